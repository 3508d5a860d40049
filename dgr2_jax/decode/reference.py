"""Plain-Python reference decoder: no KV cache, no while-loop, the whole sequence recomputed per step.

It exists to check `sampler.generate` (the jitted decoder) commit for commit. It follows
docs/design.md literally, one row at a time (rows are independent: each has
its own blocks, steps and key `fold_in(split(rng, B)[row], step)`): at every denoising step it
runs the full forward over `[prompt | blocks < j (clean) | canvas of block j | later blocks]` with
the single-stream block-causal mask, reads the prediction for response index r from slot
P + r - 1, and applies the commit rule in Python.
"""

from __future__ import annotations

import dataclasses

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


def reference_decode(model_config, params, prompts, dc: DecodeConfig, rng=None, max_prompt_len=None,
                     commits=None):
  """`commits`: per-row forced schedules (lists of ints, decode/schedule.py) or None: a row's step s
  commits at least commits[row][s] positions in place of the step budget's minimum, and the row
  stops after its schedule's last step."""
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
        k_min = -(-len(cands) // left) if commits is None else commits[row][step]
        top = sorted(cands, key=lambda i: (-conf[i], i))[:k_min]
        for i in cands:
          if (dc.threshold < 1.0 and conf[i] >= dc.threshold) or i in top:
            canvas[j * bs + i] = tok[i]
            out["commit_step"][row, j * bs + i] = step
            out["logprob"][row, j * bs + i] = lp[i, tok[i]]
            if int(tok[i]) in dc.eos_ids:
              eos_pos = min(eos_pos, j * bs + i)
        step += 1
        if commits is not None and step == len(commits[row]):
          break
      if eos_pos < (j + 1) * bs or (commits is not None and step == len(commits[row])):
        break
    out["eos_pos"][row], out["steps"][row] = eos_pos, step
  out["output_ids"] = [out["tokens"][row, :min(out["eos_pos"][row] + 1, r)].tolist() for row in range(b)]
  return out


@dataclasses.dataclass(frozen=True)
class _Judge:
  """What `reference_speculative`'s rows share: the settings, the params and the compiled pieces
  (each compiled once rather than dispatched op by op)."""
  dc: DecodeConfig
  prompt_slots: int
  verifier_vocab: int
  accept_all: bool
  write_pass: bool             # a separate K/V write: one more drafter forward per accepted block
  drafter_params: object
  verifier_params: object
  d_fwd: object                # (params, tokens, positions, mask) -> logits, the drafter's
  v_fwd: object                # the verifier's
  d_dist: object               # (logits, key) -> (the drafter's decoding log-probs, its draw)
  v_dist: object               # logits -> the verifier's decoding log-probs
  fold: object                 # jax.random.fold_in
  uniforms: object             # key -> (B_ + 1 uniforms, the key of the round's own draw)
  draw: object                 # sampling.categorical

  @property
  def sampled(self) -> bool:
    return self.dc.temperature > 0

  @classmethod
  def build(cls, dcfg, vcfg, dc: DecodeConfig, params: tuple, prompt_slots: int, rows: int, accept_all: bool):
    vv, m_id = vcfg.vocab_size, dc.mask_token_id
    v_mask = m_id if m_id < vv else None
    logprobs = lambda lg, mask_id: sampling.decoding_logprobs(lg, dc.temperature, dc.top_k, dc.top_p, mask_id)
    return cls(
        dc, prompt_slots, vv, accept_all, resolve_kv_write(dc.kv_write, rows) == "separate", *params,
        d_fwd=jax.jit(lambda prm, t, pos, msk: qwen3.forward(dcfg, prm, t, pos, msk)[0]),
        v_fwd=jax.jit(lambda prm, t, pos, msk: qwen3.forward(vcfg, prm, t, pos, msk)[0]),
        d_dist=jax.jit(lambda lg, key: (lambda lp: (lp, sampling.choose_tokens(key, lp, dc.temperature)))(
            logprobs(lg, m_id))),
        v_dist=jax.jit(lambda lg: logprobs(lg, v_mask)), fold=jax.jit(jax.random.fold_in),
        uniforms=jax.jit(lambda k: (lambda ku, kx: (jax.random.uniform(ku, (dc.block_size + 1,)), kx))(
            *jax.random.split(k))),
        draw=jax.jit(sampling.categorical))


@dataclasses.dataclass
class _JudgedRow:
  """One row of `reference_speculative`: its inputs and its progress (mutated round by round)."""
  prompt: np.ndarray           # [P]
  positions: np.ndarray        # [1,P+R]
  d_mask: np.ndarray           # the drafter's block-causal mask
  v_mask: np.ndarray           # the verifier's causal one
  draft_key: object
  verify_key: object
  canvas: np.ndarray           # [R] emitted tokens, then the block's drafts, the mask id elsewhere
  logprob: np.ndarray          # [R]
  commit_round: np.ndarray     # [R]
  round_accepts: np.ndarray    # [R]
  eos_pos: int
  n: int = 0                   # tokens emitted
  j: int = 0                   # the drafter's block
  dstep: int = 0
  rounds: int = 0
  drafter_passes: int = 0
  accepted: int = 0


def _judge_draft(g: _Judge, row: _JudgedRow):
  """Drafts block j until none of its positions is left masked (before a drafted EOS). -> (cstep,
  qlp, eos_draft): each draft's drafter step and distribution by position, the first drafted EOS."""
  dc, p, j = g.dc, g.prompt_slots, row.j
  bs, r, m_id = dc.block_size, dc.max_new_tokens, dc.mask_token_id
  round_start, cstep, qlp, eos_draft = row.dstep, {}, {}, r
  while True:
    cands = [i for i in range(bs) if row.canvas[j * bs + i] == m_id and j * bs + i <= eos_draft]
    if not cands:
      return cstep, qlp, eos_draft
    seq = np.concatenate([row.prompt, row.canvas])[None]
    lg = np.asarray(g.d_fwd(g.drafter_params, jnp.asarray(seq, jnp.int32), row.positions, row.d_mask))[0]
    preds = lg[p + j * bs - 1: p + j * bs + bs - 1]
    if not g.sampled and dc.top_k == 0 and dc.top_p == 1.0:
      pr = preds.copy()
      pr[:, m_id] = -np.inf
      lp = _np_log_softmax(pr)
      tok = lp.argmax(-1)
    else:
      lp_j, tok = g.d_dist(jnp.asarray(preds), g.fold(row.draft_key, row.dstep))
      tok, lp = np.asarray(tok), np.asarray(lp_j, np.float64)
    # Sampled drafts commit by each distribution's top probability (speculative.py docstring).
    conf = {i: float(np.exp(lp[i].max() if g.sampled else lp[i, tok[i]])) for i in cands}
    left = max(dc.steps_per_block - (row.dstep - round_start), 1) if dc.steps_per_block else bs
    top = sorted(cands, key=lambda i: (-conf[i], i))[:-(-len(cands) // left)]
    for i in cands:
      if (dc.threshold < 1.0 and conf[i] >= dc.threshold) or i in top:
        row.canvas[j * bs + i] = tok[i]
        cstep[j * bs + i], qlp[j * bs + i] = row.dstep, lp[i]
        if int(tok[i]) in dc.eos_ids:
          eos_draft = min(eos_draft, j * bs + i)
    row.dstep += 1
    row.drafter_passes += 1


def _judge_accept(g: _Judge, row: _JudgedRow, p_at, drafted: tuple, n_drafts: int):
  """The drafts kept and the token after them: -> (m, x; x = -1 past R). p_at(t): the verifier's
  decoding log-probs for position t; drafted = (cstep, qlp) of `_judge_draft`."""
  n, r, vv, canvas = row.n, g.dc.max_new_tokens, g.verifier_vocab, row.canvas
  if not g.sampled:
    m = 0
    while m < n_drafts and canvas[n + m] == int(np.argmax(p_at(n + m))):
      m += 1
    return m, (int(np.argmax(p_at(n + m))) if n + m < r else -1)
  cstep, qlp = drafted
  n_ver = 1
  while n_ver < n_drafts and cstep[n + n_ver] >= cstep[n + n_ver - 1]:
    n_ver += 1
  u, k_x = g.uniforms(g.fold(row.verify_key, row.rounds))
  u = np.asarray(u)
  m = 0
  while m < n_ver:
    d = int(canvas[n + m])
    pd = p_at(n + m)[d] if d < vv else -np.inf
    if not (g.accept_all or np.log(u[m]) < pd - qlp[n + m][d]):
      break
    m += 1
  if n + m >= r:
    return m, -1
  pm = p_at(n + m)
  if m < n_ver:
    qm = np.full(vv, -np.inf)
    qm[:min(vv, len(qlp[n + m]))] = qlp[n + m][:vv]
    with np.errstate(divide="ignore"):   # log 0 = -inf: the residual's zeros
      logits_x = np.log(np.maximum(np.exp(pm) - np.exp(qm), 0.0))
  else:
    logits_x = pm
  return m, int(g.draw(k_x, jnp.asarray(logits_x, jnp.float32)))


def _judge_round(g: _Judge, row: _JudgedRow) -> None:
  """One round of a row: draft block j, verify against the whole sequence, emit."""
  bs, r, m_id = g.dc.block_size, g.dc.max_new_tokens, g.dc.mask_token_id
  cstep, qlp, eos_draft = _judge_draft(g, row)
  # -- verify: the verifier's distribution for every position from the whole sequence
  seq = np.minimum(np.concatenate([row.prompt, row.canvas])[None], g.verifier_vocab - 1)  # ids the verifier has
  vlg = g.v_fwd(g.verifier_params, jnp.asarray(seq, jnp.int32), row.positions, row.v_mask)[0]
  vlp = np.asarray(g.v_dist(vlg), np.float64)                         # [L, Vv]

  def p_at(t):  # verifier decoding log-probs for position t (from slot p + t - 1)
    return vlp[g.prompt_slots + t - 1]
  n, j = row.n, row.j
  m, x = _judge_accept(g, row, p_at, (cstep, qlp), min((j + 1) * bs, eos_draft + 1) - n)
  emitted = [int(row.canvas[n + k]) for k in range(m)] + ([x] if n + m < r else [])
  new_n = n
  for k, t in enumerate(emitted):
    row.canvas[n + k] = t
    row.logprob[n + k] = p_at(n + k)[t] if t < g.verifier_vocab else -np.inf
    row.commit_round[n + k] = row.rounds
    new_n = n + k + 1
    if t in g.dc.eos_ids:
      row.eos_pos = n + k
      break
  row.round_accepts[row.rounds] = min(m, new_n - n)
  row.accepted += min(m, new_n - n)
  block_end = (j + 1) * bs
  for t in range(new_n, max(block_end, new_n)):
    row.canvas[t] = m_id
  row.rounds += 1
  row.n = new_n
  if new_n >= block_end and row.eos_pos == r and new_n < r:
    row.j += 1
    row.drafter_passes += int(g.write_pass)   # the drafter's K/V write of the accepted block


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
  bs, r = dc.block_size, dc.max_new_tokens
  g = _Judge.build(dcfg, vcfg, dc, (drafter_params, verifier_params), p, b, accept_all)   # as the batch's decoder
  k_draft, k_verify = jax.random.split(rng)
  draft_keys, verify_keys = jax.random.split(k_draft, b), jax.random.split(k_verify, b)
  length = p + r
  rows = []
  for i in range(b):
    valid = masks.left_pad_valid(lengths[i:i + 1], p, length)
    row = _JudgedRow(tokens[i], masks.left_pad_positions(lengths[i:i + 1], p, length),
                     masks.sequence_mask(p, length, bs, valid), masks.sequence_mask(p, length, 1, valid),
                     draft_keys[i], verify_keys[i], canvas=np.full(r, dc.mask_token_id, np.int64),
                     logprob=np.zeros(r), commit_round=np.full(r, -1, np.int64),
                     round_accepts=np.full(r, -1, np.int64), eos_pos=r)
    while row.n < r and row.eos_pos == r:
      _judge_round(g, row)
    rows.append(row)
  names = dict(tokens="canvas", logprob="logprob", commit_round="commit_round", eos_pos="eos_pos", rounds="rounds",
               drafter_passes="drafter_passes", accepted="accepted", round_accepts="round_accepts")
  out = {k: np.asarray([getattr(row, f) for row in rows]) for k, f in names.items()}
  out["output_ids"] = [out["tokens"][row, :min(out["eos_pos"][row] + 1, r)].tolist() for row in range(b)]
  return out
