"""The block-diffusion decoder: prefill + one `lax.while_loop` over denoising steps, one jit.

Semantics are ../shared/design/block-diffusion.md. Layout: prompts left-padded to `P` slots, the
response in `R = n * B` slots after them; the KV cache has `P + R` slots and every row uses the same
slot for the same response index (positions differ per row, masks hide the padding).

One loop iteration = one denoising step of the active block j = at most one forward pass:
  * first step of block j >= 1: the window is [clean block j-1 | canvas j]. It writes block j-1's
    clean K/V into the cache (the "K/V write" of the contract, fused so it costs no extra pass) and
    its last position gives the carried distribution for index 0 of block j.
  * other steps: the window is [canvas j]; prediction for index i > 0 comes from window slot i - 1.
  * B = 1 is AR decoding with no diffusion overhead: the window is the one clean token, there is no
    canvas, and the single index is predicted by the carried distribution.
Rows run in lockstep over blocks: block j + 1 starts when every unfinished row has completed j.
A row finished early idles (no commits, no NFE counted for it) while the others finish.

Commit rule (per row, over its masked positions before its first committed EOS): commit every
position whose chosen token has probability >= tau, and always the most confident one; tau >= 1.0
commits exactly one per step. A row whose block holds a committed EOS stops after that block.
Step budget (`steps_per_block` S > 0, our extension of the design's rule, which is S = 0): at the
block's step t (0-based) a row with m candidates commits at least its ceil(m / (S - t)) most
confident ones (ties: lower index first), so no block takes more than S steps. This is the
"denoising steps" budget of LLaDA / Fast-dLLM style evaluation (the paper evaluates with 64 steps):
a model that is confident nowhere is made to commit several positions per step instead of falling
back to one per step, i.e. to AR-like decoding at no speedup.

NFE per row = forward passes run after prefill while that row still had positions to commit.
`forward_passes` is the batch's count (the wall-clock-relevant one).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dgr2_jax.decode import sampling
from dgr2_jax.model import masks, qwen3
from dgr2_jax.model.config import Qwen3Config


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  block_size: int = 32
  threshold: float = 0.9          # tau; traced (no recompile)
  temperature: float = 0.0        # 0 = greedy; traced
  top_k: int = 0                  # 0 = off; traced
  top_p: float = 1.0              # 1.0 = off; traced
  steps_per_block: int = 0        # 0 = no budget; else at most this many steps per block; traced
  max_new_tokens: int = 128       # multiple of block_size; static
  eos_ids: tuple[int, ...] = ()
  mask_token_id: int | None = None
  pad_id: int = 0

  def __post_init__(self):
    if self.block_size < 1:
      raise ValueError(f"decode.block_size must be >= 1, got {self.block_size}")
    if self.max_new_tokens % self.block_size:
      raise ValueError(f"decode.max_new_tokens ({self.max_new_tokens}) must be a multiple of "
                       f"decode.block_size ({self.block_size})")
    if not 0.0 < self.threshold <= 1.0:
      raise ValueError(f"decode.threshold must be in (0, 1], got {self.threshold}")
    if self.temperature < 0:
      raise ValueError(f"decode.temperature must be >= 0, got {self.temperature}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"decode.top_p must be in (0, 1], got {self.top_p}")
    if self.steps_per_block < 0:
      raise ValueError(f"decode.steps_per_block must be >= 0, got {self.steps_per_block}")
    if self.block_size > 1 and self.mask_token_id is None:
      raise ValueError("decode.block_size > 1 needs a mask token (model config mask_token_id)")


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


def window_forward(config, params, tokens, start, cache, slot_ids, key_valid, positions):
  """Forward of a window of slots [start, start + W) against (and into) the KV cache.

  tokens [B,W]; slot_ids [S]; key_valid, positions [B,S]. Single-stream block-causal mask.
  """
  width = tokens.shape[1]
  q_ids = jax.lax.dynamic_slice_in_dim(slot_ids, start, width)
  pos = jax.lax.dynamic_slice_in_dim(positions, start, width, axis=1)
  mask = masks.block_causal_mask(q_ids, slot_ids, key_valid)         # [B,W,S]
  return qwen3.forward(config, params, tokens, pos, mask, cache, start)


def _decode(model_config: Qwen3Config, block_size: int, num_blocks: int, eos_ids: tuple,
            mask_id: int, params, prompt_tokens, prompt_len, threshold, temperature, top_k, top_p, rng,
            steps_per_block=0):
  c, bsz = model_config, block_size
  b, p = prompt_tokens.shape
  r = num_blocks * bsz
  s = p + r
  slot_ids = masks.slot_block_ids(p, s, bsz)                         # [S]
  key_valid = masks.left_pad_valid(prompt_len, p, s)                  # [B,S]
  positions = masks.left_pad_positions(prompt_len, p, s)              # [B,S]
  eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)
  row_keys = jax.random.split(rng, b)

  def run(tokens, start, cache):
    return window_forward(c, params, tokens, start, cache, slot_ids, key_valid, positions)

  cache = qwen3.init_cache(c, b, s)
  logits, cache = run(prompt_tokens, 0, cache)
  carry_logits = logits[:, -1]                                        # [B,V]: predicts response index 0

  def block_slice(x, j):  # [B, R] -> [B, bsz] of block j
    return jax.lax.dynamic_slice_in_dim(x, j * bsz, bsz, axis=1)

  def predictions(st):
    """-> (logits for each index of the active block [B,bsz,V], carry, cache, ran_forward)."""
    j = st["block"]
    canvas = block_slice(st["canvas"], j)

    def fused(args):
      carry, cache = args
      clean = block_slice(st["canvas"], jnp.maximum(j - 1, 0))
      window = clean if bsz == 1 else jnp.concatenate([clean, canvas], axis=1)
      lg, cache = run(window, p + (j - 1) * bsz, cache)
      carry = lg[:, bsz - 1]
      preds = carry[:, None] if bsz == 1 else jnp.concatenate([carry[:, None], lg[:, bsz:2 * bsz - 1]], 1)
      return preds, carry, cache

    def canvas_only(args):
      carry, cache = args
      if bsz == 1:  # block 0 of AR decoding: the prefill already predicted it
        return carry[:, None], carry, cache
      lg, cache = run(canvas, p + j * bsz, cache)
      return jnp.concatenate([carry[:, None], lg[:, :bsz - 1]], 1), carry, cache

    if num_blocks == 1:  # a single block never writes K/V of a previous one
      use_fused = jnp.bool_(False)
      preds, carry, cache = canvas_only((st["carry"], st["cache"]))
    else:
      use_fused = st["first"] & (j > 0)
      preds, carry, cache = jax.lax.cond(use_fused, fused, canvas_only, (st["carry"], st["cache"]))
    ran = use_fused | (bsz > 1)
    return preds, carry, cache, ran

  def body(st):
    j, step = st["block"], st["step"]
    preds, carry, cache, ran = predictions(st)
    idx = jnp.arange(bsz)[None, :]
    canvas = block_slice(st["canvas"], j)
    eos_in_block = st["eos_pos"] - j * bsz                            # [B] (may be <0 or >=bsz)
    cand = (canvas == mask_id) & (idx < eos_in_block[:, None]) & ~st["done"][:, None]   # [B,bsz]
    has_cand = cand.any(axis=1)

    logp = sampling.decoding_logprobs(preds, temperature, top_k, top_p, mask_id)            # [B,bsz,V]
    keys = jax.vmap(lambda k: jax.random.fold_in(k, step))(row_keys)
    tok = jax.vmap(lambda k, lp: sampling.choose_tokens(k, lp, temperature))(keys, logp)  # [B,bsz]
    tok_lp = jnp.take_along_axis(logp, tok[..., None], -1)[..., 0]
    conf = jnp.exp(tok_lp)
    # Rank of each candidate by confidence (0 = most confident; stable sort: ties -> lower index).
    order = jnp.argsort(-jnp.where(cand, conf, -1.0), axis=1, stable=True)
    rank = jnp.argsort(order, axis=1)                                   # [B,bsz]
    steps_left = jnp.where(steps_per_block > 0,
                           jnp.maximum(steps_per_block - (step - st["block_start"]), 1), bsz)
    n_cand = cand.sum(axis=1)
    k_min = (n_cand + steps_left - 1) // steps_left                     # [B]; 1 without a budget
    commit = cand & (((conf >= threshold) & (threshold < 1.0)) | (rank < k_min[:, None]))

    new_block = jnp.where(commit, tok, canvas)
    cstep = jnp.where(commit, step, block_slice(st["commit_step"], j))
    lp_rec = jnp.where(commit, tok_lp, block_slice(st["logprob"], j))
    is_eos = commit & (tok[..., None] == eos).any(-1)
    first_eos = jnp.min(jnp.where(is_eos, j * bsz + idx, r), axis=1)
    eos_pos = jnp.minimum(st["eos_pos"], first_eos)

    upd = lambda x, blk: jax.lax.dynamic_update_slice_in_dim(x, blk, j * bsz, axis=1)
    canvas_all = upd(st["canvas"], new_block)
    remaining = (new_block == mask_id) & (idx < (eos_pos - j * bsz)[:, None]) & ~st["done"][:, None]
    block_done = ~remaining.any()
    done = st["done"] | (block_done & (eos_pos < (j + 1) * bsz))
    return dict(
        step=step + 1, block=jnp.where(block_done, j + 1, j), first=block_done,
        block_start=jnp.where(block_done, step + 1, st["block_start"]),
        canvas=canvas_all, commit_step=upd(st["commit_step"], cstep), logprob=upd(st["logprob"], lp_rec),
        eos_pos=eos_pos, done=done, carry=carry, cache=cache,
        nfe=st["nfe"] + (ran & has_cand).astype(jnp.int32),
        forward_passes=st["forward_passes"] + ran.astype(jnp.int32))

  def cond(st):
    # Every iteration commits >= 1 token in each row that still has work, so a block takes at most
    # `bsz` steps; the step bound only guards against a broken invariant.
    return (st["block"] < num_blocks) & ~st["done"].all() & (st["step"] < r + num_blocks)

  st = dict(
      step=jnp.int32(0), block=jnp.int32(0), first=jnp.bool_(True), block_start=jnp.int32(0),
      canvas=jnp.full((b, r), mask_id, jnp.int32), commit_step=jnp.full((b, r), -1, jnp.int32),
      logprob=jnp.zeros((b, r), jnp.float32), eos_pos=jnp.full((b,), r, jnp.int32),
      done=jnp.zeros((b,), bool), carry=carry_logits, cache=cache,
      nfe=jnp.zeros((b,), jnp.int32), forward_passes=jnp.int32(0))
  st = jax.lax.while_loop(cond, body, st)
  return dict(tokens=st["canvas"], commit_step=st["commit_step"], logprob=st["logprob"],
              nfe=st["nfe"], eos_pos=st["eos_pos"], steps=st["step"],
              forward_passes=st["forward_passes"])


@functools.lru_cache(maxsize=32)
def compiled_decoder(model_config: Qwen3Config, block_size: int, max_new_tokens: int,
                     eos_ids: tuple, mask_id: int):
  """One jitted function per static shape/config; tau, temperature, top-k/p, the key and the step
  budget are traced."""
  fn = functools.partial(_decode, model_config, block_size, max_new_tokens // block_size,
                         tuple(eos_ids), mask_id)
  return jax.jit(fn)


def decode_config_for(model_config: Qwen3Config, **kw) -> DecodeConfig:
  """DecodeConfig with the model's EOS / mask / pad ids filled in."""
  kw.setdefault("eos_ids", model_config.eos_ids)
  kw.setdefault("mask_token_id", model_config.mask_token_id)
  kw.setdefault("pad_id", model_config.pad_token_id if model_config.pad_token_id is not None else 0)
  return DecodeConfig(**kw)


def generate(model_config: Qwen3Config, params, prompts: Sequence[Sequence[int]],
             decode_config: DecodeConfig, rng=None, max_prompt_len: int | None = None,
             return_device: bool = False) -> dict:
  """Decodes a batch of prompts (token-id lists). See the module docstring for the semantics.

  Returns numpy arrays: tokens [B,R] (the final canvas, mask id where never committed),
  commit_step [B,R] (-1 = never committed), logprob [B,R], nfe [B], steps, forward_passes, and
  output_ids (per row, truncated after the first EOS, EOS included).
  """
  dc = decode_config
  if dc.block_size > 1 and model_config.attention != "block_causal":
    model_config = model_config.as_block_diffusion(dc.block_size, dc.mask_token_id)
  max_prompt_len = max_prompt_len or max(len(x) for x in prompts)
  tokens, lengths = left_pad(prompts, max_prompt_len, dc.pad_id)
  mask_id = dc.mask_token_id if dc.mask_token_id is not None else dc.pad_id
  fn = compiled_decoder(model_config, dc.block_size, dc.max_new_tokens, tuple(dc.eos_ids), mask_id)
  rng = jax.random.PRNGKey(0) if rng is None else rng
  out = fn(params, jnp.asarray(tokens), jnp.asarray(lengths), jnp.float32(dc.threshold),
           jnp.float32(dc.temperature), jnp.int32(dc.top_k), jnp.float32(dc.top_p), rng,
           jnp.int32(dc.steps_per_block))
  if return_device:
    return out
  out = jax.tree_util.tree_map(np.asarray, out)
  out["output_ids"] = [row[:min(int(e) + 1, len(row))].tolist() for row, e in zip(out["tokens"], out["eos_pos"])]
  return out
