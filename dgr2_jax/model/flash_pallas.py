"""Block-sparse flash attention for training: a Pallas forward and backward whose mask is per-query
key intervals, so every mask of the recipe runs fused with the tiles it empties skipped.

The mask. Query t of row b sees the keys of two intervals, `[lo1, hi1) U [lo2, hi2)` (int32
[b, T] each; an interval with hi <= lo is empty). Every mask of `attention` is of that form
(`attention._pallas_intervals`): a `Ranges` is the first interval alone; in the multi-stream
layout (`Streams`: CFT's two streams, RL replay's canvases) a context query has its context range
and a segment query the context keys before its block plus its own segment. Nothing `[T, S]`
exists in HBM: the kernels compare key positions against the interval ends of the tile's rows.

Tiles. Queries and keys go in tiles (`Blocks`). Before each call plain JAX classifies every
(query tile, key tile) pair from the intervals: empty (no row of the tile sees a key of it),
full (every row that sees anything sees all of its keys) or partial, and sorts each tile's
partners full first: `order` [b, tiles, partners] and `count` [b, tiles, 2] = (full, visible).
A program runs two loops over its list: the full partners without any mask, then the partial
ones with the elementwise mask; empty partners are never loaded. The tables are
O(b x T/bq x S/bk) int32 (e.g. 32 x 32 per row at T = S = 2,048 with tiles of 64).

Kernels, after jax.experimental.pallas.ops.gpu.attention (`mha` and its backward), with its
exp2 arithmetic (scores scaled by log2(e) / sqrt(D)), f32 statistics and accumulators, matmuls
in the inputs' dtype with f32 accumulation, and the log-sum-exp (base 2) saved for the backward:
  * forward, grid (query tiles, b, heads): online softmax over the tile's key list -> out, lse;
  * dq, grid (query tiles, b, heads): the same key list, dS = P * (dP - delta) -> dq;
  * dk/dv, grid (key tiles, b, kv heads): the key tile's query list, for each of the G query
    heads of the kv head (GQA: dk and dv summed over the group in the kernel, no [.., G, ..]
    buffer) -> dk, dv.
delta = rowsum(dO * O) is one fused XLA op. Layouts are those `attention.attend` takes (q
[b, T, K, G, D], k/v [b, S, K, D]); BlockSpecs address a head's rows in place (no transposes).
Lengths are padded to whole tiles and D to a power of two >= 16 (Triton's tensor sizes; a
zero-padded head dim changes no score) only when they are not already.

A query that sees no key (a left-padding slot) gets output 0 (as 'blockwise' defines it; 'xla'
gives the mean of all values there, which no loss reads) and no gradient.

`INTERPRET`: None = Pallas interpret mode off the GPU being built for (`platform.interpret_pallas`:
the host's backend, or a compile-only target's; how the tests run it on CPU), or a bool.
On a mesh (training's rows over `data`/`fsdp`, heads over `tensor`), XLA cannot partition a Pallas
call (a custom call) and would gather every operand to every device; each of the three calls is
under `custom_partitioning` instead (as `decode_attention.partitioned`): every device runs it on
its own rows and kv heads, which are independent (no communication).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dgr2_jax import platform

INTERPRET: bool | None = None
NEG = -0.7 * float(jnp.finfo(jnp.float32).max)  # masked score (finite: no inf - inf in the kernel)
EMPTY_LSE = 1e30    # lse of a query that sees nothing: exp2(s - EMPTY_LSE) = 0 in the backward
LOG2E = math.log2(math.e)
MIN_TILE = 16       # a Triton dot needs >= 16 rows and columns


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Tile sizes (powers of two) and Triton launch parameters of the three kernels."""
  q: int = 128        # forward
  k: int = 64
  q_dq: int = 64      # dq
  k_dq: int = 64
  q_dkv: int = 64     # dk/dv
  k_dkv: int = 64
  warps_fwd: int = 8
  warps_bwd: int = 8  # the dk/dv program holds two [64, 128] f32 accumulators: 8 warps keep them in registers
  stages: int = 2


DEFAULT_BLOCKS = Blocks()   # what `blocks=None` means (benchmarks/flash_check.py --tiles sets it)


@dataclasses.dataclass(frozen=True)
class _Cfg:
  blocks: Blocks
  interpret: bool
  scale: float        # 1 / sqrt(D) of the unpadded head dim


def pow2_ceil(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _fit(block: int, n: int) -> int:
  """A tile no longer than the (power-of-two-rounded) length, at least MIN_TILE."""
  return max(MIN_TILE, min(block, pow2_ceil(n)))


def fit_blocks(b, t: int, s: int, fit=_fit):
  """`b` (a Blocks, here or flash_tpu's) with each query tile fit(tile, t) and each key tile fit(tile, s)."""
  return dataclasses.replace(b, q=fit(b.q, t), k=fit(b.k, s), q_dq=fit(b.q_dq, t), k_dq=fit(b.k_dq, s),
                             q_dkv=fit(b.q_dkv, t), k_dkv=fit(b.k_dkv, s))


def pad_to(x, axis, size):
  """x zero-padded at the end of `axis` to `size` (x itself when it is that long)."""
  extra = size - x.shape[axis]
  if not extra:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, extra)
  return jnp.pad(x, pad)


def flash_attention(q, k, v, lo1, hi1, lo2=None, hi2=None, *, blocks: Blocks | None = None,
                    interpret: bool | None = None):
  """Attention output [b,T,K,G,D] in v's dtype, differentiable in q, k, v. q [b,T,K,G,D], k/v
  [b,S,K,D]; query t of row b sees keys [lo1, hi1) U [lo2, hi2) (int [b, T] each, or [b] for a
  row-wide start; lo2/hi2 None = no second interval). The two intervals must not overlap."""
  args, cfg, (t, d) = _prepare(q, k, v, (lo1, hi1, lo2, hi2), blocks, interpret)
  return _flash(*args, cfg)[:, :t, :, :, :d]


def flash_attention_lse(q, k, v, lo1, hi1, lo2=None, hi2=None, *, blocks: Blocks | None = None,
                        interpret: bool | None = None):
  """`flash_attention`'s forward with its log-sum-exp (natural log, [b,T,K,G] f32; -inf where the
  query sees nothing). Not differentiable (the training path differentiates `flash_attention`)."""
  args, cfg, (t, d) = _prepare(q, k, v, (lo1, hi1, lo2, hi2), blocks, interpret)
  out, lse2 = _forward_p(*args, cfg)
  lse = jnp.where(lse2 < EMPTY_LSE / 2, lse2 / LOG2E, -jnp.inf)                # [b,K,G,Tp]
  return out[:, :t, :, :, :d], jnp.transpose(lse, (0, 3, 1, 2))[:, :t]


def _prepare(q, k, v, intervals, blocks, interpret):
  """Pads q/k/v to whole tiles and D to a power of two; stacks the intervals to `rows` [b, 4, Tp]
  int32 (lo1, hi1, lo2, hi2) clipped to the keys (padded queries see nothing)."""
  b, t, kh, g, d = q.shape
  s = k.shape[1]
  if k.shape != (b, s, kh, d) or v.shape != k.shape:
    raise ValueError(f"flash_attention: k/v must be [b, S, K, D] = [{b}, S, {kh}, {d}], got {k.shape}, {v.shape}")
  bl = fit_blocks(blocks or DEFAULT_BLOCKS, t, s)
  tp, sp = padded_lengths(bl, t, s)
  dp = max(MIN_TILE, pow2_ceil(d))
  qp = pad_to(pad_to(q, 1, tp), 4, dp)
  kp, vp = (pad_to(pad_to(x, 1, sp), 3, dp) for x in (k, v))
  if interpret is None:
    interpret = INTERPRET if INTERPRET is not None else platform.interpret_pallas("gpu")
  cfg = _Cfg(bl, bool(interpret), d ** -0.5)
  return (qp, kp, vp, interval_rows(intervals, b, t, s, tp)), cfg, (t, d)


def padded_lengths(bl, t: int, s: int) -> tuple:
  """(Tp, Sp): the query and key lengths padded to whole tiles of every call of `bl` (tiles are powers
  of two, so the largest one's multiples are every tile's)."""
  tile_t, tile_s = max(bl.q, bl.q_dq, bl.q_dkv), max(bl.k, bl.k_dq, bl.k_dkv)
  return -(-t // tile_t) * tile_t, -(-s // tile_s) * tile_s


def interval_rows(intervals, b: int, t: int, s: int, tp: int):
  """The intervals (lo1, hi1, lo2, hi2; each [b, t] or [b], lo2/hi2 None = no second interval) as
  `rows` [b, 4, tp] int32 clipped to the s keys; the tp - t padded queries see nothing."""
  lo1, hi1, lo2, hi2 = intervals
  if lo2 is None:
    lo2 = hi2 = jnp.zeros((b, t), jnp.int32)

  def row(x):
    x = jnp.clip(jnp.asarray(x, jnp.int32), 0, s)
    return jnp.broadcast_to(x[:, None] if x.ndim == 1 else x, (b, t))

  return pad_to(jnp.stack([row(lo1), row(hi1), row(lo2), row(hi2)], axis=1), 2, tp)


# ---- the tile tables -------------------------------------------------------------------------------
def tile_state(rows, bq: int, bk: int, num_keys: int):
  """[b, T/bq, S/bk] int32: 0 = no row of the query tile sees a key of the key tile, 2 = every row
  that sees any key sees all of them, 1 = partial (the mask is applied). rows [b, 4, T]: lo1, hi1,
  lo2, hi2, with T a multiple of bq and num_keys of bk."""
  lo1, hi1, lo2, hi2 = (rows[:, i] for i in range(4))
  b, t = lo1.shape
  start = jnp.arange(num_keys // bk, dtype=jnp.int32) * bk
  end = start + bk
  hit = lambda lo, hi: (hi > lo)[..., None] & (lo[..., None] < end) & (hi[..., None] > start)  # [b,T,nk]
  cover = lambda lo, hi: (lo[..., None] <= start) & (hi[..., None] >= end)
  empty = ~((hi1 > lo1) | (hi2 > lo2))
  tiles = lambda x: x.reshape(b, t // bq, bq, -1)
  vis = jnp.any(tiles(hit(lo1, hi1) | hit(lo2, hi2)), axis=2)
  full = jnp.all(tiles(empty[..., None] | cover(lo1, hi1) | cover(lo2, hi2)), axis=2)
  return jnp.where(vis, jnp.where(full, 2, 1), 0).astype(jnp.int32)


def tile_lists(state):
  """state [b, n, m] -> (order [b, n, m]: each tile's partners, full ones first, then partial,
  then empty; count [b, n, 2]: (full, visible)) int32."""
  order = jnp.argsort(2 - state, axis=-1, stable=True).astype(jnp.int32)
  count = jnp.stack([jnp.sum(state == 2, -1), jnp.sum(state > 0, -1)], -1).astype(jnp.int32)
  return order, count


# ---- in-kernel pieces ------------------------------------------------------------------------------
def _load_rows(rows_ref, sl=slice(None)):
  """(lo1, hi1, lo2, hi2) of the rows `sl` of a [4, T] ref, each [rows] int32."""
  return tuple(rows_ref[i, sl] for i in range(4))


def _visible(rows, k_start, num_k):
  """[rows, num_k] bool: key k_start + c is in row r's intervals. rows: 4 x [rows] int32."""
  lo1, hi1, lo2, hi2 = rows
  kpos = k_start + jax.lax.broadcasted_iota(jnp.int32, (lo1.shape[0], num_k), 1)
  return (((kpos >= lo1[:, None]) & (kpos < hi1[:, None]))
          | ((kpos >= lo2[:, None]) & (kpos < hi2[:, None])))


def dot(a, b, contract=(1, 1)):
  """2-d matmul with f32 accumulation; contract = (a's, b's) contracted dim."""
  return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), preferred_element_type=jnp.float32)


def _two_loops(count_ref, step, carry):
  """Runs step(n, carry, masked) over list entries [0, full) unmasked, then [full, visible) masked."""
  carry = jax.lax.fori_loop(0, count_ref[0], functools.partial(step, masked=False), carry)
  return jax.lax.fori_loop(count_ref[0], count_ref[1], functools.partial(step, masked=True), carry)


# ---- forward ---------------------------------------------------------------------------------------
def _fwd_kernel(rows_ref, order_ref, count_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale2, bk):
  # q/o [bq, D] (one head's query tile), k/v [S, D] (its kv head), rows [4, bq], lse [bq], order [nk],
  # count [2].
  rows = _load_rows(rows_ref)
  q = q_ref[...]
  bq, d = q.shape

  def step(n, carry, masked):
    acc, m, l = carry
    start = pl.multiple_of(order_ref[n] * bk, bk)
    kb = k_ref[pl.ds(start, bk), :]
    s = dot(q, kb.astype(q.dtype)) * scale2                               # [bq, bk], log2 units
    if masked:
      s = jnp.where(_visible(rows, start, bk), s, NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    corr = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    vb = v_ref[pl.ds(start, bk), :]
    acc = acc * corr[:, None] + dot(p.astype(vb.dtype), vb, (1, 0))
    return acc, m_new, l * corr + jnp.sum(p, axis=1)

  init = (jnp.zeros((bq, d), jnp.float32), jnp.full((bq,), NEG, jnp.float32), jnp.zeros((bq,), jnp.float32))
  acc, m, l = _two_loops(count_ref, step, init)
  # A row that sees nothing collected garbage in full tiles (they are full for the other rows).
  seen = (rows[1] > rows[0]) | (rows[3] > rows[2])
  l = jnp.where(seen, l, 1.0)
  o_ref[...] = jnp.where(seen[:, None], acc / l[:, None], 0.0).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, m + jnp.log2(l), EMPTY_LSE)


def _compiler_params(cfg: _Cfg, warps: int):
  if cfg.interpret:
    return None
  from jax.experimental.pallas import triton as plgpu  # GPU only
  return plgpu.CompilerParams(num_warps=warps, num_stages=cfg.blocks.stages)


def _forward(q, k, v, rows, cfg: _Cfg):
  """-> (out [b,Tp,K,G,Dp] in v's dtype, lse2 [b,K,G,Tp] f32 base 2; EMPTY_LSE: sees nothing)."""
  b, tp, kh, g, d = q.shape
  sp = k.shape[1]
  bq, bk = cfg.blocks.q, cfg.blocks.k
  order, count = tile_lists(tile_state(rows, bq, bk, sp))
  nk = sp // bk
  row = pl.BlockSpec((None, 4, bq), lambda i, r, h: (r, 0, i))
  head = pl.BlockSpec((None, bq, None, None, d), lambda i, r, h: (r, i, h // g, h % g, 0))
  kv = pl.BlockSpec((None, sp, None, d), lambda i, r, h: (r, 0, h // g, 0))
  kernel = functools.partial(_fwd_kernel, scale2=cfg.scale * LOG2E, bk=bk)
  return pl.pallas_call(
      kernel,
      grid=(tp // bq, b, kh * g),
      in_specs=[row,
                pl.BlockSpec((None, None, nk), lambda i, r, h: (r, i, 0)),
                pl.BlockSpec((None, None, 2), lambda i, r, h: (r, i, 0)),
                head, kv, kv],
      out_specs=[head, pl.BlockSpec((None, None, None, bq), lambda i, r, h: (r, h // g, h % g, i))],
      out_shape=[jax.ShapeDtypeStruct(q.shape, v.dtype), jax.ShapeDtypeStruct((b, kh, g, tp), jnp.float32)],
      compiler_params=_compiler_params(cfg, cfg.blocks.warps_fwd),
      interpret=cfg.interpret,
      name="range_flash_forward",
  )(rows, order, count, q, k, v)


# ---- backward: dq ----------------------------------------------------------------------------------
def _dq_kernel(rows_ref, order_ref, count_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, dq_ref, *,
               scale2, bk):
  # q/do/dq [bq, D], rows [4, bq], lse/delta [bq], k/v [S, D].
  rows = _load_rows(rows_ref)
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]

  def step(n, dq, masked):
    start = pl.multiple_of(order_ref[n] * bk, bk)
    kb = k_ref[pl.ds(start, bk), :].astype(q.dtype)
    vb = v_ref[pl.ds(start, bk), :]
    s = dot(q, kb) * scale2
    if masked:
      s = jnp.where(_visible(rows, start, bk), s, NEG)
    p = jnp.exp2(s - lse[:, None])                                         # [bq, bk]
    ds = p * (dot(do, vb.astype(do.dtype)) - delta[:, None])
    return dq + dot(ds.astype(kb.dtype), kb, (1, 0))

  dq = _two_loops(count_ref, step, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * (scale2 / LOG2E)).astype(dq_ref.dtype)


def _dq(q, k, v, rows, do, lse2, delta, cfg: _Cfg):
  b, tp, kh, g, d = q.shape
  sp = k.shape[1]
  bq, bk = cfg.blocks.q_dq, cfg.blocks.k_dq
  order, count = tile_lists(tile_state(rows, bq, bk, sp))
  row = pl.BlockSpec((None, 4, bq), lambda i, r, h: (r, 0, i))
  head = pl.BlockSpec((None, bq, None, None, d), lambda i, r, h: (r, i, h // g, h % g, 0))
  stat = pl.BlockSpec((None, None, None, bq), lambda i, r, h: (r, h // g, h % g, i))
  kv = pl.BlockSpec((None, sp, None, d), lambda i, r, h: (r, 0, h // g, 0))
  return pl.pallas_call(
      functools.partial(_dq_kernel, scale2=cfg.scale * LOG2E, bk=bk),
      grid=(tp // bq, b, kh * g),
      in_specs=[row,
                pl.BlockSpec((None, None, sp // bk), lambda i, r, h: (r, i, 0)),
                pl.BlockSpec((None, None, 2), lambda i, r, h: (r, i, 0)),
                head, head, stat, stat, kv, kv],
      out_specs=head,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=_compiler_params(cfg, cfg.blocks.warps_bwd),
      interpret=cfg.interpret,
      name="range_flash_dq",
  )(rows, order, count, q, do, lse2, delta, k, v)


# ---- backward: dk, dv ------------------------------------------------------------------------------
def _dkv_kernel(rows_ref, order_ref, count_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, dk_ref, dv_ref,
                *, scale2, bq):
  # k/v/dk/dv [bk, D] (one kv head's key tile); q/do [T, G, D] and lse/delta [G, T] (the G query
  # heads of that kv head); rows [4, T]; order [nq] (query tiles), count [2].
  kb, vb = k_ref[...], v_ref[...]
  bk = kb.shape[0]
  start_k = pl.program_id(0) * bk

  def step(n, carry, masked, g):
    dk, dv = carry
    start = pl.multiple_of(order_ref[n] * bq, bq)
    sl = pl.ds(start, bq)
    qb, do = q_ref[sl, g, :], do_ref[sl, g, :]                             # [bq, D]
    s = dot(qb, kb.astype(qb.dtype)) * scale2                              # [bq, bk]
    if masked:
      s = jnp.where(_visible(_load_rows(rows_ref, sl), start_k, bk), s, NEG)
    p = jnp.exp2(s - lse_ref[g, sl][:, None])
    dv = dv + dot(p.astype(do.dtype), do, (0, 0))                           # [bk, D]
    ds = p * (dot(do, vb.astype(do.dtype)) - delta_ref[g, sl][:, None])
    return dk + dot(ds.astype(qb.dtype), qb, (0, 0)), dv

  def head(g, carry):
    return _two_loops(count_ref, lambda n, c, masked: step(n, c, masked, g), carry)

  zeros = jnp.zeros(kb.shape, jnp.float32)
  dk, dv = jax.lax.fori_loop(0, q_ref.shape[1], head, (zeros, zeros))
  dk_ref[...] = (dk * (scale2 / LOG2E)).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dkv(q, k, v, rows, do, lse2, delta, cfg: _Cfg):
  b, tp, kh, g, d = q.shape
  sp = k.shape[1]
  bq, bk = cfg.blocks.q_dkv, cfg.blocks.k_dkv
  order, count = tile_lists(jnp.swapaxes(tile_state(rows, bq, bk, sp), 1, 2))   # per key tile
  row = pl.BlockSpec((None, 4, tp), lambda j, r, h: (r, 0, 0))
  heads = pl.BlockSpec((None, tp, None, g, d), lambda j, r, h: (r, 0, h, 0, 0))
  stat = pl.BlockSpec((None, None, g, tp), lambda j, r, h: (r, h, 0, 0))
  tile = pl.BlockSpec((None, bk, None, d), lambda j, r, h: (r, j, h, 0))
  return pl.pallas_call(
      functools.partial(_dkv_kernel, scale2=cfg.scale * LOG2E, bq=bq),
      grid=(sp // bk, b, kh),
      in_specs=[row,
                pl.BlockSpec((None, None, tp // bq), lambda j, r, h: (r, j, 0)),
                pl.BlockSpec((None, None, 2), lambda j, r, h: (r, j, 0)),
                heads, heads, stat, stat, tile, tile],
      out_specs=[tile, tile],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=_compiler_params(cfg, cfg.blocks.warps_bwd),
      interpret=cfg.interpret,
      name="range_flash_dkv",
  )(rows, order, count, q, do, lse2, delta, k, v)


# ---- on a mesh: per row and kv head ----------------------------------------------------------------
_SPECS = {"q": lambda r, h: P(r, None, h, None, None), "kv": lambda r, h: P(r, None, h, None),
          "rows": lambda r, h: P(r, None, None), "stat": lambda r, h: P(r, h, None, None)}


def _partitioned(fn, args: tuple, outs: tuple, rule: str):
  """fn(*arrays, cfg) under custom_partitioning: on a mesh each device runs it on its own rows and
  kv heads (k's sharding decides: the operands' kinds in `args`/`outs` are _SPECS keys), no
  communication; XLA cannot split a Pallas call and would otherwise gather every operand."""
  wrapped = custom_partitioning(fn, static_argnums=(len(args),))

  def shardings(mesh, arg_shapes, kinds):
    spec = tuple(getattr(arg_shapes[1].sharding, "spec", ())) + (None,) * 4     # k [b, S, K, D]
    out = tuple(NamedSharding(mesh, _SPECS[kind](spec[0], spec[2])) for kind in kinds)
    return out if len(out) > 1 else out[0]

  def infer(cfg, mesh, arg_shapes, result_shape):
    del cfg, result_shape
    return shardings(mesh, arg_shapes, outs)

  def partition(cfg, mesh, arg_shapes, result_shape):
    del result_shape
    return mesh, lambda *a: fn(*a, cfg), shardings(mesh, arg_shapes, outs), shardings(mesh, arg_shapes, args)

  wrapped.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule)
  return wrapped


_IN = "b t k g d, b s k d, b s k d, b f t"
_BWD_IN = ("q", "kv", "kv", "rows", "q", "stat", "stat")
_forward_p = _partitioned(_forward, ("q", "kv", "kv", "rows"), ("q", "stat"), _IN + " -> b t k g d, b k g t")
_dq_p = _partitioned(_dq, _BWD_IN, ("q",), _IN + ", b t k g d, b k g t, b k g t -> b t k g d")
_dkv_p = _partitioned(_dkv, _BWD_IN, ("kv", "kv"), _IN + ", b t k g d, b k g t, b k g t -> b s k d, b s k d")


# ---- custom VJP --------------------------------------------------------------------------------------
def flash_vjp(forward, dq, dkv):
  """flash(q, k, v, rows, cfg) -> out, differentiable in q, k, v, from the three calls (here's, or
  flash_tpu's): forward(q, k, v, rows, cfg) -> (out, lse [b,K,G,Tp]); dq(q, k, v, rows, do, lse, delta,
  cfg) -> dq and dkv(the same) -> (dk, dv), delta = rowsum(dO * O) [b,K,G,Tp] f32."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
  def flash(q, k, v, rows, cfg):
    return forward(q, k, v, rows, cfg)[0]

  def flash_fwd(q, k, v, rows, cfg):
    out, lse = forward(q, k, v, rows, cfg)
    return out, (q, k, v, rows, out, lse)

  def flash_bwd(cfg, res, do):
    q, k, v, rows, out, lse = res
    do = do.astype(q.dtype)
    delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)   # [b,Tp,K,G]
    delta = jnp.transpose(delta, (0, 2, 3, 1))                                      # [b,K,G,Tp]
    return (dq(q, k, v, rows, do, lse, delta, cfg), *dkv(q, k, v, rows, do, lse, delta, cfg), None)

  flash.defvjp(flash_fwd, flash_bwd)
  return flash


_flash = flash_vjp(_forward_p, _dq_p, _dkv_p)
