"""The training loop: gradient accumulation, NaN guard, resume after SIGKILL (exact continuation)."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from dgr2_jax.model import qwen3
from dgr2_jax.model.config import Qwen3Config
from dgr2_jax.train import checkpoint as ckpt_lib
from dgr2_jax.train import config as train_config_lib
from dgr2_jax.train import loop, losses, mesh as mesh_lib, optim, synthetic

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)


_PARAMS = None


def _params():
  """Tiny model parameters, initialised once per module (one compile)."""
  global _PARAMS
  if _PARAMS is None:
    _PARAMS = jax.device_get(jax.jit(lambda r: qwen3.init_params(CFG, r))(jax.random.PRNGKey(0)))
  return _PARAMS


def _config(**train):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.train = train_config_lib.train_config()
  c.train.tensorboard = False
  c.train.optimizer.warmup_steps = 2
  c.train.optimizer.peak_lr = 1e-2
  c.train.update(train)
  return c


def _sft(p, b, r):
  del r
  return losses.sft_loss(CFG, p, b, reasoning_weight=0.5, answer_weight=2.0)


def test_grad_accumulation_equals_big_batch():
  """One step with 4 micro-batches of 2 == one step with the batch of 8 (loss, metrics, params)."""
  c = _config(batch_size=8)
  mesh = mesh_lib.make_mesh(c.train.mesh, jax.devices()[:1])
  opt, sched = optim.make_optimizer(c.train.optimizer, c.train.total_steps)
  shapes, shardings = loop.state_shardings(_params(), opt, mesh,
                                           c.train.logical_axis_rules)
  batch = synthetic.SyntheticSFTIterator(8, 5, 9, CFG.vocab_size, seed=7).batch(0)
  out = {}
  for k in (1, 4):
    state = loop.init_state(_params(), opt, shardings, 0, jnp.float32)
    step = jax.jit(loop.make_train_step(_sft, opt, sched, k))
    state, _ = step(state, batch)  # step 0 has lr 0 (warmup); compare after the second update
    state, m = step(state, batch)
    out[k] = (jax.device_get(state["params"]), jax.device_get(m))
  (p1, m1), (p4, m4) = out[1], out[4]
  assert set(m1) == set(m4) and "denominator" not in m1
  # The loss is combined exactly; other metrics are denominator-weighted means of micro-batch values.
  for name in ("loss", "grad_norm", "lr"):
    np.testing.assert_allclose(m4[name], m1[name], rtol=1e-5, atol=1e-6, err_msg=name)
  moved = 0.0
  for a, b, p0 in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(p4),
                      jax.tree_util.tree_leaves(_params())):
    np.testing.assert_allclose(b, a, atol=1e-5)
    moved = max(moved, float(np.abs(a - p0).max()))
  assert moved > 1e-3  # the update really happened


def test_micro_batches_without_a_loss_token_are_skipped_exactly():
  """Gradient accumulation skips a micro-batch whose loss_mask is all 0 (its forward never runs: a
  host callback counts the forwards) and the step equals the same step without that micro-batch."""
  calls = []

  def loss_fn(p, b, r):
    del r
    jax.debug.callback(lambda: calls.append(1))
    m = b["loss_mask"].astype(jnp.float32)
    err = (b["x"] @ p["w"] - b["y"]) ** 2                                  # [rows, 3]
    denom = jnp.sum(m)
    return jnp.sum(m * err) / jnp.maximum(denom, 1.0), {"denominator": denom, "tokens": denom}

  rs = np.random.RandomState(0)
  params = {"w": jnp.asarray(rs.randn(4, 3), jnp.float32)}
  batch = {"x": rs.randn(8, 4).astype(np.float32), "y": rs.randn(8, 3).astype(np.float32),
           "loss_mask": np.ones((8, 3), np.int32)}
  batch["loss_mask"][1::4] = 0                  # micro-batch 1 of 4 (loop._split_micro: rows 1, 5)
  kept = {k: np.delete(v, [1, 5], axis=0) for k, v in batch.items()}
  opt, sched = optax.sgd(0.1), optax.constant_schedule(0.1)
  state = {"params": params, "opt_state": opt.init(params), "step": jnp.zeros((), jnp.int32),
           "rng": jax.random.PRNGKey(0)}
  skipped, m4 = jax.jit(loop.make_train_step(loss_fn, opt, sched, 4))(state, batch)
  jax.block_until_ready(skipped)
  assert len(calls) == 3                          # 4 micro-batches, 3 forwards run
  whole, m1 = jax.jit(loop.make_train_step(loss_fn, opt, sched, 1))(state, kept)
  np.testing.assert_allclose(skipped["params"]["w"], whole["params"]["w"], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(m4["loss"], m1["loss"], rtol=1e-6)
  assert not np.allclose(skipped["params"]["w"], params["w"])   # the update happened


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
  def bad_loss(p, b, r):
    loss, m = _sft(p, b, r)
    return jnp.where(jnp.any(b["example_id"] >= 16), jnp.nan, loss), m  # batch index 2 = step 3

  c = _config(batch_size=8, total_steps=6, checkpoint_every=2, async_checkpointing=True)
  it = synthetic.SyntheticSFTIterator(8, 4, 6, CFG.vocab_size, seed=1)
  with pytest.raises(FloatingPointError, match=r"loss is nan at step 3 .*Last good checkpoint: step 2"):
    loop.train(c, str(tmp_path), params=_params(), loss_fn=bad_loss, batch_iter=it)
  mgr = ckpt_lib.make_manager(str(tmp_path), 2)
  assert mgr.all_steps() == [2]
  state, data, _ = ckpt_lib.restore(mgr, 2)
  assert data == {"index": 2} and int(state["step"]) == 2
  assert all(np.isfinite(x).all() for x in jax.tree_util.tree_leaves(state["params"]))
  lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [l["step"] for l in lines] == [1, 2, 3] and lines[-1]["loss"] == "nan"


_CHILD = r"""
import json, os, sys, time
import jax, ml_collections, numpy as np
sys.path.insert(0, {repo!r})
from dgr2_jax.model import qwen3
from dgr2_jax.model.config import Qwen3Config
from dgr2_jax.train import config as tcl, loop, losses, synthetic
args = json.loads(sys.argv[1])
cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)
c = ml_collections.ConfigDict(); c.seed = 3; c.train = tcl.train_config()
c.train.update(dict(total_steps=args["total"], batch_size=4, checkpoint_every=2, keep_checkpoints=2,
                    tensorboard=False, grad_accum_steps=2))
c.train.optimizer.warmup_steps = 2; c.train.optimizer.peak_lr = 1e-2

class Slow(synthetic.SyntheticSFTIterator):
  def __next__(self):
    time.sleep(args["sleep"])
    return super().__next__()

ck = os.path.join(args["workdir"], "checkpoints")
before = sorted(int(d) for d in os.listdir(ck) if d.isdigit()) if os.path.isdir(ck) else []
st = loop.train(c, args["workdir"], params=lambda r: qwen3.init_params(cfg, r),
                loss_fn=lambda p, b, r: losses.sft_loss(cfg, p, b), batch_iter=Slow(4, 4, 6, 64, seed=5))
leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(st["params"]))
np.savez(os.path.join(args["workdir"], "final.npz"), **{{jax.tree_util.keystr(k): v for k, v in leaves}})
print("RESULT", json.dumps({{"before": before, "step": int(st["step"])}}))
"""


def _child(workdir, total, sleep, env):
  code = _CHILD.format(repo=REPO_ROOT)
  return subprocess.Popen([sys.executable, "-c", code,
                           json.dumps(dict(workdir=str(workdir), total=total, sleep=sleep))],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc):
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-3000:]
  return json.loads(out.split("RESULT", 1)[1])


def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path):
  total = 10
  # Children share a persistent compilation cache: the first compiles, the others load.
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  full = _result(_child(tmp_path / "full", total, 0.0, env))
  killed = _child(tmp_path / "resumed", total, 0.4, env)
  metrics = tmp_path / "resumed" / "metrics.jsonl"
  deadline = time.time() + 240
  while time.time() < deadline and killed.poll() is None:
    if metrics.exists() and any(json.loads(l)["step"] >= 6 for l in open(metrics) if l.strip()):
      break
    time.sleep(0.1)
  assert killed.poll() is None, "the run finished before it could be killed: " + killed.communicate()[1][-2000:]
  os.kill(killed.pid, signal.SIGKILL)
  killed.wait()
  resumed = _result(_child(tmp_path / "resumed", total, 0.0, env))
  assert resumed["before"] and 2 <= resumed["before"][-1] < total, resumed  # it resumed mid-run
  assert resumed["step"] == total and full["step"] == total
  a, b = np.load(tmp_path / "full" / "final.npz"), np.load(tmp_path / "resumed" / "final.npz")
  assert sorted(a.files) == sorted(b.files) and len(a.files) > 10
  for k in a.files:
    np.testing.assert_array_equal(b[k], a[k], err_msg=k)
  steps = [json.loads(l)["step"] for l in open(metrics)]
  assert steps == list(range(1, total + 1)), steps  # history rewound to the checkpoint, no duplicates
