"""Conversion fine-tuning (CFT): the masked block-diffusion objective, as a pure loss function.

Per (row, block) a mask rate t ~ U(eps, 1) is drawn and each response token of the block is masked
with probability t (at least one per block that holds real tokens). Every block trains in one pass
with the two-stream layout of `model/streams.py` ([prompt | clean | one noisy copy per block]), so
the logits at a masked position are exactly what the decoder computes for that canvas through its
KV cache (tested). Positions after the response's EOS (padding) are always masked in the canvas and
never trained on: the decoder leaves them masked too.

Loss, with w = span weight (reasoning / answer) on real response tokens:
  weighting "1/t" (default, the masked-diffusion ELBO):  sum_masked w * CE / t  /  sum_all w
  weighting "none":                                      sum_masked w * CE      /  sum_masked w
With B = 1 and t = 1 both equal the AR SFT loss (tested).
`choice_weight` (with `choice_after_id`, the token id of ' #'): multiplies the weight of the
reasoning's candidate numbers, the token after each ' #' in `<think>`..`</think>` (`... next #4.
So #4 goes first`), on top of `reasoning_weight`. Why: the number that picks the first candidate
is decided from the prompt only when every copy of it in the block is masked; at low t another copy is
visible and the loss is a copy. Up-weighting it trains the decision itself more (1.0 = no change).
`complementary=True` also trains the complementary mask of every row (each token trained once per
pair), doubling the batch.
The `cft` config section is this module's: its defaults (`cft_config`) and its checks (`validate`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from dgr2_jax.model import streams
from dgr2_jax.train import losses

WEIGHTINGS = ("1/t", "none")


def corrupt(rng, response, response_mask, block_size: int, mask_id: int, eps: float,
            fixed_t: float | None = None):
  """-> (noisy [b,R], masked [b,R] bool, t [b,R] per-token mask rate of its block)."""
  b, r = response.shape
  nb = r // block_size
  k_t, k_m, k_f = jax.random.split(rng, 3)
  t_blk = jax.random.uniform(k_t, (b, nb), minval=eps, maxval=1.0) if fixed_t is None else \
      jnp.full((b, nb), fixed_t, jnp.float32)
  t = jnp.repeat(t_blk, block_size, axis=1)                              # [b,R]
  real = response_mask.astype(bool)
  masked = (jax.random.uniform(k_m, (b, r)) < t) & real
  # At least one masked token in every block holding real tokens (else the block gives no signal).
  u = jnp.where(real, jax.random.uniform(k_f, (b, r)), -1.0).reshape(b, nb, block_size)
  forced = (u == u.max(-1, keepdims=True)) & (u >= 0)
  none = ~masked.reshape(b, nb, block_size).any(-1, keepdims=True)
  masked = masked | (forced & none).reshape(b, r)
  noisy = jnp.where(masked | ~real, mask_id, response)
  return noisy, masked, t


def choice_mask(batch, choice_after_id: int):
  """[b,R] bool: reasoning tokens right after a `choice_after_id` token (the candidate numbers)."""
  return losses.choice_positions(batch["response_ids"], choice_after_id) & batch["reasoning_mask"].astype(bool)


def span_weights(batch, reasoning_weight: float, answer_weight: float, choice_weight: float = 1.0,
                 choice_after_id: int = -1):
  w = (batch["reasoning_mask"] * reasoning_weight + batch["answer_mask"] * answer_weight
       ).astype(jnp.float32)
  if choice_after_id >= 0 and choice_weight != 1.0:
    w = jnp.where(choice_mask(batch, choice_after_id), w * choice_weight, w)
  return w * batch["response_mask"]


@dataclasses.dataclass(frozen=True)
class LossOptions:
  """`cft_loss`'s static options (see the module docstring): `eps` the lowest mask rate,
  `weighting` one of WEIGHTINGS, the span weights, `complementary` masks, and `fixed_t` (a mask
  rate used for every block instead of drawing one; tests)."""
  eps: float = 1e-3
  weighting: str = "1/t"
  reasoning_weight: float = 1.0
  answer_weight: float = 1.0
  choice_weight: float = 1.0
  choice_after_id: int = -1
  complementary: bool = False
  fixed_t: float | None = None


def cft_loss(model_config, params, batch, rng, *, block_size: int, mask_id: int,
             options: LossOptions = LossOptions()):
  """-> (loss, metrics). `batch` is the task pipeline's dict (left-padded prompt, response spans)."""
  o = options
  weighting, eps, complementary = o.weighting, o.eps, o.complementary
  if weighting not in WEIGHTINGS:
    raise ValueError(f"cft.loss_weighting must be one of {WEIGHTINGS}, got {weighting!r}")
  resp = batch["response_ids"].astype(jnp.int32)
  b, r = resp.shape
  if r % block_size:
    raise ValueError(f"task.response_len ({r}) must be a multiple of the block size ({block_size})")
  noisy, masked, t = corrupt(rng, resp, batch["response_mask"], block_size, mask_id, eps, o.fixed_t)
  prompt, plen, rmask = batch["prompt_ids"], batch["prompt_len"], batch["response_mask"]
  w = span_weights(batch, o.reasoning_weight, o.answer_weight, o.choice_weight, o.choice_after_id)
  if complementary:
    real = rmask.astype(bool)
    noisy = jnp.concatenate([noisy, jnp.where(~masked & real, mask_id, resp)], 0)
    masked = jnp.concatenate([masked, ~masked & real], 0)
    t = jnp.concatenate([t, 1.0 - t + eps], 0)
    resp, prompt, plen, w = (jnp.concatenate([x, x], 0) for x in (resp, prompt, plen, w))
  nb = r // block_size
  seg_block = np.arange(nb)
  pred_seg = jnp.broadcast_to(jnp.arange(r) // block_size, resp.shape)
  hidden = streams.response_hidden(model_config, params, prompt, plen, resp,
                                   noisy.reshape(-1, nb, block_size), seg_block, pred_seg, block_size)
  ce, hit = losses.token_nll(model_config, params, hidden, resp)          # [b,R], in vocabulary chunks
  mw = w * masked
  # `denominator` lets gradient accumulation combine micro-batches exactly (train/loop.py).
  denom = jnp.sum(w) if weighting == "1/t" else jnp.sum(mw)
  num = jnp.sum(mw * ce / t) if weighting == "1/t" else jnp.sum(mw * ce)
  loss = num / jnp.maximum(denom, 1e-8)
  acc = jnp.sum(masked * hit) / jnp.maximum(jnp.sum(masked), 1)
  metrics = {"loss": loss, "masked_ce": jnp.sum(mw * ce) / jnp.maximum(jnp.sum(mw), 1e-8),
             "mask_rate": jnp.sum(masked) / jnp.maximum(jnp.sum(rmask), 1) / (2 if complementary else 1),
             "masked_acc": acc, "denominator": denom}
  return loss, metrics


def _model_dirs(config, runs: set, section: str) -> None:
  """The section's explicit model directories exist (checked only when its stage runs)."""
  from dgr2_jax import checks
  for f in ("init_from", "teacher_dir"):
    if config[section].get(f) and section in runs:
      checks.model_dir(f"{section}.{f}", config[section][f])


def cft_config() -> ml_collections.ConfigDict:
  """Conversion fine-tuning (dgr2_jax.stages.cft, loss in dgr2_jax.train.cft)."""
  c = ml_collections.ConfigDict()
  c.init_from = ""          # '' => the previous model stage's dir (workdir/convert/model)
  c.epochs = 3  # passes over the training traces
  c.steps = 0               # > 0 overrides epochs
  c.lr = 0.0                # 0 => train.optimizer.peak_lr
  c.batch_size = 0          # 0 => train.batch_size
  c.block_size = 32  # block of the block-diffusion attention the model is trained for
  c.loss_weighting = "1/t"  # '1/t' (masked-diffusion ELBO) | 'none'
  c.eps = 1e-3              # t ~ U(eps, 1)
  c.complementary_mask = False  # also train on each mask's complement (two views per example)
  c.reasoning_weight = 1.0  # loss weight of the reasoning tokens
  c.answer_weight = 1.0  # loss weight of the answer tokens
  # Multiplies reasoning_weight on the reasoning's candidate numbers (the token after each ' #':
  # `next #4. So #4`): the first pick is decided there (dgr2_jax/train/cft.py). 1.0 = no change.
  c.choice_weight = 1.0
  return c


def validate(config, runs: set) -> None:
  """Checks the `cft` config section (and that task.response_len is whole blocks)."""
  from dgr2_jax import checks
  c = config
  if "cft" not in c:
    return
  checks.positive_int(c, "cft", "block_size")
  checks.one_of(c, "cft", "loss_weighting", WEIGHTINGS)
  if float(c.cft.get("choice_weight", cft_config().choice_weight)) < 0:
    checks.fail("cft.choice_weight", f"must be >= 0, got {c.cft.choice_weight}")
  if not 0.0 < float(c.cft.eps) < 1.0:
    checks.fail("cft.eps", f"must be in (0, 1), got {c.cft.eps}")
  if "task" in c and c.task.response_len % c.cft.block_size:
    checks.fail("task.response_len", f"({c.task.response_len}) must be a multiple of cft.block_size "
                f"({c.cft.block_size})")
  _model_dirs(c, runs, "cft")
