"""TPU attention for training ('pallas_tpu'): splash attention where a static mask says the mask, and a
Pallas TPU (Mosaic) port of model/flash_pallas.py's block-sparse kernel where the mask is per-row key
intervals. Forward and backward of both, on a mesh per row and kv head.

Which kernel (`attention._pallas_tpu` chooses):
  * `splash_attention`: jax.experimental.pallas.ops.tpu.splash_attention over N = T = S slots with a
    static mask (`CausalMask`, or a `NumpyMask` of the multi-stream layout's structure: `StreamLayout`)
    and segment ids for what varies by row, the left padding: a row's padding slots (and the tail
    that pads N to whole tiles) are segment 0, its tokens segment 1, so a token never sees padding
    and a padding slot sees only padding (at least itself: no row is empty, no 0 / 0). Queries are
    pre-scaled by 1 / sqrt(D) (splash does not scale), D zero-padded to a multiple of 128. GQA:
    splash's MHA with K kv heads, heads h = k * G + g in attend's head order.
  * `flash_attention`: query t of row b sees keys [lo1, hi1) U [lo2, hi2) (int32 [b, T] each), the
    form `attention._pallas_intervals` gives every `Ranges` and `Streams`. As in flash_pallas, plain
    JAX classifies each (query tile, key tile) pair from the intervals (`flash_pallas.tile_state`,
    `tile_lists`: empty, full, partial; each tile's partners full first). Those tables are scalar
    prefetch (`pltpu.PrefetchScalarGridSpec`, SMEM): a kernel's last grid axis walks its tile's
    partner list, the k/v (or q) BlockSpec's index map reads the partner's tile from the table, so
    only visible tiles are DMA'd (past the list's end the index repeats, and Pallas skips the copy
    of an unchanged block); full partners run without a mask, partial ones compare key positions
    with the rows' interval ends. Grids: forward and dq (b, heads, query tiles, key partners); dk/dv
    (b, kv heads, key tiles, G, query partners), dk and dv summed over the group in VMEM scratch.
    q/o/do [b, H, T, D], k/v [b, K, S, D] (transposed from attend's layout by XLA); the per-query
    statistics (lse, delta) [b, H, 1, T] and the intervals [b, 4, T], so a tile's values are lanes
    (the dk/dv kernel works on transposed scores [bk, bq], where they broadcast over sublanes) or a
    column after a reshape (forward, dq). f32 statistics and accumulators, matmuls in the inputs'
    dtype with f32 accumulation; tiles are powers of two >= 128 (the lane width), so every block's
    last two dims satisfy TPU tiling ((8, 128) f32, (16, 128) bf16); lengths are padded to whole
    tiles and D to a multiple of 128 only when they are not already.

A query that sees no key (left padding) gets output 0 and no gradient from the interval kernel; under
splash it attends to the padding slots up to itself; 'xla' gives it the mean of all values. No loss
reads it. Off a TPU (`platform.interpret_pallas('tpu')`) both kernels run in Pallas interpret
mode, which is how the tests compare them with 'xla' on the CPU; inside `platform.target('tpu', ...)`
they lower to Mosaic (`tpu_custom_call`). Block sizes are not tuned on a device (none was available):
512 is MaxText's splash default for v5p.

On a mesh each call runs under `shard_map` (`_on_mesh`): every device on its own rows and kv heads,
no communication. The mesh is the one in context (`jax.set_mesh`) or the one the arrays' avals carry
(a jit called with arrays or ShapeDtypeStructs that have NamedShardings); when neither says, XLA
runs the kernels replicated, gathering their operands. (flash_pallas's `custom_partitioning` does not
lower on TPUs: "Custom emitter for CustomSPMDPartitioning not found", jax-ml/jax#38196.)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import PartitionSpec as P

from dgr2_jax import platform
from dgr2_jax.model.flash_pallas import (dot, fit_blocks, flash_vjp, interval_rows, pad_to, padded_lengths,
                                         pow2_ceil, tile_lists, tile_state)

NEG = -0.7 * float(np.finfo(np.float32).max)  # masked score (finite: no inf - inf in the kernel)
EMPTY_LSE = 1e30    # lse of a query that sees nothing: exp(s - EMPTY_LSE) = 0 in the backward
LANES = 128         # TPU lane width: the smallest tile, and D's padding multiple


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Tile sizes (powers of two >= 128) of the interval kernel's three calls and of splash's."""
  q: int = 512        # forward
  k: int = 512
  q_dq: int = 512     # dq
  k_dq: int = 512
  q_dkv: int = 512    # dk/dv
  k_dkv: int = 512
  splash: int = 512   # every splash block (q, kv, kv compute; forward, dq, dkv)


DEFAULT_BLOCKS = Blocks()


class StreamLayout(NamedTuple):
  """Static structure of the multi-stream layout (`attention.Streams`) for splash's NumpyMask: the
  context [prompt (P) | clean (C - P)] then one segment of `block_size` per entry of
  `segment_blocks` (the clean block it canvases)."""
  prompt_slots: int
  context: int
  block_size: int
  segment_blocks: tuple


@dataclasses.dataclass(frozen=True)
class _Cfg:
  blocks: Blocks
  interpret: bool
  scale: float                        # 1 / sqrt(D) of the unpadded head dim
  layout: StreamLayout | None = None  # splash: None = causal


def _fit(block: int, n: int) -> int:
  """A power-of-two tile no longer than the (power-of-two-rounded) length, at least LANES."""
  return max(LANES, min(pow2_ceil(block), pow2_ceil(n)))


def _interpret(interpret: bool | None) -> bool:
  return platform.interpret_pallas("tpu") if interpret is None else bool(interpret)


def _compiler_params(cfg: _Cfg, semantics: tuple):
  return None if cfg.interpret else pltpu.CompilerParams(dimension_semantics=semantics)


# ---- layouts: attend's [b, T, K, G, D] <-> the kernels' heads-major [b, H, T, D] --------------------
def _heads(q):
  b, t, kh, g, d = q.shape
  return jnp.transpose(q, (0, 2, 3, 1, 4)).reshape(b, kh * g, t, d)           # [b,H,T,D]


def _from_heads(x, kh: int):
  b, h, t, d = x.shape
  return jnp.transpose(x.reshape(b, kh, h // kh, t, d), (0, 3, 1, 2, 4))       # [b,T,K,G,D]


def _kv_heads(k):
  return jnp.transpose(k, (0, 2, 1, 3))                                        # [b,S,K,D] <-> [b,K,S,D]


# ---- the interval kernel ---------------------------------------------------------------------------
def flash_attention(q, k, v, lo1, hi1, lo2=None, hi2=None, *, blocks: Blocks | None = None,
                    interpret: bool | None = None):
  """Attention output [b,T,K,G,D] in v's dtype, differentiable in q, k, v. q [b,T,K,G,D], k/v
  [b,S,K,D]; query t of row b sees keys [lo1, hi1) U [lo2, hi2) (int [b, T] each, or [b] for a
  row-wide start; lo2/hi2 None = no second interval). The two intervals must not overlap."""
  b, t, kh, g, d = q.shape
  s = k.shape[1]
  if k.shape != (b, s, kh, d) or v.shape != k.shape:
    raise ValueError(f"flash_tpu: k/v must be [b, S, K, D] = [{b}, S, {kh}, {d}], got {k.shape}, {v.shape}")
  bl = fit_blocks(blocks or DEFAULT_BLOCKS, t, s, _fit)
  tp, sp = padded_lengths(bl, t, s)
  dp = -(-d // LANES) * LANES
  rows = interval_rows((lo1, hi1, lo2, hi2), b, t, s, tp)                     # [b,4,Tp]; padding sees nothing
  qp = pad_to(pad_to(q, 1, tp), 4, dp)
  kp, vp = (pad_to(pad_to(x, 1, sp), 3, dp) for x in (k, v))
  cfg = _Cfg(bl, _interpret(interpret), d ** -0.5)
  return _on_mesh(lambda q, k, v, rows: _flash(q, k, v, rows, cfg), qp, kp, vp, rows)[:, :t, :, :, :d]


def _entry(order_ref, count_ref, r, i, n, width: int, tiles: int):
  """The tile at entry n of tile i's partner list in row r; past the list's end its last entry
  (the same block: no copy), 0 for an empty list. Tables are flat: order [b*tiles*width], count
  [b*tiles*2]."""
  last = jnp.maximum(count_ref[(r * tiles + i) * 2 + 1] - 1, 0)
  return order_ref[(r * tiles + i) * width + jnp.minimum(n, last)]


def _run(count_ref, r, i, n, tiles: int, step):
  """step(masked) for list entry n of tile i: unmasked below the full count, masked below the visible."""
  full, vis = count_ref[(r * tiles + i) * 2], count_ref[(r * tiles + i) * 2 + 1]
  pl.when(n < full)(lambda: step(False))
  pl.when((n >= full) & (n < vis))(lambda: step(True))


def _col(ref, c):
  """Row c of a [rows, bq] ref as a [bq, 1] column (the per-query value against [bq, bk] scores)."""
  return ref[c][:, None]


def _visible_cols(rows_ref, k_start, bq: int, bk: int):
  """[bq, bk] bool: key k_start + c is in query r's intervals (rows_ref [4, bq]: lo1 hi1 lo2 hi2)."""
  kpos = k_start + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
  lo1, hi1, lo2, hi2 = (_col(rows_ref, c) for c in range(4))
  return ((kpos >= lo1) & (kpos < hi1)) | ((kpos >= lo2) & (kpos < hi2))


def _visible_rows(rows_ref, k_start, bk: int, bq: int):
  """[bk, bq] bool, transposed: key k_start + c (sublanes) is in query r's (lanes) intervals."""
  kpos = k_start + jax.lax.broadcasted_iota(jnp.int32, (bk, bq), 0)
  lo1, hi1, lo2, hi2 = (rows_ref[c:c + 1, :] for c in range(4))
  return ((kpos >= lo1) & (kpos < hi1)) | ((kpos >= lo2) & (kpos < hi2))


def _fwd_kernel(order_ref, count_ref, rows_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, *,
                scale, bk, nq, nk):
  # q/o [bq, D] (one head's query tile), k/v [bk, D] (the partner key tile), rows [4, bq], lse [1, bq];
  # scratch m/l [bq, 1], acc [bq, D] (f32) across the partner axis.
  r, i, n = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  bq = q_ref.shape[0]

  @pl.when(n == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, NEG, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  def step(masked):
    q = q_ref[...]
    s = dot(q, k_ref[...].astype(q.dtype)) * scale                         # [bq, bk]
    if masked:
      start = _entry(order_ref, count_ref, r, i, n, nk, nq) * bk
      s = jnp.where(_visible_cols(rows_ref, start, bq, bk), s, NEG)
    m_prev = m_sc[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))           # [bq, 1]
    corr = jnp.exp(m_prev - m_new)
    p = jnp.exp(s - m_new)
    vb = v_ref[...]
    acc_sc[...] = acc_sc[...] * corr + dot(p.astype(vb.dtype), vb, (1, 0))
    l_sc[...] = l_sc[...] * corr + jnp.sum(p, axis=1, keepdims=True)
    m_sc[...] = m_new

  _run(count_ref, r, i, n, nq, step)

  @pl.when(n == nk - 1)
  def _end():
    # A row that sees nothing collected garbage in full tiles (they are full for the other rows).
    seen = (_col(rows_ref, 1) > _col(rows_ref, 0)) | (_col(rows_ref, 3) > _col(rows_ref, 2))   # [bq, 1]
    l = jnp.where(seen, l_sc[...], 1.0)
    o_ref[...] = jnp.where(seen, acc_sc[...] / l, 0.0).astype(o_ref.dtype)
    lse_ref[0] = jnp.where(seen, m_sc[...] + jnp.log(l), EMPTY_LSE)[:, 0]


def _key_spec(bk: int, d: int, g: int, nq: int, nk: int):
  """k/v BlockSpec of the forward and dq grids (b, H, query tiles, partners): the partner's key tile."""
  return pl.BlockSpec((None, None, bk, d),
                      lambda r, h, i, n, order, count: (r, h // g, _entry(order, count, r, i, n, nk, nq), 0))


def _forward(q, k, v, rows, cfg: _Cfg):
  """q [b,Tp,K,G,Dp], k/v [b,Sp,K,Dp], rows [b,4,Tp] -> (out [b,Tp,K,G,Dp] in v's dtype, lse [b,K,G,Tp] f32;
  EMPTY_LSE: sees nothing)."""
  b, tp, kh, g, d = q.shape
  sp = k.shape[1]
  bq, bk = cfg.blocks.q, cfg.blocks.k
  nq, nk = tp // bq, sp // bk
  order, count = tile_lists(tile_state(rows, bq, bk, sp))
  head = pl.BlockSpec((None, None, bq, d), lambda r, h, i, n, *_: (r, h, i, 0))
  stat = pl.BlockSpec((None, None, 1, bq), lambda r, h, i, n, *_: (r, h, 0, i))
  kv = _key_spec(bk, d, g, nq, nk)
  out, lse = pl.pallas_call(
      functools.partial(_fwd_kernel, scale=cfg.scale, bk=bk, nq=nq, nk=nk),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(b, kh * g, nq, nk),
          in_specs=[pl.BlockSpec((None, 4, bq), lambda r, h, i, n, *_: (r, 0, i)), head, kv, kv],
          out_specs=[head, stat],
          scratch_shapes=[pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
                          pltpu.VMEM((bq, d), jnp.float32)]),
      out_shape=[jax.ShapeDtypeStruct((b, kh * g, tp, d), v.dtype),
                 jax.ShapeDtypeStruct((b, kh * g, 1, tp), jnp.float32)],
      compiler_params=_compiler_params(cfg, ("parallel", "parallel", "parallel", "arbitrary")),
      interpret=cfg.interpret,
      name="range_flash_forward_tpu",
  )(order.reshape(-1), count.reshape(-1), rows, _heads(q), _kv_heads(k), _kv_heads(v))
  return _from_heads(out, kh), lse.reshape(b, kh, g, tp)


def _dq_kernel(order_ref, count_ref, rows_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, dq_ref, dq_sc, *,
               scale, bk, nq, nk):
  # q/do/dq [bq, D], rows [4, bq], lse/delta [1, bq], k/v [bk, D] (the partner key tile); scratch dq [bq, D].
  r, i, n = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  bq = q_ref.shape[0]

  @pl.when(n == 0)
  def _init():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  def step(masked):
    q, do = q_ref[...], do_ref[...]
    kb = k_ref[...].astype(q.dtype)
    s = dot(q, kb) * scale
    if masked:
      start = _entry(order_ref, count_ref, r, i, n, nk, nq) * bk
      s = jnp.where(_visible_cols(rows_ref, start, bq, bk), s, NEG)
    p = jnp.exp(s - _col(lse_ref, 0))                                         # [bq, bk]
    ds = p * (dot(do, v_ref[...].astype(do.dtype)) - _col(delta_ref, 0))
    dq_sc[...] += dot(ds.astype(kb.dtype), kb, (1, 0))

  _run(count_ref, r, i, n, nq, step)

  @pl.when(n == nk - 1)
  def _end():
    dq_ref[...] = (dq_sc[...] * scale).astype(dq_ref.dtype)


def _dq(q, k, v, rows, do, lse, delta, cfg: _Cfg):
  """-> dq [b,Tp,K,G,Dp] in q's dtype. lse/delta [b,K,G,Tp] f32."""
  b, tp, kh, g, d = q.shape
  sp = k.shape[1]
  bq, bk = cfg.blocks.q_dq, cfg.blocks.k_dq
  nq, nk = tp // bq, sp // bk
  order, count = tile_lists(tile_state(rows, bq, bk, sp))
  head = pl.BlockSpec((None, None, bq, d), lambda r, h, i, n, *_: (r, h, i, 0))
  stat = pl.BlockSpec((None, None, 1, bq), lambda r, h, i, n, *_: (r, h, 0, i))
  kv = _key_spec(bk, d, g, nq, nk)
  stats = lambda x: x.reshape(b, kh * g, 1, tp)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, scale=cfg.scale, bk=bk, nq=nq, nk=nk),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(b, kh * g, nq, nk),
          in_specs=[pl.BlockSpec((None, 4, bq), lambda r, h, i, n, *_: (r, 0, i)), head, head, stat, stat, kv, kv],
          out_specs=head,
          scratch_shapes=[pltpu.VMEM((bq, d), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct((b, kh * g, tp, d), q.dtype),
      compiler_params=_compiler_params(cfg, ("parallel", "parallel", "parallel", "arbitrary")),
      interpret=cfg.interpret,
      name="range_flash_dq_tpu",
  )(order.reshape(-1), count.reshape(-1), rows, _heads(q), _heads(do), stats(lse), stats(delta), _kv_heads(k),
    _kv_heads(v))
  return _from_heads(dq, kh)


def _dkv_kernel(order_ref, count_ref, rows_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, dk_ref, dv_ref,
                dk_sc, dv_sc, *, scale, g, nk, nq):
  # k/v/dk/dv [bk, D] (one kv head's key tile); q/do [bq, D], rows [4, bq], lse/delta [1, bq] (the partner
  # query tile, of query head kh * G + j); scratch dk/dv [bk, D] summed over the G heads and the partners.
  # Scores are transposed, [bk, bq]: the per-query values broadcast over sublanes.
  r, t, j, n = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
  bk, bq = k_ref.shape[0], q_ref.shape[0]

  @pl.when((j == 0) & (n == 0))
  def _init():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  def step(masked):
    qb, do = q_ref[...], do_ref[...]
    s = dot(k_ref[...].astype(qb.dtype), qb) * scale                          # [bk, bq]
    if masked:
      s = jnp.where(_visible_rows(rows_ref, t * bk, bk, bq), s, NEG)
    p = jnp.exp(s - lse_ref[...])
    dv_sc[...] += dot(p.astype(do.dtype), do, (1, 0))                           # [bk, D]
    ds = p * (dot(v_ref[...].astype(do.dtype), do) - delta_ref[...])
    dk_sc[...] += dot(ds.astype(qb.dtype), qb, (1, 0))

  _run(count_ref, r, t, n, nk, step)

  @pl.when((j == g - 1) & (n == nq - 1))
  def _end():
    dk_ref[...] = (dk_sc[...] * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _dkv(q, k, v, rows, do, lse, delta, cfg: _Cfg):
  """-> (dk, dv) [b,Sp,K,Dp] in k's / v's dtype. lse/delta [b,K,G,Tp] f32."""
  b, tp, kh, g, d = q.shape
  sp = k.shape[1]
  bq, bk = cfg.blocks.q_dkv, cfg.blocks.k_dkv
  nq, nk = tp // bq, sp // bk
  order, count = tile_lists(jnp.swapaxes(tile_state(rows, bq, bk, sp), 1, 2))   # per key tile: [b,nk,nq], [b,nk,2]
  part = lambda r, t, n, order, count: _entry(order, count, r, t, n, nq, nk)    # the partner query tile
  head = pl.BlockSpec((None, None, bq, d), lambda r, h, t, j, n, *tb: (r, h * g + j, part(r, t, n, *tb), 0))
  stat = pl.BlockSpec((None, None, 1, bq), lambda r, h, t, j, n, *tb: (r, h * g + j, 0, part(r, t, n, *tb)))
  rows_spec = pl.BlockSpec((None, 4, bq), lambda r, h, t, j, n, *tb: (r, 0, part(r, t, n, *tb)))
  tile = pl.BlockSpec((None, None, bk, d), lambda r, h, t, j, n, *_: (r, h, t, 0))
  stats = lambda x: x.reshape(b, kh * g, 1, tp)
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, scale=cfg.scale, g=g, nk=nk, nq=nq),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(b, kh, nk, g, nq),
          in_specs=[rows_spec, head, head, stat, stat, tile, tile],
          out_specs=[tile, tile],
          scratch_shapes=[pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, d), jnp.float32)]),
      out_shape=[jax.ShapeDtypeStruct((b, kh, sp, d), k.dtype), jax.ShapeDtypeStruct((b, kh, sp, d), v.dtype)],
      compiler_params=_compiler_params(cfg, ("parallel", "parallel", "parallel", "arbitrary", "arbitrary")),
      interpret=cfg.interpret,
      name="range_flash_dkv_tpu",
  )(order.reshape(-1), count.reshape(-1), rows, _heads(q), _heads(do), stats(lse), stats(delta), _kv_heads(k),
    _kv_heads(v))
  return _kv_heads(dk), _kv_heads(dv)


# ---- custom VJP (flash_pallas's, over these calls) ------------------------------------------------
_flash = flash_vjp(_forward, _dq, _dkv)


# ---- splash attention: static masks + segment ids ---------------------------------------------------
def splash_attention(q, k, v, lo, layout: StreamLayout | None = None, *, blocks: Blocks | None = None,
                     interpret: bool | None = None):
  """Attention output [b,N,K,G,D] in v's dtype, differentiable in q, k, v. q [b,N,K,G,D], k/v [b,N,K,D]
  (queries and keys are the same N slots); lo [b]: row b's first real slot (the slots before it are
  left padding). `layout` None: causal (query t sees [lo, t + 1)); else the multi-stream layout's
  rule (`StreamLayout`; its context follows the single-stream rule from lo)."""
  b, n, kh, g, d = q.shape
  if k.shape != (b, n, kh, d) or v.shape != k.shape:
    raise ValueError(f"splash_attention: k/v must be [b, N, K, D] = [{b}, {n}, {kh}, {d}], got {k.shape}, {v.shape}")
  bl = blocks or DEFAULT_BLOCKS
  tile = _fit(bl.splash, n)
  np_ = -(-n // tile) * tile
  cfg = _Cfg(dataclasses.replace(bl, splash=tile), _interpret(interpret), d ** -0.5, layout)
  slot = jnp.arange(np_, dtype=jnp.int32)[None]
  seg = ((slot >= jnp.asarray(lo, jnp.int32)[:, None]) & (slot < n)).astype(jnp.int32)[:, None]   # [b,1,Np]
  qs = (q.astype(jnp.float32) * cfg.scale).astype(q.dtype)                    # splash does not scale
  dp = -(-d // LANES) * LANES                                                 # a zero-padded head dim changes no score
  qp, kp, vp = pad_to(pad_to(qs, 1, np_), 4, dp), pad_to(pad_to(k, 1, np_), 3, dp), pad_to(pad_to(v, 1, np_), 3, dp)

  def local(q, k, v, seg):  # one device's rows and kv heads; splash's own custom VJP differentiates it
    kernel = _splash_kernel(cfg, np_, q.shape[2] * g)
    one = lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(s[0], s[0]))
    return _from_heads(jax.vmap(one)(_heads(q), _kv_heads(k), _kv_heads(v), seg), q.shape[2])

  return _on_mesh(local, qp, kp, vp, seg)[:, :n, :, :, :d]


def stream_mask(layout: StreamLayout, n: int) -> np.ndarray:
  """[n, n] bool (numpy, static) of the multi-stream layout, left padding aside (segment ids carry
  it): a prompt slot sees the prompt slots up to itself, a clean slot the context up to the end of
  its block, a segment of block j the context before clean block j and itself; a slot past the
  layout (tile padding) only itself."""
  p, c, bs = layout.prompt_slots, layout.context, layout.block_size
  t = np.arange(n)
  blocks = np.asarray(layout.segment_blocks, np.int64)
  g = np.clip((t - c) // bs, 0, max(len(blocks) - 1, 0))
  in_seg = (t >= c) & (t < c + len(blocks) * bs)
  hi1 = np.where(t < p, t + 1, p + ((t - p) // bs + 1) * bs)                   # the context rule
  hi1 = np.where(t >= c, np.where(in_seg, p + blocks[g] * bs if len(blocks) else 0, 0), hi1)
  lo2 = np.where(in_seg, c + g * bs, np.where(t >= c, t, 0))                   # own segment; padding: itself
  hi2 = np.where(in_seg, c + (g + 1) * bs, np.where(t >= c, t + 1, 0))
  key = t[None, :]
  return (key < hi1[:, None]) | ((key >= lo2[:, None]) & (key < hi2[:, None]))


@dataclasses.dataclass(eq=False)
class _LayoutMask(splash_mask.NumpyMask):
  """`stream_mask` as splash's NumpyMask, hashed and compared by (layout, n): splash looks its block
  tables up by the mask's hash, and hashing the [n, n] array of every head on every call is slow."""
  key: tuple = ()

  def __eq__(self, other):
    return isinstance(other, _LayoutMask) and self.key == other.key

  def __hash__(self):
    return hash(self.key)


@functools.lru_cache(maxsize=16)
def _static_mask(layout: StreamLayout | None, n: int):
  return splash_mask.CausalMask((n, n)) if layout is None else _LayoutMask(stream_mask(layout, n), (layout, n))


def _splash_kernel(cfg: _Cfg, n: int, heads: int):
  """Splash's MHA kernel over `heads` query heads (kv heads from k's shape) for the layout's mask
  (splash caches the mask's block tables, keyed on the mask)."""
  t = cfg.blocks.splash
  sizes = splash.BlockSizes(block_q=t, block_kv=t, block_kv_compute=t, block_q_dkv=t, block_kv_dkv=t,
                            block_kv_dkv_compute=t, block_q_dq=t, block_kv_dq=t)
  mask = splash_mask.MultiHeadMask([_static_mask(cfg.layout, n)] * heads)
  return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=cfg.interpret)


# ---- on a mesh: per row and kv head ----------------------------------------------------------------
def _mesh(x):
  """The mesh a traced array is laid over: the context's (`jax.set_mesh`), else its own aval's
  (arrays of a jit whose inputs carry NamedShardings); None on one device, when neither says, or
  inside a shard_map (the arrays are already a device's own)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", mesh)
  manual = any(t == jax.sharding.AxisType.Manual for t in mesh.axis_types)
  return None if mesh.empty or mesh.size == 1 or manual else mesh


def _on_mesh(fn, q, k, v, rows):
  """fn(q [b,T,K,G,D], k/v [b,S,K,D], rows [b,f,T]) -> [b,T,K,G,D], under shard_map on a mesh: each
  device runs it on its own rows (every mesh axis but 'tensor' whose sizes divide b, in order) and kv
  heads ('tensor', when it divides K); what a mesh axis does not split is replicated. A Pallas call
  is a custom call XLA cannot partition (it would gather every operand to every device), and
  custom_partitioning, what flash_pallas uses on GPUs, does not lower on TPUs (jax-ml/jax#38196)."""
  mesh = _mesh(k)
  if mesh is None:
    return fn(q, k, v, rows)
  b, kh = k.shape[0], k.shape[2]
  rows_axes, prod = [], 1
  for a in mesh.axis_names:
    if a != "tensor" and mesh.shape[a] > 1:
      if b % (prod * mesh.shape[a]):
        break
      rows_axes.append(a)
      prod *= mesh.shape[a]
  r = tuple(rows_axes) or None
  h = "tensor" if mesh.shape.get("tensor", 1) > 1 and kh % mesh.shape["tensor"] == 0 else None
  specs = (P(r, None, h, None, None), P(r, None, h, None), P(r, None, h, None), P(r, None, None))
  return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=False)(q, k, v, rows)
