"""The block-diffusion prediction for every response index in one pass (multi-stream layout).

This is the training-side twin of the decoder (docs/design.md, "CFT" and
"Replay"). The input is `[prompt (P) | clean response (R) | G noisy segments of B tokens]`:
  * the clean copy plays the role of the decoder's K/V-write pass (block j sees blocks <= j);
  * each noisy segment is one canvas of one block j (CFT: the corrupted block; replay: the canvas
    at one denoising step) and sees the prompt, the clean blocks < j and itself.
The prediction for response index r (AR token shift):
  * r % B == 0: clean-stream hidden state at slot r - 1 (the last prompt token when r = 0);
  * otherwise: hidden state at in-block index r % B - 1 of segment `pred_seg[r]`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dgr2_jax.model import attention, masks, qwen3
from dgr2_jax.model.config import Qwen3Config


def stream_layout(prompt_slots: int, response_len: int, block_size: int, seg_block: np.ndarray):
  """Static per-token attributes [N] of the layout (numpy)."""
  p, r, b = prompt_slots, response_len, block_size
  g = len(seg_block)
  kind = np.concatenate([np.full(p, masks.PROMPT), np.full(r, masks.CLEAN), np.full(g * b, masks.NOISY)])
  block = np.concatenate([np.arange(p), np.arange(r) // b, np.repeat(np.asarray(seg_block, int), b)])
  seg = np.concatenate([np.full(p + r, -1), np.repeat(np.arange(g), b)])
  # response index each token stands for (-1 for prompt): its position is prompt_len + index.
  resp_index = np.concatenate([np.full(p, -1), np.arange(r),
                               (np.asarray(seg_block, int)[:, None] * b + np.arange(b)[None]).reshape(-1)])
  return dict(kind=kind, block=block, seg=seg, resp_index=resp_index)


def stream_ranges(prompt_len, prompt_slots: int, response_len: int, block_size: int,
                  seg_block: np.ndarray):
  """`attention.Streams` of the layout: the context [prompt | clean] follows the single-stream
  rule; a segment of block j sees the context keys before clean block j (prompt + clean < j)."""
  ctx = masks.sequence_ranges(prompt_len, prompt_slots, prompt_slots + response_len, block_size)
  seg_hi = prompt_slots + np.asarray(seg_block, np.int32) * block_size
  seg_hi = jnp.broadcast_to(jnp.asarray(seg_hi, jnp.int32)[None], (ctx.lo.shape[0], len(seg_block)))
  return attention.Streams(ctx, seg_hi, prompt_slots=prompt_slots, block_size=block_size,
                           segment_blocks=tuple(int(j) for j in seg_block))


def response_predictions(config: Qwen3Config, params, prompt, prompt_len, clean, seg_tokens,
                         seg_block: np.ndarray, pred_seg, block_size: int | None = None,
                         dense_mask: bool = False):
  """f32 logits [b, R, V] of `response_hidden` (small vocabularies, tests; losses project the hidden
  states in chunks, model/logits.py)."""
  return qwen3.lm_head(config, params, response_hidden(config, params, prompt, prompt_len, clean, seg_tokens,
                                                       seg_block, pred_seg, block_size, dense_mask))


def response_hidden(config: Qwen3Config, params, prompt, prompt_len, clean, seg_tokens,
                    seg_block: np.ndarray, pred_seg, block_size: int | None = None,
                    dense_mask: bool = False):
  """Final hidden states [b, R, E] whose projection is the model's distribution for each index.

  prompt [b,P] left-padded; prompt_len [b]; clean [b,R]; seg_tokens [b,G,B]; seg_block [G] static
  (block of each segment); pred_seg [b,R] int (segment predicting r; ignored when r % B == 0).
  `dense_mask` = the plain [N,N]-masked attention instead of the key ranges of `stream_ranges`
  (the same function; kept as the reference and for benchmarks/replay_cost.py).
  """
  bsz = block_size or config.block_size
  b, p = prompt.shape
  r = clean.shape[1]
  g = len(seg_block)
  lay = stream_layout(p, r, bsz, seg_block)
  tokens = jnp.concatenate([prompt, clean, seg_tokens.reshape(b, g * bsz)], axis=1).astype(jnp.int32)
  n = tokens.shape[1]
  prompt_valid = masks.left_pad_valid(prompt_len, p, p)
  key_valid = jnp.concatenate([prompt_valid, jnp.ones((b, n - p), bool)], axis=1)
  prompt_pos = masks.left_pad_positions(prompt_len, p, p)
  resp_pos = jnp.asarray(prompt_len)[:, None] + jnp.asarray(lay["resp_index"][p:])[None, :]
  positions = jnp.concatenate([prompt_pos, resp_pos], axis=1)
  # The dense [N,N] mask of this layout is masks.stream_mask; attention takes it as key ranges
  # (attention.Streams): context x context, and each segment x (context range + itself).
  if dense_mask:
    mask = masks.stream_mask(lay["kind"], lay["block"], lay["seg"], lay["kind"], lay["block"], lay["seg"],
                             key_valid)                                                      # [b,N,N]
  else:
    mask = stream_ranges(prompt_len, p, r, bsz, seg_block)
  hidden, _ = qwen3.forward(config, params, tokens, positions, mask, return_hidden=True)  # [b,N,E]
  ridx = jnp.arange(r)[None, :]
  in_block = ridx % bsz
  src = jnp.where(in_block == 0, p + ridx - 1, p + r + jnp.asarray(pred_seg) * bsz + in_block - 1)
  return jnp.take_along_axis(hidden, src[..., None], axis=1)            # [b,R,E]
