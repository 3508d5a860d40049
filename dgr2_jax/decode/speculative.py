"""Lossless speculative re-ranking: the block-diffusion model drafts, an AR model verifies.

`decode.mode='speculative'`. The drafter is the diffusion model with its own commit rule
(`threshold`, `steps_per_block`, decode/sampler.py); the verifier an AR (causal) model with the same
tokenizer (the pipeline's AR teacher by default; its vocabulary may lack the mask token). The
output is exactly the verifier's: greedy, token for token what AR greedy decoding of the verifier
gives; sampled, a draw from the verifier's decoding distribution (speculative sampling).

A round of one row, at the drafter's active block j whose positions [jB, n) are accepted:
  1. draft: the drafter denoises the block's masked positions until none is left (before a drafted
     EOS), one drafter forward per loop iteration, its step budget restarting each round;
  2. verify (at the batch's next verifier pass, `decode.verify_every` below): the verifier runs
     one causal forward over [pending token | the block's drafts] (the pending token is the last
     accepted one, or the last prompt token, whose K/V the verifier has not written yet) against
     its own KV cache, so its logits at window slot k are its distribution for position n + k
     given everything accepted and the drafts before it. A complete draft waits for that pass
     unchanged (its drafts and its round's key are fixed): when it is verified changes no output;
  3. accept: greedy keeps the longest prefix of drafts equal to the verifier's argmax and appends
     the verifier's argmax at the first mismatch. Sampled keeps draft k with probability
     min(1, p_k(d_k) / q_k(d_k)) (p the verifier's, q the drafter's decoding distribution at the
     step that committed d_k) and at the first rejection draws from normalised max(0, p - q).
     Two things make a diffusion draft an exact sample of q here. A sampled round commits by the
     top probability of each position's distribution (the greedy confidence), not by the drawn
     token's, so whether a position commits never depends on the token drawn there (committing
     by the drawn token's probability would favour likely tokens: a biased proposal). And a draft
     is verified only where it was drawn after (or with) the drafts to its left: conditioning on a
     later-drawn left neighbour, which saw it, would bias it. So sampled rounds verify the prefix
     whose commit steps do not decrease, and at its end draw from p itself.
     Every round emits at least one token; when the whole block is accepted, the verifier's next
     token is the first position of block j + 1 (already committed there);
  4. the accepted tokens are committed positions of the drafter's block, the rest are masked
     again and re-drafted next round; a block accepted whole is written to the drafter's cache as
     a clean block (its K/V write, decode/sampler.py `kv_write`), as in threshold decoding.
Rows progress independently (per-row blocks, rounds and window offsets into both static caches);
the whole loop is one `lax.while_loop` in one jit; threshold, step budget, temperature, top-k/p
and the key are traced (no recompile per threshold).

Outputs per row: tokens [B,R] (mask id where never emitted), logprob (the verifier's decoding
log-prob of each emitted token, as its own AR decoding records it), commit_round (round that
emitted each position, -1 never), eos_pos, rounds (= verifier passes), drafter_passes (drafter
forwards, K/V writes included), accepted (drafts accepted), round_accepts [B,R] (drafts accepted in
round i, -1 past the last round), nfe (drafter + verifier forwards), and for the batch:
forward_passes (loop steps that ran with at least one unfinished row: each runs a drafter forward),
masked_steps (drafter steps run after every row finished, the tail of the last `steps_per_sync`
group: wasted work), verifier_calls (verifier forwards that verified at least one row) and
verifier_forwards (every verifier forward run: the batch's wall-clock cost is forward_passes +
masked_steps drafter forwards and verifier_forwards verifier forwards). NFE counts a row's useful
forwards only: a step it spent waiting for its verification is in neither of its counts.

Host round trips (decode/sampler.py "Host round trips"): the loop is a `while_loop` ("is every row
finished?") over `decode.steps_per_sync` (k) drafter steps in loops of static trip count, so its
predicate is the only one that reaches the host: once per k drafter steps. The verifier's pass runs
on a static schedule, `decode.verify_every` (m, a divisor of k): k / m cycles of m drafter steps
followed by one verifier forward over every ready row (a row not ready changes nothing). A
draft completed before the cycle's end waits for it: up to m - 1 drafter steps, which at batch 1
are forwards of nothing. m = 0 restores the verification on the device's decision (a `lax.cond`
per drafter step, run when at least half of the live rows are ready): no wait, but a host round
trip per drafter step on a GPU. Which costs less depends on the round trip's share of a step
(docs/decoding_rounds.md).

decode/reference.py `reference_speculative` is the plain-Python judge of this loop.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dgr2_jax.decode import mesh as dmesh
from dgr2_jax.decode import prefix, sampler, sampling
# The modes and the verification schedule's rule belong to the decode section's owner.
from dgr2_jax.decode.config import MODES, check_schedule  # noqa: F401
from dgr2_jax.model import masks, qwen3
from dgr2_jax.model.config import Qwen3Config


def check_pair(drafter: Qwen3Config, verifier: Qwen3Config, mask_id: int) -> None:
  """The verifier must share the drafter's vocabulary, up to the mask token it may lack."""
  if verifier.vocab_size not in (drafter.vocab_size, drafter.vocab_size - 1) and verifier.vocab_size < mask_id:
    raise ValueError(f"speculative decoding: the verifier's vocabulary ({verifier.vocab_size}) is neither the "
                     f"drafter's ({drafter.vocab_size}) nor the drafter's without its mask token")


@dataclasses.dataclass(frozen=True)
class SpecOptions:
  """What a compiled speculative decoder fixes at trace time (`compiled_speculative`: one jit per value)."""
  drafter: Qwen3Config         # block-diffusion of `block_size` (`sampler.model_for_decoding`)
  verifier: Qwen3Config        # causal (block size 1)
  block_size: int
  num_blocks: int              # R = num_blocks * block_size response slots
  eos_ids: tuple[int, ...]
  mask_id: int
  kv_write: str                # DecodeConfig.kv_write ('auto' resolved by rows per device)
  sampled: bool                # temperature > 0: speculative sampling; else greedy rounds
  accept_all: bool = False     # tests only: keep every draft (it samples the drafter, not the verifier)
  route: str | None = None     # the greedy rounds' `sampler.choose` route; None = picked on the device
  steps_per_sync: int = 8      # drafter steps per host round trip
  verify_every: int = 2        # drafter steps per verifier pass (0: on the device's decision)
  mesh: object = None          # decode/mesh.py: the loop state pinned to it; None = one device
  weight_dtype: str = ""       # DecodeConfig.weight_dtype: both models' params (qwen3.decode_params)
  fuse_projections: bool = True   # qwen3.decode_params' fuse
  prefix_len: int = 0          # a shared prompt prefix prefilled once by each model (decode/prefix.py)


@struct.dataclass
class SpecState:
  """The speculative loop's state. Per row ([B], [B,R+B_] ...) unless marked (): batch counters."""
  block: jax.Array             # [B] the drafter's active block j
  first: jax.Array             # [B] bool: a new block, owing block j-1's K/V write
  dstep: jax.Array             # [B] drafter steps so far (the draft key's fold-in)
  round_start: jax.Array       # [B] dstep at the round's start (the step budget's origin)
  canvas: jax.Array            # [B,R+B_] accepted tokens, then the block's drafts, mask id elsewhere
  cstep: jax.Array             # [B,R+B_] the drafter step that committed each draft, -1 none
  eos_draft: jax.Array         # [B] first drafted EOS, R = none
  carry: jax.Array             # [B,E] drafter hidden state predicting index 0 of the active block
  dcache: object               # the drafter's KV cache (P + R slots)
  vcache: object               # the verifier's KV cache (P + R + B_ slots: its windows overhang)
  n_acc: jax.Array             # [B] tokens emitted so far (position of the pending one)
  logprob: jax.Array           # [B,R] the verifier's decoding log-prob of each emitted token
  commit_round: jax.Array      # [B,R] the round that emitted each position, -1 never
  eos_pos: jax.Array           # [B] emitted EOS, R = none
  done: jax.Array              # [B] bool
  rounds: jax.Array            # [B] verifier passes that verified the row (the verify key's fold-in)
  accepted: jax.Array          # [B] drafts accepted
  drafter_passes: jax.Array    # [B] drafter forwards of the row (K/V writes included)
  round_accepts: jax.Array     # [B,R] drafts accepted in round i, -1 past the last
  iteration: jax.Array         # () drafter steps run
  verifier_calls: jax.Array    # () verifier forwards that verified at least one row
  verifier_forwards: jax.Array  # () every verifier forward
  forward_passes: jax.Array    # () drafter steps run with an unfinished row
  masked_steps: jax.Array      # () drafter steps run after every row finished
  qlp: jax.Array | None = None  # [B,B_,Vd] sampled: the drafter's log-probs at each committed position


@dataclasses.dataclass(frozen=True)
class _Call:
  """One call's constants, read by every step of its loop (closed over, never carried)."""
  o: SpecOptions
  dcfg: Qwen3Config            # the models as they run (layers unstacked)
  vcfg: Qwen3Config
  dparams: object              # per layer, in the compute dtype
  vparams: object
  prompt_tokens: jax.Array     # [B,P] left-padded, P >= B_ + 1
  prompt_len: jax.Array        # [B]
  pos_v: jax.Array             # [B,P+R+B_] the verifier's positions
  win: sampler.BlockWindows    # the drafter's window forward
  knobs: sampler.Knobs
  draft_keys: jax.Array        # [B] a row's drafter key (step s: fold_in(key, s))
  verify_keys: jax.Array       # [B] its verifier key (round i: fold_in(key, i))
  eos: jax.Array               # EOS ids ((-1,) when none)
  idx: jax.Array               # [1,B_] a block's indices
  kwin: jax.Array              # [1,B_+1] a verifier window's slots
  rows: jax.Array              # [B]

  @property
  def bsz(self) -> int:
    return self.o.block_size

  @property
  def r(self) -> int:
    return self.o.num_blocks * self.o.block_size

  @property
  def p(self) -> int:
    return self.prompt_tokens.shape[1]

  @property
  def vv(self) -> int:
    return self.vcfg.vocab_size

  @property
  def v_mask(self) -> int | None:
    return self.o.mask_id if self.o.mask_id < self.vv else None


def _draft(k: _Call, st: SpecState) -> SpecState:
  """One drafter step of every row still drafting (a K/V write for rows starting a block)."""
  o, bsz, r, kn = k.o, k.bsz, k.r, k.knobs
  jc = jnp.minimum(st.block, o.num_blocks - 1)
  canvas = st.canvas[:, :r]
  preds, carry, dcache, writing = k.win.predictions(st.block, st.first, st.done, canvas, st.carry, st.dcache)
  block = sampler.row_slice(canvas, jc * bsz, bsz)
  eos_in = st.eos_draft - jc * bsz
  cand = (block == o.mask_id) & (k.idx <= eos_in[:, None]) & ~(st.done | writing)[:, None]
  has = cand.any(1)
  keys = jax.vmap(jax.random.fold_in)(k.draft_keys, st.dstep)
  qlp = st.qlp
  if o.sampled:
    lp = sampler.decoding_logprobs_of(k.dcfg, k.dparams, preds, kn.temperature, kn.top_k, kn.top_p,
                                      o.mask_id)                      # [B,bsz,Vd]
    tok = jax.vmap(sampling.categorical)(keys, lp)   # choose_tokens at temperature > 0, without its cond
    conf = jnp.exp(jnp.max(lp, axis=-1))   # not the drawn token's: see the module docstring
  else:
    tok, tok_lp = sampler.choose(k.dcfg, k.dparams, preds, keys, kn.temperature, kn.top_k, kn.top_p, o.mask_id,
                                 o.route)
    conf = jnp.exp(tok_lp)
  left = jnp.where(kn.steps_per_block > 0, jnp.maximum(kn.steps_per_block - (st.dstep - st.round_start), 1), bsz)
  commit = sampler.commit_mask(conf, cand, kn.threshold, left)
  at = k.rows[:, None], jc[:, None] * bsz + k.idx
  new_block = jnp.where(commit, tok, block)
  is_eos = commit & (tok[..., None] == k.eos).any(-1)
  eos_draft = jnp.minimum(st.eos_draft, jnp.min(jnp.where(is_eos, jc[:, None] * bsz + k.idx, r), 1))
  if o.sampled:  # the drafter's distribution at each committed position, for the acceptance test
    qlp = jnp.where(commit[..., None], lp, st.qlp)
  return st.replace(canvas=st.canvas.at[at].set(new_block), dcache=dcache, carry=carry,
                    cstep=st.cstep.at[at].set(jnp.where(commit, st.dstep[:, None], st.cstep[at])),
                    dstep=st.dstep + has.astype(jnp.int32), eos_draft=eos_draft,
                    first=st.first & ~writing & ~has,
                    drafter_passes=st.drafter_passes + (has | writing).astype(jnp.int32), qlp=qlp)


def _ready_rows(k: _Call, st: SpecState):
  """[B] rows whose draft is complete (none of its candidates left masked), waiting for the verifier."""
  j = jnp.minimum(st.block, k.o.num_blocks - 1)
  block = sampler.row_slice(st.canvas[:, :k.r], j * k.bsz, k.bsz)
  left = (block == k.o.mask_id) & (k.idx <= (st.eos_draft - j * k.bsz)[:, None])
  return ~st.done & ~st.first & ~left.any(1)


def _accept_greedy(k: _Call, st: SpecState, h, drafts, n_drafts, vkeys):
  """Greedy rounds: the longest prefix of drafts equal to the verifier's choice, then its choice.
  h [B,W,E] the verifier's hidden states, drafts [B,W] (d_k at position n + k), n_drafts [B].
  -> (m [B] drafts kept, x [B] the token after them, lp [B,W] the verifier's log-probs of the
  window's emitted tokens)."""
  kn = k.knobs
  a, a_lp = sampler.choose(k.vcfg, k.vparams, h, vkeys, kn.temperature, kn.top_k, kn.top_p, k.v_mask, k.o.route)
  ok = (drafts == a) & (k.kwin < n_drafts[:, None])
  m = jnp.argmin(jnp.concatenate([ok, jnp.zeros_like(ok[:, :1])], 1), axis=1)   # leading matches
  x = jnp.take_along_axis(a, m[:, None], 1)[:, 0]
  return m, x, a_lp


def _accept_sampled(k: _Call, st: SpecState, h, drafts, n_drafts, vkeys):
  """Sampled rounds (module docstring, step 3): draft k kept with probability min(1, p_k/q_k) over
  the verifiable prefix, then a draw from normalised max(0, p - q) at a rejection (p past it). As
  `_accept_greedy`."""
  kn, bsz, vv, kwin = k.knobs, k.bsz, k.vv, k.kwin
  n, j = st.n_acc, jnp.minimum(st.block, k.o.num_blocks - 1)
  plp = sampler.decoding_logprobs_of(k.vcfg, k.vparams, h, kn.temperature, kn.top_k, kn.top_p, k.v_mask)  # [B,W,Vv]
  in_blk = jnp.clip(n[:, None] + kwin - j[:, None] * bsz, 0, bsz - 1)                     # [B,W]
  qlp = jnp.take_along_axis(st.qlp, in_blk[..., None], 1)                                 # [B,W,Vd]
  qv = _to_vocab(qlp, vv)                                                                 # [B,W,Vv]
  cs = sampler.row_slice(st.cstep, n, bsz + 1)
  # The verifiable prefix: commit steps that never decrease (module docstring).
  order_ok = jnp.concatenate([jnp.ones_like(cs[:, :1], bool), cs[:, 1:] >= cs[:, :-1]], 1)
  n_ver = jnp.argmin(jnp.concatenate([order_ok & (kwin < n_drafts[:, None]),
                                      jnp.zeros_like(order_ok[:, :1])], 1), axis=1)
  k_u, k_x = jax.vmap(jax.random.split)(vkeys).swapaxes(0, 1)
  u = jax.vmap(lambda key: jax.random.uniform(key, (bsz + 1,)))(k_u)
  d_safe = jnp.minimum(drafts, vv - 1)
  p_d = jnp.where(drafts < vv, jnp.take_along_axis(plp, d_safe[..., None], -1)[..., 0], -jnp.inf)
  q_d = jnp.take_along_axis(qlp, drafts[..., None], -1)[..., 0]
  ok = (jnp.log(u) < p_d - q_d) & (kwin < n_ver[:, None])
  if k.o.accept_all:
    ok = kwin < n_ver[:, None]
  m = jnp.argmin(jnp.concatenate([ok, jnp.zeros_like(ok[:, :1])], 1), axis=1)
  p_m = jnp.take_along_axis(plp, m[:, None, None], 1)[:, 0]                              # [B,Vv]
  q_m = jnp.take_along_axis(qv, m[:, None, None], 1)[:, 0]
  rejected = m < n_ver
  resid = jnp.maximum(jnp.exp(p_m) - jnp.exp(q_m), 0.0)
  logits_x = jnp.where(rejected[:, None], jnp.log(resid), p_m)
  x = jax.vmap(sampling.categorical)(k_x, logits_x)
  lp_k = jnp.take_along_axis(plp, jnp.minimum(drafts, vv - 1)[..., None], -1)[..., 0]
  lp_x = jnp.take_along_axis(p_m, x[:, None], -1)[:, 0]
  return m, x, jnp.where(kwin == m[:, None], lp_x[:, None], lp_k)


def _verify(k: _Call, st: SpecState) -> SpecState:
  """The verifier's pass (module docstring, steps 2-4) over every row; a row not ready changes nothing
  but the verifier's K/V at and after its pending slot."""
  bsz, vv = k.bsz, k.vv
  n, j = st.n_acc, jnp.minimum(st.block, k.o.num_blocks - 1)
  start = k.p - 1 + n                                                  # the pending token's slot
  # Masked slots past the drafts may hold an id the verifier lacks (its vocabulary without the
  # mask token): any valid id will do there, those slots predict nothing that is read.
  seq = jnp.minimum(jnp.concatenate([k.prompt_tokens, st.canvas], axis=1), vv - 1)   # [B, p + r + bsz]
  h, vcache = sampler.window_forward(k.vcfg, k.vparams, sampler.row_slice(seq, start, bsz + 1), start, st.vcache,
                                     k.prompt_len, k.p, k.pos_v, return_hidden=True)
  drafts = sampler.row_slice(st.canvas, n, bsz + 1)                        # d_k at position n + k
  # Drafts to check: up to the end of the block, or through a drafted EOS.
  n_drafts = jnp.minimum((j + 1) * bsz, st.eos_draft + 1) - n     # [B]
  vkeys = jax.vmap(jax.random.fold_in)(k.verify_keys, st.rounds)
  accept = _accept_sampled if k.o.sampled else _accept_greedy
  m, x, lp_k = accept(k, st, h, drafts, n_drafts, vkeys)
  return _emit(k, st.replace(vcache=vcache), drafts, m, x, lp_k)


def _emit(k: _Call, st: SpecState, drafts, m, x, lp_k) -> SpecState:
  """A round's outcome written back: drafts n .. n+m-1, then x at n+m (not past R, not past an EOS),
  the rest of the block masked again; rows not ready keep everything."""
  bsz, r, kwin = k.bsz, k.r, k.kwin
  ready = _ready_rows(k, st)
  n, j = st.n_acc, jnp.minimum(st.block, k.o.num_blocks - 1)
  emit = (kwin <= m[:, None]) & (n[:, None] + kwin < r) & ready[:, None]
  toks = jnp.where(kwin == m[:, None], x[:, None], drafts)
  posn = n[:, None] + kwin                                            # [B,W]
  is_eos = emit & (toks[..., None] == k.eos).any(-1)
  first_eos = jnp.min(jnp.where(is_eos, posn, r), 1)
  emit = emit & (posn <= first_eos[:, None])
  n_new = jnp.where(ready, jnp.minimum(jnp.where(first_eos < r, first_eos + 1, n + m + 1), r), n)
  # Write back: emitted tokens, the rest of the block masked again (the bonus past the block end
  # is the next block's first position).
  blk_end = (j + 1) * bsz
  rng_cols = jnp.arange(r + bsz)[None, :]
  keep = rng_cols < n[:, None]
  redo = ready[:, None] & (rng_cols >= n_new[:, None]) & (rng_cols < jnp.maximum(blk_end, n_new)[:, None])
  canvas = jnp.where(redo & ~keep, k.o.mask_id, st.canvas)
  put = lambda arr, vals: jax.vmap(lambda a_, v_, e_, s_: jnp.where(
      e_, v_, jax.lax.dynamic_slice_in_dim(a_, s_, bsz + 1)))(arr, vals, emit, n)
  upd = lambda arr, vals: jax.vmap(lambda a_, w_, s_: jax.lax.dynamic_update_slice_in_dim(a_, w_, s_, 0))(
      arr, put(arr, vals), n)
  canvas = upd(canvas, toks)
  logprob = upd(jnp.pad(st.logprob, ((0, 0), (0, bsz))), lp_k)[:, :r]
  rnd = upd(jnp.pad(st.commit_round, ((0, 0), (0, bsz))), jnp.broadcast_to(st.rounds[:, None], toks.shape))[:, :r]
  block_done = ready & (n_new >= blk_end)
  n_acc_drafts = jnp.where(ready, jnp.minimum(m, n_new - n), 0)
  at_round = k.rows, jnp.minimum(st.rounds, r - 1)
  return st.replace(
      canvas=canvas, n_acc=n_new, logprob=logprob, commit_round=rnd,
      done=st.done | (ready & ((first_eos < r) | (n_new >= r))),
      eos_pos=jnp.where(ready & (first_eos < r), first_eos, st.eos_pos),
      block=jnp.where(block_done, st.block + 1, st.block), first=jnp.where(block_done, True, st.first),
      eos_draft=jnp.where(ready, r, st.eos_draft), round_start=jnp.where(ready, st.dstep, st.round_start),
      cstep=jnp.where(ready[:, None], -1, st.cstep), rounds=st.rounds + ready.astype(jnp.int32),
      accepted=st.accepted + n_acc_drafts,
      round_accepts=st.round_accepts.at[at_round].set(jnp.where(ready, n_acc_drafts, st.round_accepts[at_round])))


def _draft_step(k: _Call, st: SpecState) -> SpecState:
  # The drafter runs on every step, not under `lax.cond(some row drafting)`: a GPU copies a
  # cond's predicate to the host, and a verified row drafts again at the next step, so that cond
  # skipped a forward almost never. A row not drafting (ready, or finished) commits nothing.
  live = ~st.done.all()
  st = _draft(k, st)
  return st.replace(iteration=st.iteration + 1, forward_passes=st.forward_passes + live.astype(jnp.int32),
                    masked_steps=st.masked_steps + (~live).astype(jnp.int32))


def _verify_ready(k: _Call, st: SpecState) -> SpecState:
  # Rows not ready change nothing but verifier K/V at and after their pending slot, which their
  # next verification rewrites before any read.
  useful = _ready_rows(k, st).any()
  st = _verify(k, st)
  return st.replace(verifier_calls=st.verifier_calls + useful.astype(jnp.int32),
                    verifier_forwards=st.verifier_forwards + 1)


def _step_with_cond(k: _Call, st: SpecState) -> SpecState:
  # verify_every = 0. A complete draft can wait for its verification without changing any
  # output (the draft and its round's key are fixed), so a batch verifies when at least half of
  # its live rows are ready or none is still drafting: fewer verifier passes at batch > 1, the
  # same rounds. This cond's predicate goes to the host on every step.
  st = _draft_step(k, st)
  ready, live_rows = _ready_rows(k, st), ~st.done
  go = ready.any() & ((2 * ready.sum() >= live_rows.sum()) | ~(live_rows & ~ready).any())
  return jax.lax.cond(go, functools.partial(_verify_ready, k), lambda x: x, st)


def _cycle(k: _Call, st: SpecState) -> SpecState:
  # verify_every = m > 0: m drafter steps (a loop of static trip count), then the verifier's
  # pass over every ready row. No predicate leaves the device; a row whose draft completes
  # before the m-th step waits for the pass (its outputs do not depend on when it is verified).
  st = jax.lax.fori_loop(0, k.o.verify_every, lambda _, x: _draft_step(k, x), st)
  return _verify_ready(k, st)


def _unfinished(k: _Call, st: SpecState):
  # The loop's host-visible predicate, read once per `steps_per_sync` drafter steps. The bound
  # only guards a broken invariant: a round commits >= 1 draft per drafting step, waits < m
  # steps for its pass and emits >= 1 token; each block adds one K/V write.
  o = k.o
  return ~st.done.all() & (st.iteration < k.r * (k.bsz + o.verify_every + 2) + o.num_blocks)


def _steps(k: _Call, st: SpecState) -> SpecState:
  # A fixed trip count of `steps_per_sync` drafter steps; once every row is finished the rest
  # are masked (no output changes).
  o = k.o
  if o.verify_every == 0:
    return jax.lax.fori_loop(0, o.steps_per_sync, lambda _, x: _step_with_cond(k, x), st)
  return jax.lax.fori_loop(0, o.steps_per_sync // o.verify_every, lambda _, x: _cycle(k, x), st)


def _start(k: _Call, carry, dcache, vcache) -> SpecState:
  """The loop state before the first drafter step (after both prefills)."""
  b, r, bsz, mask_id = k.rows.shape[0], k.r, k.bsz, k.o.mask_id
  zeros, scalar = jnp.zeros((b,), jnp.int32), jnp.int32(0)
  return SpecState(
      block=zeros, first=jnp.ones((b,), bool), dstep=zeros, round_start=zeros,
      canvas=jnp.full((b, r + bsz), mask_id, jnp.int32), cstep=jnp.full((b, r + bsz), -1, jnp.int32),
      eos_draft=jnp.full((b,), r, jnp.int32), carry=carry, dcache=dcache, vcache=vcache, n_acc=zeros,
      logprob=jnp.zeros((b, r), jnp.float32), commit_round=jnp.full((b, r), -1, jnp.int32),
      eos_pos=jnp.full((b,), r, jnp.int32), done=jnp.zeros((b,), bool), rounds=zeros, accepted=zeros,
      drafter_passes=zeros, round_accepts=jnp.full((b, r), -1, jnp.int32), iteration=scalar,
      verifier_calls=scalar, verifier_forwards=scalar, forward_passes=scalar, masked_steps=scalar,
      qlp=jnp.zeros((b, bsz, k.dcfg.vocab_size), jnp.float32) if k.o.sampled else None)


def _outputs(k: _Call, st: SpecState) -> dict:
  # nfe / commit_step / steps: the threshold decoder's names, so eval and generate read either
  # (NFE = the row's drafter + verifier forwards after the prefills; a round is its step).
  return dict(tokens=st.canvas[:, :k.r], logprob=st.logprob, commit_round=st.commit_round,
              eos_pos=st.eos_pos, rounds=st.rounds, drafter_passes=st.drafter_passes,
              accepted=st.accepted, round_accepts=st.round_accepts, forward_passes=st.forward_passes,
              masked_steps=st.masked_steps, verifier_calls=st.verifier_calls,
              verifier_forwards=st.verifier_forwards, nfe=st.drafter_passes + st.rounds,
              commit_step=st.commit_round, steps=st.rounds)


def _decode(o: SpecOptions, params: tuple, prompt_tokens, prompt_len, knobs: sampler.Knobs, rng) -> dict:
  """The decoder `compiled_speculative` jits: params = (drafter's, verifier's)."""
  bsz, mesh = o.block_size, o.mesh
  if o.route in ("greedy", "sampled"):
    # The filters are off (top_k 0, top_p 1 at run time too): as constants they let XLA drop the
    # cond `sampling.decoding_logprobs` holds on them, a host round trip per step on a GPU.
    knobs = knobs.replace(top_k=0, top_p=1.0)
  dcfg, vcfg = o.drafter.replace(scan_layers=False), o.verifier.replace(scan_layers=False)
  # once per call (nothing for params the caller prepared: qwen3.decode_params is idempotent)
  dparams, vparams = (qwen3.decode_params(cfg, p, o.weight_dtype, o.fuse_projections)
                      for cfg, p in ((dcfg, params[0]), (vcfg, params[1])))
  # Block 0 needs a previous block of prompt slots (the drafter) and the verifier a prompt token
  # before the pending one: at least B + 1 prompt slots (pad slots).
  if prompt_tokens.shape[1] < bsz + 1:
    prompt_tokens = jnp.pad(prompt_tokens, ((0, 0), (bsz + 1 - prompt_tokens.shape[1], 0)))
  b, p = prompt_tokens.shape
  kv_write = sampler.resolve_kv_write(o.kv_write, -(-b // dmesh.data_size(mesh)))   # by rows per device
  r = o.num_blocks * bsz
  s_d, s_v = p + r, p + r + bsz                                       # the verifier's windows overhang
  pos_d = masks.left_pad_positions(prompt_len, p, s_d)
  pos_v = masks.left_pad_positions(prompt_len, p, s_v)
  eos = jnp.asarray(o.eos_ids if o.eos_ids else (-1,), jnp.int32)
  k_draft, k_verify = jax.random.split(rng)
  draft_keys, verify_keys = jax.random.split(k_draft, b), jax.random.split(k_verify, b)
  rows, idx, kwin = jnp.arange(b), jnp.arange(bsz)[None, :], jnp.arange(bsz + 1)[None, :]

  # Prefills: the drafter over the whole prompt (its last slot predicts index 0), the verifier over
  # all but the last prompt token (pending for the first round).
  init = lambda cfg, s: dmesh.constrain_cache(mesh, qwen3.init_cache(cfg, b, s))   # rows / kv heads split
  # A shared prefix (o.prefix_len > 0): its K/V computed once per model and copied into each row.
  dwin = lambda t, start, cache: sampler.window_forward(dcfg, dparams, t, start, cache, prompt_len, p, pos_d,
                                                        return_hidden=True)
  vwin = lambda t, start, cache: sampler.window_forward(vcfg, vparams, t, start, cache, prompt_len, p, pos_v,
                                                        return_hidden=True)
  hidden, dcache = prefix.prefill(dcfg, dparams, prompt_tokens, prompt_len, init(dcfg, s_d), o.prefix_len, p, dwin)
  _, vcache = prefix.prefill(vcfg, vparams, prompt_tokens, prompt_len, init(vcfg, s_v), o.prefix_len, p - 1, vwin)
  win = sampler.BlockWindows(dcfg, dparams, prompt_tokens, prompt_len, pos_d, bsz, o.num_blocks, kv_write)
  k = _Call(o, dcfg, vcfg, dparams, vparams, prompt_tokens, prompt_len, pos_v, win, knobs, draft_keys, verify_keys,
            eos, idx, kwin, rows)
  pinned = lambda st: dmesh.constrain_state(mesh, st, b)               # the loop state keeps its shardings
  st = jax.lax.while_loop(functools.partial(_unfinished, k), lambda st: pinned(_steps(k, st)),
                          pinned(_start(k, hidden[:, -1], dcache, vcache)))
  return _outputs(k, st)


def _to_vocab(lp, v):
  """Log-probs [..., Vd] on the verifier's vocabulary [..., v] (-inf where the drafter has none)."""
  vd = lp.shape[-1]
  if vd >= v:
    return lp[..., :v]
  return jnp.concatenate([lp, jnp.full(lp.shape[:-1] + (v - vd,), -jnp.inf, lp.dtype)], -1)


@functools.lru_cache(maxsize=16)
def compiled_speculative(o: SpecOptions):
  """One jit per SpecOptions (threshold, step budget, temperature, top-k/p and the key are traced),
  called as fn(drafter_params, verifier_params, prompt_tokens, prompt_len, threshold, temperature,
  top_k, top_p, rng, steps_per_block)."""
  check_schedule(o.steps_per_sync, o.verify_every)

  def decode(dparams, vparams, prompt_tokens, prompt_len, threshold, temperature, top_k, top_p, rng,
             steps_per_block):
    knobs = sampler.Knobs(threshold, temperature, top_k, top_p, steps_per_block)
    return _decode(o, (dparams, vparams), prompt_tokens, prompt_len, knobs, rng)
  return jax.jit(decode)


def decoder_for(drafter_config: Qwen3Config, verifier_config: Qwen3Config, dc: sampler.DecodeConfig,
                accept_all: bool = False, mesh=None, fuse_projections: bool = True, prefix_len: int = 0):
  """The compiled speculative decoder for a drafter/verifier pair and a DecodeConfig (on `mesh`).
  `accept_all` (tests only): SpecOptions.accept_all; `fuse_projections`, `prefix_len`: SpecOptions'."""
  if dc.block_size < 2:
    raise ValueError(f"decode.mode='speculative' needs a drafter block size >= 2, got {dc.block_size}")
  if dc.mask_token_id is None:
    raise ValueError("decode.mode='speculative' needs the drafter's mask token")
  dcfg = sampler.model_for_decoding(drafter_config, dc)
  vcfg = verifier_config.as_block_diffusion(1).replace(attention_impl=drafter_config.attention_impl)
  check_pair(dcfg, vcfg, dc.mask_token_id)
  return compiled_speculative(SpecOptions(
      dcfg, vcfg, dc.block_size, dc.max_new_tokens // dc.block_size, tuple(dc.eos_ids), dc.mask_token_id,
      dc.kv_write, dc.temperature > 0, bool(accept_all), sampler.sampling_route(dc), int(dc.steps_per_sync),
      int(dc.verify_every), mesh, dc.weight_dtype, bool(fuse_projections), int(prefix_len)))


def generate(drafter_config: Qwen3Config, drafter_params, verifier_config: Qwen3Config, verifier_params,
             prompts: Sequence[Sequence[int]], decode_config: sampler.DecodeConfig, rng=None,
             max_prompt_len: int | None = None, return_device: bool = False, mesh=None) -> dict:
  """Speculative decoding of a batch of prompts (module docstring); numpy outputs + output_ids.
  `mesh`: as in `sampler.generate` (both models' params placed on it)."""
  fn = decoder_for(drafter_config, verifier_config, decode_config, mesh=mesh,
                   prefix_len=prefix.resolve(decode_config.shared_prefix, prompts))
  return generate_with(fn, (drafter_params, verifier_params), prompts, decode_config, rng, max_prompt_len,
                       return_device, mesh)


def generate_with(fn, params: tuple, prompts: Sequence[Sequence[int]], decode_config: sampler.DecodeConfig,
                  rng=None, max_prompt_len: int | None = None, return_device: bool = False, mesh=None) -> dict:
  """`generate` with a compiled decoder `fn` (`decoder_for`); params = (drafter's, verifier's)."""
  dc = decode_config
  max_prompt_len = max_prompt_len or max(len(x) for x in prompts)
  tokens, lengths = sampler.left_pad(prompts, max_prompt_len, dc.pad_id)
  n = n_pad = len(tokens)
  if mesh is not None:
    (tokens, lengths), n = dmesh.put_rows(mesh, tokens, lengths)
    n_pad = tokens.shape[0]
  rng = np.zeros((2,), np.uint32) if rng is None else rng
  out = fn(*params, tokens, lengths, np.float32(dc.threshold), np.float32(dc.temperature),
           np.int32(dc.top_k), np.float32(dc.top_p), rng, np.int32(dc.steps_per_block))
  out = dmesh.take_rows(out, n, n_pad, host=not return_device)
  if return_device:
    return out
  out["output_ids"] = sampler.output_ids(out["tokens"], out["eos_pos"])
  return out
