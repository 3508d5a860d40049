"""Shared-prefix KV reuse: a prompt prefix that every row shares (the re-ranking prompt's system
message and instructions) is prefilled once and its K/V copied into each row or serving slot, so
a prefill computes only the slots after it. `DecodeConfig.shared_prefix` turns it on.

Why the copy is the row's own K/V. Rows are left-padded (decode/sampler.py): row b's prompt fills
slots [pad_b, P), pad_b = P - len_b, at positions 0 .. len_b - 1 (`masks.left_pad_positions`:
position 0 is the row's first real token, whatever its padding), and a prompt slot attends only
the row's real slots up to itself (causal). So the K/V of a row's first L tokens are a function of
those L tokens at positions 0 .. L - 1 and nothing else: for a prefix every row shares, one causal
forward of the L tokens alone (`prefix_cache`, batch 1, L slots) gives what each row's own prefill
would write at its slots [pad_b, pad_b + L). `copy_prefix` writes it there (one
`dynamic_update_slice` per row at its pad offset).

The rest of the prompt (`prefill`). The prompt slots after the prefix run as one window
[L, end) against the cache, of static start and width shared by every row (`end` = P for the
decoder, P - 1 for the speculative verifier, which leaves the last prompt token pending): end - L
slots per row instead of end. In a row shorter than the longest, the window's first slots are
that row's pad slots (their queries see no key, as in the full prefill; their K/V are never read)
and the tail of its prefix, recomputed with the same inputs (what the full prefill does for every
slot). The window's last slot is every row's last prompt slot, so `hidden[:, -1]` is what the
full prefill's is: the state predicting the first response token.

Floating point. Computed by a batch-1 forward, the copied K/V are the same function of the same
inputs, but XLA's CPU kernels pick their blocking by operand shape, so from the second layer on
(where attention feeds the K/V) they can differ from the batched prefill's in the last bits
(~1e-6 relative in float32, measured); that is the same kind of difference the batched decoder
already has against one row decoded alone (decode/reference.py; tests compare log-probs to 1e-5).
Tokens, commit steps and NFE are equal in every test (tests/test_prefix.py); a near-tie of two
tokens' probabilities, or of a confidence and tau, could in principle resolve differently. This
is why `shared_prefix` is off by default.

Which prefix (`resolve`, on the host, per batch): `shared_prefix` -1 takes the batch's longest
common token prefix, rounded down to a multiple of AUTO_ROUND tokens (each length is a compiled
decoder: rounding keeps the batches of one task on one or two); N > 0 takes the same prefix
capped at N tokens, not rounded (N = the known system prompt's length). Either way at most the
shortest prompt's length - 1 (every row prefills at least its last token, whose hidden state
predicts the first response token) and nothing for a single prompt (nothing to share in one
call). A batch whose prompts share no such prefix is prefilled in full. The serving slots
(serve/slots.py) keep one prefix, prefilled once for the server's life, and reuse it for every
request that starts with it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dgr2_jax.model import masks, qwen3
from dgr2_jax.model.config import Qwen3Config

# `shared_prefix = -1`: the detected prefix is rounded down to a multiple of this many tokens.
AUTO_ROUND = 16


def common_prefix_len(prompts: Sequence[Sequence[int]]) -> int:
  """Length of the longest token prefix every prompt starts with."""
  if not prompts:
    return 0
  n = min(len(p) for p in prompts)
  first = np.asarray(prompts[0][:n])
  for p in prompts[1:]:
    diff = np.flatnonzero(np.asarray(p[:n]) != first[:n])
    n = int(diff[0]) if diff.size else n
  return n


def resolve(shared_prefix: int, prompts: Sequence[Sequence[int]]) -> int:
  """The prefix length L a batch decodes with (module docstring); 0 = a full prefill."""
  if shared_prefix == 0 or len(prompts) < 2:
    return 0
  n = min(common_prefix_len(prompts), min(len(p) for p in prompts) - 1)
  if shared_prefix > 0:
    return max(0, min(n, int(shared_prefix)))
  return max(0, n) // AUTO_ROUND * AUTO_ROUND


def prefix_cache(config: Qwen3Config, params, tokens) -> qwen3.Cache:
  """K/V of the prefix tokens [L] at positions 0 .. L - 1: one causal forward of batch 1 into a
  cache of L slots. `config` / `params` as the decoder runs them (layers unstacked)."""
  n = tokens.shape[-1]
  cache = qwen3.init_cache(config, 1, n)
  ranges = masks.sequence_ranges(jnp.full((1,), n, jnp.int32), n, n, config.block_size, q_slots=np.arange(n))
  _, cache = qwen3.forward(config, params, jnp.reshape(tokens, (1, n)), jnp.arange(n)[None], ranges, cache, 0,
                           return_hidden=True)
  return cache


def copy_prefix(cache: qwen3.Cache, pcache: qwen3.Cache, start) -> qwen3.Cache:
  """`pcache`'s L slots (batch 1) written into every row of `cache` at the row's slot start [B]."""
  def put(buf, kv):
    kv = kv[0].astype(buf.dtype)                                        # [L,K,D]
    return jax.vmap(lambda b_, s: jax.lax.dynamic_update_slice(b_, kv, (s, 0, 0)))(buf, start)
  return jax.tree_util.tree_map(put, cache, pcache)


def row_prefix(prompt_tokens, prompt_len, n: int):
  """The first n real tokens of row 0 of left-padded prompts [B,P] (every row shares them)."""
  p = prompt_tokens.shape[1]
  return jax.lax.dynamic_slice_in_dim(prompt_tokens[0], p - prompt_len[0], n)


Window = Callable  # (tokens [B,W], start slot, cache) -> (hidden [B,W,E], cache): sampler.window_forward's


def prefill(config: Qwen3Config, params, prompt_tokens, prompt_len, cache, n: int, end: int, window: Window,
            pcache: qwen3.Cache | None = None):
  """The prompt slots [0, end) of left-padded prompts [B,P] into `cache`: with n = 0 one window
  over them (the full prefill), else the shared n-token prefix's K/V (`pcache`, or computed here
  from row 0) copied into each row and one window over [n, end) (module docstring).
  -> (hidden of the window's slots [B, end - n, E], None when the window is empty; cache)."""
  if n == 0:
    return window(prompt_tokens[:, :end], 0, cache)
  if pcache is None:
    pcache = prefix_cache(config, params, row_prefix(prompt_tokens, prompt_len, n))
  cache = copy_prefix(cache, pcache, (prompt_tokens.shape[1] - prompt_len).astype(jnp.int32))
  if end == n:
    return None, cache
  return window(prompt_tokens[:, n:end], n, cache)


def prefill_counts(prompt_lens: Sequence[int], prompt_slots: int, n: int) -> dict:
  """Prefill work per request of one batch of prompts (lengths `prompt_lens`, left-padded to
  `prompt_slots`) without and with a shared prefix of n tokens: slots run through the model
  (`*_slots`: the padded window, the prefix's own forward shared by the batch) and real prompt
  tokens (`*_tokens`)."""
  b, p = len(prompt_lens), int(prompt_slots)
  real = float(np.mean(prompt_lens))
  return dict(rows=b, prompt_slots=p, prefix=int(n), full_slots=float(p), reuse_slots=(p - n) + n / b,
              full_tokens=real, reuse_tokens=real - n + n / b)
