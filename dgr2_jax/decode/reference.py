"""Plain-Python reference decoder: no KV cache, no while-loop, the whole sequence recomputed per step.

It exists to check `sampler.generate` (the jitted decoder) commit for commit. It follows
../shared/design/block-diffusion.md literally, one row at a time (rows are independent: each has
its own blocks, steps and key `fold_in(split(rng, B)[row], step)`): at every denoising step it
runs the full forward over `[prompt | blocks < j (clean) | canvas of block j | later blocks]` with
the single-stream block-causal mask, reads the prediction for response index r from slot
P + r - 1, and applies the commit rule in Python.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dgr2_jax.decode import sampling
from dgr2_jax.decode.sampler import DecodeConfig, left_pad, resolve_kv_write
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
  greedy_plain = dc.temperature == 0 and dc.top_k == 0 and dc.top_p == 1.0
  fwd = jax.jit(lambda prm, t, pos, msk: qwen3.forward(model_config, prm, t, pos, msk)[0])
  # The shared per-position distribution and draw (sampling.py), compiled once rather than
  # dispatched op by op.
  dist = jax.jit(lambda lg, key: (lambda lp: (lp, sampling.choose_tokens(key, lp, dc.temperature)))(
      sampling.decoding_logprobs(lg, dc.temperature, dc.top_k, dc.top_p, m)))
  row_keys = jax.random.split(rng, b)
  out = dict(tokens=np.full((b, r), m, np.int64), commit_step=np.full((b, r), -1, np.int64),
             logprob=np.zeros((b, r), np.float64), nfe=np.zeros(b, np.int64), eos_pos=np.full(b, r, np.int64),
             steps=np.zeros(b, np.int64))
  # A separate K/V write (DecodeConfig.kv_write) is one more forward per block a row moves to.
  write_pass = bs > 1 and resolve_kv_write(dc.kv_write, b) == "separate"   # as the batch's decoder
  length = p + r
  for row in range(b):
    canvas, eos_pos, step = out["tokens"][row], r, 0
    valid = masks.left_pad_valid(lengths[row:row + 1], p, length)
    mask = masks.sequence_mask(p, length, bs, valid)
    pos = masks.left_pad_positions(lengths[row:row + 1], p, length)
    for j in range(r // bs):
      block_start = step
      out["nfe"][row] += int(write_pass and j > 0)
      while True:
        cands = [i for i in range(bs) if canvas[j * bs + i] == m and j * bs + i < eos_pos]
        if not cands:
          break
        # The whole sequence, later blocks included (still masks): the block-causal mask hides them.
        seq = np.concatenate([tokens[row], canvas])[None]
        logits = np.asarray(fwd(params, jnp.asarray(seq, jnp.int32), pos, mask))[0]   # [L, V]
        out["nfe"][row] += int(not (bs == 1 and j == 0))  # AR block 0 is predicted by the prefill itself
        preds = logits[p + j * bs - 1: p + j * bs + bs - 1]  # [bs, V]: slot P+r-1 predicts r
        if greedy_plain:
          preds = preds.copy()
          preds[:, m] = -np.inf
          lp = _np_log_softmax(preds)
          tok = lp.argmax(-1)
        else:
          lp_j, tok = dist(jnp.asarray(preds), jax.random.fold_in(row_keys[row], step))
          tok, lp = np.asarray(tok), np.asarray(lp_j, np.float64)
        conf = {i: float(np.exp(lp[i, tok[i]])) for i in cands}
        # The step budget: at least ceil(m / steps left) commits, most confident first.
        left = max(dc.steps_per_block - (step - block_start), 1) if dc.steps_per_block else bs
        k_min = -(-len(cands) // left)
        top = sorted(cands, key=lambda i: (-conf[i], i))[:k_min]
        for i in cands:
          if (dc.threshold < 1.0 and conf[i] >= dc.threshold) or i in top:
            canvas[j * bs + i] = tok[i]
            out["commit_step"][row, j * bs + i] = step
            out["logprob"][row, j * bs + i] = lp[i, tok[i]]
            if int(tok[i]) in dc.eos_ids:
              eos_pos = min(eos_pos, j * bs + i)
        step += 1
      if eos_pos < (j + 1) * bs:
        break
    out["eos_pos"][row], out["steps"][row] = eos_pos, step
  out["output_ids"] = [out["tokens"][row, :min(out["eos_pos"][row] + 1, r)].tolist() for row in range(b)]
  return out


def reference_speculative(drafter_config, drafter_params, verifier_config, verifier_params, prompts,
                          dc: DecodeConfig, rng=None, max_prompt_len=None, accept_all: bool = False):
  """Plain-Python speculative decoding (decode/speculative.py), one row at a time, every forward
  over the whole sequence without a cache: the drafter's block-causal mask, the verifier's causal
  one. Same keys: drafter step s of a row folds s into its draft key, round i its verify key."""
  dcfg = drafter_config.as_block_diffusion(dc.block_size, dc.mask_token_id)
  vcfg = verifier_config.as_block_diffusion(1)
  rng = jax.random.PRNGKey(0) if rng is None else rng
  max_prompt_len = max_prompt_len or max(len(x) for x in prompts)
  tokens, lengths = left_pad(prompts, max_prompt_len, dc.pad_id)
  b, p = tokens.shape
  bs, r, m_id = dc.block_size, dc.max_new_tokens, dc.mask_token_id
  sampled = dc.temperature > 0
  vv = vcfg.vocab_size
  v_mask = m_id if m_id < vv else None
  d_fwd = jax.jit(lambda prm, t, pos, msk: qwen3.forward(dcfg, prm, t, pos, msk)[0])
  v_fwd = jax.jit(lambda prm, t, pos, msk: qwen3.forward(vcfg, prm, t, pos, msk)[0])
  # The shared distributions and draws (sampling.py), compiled once rather than dispatched op by op.
  d_dist = jax.jit(lambda lg, key: (lambda lp: (lp, sampling.choose_tokens(key, lp, dc.temperature)))(
      sampling.decoding_logprobs(lg, dc.temperature, dc.top_k, dc.top_p, m_id)))
  v_dist = jax.jit(lambda lg: sampling.decoding_logprobs(lg, dc.temperature, dc.top_k, dc.top_p, v_mask))
  fold = jax.jit(jax.random.fold_in)
  uniforms = jax.jit(lambda k: (lambda ku, kx: (jax.random.uniform(ku, (bs + 1,)), kx))(*jax.random.split(k)))
  draw = jax.jit(sampling.categorical)
  k_draft, k_verify = jax.random.split(rng)
  draft_keys, verify_keys = jax.random.split(k_draft, b), jax.random.split(k_verify, b)
  write_pass = resolve_kv_write(dc.kv_write, b) == "separate"   # as the batch's decoder
  eos_ids = set(dc.eos_ids)
  keys_out = ("tokens", "logprob", "commit_round", "eos_pos", "rounds", "drafter_passes", "accepted", "round_accepts")
  out = {k: [] for k in keys_out}
  length = p + r
  for row in range(b):
    valid = masks.left_pad_valid(lengths[row:row + 1], p, length)
    pos = masks.left_pad_positions(lengths[row:row + 1], p, length)
    d_mask = masks.sequence_mask(p, length, bs, valid)
    v_mask_arr = masks.sequence_mask(p, length, 1, valid)
    canvas = np.full(r, m_id, np.int64)
    logprob, commit_round = np.zeros(r), np.full(r, -1, np.int64)
    round_accepts = np.full(r, -1, np.int64)
    n, j, dstep, rounds, passes, accepted, eos_pos = 0, 0, 0, 0, 0, 0, r
    while n < r and eos_pos == r:
      # -- draft block j
      round_start, cstep, qlp, eos_draft = dstep, {}, {}, r
      while True:
        cands = [i for i in range(bs) if canvas[j * bs + i] == m_id and j * bs + i <= eos_draft]
        if not cands:
          break
        seq = np.concatenate([tokens[row], canvas])[None]
        lg = np.asarray(d_fwd(drafter_params, jnp.asarray(seq, jnp.int32), pos, d_mask))[0]
        preds = lg[p + j * bs - 1: p + j * bs + bs - 1]
        if not sampled and dc.top_k == 0 and dc.top_p == 1.0:
          pr = preds.copy()
          pr[:, m_id] = -np.inf
          lp = _np_log_softmax(pr)
          tok = lp.argmax(-1)
        else:
          lp_j, tok = d_dist(jnp.asarray(preds), fold(draft_keys[row], dstep))
          tok, lp = np.asarray(tok), np.asarray(lp_j, np.float64)
        # Sampled drafts commit by each distribution's top probability (speculative.py docstring).
        conf = {i: float(np.exp(lp[i].max() if sampled else lp[i, tok[i]])) for i in cands}
        left = max(dc.steps_per_block - (dstep - round_start), 1) if dc.steps_per_block else bs
        top = sorted(cands, key=lambda i: (-conf[i], i))[:-(-len(cands) // left)]
        for i in cands:
          if (dc.threshold < 1.0 and conf[i] >= dc.threshold) or i in top:
            canvas[j * bs + i] = tok[i]
            cstep[j * bs + i], qlp[j * bs + i] = dstep, lp[i]
            if int(tok[i]) in eos_ids:
              eos_draft = min(eos_draft, j * bs + i)
        dstep += 1
        passes += 1
      # -- verify: the verifier's distribution for every position from the whole sequence
      seq = np.minimum(np.concatenate([tokens[row], canvas])[None], vv - 1)  # ids the verifier has
      vlg = v_fwd(verifier_params, jnp.asarray(seq, jnp.int32), pos, v_mask_arr)[0]
      vlp = np.asarray(v_dist(vlg), np.float64)                         # [L, Vv]
      n_drafts = min((j + 1) * bs, eos_draft + 1) - n
      vkey = fold(verify_keys[row], rounds)

      def p_at(t):  # verifier decoding log-probs for position t (from slot p + t - 1)
        return vlp[p + t - 1]
      if not sampled:
        m = 0
        while m < n_drafts and canvas[n + m] == int(np.argmax(p_at(n + m))):
          m += 1
        x = int(np.argmax(p_at(n + m))) if n + m < r else -1
      else:
        n_ver = 1
        while n_ver < n_drafts and cstep[n + n_ver] >= cstep[n + n_ver - 1]:
          n_ver += 1
        u, k_x = uniforms(vkey)
        u = np.asarray(u)
        m = 0
        while m < n_ver:
          d = int(canvas[n + m])
          pd = p_at(n + m)[d] if d < vv else -np.inf
          if not (accept_all or np.log(u[m]) < pd - qlp[n + m][d]):
            break
          m += 1
        if n + m < r:
          pm = p_at(n + m)
          if m < n_ver:
            qm = np.full(vv, -np.inf)
            qm[:min(vv, len(qlp[n + m]))] = qlp[n + m][:vv]
            with np.errstate(divide="ignore"):   # log 0 = -inf: the residual's zeros
              logits_x = np.log(np.maximum(np.exp(pm) - np.exp(qm), 0.0))
          else:
            logits_x = pm
          x = int(draw(k_x, jnp.asarray(logits_x, jnp.float32)))
        else:
          x = -1
      emitted = [int(canvas[n + k]) for k in range(m)] + ([x] if n + m < r else [])
      new_n = n
      for k, t in enumerate(emitted):
        canvas[n + k] = t
        logprob[n + k] = p_at(n + k)[t] if t < vv else -np.inf
        commit_round[n + k] = rounds
        new_n = n + k + 1
        if t in eos_ids:
          eos_pos = n + k
          break
      round_accepts[rounds] = min(m, new_n - n)
      accepted += min(m, new_n - n)
      block_end = (j + 1) * bs
      for t in range(new_n, max(block_end, new_n)):
        canvas[t] = m_id
      rounds += 1
      n = new_n
      if n >= block_end and eos_pos == r and n < r:
        j += 1
        passes += int(write_pass)   # the drafter's K/V write of the accepted block
    out["tokens"].append(canvas)
    for k_, v_ in (("logprob", logprob), ("commit_round", commit_round), ("eos_pos", eos_pos), ("rounds", rounds),
                   ("drafter_passes", passes), ("accepted", accepted), ("round_accepts", round_accepts)):
      out[k_].append(v_)
  out = {k: np.asarray(v) for k, v in out.items()}
  out["output_ids"] = [out["tokens"][row, :min(out["eos_pos"][row] + 1, r)].tolist() for row in range(b)]
  return out
