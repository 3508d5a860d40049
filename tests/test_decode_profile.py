"""benchmarks/decode_profile.py's reading of a profile: which ops of a compiled program run inside
its loop, the group each belongs to by its name, which trace events count (the device's, once),
and the launch gaps between a loop's ops. Small programs and synthetic traces; no profiler run."""

import os
import sys

import jax
import jax.numpy as jnp
import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
import decode_profile as dp  # noqa: E402


def _program():
  def f(w, x, n):
    with jax.named_scope("Qwen3/norm"):
      x = x * jax.lax.rsqrt(jnp.mean(x * x) + 1e-6)

    def body(c):
      i, y = c
      with jax.named_scope("Qwen3/layers_0/mlp"):
        y = jnp.tanh(y @ w)
      with jax.named_scope("Qwen3/layers_0/self_attn/k_norm"):
        y = y * jax.lax.rsqrt(jnp.mean(y * y) + 1e-6)
      return i + 1, y
    return jax.lax.while_loop(lambda c: c[0] < n, body, (0, x))[1]
  hlo = jax.jit(f).lower(jnp.ones((8, 8)), jnp.ones((2, 8)), 3).compile().as_text()
  return dp.Program(hlo)


def test_loop_ops_and_their_groups():
  prog = _program()
  loop = {op: prog.group_of(op) for op in prog.insts if prog.where(op) == "loop"}
  outside = [op for op in prog.insts if prog.where(op) == "prefill"]
  assert "mlp" in loop.values() and "norms" in loop.values(), loop
  assert outside and all("while" not in prog.op_name(op) for op in outside)
  assert {prog.where(op) for op in prog.insts if prog.insts[op]["opcode"] == "while"} == {"container"}
  assert prog.where("no_such_op") == "unmatched"


def test_a_gpu_kernel_name_resolves_to_its_instruction():
  prog = _program()
  name = next(op for op in prog.insts if "." in op and prog.where(op) == "loop")
  kernel = name.replace(".", "_").replace("-", "_")
  assert prog.resolve(kernel) == name and prog.where(kernel) == "loop"


@pytest.mark.parametrize("op_name,group", [
    ("jit(decode)/while/body/while/body/closed_call/Qwen3/layers_3/self_attn/q_norm/mul", "norms"),
    ("jit(decode)/while/body/while/body/closed_call/Qwen3/layers_3/self_attn/q_proj/dot_general", "projections"),
    ("jit(decode)/while/body/while/body/closed_call/Qwen3/layers_3/self_attn/dot_general", "projections"),
    ("jit(decode)/while/body/while/body/closed_call/Qwen3/layers_3/mlp/down_proj/dot_general", "mlp"),
    ("jit(decode)/while/body/while/body/closed_call/Qwen3/cos", "rope"),
    ("jit(decode)/while/body/while/body/closed_call/Qwen3/layers_3/self_attn/vmap(vmap())/scatter", "kv_cache"),
    ("jit(decode)/while/body/while/body/closed_call/Qwen3/layers_3/self_attn/pallas_call", "attention"),
    ("jit(decode)/while/body/while/body/closed_call/Qwen3/layers_3/self_attn/reduce_max", "attention"),
    ("jit(decode)/while/body/while/body/closed_call/dot_general", "lm_head"),
    ("jit(decode)/while/body/while/body/closed_call/exp", "choose"),
    ("jit(decode)/while/body/while/body/closed_call/jit(_where)/select_n", "rest")])
def test_groups_by_name(op_name, group):
  assert dp.classify(op_name) == group


def _ev(name, ts, dur, pid=1, tid=1, **args):
  return dict(ph="X", name=name, ts=ts, dur=dur, pid=pid, tid=tid, args=args)


def test_events_on_the_device_are_counted_once():
  meta = [dict(ph="M", name="process_name", pid=1, args=dict(name="/host:CPU")),
          dict(ph="M", name="process_name", pid=2, args=dict(name="/device:GPU:0")),
          dict(ph="M", name="thread_name", pid=2, tid=7, args=dict(name="Stream #7")),
          dict(ph="M", name="thread_name", pid=2, tid=9, args=dict(name="XLA Ops"))]
  host = [_ev("fusion.1", 0, 5, hlo_op="fusion.1"), _ev("end: fusion.1", 5, 1, _src="x"), _ev("$python", 0, 50)]
  stream = [_ev("fusion_1", 10, 3, pid=2, tid=7), _ev("fusion_2", 14, 4, pid=2, tid=7)]
  assert [e["op"] for e in dp.op_events(meta + host)] == ["fusion.1"]
  assert [e["op"] for e in dp.op_events(meta + host + stream)] == ["fusion_1", "fusion_2"]
  xla_ops = [_ev("fusion.1", 10, 3, pid=2, tid=9, hlo_op="fusion.1")]
  assert [e["op"] for e in dp.op_events(meta + host + stream + xla_ops)] == ["fusion.1"]


def test_launch_gaps_sum_the_idle_time_between_loop_ops():
  lane = (2, 7)
  ops = [dict(op="a", ts=0.0, dur=10.0, lane=lane), dict(op="b", ts=12.0, dur=5.0, lane=lane),
         dict(op="prefill", ts=18.0, dur=1.0, lane=lane), dict(op="a", ts=20.0, dur=10.0, lane=lane),
         dict(op="a", ts=1e6, dur=10.0, lane=lane),            # the next call: not a gap inside a loop
         dict(op="b", ts=1e6 + 13, dur=1.0, lane=(1, 1))]      # another lane
  # gaps: 10 -> 12 (2) and 17 -> 20 (3), over 1 call of 1 iteration
  assert dp.launch_gaps(ops, {"a", "b"}, calls=1, iterations=1) == pytest.approx(5.0)
  assert dp.launch_gaps(ops, {"a", "b"}, calls=1, iterations=5) == pytest.approx(1.0)
  assert dp.launch_gaps(ops, set(), calls=1, iterations=1) == 0.0
