"""Vocabulary-sized terms in chunks of positions: memory O(chunk x V), never O(tokens x V).

A `[tokens, V]` f32 array costs 4V bytes a token: 0.6 MB at Qwen3's vocabulary plus the SID and
mask tokens, so one such array over 32 rollouts x 512 tokens is 10 GB, and a loss and its
gradient hold several. Every loss, replay scorer and teacher cache therefore takes the final
hidden states `[..., E]` and maps each position to its per-position results (a log-prob, a KL,
an argmax, a top-k) with `map_positions`: the positions are flattened and cut into chunks of
`positions_per_chunk`, the chunk's logits exist only inside one step of a `lax.map`, and the
step is rematerialised (`jax.checkpoint`) so the backward pass recomputes them chunk by chunk
instead of keeping every chunk's. When every position fits in one chunk (small vocabularies)
`fn` runs once on all of them, exactly as an unchunked loss would.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# f32 elements of one chunk's logits (64 MiB); `Qwen3Config.logits_chunk` > 0 overrides it.
CHUNK_ELEMENTS = 2**24


def positions_per_chunk(vocab_size: int, num_positions: int, chunk: int = 0) -> int:
  """Positions a chunk holds: `chunk` when > 0, else as many as fit in CHUNK_ELEMENTS."""
  per = int(chunk) if chunk > 0 else max(1, CHUNK_ELEMENTS // max(int(vocab_size), 1))
  return max(1, min(per, int(num_positions)))


def map_positions(fn, xs, chunk: int):
  """`fn(xs_chunk) -> pytree` over the leading axis of every leaf of `xs` ([N, ...]), `chunk`
  positions at a time (rematerialised in the backward pass). Results have leading axis N."""
  leaves = jax.tree_util.tree_leaves(xs)
  n = leaves[0].shape[0]
  if chunk >= n:
    return fn(xs)
  pad = -n % chunk
  split = lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape((-1, chunk) + x.shape[1:])
  ys = jax.lax.map(jax.checkpoint(fn), jax.tree_util.tree_map(split, xs))
  return jax.tree_util.tree_map(lambda y: y.reshape((-1,) + y.shape[2:])[:n], ys)


def per_position(config, params, fn, hidden, *extras):
  """`fn(logits [n, V] f32, *extras) -> pytree of per-position arrays [n, ...]` over hidden
  [..., E] (and `extras` with the same leading dims), chunked as `config.logits_chunk` or
  CHUNK_ELEMENTS say. Results have hidden's leading dims."""
  from dgr2_jax.model import qwen3
  lead = hidden.shape[:-1]
  n = 1
  for s in lead:
    n *= s
  flat = (hidden.reshape(n, hidden.shape[-1]),) + tuple(e.reshape((n,) + e.shape[len(lead):]) for e in extras)
  chunk = positions_per_chunk(config.vocab_size, n, getattr(config, "logits_chunk", 0))

  def one(xs):
    h, *ex = xs
    return fn(qwen3.lm_head(config, params, h), *ex)

  out = map_positions(one, flat, chunk)
  return jax.tree_util.tree_map(lambda y: y.reshape(lead + y.shape[1:]), out)
