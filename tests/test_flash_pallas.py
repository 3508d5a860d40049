"""The 'pallas' route (model/flash_pallas.py, Pallas interpret mode on CPU) equals the dense 'xla'
route over the recipe's training masks, in values and in dq, dk, dv.

Masks, with left padding (row 1's first 14 prompt slots are padding: queries that see nothing):
SFT's causal layout; CFT's two streams (prompt | clean | one noised segment per block of 8, each
block-bidirectional and reading the clean blocks before it); RL replay's layout (two canvases per
block). Tiles of 16 and 32 in mixed combinations, so key tiles are skipped, full tiles run
unmasked, partial ones masked, and the last tiles are padded. At model level the CFT and SFT
losses and their parameter gradients equal 'xla's. On a simulated 4-device mesh the calls run per
row and kv head without collectives. The kernels lower for a GPU (Triton) from shapes at
Qwen3-0.6B's and 8B's attention shapes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgr2_jax.model import attention, flash_pallas, masks, streams

B, P, R, BS, K, G, D = 2, 24, 32, 8, 2, 2, 16
PLEN = np.array([24, 10])                      # row 1: 14 slots of left padding
BLOCKS = flash_pallas.Blocks(q=16, k=32, q_dq=32, k_dq=16, q_dkv=16, k_dkv=16)


def _layout(name):
  """(`Ranges`/`Streams`, the dense [b, N, N] mask built by masks.py, N)."""
  valid = np.arange(P)[None] >= (P - PLEN)[:, None]
  if name == "causal":
    n = P + R
    kv = np.concatenate([valid, np.ones((B, R), bool)], 1)
    return masks.sequence_ranges(PLEN, P, n, 1), masks.sequence_mask(P, n, 1, jnp.asarray(kv)), n
  seg_block = np.arange(R // BS) if name == "two_stream" else np.repeat(np.arange(R // BS), 2)
  lay = streams.stream_layout(P, R, BS, seg_block)
  n = len(lay["kind"])
  kv = np.concatenate([valid, np.ones((B, n - P), bool)], 1)
  dense = masks.stream_mask(lay["kind"], lay["block"], lay["seg"], lay["kind"], lay["block"], lay["seg"],
                            jnp.asarray(kv))
  return streams.stream_ranges(PLEN, P, R, BS, seg_block), dense, n


def _rand(rs, *shape):
  return jnp.asarray(rs.randn(*shape).astype(np.float32))


def _pallas(q, k, v, spec):
  return flash_pallas.flash_attention(q, k, v, *attention._pallas_intervals(spec, k.shape[1]), blocks=BLOCKS)


def _routes(spec, dense, sees, w):
  """Jitted (out, loss, (dq, dk, dv)) of both routes, and the kernel's log-sum-exp."""
  def run(route):
    def loss(q, k, v):   # queries that see nothing are left out: 'xla' gives them the mean of v
      out = route(q, k, v)
      return jnp.sum(jnp.where(sees, out, 0.0).astype(jnp.float32) * w), out
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  lse = jax.jit(lambda q, k, v: flash_pallas.flash_attention_lse(
      q, k, v, *attention._pallas_intervals(spec, k.shape[1]), blocks=BLOCKS)[1])
  return run(lambda q, k, v: _pallas(q, k, v, spec)), run(lambda q, k, v: attention.attend(q, k, v, dense, "xla")), lse


@pytest.mark.parametrize("layout", ["causal", "two_stream", "replay"])
def test_kernel_equals_xla_values_and_gradients(layout):
  spec, dense, n = _layout(layout)
  rs = np.random.RandomState(0)
  q, k, v, w = _rand(rs, B, n, K, G, D), _rand(rs, B, n, K, D), _rand(rs, B, n, K, D), _rand(rs, B, n, K, G, D)
  sees = jnp.any(dense, -1)[:, :, None, None, None]                       # [b,N,1,1,1]
  assert not bool(jnp.all(sees)), "the layout has queries that see nothing (left padding)"
  got, ref, lse_fn = _routes(spec, dense, sees, w)
  (_, out), grads = got(q, k, v)
  (_, ref_out), ref_grads = ref(q, k, v)
  np.testing.assert_allclose(np.asarray(jnp.where(sees, out, 0)), np.asarray(jnp.where(sees, ref_out, 0)), atol=1e-5)
  assert not np.any(np.asarray(jnp.where(sees, 0, out)))                  # seeing nothing: output 0
  for a, b in zip(grads, ref_grads):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
  # The log-sum-exp the backward reads: the dense one's, -inf where nothing is seen.
  s = jnp.einsum("btkgd,bskd->bkgts", q, k) * D ** -0.5
  ref_lse = jax.nn.logsumexp(jnp.where(dense[:, None, None], s, -jnp.inf), axis=-1)   # [b,K,G,N]
  np.testing.assert_allclose(np.asarray(lse_fn(q, k, v)), np.asarray(jnp.moveaxis(ref_lse, 3, 1)), atol=1e-5)


def test_bf16_within_bf16_precision_of_xla():
  spec, dense, n = _layout("two_stream")
  rs = np.random.RandomState(1)
  q, k, v = (x.astype(jnp.bfloat16) for x in (_rand(rs, B, n, K, G, D), _rand(rs, B, n, K, D), _rand(rs, B, n, K, D)))
  w = _rand(rs, B, n, K, G, D)
  got, ref, _ = _routes(spec, dense, jnp.any(dense, -1)[:, :, None, None, None], w)
  (loss, out), grads = got(q, k, v)
  (ref_loss, _), ref_grads = ref(q, k, v)
  assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=2e-2, atol=0.5)
  for a, b in zip(grads, ref_grads):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max() + 2e-2, (np.abs(a - b).max(), np.abs(b).max())


def test_tiles_outside_every_range_are_never_read():
  # Causal with 14 and 30 slots of left padding, tiles of 16: the tile table skips the tiles above
  # the diagonal and the key tiles wholly in a row's padding, runs the ones below the diagonal and
  # right of the padding unmasked (2) and the rest masked (1).
  t = 64
  lo = jnp.array([14, 30], jnp.int32)
  hi = jnp.broadcast_to(jnp.arange(1, t + 1, dtype=jnp.int32), (2, t))
  zero = jnp.zeros((2, t), jnp.int32)
  rows = jnp.stack([jnp.broadcast_to(lo[:, None], (2, t)), hi, zero, zero], axis=1)   # [b, 4, T]: lo1 hi1 lo2 hi2
  state = np.asarray(flash_pallas.tile_state(rows, 16, 16, t))
  np.testing.assert_array_equal(state[0], [[1, 0, 0, 0], [1, 1, 0, 0], [1, 2, 1, 0], [1, 2, 2, 1]])
  np.testing.assert_array_equal(state[1], [[0, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 2, 1]])
  order, count = flash_pallas.tile_lists(jnp.asarray(state))
  assert order[0, 3, :3].tolist() == [1, 2, 0] and count[0, 3].tolist() == [2, 4]   # full first, then partial
  # NaN keys and values in the key tile row 1's queries never see: nothing reads them.
  rs = np.random.RandomState(2)
  q, k, v = _rand(rs, 2, t, 1, 1, D), _rand(rs, 2, t, 1, D), _rand(rs, 2, t, 1, D)
  poison = lambda x: x.at[1, :16].set(jnp.nan)
  f = lambda q, k, v: jnp.sum(flash_pallas.flash_attention(q, k, v, lo, hi, blocks=flash_pallas.Blocks(16, 16, 16, 16,
                                                                                                     16, 16)))
  f = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))
  out, grads = f(q, poison(k), poison(v))
  clean, ref_grads = f(q, k, v)
  np.testing.assert_allclose(float(out), float(clean), rtol=1e-6)
  for a, b in zip(grads, ref_grads):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


@pytest.mark.parametrize("group", [2, 4])
def test_kernels_lower_for_gpu_at_training_shape(monkeypatch, group):
  """Qwen3-0.6B (16 query heads) and 8B (32) attention, 8 kv heads, head dim 128, 2,048 tokens,
  bf16: the forward and both backward kernels lower through Pallas' Triton lowering (which checks
  every load's shape) from shapes only, for the causal and the two-stream layout, and the
  gradients have the inputs' shapes and dtypes. Compiling the Triton module to GPU code needs a
  GPU (benchmarks/flash_check.py)."""
  monkeypatch.setattr(flash_pallas, "INTERPRET", False)
  sd = jax.ShapeDtypeStruct
  p, r = 512, 768
  cases = [(masks.sequence_ranges(np.array([500]), p, p + 2 * r, 1), p + 2 * r),
           (streams.stream_ranges(np.array([500]), p, r, 32, np.arange(r // 32)), p + 2 * r)]
  for spec, n in cases:
    x, kv = sd((1, n, 8, group, 128), jnp.bfloat16), sd((1, n, 8, 128), jnp.bfloat16)
    loss = lambda q, k, v: jnp.sum(attention.attend(q, k, v, spec, "pallas").astype(jnp.float32))
    grad = jax.grad(loss, argnums=(0, 1, 2))
    text = jax.jit(grad).trace(x, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    for name in ("range_flash_forward", "range_flash_dq", "range_flash_dkv"):
      assert name in text, name
    assert jax.eval_shape(grad, x, kv, kv) == (x, kv, kv)


def _batch(rs, b, p, r, plen):
  return {"prompt_ids": rs.randint(6, 60, (b, p)).astype(np.int32), "prompt_len": np.asarray(plen, np.int32),
          "response_ids": rs.randint(6, 60, (b, r)).astype(np.int32), "response_mask": np.ones((b, r), np.float32),
          "reasoning_mask": np.ones((b, r), np.float32), "answer_mask": np.zeros((b, r), np.float32)}


@pytest.mark.parametrize("loss", ["cft", "sft"])
def test_training_loss_and_grads_pallas_equal_xla(tiny_lm, loss):
  from dgr2_jax.train import cft, losses
  cfg, params = tiny_lm   # one of its two layers: the route is the same in each, and compiles take the time
  cfg = cfg.replace(num_hidden_layers=1)
  params = {k: v for k, v in params.items() if k != "layers_1"}
  batch = _batch(np.random.RandomState(3), 2, 9, 8, [9, 4])
  vals = {}
  for impl in ("xla", "pallas"):
    if loss == "cft":
      c = cfg.as_block_diffusion(4, 63).replace(attention_impl=impl)
      fn = lambda prm: cft.cft_loss(c, prm, batch, jax.random.PRNGKey(0), block_size=4, mask_id=63)[0]
    else:
      c = cfg.replace(attention_impl=impl)
      fn = lambda prm: losses.sft_loss(c, prm, batch)[0]
    vals[impl] = jax.jit(jax.value_and_grad(fn))(params)
  np.testing.assert_allclose(float(vals["pallas"][0]), float(vals["xla"][0]), rtol=1e-5)
  for a, b in zip(jax.tree_util.tree_leaves(vals["pallas"][1]), jax.tree_util.tree_leaves(vals["xla"][1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


_MESH_CHILD = r"""
import sys
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from dgr2_jax.model import attention, flash_pallas, streams
assert jax.device_count() == 4, jax.devices()
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "tensor"))
rs = np.random.RandomState(0)
b, kh, g, d, p, r, bs = 4, 4, 2, 16, 16, 32, 8
spec = streams.stream_ranges(np.array([16, 5, 9, 12]), p, r, bs, np.arange(r // bs))
n = p + 2 * r
q = jnp.asarray(rs.randn(b, n, kh, g, d), jnp.float32)
k, v = (jnp.asarray(rs.randn(b, n, kh, d), jnp.float32) for _ in range(2))
lo1, hi1, lo2, hi2 = attention._pallas_intervals(spec, n)
sees = ((hi1 > lo1) | (hi2 > lo2))[:, :, None, None, None]
# rows that see nothing: 'xla' sends their cotangent to v through a uniform softmax; zero it
ct = jnp.where(sees, jnp.asarray(rs.randn(b, n, kh, g, d), jnp.float32), 0.0)
blocks = flash_pallas.Blocks(16, 16, 16, 16, 16, 16)

def route(q, k, v, impl):
  if impl == "xla":
    return attention.attend(q, k, v, spec, "xla")
  return flash_pallas.flash_attention(q, k, v, *attention._pallas_intervals(spec, n), blocks=blocks)

def vjp(q, k, v, ct, impl="pallas"):
  out, pull = jax.vjp(lambda *a: route(*a, impl), q, k, v)
  return (out,) + pull(ct)

ns = lambda *a: NamedSharding(mesh, P(*a))
sq, skv = ns("data", None, "tensor", None, None), ns("data", None, "tensor", None)
f = jax.jit(vjp, in_shardings=(sq, skv, skv, sq))
compiled = f.lower(q, k, v, ct).compile()
text = compiled.as_text()
for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce"):
  assert op not in text, op
got = compiled(q, k, v, ct)
assert got[0].sharding.spec[:3] == ("data", None, "tensor"), got[0].sharding
assert got[2].sharding.spec[:3] == ("data", None, "tensor"), got[2].sharding
ref = jax.jit(lambda *a: vjp(*a, impl="xla"))(q, k, v, ct)
errs = [float(jnp.max(jnp.abs(jnp.where(sees, got[0] - ref[0], 0))))]
errs += [float(jnp.max(jnp.abs(a - b))) for a, b in zip(got[1:], ref[1:])]
assert max(errs) < 1e-5, errs
print("OK", errs)
"""


def test_on_a_mesh_each_device_runs_its_rows_and_kv_heads():
  """Rows over `data` (2), kv heads over `tensor` (2) on 4 simulated devices (a subprocess: the
  device count is set before jax starts): the forward and both backward calls run per device with
  no collective (called without custom_partitioning, the same program all-gathers), and the
  output and dq, dk, dv equal 'xla' (two-stream mask, left padding)."""
  import os
  import subprocess
  import sys
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _MESH_CHILD, repo], env=env, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]
