"""Vocabulary-sized terms in chunks of positions: memory O(chunk x V), never O(tokens x V); and
the decoder's per-step vocabulary term, which reads the LM head once per step.

A `[tokens, V]` f32 array costs 4V bytes a token: 0.6 MB at Qwen3's vocabulary plus the SID and
mask tokens, so one such array over 32 rollouts x 512 tokens is 10 GB, and a loss and its
gradient hold several. Every loss, replay scorer and teacher cache therefore takes the final
hidden states `[..., E]` and maps each position to its per-position results (a log-prob, a KL,
an argmax, a top-k) with `map_positions`: the positions are flattened and cut into chunks of
`positions_per_chunk`, the chunk's logits exist only inside one step of a `lax.map`, and the
step is rematerialised (`jax.checkpoint`) so the backward pass recomputes them chunk by chunk
instead of keeping every chunk's. When every position fits in one chunk (small vocabularies)
`fn` runs once on all of them, exactly as an unchunked loss would.

Decoding is bound by reading the weights, so a decoding step's vocabulary term must not re-read
the LM head per chunk of positions (at batch 64 x a 32-slot window, chunks of 2^24 / V positions
read the 1.2 GB head of Qwen3-8B 22 times a step). `fits_budget` says whether a step's f32 logits
fit `Qwen3Config.logits_budget_bytes` (then: one matmul over every position); beyond it,
`greedy_over_vocab` walks the head in tiles of columns with a running max, first argmax and
sum of exponentials: one read of the head, one tile's logits alive at a time.
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


def fits_budget(config, num_positions: int) -> bool:
  """Whether num_positions rows of f32 logits fit `config.logits_budget_bytes`."""
  return 4 * int(num_positions) * int(config.vocab_size) <= int(config.logits_budget_bytes)


def vocab_tile(config, num_positions: int) -> int:
  """Columns of the LM head per tile of `greedy_over_vocab`: the widest whose f32 logits over
  num_positions rows fit `config.logits_budget_bytes` (at least 1, at most V)."""
  per = int(config.logits_budget_bytes) // (4 * max(int(num_positions), 1))
  return max(1, min(int(config.vocab_size), per))


def greedy_over_vocab(config, params, hidden, mask_id):
  """(token int32, log-prob f32) of the argmax of softmax(logits) without the mask token, per
  position of hidden [..., E], reading the LM head once in tiles of `vocab_tile` columns (a
  `lax.scan`; the last tile is clamped to end at V and masks the columns an earlier tile saw).
  Carried per position: the running max, the first index reaching it (an earlier tile wins ties,
  as the first argmax of the whole row would) and the sum of exp(logit - running max). The
  same token and, up to the order of the f32 sums, the same log-prob as `sampler._greedy_choice`
  over the whole row."""
  lead, e = hidden.shape[:-1], hidden.shape[-1]
  dt = config.jnp_dtype
  h = hidden.reshape(-1, e).astype(dt)                                        # [M,E]
  m, v = h.shape[0], int(config.vocab_size)
  t = vocab_tile(config, m)
  tied = config.tie_word_embeddings
  from dgr2_jax.model import qwen3
  w, scale = qwen3.head_weight(config, params)   # [V,E] | [E,V]; scale [V] of a float8 head (decode_params)
  w, h = qwen3.in_step(w, h)

  def tile(carry, i):
    top, tok, s = carry                                                       # [M] f32, int32, f32
    start = jnp.minimum(i * t, v - t)
    wt = jax.lax.dynamic_slice_in_dim(w, start, t, axis=0 if tied else 1).astype(dt)
    x = jnp.einsum("me,te->mt" if tied else "me,et->mt", h, wt, preferred_element_type=jnp.float32)
    if scale is not None:
      x = x * jax.lax.dynamic_slice_in_dim(scale, start, t)
    col = start + jnp.arange(t, dtype=jnp.int32)                              # [t]
    x = jnp.where((col == mask_id) | (col < i * t), -jnp.inf, x)              # [M,t]
    t_top = jnp.max(x, axis=-1)
    t_tok = jnp.min(jnp.where(x == t_top[:, None], col, v), axis=-1)
    new = jnp.maximum(top, t_top)
    ref = jnp.where(jnp.isneginf(new), 0.0, new)                              # all -inf so far: sums stay 0
    s = s * jnp.exp(top - ref) + jnp.sum(jnp.exp(x - ref[:, None]), axis=-1)
    return (new, jnp.where(t_top > top, t_tok, tok), s), None

  init = (jnp.full((m,), -jnp.inf, jnp.float32), jnp.zeros((m,), jnp.int32), jnp.zeros((m,), jnp.float32))
  (top, tok, s), _ = jax.lax.scan(tile, init, jnp.arange(-(-v // t), dtype=jnp.int32))
  lse = top + jnp.log(s)
  return tok.reshape(lead), (top - lse).reshape(lead)
