"""Per-position token distributions and draws, shared by the decoder and trajectory replay.

A *decoding distribution* is what the commit rule and the recorded log-probabilities refer to:
`softmax(logits / T)` restricted by top-k and top-p and renormalised, with T = 1 when greedy
(temperature 0). Greedy takes its argmax; sampling draws from it. Replay must score committed
tokens under the same distribution, so both sides call `decoding_logprobs`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -1e30


def decoding_logprobs(logits: jnp.ndarray, temperature, top_k, top_p, mask_id: int | None = None
                      ) -> jnp.ndarray:
  """logits [..., V] f32 -> log-probs [..., V] of the decoding distribution.

  temperature, top_k (0 = off), top_p (1.0 = off) may be traced scalars: changing them does not
  recompile. The mask token is never a valid output: its probability is zero.
  """
  t = jnp.where(temperature > 0, temperature, 1.0)
  x = logits.astype(jnp.float32) / t
  if mask_id is not None:
    x = x.at[..., mask_id].set(_NEG)
  # The filters cost a top-k (or, rarely, a sort) per position: skip them when both are off.
  x = jax.lax.cond((top_k > 0) | (top_p < 1.0), lambda y: _filter_top_k_top_p(y, top_k, top_p),
                   lambda y: y, x)
  return jax.nn.log_softmax(x, axis=-1)


def choose_tokens(key, logprobs: jnp.ndarray, temperature) -> jnp.ndarray:
  """Greedy argmax when temperature == 0, else a draw (`categorical`). logprobs [..., V] -> [...]."""
  return jax.lax.cond(temperature > 0, lambda lp: categorical(key, lp),
                      lambda lp: jnp.argmax(lp, axis=-1).astype(jnp.int32), logprobs)


# Entries per chunk of the two-level inverse CDF (`inverse_cdf`).
CDF_CHUNK = 512


def categorical(key, logits: jnp.ndarray) -> jnp.ndarray:
  """One draw from softmax(logits) per position: [..., V] -> [...] int32 (entries of -inf, e.g.
  the mask token or what top-k/top-p removed, are never drawn).

  By inversion, one uniform per position. `jax.random.categorical` (Gumbel-max) generates and
  transforms V random numbers per position instead: at Qwen3's vocabulary that was most of a
  sampled decoding step (benchmarks/sampling_cost.py). Same distribution, another random stream."""
  x = logits.astype(jnp.float32)
  p = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
  return inverse_cdf(p, jax.random.uniform(key, x.shape[:-1], jnp.float32))


def inverse_cdf(p: jnp.ndarray, u: jnp.ndarray, chunk: int = CDF_CHUNK) -> jnp.ndarray:
  """The index i with c[i-1] <= u * c[V-1] < c[i], where c are the cumulative sums of the
  unnormalised probabilities p [..., V] >= 0 and u [...] in [0, 1): i is drawn with probability
  p[i] / sum(p), and an entry with p == 0 (an empty interval) is never returned.

  Two levels, O(V) work and no [..., V] cumulative sum: the cumulative sums of chunks of `chunk`
  entries locate the chunk, a cumulative sum inside that one chunk the entry. Where rounding puts
  the target past the last nonempty interval (u * total rounding up to total, or a chunk's sum
  and the cumulative sum inside it differing in the last bit), the last nonempty one is taken."""
  lead, v = p.shape[:-1], p.shape[-1]
  c = min(chunk, v)
  k0 = v // c
  # Whole chunks, and the rest as one short chunk of its own: padding the whole [..., V] array to
  # a multiple of the chunk instead (jnp.pad) runs ~50x slower on XLA's CPU backend at V = 152,961.
  main = p[..., :k0 * c].reshape(lead + (k0, c))                                        # [...,K0,C]
  tail = p[..., k0 * c:]
  sums = main.sum(-1)
  if tail.shape[-1]:
    sums = jnp.concatenate([sums, tail.sum(-1, keepdims=True)], -1)                    # [...,K]
  cum = jnp.cumsum(sums, -1)
  t = u * cum[..., -1]
  k = jnp.minimum(jnp.sum(cum <= t[..., None], -1), _last_nonzero(sums))                # [...]
  before = jnp.where(k > 0, jnp.take_along_axis(cum, jnp.maximum(k - 1, 0)[..., None], -1)[..., 0], 0.0)
  q = jnp.take_along_axis(main, jnp.minimum(k, k0 - 1)[..., None, None], -2)[..., 0, :]  # [...,C]
  if tail.shape[-1]:
    q = jnp.where((k == k0)[..., None], jnp.pad(tail, [(0, 0)] * len(lead) + [(0, c - tail.shape[-1])]), q)
  i = jnp.sum(jnp.cumsum(q, -1) <= (t - before)[..., None], -1)
  return (k * c + jnp.minimum(i, _last_nonzero(q))).astype(jnp.int32)


def _last_nonzero(x):
  """Index of the last entry > 0 along the last axis."""
  return x.shape[-1] - 1 - jnp.argmax(x[..., ::-1] > 0, axis=-1)


# Candidates of the top-k / top-p filters: `lax.top_k` of this many per position, not a sort of V.
TOP_CANDIDATES = 1024


def _filter_top_k_top_p(x, top_k, top_p):
  """x [..., V] with the entries top-k / top-p remove set to _NEG. From the `TOP_CANDIDATES`
  largest entries (`lax.top_k`) when the kept set provably lies among them (top-k at most that
  many without a tie at the last candidate; top-p whose mass the candidates reach); else from a
  sort of the whole row (`_filter_sorted`), so the result never depends on the shortcut."""
  v = x.shape[-1]
  c = min(TOP_CANDIDATES, v)
  if c == v:
    return _filter_sorted(x, top_k, top_p)
  vals = jax.lax.top_k(x, c)[0]                                                  # [..., C] descending
  on = top_k > 0
  kth = jnp.where(on, jnp.take_along_axis(vals, jnp.broadcast_to(jnp.clip(top_k, 1, c) - 1, x.shape[:-1] + (1,))
                                          .astype(jnp.int32), -1), -jnp.inf)     # [..., 1]
  kept = jnp.where(vals >= kth, vals, _NEG)
  # The top-p distribution is the top-k-renormalised one: over the kept candidates, or the whole row.
  lse = jnp.where(on, jax.nn.logsumexp(kept, -1, keepdims=True), jax.nn.logsumexp(x, -1, keepdims=True))
  p = jnp.exp(kept - lse)
  mass_before = jnp.cumsum(p, -1) - p
  cutoff = jnp.min(jnp.where(mass_before < top_p, kept, jnp.inf), -1, keepdims=True)
  exact = jnp.where(on, (top_k <= c) & (vals[..., -1:] < kth), (top_p >= 1.0) | (mass_before[..., -1:] >= top_p))
  fast = lambda x: jnp.where((top_p < 1.0) & (x < cutoff), _NEG, jnp.where(x >= kth, x, _NEG))
  return jax.lax.cond(jnp.all(exact), fast, lambda x: _filter_sorted(x, top_k, top_p), x)


def _filter_sorted(x, top_k, top_p):
  v = x.shape[-1]
  sorted_desc = -jnp.sort(-x, axis=-1)
  # top-k: keep logits >= the k-th largest.
  k = jnp.clip(jnp.where(top_k > 0, top_k, v), 1, v)
  kth = jnp.take_along_axis(sorted_desc, jnp.broadcast_to(k - 1, x.shape[:-1] + (1,)).astype(jnp.int32), -1)
  x = jnp.where(x >= kth, x, _NEG)
  # top-p: keep the smallest prefix of the sorted distribution whose mass reaches p (always >= 1 token).
  sorted_desc = jnp.where(sorted_desc >= kth, sorted_desc, _NEG)
  probs_sorted = jax.nn.softmax(sorted_desc, axis=-1)
  mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
  keep_sorted = mass_before < top_p
  cutoff = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
  return jnp.where((top_p < 1.0) & (x < cutoff), _NEG, x)
