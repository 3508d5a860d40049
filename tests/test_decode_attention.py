"""The split-key decode attention kernel ('splitkey', model/decode_attention.py) against the dense
route ('xla'), run in Pallas interpret mode on CPU: the 1-slot AR step and the 32- and 64-slot
windows with left padding, per-row window starts (so per-row key ranges), block-causal key ends,
GQA at Qwen3-8B's ratio, several key splits, f32 and bf16. Then: what 'auto' picks, the decoder
with the kernel equal to the plain-Python reference, the prompt's prefill as a causal range, and
the kernel lowered for a GPU (Triton) at the Qwen3-8B shape from shapes only.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgr2_jax.decode import reference, sampler
from dgr2_jax.model import attention, decode_attention, masks

B, K, G, D = 3, 4, 2, 16     # 8 query heads over 4 kv heads (Qwen3-0.6B's 2:1; 8B's 4:1 below)
BS = 32                      # the decoder's block size


def _case(t, dtype, seed=0, g=G):
  """q/k/v and the key ranges of a window of t slots at per-row starts over a left-padded
  single-stream layout [prompt P | response 3 blocks] (the decoder's masks.sequence_ranges)."""
  rs = np.random.RandomState(seed)
  p = 40
  s = p + 3 * BS
  plen = np.array([40, 7, 23])                          # left padding 0, 33, 17 slots
  bs = 1 if t == 1 else BS
  start = np.array([p, p + BS, s - t]) if t > 1 else np.array([p + 5, p + 70, s - 1])
  slots = jnp.asarray(start)[:, None] + jnp.arange(t)[None]
  r = masks.sequence_ranges(plen, p, s, bs, q_slots=slots)
  q = jnp.asarray(rs.randn(B, t, K, g, D), jnp.float32)
  k = jnp.asarray(rs.randn(B, s, K, D), jnp.float32)
  v = jnp.asarray(rs.randn(B, s, K, D), jnp.float32)
  return tuple(x.astype(dtype) for x in (q, k, v)), r


@pytest.mark.parametrize("t", [1, 32, 64])
def test_split_key_equals_xla(t):
  (q, k, v), r = _case(t, jnp.float32, g=4 if t == 32 else G)
  ref = attention.attend(q, k, v, r, "xla")
  scores = jnp.einsum("btkgd,bskd->btkgs", q, k) * D ** -0.5
  vis = attention.dense_mask(r, k.shape[1])[:, :, None, None]                 # [b,T,1,1,S]
  ref_lse = jax.nn.logsumexp(jnp.where(vis, scores, -jnp.inf), axis=-1)
  for splits in ((0, 3) if t == 1 else (3,)):   # the rule's count (the cache's key blocks); an uneven 3
    out, lse = jax.jit(lambda *a, n=splits: decode_attention.split_key_attention(*a, k_splits=n))(q, k, v, r.lo, r.hi)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, err_msg=f"splits={splits}")
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-5, rtol=1e-5)
  # bf16 inputs through the model's entry point: equal to 'xla' on the same bf16 inputs and to
  # the f32 result within bf16's precision.
  q16, k16, v16 = (x.astype(jnp.bfloat16) for x in (q, k, v))
  out16 = jax.jit(lambda *a: attention.attend(*a, r, "splitkey"))(q16, k16, v16)
  assert out16.dtype == jnp.bfloat16
  ref16 = attention.attend(q16, k16, v16, r, "xla").astype(jnp.float32)
  np.testing.assert_allclose(np.asarray(out16, np.float32), np.asarray(ref16), atol=2e-2)
  np.testing.assert_allclose(np.asarray(out16, np.float32), np.asarray(ref), atol=5e-2)


def test_split_rule_and_tiling():
  # >= 2 programs per SM: Qwen3-8B (8 kv heads) on 132 SMs -> 33 splits at batch 1, 5 at batch 8,
  # capped by the cache's key blocks (26 of 128 keys at 3,224 slots) and MAX_SPLITS.
  assert decode_attention.num_splits(1, 8, 1, 8192, 128, sms=132) == 33
  assert decode_attention.num_splits(1, 8, 1, 3224, 128, sms=132) == 26
  assert decode_attention.num_splits(8, 8, 1, 3224, 128, sms=132) == 5
  assert decode_attention.num_splits(1, 8, 1, 300, 128, sms=132) == 3
  assert decode_attention.num_splits(1, 1, 1, 10 ** 6, 128, sms=132) == decode_attention.MAX_SPLITS
  assert decode_attention.num_splits(1, 8, 1, 3224, 128, k_splits=7) == 7
  # Rows t * G: the AR step's 4 query heads padded to 16; a 64-slot window of 4 heads in blocks of 64.
  assert decode_attention.tiling(4, 3224) == (16, 16, 128)
  assert decode_attention.tiling(256, 3224) == (64, 256, 64)
  assert decode_attention.tiling(6, 40) == (16, 16, 32)


def test_auto_picks_split_key_for_decode_windows_on_gpu():
  lo = jnp.zeros((1,), jnp.int32)
  window = lambda t: attention.Ranges(lo, jnp.ones((1, t), jnp.int32))
  assert attention.auto_impl(1, 3224, window(1), "gpu") == "splitkey"
  assert attention.auto_impl(64, 3224, window(64), "gpu") == "splitkey"
  assert attention.auto_impl(65, 3224, window(65), "gpu") == "cudnn"              # not a decode window
  assert attention.auto_impl(64, 64, window(64), "gpu") == "cudnn"                # training: no cache
  assert attention.auto_impl(32, 3224, attention.Ranges(lo, lo[None], causal=True), "gpu") == "cudnn"  # prefill
  assert attention.auto_impl(1, 3224, window(1), "cpu") == "blockwise"


def test_decoder_with_split_key_equals_reference(tiny_lm):
  """The jitted decoder on the kernel ('splitkey': prefill and every window, blocks of 4 written
  by the fused 8-slot window, rows at their own slots) equals the plain-Python reference (which
  attends densely): tokens, commit steps, log-probs, NFE."""
  cfg, params = tiny_lm
  prompts = [[7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20], [21, 22, 23]]
  dc = sampler.DecodeConfig(block_size=4, threshold=0.1, max_new_tokens=8, mask_token_id=63, pad_id=0,
                            eos_ids=(5,), kv_write="fused")
  out = sampler.generate(cfg.replace(attention_impl="splitkey", attention_k_splits=2), params, prompts, dc)
  ref = reference.reference_decode(cfg, params, prompts, dc)
  np.testing.assert_array_equal(out["tokens"], ref["tokens"])
  np.testing.assert_array_equal(out["commit_step"], ref["commit_step"])
  np.testing.assert_allclose(out["logprob"], ref["logprob"], atol=1e-5)
  np.testing.assert_array_equal(out["nfe"], ref["nfe"])


def test_prefill_is_a_causal_range_and_cudnn_runs_it_exactly(monkeypatch):
  monkeypatch.setattr(attention, "DPA_IMPLEMENTATION", None)   # XLA's implementation, same calls
  p, s = 11, 11 + 8
  plen = np.array([11, 5, 7])
  pre = masks.sequence_ranges(plen, p, s, 4, q_slots=np.arange(p))
  traced = masks.sequence_ranges(plen, p, s, 4, q_slots=jnp.arange(p))
  assert pre.causal and not traced.causal
  assert not masks.sequence_ranges(plen, p, s, 4, q_slots=np.arange(p) + 1).causal
  np.testing.assert_array_equal(np.asarray(pre.hi), np.asarray(traced.hi))
  rs = np.random.RandomState(1)
  q = jnp.asarray(rs.randn(3, p, 2, 2, 8), jnp.float32)
  k, v = (jnp.asarray(rs.randn(3, s, 2, 8), jnp.float32) for _ in range(2))
  real = (np.arange(p)[None] >= (p - plen)[:, None])[:, :, None, None, None]   # queries on padding: not compared
  ref = attention.attend(q, k, v, traced, "xla")
  for impl in ("cudnn", "splitkey"):
    out = jax.jit(lambda *a, impl=impl: attention.attend(*a, pre, impl))(q, k, v)
    np.testing.assert_allclose(np.where(real, out, 0), np.where(real, ref, 0), atol=1e-5, err_msg=impl)


@pytest.mark.parametrize("b", [1, 8])
def test_8b_shape_lowers_to_triton(b):
  """Qwen3-8B (32 q heads, 8 kv heads, head dim 128), prompt 2,200 + response 1,024 slots, bf16:
  the kernel lowers for a GPU (the Triton lowering checks every load's shape) for the AR step and
  both windows, from shapes only; eval_shape gives the output shapes."""
  kh, g, d, s = 8, 4, 128, 2200 + 1024
  sd = jax.ShapeDtypeStruct
  for t in (1, 32, 64):
    args = (sd((b, t, kh, g, d), jnp.bfloat16), sd((b, s, kh, d), jnp.bfloat16), sd((b, s, kh, d), jnp.bfloat16),
            sd((b,), jnp.int32), sd((b, t), jnp.int32))
    f = jax.jit(lambda *a: decode_attention.split_key_attention(*a, interpret=False))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "split_key_decode_attention" in text
    out, lse = jax.eval_shape(lambda *a: decode_attention.split_key_attention(*a), *args)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == ((b, t, kh, g, d), jnp.bfloat16, (b, t, kh, g), jnp.float32)


_MESH_CHILD = r"""
import sys
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from dgr2_jax.model import attention, masks
assert jax.device_count() == 4, jax.devices()
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "tensor"))
rs = np.random.RandomState(0)
b, t, k_heads, g, d, p, s = 4, 8, 4, 2, 16, 30, 62
q = jnp.asarray(rs.randn(b, t, k_heads, g, d), jnp.float32)
k, v = (jnp.asarray(rs.randn(b, s, k_heads, d), jnp.float32) for _ in range(2))
start = jnp.array([30, 38, 46, 54])
r = masks.sequence_ranges(np.array([30, 5, 17, 22]), p, s, 8, q_slots=start[:, None] + jnp.arange(t))
ns = lambda *a: NamedSharding(mesh, P(*a))
f = jax.jit(lambda q, k, v, lo, hi: attention.attend(q, k, v, attention.Ranges(lo, hi), "splitkey"),
            in_shardings=(ns("data", None, "tensor", None, None), ns("data", None, "tensor", None),
                          ns("data", None, "tensor", None), ns("data"), ns("data", None)))
compiled = f.lower(q, k, v, r.lo, r.hi).compile()
text = compiled.as_text()
for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce"):
  assert op not in text, op
out = compiled(q, k, v, r.lo, r.hi)
assert out.sharding.spec[:3] == ("data", None, "tensor"), out.sharding
err = float(jnp.max(jnp.abs(out - attention.attend(q, k, v, r, "xla"))))
assert err < 1e-5, err
print("OK", err)
"""


def test_split_key_on_a_mesh_runs_per_row_and_kv_head():
  """Rows over `data` (2), kv heads over `tensor` (2) on 4 simulated devices: the partitioned
  kernel runs on each device's rows and heads with no collective, equal to 'xla'. (A subprocess:
  the CPU device count is set before jax initialises.)"""
  import os
  import subprocess
  import sys
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _MESH_CHILD, repo], env=env, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]
