"""Decode attention split over keys (flash-decoding): one Pallas kernel for the decoder's query
windows (the 1-slot AR step, the 32/64-slot diffusion window, a speculative round) against its
KV cache, with the per-row key ranges of `attention.Ranges`.

Why a kernel of its own. At small batch a decode step is bound by reading the KV cache, and a
kernel whose grid is batch x heads (cuDNN's, 32 thread blocks for Qwen3-8B at batch 1 on a
132-SM GPU) streams the cache at a fraction of the bandwidth. Flash-decoding adds a grid axis over
key splits: each program reads one slice of the visible keys, keeps an online softmax in f32 and
writes its normalised partial output with its log-sum-exp; a small combine step (plain JAX, f32)
merges the splits by log-sum-exp. JAX ships such a kernel
(`jax.experimental.pallas.ops.gpu.decode_attention.gqa`), but for one query per head only, with
one (start, length) per row, and it transposes the whole cache to [b, K, S, D] before the call;
the decoder's window needs W queries with their own key end each (block-causal), so this kernel
is written in the same style for W x G query rows:

  grid (b, K, row blocks, splits); program (b, h, r, j) holds query rows [r*Rb, (r+1)*Rb) of kv
  head h (row = t * G + g: slot t, query head g of the group, GQA without repeating K/V), and
  reads the cache in its own [b, S, K, D] layout (no transpose, no copy).

  The keys a row block can see are [lo, max hi) of its rows (lo: the row's first real slot, so
  left padding is never read; max hi: the end of the window's block, so the cache's unwritten
  tail is never read either). That span, not the cache length, is cut into `splits` equal slices
  (multiples of `block_k`), so the work per program tracks the tokens decoded so far. A slice is
  read in `block_k` key blocks; the last block of the cache is read from S - block_k with the
  keys before its intended start masked (no padding of the cache, every load in bounds).

  f32 statistics (running max, sum, accumulator); scores from the input dtype's matmul with f32
  accumulation; probabilities cast to v's dtype for the second matmul (as 'xla' does).

How many splits (`k_splits`, the model config's `attention_k_splits`; 0 = this rule): enough
programs for two thread blocks per SM at the call's batch, b * K * row_blocks * splits >=
2 * SMs (264 on an H100/H200, 132 SMs: 33 splits at batch 1 for Qwen3-8B's 8 kv heads, 5 at batch
8), never more splits than key blocks in the cache, and at most `MAX_SPLITS`.

On a mesh (the decode mesh's rows over `data`, heads and the KV cache over `tensor`), XLA cannot
partition a Pallas call (a custom call) and would gather the whole cache to every device;
`partitioned` is the kernel under `custom_partitioning`: each device runs it on its own rows and
kv heads (the rows and heads are independent: no communication), with the split rule applied to
its local shapes.

On CPU the same kernel runs in Pallas interpret mode (`interpret=None`: interpret off the GPU being
built for, `platform.interpret_pallas`),
which is how the tests prove it equal to the dense route. No backward: a decode-only route.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dgr2_jax import platform

NEG = -1e30          # finite "minus infinity" of the running max (no inf - inf in the kernel)
MAX_SPLITS = 64
DEFAULT_SMS = 132    # H100 / H200 SXM; a GPU device's core_count wins when it has one
MIN_ROWS = 16        # a Triton dot needs >= 16 rows: the AR step's G query heads are padded to 16


def _pow2_ceil(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _pow2_floor(n: int) -> int:
  return 1 << (max(1, n).bit_length() - 1)


def tiling(rows: int, num_keys: int, block_r: int = 64) -> tuple[int, int, int]:
  """(row block Rb, padded rows, key block) for `rows` = T * G query rows of one kv head:
  powers of two (Triton's tensor sizes), Rb <= block_r, key block 128 for a few rows (the AR
  step: a wider read per loop trip) and 64 for windows (keeps the [Rb, bk] scores in registers),
  never more than the cache's length."""
  rb = min(block_r, _pow2_ceil(max(rows, MIN_ROWS)))
  padded = -(-rows // rb) * rb
  bk = min(128 if rb <= 16 else 64, _pow2_floor(num_keys))
  return rb, padded, bk


def num_sms() -> int:
  """Streaming multiprocessors of the target's GPU, else the default device's (DEFAULT_SMS when
  neither says; dgr2_jax/platform.py)."""
  return platform.num_sms(DEFAULT_SMS)


def num_splits(batch: int, kv_heads: int, row_blocks: int, num_keys: int, block_k: int,
               k_splits: int = 0, sms: int | None = None) -> int:
  """Key splits of one call: `k_splits` when > 0, else the module docstring's rule (>= 2
  programs per SM); capped by the key blocks of the cache and MAX_SPLITS."""
  if k_splits <= 0:
    programs = batch * kv_heads * row_blocks
    k_splits = -(-2 * (sms or num_sms()) // programs)
  return max(1, min(k_splits, MAX_SPLITS, -(-num_keys // block_k)))


def _kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, splits, block_k, num_keys, scale):
  # lo/hi [Rb] int32 (the rows' key range), q [Rb, D], k/v [S, D] (this row's kv head),
  # o [Rb, D] f32 (normalised over this split's keys), lse [Rb] f32 (NEG: no key in this split).
  j = pl.program_id(3)
  lo, hi = lo_ref[...], hi_ref[...]
  span_lo = jnp.min(lo)
  span = jnp.maximum(jnp.max(hi) - span_lo, 0)
  per = jax.lax.div(jax.lax.div(span + splits - 1, splits) + block_k - 1, block_k) * block_k
  first = span_lo + j * per
  last = jnp.minimum(first + per, span_lo + span)
  n_blocks = jax.lax.div(jnp.maximum(last - first, 0) + block_k - 1, block_k)
  q = q_ref[...]
  rows, d = q.shape

  def body(i, carry):
    m, l, acc = carry
    want = first + i * block_k                          # this block's keys: [want, want + block_k)
    s0 = jnp.minimum(want, num_keys - block_k)          # in bounds; keys before `want` masked
    kb = k_ref[pl.ds(s0, block_k), :]                   # [bk, D]
    vb = v_ref[pl.ds(s0, block_k), :]
    s = jax.lax.dot_general(q, kb.astype(q.dtype), (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * scale     # [Rb, bk]
    kpos = s0 + jax.lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
    vis = ((kpos >= jnp.maximum(lo, want)[:, None])
           & (kpos < jnp.minimum(hi, jnp.minimum(last, want + block_k))[:, None]))
    m_new = jnp.maximum(m, jnp.max(jnp.where(vis, s, NEG), axis=1))
    p = jnp.where(vis, jnp.exp(s - m_new[:, None]), 0.0)
    corr = jnp.exp(m - m_new)
    pv = jax.lax.dot_general(p.astype(vb.dtype), vb, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)            # [Rb, D]
    return m_new, l * corr + jnp.sum(p, axis=1), acc * corr[:, None] + pv

  init = (jnp.full((rows,), NEG, jnp.float32), jnp.zeros((rows,), jnp.float32),
          jnp.zeros((rows, d), jnp.float32))
  m, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
  seen = l > 0.0
  o_ref[...] = acc / jnp.where(seen, l, 1.0)[:, None]
  lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG)


def split_key_attention(q, k, v, lo, hi, *, k_splits: int = 0, block_r: int = 64,
                        interpret: bool | None = None, num_warps: int = 4, num_stages: int = 2):
  """-> (out [b,T,K,G,D] in v's dtype, lse [b,T,K,G] f32; -inf (output 0) for a query that sees
  no key). q [b,T,K,G,D]; k/v [b,S,K,D] (the KV cache); query t of row b attends keys
  [lo[b], hi[b,t]) (`attention.Ranges`). `interpret`: None = Pallas interpret mode off the GPU."""
  b, t, kh, g, d = q.shape
  s_len = k.shape[1]
  if interpret is None:
    interpret = platform.interpret_pallas("gpu")
  rb, rows, bk = tiling(t * g, s_len, block_r)
  splits = num_splits(b, kh, rows // rb, s_len, bk, k_splits)
  lo = jnp.broadcast_to(jnp.asarray(lo, jnp.int32), (b,))
  hi = jnp.asarray(hi, jnp.int32)
  # Rows t * G + g of each kv head, padded to `rows`; padded rows get the empty range [lo, lo).
  qr = jnp.transpose(q, (0, 2, 1, 3, 4)).reshape(b, kh, t * g, d)              # [b,K,T*G,D]
  qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rows - t * g), (0, 0)))               # [b,K,Rp,D]
  hi_r = jnp.pad(jnp.repeat(hi, g, axis=1), ((0, 0), (0, rows - t * g)))      # [b,Rp]
  hi_r = jnp.where(jnp.arange(rows)[None] < t * g, hi_r, lo[:, None])
  lo_r = jnp.broadcast_to(lo[:, None], (b, rows))
  kernel = functools.partial(_kernel, splits=splits, block_k=bk, num_keys=s_len, scale=d ** -0.5)
  compiler_params = None
  if not interpret:
    from jax.experimental.pallas import triton as plgpu  # GPU only
    compiler_params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  o, lse = pl.pallas_call(
      kernel,
      grid=(b, kh, rows // rb, splits),
      in_specs=[
          pl.BlockSpec((None, rb), lambda i, h, r, j: (i, r)),                 # lo rows
          pl.BlockSpec((None, rb), lambda i, h, r, j: (i, r)),                 # hi rows
          pl.BlockSpec((None, None, rb, d), lambda i, h, r, j: (i, h, r, 0)),  # q
          pl.BlockSpec((None, s_len, None, d), lambda i, h, r, j: (i, 0, h, 0)),  # k: whole row
          pl.BlockSpec((None, s_len, None, d), lambda i, h, r, j: (i, 0, h, 0)),  # v
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, rb, d), lambda i, h, r, j: (i, h, j, r, 0)),
          pl.BlockSpec((None, None, None, rb), lambda i, h, r, j: (i, h, j, r)),
      ],
      out_shape=[jax.ShapeDtypeStruct((b, kh, splits, rows, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, kh, splits, rows), jnp.float32)],
      compiler_params=compiler_params,
      interpret=interpret,
      name="split_key_decode_attention",
  )(lo_r, hi_r, qr, k, v)
  out, lse = combine(o, lse)                                                   # [b,K,Rp,(D)]
  out = out[:, :, :t * g].reshape(b, kh, t, g, d)
  lse = lse[:, :, :t * g].reshape(b, kh, t, g)
  return (jnp.transpose(out, (0, 2, 1, 3, 4)).astype(v.dtype),                # [b,T,K,G,D]
          jnp.transpose(lse, (0, 2, 1, 3)))                                    # [b,T,K,G]


def combine(o, lse):
  """Merge key splits (axis 2) by log-sum-exp: o [b,K,splits,R,D], lse [b,K,splits,R] (NEG: an
  empty split) -> (out [b,K,R,D] f32, lse [b,K,R] f32, -inf where no split saw a key)."""
  m = jnp.max(lse, axis=2)                                                     # [b,K,R]
  w = jnp.where(lse > NEG / 2, jnp.exp(lse - m[:, :, None]), 0.0)              # [b,K,splits,R]
  den = jnp.sum(w, axis=2)
  out = jnp.sum(w[..., None] * o, axis=2) / jnp.where(den > 0, den, 1.0)[..., None]
  return out, jnp.where(den > 0, m + jnp.log(jnp.where(den > 0, den, 1.0)), -jnp.inf)


# ---- on a mesh: per row and kv head, no gathers ------------------------------------------------
@functools.partial(custom_partitioning, static_argnums=(5,))
def partitioned(q, k, v, lo, hi, k_splits):
  """`split_key_attention` (same arguments, k_splits positional) that a mesh partitions over the
  rows and kv heads of the KV cache's sharding (module docstring)."""
  return split_key_attention(q, k, v, lo, hi, k_splits=k_splits)


def _specs(mesh, arg_shapes):
  """Shardings of (q, k, v, lo, hi) and of (out, lse) from the cache's rows and kv-head axes
  (the cache is the big operand: it is never resharded); every other dimension replicated."""
  spec = tuple(arg_shapes[1].sharding.spec) + (None,) * 4                     # k [b,S,K,D]
  rows, heads = spec[0], spec[2]
  ns = lambda *a: NamedSharding(mesh, P(*a))
  args = (ns(rows, None, heads, None, None), ns(rows, None, heads, None), ns(rows, None, heads, None),
          ns(rows), ns(rows, None))
  return args, (ns(rows, None, heads, None, None), ns(rows, None, heads, None))


def _infer(k_splits, mesh, arg_shapes, result_shape):
  del k_splits, result_shape
  return _specs(mesh, arg_shapes)[1]


def _partition(k_splits, mesh, arg_shapes, result_shape):
  del result_shape
  args, outs = _specs(mesh, arg_shapes)
  local = lambda q, k, v, lo, hi: split_key_attention(q, k, v, lo, hi, k_splits=k_splits)
  return mesh, local, outs, args


partitioned.def_partition(partition=_partition, infer_sharding_from_operands=_infer,
                          sharding_rule="b t k g d, b s k d, b s k d, b, b t -> b t k g d, b t k g")
