"""Attention masks as pure functions. Every mask is boolean, True = "query may attend key".

Two layouts exist (see docs/design.md, "Attention"):

* Single stream `[prompt (P slots, left-padded) | response (R slots)]`, used by the AR forward, the
  block-diffusion decoder and its KV cache. Each slot gets a *block id*: prompt slot `s` -> `s`,
  response slot `P + r` -> `P + r // B`. A query may attend a key iff `id(key) <= id(query)` and the
  key is a real token. With B = 1 this is exactly the causal mask.
* Multi stream `[prompt | clean response | noisy segments ...]`, used by CFT and trajectory replay
  so that every block (or every denoising step) trains/scores in one pass. Each token carries
  `(kind, block, segment)`; the rules are in `stream_mask`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dgr2_jax.model import attention

PROMPT, CLEAN, NOISY = 0, 1, 2


def causal_mask(length: int) -> jnp.ndarray:
  """[T, T]: key <= query."""
  idx = jnp.arange(length)
  return idx[None, :] <= idx[:, None]


def padding_mask(key_valid: jnp.ndarray) -> jnp.ndarray:
  """[B, S] real-token flags -> [B, 1, S], broadcastable against [B, T, S]."""
  return key_valid[:, None, :].astype(bool)


def slot_block_ids(prompt_slots: int, total_slots: int, block_size: int) -> jnp.ndarray:
  """[S] block id of each slot of the single-stream layout (prompt causal, response in blocks)."""
  s = jnp.arange(total_slots)
  return jnp.where(s < prompt_slots, s, prompt_slots + (s - prompt_slots) // block_size)


def block_causal_mask(q_ids: jnp.ndarray, k_ids: jnp.ndarray, key_valid: jnp.ndarray) -> jnp.ndarray:
  """Single-stream mask from block ids.

  q_ids: [T] or [B, T]; k_ids: [S]; key_valid: [B, S]. Returns [B, T, S].
  """
  q_ids = jnp.asarray(q_ids)
  if q_ids.ndim == 1:
    q_ids = q_ids[None]
  allowed = k_ids[None, None, :] <= q_ids[:, :, None]
  return allowed & padding_mask(key_valid)


def sequence_mask(prompt_slots: int, total_slots: int, block_size: int,
                  key_valid: jnp.ndarray) -> jnp.ndarray:
  """[B, S, S]: the full single-stream mask over `[prompt | response]` (no cache)."""
  ids = slot_block_ids(prompt_slots, total_slots, block_size)
  return block_causal_mask(ids, ids, key_valid)


def slot_key_end(slots, prompt_slots: int, block_size: int):
  """End (exclusive) of the keys a query at single-stream slot `slots` may see: slot + 1 in the
  prompt (causal), the end of its block in the response. Any shape; traced or static."""
  slots = jnp.asarray(slots)
  resp_end = prompt_slots + ((slots - prompt_slots) // block_size + 1) * block_size
  return jnp.where(slots < prompt_slots, slots + 1, resp_end).astype(jnp.int32)


def sequence_ranges(prompt_len, prompt_slots: int, total_slots: int, block_size: int,
                    q_slots=None) -> attention.Ranges:
  """`attention.Ranges` of the single-stream mask (what `sequence_mask` / `block_causal_mask`
  hold densely): queries at `q_slots` ([T] or [b, T]; default every slot) of left-padded rows.
  Key validity is the range's start: a row's first real slot. Causal (`Ranges.causal`) when
  every query is a prompt slot t seeing [lo, t + 1): the whole layout with block size 1, or
  static `q_slots` = the prompt slots 0 .. P - 1 (the decoder's prefill against its cache)."""
  lo = (prompt_slots - jnp.asarray(prompt_len)).astype(jnp.int32)          # [b]
  prefill = (isinstance(q_slots, np.ndarray) and q_slots.ndim == 1
             and np.array_equal(q_slots, np.arange(prompt_slots)))
  causal = prefill or (q_slots is None and (block_size == 1 or total_slots == prompt_slots))
  q_slots = jnp.arange(total_slots) if q_slots is None else jnp.asarray(q_slots)
  if q_slots.ndim == 1:
    q_slots = jnp.broadcast_to(q_slots[None], (lo.shape[0], q_slots.shape[0]))
  return attention.Ranges(lo, slot_key_end(q_slots, prompt_slots, block_size), causal=causal)


def left_pad_positions(prompt_len: jnp.ndarray, prompt_slots: int, total_slots: int) -> jnp.ndarray:
  """[B, S] position ids for left-padded prompts followed by the response.

  Row b's prompt occupies slots `P - len_b .. P - 1` with positions `0 .. len_b - 1`; response slot
  `P + r` has position `len_b + r`. Pad slots get position 0 (they are never attended).
  """
  s = jnp.arange(total_slots)[None, :]
  pad = prompt_slots - jnp.asarray(prompt_len)[:, None]
  return jnp.maximum(s - pad, 0)


def left_pad_valid(prompt_len: jnp.ndarray, prompt_slots: int, total_slots: int) -> jnp.ndarray:
  """[B, S] True on real prompt slots and on every response slot."""
  s = jnp.arange(total_slots)[None, :]
  pad = prompt_slots - jnp.asarray(prompt_len)[:, None]
  return s >= pad


def stream_mask(q_kind, q_block, q_seg, k_kind, k_block, k_seg, key_valid) -> jnp.ndarray:
  """Multi-stream block-diffusion mask. Per-token arrays are [N] (shared by the batch).

  kind: PROMPT / CLEAN / NOISY. block: prompt tokens carry their slot index (causal among
  themselves), response tokens their block index. seg: which noisy segment a NOISY token is in.
    PROMPT query: PROMPT keys with block <= its own (causal prompt).
    CLEAN query, block j: all PROMPT keys; CLEAN keys of blocks <= j.
    NOISY query, block j, segment g: all PROMPT keys; CLEAN keys of blocks < j; NOISY keys of segment g.
  Returns [B, Nq, Nk].
  """
  qk, qb, qs = (jnp.asarray(a)[:, None] for a in (q_kind, q_block, q_seg))
  kk, kb, ks = (jnp.asarray(a)[None, :] for a in (k_kind, k_block, k_seg))
  prompt_q = (qk == PROMPT) & (kk == PROMPT) & (kb <= qb)
  clean_q = (qk == CLEAN) & ((kk == PROMPT) | ((kk == CLEAN) & (kb <= qb)))
  noisy_q = (qk == NOISY) & ((kk == PROMPT) | ((kk == CLEAN) & (kb < qb)) | ((kk == NOISY) & (ks == qs)))
  return (prompt_q | clean_q | noisy_q)[None] & padding_mask(key_valid)


def two_stream_layout(prompt_slots: int, response_len: int, block_size: int):
  """Token attributes of `[prompt | noisy copy (R) | clean copy (R)]` for CFT (numpy, static).

  Returns dict of [N] arrays: kind, block, seg, and `slot` = the single-stream slot each token
  stands for (so positions can be gathered from the single-stream position ids).
  """
  p, r, b = prompt_slots, response_len, block_size
  resp_blocks = np.arange(r) // b
  kind = np.concatenate([np.full(p, PROMPT), np.full(r, NOISY), np.full(r, CLEAN)])
  block = np.concatenate([np.arange(p), resp_blocks, resp_blocks])
  seg = np.concatenate([np.full(p, -1), resp_blocks, np.full(r, -1)])
  slot = np.concatenate([np.arange(p), p + np.arange(r), p + np.arange(r)])
  return dict(kind=kind, block=block, seg=seg, slot=slot)
