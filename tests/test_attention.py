"""Every attention route equals the einsum path over the recipe's masks, in values and gradients.

Masks: causal, block-causal (block 4), and the multi-stream layout (prompt | clean | canvases of
two blocks) with left padding. Routes: 'blockwise' (pure JAX online softmax, several query/key
blocks so blocks are skipped and the last one is padded) and 'cudnn' (the decomposition into fused
calls, run through XLA's implementation of jax.nn.dot_product_attention on CPU). fp32 to 1e-5,
bf16 within bf16's tolerance; and at model level the CFT logits of 'blockwise' equal 'xla's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgr2_jax.model import attention, masks, streams

B, P, R, BS, K, G, D = 3, 11, 8, 4, 2, 2, 8
PLEN = np.array([11, 5, 7])   # left padding of 0, 6 and 4 slots


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
  monkeypatch.setattr(attention, "Q_BLOCK", 4)
  monkeypatch.setattr(attention, "K_BLOCK", 3)
  monkeypatch.setattr(attention, "DPA_IMPLEMENTATION", None)  # XLA's kernel on CPU, same calls


def _rand(rs, *shape, dtype=jnp.float32):
  return jnp.asarray(rs.randn(*shape).astype(np.float32)).astype(dtype)


def _layouts():
  s = P + R
  valid = np.arange(s)[None] >= (P - PLEN)[:, None]
  out = {}
  for name, bs in (("causal", 1), ("block_causal", BS)):
    out[name] = (masks.sequence_ranges(PLEN, P, s, bs), masks.sequence_mask(P, s, bs, jnp.asarray(valid)), valid)
  seg_block = np.array([0, 0, 1, 1])
  n = P + R + len(seg_block) * BS
  lay = streams.stream_layout(P, R, BS, seg_block)
  kv = np.concatenate([valid[:, :P], np.ones((B, n - P), bool)], 1)
  dense = masks.stream_mask(lay["kind"], lay["block"], lay["seg"], lay["kind"], lay["block"], lay["seg"],
                            jnp.asarray(kv))
  out["multi_stream"] = (streams.stream_ranges(PLEN, P, R, BS, seg_block), dense, kv)
  return out


@pytest.mark.parametrize("layout", ["causal", "block_causal", "multi_stream"])
@pytest.mark.parametrize("impl", ["xla", "blockwise", "cudnn"])
def test_route_equals_einsum_values_and_gradients(layout, impl):
  spec, dense, valid = _layouts()[layout]
  n = valid.shape[1]
  rs = np.random.RandomState(0)
  q, k, v = _rand(rs, B, n, K, G, D), _rand(rs, B, n, K, D), _rand(rs, B, n, K, D)
  w = _rand(rs, B, n, K, G, D)
  on = jnp.asarray(valid)[:, :, None, None, None]   # queries on padding see nothing: not compared

  def f(q, k, v, mask, route):
    return jnp.sum(jnp.where(on, attention.attend(q, k, v, mask, route), 0.0) * w)
  ref_g = jax.grad(f, argnums=(0, 1, 2))(q, k, v, dense, "xla")
  g = jax.grad(f, argnums=(0, 1, 2))(q, k, v, spec, impl)
  # Values compared element by element: the weighted sum of ~3,000 outputs cancels to ~0.5, so its
  # f32 rounding depends on the CPU's reduction order, not on the route.
  out = jnp.where(on, attention.attend(q, k, v, spec, impl), 0.0)
  ref = jnp.where(on, attention.attend(q, k, v, dense, "xla"), 0.0)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)
  for a, b in zip(g, ref_g):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
  # bf16 inputs: within bf16's precision of the f32 reference.
  lo = lambda x: x.astype(jnp.bfloat16)
  o16 = attention.attend(lo(q), lo(k), lo(v), spec, impl).astype(jnp.float32)
  o32 = attention.attend(q, k, v, dense, "xla")
  np.testing.assert_allclose(np.asarray(jnp.where(on, o16, 0)), np.asarray(jnp.where(on, o32, 0)), atol=5e-2)


def test_blockwise_never_materialises_scores_and_skips_empty_blocks(monkeypatch):
  # A query block's key loop runs over the key blocks its ranges can see: causal query block
  # [8, 12) with key blocks of 4 visits blocks 0..2, not 0..3.
  lo = jnp.zeros((1,), jnp.int32)
  first, last = attention._key_block_bounds(lo, jnp.arange(9, 13)[None], 4, 4)
  assert (int(first), int(last)) == (0, 3)
  # At T = S = 4096 the dense scores alone are 64 MiB per head; the compiled value-and-grad of the
  # blockwise route plans a small fraction of that (blocks of 512).
  monkeypatch.setattr(attention, "Q_BLOCK", 512)
  monkeypatch.setattr(attention, "K_BLOCK", 512)
  t = 4096
  spec = attention.Ranges(lo, jnp.arange(1, t + 1, dtype=jnp.int32)[None], causal=True)
  x = jax.ShapeDtypeStruct((1, t, 1, 1, 16), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, t, 1, 16), jnp.float32)
  temp = {}
  for impl in ("xla", "blockwise"):
    fn = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention.attend(q, k, v, spec, impl)), argnums=(0, 1, 2)))
    temp[impl] = fn.lower(x, kv, kv).compile().memory_analysis().temp_size_in_bytes
  assert temp["xla"] >= t * t * 4          # the [T, S] f32 scores
  assert temp["blockwise"] < t * t * 4 / 8, temp


def test_model_cft_logits_blockwise_equal_xla(tiny_lm):
  from dgr2_jax.train import cft
  cfg, params = tiny_lm
  rs = np.random.RandomState(3)
  b, p, r = 2, 9, 8
  batch = {"prompt_ids": rs.randint(6, 60, (b, p)).astype(np.int32), "prompt_len": np.array([9, 4], np.int32),
           "response_ids": rs.randint(6, 60, (b, r)).astype(np.int32), "response_mask": np.ones((b, r), np.float32),
           "reasoning_mask": np.ones((b, r), np.float32), "answer_mask": np.zeros((b, r), np.float32)}
  vals = {}
  for impl in ("xla", "blockwise"):
    c = cfg.as_block_diffusion(4, 63).replace(attention_impl=impl)
    vals[impl] = jax.value_and_grad(lambda prm: cft.cft_loss(c, prm, batch, jax.random.PRNGKey(0), block_size=4,
                                                             mask_id=63)[0])(params)
  np.testing.assert_allclose(float(vals["blockwise"][0]), float(vals["xla"][0]), rtol=1e-5)
  for a, bb in zip(jax.tree_util.tree_leaves(vals["blockwise"][1]), jax.tree_util.tree_leaves(vals["xla"][1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(bb), atol=1e-5)
