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

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dgr2_jax.decode import mesh as dmesh
from dgr2_jax.decode import sampler, sampling
from dgr2_jax.model import masks, qwen3
from dgr2_jax.model.config import Qwen3Config

MODES = ("threshold", "speculative")


def check_pair(drafter: Qwen3Config, verifier: Qwen3Config, mask_id: int) -> None:
  """The verifier must share the drafter's vocabulary, up to the mask token it may lack."""
  if verifier.vocab_size not in (drafter.vocab_size, drafter.vocab_size - 1) and verifier.vocab_size < mask_id:
    raise ValueError(f"speculative decoding: the verifier's vocabulary ({verifier.vocab_size}) is neither the "
                     f"drafter's ({drafter.vocab_size}) nor the drafter's without its mask token")


def check_schedule(steps_per_sync: int, verify_every: int) -> None:
  """A group of `steps_per_sync` drafter steps holds whole verification cycles."""
  if verify_every < 0 or (verify_every and steps_per_sync % verify_every):
    raise ValueError(f"decode.verify_every ({verify_every}) must be 0 or divide decode.steps_per_sync "
                     f"({steps_per_sync})")


def _decode(dcfg: Qwen3Config, vcfg: Qwen3Config, block_size: int, num_blocks: int, eos_ids: tuple,
            mask_id: int, kv_write: str, sampled: bool, accept_all: bool, route: str | None, steps_per_sync: int,
            verify_every: int, dparams, vparams, prompt_tokens, prompt_len, threshold, temperature, top_k, top_p,
            rng, steps_per_block, *, mesh=None):
  bsz = block_size
  if route in ("greedy", "sampled"):
    # The filters are off (top_k 0, top_p 1 at run time too): as constants they let XLA drop the
    # cond `sampling.decoding_logprobs` holds on them, a host round trip per step on a GPU.
    top_k, top_p = 0, 1.0
  dcfg, vcfg = dcfg.replace(scan_layers=False), vcfg.replace(scan_layers=False)
  dparams, vparams = qwen3.decode_params(dcfg, dparams), qwen3.decode_params(vcfg, vparams)  # once
  # Block 0 needs a previous block of prompt slots (the drafter) and the verifier a prompt token
  # before the pending one: at least B + 1 prompt slots (pad slots).
  if prompt_tokens.shape[1] < bsz + 1:
    prompt_tokens = jnp.pad(prompt_tokens, ((0, 0), (bsz + 1 - prompt_tokens.shape[1], 0)))
  b, p = prompt_tokens.shape
  kv_write = sampler.resolve_kv_write(kv_write, -(-b // dmesh.data_size(mesh)))   # by rows per device
  r = num_blocks * bsz
  s_d, s_v = p + r, p + r + bsz                                       # the verifier's windows overhang
  vv = vcfg.vocab_size
  v_mask = mask_id if mask_id < vv else None
  pos_d = masks.left_pad_positions(prompt_len, p, s_d)
  pos_v = masks.left_pad_positions(prompt_len, p, s_v)
  eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)
  k_draft, k_verify = jax.random.split(rng)
  draft_keys, verify_keys = jax.random.split(k_draft, b), jax.random.split(k_verify, b)
  rows = jnp.arange(b)
  idx = jnp.arange(bsz)[None, :]
  kwin = jnp.arange(bsz + 1)[None, :]

  # Prefills: the drafter over the whole prompt (its last slot predicts index 0), the verifier over
  # all but the last prompt token (pending for the first round).
  init = lambda cfg, s: dmesh.constrain_cache(mesh, qwen3.init_cache(cfg, b, s))   # rows / kv heads split
  hidden, dcache = sampler.window_forward(dcfg, dparams, prompt_tokens, 0, init(dcfg, s_d),
                                          prompt_len, p, pos_d, return_hidden=True)
  _, vcache = sampler.window_forward(vcfg, vparams, prompt_tokens[:, :p - 1], 0, init(vcfg, s_v),
                                     prompt_len, p, pos_v, return_hidden=True)
  win = sampler.BlockWindows(dcfg, dparams, prompt_tokens, prompt_len, pos_d, bsz, num_blocks, kv_write)

  def draft(st):
    """One drafter step of every row still drafting (a K/V write for rows starting a block)."""
    j = st["block"]
    jc = jnp.minimum(j, num_blocks - 1)
    canvas = st["canvas"][:, :r]
    preds, carry, dcache, writing = win.predictions(st["block"], st["first"], st["done"], canvas,
                                                    st["carry"], st["dcache"])
    block = sampler.row_slice(canvas, jc * bsz, bsz)
    eos_in = st["eos_draft"] - jc * bsz
    cand = (block == mask_id) & (idx <= eos_in[:, None]) & ~(st["done"] | writing)[:, None]
    has = cand.any(1)
    keys = jax.vmap(jax.random.fold_in)(draft_keys, st["dstep"])
    if sampled:
      lp = sampler.decoding_logprobs_of(dcfg, dparams, preds, temperature, top_k, top_p, mask_id)  # [B,bsz,Vd]
      tok = jax.vmap(sampling.categorical)(keys, lp)   # choose_tokens at temperature > 0, without its cond
      conf = jnp.exp(jnp.max(lp, axis=-1))   # not the drawn token's: see the module docstring
    else:
      tok, tok_lp = sampler.choose(dcfg, dparams, preds, keys, temperature, top_k, top_p, mask_id, route)
      conf = jnp.exp(tok_lp)
    left = jnp.where(steps_per_block > 0, jnp.maximum(steps_per_block - (st["dstep"] - st["round_start"]), 1), bsz)
    commit = sampler.commit_mask(conf, cand, threshold, left)
    at = rows[:, None], jc[:, None] * bsz + idx
    new_block = jnp.where(commit, tok, block)
    is_eos = commit & (tok[..., None] == eos).any(-1)
    eos_draft = jnp.minimum(st["eos_draft"], jnp.min(jnp.where(is_eos, jc[:, None] * bsz + idx, r), 1))
    out = dict(st, canvas=st["canvas"].at[at].set(new_block), dcache=dcache, carry=carry,
               cstep=st["cstep"].at[at].set(jnp.where(commit, st["dstep"][:, None], st["cstep"][at])),
               dstep=st["dstep"] + has.astype(jnp.int32), eos_draft=eos_draft,
               first=st["first"] & ~writing & ~has,
               drafter_passes=st["drafter_passes"] + (has | writing).astype(jnp.int32))
    if sampled:  # the drafter's distribution at each committed position, for the acceptance test
      out["qlp"] = jnp.where(commit[..., None], lp, st["qlp"])
    return out

  def ready_rows(st):
    j = jnp.minimum(st["block"], num_blocks - 1)
    block = sampler.row_slice(st["canvas"][:, :r], j * bsz, bsz)
    left = (block == mask_id) & (idx <= (st["eos_draft"] - j * bsz)[:, None])
    return ~st["done"] & ~st["first"] & ~left.any(1)

  def verify(st):
    ready = ready_rows(st)
    n, j = st["n_acc"], jnp.minimum(st["block"], num_blocks - 1)
    start = p - 1 + n                                                  # the pending token's slot
    # Masked slots past the drafts may hold an id the verifier lacks (its vocabulary without the
    # mask token): any valid id will do there, those slots predict nothing that is read.
    seq = jnp.minimum(jnp.concatenate([prompt_tokens, st["canvas"]], axis=1), vv - 1)   # [B, p + r + bsz]
    h, vcache = sampler.window_forward(vcfg, vparams, sampler.row_slice(seq, start, bsz + 1), start, st["vcache"],
                                       prompt_len, p, pos_v, return_hidden=True)
    drafts = sampler.row_slice(st["canvas"], n, bsz + 1)                        # d_k at position n + k
    # Drafts to check: up to the end of the block, or through a drafted EOS.
    n_drafts = jnp.minimum((j + 1) * bsz, st["eos_draft"] + 1) - n     # [B]
    vkeys = jax.vmap(jax.random.fold_in)(verify_keys, st["rounds"])
    if not sampled:
      a, a_lp = sampler.choose(vcfg, vparams, h, vkeys, temperature, top_k, top_p, v_mask, route)
      ok = (drafts == a) & (kwin < n_drafts[:, None])
      m = jnp.argmin(jnp.concatenate([ok, jnp.zeros_like(ok[:, :1])], 1), axis=1)   # leading matches
      x = jnp.take_along_axis(a, m[:, None], 1)[:, 0]
      lp_k = a_lp
    else:
      plp = sampler.decoding_logprobs_of(vcfg, vparams, h, temperature, top_k, top_p, v_mask)  # [B,W,Vv]
      in_blk = jnp.clip(n[:, None] + kwin - j[:, None] * bsz, 0, bsz - 1)                     # [B,W]
      qlp = jnp.take_along_axis(st["qlp"], in_blk[..., None], 1)                              # [B,W,Vd]
      qv = _to_vocab(qlp, vv)                                                                 # [B,W,Vv]
      cs = sampler.row_slice(st["cstep"], n, bsz + 1)
      # The verifiable prefix: commit steps that never decrease (module docstring).
      order_ok = jnp.concatenate([jnp.ones_like(cs[:, :1], bool), cs[:, 1:] >= cs[:, :-1]], 1)
      n_ver = jnp.argmin(jnp.concatenate([order_ok & (kwin < n_drafts[:, None]),
                                          jnp.zeros_like(order_ok[:, :1])], 1), axis=1)
      k_u, k_x = jax.vmap(jax.random.split)(vkeys).swapaxes(0, 1)
      u = jax.vmap(lambda k: jax.random.uniform(k, (bsz + 1,)))(k_u)
      d_safe = jnp.minimum(drafts, vv - 1)
      p_d = jnp.where(drafts < vv, jnp.take_along_axis(plp, d_safe[..., None], -1)[..., 0], -jnp.inf)
      q_d = jnp.take_along_axis(qlp, drafts[..., None], -1)[..., 0]
      ok = (jnp.log(u) < p_d - q_d) & (kwin < n_ver[:, None])
      if accept_all:
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
      lp_k = jnp.where(kwin == m[:, None], lp_x[:, None], lp_k)
    # Emitted this round: drafts n .. n+m-1, then x at n+m (not past R).
    emit = (kwin <= m[:, None]) & (n[:, None] + kwin < r) & ready[:, None]
    toks = jnp.where(kwin == m[:, None], x[:, None], drafts)
    posn = n[:, None] + kwin                                            # [B,W]
    is_eos = emit & (toks[..., None] == eos).any(-1)
    first_eos = jnp.min(jnp.where(is_eos, posn, r), 1)
    emit = emit & (posn <= first_eos[:, None])
    n_new = jnp.where(ready, jnp.minimum(jnp.where(first_eos < r, first_eos + 1, n + m + 1), r), n)
    # Write back: emitted tokens, the rest of the block masked again (the bonus past the block end
    # is the next block's first position).
    blk_end = (j + 1) * bsz
    rng_cols = jnp.arange(r + bsz)[None, :]
    keep = rng_cols < n[:, None]
    redo = ready[:, None] & (rng_cols >= n_new[:, None]) & (rng_cols < jnp.maximum(blk_end, n_new)[:, None])
    canvas = jnp.where(redo & ~keep, mask_id, st["canvas"])
    put = lambda arr, vals: jax.vmap(lambda a_, v_, e_, s_: jnp.where(
        e_, v_, jax.lax.dynamic_slice_in_dim(a_, s_, bsz + 1)))(arr, vals, emit, n)
    upd = lambda arr, vals: jax.vmap(lambda a_, w_, s_: jax.lax.dynamic_update_slice_in_dim(a_, w_, s_, 0))(
        arr, put(arr, vals), n)
    canvas = upd(canvas, toks)
    logprob = upd(jnp.pad(st["logprob"], ((0, 0), (0, bsz))), lp_k)[:, :r]
    rnd = upd(jnp.pad(st["commit_round"], ((0, 0), (0, bsz))),
              jnp.broadcast_to(st["rounds"][:, None], toks.shape))[:, :r]
    done = st["done"] | (ready & ((first_eos < r) | (n_new >= r)))
    block_done = ready & (n_new >= blk_end)
    eos_pos = jnp.where(ready & (first_eos < r), first_eos, st["eos_pos"])
    n_acc_drafts = jnp.where(ready, jnp.minimum(m, n_new - n), 0)
    ra = st["round_accepts"].at[rows, jnp.minimum(st["rounds"], r - 1)].set(
        jnp.where(ready, n_acc_drafts, st["round_accepts"][rows, jnp.minimum(st["rounds"], r - 1)]))
    return dict(st, canvas=canvas, vcache=vcache, n_acc=n_new, logprob=logprob, commit_round=rnd,
                done=done, eos_pos=eos_pos, block=jnp.where(block_done, st["block"] + 1, st["block"]),
                first=jnp.where(block_done, True, st["first"]),
                eos_draft=jnp.where(ready, r, st["eos_draft"]),
                round_start=jnp.where(ready, st["dstep"], st["round_start"]),
                cstep=jnp.where(ready[:, None], -1, st["cstep"]),
                rounds=st["rounds"] + ready.astype(jnp.int32), accepted=st["accepted"] + n_acc_drafts,
                round_accepts=ra)

  def draft_step(st):
    # The drafter runs on every step, not under `lax.cond(some row drafting)`: a GPU copies a
    # cond's predicate to the host, and a verified row drafts again at the next step, so that cond
    # skipped a forward almost never. A row not drafting (ready, or finished) commits nothing.
    live = ~st["done"].all()
    st = draft(st)
    return dict(st, iteration=st["iteration"] + 1, forward_passes=st["forward_passes"] + live.astype(jnp.int32),
                masked_steps=st["masked_steps"] + (~live).astype(jnp.int32))

  def verify_ready(st):
    # Rows not ready change nothing but verifier K/V at and after their pending slot, which their
    # next verification rewrites before any read.
    useful = ready_rows(st).any()
    st = verify(st)
    return dict(st, verifier_calls=st["verifier_calls"] + useful.astype(jnp.int32),
                verifier_forwards=st["verifier_forwards"] + 1)

  def step_with_cond(st):
    # verify_every = 0. A complete draft can wait for its verification without changing any
    # output (the draft and its round's key are fixed), so a batch verifies when at least half of
    # its live rows are ready or none is still drafting: fewer verifier passes at batch > 1, the
    # same rounds. This cond's predicate goes to the host on every step.
    st = draft_step(st)
    ready, live_rows = ready_rows(st), ~st["done"]
    go = ready.any() & ((2 * ready.sum() >= live_rows.sum()) | ~(live_rows & ~ready).any())
    return jax.lax.cond(go, verify_ready, lambda x: x, st)

  def cycle(st):
    # verify_every = m > 0: m drafter steps (a loop of static trip count), then the verifier's
    # pass over every ready row. No predicate leaves the device; a row whose draft completes
    # before the m-th step waits for the pass (its outputs do not depend on when it is verified).
    st = jax.lax.fori_loop(0, verify_every, lambda _, x: draft_step(x), st)
    return verify_ready(st)

  def cond(st):
    # The loop's host-visible predicate, read once per `steps_per_sync` drafter steps. The bound
    # only guards a broken invariant: a round commits >= 1 draft per drafting step, waits < m
    # steps for its pass and emits >= 1 token; each block adds one K/V write.
    return ~st["done"].all() & (st["iteration"] < r * (bsz + verify_every + 2) + num_blocks)

  def steps(st):
    # A fixed trip count of `steps_per_sync` drafter steps; once every row is finished the rest
    # are masked (no output changes).
    if verify_every == 0:
      return jax.lax.fori_loop(0, steps_per_sync, lambda _, x: step_with_cond(x), st)
    return jax.lax.fori_loop(0, steps_per_sync // verify_every, lambda _, x: cycle(x), st)

  st = dict(
      iteration=jnp.int32(0), verifier_calls=jnp.int32(0), verifier_forwards=jnp.int32(0),
      forward_passes=jnp.int32(0), masked_steps=jnp.int32(0),
      block=jnp.zeros((b,), jnp.int32), first=jnp.ones((b,), bool), dstep=jnp.zeros((b,), jnp.int32),
      round_start=jnp.zeros((b,), jnp.int32), canvas=jnp.full((b, r + bsz), mask_id, jnp.int32),
      cstep=jnp.full((b, r + bsz), -1, jnp.int32), eos_draft=jnp.full((b,), r, jnp.int32),
      carry=hidden[:, -1], dcache=dcache, vcache=vcache, n_acc=jnp.zeros((b,), jnp.int32),
      logprob=jnp.zeros((b, r), jnp.float32), commit_round=jnp.full((b, r), -1, jnp.int32),
      eos_pos=jnp.full((b,), r, jnp.int32), done=jnp.zeros((b,), bool), rounds=jnp.zeros((b,), jnp.int32),
      accepted=jnp.zeros((b,), jnp.int32), drafter_passes=jnp.zeros((b,), jnp.int32),
      round_accepts=jnp.full((b, r), -1, jnp.int32))
  if sampled:
    st["qlp"] = jnp.zeros((b, bsz, dcfg.vocab_size), jnp.float32)
  pinned = lambda st: dmesh.constrain_state(mesh, st, b)               # the loop state keeps its shardings
  st = jax.lax.while_loop(cond, lambda st: pinned(steps(st)), pinned(st))
  # nfe / commit_step / steps: the threshold decoder's names, so eval and generate read either
  # (NFE = the row's drafter + verifier forwards after the prefills; a round is its step).
  return dict(tokens=st["canvas"][:, :r], logprob=st["logprob"], commit_round=st["commit_round"],
              eos_pos=st["eos_pos"], rounds=st["rounds"], drafter_passes=st["drafter_passes"],
              accepted=st["accepted"], round_accepts=st["round_accepts"], forward_passes=st["forward_passes"],
              masked_steps=st["masked_steps"],
              verifier_calls=st["verifier_calls"], verifier_forwards=st["verifier_forwards"],
              nfe=st["drafter_passes"] + st["rounds"],
              commit_step=st["commit_round"], steps=st["rounds"])


def _to_vocab(lp, v):
  """Log-probs [..., Vd] on the verifier's vocabulary [..., v] (-inf where the drafter has none)."""
  vd = lp.shape[-1]
  if vd >= v:
    return lp[..., :v]
  return jnp.concatenate([lp, jnp.full(lp.shape[:-1] + (v - vd,), -jnp.inf, lp.dtype)], -1)


@functools.lru_cache(maxsize=16)
def compiled_speculative(dcfg: Qwen3Config, vcfg: Qwen3Config, block_size: int, max_new_tokens: int,
                         eos_ids: tuple, mask_id: int, kv_write: str, sampled: bool, accept_all: bool = False,
                         route: str | None = None, steps_per_sync: int = 8, mesh=None, verify_every: int = 2):
  """One jit per static shape/config (threshold, budget, temperature, top-k/p and key are traced).
  `accept_all` (tests only) keeps every draft: it samples the drafter, not the verifier. `route`:
  the greedy rounds' `sampler.choose` route (`sampler.sampling_route`; None = picked on device).
  `mesh`: see `sampler.compiled_decoder`. `verify_every`: DecodeConfig.verify_every."""
  check_schedule(steps_per_sync, verify_every)
  fn = functools.partial(_decode, dcfg, vcfg, block_size, max_new_tokens // block_size, tuple(eos_ids), mask_id,
                         kv_write, bool(sampled), bool(accept_all), route,
                         int(steps_per_sync), int(verify_every), mesh=mesh)
  return jax.jit(fn)


def decoder_for(drafter_config: Qwen3Config, verifier_config: Qwen3Config, dc: sampler.DecodeConfig,
                accept_all: bool = False, mesh=None):
  """The compiled speculative decoder for a drafter/verifier pair and a DecodeConfig (on `mesh`)."""
  if dc.block_size < 2:
    raise ValueError(f"decode.mode='speculative' needs a drafter block size >= 2, got {dc.block_size}")
  if dc.mask_token_id is None:
    raise ValueError("decode.mode='speculative' needs the drafter's mask token")
  dcfg = sampler.model_for_decoding(drafter_config, dc)
  vcfg = verifier_config.as_block_diffusion(1).replace(attention_impl=drafter_config.attention_impl)
  check_pair(dcfg, vcfg, dc.mask_token_id)
  return compiled_speculative(dcfg, vcfg, dc.block_size, dc.max_new_tokens, tuple(dc.eos_ids), dc.mask_token_id,
                              dc.kv_write, dc.temperature > 0, accept_all, sampler.sampling_route(dc), dc.steps_per_sync,
                              mesh, dc.verify_every)


def generate(drafter_config: Qwen3Config, drafter_params, verifier_config: Qwen3Config, verifier_params,
             prompts: Sequence[Sequence[int]], decode_config: sampler.DecodeConfig, rng=None,
             max_prompt_len: int | None = None, return_device: bool = False, accept_all: bool = False,
             mesh=None) -> dict:
  """Speculative decoding of a batch of prompts (module docstring); numpy outputs + output_ids.
  `mesh`: as in `sampler.generate` (both models' params placed on it)."""
  dc = decode_config
  fn = decoder_for(drafter_config, verifier_config, dc, accept_all, mesh)
  max_prompt_len = max_prompt_len or max(len(x) for x in prompts)
  tokens, lengths = sampler.left_pad(prompts, max_prompt_len, dc.pad_id)
  n = n_pad = len(tokens)
  if mesh is not None:
    (tokens, lengths), n = dmesh.put_rows(mesh, tokens, lengths)
    n_pad = tokens.shape[0]
  rng = np.zeros((2,), np.uint32) if rng is None else rng
  out = fn(drafter_params, verifier_params, tokens, lengths, np.float32(dc.threshold), np.float32(dc.temperature),
           np.int32(dc.top_k), np.float32(dc.top_p), rng, np.int32(dc.steps_per_block))
  out = dmesh.take_rows(out, n, n_pad, host=not return_device)
  if return_device:
    return out
  out["output_ids"] = sampler.output_ids(out["tokens"], out["eos_pos"])
  return out
