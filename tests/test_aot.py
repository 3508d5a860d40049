"""Compile-only targets (dgr2_jax/aot): targets resolve by name, an unknown one or a missing compiler
is one line naming the fix, every route choice and mesh follows the platform built for (never the
host), and the one HLO reader reads compiled programs (memory, FLOPs, loops, collectives, custom
calls).

The tests marked `gpu_compiler` / `tpu_compiler` compile for an H100 mesh and a TPU v5e slice; they
need the compilers of `pip install -e ".[aot]"` and skip without them (the README's test command
installs no extra; .ci/run does). Everything else runs on the CPU suite. Shapes are tiny: what is
checked is which program comes out, not its speed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dgr2_jax import platform
from dgr2_jax.aot import hlo, targets
from dgr2_jax.decode import mesh as dmesh
from dgr2_jax.decode import sampler
from dgr2_jax.model import attention, decode_attention, masks
from dgr2_jax.train import mesh as train_mesh

sd = jax.ShapeDtypeStruct
_HAVE = {b: targets.available(b) for b in ("gpu", "tpu")}
gpu_compiler = pytest.mark.skipif(not _HAVE["gpu"], reason=f"no GPU compiler here: {targets.AOT_EXTRA} installs it")
tpu_compiler = pytest.mark.skipif(not _HAVE["tpu"], reason=f"no TPU compiler here: {targets.AOT_EXTRA} installs it")


# ---- targets -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,backend,devices,processes,topology", [
    ("h100", "gpu", 1, 1, "1x1x1"), ("h100x8", "gpu", 8, 1, "1x1x8"), ("h200x8", "gpu", 8, 1, "1x1x8"),
    ("h100x8x2", "gpu", 16, 2, "2x1x8"), ("v5e-4", "tpu", 4, 1, "v5e:2x2"), ("v5e-32", "tpu", 32, 8, "v5e:4x8"),
    ("v5p-8", "tpu", 4, 1, "v5p:2x2x1"), ("v5p-16", "tpu", 8, 2, "v5p:2x2x2"), ("v6e-8", "tpu", 8, 1, "v6e:2x4"),
    ("v5p:2x2x4", "tpu", 16, 4, "v5p:2x2x4")])
def test_targets_resolve(name, backend, devices, processes, topology):
  t = targets.resolve(name)
  assert (t.backend, t.num_devices, t.processes, t.topology) == (backend, devices, processes, topology)
  assert t.devices_per_process * t.processes == t.num_devices
  assert t.memory_bytes > 15 * 2**30 and t.peak_bf16_flops > 1e14 and t.hbm_bytes_per_s > 5e11
  assert (t.sms == 132) == (backend == "gpu")


def test_gpu_target_figures_come_from_the_shipped_descriptions():
  h100, h200 = targets.resolve("h100"), targets.resolve("h200x8")
  assert h100.memory_bytes == 84978434048 and h100.hbm_bytes_per_s == 3.35232e12
  assert h200.memory_bytes > 140 * 2**30 and h200.hbm_bytes_per_s == 4.8e12
  for chip in ("h100", "h200"):
    assert "cuda_compute_capability { major: 9 minor: 0 }" in targets.gpu_spec(chip)


@pytest.mark.parametrize("name", ["a100x8", "v5e-3", "v5p-4", "h100x9", "v5p:2x2", "tpu"])
def test_unknown_target_is_one_line_naming_the_known(name):
  with pytest.raises(targets.TargetError) as e:
    targets.resolve(name)
  msg = str(e.value)
  assert "\n" not in msg and repr(name) in msg and "known targets: h100," in msg and "v5p-16" in msg


@pytest.mark.parametrize("name,error", [("v5e-4", RuntimeError("JAX TPU support not installed; cannot generate "
                                                                "TPU topology. See https://...")),
                                        ("h100x2", NotImplementedError("topology not implemented for cuda"))])
def test_missing_compiler_is_one_line_naming_the_extra(monkeypatch, name, error):
  """What jax raises without libtpu / the CUDA plugin becomes one line naming the extra."""
  from jax.experimental import topologies

  def missing(*a, **k):
    raise error
  monkeypatch.setattr(topologies, "get_topology_desc", missing)
  targets._topology_devices.cache_clear()
  try:
    with pytest.raises(targets.TargetError) as e:
      targets.devices(name)
  finally:
    targets._topology_devices.cache_clear()
  msg = str(e.value)
  assert "\n" not in msg and name in msg and 'pip install -e ".[aot]"' in msg


# ---- route choices follow the platform built for (no compiler needed: lowered only) -------------------
def test_host_is_the_default_platform():
  assert platform.current() is None and platform.backend() == jax.default_backend() == "cpu"
  assert platform.devices() == jax.devices() and platform.process_count() == jax.process_count()
  assert not platform.interpret_pallas("cpu") and platform.interpret_pallas("gpu")


def test_route_choices_follow_the_target():
  window = attention.Ranges(jnp.zeros((1,), jnp.int32), jnp.full((1, 32), 40, jnp.int32))
  causal = masks.sequence_ranges(np.array([60]), 32, 64, 1)
  assert attention.auto_impl(32, 64, window, platform.backend()) == "blockwise"
  assert sampler.resolve_kv_write("auto", 1) == "separate"
  assert decode_attention.num_sms() == decode_attention.DEFAULT_SMS
  with platform.target("gpu", sms=114, name="h100-pcie-like"):
    assert platform.backend() == "gpu" and not platform.interpret_pallas("gpu")
    assert attention.auto_impl(32, 64, window, platform.backend()) == "splitkey"
    assert attention.auto_impl(64, 64, causal, platform.backend()) == "cudnn"
    assert sampler.resolve_kv_write("auto", 1) == "fused" and decode_attention.num_sms() == 114
  with platform.target("tpu"):
    assert platform.interpret_pallas("gpu") and not platform.interpret_pallas("tpu")
    assert sampler.resolve_kv_write("auto", 1) == "fused"
  assert platform.backend() == "cpu" and sampler.resolve_kv_write("auto", 1) == "separate"


def test_gpu_target_lowers_kernels_not_interpret_loops_and_retraces():
  """The same jitted 'auto' attention, lowered for CUDA: on the host's platform the split-key kernel
  runs in Pallas interpret mode (a while loop, no kernel); for a GPU target the Triton kernel, with
  no loop. The target is part of jit's cache key: the host's trace is not reused, nor the other way."""
  b, t, s, kh, g, d = 1, 32, 64, 2, 2, 16
  args = (sd((b, t, kh, g, d), jnp.bfloat16), sd((b, s, kh, d), jnp.bfloat16), sd((b, s, kh, d), jnp.bfloat16),
          sd((b,), jnp.int32), sd((b, t), jnp.int32))
  fn = jax.jit(lambda q, k, v, lo, hi: attention.attend(q, k, v, attention.Ranges(lo, hi), "splitkey"))
  lowered = lambda: fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  host = lowered()
  with platform.target("gpu", sms=132):
    gpu = lowered()
  assert "stablehlo.while" in host and "split_key_decode_attention" not in host
  assert "split_key_decode_attention" in gpu and "stablehlo.while" not in gpu
  assert lowered() == host


# ---- the HLO reader on the host ------------------------------------------------------------------------
def test_reader_on_a_cpu_program():
  def f(w, x, n):
    def body(c):
      i, y = c
      y = jax.lax.fori_loop(0, 4, lambda _, z: jnp.tanh(z @ w), y)
      return i + 1, jax.lax.cond(y.sum() > 0, lambda: y * 2, lambda: y)
    return jax.lax.while_loop(lambda c: c[0] < n, body, (0, x))[1]
  prog = hlo.compile_program(jax.jit(f), sd((16, 16), jnp.float32), sd((4, 16), jnp.float32), sd((), jnp.int32),
                             name="loop")
  assert prog.platform == "cpu" and prog.target == "" and prog.devices == 1 and prog.name == "loop"
  assert prog.memory.arguments == (16 * 16 + 4 * 16) * 4 + 4 and prog.memory.peak >= prog.memory.arguments
  assert prog.flops > 0 and prog.bytes_accessed > 0 and prog.cost_source == "backend" and prog.compile_s > 0
  outer = [l for l in prog.loops() if l.trip_count is None]
  assert len(outer) == 1 and outer[0].conditionals == 1
  assert hlo.host_predicates(prog.text, outer[0]) == 2   # its own predicate + the cond's
  assert prog.collectives == [] and prog.row()["memory"]["peak"] == prog.memory.peak


def test_collective_reader_on_known_text():
  text = """HloModule m

%body (p: (s32[], bf16[8,4])) -> (s32[], bf16[8,4]) {
  %p = (s32[], bf16[8,4]) parameter(0)
  %x = bf16[8,4]{1,0} get-tuple-element(%p), index=1
  %ag = bf16[16,4]{1,0} all-gather(%x), channel_id=1, replica_groups={{0,1}}, dimensions={0}
  %s = bf16[8,4]{1,0} slice(%ag), slice={[0:8], [0:4]}
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], bf16[8,4]) tuple(%i, %s)
}

%cond (p: (s32[], bf16[8,4])) -> pred[] {
  %p = (s32[], bf16[8,4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %c = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

ENTRY %main (a: bf16[8,4]) -> bf16[8,4] {
  %a = bf16[8,4]{1,0} parameter(0)
  %rs = ((bf16[8,4]{1,0}), bf16[4,4]{1,0}) reduce-scatter-start(%a), replica_groups=[1,2]<=[2], dimensions={0}
  %rd = bf16[4,4]{1,0} reduce-scatter-done(%rs)
  %k = s32[] constant(0)
  %t = (s32[], bf16[8,4]) tuple(%k, %a)
  %w = (s32[], bf16[8,4]) while(%t), condition=%cond, body=%body
  %cc = bf16[8,4]{1,0} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton"
  ROOT %r = bf16[8,4]{1,0} get-tuple-element(%w), index=1
}
"""
  found = {c.op: c for c in hlo.collectives(text)}
  assert set(found) == {"all-gather", "reduce-scatter"}
  gather = found["all-gather"]
  assert (gather.shape, gather.bytes, gather.in_loop) == ("bf16[16,4]", 128, True)
  assert found["all-gather"].groups == "{{0,1}}"
  assert (found["reduce-scatter"].shape, found["reduce-scatter"].in_loop) == ("bf16[4,4]", False)
  assert found["reduce-scatter"].groups == "[1,2]<=[2]"
  assert hlo.custom_calls(text) == {"__gpu$xla.gpu.triton": 1}
  assert [l.name for l in hlo.loops(text)] == ["w"]


# ---- compiled for a GPU mesh and a TPU slice (the aot extra) ------------------------------------------
def _matmuls(name):
  """A bf16 matmul on one device, and one contracted over a 2-device (or slice-wide) mesh: an
  all-reduce (replicated result) and a reduce-scatter (sharded result)."""
  one = sd((256, 256), jnp.bfloat16)
  progs = [hlo.compile_program(jax.jit(lambda a, b: a @ b), one, one, target=name, name="matmul")]
  with targets.compile_for(name):
    mesh = Mesh(np.asarray(platform.devices()), ("x",))
    a = sd((256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "x")))
    b = sd((512, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("x", None)))
    for out in (P(), P("x", None)):
      progs.append(hlo.compile_program(jax.jit(lambda a, b: a @ b, out_shardings=NamedSharding(mesh, out)), a, b,
                                       name=f"sharded {out}"))
  return progs


@gpu_compiler
def test_gpu_compile_reads_memory_collectives_and_kernels():
  single, reduced, scattered = _matmuls("h100x2")
  assert (single.platform, single.target, single.devices, reduced.devices) == ("gpu", "h100x2", 1, 2)
  assert single.memory.arguments == 2 * 256 * 256 * 2 and single.memory.outputs == 256 * 256 * 2
  assert single.cost_source == "hlo cost analysis" and single.flops >= 2 * 256 ** 3
  assert any("gemm" in k for k in single.custom_fusions), single.custom_fusions   # XLA's Triton GEMM
  assert [(c.op, c.shape, c.in_loop) for c in reduced.collectives] == [("all-reduce", "bf16[256,256]", False)]
  assert [(c.op, c.shape) for c in scattered.collectives] == [("reduce-scatter", "bf16[128,256]")]
  assert scattered.memory.outputs == 128 * 256 * 2


@tpu_compiler
def test_tpu_compile_reads_memory_collectives():
  single, reduced, scattered = _matmuls("v5e-4")
  assert (single.platform, reduced.devices, single.cost_source) == ("tpu", 4, "backend")
  assert single.memory.arguments == 2 * 256 * 256 * 2 and single.flops >= 2 * 256 ** 3
  assert {c.op for c in reduced.collectives} == {"all-reduce"} and scattered.memory.outputs == 64 * 256 * 2


@tpu_compiler
@pytest.mark.parametrize("name", ["v4-8", "v5e-4", "v5p-8", "v6e-8"])
def test_tpu_memory_is_what_the_compiler_gives_a_program(name):
  """A chip's memory in targets.CHIPS is the HBM XLA:TPU says is available, read from its refusal of
  a program that needs more (fourteen 8 GB arrays alive at once)."""
  import re
  t = targets.resolve(name)
  with targets.compile_for(t):
    outer = lambda x, i: x[:, None] * x[None, :] * (i + 1.5)
    big = jax.jit(lambda x: jnp.sort(jnp.stack([outer(x, i) for i in range(14)]), axis=0)[3].sum())
    with pytest.raises(Exception, match="exceeds available HBM") as e:
      hlo.compile_program(big, sd((46_000,), jnp.float32), name="too big")
  available = float(re.search(r"exceeds available HBM \((\d+(?:\.\d+)?)G\)", str(e.value)).group(1))
  assert abs(t.memory_bytes / 2**30 - available) < 0.01, (name, t.memory_bytes / 2**30, available)


@gpu_compiler
def test_compiled_gpu_programs_hold_the_targets_kernels():
  """No monkeypatch: inside the H100 target 'auto' takes cuDNN for training attention (forward and
  backward) and the split-key Triton kernel for a decode window, and 'pallas' compiles its three
  Triton kernels; none of them leaves an interpret-mode loop. The same 'pallas' program built for
  the host runs in interpret mode (while loops, no kernel)."""
  b, t, kh, g, d = 1, 128, 2, 2, 64
  q, kv = sd((b, t, kh, g, d), jnp.bfloat16), sd((b, t, kh, d), jnp.bfloat16)
  causal = masks.sequence_ranges(np.array([100]), 64, t, 1)
  grad = lambda impl: jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention.attend(q, k, v, causal, impl)
                                                                 .astype(jnp.float32)), argnums=(0, 1, 2)))
  cudnn = hlo.compile_program(grad("auto"), q, kv, kv, target="h100")
  assert cudnn.custom_calls == {"__cudnn$fmhaSoftmax": 1, "__cudnn$fmhaSoftmaxBackward": 1}
  pallas = hlo.compile_program(grad("pallas"), q, kv, kv, target="h100")
  assert pallas.custom_calls == {"__gpu$xla.gpu.triton": 3} and pallas.loops() == []
  window = attention.Ranges(jnp.zeros((b,), jnp.int32), jnp.full((b, 32), 100, jnp.int32))
  split = hlo.compile_program(jax.jit(lambda q, k, v: attention.attend(q, k, v, window, "auto")),
                              sd((b, 32, kh, g, d), jnp.bfloat16), kv, kv, target="h100")
  assert split.custom_calls == {"__gpu$xla.gpu.triton": 1} and split.loops() == []
  host = hlo.compile_program(grad("pallas"), q, kv, kv)
  assert host.platform == "cpu" and host.custom_calls == {} and len(host.loops()) > 0


@gpu_compiler
def test_multi_host_gpu_target_meshes():
  """h100x8x2: every host's devices, two processes; the training mesh spans all 16, the decode mesh
  its data x tensor, and a batch that does not split over the two processes is refused."""
  with targets.compile_for("h100x8x2") as t:
    assert len(platform.devices()) == 16 and platform.process_count() == 2 == t.processes
    mesh = train_mesh.make_mesh({"data": -1, "fsdp": 1, "tensor": 8})
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 8}
    assert {d.process_index for d in mesh.devices[0].flat} == {0}, "a tensor group stays on one host"
    assert dmesh.from_config({"decode": {"mesh": {"data": -1, "tensor": 8}}}).devices.shape == (2, 8)
    with pytest.raises(ValueError, match="process count"):
      train_mesh.check_batch_size(3, {"data": -1, "fsdp": 1, "tensor": 1}, 16, platform.process_count())
