"""Trajectory replay: rebuild the canvas of the step that committed each token and score it.

A rollout (from `decode.sampler.generate`) stores per response index the token, its
`commit_step` (-1 = never committed, e.g. after EOS) and the decode-time log-prob. For block j with
distinct commit steps s_1 < ... < s_k, the canvas at step s_m is the rollout's tokens with every
position of block j whose commit_step >= s_m (or -1) replaced by the mask token; earlier blocks are
clean. Each canvas becomes one noisy segment of `model/streams.py`, so a whole rollout is scored in
one pass. Host-side NumPy builds the segments (explicit, static shapes); the scoring is jitted.

Cost: the layout holds `cap` segments per block, where cap is the most steps any block of the batch
used, rounded up to a power of two, and at most `max_segments_per_block`. When a block used more
steps than the cap, neighbouring steps are merged: a merged group is scored on the canvas of its
earliest step (its tokens see less context than at decode time) and the row is flagged inexact.
With `max_segments_per_block` = block size replay is always exact.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dgr2_jax.decode import sampling
from dgr2_jax.model import logits as logits_lib
from dgr2_jax.model import qwen3
from dgr2_jax.model import streams


def build_segments(tokens: np.ndarray, commit_step: np.ndarray, block_size: int,
                   max_segments_per_block: int, mask_id: int):
  """-> dict(seg_tokens [b, nb*cap, B], seg_block [nb*cap], pred_seg [b,R], exact [b], clean [b,R])."""
  b, r = tokens.shape
  bs = block_size
  nb = r // bs
  # Segments per block: enough for the most steps any block of the batch used (rounded up to a
  # power of two, so few shapes compile), at most `max_segments_per_block`.
  per_block = commit_step.reshape(b, nb, bs)
  used = max([len(np.unique(c[c >= 0])) for c in per_block.reshape(-1, bs)] + [1])
  cap = max(1, min(max_segments_per_block, 1 << (used - 1).bit_length()))
  seg_tokens = np.full((b, nb * cap, bs), mask_id, np.int32)
  pred_seg = np.zeros((b, r), np.int32)
  exact = np.ones((b,), bool)
  clean = np.where(commit_step >= 0, tokens, mask_id).astype(np.int32)
  for row in range(b):
    for j in range(nb):
      cs = commit_step[row, j * bs:(j + 1) * bs]
      steps = np.unique(cs[cs >= 0])
      if len(steps) > cap:
        exact[row] = False
      # Group m of the block's n distinct steps; groups are 0..min(cap, n)-1, each non-empty, and
      # neighbouring steps share a group only when n > cap.
      groups = (np.arange(len(steps)) * min(cap, len(steps))) // max(len(steps), 1)
      for m in range(min(cap, len(steps))):
        first = steps[groups == m].min()
        canvas = clean[row, j * bs:(j + 1) * bs].copy()
        canvas[(cs >= first) | (cs < 0)] = mask_id
        seg_tokens[row, j * cap + m] = canvas
      for i in range(bs):
        if cs[i] >= 0:
          pred_seg[row, j * bs + i] = j * cap + groups[np.searchsorted(steps, cs[i])]
  seg_block = np.repeat(np.arange(nb), cap)
  return dict(seg_tokens=seg_tokens, seg_block=seg_block, pred_seg=pred_seg, exact=exact, clean=clean)


def segments_per_block(seg_tokens, response_len: int) -> int:
  """The cap of a layout: its segments [b, nb*cap, B] over the response's nb blocks."""
  _, g, bs = np.shape(seg_tokens)
  return g // (response_len // bs)


def widen_segments(seg_tokens: np.ndarray, pred_seg: np.ndarray, response_len: int, cap: int):
  """The same replay with `cap` segments per block (>= the layout's): block j's segment m moves to
  j * cap + m, the new segments are copies of the block's first (nothing is predicted from them,
  and a segment attends only to the context before its block and to itself, so every prediction
  is unchanged). Lets batches replayed with different caps share one shape (dynamic sampling's
  draws). -> (seg_tokens [b, nb*cap, B], pred_seg [b, R])."""
  nb = response_len // np.shape(seg_tokens)[2]
  old = segments_per_block(seg_tokens, response_len)
  if cap < old:
    raise ValueError(f"widen_segments: cap {cap} is below the layout's {old} segments per block")
  idx = np.repeat(np.arange(nb) * old, cap) + np.tile(np.where(np.arange(cap) < old, np.arange(cap), 0), nb)
  pred = np.asarray(pred_seg)
  return np.asarray(seg_tokens)[:, idx], ((pred // old) * cap + pred % old).astype(pred.dtype)


def replay_hidden(model_config, params, prompt, prompt_len, segments, block_size: int):
  """Final hidden states [b,R,E] whose projection each committed token was sampled from.

  `segments` needs `clean`, `seg_tokens` and `pred_seg` (arrays, so it can be a jit argument).
  """
  if block_size == 1:  # AR: every prediction comes from the clean stream
    b, r = segments["clean"].shape
    return streams.response_hidden(model_config, params, prompt, prompt_len, segments["clean"],
                                   jnp.zeros((b, 0, 1), jnp.int32), np.zeros((0,), int),
                                   jnp.zeros((b, r), jnp.int32), 1)
  r = segments["clean"].shape[1]
  g = segments["seg_tokens"].shape[1]
  seg_block = np.repeat(np.arange(r // block_size), g // (r // block_size))  # static, from shapes
  return streams.response_hidden(model_config, params, prompt, prompt_len, segments["clean"],
                                 segments["seg_tokens"], seg_block, segments["pred_seg"], block_size)


def replay_logits(model_config, params, prompt, prompt_len, segments, block_size: int):
  """f32 logits [b,R,V] (before temperature/top-k/top-p) of `replay_hidden`: small vocabularies
  and tests; the scorers below project in chunks (model/logits.py)."""
  return qwen3.lm_head(model_config, params,
                       replay_hidden(model_config, params, prompt, prompt_len, segments, block_size))


def replay_logprobs(model_config, params, prompt, prompt_len, segments, block_size: int, *,
                    temperature=0.0, top_k=0, top_p=1.0, mask_id=None):
  """Log-prob [b,R] of each committed token under the decoding distribution it was drawn from
  (computed in vocabulary chunks)."""
  hidden = replay_hidden(model_config, params, prompt, prompt_len, segments, block_size)

  def one(lg, tok):
    lp = sampling.decoding_logprobs(lg, temperature, top_k, top_p, mask_id)
    return jnp.take_along_axis(lp, tok[:, None], -1)[:, 0]
  return logits_lib.per_position(model_config, params, one, hidden, jnp.asarray(segments["clean"], jnp.int32))
