"""Plain-Python reference decoder: no KV cache, no while-loop, the whole sequence recomputed per step.

It exists to check `sampler.generate` (the jitted decoder) commit for commit. It follows
../shared/design/block-diffusion.md literally: at every denoising step it runs the full forward over
`[prompt | blocks < j (clean) | canvas of block j | later blocks]` with the single-stream block-causal mask, reads
the prediction for response index r from slot P + r - 1, and applies the commit rule in Python.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dgr2_jax.decode import sampling
from dgr2_jax.decode.sampler import DecodeConfig, left_pad
from dgr2_jax.model import masks, qwen3


def _np_log_softmax(x):
  x = x.astype(np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def reference_decode(model_config, params, prompts, dc: DecodeConfig, rng=None, max_prompt_len=None):
  if dc.block_size > 1:
    model_config = model_config.as_block_diffusion(dc.block_size, dc.mask_token_id)
  rng = jax.random.PRNGKey(0) if rng is None else rng
  max_prompt_len = max_prompt_len or max(len(x) for x in prompts)
  tokens, lengths = left_pad(prompts, max_prompt_len, dc.pad_id)
  b, p = tokens.shape
  bs, r = dc.block_size, dc.max_new_tokens
  m = dc.mask_token_id if dc.mask_token_id is not None else dc.pad_id
  canvas = np.full((b, r), m, np.int64)
  commit_step = np.full((b, r), -1, np.int64)
  logprob = np.zeros((b, r), np.float64)
  eos_pos = [r] * b
  done = [False] * b
  nfe = [0] * b
  step = 0
  row_keys = jax.random.split(rng, b)
  greedy_plain = dc.temperature == 0 and dc.top_k == 0 and dc.top_p == 1.0
  fwd = jax.jit(lambda prm, t, pos, msk: qwen3.forward(model_config, prm, t, pos, msk)[0])

  for j in range(r // bs):
    if all(done):
      break
    block_start = step
    while True:
      cands = [[i for i in range(bs) if not done[row] and canvas[row, j * bs + i] == m
                and j * bs + i < eos_pos[row]] for row in range(b)]
      if not any(cands):
        break
      # The whole sequence, later blocks included (still masks): the block-causal mask hides them.
      length = p + r
      seq = np.concatenate([tokens, canvas], axis=1)
      valid = masks.left_pad_valid(lengths, p, length)
      mask = masks.sequence_mask(p, length, bs, valid)
      pos = masks.left_pad_positions(lengths, p, length)
      logits = np.asarray(fwd(params, jnp.asarray(seq, jnp.int32), pos, mask))  # [B, L, V]
      ran = not (bs == 1 and j == 0)  # AR block 0 is predicted by the prefill itself
      for row in range(b):
        if not cands[row]:
          continue
        nfe[row] += int(ran)
        preds = logits[row, p + j * bs - 1: p + j * bs + bs - 1]  # [bs, V]: slot P+r-1 predicts r
        if greedy_plain:
          preds = preds.copy(); preds[:, m] = -np.inf
          lp = _np_log_softmax(preds)
          tok = lp.argmax(-1)
        else:
          lp_j = sampling.decoding_logprobs(jnp.asarray(preds), dc.temperature, dc.top_k, dc.top_p, m)
          key = jax.random.fold_in(row_keys[row], step)
          tok = np.asarray(sampling.choose_tokens(key, lp_j, dc.temperature))
          lp = np.asarray(lp_j, np.float64)
        conf = {i: float(np.exp(lp[i, tok[i]])) for i in cands[row]}
        # The step budget: at least ceil(m / steps left) commits, most confident first.
        left = max(dc.steps_per_block - (step - block_start), 1) if dc.steps_per_block else bs
        k_min = -(-len(cands[row]) // left)
        top = sorted(cands[row], key=lambda i: (-conf[i], i))[:k_min]
        chosen = [i for i in cands[row] if (dc.threshold < 1.0 and conf[i] >= dc.threshold) or i in top]
        for i in chosen:
          canvas[row, j * bs + i] = tok[i]
          commit_step[row, j * bs + i] = step
          logprob[row, j * bs + i] = lp[i, tok[i]]
          if int(tok[i]) in dc.eos_ids:
            eos_pos[row] = min(eos_pos[row], j * bs + i)
      step += 1
    for row in range(b):
      if eos_pos[row] < (j + 1) * bs:
        done[row] = True
  output_ids = [canvas[row, :min(eos_pos[row] + 1, r)].tolist() for row in range(b)]
  return dict(tokens=canvas, commit_step=commit_step, logprob=logprob, nfe=np.asarray(nfe),
              eos_pos=np.asarray(eos_pos), steps=step, output_ids=output_ids)
