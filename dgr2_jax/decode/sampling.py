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
  # The sort behind top-k / top-p costs O(V log V) per position: skip it when both are off.
  x = jax.lax.cond((top_k > 0) | (top_p < 1.0), lambda y: _filter_top_k_top_p(y, top_k, top_p),
                   lambda y: y, x)
  return jax.nn.log_softmax(x, axis=-1)


def choose_tokens(key, logprobs: jnp.ndarray, temperature) -> jnp.ndarray:
  """Greedy argmax when temperature == 0, else a categorical draw. logprobs [..., V] -> [...]."""
  return jax.lax.cond(temperature > 0,
                      lambda lp: jax.random.categorical(key, lp, axis=-1).astype(jnp.int32),
                      lambda lp: jnp.argmax(lp, axis=-1).astype(jnp.int32), logprobs)


def _filter_top_k_top_p(x, top_k, top_p):
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
