"""Slot-level block-diffusion decoding: the batch decoder's per-row loop over a fixed set of slots.

decode/sampler.py decodes a static batch: every row is prefilled together and the loop runs until
the slowest row is done. Its rows already progress independently (own active block, step counter,
window offset into the static KV cache), so here the same per-row state is kept across calls:

  state = init_state()                          # every slot empty (done)
  state = prefill(state, slot, tokens, length)  # one prompt into one slot, the others untouched
  state, iters, active = step(state, k)         # at most k denoising steps of every busy slot

`prefill` runs the prompt's forward on that slot's cache rows only and resets the slot's loop
carry (block 0, step 0, a fully masked canvas); it may run while other slots are mid-block, so a
request is admitted at any denoising step. `step` is decode/sampler.py `_decode`'s loop body, per
row, with the per-batch iteration counter replaced by the row's own (AR: block 0 is predicted by
the prefill's carried state, later blocks by a forward) and the threshold per slot (a request's
own tau). A row decodes exactly as it would alone, so its greedy output equals the batch
decoder's for the same prompt whatever shares the slots (tests/test_serve.py).

Empty or finished slots idle (their window still runs: static shapes); `step` returns how many
iterations ran and how many of them each slot was busy, the engine's wasted row-iterations.
Temperature, top-k/p and the step budget are the engine's (traced), not per request.

Shared prefix (`set_prefix`, decode/prefix.py): a prompt prefix the requests share (the re-ranking
prompt's system message and instructions) is prefilled once for the decoder's life; a prompt that
starts with it (and is longer) gets its K/V copied into the slot at the prompt's pad offset and
prefills only its slots after the prefix (`prefill_stats` counts the slots run per request).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dgr2_jax.decode import prefix, sampler
from dgr2_jax.model import masks, qwen3
from dgr2_jax.model.config import Qwen3Config


class SlotDecoder:
  """Jitted prefill / step over `slots` rows of a static KV cache of `prompt_slots + R` slots."""

  def __init__(self, model_config: Qwen3Config, params, dc: sampler.DecodeConfig, slots: int,
               prompt_slots: int):
    self.dc = dc
    mc = sampler.model_for_decoding(model_config, dc)
    self.config = mc.replace(scan_layers=False)
    # per layer (the KV cache), projections fused, kernels in dc.weight_dtype: once (qwen3.decode_params)
    self.params = qwen3.decode_params(self.config, params, dc.weight_dtype)
    self.bsz = dc.block_size
    self.num_blocks = dc.max_new_tokens // dc.block_size
    self.r = self.num_blocks * self.bsz
    self.p = max(prompt_slots, self.bsz)          # block 0 needs a previous block of prompt slots
    self.slots = slots
    self.mask_id = dc.mask_token_id if dc.mask_token_id is not None else dc.pad_id
    self.eos_ids = tuple(dc.eos_ids) or (-1,)
    self.kv_write = sampler.resolve_kv_write(dc.kv_write, slots)
    self._prefill = jax.jit(self._prefill_fn, donate_argnums=(1,))
    self._step = jax.jit(self._step_fn, donate_argnums=(1,))
    self._release = jax.jit(lambda st, slot: dict(st, done=st["done"].at[slot].set(True)), donate_argnums=(0,))
    self.prefix_tokens, self.prefix_kv = (), None
    # Prefills run, the prompt slots they ran through the model, and how many reused the prefix.
    self.prefill_stats = dict(requests=0, slots=0, reused=0)

  def set_prefix(self, tokens) -> int:
    """Prefills `tokens`, a prompt prefix later requests share, once (module docstring); at most
    prompt_slots - 1 tokens (every prompt prefills its last token itself); empty = none.
    -> the prefix length kept."""
    tokens = [int(t) for t in tokens]
    if len(tokens) > self.p - 1:
      raise ValueError(f"shared prefix: {len(tokens)} tokens, more than prompt_slots - 1 = {self.p - 1}")
    self.prefix_tokens = tuple(tokens)
    fn = jax.jit(lambda params, t: prefix.prefix_cache(self.config, params, t))
    self.prefix_kv = fn(self.params, np.asarray(tokens, np.int32)) if tokens else None
    return len(tokens)

  # ---- state ----------------------------------------------------------------------------------
  def init_state(self) -> dict:
    b, p, r = self.slots, self.p, self.r
    s = p + r
    c = self.config
    plen = jnp.full((b,), p, jnp.int32)   # empty slots: an all-pad prompt of full length (finite)
    return dict(
        prompt_tokens=jnp.full((b, p), self.dc.pad_id, jnp.int32), prompt_len=plen,
        positions=masks.left_pad_positions(plen, p, s),
        step=jnp.zeros((b,), jnp.int32), block=jnp.zeros((b,), jnp.int32),
        first=jnp.ones((b,), bool), block_start=jnp.zeros((b,), jnp.int32),
        canvas=jnp.full((b, r), self.mask_id, jnp.int32), commit_step=jnp.full((b, r), -1, jnp.int32),
        logprob=jnp.zeros((b, r), jnp.float32), eos_pos=jnp.full((b,), r, jnp.int32),
        done=jnp.ones((b,), bool), carry=jnp.zeros((b, c.hidden_size), c.jnp_dtype),
        cache=qwen3.init_cache(c, b, s), nfe=jnp.zeros((b,), jnp.int32),
        threshold=jnp.ones((b,), jnp.float32), row_key=jnp.zeros((b, 2), jnp.uint32),
        limit=jnp.full((b,), self.num_blocks, jnp.int32))

  def prefill(self, state, slot: int, prompt, threshold: float, max_new_tokens: int | None = None,
              rng=None):
    """One prompt (token list, at most prompt_slots long) into `slot`, left-padded; the row stops
    after the block holding its `max_new_tokens`-th token (a multiple of the block size, at most
    the decoder's; the blocks before it decode exactly as with the decoder's own limit)."""
    tokens, lengths = sampler.left_pad([prompt], self.p, self.dc.pad_id)
    rng = np.zeros((2,), np.uint32) if rng is None else np.asarray(rng, np.uint32)
    limit = self.num_blocks if max_new_tokens is None else -(-int(max_new_tokens) // self.bsz)
    if not 1 <= limit <= self.num_blocks:
      raise ValueError(f"max_new_tokens must be in [1, {self.r}], got {max_new_tokens}")
    n = len(self.prefix_tokens)
    reuse = 0 < n < len(prompt) and tuple(prompt[:n]) == self.prefix_tokens
    st = self.prefill_stats
    st["requests"] += 1
    st["slots"] += self.p - n if reuse else self.p
    st["reused"] += int(reuse)
    return self._prefill(self.params, state, np.int32(slot), tokens[0], lengths[0],
                         np.float32(threshold), rng, np.int32(limit), self.prefix_kv if reuse else None)

  def release(self, state, slot: int):
    """Marks `slot` empty (a cancelled or expired request): it idles from the next step on."""
    return self._release(state, np.int32(slot))

  def step(self, state, k: int, stop_on_finish: bool = False):
    """-> (state, iterations run, busy iterations per slot [S]) after at most k steps; with
    `stop_on_finish`, also right after the first iteration in which a busy row finishes (its slot
    is free and its answer ready without waiting out the round)."""
    dc = self.dc
    return self._step(self.params, state, np.int32(k), np.float32(dc.temperature), np.int32(dc.top_k),
                      np.float32(dc.top_p), np.int32(dc.steps_per_block), np.bool_(stop_on_finish))

  # ---- jitted ---------------------------------------------------------------------------------
  def _prefill_fn(self, params, state, slot, tokens, length, threshold, rng, limit, pcache=None):
    p, s = self.p, self.p + self.r
    plen = length[None]
    pos = masks.left_pad_positions(plen, p, s)                           # [1,S]
    row = lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=0)
    cache1 = jax.tree_util.tree_map(row, state["cache"])                 # this slot's cache rows
    run = lambda t, start, cache: sampler.window_forward(self.config, params, t, start, cache, plen, p, pos,
                                                         return_hidden=True)
    n = 0 if pcache is None else jax.tree_util.tree_leaves(pcache)[0].shape[1]   # the shared prefix's K/V
    hidden, cache1 = prefix.prefill(self.config, params, tokens[None], plen, cache1, n, p, run, pcache)
    put = lambda x, v: jax.lax.dynamic_update_slice_in_dim(x, v.astype(x.dtype), slot, axis=0)
    st = dict(state)
    st["cache"] = jax.tree_util.tree_map(put, state["cache"], cache1)
    fresh = dict(prompt_tokens=tokens[None], prompt_len=plen, positions=pos,
                 step=jnp.zeros((1,), jnp.int32), block=jnp.zeros((1,), jnp.int32),
                 first=jnp.ones((1,), bool), block_start=jnp.zeros((1,), jnp.int32),
                 canvas=jnp.full((1, self.r), self.mask_id, jnp.int32),
                 commit_step=jnp.full((1, self.r), -1, jnp.int32), logprob=jnp.zeros((1, self.r), jnp.float32),
                 eos_pos=jnp.full((1,), self.r, jnp.int32), done=jnp.zeros((1,), bool),
                 carry=hidden[:, -1], nfe=jnp.zeros((1,), jnp.int32), threshold=threshold[None],
                 row_key=rng[None], limit=limit[None])
    for k, v in fresh.items():
      st[k] = put(state[k], v)
    return st

  def _step_fn(self, params, state, k, temperature, top_k, top_p, steps_per_block, stop_on_finish):
    c, bsz, nb, r, p = self.config, self.bsz, self.num_blocks, self.r, self.p
    rule = sampler.CommitRule(c, bsz, r, self.eos_ids, self.mask_id)
    b = self.slots

    def predictions(st):
      """-> (hidden predicting every index of each row's active block [S,bsz,E], carry, cache,
      ran [S], writing [S]) (sampler._decode's, per row)."""
      if bsz > 1:
        win = sampler.BlockWindows(c, params, st["prompt_tokens"], st["prompt_len"], st["positions"], bsz, nb,
                                   self.kv_write)
        preds, carry, cache, writing = win.predictions(st["block"], st["first"], st["done"], st["canvas"],
                                                       st["carry"], st["cache"])
        return preds, carry, cache, jnp.ones((b,), bool), writing
      # AR: block 0 is predicted by the prefill's carry; later blocks by the previous token
      blk = jnp.minimum(st["block"], nb - 1)
      seq = jnp.concatenate([st["prompt_tokens"], st["canvas"]], axis=1)
      ran = (st["block"] > 0) & ~st["done"]

      def fwd(args):
        carry, cache = args
        # Rows not running write their window into the last response slot, which AR decoding never
        # attends (the last token's K/V is never needed), so a row waiting at block 0 keeps the
        # prefill's K/V of its last prompt token bit for bit.
        start = jnp.where(ran, p + blk - 1, p + r - 1)
        h, cache = sampler.window_forward(c, params, sampler.row_slice(seq, start, 1), start, cache,
                                          st["prompt_len"], p, st["positions"], return_hidden=True)
        return jnp.where(ran[:, None], h[:, 0], carry), cache
      carry, cache = jax.lax.cond(ran.any(), fwd, lambda a: a, (st["carry"], st["cache"]))
      return carry[:, None], carry, cache, ran, jnp.zeros((b,), bool)

    def body(loop):
      st, it, busy = loop
      preds, carry, cache, ran, writing = predictions(st)
      # The batch decoder's own step (per-slot threshold and block limit): both commit alike.
      knobs = sampler.Knobs(st["threshold"][:, None], temperature, top_k, top_p, steps_per_block)
      upd, has_cand = sampler.denoise_commit(rule, params, sampler.Rows.of(st), preds, writing, st["row_key"],
                                             knobs, st["limit"])
      new = dict(st, **upd.as_dict(), carry=carry, cache=cache,
                 nfe=st["nfe"] + (ran & (has_cand | writing)).astype(jnp.int32))
      return new, it + 1, busy + (~st["done"]).astype(jnp.int32)

    def cond(loop):
      st, it, _ = loop
      finished = (st["done"] & ~state["done"]).any()     # a row busy at the call's start is done
      return (it < k) & ~st["done"].all() & ~(stop_on_finish & finished)

    st, it, busy = jax.lax.while_loop(cond, body, (state, jnp.int32(0), jnp.zeros((b,), jnp.int32)))
    return st, it, busy

