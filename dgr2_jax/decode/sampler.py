"""The block-diffusion decoder: prefill + one `lax.while_loop` over denoising steps, one jit.

Semantics are docs/design.md, per row. Layout: prompts left-padded to `P`
slots (at least one block, so block 0 has a "previous block"), the response in `R = n * B` slots
after them; the KV cache has `P + R` slots and every row uses the same slot for the same response
index (positions differ per row, key ranges hide the padding). A prompt prefix every row shares
can be prefilled once and its K/V copied into each row (`DecodeConfig.shared_prefix`, decode/prefix.py).

Rows progress independently: each row has its own active block, step counter and step budget,
and a row whose block is finished moves to its next block while the others are still denoising.
One loop iteration = one denoising step of every unfinished row = one forward pass of a window
whose start slot is per row (the KV cache is written at per-row offsets):
  * when some row is at the first step of a block j >= 1, the window of every row is [its
    previous block | its active canvas] (2B slots). For a row at its first step this writes the
    previous block's clean K/V into the cache (the contract's "K/V write", fused so it costs no
    extra pass) and the window's slot B - 1 gives the carried distribution for index 0 of the
    block. A row in mid-block rewrites the same clean K/V and keeps its carried distribution;
  * otherwise the window is [active canvas] (B slots); the prediction for index i > 0 comes from
    window slot i - 1, index 0 from the carried state (the final hidden state of the previous
    block's last slot, projected when needed);
  * B = 1 is AR decoding with no diffusion overhead: the window is the one clean token, there is
    no canvas, and the single index is predicted by the carried state (rows advance in lockstep,
    since every row commits exactly one token per step).
Only the B predicting positions of a window are projected to the vocabulary. Without top-k/top-p
the token, its log-probability and confidence come from one pass over the logits (greedy: max,
argmax, logsumexp; sampled: one exponential for the normaliser and an inverse-CDF draw; no
[B, W, V] log-probs); top-k/top-p use `sampling.decoding_logprobs` (the sorted filters). A
finished row idles.

Commit rule (per row, over its masked positions before its first committed EOS): commit every
position whose chosen token has probability >= tau, and always the most confident one; tau >= 1.0
commits exactly one per step. A row whose block holds a committed EOS stops after that block.
Step budget (`steps_per_block` S > 0, our extension of the design's rule, which is S = 0): at the
block's step t (0-based) a row with m candidates commits at least its ceil(m / (S - t)) most
confident ones (ties: lower index first), so no block takes more than S steps. This is the
"denoising steps" budget of LLaDA / Fast-dLLM style evaluation (the paper evaluates with 64 steps):
a model that is confident nowhere is made to commit several positions per step instead of falling
back to one per step, i.e. to AR-like decoding at no speedup.
Forced schedule (`Knobs.commits`, decode/schedule.py): an int per row and step replaces the budget's
minimum count, so at tau 1 the row's step s commits exactly its n_s most confident positions, and
the row finishes where its schedule ends, as at an EOS (a recorded answer's steps, replayed).

`commit_step` counts the row's own steps (0, 1, ...); the key of a row's step s is
`fold_in(row_key, s)`, so a row decodes exactly as it would alone (decode/reference.py decodes each
row by itself). NFE per row = forward passes run after prefill while that row still had positions
to commit; `forward_passes` = loop steps that ran a forward with at least one unfinished row (the
batch's wall-clock count); `masked_steps` = steps run after every row had finished (below).

Host round trips. On a GPU every data-dependent predicate of the loop (a `while_loop` condition,
a `lax.cond` / `lax.switch`) is copied to the host, which then launches what follows: a stall of
tens of microseconds, a visible share of a small model's step. So the loop has one: an outer
`while_loop` ("is every row finished?") whose body is a `fori_loop` of `steps_per_sync` (k) steps,
whose trip count is static (XLA marks it `known_trip_count`: no predicate leaves the device). A
row that finishes inside the k steps idles there (its commits, counters and outputs are left as
they are), and once every row has finished the rest of the k steps are masked: wasted forwards,
at most k - 1 per call, reported as `masked_steps`. Inside a step there is no cond: the sampling
route is chosen at trace time from the DecodeConfig (`sampling_route`; the settings stay traced),
AR step 0 (predicted by the prefill, no forward) runs before the loop, and 'fused' runs its 2B
window on every step. `dgr2_jax/aot/hlo.py` reads this structure back from the compiled program.
The filtered route (top-k/top-p) still holds `sampling.py`'s conds on the traced filter settings.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dgr2_jax import platform
from dgr2_jax.decode import mesh as dmesh
from dgr2_jax.decode import prefix, sampling
from dgr2_jax.decode.config import KV_WRITES, DecodeConfig, decode_config_from  # noqa: F401
from dgr2_jax.model import logits as logits_lib
from dgr2_jax.model import masks, qwen3
from dgr2_jax.model.config import Qwen3Config


# 'auto' on an accelerator: 'fused' up to this many rows per device, 'separate' beyond. A fused
# step's 64-slot window doubles its FLOPs; while the step stays bound by reading the weights that is
# free and saves each row the step 'separate' spends on a block's K/V write, but from a few rows on
# the FLOPs bound the step (benchmarks/decode_bytes.py's FLOP-bound against roofline columns,
# docs/decoding_accelerator.md).
FUSED_MAX_ROWS = 2


def _backend() -> str:
  return platform.backend()   # the target's (a compile-only build), else the host's


def resolve_kv_write(kv_write: str, rows: int | None = None, backend: str | None = None) -> str:
  """DecodeConfig.kv_write for a decoder of `rows` rows per device (None: unknown, taken as few):
  'auto' -> 'separate' on CPU, where a 2B window costs over twice a B window; elsewhere 'fused' up
  to FUSED_MAX_ROWS rows, 'separate' beyond."""
  if kv_write != "auto":
    return kv_write
  if (backend or _backend()) == "cpu":
    return "separate"
  return "fused" if rows is None or rows <= FUSED_MAX_ROWS else "separate"


def left_pad(prompts: Sequence[Sequence[int]], max_prompt_len: int, pad_id: int):
  """list of token lists -> (tokens [B, P] int32 left-padded, lengths [B] int32)."""
  tokens = np.full((len(prompts), max_prompt_len), pad_id, np.int32)
  lengths = np.zeros((len(prompts),), np.int32)
  for i, p in enumerate(prompts):
    if len(p) == 0:
      raise ValueError(f"prompt {i} is empty")
    if len(p) > max_prompt_len:
      raise ValueError(f"prompt {i} has {len(p)} tokens, more than max_prompt_len={max_prompt_len}")
    tokens[i, max_prompt_len - len(p):] = p
    lengths[i] = len(p)
  return tokens, lengths


def window_forward(config, params, tokens, start, cache, prompt_len, prompt_slots: int, positions,
                   return_hidden: bool = False):
  """Forward of the window of slots [start, start + W) against (and into) the KV cache.

  tokens [B,W]; start: one slot for every row, or [B] (one per row); prompt_len [B];
  positions [B,S] of the single-stream layout. The key ranges are the block-causal rule of
  `config.block_size` (masks.sequence_ranges). -> (logits [B,W,V] or hidden [B,W,E], cache)."""
  b, width = tokens.shape
  # The prompt's prefill (static start 0 over the P prompt slots) is causal: no dense bias.
  prefill = isinstance(start, int) and start == 0 and width == prompt_slots
  start = jnp.broadcast_to(jnp.asarray(start, jnp.int32), (b,))
  slots = start[:, None] + jnp.arange(width)[None, :]                         # [B,W]
  ranges = masks.sequence_ranges(prompt_len, prompt_slots, positions.shape[1], config.block_size,
                                 q_slots=np.arange(width) if prefill else slots)
  pos = jnp.take_along_axis(positions, slots, axis=1)
  return qwen3.forward(config, params, tokens, pos, ranges, cache, start, return_hidden=return_hidden)


def row_slice(x, start, width: int):
  """x [B, L, ...] -> [B, width, ...] from per-row start slots start [B]."""
  return jax.vmap(lambda xi, si: jax.lax.dynamic_slice_in_dim(xi, si, width))(x, start)


def _greedy_choice(logits, mask_id):
  """(token, log-prob) of the argmax of softmax(logits) without the mask token: three reductions
  over the logits (max; first index of the max, which XLA's CPU backend runs ~3x faster than its
  variadic argmax; logsumexp), no log-probs materialised."""
  v = logits.shape[-1]
  iota = jnp.arange(v, dtype=jnp.int32)
  x = jnp.where(iota == mask_id, -jnp.inf, logits.astype(jnp.float32))
  top = jnp.max(x, axis=-1)
  tok = jnp.min(jnp.where(x == top[..., None], iota, v), axis=-1)
  lse = top + jnp.log(jnp.sum(jnp.exp(x - top[..., None]), axis=-1))
  return tok, top - lse


def _sampled_choice(key, logits, temperature, mask_id):
  """(token, log-prob) of a draw from softmax(logits / T) without the mask token, unfiltered: one
  exponential over the logits serves both the normaliser and the draw (`sampling.inverse_cdf`),
  no log-probs materialised. The same distribution and draw as `sampling.decoding_logprobs` +
  `sampling.choose_tokens` (what the reference decoder runs)."""
  v = logits.shape[-1]
  x = jnp.where(jnp.arange(v) == mask_id, -jnp.inf, logits.astype(jnp.float32) / temperature)
  top = jnp.max(x, axis=-1, keepdims=True)
  e = jnp.exp(x - top)
  tok = sampling.inverse_cdf(e, jax.random.uniform(key, x.shape[:-1], jnp.float32))
  lse = top[..., 0] + jnp.log(jnp.sum(e, axis=-1))
  return tok, jnp.take_along_axis(x, tok[..., None], -1)[..., 0] - lse


@struct.dataclass
class Knobs:
  """The traced decoding settings (DecodeConfig's): one compilation serves every value. Scalars, or
  per-row arrays where a caller sets them per row (serve/slots.py: threshold [B,1])."""
  threshold: jax.Array         # tau
  temperature: jax.Array       # 0 = greedy
  top_k: jax.Array             # 0 = off
  top_p: jax.Array             # 1.0 = off
  steps_per_block: jax.Array   # 0 = no step budget
  # A forced commit schedule [B, T+1] int32 (decode/schedule.py; None = none): the row's step s
  # commits at least commits[row, s] positions in place of the step budget's minimum (exactly that
  # many at tau 1), and a row finishes once the entry after its step is 0 (the schedule's end).
  commits: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class CommitRule:
  """What a denoising step's choice and commits fix at trace time (`denoise_commit`)."""
  config: Qwen3Config          # the model config the decoder runs (its LM head)
  block_size: int
  response_len: int            # R = num_blocks * block_size response slots
  eos_ids: tuple[int, ...]     # () = no EOS
  mask_id: int
  route: str | None = None     # `sampling_route`; None = picked on the device per step

  @property
  def eos(self) -> jax.Array:
    return jnp.asarray(self.eos_ids if self.eos_ids else (-1,), jnp.int32)


@struct.dataclass
class Rows:
  """Every row's progress through its response: what one denoising step reads and updates."""
  step: jax.Array              # [B] the row's own denoising steps so far (its key's fold-in)
  block: jax.Array             # [B] active block j (num_blocks once finished)
  first: jax.Array             # [B] bool: at block j's first step (owes block j-1's K/V write)
  block_start: jax.Array       # [B] the step block j began at (the step budget's origin)
  canvas: jax.Array            # [B,R] committed tokens, the mask id elsewhere
  commit_step: jax.Array       # [B,R] the step that committed each position, -1 never
  logprob: jax.Array           # [B,R] f32 decoding log-prob of each committed token
  eos_pos: jax.Array           # [B] first committed EOS, R = none
  done: jax.Array              # [B] bool: finished (idles from now on)

  @classmethod
  def start(cls, b: int, r: int, mask_id: int) -> "Rows":
    """`b` rows before their first step, `r` response slots each."""
    return cls(step=jnp.zeros((b,), jnp.int32), block=jnp.zeros((b,), jnp.int32), first=jnp.ones((b,), bool),
               block_start=jnp.zeros((b,), jnp.int32), canvas=jnp.full((b, r), mask_id, jnp.int32),
               commit_step=jnp.full((b, r), -1, jnp.int32), logprob=jnp.zeros((b, r), jnp.float32),
               eos_pos=jnp.full((b,), r, jnp.int32), done=jnp.zeros((b,), bool))

  @classmethod
  def of(cls, state) -> "Rows":
    """The fields of a mapping that holds them (and more: serve/slots.py's slot state)."""
    return cls(**{f.name: state[f.name] for f in dataclasses.fields(cls)})

  def as_dict(self) -> dict:
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def denoise_commit(rule: CommitRule, params, rows: Rows, preds, writing, row_keys, knobs: Knobs,
                   num_blocks) -> tuple[Rows, jax.Array]:
  """One denoising step's choice and commits for every row, from `preds` [B,bsz,E] (the hidden
  states predicting each index of the row's active block); `writing` [B]: rows whose forward was a
  separate K/V write (they commit nothing); `row_keys` [B]. Shared by the batch decoder and the
  serving slots (serve/slots.py), so both commit exactly alike. `knobs.threshold` and `num_blocks`
  are scalars or per-row [B,1] / [B] arrays. Returns (the rows after the step, has_cand [B])."""
  bsz, r, mask_id = rule.block_size, rule.response_len, rule.mask_id
  j, step = rows.block, rows.step                                     # [B], [B]
  b = step.shape[0]
  jc = jnp.minimum(j, num_blocks - 1)
  idx = jnp.arange(bsz)[None, :]
  row_ids = jnp.arange(b)
  canvas = row_slice(rows.canvas, jc * bsz, bsz)                      # [B,bsz]
  eos_in_block = rows.eos_pos - jc * bsz                              # [B] (may be <0 or >=bsz)
  cand = (canvas == mask_id) & (idx < eos_in_block[:, None]) & ~(rows.done | writing)[:, None]   # [B,bsz]
  has_cand = cand.any(axis=1)

  keys = jax.vmap(jax.random.fold_in)(row_keys, step)
  tok, tok_lp = choose(rule.config, params, preds, keys, knobs.temperature, knobs.top_k, knobs.top_p, mask_id,
                       rule.route)
  steps_left = jnp.where(knobs.steps_per_block > 0,
                         jnp.maximum(knobs.steps_per_block - (step - rows.block_start), 1), bsz)
  forced = None if knobs.commits is None else _schedule_at(knobs.commits, step)
  commit = commit_mask(jnp.exp(tok_lp), cand, knobs.threshold, steps_left, forced)

  new_block = jnp.where(commit, tok, canvas)
  at = row_ids[:, None], jc[:, None] * bsz + idx                      # this row's active block
  is_eos = commit & (tok[..., None] == rule.eos).any(-1)
  first_eos = jnp.min(jnp.where(is_eos, jc[:, None] * bsz + idx, r), axis=1)
  eos_pos = jnp.minimum(rows.eos_pos, first_eos)
  remaining = (new_block == mask_id) & (idx < (eos_pos - jc * bsz)[:, None]) & ~rows.done[:, None]
  block_done = ~remaining.any(axis=1) & ~rows.done & ~writing
  done = rows.done | (block_done & ((eos_pos < (jc + 1) * bsz) | (jc + 1 >= num_blocks)))
  if knobs.commits is not None:   # a forced schedule that ends here finishes the row, as an EOS would
    done = done | (has_cand & (_schedule_at(knobs.commits, step + 1) == 0))
  return Rows(
      step=step + has_cand.astype(jnp.int32), block=jnp.where(block_done, j + 1, j),
      first=block_done | (rows.first & ~writing & ~has_cand),
      block_start=jnp.where(block_done, step + 1, rows.block_start),
      canvas=rows.canvas.at[at].set(new_block),
      commit_step=rows.commit_step.at[at].set(jnp.where(commit, step[:, None], rows.commit_step[at])),
      logprob=rows.logprob.at[at].set(jnp.where(commit, tok_lp, rows.logprob[at])),
      eos_pos=eos_pos, done=done), has_cand


def choose(config, params, hidden, keys, temperature, top_k, top_p, mask_id, route: str | None = None):
  """Token and its log-prob under the decoding distribution, per position.

  hidden [B,N,E]; keys [B] (one per row). The LM head is read once per step: when the step's f32
  logits fit `config.logits_budget_bytes`, one matmul over every position; beyond it, greedy steps
  walk the vocabulary in tiles (`logits.greedy_over_vocab`) and sampled ones project a few rows
  at a time (model/logits.py). Without top-k/top-p: `_greedy_choice` or `_sampled_choice` (one
  pass over the logits); with them `sampling.decoding_logprobs` + `sampling.choose_tokens`.
  `route` (static, `sampling_route`) picks one at trace time; None picks it on the device from the
  traced settings (a `lax.switch`/`lax.cond`, whose predicate a GPU copies to the host: the
  decoders always pass the route)."""
  def rows(xs):
    h, k = xs
    lg = qwen3.lm_head(config, params, h)                                       # [b,N,V]

    def general(lg):
      lp = sampling.decoding_logprobs(lg, temperature, top_k, top_p, mask_id)
      tok = jax.vmap(lambda kk, l: sampling.choose_tokens(kk, l, temperature))(k, lp)   # [b,N]
      return tok, jnp.take_along_axis(lp, tok[..., None], -1)[..., 0]
    greedy = lambda lg: _greedy_choice(lg, mask_id)
    sampled = lambda lg: jax.vmap(lambda kk, l: _sampled_choice(kk, l, temperature, mask_id))(k, lg)
    if route is not None:
      return {"greedy": greedy, "sampled": sampled, "filtered": general}[route](lg)
    filtered = (top_k > 0) | (top_p < 1.0)
    return jax.lax.switch(jnp.where(filtered, 2, jnp.where(temperature > 0, 1, 0)), (greedy, sampled, general), lg)
  b, n = hidden.shape[:2]
  per = _rows_per_chunk(config, b, n)
  if per >= b:                                                                # one matmul
    return rows((hidden, keys))
  tiles = lambda xs: logits_lib.greedy_over_vocab(config, params, xs[0], mask_id)
  chunks = lambda xs: logits_lib.map_positions(rows, xs, per)
  if route is not None:
    return (tiles if route == "greedy" else chunks)((hidden, keys))
  greedy = (temperature <= 0) & (top_k <= 0) & (top_p >= 1.0)
  return jax.lax.cond(greedy, tiles, chunks, (hidden, keys))


ROUTES = ("greedy", "sampled", "filtered")


def sampling_route(dc: "DecodeConfig") -> str:
  """The route of `choose` for a DecodeConfig, fixed at trace time (the settings inside it stay
  traced: one compilation serves every temperature > 0, every top-k/top-p)."""
  if dc.top_k > 0 or dc.top_p < 1.0:
    return "filtered"
  return "sampled" if dc.temperature > 0 else "greedy"


def _schedule_at(commits, step):
  """commits [B, T+1] (`Knobs.commits`) at each row's step [B], past the end read as its last (0) column."""
  return jnp.take_along_axis(commits, jnp.minimum(step, commits.shape[1] - 1)[:, None], axis=1)[:, 0]


def confidence_rank(conf, cand):
  """Rank of each candidate by confidence (0 = most confident; ties -> lower index first), as a
  stable argsort would give; non-candidates rank after every candidate. conf, cand [B,N]."""
  c = jnp.where(cand, conf, -1.0)
  n = c.shape[1]
  idx = jnp.arange(n)
  before = ((c[:, None, :] > c[:, :, None])
            | ((c[:, None, :] == c[:, :, None]) & (idx[None, None, :] < idx[None, :, None])))
  return before.sum(-1)                                                       # [B,N]


def commit_mask(conf, cand, threshold, steps_left, forced=None):
  """The commit rule (module docstring) for one step: cand, conf [B,N]; steps_left [B]. `forced`
  [B] (a forced schedule's entries, `Knobs.commits`): the minimum count in place of the budget's."""
  rank = confidence_rank(conf, cand)
  k_min = (cand.sum(axis=1) + steps_left - 1) // steps_left                  # [B]; 1 without a budget
  if forced is not None:
    k_min = forced
  return cand & (((conf >= threshold) & (threshold < 1.0)) | (rank < k_min[:, None]))


def decoding_logprobs_of(config, params, hidden, temperature, top_k, top_p, mask_id):
  """`sampling.decoding_logprobs` of hidden [B,N,E] projected to the vocabulary, a few rows at a
  time at large vocabularies -> [B,N,V] (the sampled paths that need the whole distribution)."""
  b, n = hidden.shape[:2]
  fn = lambda h: sampling.decoding_logprobs(qwen3.lm_head(config, params, h), temperature, top_k, top_p, mask_id)
  return logits_lib.map_positions(fn, hidden, _rows_per_chunk(config, b, n))


def _rows_per_chunk(config, rows: int, n: int) -> int:
  """Rows of n positions whose f32 logits fit `config.logits_budget_bytes` (1 <= . <= rows)."""
  per = int(config.logits_budget_bytes) // (4 * n * int(config.vocab_size))
  return max(1, min(per, rows))


@dataclasses.dataclass(frozen=True)
class BlockWindows:
  """The window forward of a block-diffusion model decoding blocks of `block_size` (B > 1) with
  per-row progress (module docstring), shared by threshold and speculative decoding."""
  config: Qwen3Config
  params: object
  prompt_tokens: jax.Array   # [B,P] left-padded, P >= block size
  prompt_len: jax.Array      # [B]
  positions: jax.Array       # [B,P+R]
  block_size: int
  num_blocks: int
  kv_write: str              # 'fused' | 'separate' (resolved)

  def predictions(self, block, first, done, canvas, carry, cache):
    """-> (hidden predicting each index of every row's active block [B,B_,E], carry, cache,
    writing [B]: rows whose forward was a separate K/V write and commit nothing)."""
    bsz, p = self.block_size, self.prompt_tokens.shape[1]
    blk = jnp.minimum(block, self.num_blocks - 1)                    # finished rows: any valid block
    seq = jnp.concatenate([self.prompt_tokens, canvas], axis=1)      # [B,S]
    due = first & (block > 0) & ~done                                 # rows owing block j-1's K/V write

    def run(start, width, cache):
      tokens = row_slice(seq, start, width)
      return window_forward(self.config, self.params, tokens, start, cache, self.prompt_len, p,
                            self.positions, return_hidden=True)

    def fused(args):  # [previous block | canvas] for every row
      carry, cache = args
      h, cache = run(p + (blk - 1) * bsz, 2 * bsz, cache)            # start >= p - bsz >= 0
      carry = jnp.where(due[:, None], h[:, bsz - 1], carry)
      return jnp.concatenate([carry[:, None], h[:, bsz:2 * bsz - 1]], 1), carry, cache

    def canvas_only(args):
      carry, cache = args
      h, cache = run(p + blk * bsz, bsz, cache)
      return jnp.concatenate([carry[:, None], h[:, :bsz - 1]], 1), carry, cache

    def separate(args):  # rows owing the write spend this forward on it (B-slot windows only)
      carry, cache = args
      h, cache = run(jnp.where(due, p + (blk - 1) * bsz, p + blk * bsz), bsz, cache)
      carry = jnp.where(due[:, None], h[:, bsz - 1], carry)
      return jnp.concatenate([carry[:, None], h[:, :bsz - 1]], 1), carry, cache

    no_write = jnp.zeros_like(done)
    if self.num_blocks == 1:  # a single block never writes K/V of a previous one
      return canvas_only((carry, cache)) + (no_write,)
    if self.kv_write == "separate":
      return separate((carry, cache)) + (due,)
    # 'fused' runs the 2B window on every step, not `lax.cond(due.any(), fused, canvas_only)`: a
    # GPU copies a cond's predicate to the host (a round trip per step), while 'auto' picks 'fused'
    # only where a 2B window costs about what a B window does (a few rows on an accelerator,
    # `resolve_kv_write`). A mid-block row rewrites its previous block's clean K/V with the same
    # values and keeps its carried distribution.
    return fused((carry, cache)) + (no_write,)


@dataclasses.dataclass(frozen=True)
class DecoderOptions:
  """What a compiled threshold decoder fixes at trace time (`compiled_decoder`: one jit per value)."""
  config: Qwen3Config          # the model config it runs (`model_for_decoding`)
  block_size: int
  num_blocks: int              # R = num_blocks * block_size response slots
  eos_ids: tuple[int, ...]
  mask_id: int
  kv_write: str = "auto"       # DecodeConfig.kv_write ('auto' resolved by rows per device)
  route: str | None = None     # `sampling_route`; None = picked on the device per step
  steps_per_sync: int = 8      # decode steps per host round trip
  mesh: object = None          # decode/mesh.py: the loop state pinned to it; None = one device
  prefix_len: int = 0          # a shared prompt prefix prefilled once (decode/prefix.py); 0 = none
  weight_dtype: str = ""       # DecodeConfig.weight_dtype (qwen3.decode_params)
  fuse_projections: bool = True   # qwen3.decode_params' fuse: q/k/v and gate/up one matmul each


@struct.dataclass
class DecodeState:
  """The threshold decoder's loop state."""
  rows: Rows
  carry: jax.Array             # [B,E] hidden state predicting index 0 of each row's active block
  cache: object                # the KV cache, P + R slots
  nfe: jax.Array               # [B] forwards run while the row had work
  iteration: jax.Array         # () loop steps run (forwards; AR step 0 is none)
  forward_passes: jax.Array    # () steps run with at least one unfinished row
  masked_steps: jax.Array      # () steps run after every row finished

  @classmethod
  def start(cls, rows: Rows, carry, cache) -> "DecodeState":
    b = carry.shape[0]
    return cls(rows=rows, carry=carry, cache=cache, nfe=jnp.zeros((b,), jnp.int32), iteration=jnp.int32(0),
               forward_passes=jnp.int32(0), masked_steps=jnp.int32(0))


def _decode(o: DecoderOptions, params, prompt_tokens, prompt_len, knobs: Knobs, rng) -> dict:
  c, bsz, num_blocks = o.config.replace(scan_layers=False), o.block_size, o.num_blocks
  # Per layer, in the compute dtype, projections fused (and quantized): once per call; nothing
  # when the caller passed params it prepared (qwen3.decode_params is idempotent).
  params = qwen3.decode_params(c, params, o.weight_dtype, o.fuse_projections)
  if prompt_tokens.shape[1] < bsz:  # block 0 needs a previous block of prompt slots (pad slots)
    prompt_tokens = jnp.pad(prompt_tokens, ((0, 0), (bsz - prompt_tokens.shape[1], 0)))
  b, p = prompt_tokens.shape
  kv_write = resolve_kv_write(o.kv_write, -(-b // dmesh.data_size(o.mesh)))   # by rows per device
  r = num_blocks * bsz
  s = p + r
  positions = masks.left_pad_positions(prompt_len, p, s)              # [B,S]
  rule = CommitRule(c, bsz, r, o.eos_ids, o.mask_id, o.route)
  row_keys = jax.random.split(rng, b)

  def run(tokens, start, cache):
    return window_forward(c, params, tokens, start, cache, prompt_len, p, positions, return_hidden=True)

  cache = dmesh.constrain_cache(o.mesh, qwen3.init_cache(c, b, s))   # rows over data, kv heads over tensor
  # hidden[:, -1] predicts index 0 of block 0; a shared prefix's K/V computed once (decode/prefix.py)
  hidden, cache = prefix.prefill(c, params, prompt_tokens, prompt_len, cache, o.prefix_len, p, run)

  win = BlockWindows(c, params, prompt_tokens, prompt_len, positions, bsz, num_blocks, kv_write)

  def predictions(st: DecodeState, forward: bool):
    """-> (hidden predicting each index of every row's active block [B,bsz,E], carry, cache,
    writing). `forward` False (static): AR step 0, predicted by the prefill's carry."""
    rows = st.rows
    if bsz > 1:
      return win.predictions(rows.block, rows.first, rows.done, rows.canvas, st.carry, st.cache)
    if not forward:
      return st.carry[:, None], st.carry, st.cache, jnp.zeros_like(rows.done)
    # AR: the one token of the previous block
    start = p + jnp.minimum(rows.block, num_blocks - 1) - 1
    seq = jnp.concatenate([prompt_tokens, rows.canvas], axis=1)
    h, cache = run(row_slice(seq, start, 1), start, st.cache)
    return h[:, :1], h[:, 0], cache, jnp.zeros_like(rows.done)

  def body(st: DecodeState, forward: bool = True) -> DecodeState:
    """One denoising step of every unfinished row. A finished row's outputs and counters are left
    as they are (its forward runs on a clamped block and writes only K/V no later read uses)."""
    preds, carry, cache, writing = predictions(st, forward)   # writing rows commit nothing this time
    rows, has_cand = denoise_commit(rule, params, st.rows, preds, writing, row_keys, knobs, num_blocks)
    live = ~st.rows.done.all()                                        # some row had work this step
    return DecodeState(
        rows=rows, iteration=st.iteration + int(forward), carry=carry, cache=cache,
        nfe=st.nfe + (forward & (has_cand | writing)).astype(jnp.int32),
        forward_passes=st.forward_passes + (forward & live).astype(jnp.int32),
        masked_steps=st.masked_steps + (forward & ~live).astype(jnp.int32))

  def cond(st: DecodeState):
    # The only predicate the host reads: once per `steps_per_sync` steps. Every step commits >= 1
    # token in each row that still has work (or writes its previous block's K/V), so a row takes
    # at most R steps + one write per block; the bound only guards against a broken invariant.
    return ~st.rows.done.all() & (st.iteration < r + num_blocks + 1)

  def steps(st: DecodeState) -> DecodeState:
    # A fixed trip count: no predicate leaves the device. Once every row is finished, the rest
    # of these steps are masked (they change no output; counted in `masked_steps`).
    return jax.lax.fori_loop(0, o.steps_per_sync, lambda _, x: body(x), st)

  st = DecodeState.start(Rows.start(b, r, o.mask_id), hidden[:, -1], cache)
  if bsz == 1:  # AR step 0 before the loop: the prefill predicted index 0, no forward
    st = body(st, forward=False)
  pinned = lambda st: dmesh.constrain_state(o.mesh, st, b)             # the loop state keeps its shardings
  st = jax.lax.while_loop(cond, lambda st: pinned(steps(st)), pinned(st))
  rows = st.rows
  return dict(tokens=rows.canvas, commit_step=rows.commit_step, logprob=rows.logprob,
              nfe=st.nfe, eos_pos=rows.eos_pos, steps=rows.step,
              forward_passes=st.forward_passes, masked_steps=st.masked_steps)


@functools.lru_cache(maxsize=32)
def jitted_decoder(o: DecoderOptions):
  """One jitted function per DecoderOptions: per static shape/config, sampling route
  (`sampling_route`; None = picked on the device per step), mesh, shared prefix and weight
  preparation; tau, temperature, top-k/p, the key and the step budget are traced. `o.mesh`
  (decode/mesh.py): the loop state is pinned to it (rows over data, the KV cache over tensor); the
  params and prompts arrive already placed on it. `o.prefix_len` > 0: every prompt starts with the
  same that many tokens, prefilled once (decode/prefix.py `resolve`). `o.weight_dtype`,
  `o.fuse_projections`: how the params are prepared (`qwen3.decode_params`). Called as
  fn(params, prompt_tokens, prompt_len, threshold, temperature, top_k, top_p, rng, steps_per_block,
  commits=None) (`commits`: a forced schedule, `Knobs.commits`)."""
  if o.route is not None and o.route not in ROUTES:
    raise ValueError(f"sampling route must be one of {ROUTES}, got {o.route!r}")

  def decode(params, prompt_tokens, prompt_len, threshold, temperature, top_k, top_p, rng, steps_per_block=0,
             commits=None):
    knobs = Knobs(threshold, temperature, top_k, top_p, steps_per_block, commits)
    return _decode(o, params, prompt_tokens, prompt_len, knobs, rng)
  return jax.jit(decode)


def compiled_decoder(model_config: Qwen3Config, block_size: int, max_new_tokens: int,
                     eos_ids: tuple, mask_id: int, kv_write: str = "auto", route: str | None = None,
                     steps_per_sync: int = 8, mesh=None, **options):
  """`jitted_decoder` of these DecoderOptions; `options`: its other fields by name (prefix_len,
  weight_dtype, fuse_projections)."""
  return jitted_decoder(DecoderOptions(model_config, block_size, max_new_tokens // block_size, tuple(eos_ids),
                                       mask_id, kv_write, route, int(steps_per_sync), mesh, **options))


compiled_decoder.cache_clear = jitted_decoder.cache_clear   # the compiled decoders are jitted_decoder's


def decoder_for(model_config: Qwen3Config, dc: DecodeConfig, mesh=None, prefix_len: int = 0,
                fuse_projections: bool = True):
  """(the model config it runs, the compiled decoder) for a DecodeConfig (on `mesh`, if given). The
  decoder serves every DecodeConfig with the same static fields and `sampling_route` (run it with
  `run_decoder`); with `prefix_len` > 0, prompts that all start with the same that many tokens
  (`prefix.resolve` of `dc.shared_prefix` and the batch). `fuse_projections` False: q/k/v and
  gate/up stay separate matmuls (an A/B of `qwen3.decode_params`' fusion)."""
  model_config = model_for_decoding(model_config, dc)
  mask_id = dc.mask_token_id if dc.mask_token_id is not None else dc.pad_id
  return model_config, compiled_decoder(model_config, dc.block_size, dc.max_new_tokens, tuple(dc.eos_ids),
                                        mask_id, dc.kv_write, sampling_route(dc), dc.steps_per_sync, mesh,
                                        prefix_len=int(prefix_len), weight_dtype=dc.weight_dtype,
                                        fuse_projections=bool(fuse_projections))


def run_decoder(fn, params, prompt_tokens, prompt_len, dc: DecodeConfig, rng=None, commits=None):
  """Calls a `compiled_decoder` with `dc`'s traced settings (device arrays out). Host values go in
  as NumPy (one transfer with the call, no per-scalar dispatch: at batch 1 the host side of a call
  is a visible share of its wall-clock); rng None = PRNGKey(0). `commits`: a forced schedule [B, T+1]
  (`Knobs.commits`, decode/schedule.py's `forced_commits`; None = none)."""
  rng = np.zeros((2,), np.uint32) if rng is None else rng   # == jax.random.PRNGKey(0)
  return fn(params, prompt_tokens, prompt_len, np.float32(dc.threshold), np.float32(dc.temperature),
            np.int32(dc.top_k), np.float32(dc.top_p), rng, np.int32(dc.steps_per_block), commits)


def decode_config_for(model_config: Qwen3Config, **kw) -> DecodeConfig:
  """DecodeConfig with the model's EOS / mask / pad ids filled in."""
  kw.setdefault("eos_ids", model_config.eos_ids)
  kw.setdefault("mask_token_id", model_config.mask_token_id)
  kw.setdefault("pad_id", model_config.pad_token_id if model_config.pad_token_id is not None else 0)
  return DecodeConfig(**kw)


def model_for_decoding(model_config: Qwen3Config, dc: DecodeConfig) -> Qwen3Config:
  """The model config the decoder runs: block-causal of `dc.block_size` (an AR checkpoint is
  converted on the fly, weights unchanged), causal for block size 1."""
  if dc.block_size > 1 and (model_config.attention != "block_causal" or model_config.block_size != dc.block_size):
    return model_config.as_block_diffusion(dc.block_size, dc.mask_token_id)
  if dc.block_size == 1 and model_config.block_size != 1:
    return model_config.as_block_diffusion(1)
  return model_config


def output_ids(tokens: np.ndarray, eos_pos: np.ndarray) -> list[list[int]]:
  """Per row: the canvas truncated after the first EOS (EOS included)."""
  r = tokens.shape[1]
  return [row[:min(int(e) + 1, r)].tolist() for row, e in zip(tokens, eos_pos)]


def generate(model_config: Qwen3Config, params, prompts: Sequence[Sequence[int]],
             decode_config: DecodeConfig, rng=None, max_prompt_len: int | None = None,
             return_device: bool = False, mesh=None) -> dict:
  """Decodes a batch of prompts (token-id lists). See the module docstring for the semantics.

  Returns numpy arrays: tokens [B,R] (the final canvas, mask id where never committed),
  commit_step [B,R] (-1 = never committed), logprob [B,R], nfe [B], steps [B] (the row's own
  denoising steps), forward_passes, masked_steps (module docstring), and output_ids (per row,
  truncated after the first EOS, EOS included). `mesh` (decode/mesh.py; `params` placed on it by
  `mesh.put_params`): the rows are split over its data axis (padded to a multiple of its size, pad
  rows dropped from the outputs), the model over its tensor axis; the outputs equal one device's.
  """
  dc = decode_config
  model_config, fn = decoder_for(model_config, dc, mesh, prefix.resolve(dc.shared_prefix, prompts))
  max_prompt_len = max_prompt_len or max(len(x) for x in prompts)
  tokens, lengths = left_pad(prompts, max_prompt_len, dc.pad_id)
  n = n_pad = len(tokens)
  if mesh is not None:
    (tokens, lengths), n = dmesh.put_rows(mesh, tokens, lengths)
    n_pad = tokens.shape[0]
  out = run_decoder(fn, params, tokens, lengths, dc, rng)
  out = dmesh.take_rows(out, n, n_pad, host=not return_device)
  if return_device:
    return out
  out["output_ids"] = output_ids(out["tokens"], out["eos_pos"])
  return out
