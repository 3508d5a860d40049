"""The 'pallas_tpu' route (model/flash_tpu.py: splash attention and the Pallas TPU interval kernel, in
Pallas interpret mode on CPU) equals the dense 'xla' route over the recipe's training masks, in values
and in dq, dk, dv, at Qwen3-0.6B's attention heads (16 query heads over 8 kv heads, head dim 128).

Masks, with left padding (row 1's first 44 prompt slots are padding: queries that see nothing, left
out of the comparison as in test_flash_pallas.py): SFT's causal layout, CFT's two streams (prompt |
clean | one noised segment per block of 32) and RL replay's layout (two canvases per block). The
route sends causal and two-stream masks to splash and replay to the interval kernel (checked from
the kernels in the program); the interval kernel also runs the first two. Tiles of 128, so the
two-stream layout's 192 slots are padded to 256, key tiles are skipped, full ones run unmasked and
partial ones masked. On 4 simulated
devices each call runs per row and kv head without collectives. With libtpu installed (the `aot`
extra) the kernels compile for TPU v5e and v5p compile-only topologies as Mosaic custom calls;
without it those tests skip, saying so.
"""

import os
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgr2_jax import platform
from dgr2_jax.model import attention, flash_tpu, masks, streams

B, P, R, BS, K, G, D = 2, 64, 64, 32, 8, 2, 128
PLEN = np.array([64, 20])                      # row 1: 44 slots of left padding
BLOCKS = flash_tpu.Blocks(q=128, k=128, q_dq=128, k_dq=128, q_dkv=128, k_dkv=128, splash=128)


def _layout(name, p=P, r=R, plen=PLEN):
  """(`Ranges`/`Streams`, the dense [b, N, N] mask built by masks.py, N)."""
  b = len(plen)
  valid = np.arange(p)[None] >= (p - plen)[:, None]
  if name == "causal":
    n = p + r
    kv = np.concatenate([valid, np.ones((b, r), bool)], 1)
    return masks.sequence_ranges(plen, p, n, 1), masks.sequence_mask(p, n, 1, jnp.asarray(kv)), n
  seg_block = np.arange(r // BS) if name == "two_stream" else np.repeat(np.arange(r // BS), 2)
  lay = streams.stream_layout(p, r, BS, seg_block)
  n = len(lay["kind"])
  kv = np.concatenate([valid, np.ones((b, n - p), bool)], 1)
  dense = masks.stream_mask(lay["kind"], lay["block"], lay["seg"], lay["kind"], lay["block"], lay["seg"],
                            jnp.asarray(kv))
  return streams.stream_ranges(plen, p, r, BS, seg_block), dense, n


def _rand(rs, *shape, dtype=jnp.float32):
  return jnp.asarray(rs.randn(*shape).astype(np.float32)).astype(dtype)


def _kernel(spec, kernel):
  """The route ('pallas_tpu' through attention.attend) or the interval kernel called directly."""
  if kernel == "route":
    return lambda q, k, v: attention.attend(q, k, v, spec, "pallas_tpu")
  return lambda q, k, v: flash_tpu.flash_attention(q, k, v, *attention._pallas_intervals(spec, k.shape[1]),
                                                   blocks=BLOCKS)


def _value_and_grads(route, sees, w):
  def loss(q, k, v):   # queries that see nothing are left out: 'xla' gives them the mean of v
    out = route(q, k, v)
    return jnp.sum(jnp.where(sees, out, 0.0).astype(jnp.float32) * w), out
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
  monkeypatch.setattr(flash_tpu, "DEFAULT_BLOCKS", BLOCKS)   # what the route uses: tiles of 128


@pytest.mark.parametrize("layout,kernel,expect", [
    ("causal", "route", "splash"), ("two_stream", "route", "splash"), ("replay", "route", "range_flash"),
    ("causal", "intervals", "range_flash"), ("two_stream", "intervals", "range_flash")])
def test_tpu_kernels_equal_xla_values_and_gradients(layout, kernel, expect):
  spec, dense, n = _layout(layout)
  rs = np.random.RandomState(0)
  q, k, v, w = _rand(rs, B, n, K, G, D), _rand(rs, B, n, K, D), _rand(rs, B, n, K, D), _rand(rs, B, n, K, G, D)
  sees = jnp.any(dense, -1)[:, :, None, None, None]                       # [b,N,1,1,1]
  assert not bool(jnp.all(sees)), "the layout has queries that see nothing (left padding)"
  route = _kernel(spec, kernel)
  names = set(re.findall(r"(splash_mha_\w+|range_flash_\w+)", str(jax.make_jaxpr(jax.grad(
      lambda q, k, v: jnp.sum(route(q, k, v)), argnums=(0, 1, 2)))(q, k, v))))
  assert len(names) == 3 and all(x.startswith(expect) for x in names), names   # forward, dq, dk/dv
  (_, out), grads = _value_and_grads(route, sees, w)(q, k, v)
  (_, ref_out), ref_grads = _value_and_grads(lambda q, k, v: attention.attend(q, k, v, dense, "xla"), sees, w)(q, k, v)
  np.testing.assert_allclose(np.asarray(jnp.where(sees, out, 0)), np.asarray(jnp.where(sees, ref_out, 0)), atol=2e-5)
  for name, a, b in zip(("dq", "dk", "dv"), grads, ref_grads):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, err_msg=name)
  if expect == "range_flash":                                              # seeing nothing: output 0
    assert not np.any(np.asarray(jnp.where(sees, 0, out)))


@pytest.mark.parametrize("layout", ["two_stream", "replay"])
def test_bf16_within_bf16_precision_of_xla(layout):
  spec, dense, n = _layout(layout)
  rs = np.random.RandomState(1)
  q = _rand(rs, B, n, K, G, D, dtype=jnp.bfloat16)
  k, v = _rand(rs, B, n, K, D, dtype=jnp.bfloat16), _rand(rs, B, n, K, D, dtype=jnp.bfloat16)
  w = _rand(rs, B, n, K, G, D)
  sees = jnp.any(dense, -1)[:, :, None, None, None]
  (loss, out), grads = _value_and_grads(_kernel(spec, "route"), sees, w)(q, k, v)
  (ref_loss, _), ref_grads = _value_and_grads(lambda q, k, v: attention.attend(q, k, v, dense, "xla"), sees, w)(q, k, v)
  assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=2e-2, atol=0.5)
  for a, b in zip(grads, ref_grads):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max() + 2e-2, (np.abs(a - b).max(), np.abs(b).max())


def test_key_tiles_outside_every_range_are_never_read():
  # Causal, 512 slots, tiles of 128, row 1's first 300 slots padding: its queries never see key tiles 0
  # and 1, so NaN keys and values there reach neither the output nor any gradient.
  t = 512
  lo = jnp.array([140, 300], jnp.int32)
  hi = jnp.broadcast_to(jnp.arange(1, t + 1, dtype=jnp.int32), (2, t))
  rs = np.random.RandomState(2)
  q, k, v = _rand(rs, 2, t, 1, 1, D), _rand(rs, 2, t, 1, D), _rand(rs, 2, t, 1, D)
  poison = lambda x: x.at[1, :256].set(jnp.nan)
  f = lambda q, k, v: jnp.sum(flash_tpu.flash_attention(q, k, v, lo, hi, blocks=BLOCKS))
  f = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))
  out, grads = f(q, poison(k), poison(v))
  clean, ref_grads = f(q, k, v)
  np.testing.assert_allclose(float(out), float(clean), rtol=1e-6)
  for a, b in zip(grads, ref_grads):   # dk, dv of the poisoned keys: 0, as in the clean run
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


@pytest.mark.parametrize("layout", ["two_stream", "replay"])
def test_splash_static_mask_is_the_layout(layout):
  # The NumpyMask splash compiles in equals masks.stream_mask with every key real (the left padding is
  # segment ids), and the slots that pad N to whole tiles see only themselves.
  spec, _, n = _layout(layout, plen=np.array([P]))
  lay = streams.stream_layout(P, R, BS, np.asarray(spec.segment_blocks))
  dense = masks.stream_mask(lay["kind"], lay["block"], lay["seg"], lay["kind"], lay["block"], lay["seg"],
                            jnp.ones((1, n), bool))[0]
  static = flash_tpu.stream_mask(flash_tpu.StreamLayout(P, P + R, BS, spec.segment_blocks), n + 100)
  np.testing.assert_array_equal(static[:n, :n], np.asarray(dense))
  np.testing.assert_array_equal(static[n:], np.eye(n + 100, dtype=bool)[n:])
  assert not static[:n, n:].any()


def test_auto_on_a_tpu_takes_the_tpu_kernels_and_no_gpu_kernel():
  lo = jnp.zeros((1,), jnp.int32)
  window = attention.Ranges(lo, jnp.full((1, 32), 100, jnp.int32))                   # a decode window
  prefill = attention.Ranges(lo, jnp.arange(1, 33, dtype=jnp.int32)[None], causal=True)
  spec, _, n = _layout("two_stream")
  assert attention.auto_impl(32, 3224, window, "tpu") == "xla"
  assert attention.auto_impl(32, 3224, prefill, "tpu") == "pallas_tpu"
  assert attention.auto_impl(n, n, spec, "tpu") == "pallas_tpu"
  q, kv = jnp.zeros((1, 32, 1, 1, D)), jnp.zeros((1, 32, 1, D))
  with platform.target("tpu"):
    for impl in attention.GPU_ONLY:
      with pytest.raises(ValueError, match=f"attention_impl='{impl}' is a GPU kernel") as e:
        attention.attend(q, kv, kv, prefill, impl)
      assert "\n" not in str(e.value)


_MESH_CHILD = r"""
import sys
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from dgr2_jax.model import attention, flash_tpu, streams
assert jax.device_count() == 4, jax.devices()
flash_tpu.DEFAULT_BLOCKS = flash_tpu.Blocks(128, 128, 128, 128, 128, 128, 128)
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "tensor"))
rs = np.random.RandomState(0)
b, kh, g, d, p, r, bs = 4, 2, 2, 128, 64, 64, 32
ns = lambda *a: NamedSharding(mesh, P(*a))
sq, skv = ns("data", None, "tensor", None, None), ns("data", None, "tensor", None)
for cap in (1, 2):   # CFT's two streams (splash), replay (the interval kernel)
  spec = streams.stream_ranges(np.array([64, 10, 33, 50]), p, r, bs, np.repeat(np.arange(r // bs), cap))
  n = p + r + cap * r
  q = jax.device_put(jnp.asarray(rs.randn(b, n, kh, g, d), jnp.float32), sq)
  k, v = (jax.device_put(jnp.asarray(rs.randn(b, n, kh, d), jnp.float32), skv) for _ in range(2))
  lo1, hi1, lo2, hi2 = attention._pallas_intervals(spec, n)
  sees = ((hi1 > lo1) | (hi2 > lo2))[:, :, None, None, None]
  # rows that see nothing: 'xla' sends their cotangent to v through a uniform softmax; zero it
  ct = jax.device_put(jnp.where(sees, jnp.asarray(rs.randn(b, n, kh, g, d), jnp.float32), 0.0), sq)

  def vjp(q, k, v, ct, impl="pallas_tpu"):
    out, pull = jax.vjp(lambda *a: attention.attend(*a, spec, impl), q, k, v)
    return (out,) + pull(ct)

  compiled = jax.jit(vjp).lower(q, k, v, ct).compile()
  text = compiled.as_text()
  for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce"):
    assert op not in text, op
  got = compiled(q, k, v, ct)
  ref = jax.jit(lambda *a: vjp(*a, impl="xla"))(q, k, v, ct)
  errs = [float(jnp.max(jnp.abs(jnp.where(sees, got[0] - ref[0], 0))))]
  errs += [float(jnp.max(jnp.abs(a - b))) for a, b in zip(got[1:], ref[1:])]
  assert max(errs) < 2e-5, errs
  print("OK", cap, errs)
"""


def test_on_a_mesh_each_device_runs_its_rows_and_kv_heads():
  """Rows over `data` (2), kv heads over `tensor` (2) on 4 simulated devices (a subprocess: the
  device count is set before jax starts), arrays carrying their NamedShardings as a training step's
  do: splash (two streams) and the interval kernel (replay) run per device under shard_map, with no
  collective in the program, and the output and dq, dk, dv equal 'xla'."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _MESH_CHILD, repo], env=env, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0 and proc.stdout.count("OK") == 2, proc.stdout + proc.stderr[-3000:]


def _tpu_devices(topology: str):
  """Compile-only TPU devices of `topology`, or a skip saying what is missing."""
  try:
    from jax.experimental import topologies
    return topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
  except Exception as e:  # pylint: disable=broad-except  (no libtpu: ImportError / RuntimeError / JaxRuntimeError)
    pytest.skip(f"no TPU compiler here ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
                f"pip install -e \".[aot]\" (jax[tpu]) to compile for TPUs")


@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1"])
def test_kernels_compile_for_tpu_as_mosaic_calls(topology):
  """Qwen3-0.6B attention (8 kv heads, 16 query heads, head dim 128, bf16) on a 2x2 slice, rows over
  `data` and kv heads over `tensor`: the gradient of 'auto' over the causal, two-stream and replay
  masks compiles for the TPU with each kernel a Mosaic custom call (splash forward, dq, dk/dv; the
  interval kernel's three), no interpret-mode loop and no collective."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as Ps
  devices = _tpu_devices(topology)
  mesh = Mesh(np.asarray(devices).reshape(2, 2), ("data", "tensor"))
  p, r, plen = 384, 128, np.array([380, 100])
  specs = [_layout(name, p, r, plen)[::2] for name in ("causal", "two_stream", "replay")]

  def grads(*qkv):
    loss = lambda *a: sum(jnp.sum(attention.attend(*a[3 * i:3 * i + 3], spec, "auto").astype(jnp.float32))
                          for i, (spec, _) in enumerate(specs))
    return jax.grad(loss, argnums=tuple(range(len(qkv))))(*qkv)

  ns = lambda *a: NamedSharding(mesh, Ps(*a))
  args = []
  for _, n in specs:
    args += [jax.ShapeDtypeStruct((2, n, 8, 2, 128), jnp.bfloat16, sharding=ns("data", None, "tensor", None, None))]
    args += [jax.ShapeDtypeStruct((2, n, 8, 128), jnp.bfloat16, sharding=ns("data", None, "tensor", None))] * 2
  start = time.time()
  with platform.target("tpu", devices=devices):
    compiled = jax.jit(grads).lower(*args).compile()
  text = compiled.as_text()
  calls = re.findall(r'custom_call_target="([^"]+)"', text)
  assert calls.count("tpu_custom_call") == 9 and set(calls) == {"tpu_custom_call"}, calls
  for kernel in ("splash_mha_fwd", "splash_mha_dq", "splash_mha_dkv", "range_flash_forward_tpu",
                 "range_flash_dq_tpu", "range_flash_dkv_tpu"):
    assert kernel in text, kernel
  assert "while" not in text      # interpret mode leaves loops (or their unrolled ops' `while/body` metadata)
  for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce"):
    assert op not in text, op
  print(f"{topology}: compiled in {time.time() - start:.1f}s, {len(calls)} Mosaic calls")
