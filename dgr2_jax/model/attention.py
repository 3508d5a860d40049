"""Attention: one entry point (`attend`), every mask of the recipe as key ranges, three routes.

Every mask the recipe uses (docs/design.md, "Attention") is, for query t of
row b, a contiguous range of key slots `[lo_b, hi_bt)`, plus, in the multi-stream layout, a
query's own segment:
  * single stream `[prompt (left-padded) | response]` (AR forward, SFT, the teacher, the decoder's
    window over its KV cache): lo_b = the row's first real slot; hi = t + 1 for a prompt slot and
    the end of its block for a response slot (block size 1: causal). `Ranges`.
  * multi stream `[context = prompt | clean response] + G segments of B` (CFT, replay, OPD, RL;
    model/streams.py): context queries follow the single-stream rule over the context; a segment
    of block j sees the context keys `[lo_b, P + jB)` (prompt + clean blocks < j) and its own B
    keys. `Streams`.
So no route needs a materialised `[T, S]` mask.

Routes (`impl`, the model config's `attention_impl`):
  * 'xla': einsum + softmax over a dense mask built from the ranges (scores `[T, S]` in f32):
    the reference, fastest for the tiny CPU models.
  * 'blockwise': pure JAX, runs everywhere. Queries and keys in blocks, an online softmax over
    the key blocks a query block can see (a `fori_loop` whose bounds come from the ranges, so
    the blocks a mask empties are never computed), and a hand-written backward (custom VJP, the
    flash-attention recurrence from the saved log-sum-exp), so no `[T, S]` array exists in the
    forward or the backward: memory O(T * D + q_block * k_block) per head.
  * 'cudnn': `jax.nn.dot_product_attention(implementation='cudnn')` on GPUs. Causal layouts
    (`Ranges.causal`) roll each row so its tokens start at slot 0 (left padding becomes right
    padding, `key_value_seq_lengths`) and run `is_causal`; the multi-stream layout becomes three
    calls of that form (prompt causal; each clean block and each segment as its own batch item
    whose visible keys are a prefix, the segments in groups of at most one per block so that
    replay's canvases copy the context no more than CFT does); any other range (the decoder's
    window) passes the ranges as a boolean mask (a small `[B, 1, W, S]` bias without a
    backward). `DPA_IMPLEMENTATION` lets tests run the same decomposition through XLA's
    implementation on CPU.
  * 'splitkey': decode attention split over keys (flash-decoding), a Pallas kernel
    (model/decode_attention.py) for queries against a KV cache (`Ranges` with more keys than
    queries: the decoder's 1-slot AR step, its 32/64-slot window, a speculative round, the
    prompt's prefill); anything else (training's square layouts, `Streams`) runs 'blockwise'.
    Forward only. Off the GPU it runs in Pallas interpret mode (tests).
  * 'pallas': block-sparse flash attention for training, forward and backward as Pallas
    kernels (model/flash_pallas.py) over any `Ranges` or `Streams` (as per-query key intervals:
    `_pallas_intervals`): key tiles no query of a tile sees are skipped, the mask is applied on
    partial tiles only. Opt-in ('auto' does not pick it). Off the GPU it runs in Pallas interpret
    mode (tests; `flash_pallas.INTERPRET`). A GPU (Triton) kernel: on a TPU it raises (as do
    'cudnn' and 'splitkey').
  * 'pallas_tpu': the TPU kernels (model/flash_tpu.py), forward and backward: splash attention
    for causal `Ranges` (SFT, the AR forward, the prompt's prefill) and CFT's two streams (at most
    one segment per clean block: `Streams.segment_blocks`), a Pallas TPU port of 'pallas' over
    key intervals for the rest (replay's canvases, any other range). Off a TPU it runs in Pallas
    interpret mode (tests).
  * 'auto': on GPUs 'splitkey' for decode windows (at most DECODE_MAX_QUERIES queries against a
    cache) and 'cudnn' for everything else (training, the prompt's prefill); on TPUs 'xla' for
    decode windows (a [W, S] score block per kv head, inside the decode loop) and 'pallas_tpu'
    for everything else; elsewhere 'blockwise' (what the real presets use).

The prompt's prefill (the decoder's first window: the prompt slots from slot 0) is a causal
`Ranges` (hi = t + 1 over the first T key slots of the cache), so 'cudnn' runs it `is_causal`
with no dense bias and skips the masked tiles.

Shapes: b batch, T queries, S keys, K kv heads, G = heads // K, D head dim.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from dgr2_jax import platform
from dgr2_jax.model import decode_attention, flash_pallas, flash_tpu

IMPLS = ("auto", "xla", "blockwise", "cudnn", "splitkey", "pallas", "pallas_tpu")
GPU_ONLY = ("cudnn", "splitkey", "pallas")  # GPU kernels (cuDNN, Triton): never lowered for a TPU
_NEG = -1e30  # finite: a query with no visible key gets a uniform (not NaN) softmax in 'xla'
# What the 'cudnn' route passes to jax.nn.dot_product_attention; tests set None (XLA) on CPU.
DPA_IMPLEMENTATION = "cudnn"
Q_BLOCK = 512
K_BLOCK = 512
# 'auto' on GPUs (TPUs): windows of at most this many queries against a cache take 'splitkey' ('xla').
DECODE_MAX_QUERIES = 64


@flax.struct.dataclass
class Ranges:
  """Query t of row b sees key slots [lo[b], hi[b, t]). lo [b] int32, hi [b, T] int32.

  `causal` (static) promises hi[b, t] = t + 1: query t is key slot t (the keys may run past
  the queries, as a prefill's KV cache does)."""
  lo: jax.Array
  hi: jax.Array
  causal: bool = flax.struct.field(pytree_node=False, default=False)


@flax.struct.dataclass
class Streams:
  """The multi-stream layout: `context` ranges over the first C = P + R tokens ([prompt | clean]);
  segment g (of (N - C) / G tokens) sees context keys [context.lo[b], segment_hi[b, g]) and its
  own keys. `prompt_slots` P and the clean stream's `block_size` (static) are for 'cudnn';
  `segment_blocks` (static, optional: the clean block each segment canvases, segment_hi = P + jB)
  lets 'pallas_tpu' build splash attention's static mask."""
  context: Ranges
  segment_hi: jax.Array  # [b, G]
  prompt_slots: int = flax.struct.field(pytree_node=False, default=0)
  block_size: int = flax.struct.field(pytree_node=False, default=1)
  segment_blocks: tuple = flax.struct.field(pytree_node=False, default=())


def dense_mask(r: Ranges, num_keys: int) -> jax.Array:
  """[b, T, S] bool from ranges (what 'xla' attends with)."""
  k = jnp.arange(num_keys)[None, None, :]
  return (k >= r.lo[:, None, None]) & (k < r.hi[:, :, None])


def attend(q, k, v, mask, impl: str = "xla", k_splits: int = 0):
  """Attention output [b, T, K, G, D] (v's dtype). q [b,T,K,G,D], k/v [b,S,K,D].

  `mask`: a bool array [b, T, S] (dense, 'xla' only), `Ranges` or `Streams` (then N = T = S).
  `k_splits`: key splits of 'splitkey' (0 = decode_attention.num_splits' rule)."""
  if impl not in IMPLS:
    raise ValueError(f"model.attention_impl must be one of {IMPLS}, got {impl!r}")
  if impl == "auto":  # the fused kernels where they exist, else the memory-efficient pure-JAX route
    impl = auto_impl(q.shape[1], k.shape[1], mask, platform.backend())   # the target's, else the host's
  if impl in GPU_ONLY and platform.backend() == "tpu":
    raise ValueError(f"model.attention_impl={impl!r} is a GPU kernel and does not run on a TPU: use 'pallas_tpu' "
                     f"(what 'auto' takes there), 'xla' or 'blockwise'")
  if impl == "pallas_tpu" and isinstance(mask, (Ranges, Streams)):
    return _pallas_tpu(q, k, v, mask)
  if impl == "pallas" and isinstance(mask, (Ranges, Streams)):
    return flash_pallas.flash_attention(q, k, v, *_pallas_intervals(mask, k.shape[1]))
  if isinstance(mask, Streams):
    return _streams(q, k, v, mask, "blockwise" if impl == "splitkey" else impl)
  if not isinstance(mask, Ranges):
    return _dense(q, k, v, jnp.asarray(mask, bool))
  if impl == "xla":
    return _dense(q, k, v, dense_mask(mask, k.shape[1]))
  if impl == "splitkey" and k.shape[1] > q.shape[1]:
    return decode_attention.partitioned(q, k, v, mask.lo, mask.hi, k_splits)[0]
  if impl in ("blockwise", "splitkey"):
    return range_attention(q, k, v, mask.lo, mask.hi)[0]
  return _cudnn_ranges(q, k, v, mask)


def auto_impl(num_queries: int, num_keys: int, mask, backend: str) -> str:
  """The route 'auto' takes: on GPUs the split-key kernel for a decode window (a non-causal
  `Ranges` of at most DECODE_MAX_QUERIES queries against more keys: a KV cache) and cuDNN
  for the rest; on TPUs 'xla' for a decode window and the TPU kernels for the rest; 'blockwise'
  elsewhere."""
  if backend not in ("gpu", "tpu"):
    return "blockwise"
  window = (isinstance(mask, Ranges) and not mask.causal and num_keys > num_queries
            and num_queries <= DECODE_MAX_QUERIES)
  if backend == "tpu":
    return "xla" if window else "pallas_tpu"
  return "splitkey" if window else "cudnn"


# ---- 'pallas_tpu': splash attention or the interval kernel (model/flash_tpu.py) -------------------
def _pallas_tpu(q, k, v, mask):
  """Splash attention where its static masks say the mask: causal `Ranges` (keys past the queries,
  a prefill's cache, are never visible) and the multi-stream layout with at most one segment per
  clean block (CFT's two streams; block size 1: causal). Replay's canvases (up to B per block, so
  several times CFT's length and a new [N, N] numpy mask per cap) and every other range take the
  interval kernel, whose tile tables come from the ranges at run time."""
  t = q.shape[1]
  if isinstance(mask, Ranges) and mask.causal:
    return flash_tpu.splash_attention(q, k[:, :t], v[:, :t], mask.lo)
  if isinstance(mask, Streams):
    c, blocks, bs = mask.context.hi.shape[1], mask.segment_blocks, mask.block_size
    if mask.context.causal and not mask.segment_hi.shape[1]:
      return flash_tpu.splash_attention(q, k, v, mask.context.lo)
    if (blocks and len(blocks) == mask.segment_hi.shape[1] == len(set(blocks)) and bs > 1
        and k.shape[1] == c + len(blocks) * bs):
      layout = flash_tpu.StreamLayout(mask.prompt_slots, c, bs, tuple(blocks))
      return flash_tpu.splash_attention(q, k, v, mask.context.lo, layout)
  return flash_tpu.flash_attention(q, k, v, *_pallas_intervals(mask, k.shape[1]))


# ---- 'pallas': key intervals ---------------------------------------------------------------------
def _pallas_intervals(mask, num_keys: int):
  """(lo1, hi1, lo2, hi2) [b, N] int32: query t sees keys [lo1, hi1) U [lo2, hi2). A `Ranges` is
  the first interval; in `Streams` a context query has its context range, a segment query the
  context keys [lo, segment_hi) and its own segment (model/flash_pallas.py)."""
  ctx = mask.context if isinstance(mask, Streams) else mask
  b, c = ctx.hi.shape
  lo = jnp.broadcast_to(jnp.asarray(ctx.lo, jnp.int32)[:, None], (b, num_keys if isinstance(mask, Streams) else c))
  none = jnp.zeros(lo.shape, jnp.int32)
  if not isinstance(mask, Streams) or mask.segment_hi.shape[1] == 0:
    return lo, ctx.hi, none, none
  s = mask.segment_hi.shape[1]
  bs = (num_keys - c) // s
  own = c + bs * jnp.repeat(jnp.arange(s, dtype=jnp.int32), bs)               # [S*B] segment starts
  hi1 = jnp.concatenate([ctx.hi, jnp.repeat(mask.segment_hi, bs, axis=1)], axis=1)
  lo2 = jnp.concatenate([none[:, :c], jnp.broadcast_to(own, (b, s * bs))], axis=1)
  hi2 = jnp.concatenate([none[:, :c], jnp.broadcast_to(own + bs, (b, s * bs))], axis=1)
  return lo, hi1.astype(jnp.int32), lo2, hi2


# ---- 'xla': dense ---------------------------------------------------------------------------------
def _dense(q, k, v, mask):
  # Laid out as plain batched matmuls over the (b, K) kv heads, the G query heads of a kv head
  # merged with the queries: [b,K,G*T,D] x [b,K,S,D] (reads each kv head once, and XLA's CPU
  # dot runs this layout ~2x faster than the 5-d einsum).
  b, t, kh, g, d = q.shape
  qh = jnp.transpose(q, (0, 2, 3, 1, 4)).reshape(b, kh, g * t, d)             # [b,K,G*T,D]
  kt = jnp.transpose(k.astype(q.dtype), (0, 2, 1, 3))                          # [b,K,S,D]
  vt = jnp.transpose(v, (0, 2, 1, 3))
  scores = jnp.einsum("bkqd,bksd->bkqs", qh, kt, preferred_element_type=jnp.float32) * (d ** -0.5)
  scores = jnp.where(mask[:, None, None], scores.reshape(b, kh, g, t, -1), _NEG)  # [b,K,G,T,S]
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b, kh, g * t, -1)
  out = jnp.einsum("bkqs,bksd->bkqd", probs, vt).reshape(b, kh, g, t, d)
  return jnp.transpose(out, (0, 3, 1, 2, 4))                                   # [b,T,K,G,D]


def _streams(q, k, v, m: Streams, impl: str):
  """Context x context, then each segment x (context range + itself)."""
  if impl == "cudnn":
    return _cudnn_streams(q, k, v, m)
  b, n, kh, g, d = q.shape
  c, s = m.context.hi.shape[1], m.segment_hi.shape[1]
  qc, kc, vc = q[:, :c], k[:, :c], v[:, :c]
  out_c = attend(qc, kc, vc, m.context, impl)                                   # [b,C,K,G,D]
  if s == 0:  # block size 1: no segments
    return out_c
  bs = (n - c) // s
  qn = q[:, c:].reshape(b, s, bs, kh, g, d)
  kn, vn = k[:, c:].reshape(b, s, bs, kh, d), v[:, c:].reshape(b, s, bs, kh, d)
  scale = d ** -0.5
  s_own = jnp.einsum("bntkgd,bnskd->bnkgts", qn, kn.astype(qn.dtype),
                     preferred_element_type=jnp.float32) * scale               # [b,S,K,G,B,B]
  seg_hi = jnp.repeat(m.segment_hi, bs, axis=1)                                 # [b,S*B]
  if impl == "xla":  # one softmax over [context range | own segment], as the dense mask does
    kpos = jnp.arange(c)
    vis = (kpos[None, None, :] >= m.context.lo[:, None, None]) & (kpos[None, None, :] < m.segment_hi[:, :, None])
    s_ctx = jnp.einsum("bntkgd,bskd->bnkgts", qn, kc.astype(qn.dtype),
                       preferred_element_type=jnp.float32) * scale             # [b,S,K,G,B,C]
    s_ctx = jnp.where(vis[:, :, None, None, None, :], s_ctx, _NEG)
    pn = jax.nn.softmax(jnp.concatenate([s_ctx, s_own], axis=-1), axis=-1).astype(v.dtype)
    out_n = (jnp.einsum("bnkgts,bskd->bntkgd", pn[..., :c], vc)
             + jnp.einsum("bnkgts,bnskd->bntkgd", pn[..., c:], vn))           # [b,S,B,K,G,D]
    return jnp.concatenate([out_c, out_n.reshape(b, s * bs, kh, g, d)], axis=1)
  # 'blockwise': the context part by ranges, the own part dense (B x B), merged by log-sum-exp.
  out_x, lse_x = range_attention(q[:, c:], kc, vc, m.context.lo, seg_hi)       # [b,S*B,K,G,(D)]
  lse_o = jax.nn.logsumexp(s_own, axis=-1)                                      # [b,S,K,G,B]
  p_own = jnp.exp(s_own - lse_o[..., None]).astype(v.dtype)
  out_o = jnp.einsum("bnkgts,bnskd->bntkgd", p_own, vn).reshape(b, s * bs, kh, g, d)
  lse_o = jnp.moveaxis(lse_o, -1, 2).reshape(b, s * bs, kh, g)
  out_n = _merge(out_x, lse_x, out_o, lse_o)
  return jnp.concatenate([out_c, out_n.astype(v.dtype)], axis=1)


def _merge(o1, l1, o2, l2):
  """Softmax over the union of two key sets from each one's normalised output and log-sum-exp."""
  lse = jnp.logaddexp(l1, l2)
  w1 = jnp.exp(l1 - lse)[..., None]
  w2 = jnp.exp(l2 - lse)[..., None]
  return o1.astype(jnp.float32) * w1 + o2.astype(jnp.float32) * w2


# ---- 'blockwise': online softmax with a hand-written backward ----------------------------------
def _pad_to(x, axis, multiple):
  n = x.shape[axis]
  extra = -n % multiple
  if not extra:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, extra)
  return jnp.pad(x, pad)


def _block_sizes(t, s):
  return min(Q_BLOCK, max(t, 1)), min(K_BLOCK, max(s, 1))


def range_attention(q, k, v, lo, hi, q_block: int | None = None, k_block: int | None = None):
  """-> (out [b,T,K,G,D] in v's dtype, lse [b,T,K,G] f32; -inf for a query that sees nothing,
  whose output is 0). Query t of row b attends keys [lo[b], hi[b,t])."""
  bq, bk = _block_sizes(q.shape[1], k.shape[1])
  bq, bk = q_block or bq, k_block or bk
  return _range_attention(q, k, v, jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32), bq, bk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _range_attention(q, k, v, lo, hi, bq, bk):
  return _ra_forward(q, k, v, lo, hi, bq, bk)[:2]


def _key_block_bounds(lo, hi_blk, bk, nk):
  """Key blocks [first, last) any query of this query block can see (the union over rows)."""
  first = jnp.min(lo) // bk
  last = (jnp.max(hi_blk) + bk - 1) // bk
  return jnp.clip(first, 0, nk), jnp.clip(last, 0, nk)


def _scores(qi, kj, scale, lo, hi_i, j, bk):
  """Masked f32 scores [b,K,G,bq,bk] of a query block against key block j, and the mask."""
  s = jnp.einsum("btkgd,bskd->bkgts", qi, kj.astype(qi.dtype), preferred_element_type=jnp.float32) * scale
  kpos = j * bk + jnp.arange(bk)
  vis = (kpos[None, None, :] >= lo[:, None, None]) & (kpos[None, None, :] < hi_i[:, :, None])  # [b,bq,bk]
  return s, vis[:, None, None]


def _ra_forward(q, k, v, lo, hi, bq, bk):
  b, t, kh, g, d = q.shape
  s_len = k.shape[1]
  scale = d ** -0.5
  qp, hip = _pad_to(q, 1, bq), _pad_to(hi, 1, bq)        # padded queries see nothing (hi = 0)
  kp, vp = _pad_to(k, 1, bk), _pad_to(v, 1, bk)
  nq, nk = qp.shape[1] // bq, kp.shape[1] // bk
  del s_len

  def q_block(i):
    qi = jax.lax.dynamic_slice_in_dim(qp, i * bq, bq, axis=1)
    hi_i = jax.lax.dynamic_slice_in_dim(hip, i * bq, bq, axis=1)
    first, last = _key_block_bounds(lo, hi_i, bk, nk)

    def body(j, carry):
      m, l, acc = carry
      kj = jax.lax.dynamic_slice_in_dim(kp, j * bk, bk, axis=1)
      vj = jax.lax.dynamic_slice_in_dim(vp, j * bk, bk, axis=1)
      s, vis = _scores(qi, kj, scale, lo, hi_i, j, bk)
      m_new = jnp.maximum(m, jnp.max(jnp.where(vis, s, -jnp.inf), axis=-1))
      m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
      p = jnp.where(vis, jnp.exp(s - m_use[..., None]), 0.0)
      corr = jnp.exp(m - m_use)
      l = l * corr + p.sum(-1)
      pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), vj, preferred_element_type=jnp.float32)
      return m_new, l, acc * corr[..., None] + pv

    init = (jnp.full((b, kh, g, bq), -jnp.inf, jnp.float32), jnp.zeros((b, kh, g, bq), jnp.float32),
            jnp.zeros((b, kh, g, bq, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(first, last, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    return out, lse                                         # [b,K,G,bq,D], [b,K,G,bq]

  out, lse = jax.lax.map(q_block, jnp.arange(nq))          # [nq,b,K,G,bq,(D)]
  out = jnp.moveaxis(out, 0, 3).reshape(b, kh, g, nq * bq, d)[:, :, :, :t]
  lse = jnp.moveaxis(lse, 0, 3).reshape(b, kh, g, nq * bq)[:, :, :, :t]
  out = jnp.transpose(out, (0, 3, 1, 2, 4)).astype(v.dtype)  # [b,T,K,G,D]
  lse = jnp.transpose(lse, (0, 3, 1, 2))                    # [b,T,K,G]
  return out, lse, (q, k, v, lo, hi, out, lse)


def _ra_fwd(q, k, v, lo, hi, bq, bk):
  out, lse, res = _ra_forward(q, k, v, lo, hi, bq, bk)
  return (out, lse), res


def _ra_bwd(bq, bk, res, cot):
  q, k, v, lo, hi, out, lse = res
  d_out, d_lse = cot
  b, t, kh, g, d = q.shape
  s_len = k.shape[1]
  scale = d ** -0.5
  # delta_t = sum_d dO * O - dlse: ds = p * (dp - delta) (the lse cotangent adds p * dlse).
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), -1) - d_lse.astype(jnp.float32)
  to_blk = lambda x: jnp.moveaxis(x, 1, 3)                 # [b,T,K,G,...] -> [b,K,G,T,...]
  qp, hip = _pad_to(q, 1, bq), _pad_to(hi, 1, bq)
  dop = _pad_to(d_out, 1, bq)
  lsep = _pad_to(to_blk(jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])[..., 0], 3, bq)  # [b,K,G,Tp]
  deltap = _pad_to(to_blk(delta[..., None])[..., 0], 3, bq)
  kp, vp = _pad_to(k, 1, bk), _pad_to(v, 1, bk)
  nq, nk = qp.shape[1] // bq, kp.shape[1] // bk

  def q_block(carry, i):
    dk_all, dv_all = carry
    qi = jax.lax.dynamic_slice_in_dim(qp, i * bq, bq, axis=1)
    hi_i = jax.lax.dynamic_slice_in_dim(hip, i * bq, bq, axis=1)
    doi = jax.lax.dynamic_slice_in_dim(dop, i * bq, bq, axis=1)
    lse_i = jax.lax.dynamic_slice_in_dim(lsep, i * bq, bq, axis=3)
    delta_i = jax.lax.dynamic_slice_in_dim(deltap, i * bq, bq, axis=3)
    first, last = _key_block_bounds(lo, hi_i, bk, nk)

    def body(j, inner):
      dq_i, dk_all, dv_all = inner
      kj = jax.lax.dynamic_slice_in_dim(kp, j * bk, bk, axis=1)
      vj = jax.lax.dynamic_slice_in_dim(vp, j * bk, bk, axis=1)
      s, vis = _scores(qi, kj, scale, lo, hi_i, j, bk)
      p = jnp.where(vis, jnp.exp(s - lse_i[..., None]), 0.0)                  # [b,K,G,bq,bk]
      dv_j = jnp.einsum("bkgts,btkgd->bskd", p.astype(doi.dtype), doi, preferred_element_type=jnp.float32)
      dp = jnp.einsum("btkgd,bskd->bkgts", doi, vj.astype(doi.dtype), preferred_element_type=jnp.float32)
      ds = p * (dp - delta_i[..., None]) * scale
      dq_i = dq_i + jnp.einsum("bkgts,bskd->btkgd", ds, kj.astype(jnp.float32))
      dk_j = jnp.einsum("bkgts,btkgd->bskd", ds, qi.astype(jnp.float32))
      upd = lambda a, x: jax.lax.dynamic_update_slice_in_dim(
          a, jax.lax.dynamic_slice_in_dim(a, j * bk, bk, axis=1) + x, j * bk, axis=1)
      return dq_i, upd(dk_all, dk_j), upd(dv_all, dv_j)

    dq_i = jnp.zeros((b, bq, kh, g, d), jnp.float32)
    dq_i, dk_all, dv_all = jax.lax.fori_loop(first, last, body, (dq_i, dk_all, dv_all))
    return (dk_all, dv_all), dq_i

  zeros = jnp.zeros(kp.shape, jnp.float32)
  (dk, dv), dq = jax.lax.scan(q_block, (zeros, zeros), jnp.arange(nq))
  dq = jnp.moveaxis(dq, 0, 1).reshape(b, nq * bq, kh, g, d)[:, :t]
  return (dq.astype(q.dtype), dk[:, :s_len].astype(k.dtype), dv[:, :s_len].astype(v.dtype), None, None)


_range_attention.defvjp(_ra_fwd, _ra_bwd)


# ---- 'cudnn': fused kernels through jax.nn.dot_product_attention -----------------------------------
def _dpa(q, k, v, **kw):
  """q [n,T,K,G,D] -> jax.nn.dot_product_attention over H = K*G heads (GQA by the kernel)."""
  n, t, kh, g, d = q.shape
  out = jax.nn.dot_product_attention(q.reshape(n, t, kh * g, d), k.astype(q.dtype), v.astype(q.dtype),
                                     implementation=DPA_IMPLEMENTATION, **kw)
  return out.reshape(n, t, kh, g, d)


def _roll_rows(x, shift):
  """Row b of x [b, T, ...] rolled left by shift[b] (left padding -> right padding)."""
  return jax.vmap(lambda xi, si: jnp.roll(xi, -si, axis=0))(x, shift)


def _cudnn_ranges(q, k, v, r: Ranges):
  """Causal ranges (training's AR layout, the prompt's prefill): one `is_causal` call on rows
  rolled to start at slot 0, no bias. Any other ranges go as a dense boolean mask, which is what
  a decode window costs here: a [b, 1, W, S] bias built and read per layer and step, every one of
  the S cache slots read (left padding and the unwritten tail included), and a grid over batch x
  heads only (32 thread blocks for Qwen3-8B at batch 1 on a 132-SM GPU), so the cache streams at
  a fraction of HBM bandwidth. 'auto' sends decode windows to 'splitkey' instead."""
  if r.causal:  # keys past the queries are never visible: the square call (no alignment question)
    lo = r.lo
    t = q.shape[1]
    qs, ks, vs = (_roll_rows(x, lo) for x in (q, k[:, :t], v[:, :t]))
    n = q.shape[1] - lo
    out = _dpa(qs, ks, vs, is_causal=True, query_seq_lengths=n, key_value_seq_lengths=n)
    return _roll_rows(out, -lo).astype(v.dtype)
  mask = dense_mask(r, k.shape[1])[:, None]                                   # [b,1,T,S]
  return _dpa(q, k, v, mask=mask).astype(v.dtype)


def _cudnn_streams(q, k, v, m: Streams):
  """The multi-stream layout as fused calls whose visible keys are prefixes (module docstring).

  Rolled left by the row's padding, the context is [prompt | clean blocks | padding]; a prompt
  query sees a causal prefix, clean block j (slots P + jB ..) the prefix up to its end, and a
  segment of block j the prefix before clean block j followed by its own B keys."""
  b, n, kh, g, d = q.shape
  c, s = m.context.hi.shape[1], m.segment_hi.shape[1]
  p, bs = m.prompt_slots, m.block_size
  lo = m.context.lo
  if m.context.causal:  # block size 1: the context is one causal call
    out_c = _cudnn_ranges(q[:, :c], k[:, :c], v[:, :c], m.context)
    if s == 0:
      return out_c
    raise ValueError("attention.Streams: segments need a clean block size > 1")
  kc, vc = _roll_rows(k[:, :c], lo), _roll_rows(v[:, :c], lo)
  # Prompt queries: causal over the rolled context (the clean queries' outputs are replaced below).
  out_c = _roll_rows(_dpa(_roll_rows(q[:, :c], lo), kc, vc, is_causal=True), -lo)
  real = p - lo                                                                # [b] real prompt tokens
  nb = (c - p) // bs
  if nb:
    qb = q[:, p:c].reshape(b * nb, bs, kh, g, d)
    ends = real[:, None] + (jnp.arange(nb)[None] + 1) * bs                     # [b,nb]
    rep = lambda x: jnp.repeat(x, nb, axis=0)
    out_b = _dpa(qb, rep(kc), rep(vc), key_value_seq_lengths=ends.reshape(-1))
    out_c = jnp.concatenate([out_c[:, :p], out_b.reshape(b, nb * bs, kh, g, d).astype(out_c.dtype)], axis=1)
  if s == 0:
    return out_c.astype(v.dtype)
  seg_bs = (n - c) // s
  seg_len = m.segment_hi - lo[:, None]                                         # [b,S] visible context
  put = jax.vmap(jax.vmap(lambda a, x, i: jax.lax.dynamic_update_slice_in_dim(a, x.astype(a.dtype), i, axis=0)))

  def call(xs):  # segments [b, per, ...] -> outputs [b, per * B, K, G, D]
    qs, ks, vs, ls = xs
    per = ls.shape[1]
    kx = put(jnp.broadcast_to(kc[:, None], (b, per) + kc.shape[1:]), ks, ls).reshape(b * per, c, kh, d)
    vx = put(jnp.broadcast_to(vc[:, None], (b, per) + vc.shape[1:]), vs, ls).reshape(b * per, c, kh, d)
    out = _dpa(qs.reshape(b * per, seg_bs, kh, g, d), kx, vx, key_value_seq_lengths=(ls + seg_bs).reshape(-1))
    return out.reshape(b, per * seg_bs, kh, g, d)

  # Each segment attends to its own copy of the context ([b * S, C] keys, k and v, and as many
  # gradients): with replay's canvases per block that is S / nb times the clean blocks' copies.
  # Segments go in groups of at most nb per call, the groups in a rematerialised lax.map, so the
  # copies alive at once (forward and backward) are those of one group, as in CFT's one canvas.
  groups = _segment_groups(s, max(nb, 1))
  split = lambda x: jnp.moveaxis(x.reshape((b, groups, s // groups) + x.shape[2:]), 1, 0)
  xs = (split(q[:, c:].reshape(b, s, seg_bs, kh, g, d)), split(k[:, c:].reshape(b, s, seg_bs, kh, d)),
        split(v[:, c:].reshape(b, s, seg_bs, kh, d)), split(seg_len))
  if groups == 1:
    out_n = call(jax.tree_util.tree_map(lambda x: x[0], xs))
  else:
    out_n = jnp.moveaxis(jax.lax.map(jax.checkpoint(call), xs), 0, 1).reshape(b, s * seg_bs, kh, g, d)
  return jnp.concatenate([out_c, out_n.astype(out_c.dtype)], axis=1).astype(v.dtype)


def _segment_groups(s: int, most: int) -> int:
  """The fewest equal groups of the S segments with at most `most` segments each."""
  per = max(x for x in range(1, min(s, most) + 1) if s % x == 0)
  return s // per
