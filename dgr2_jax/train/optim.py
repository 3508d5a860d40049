"""Optimiser: AdamW with linear warmup then cosine decay (or constant), global-norm clipping, and
optionally a decoupled pull toward the starting weights (`anchor_decay`, see `pull_toward_start`).

Gradient accumulation is not an optimizer wrapper: `loop.make_train_step` scans the micro-batches
inside one step and applies the optimizer once, so one step always means one update (the schedule,
checkpoints and metrics count updates). Master weights are whatever dtype the params are kept in
(`train.param_dtype`, float32 by default); the optimizer state follows the params' dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


def make_schedule(opt_cfg, total_steps: int) -> optax.Schedule:
  peak, warm = float(opt_cfg.peak_lr), int(opt_cfg.warmup_steps)
  if opt_cfg.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak, warmup_steps=warm,
        decay_steps=max(int(total_steps), warm + 1), end_value=peak * float(opt_cfg.end_lr_frac))
  if opt_cfg.schedule == "constant":
    if warm == 0:
      return optax.constant_schedule(peak)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, warm), optax.constant_schedule(peak)], [warm])
  raise ValueError(f"train.optimizer.schedule must be 'cosine' or 'constant', got {opt_cfg.schedule!r}")


def decay_mask(params):
  """Weight decay on matrices (kernels, embeddings) only; norm scales and biases are exempt."""
  return jax.tree_util.tree_map(lambda x: x.ndim >= 2, params)


class PullState(NamedTuple):
  count: jax.Array  # updates applied so far (the schedule's step)
  start: optax.Params  # the weights at `init`: where the pull points


def pull_toward_start(schedule: optax.Schedule, rate: float) -> optax.GradientTransformation:
  """Adds -lr(t) * rate * (params - start) to the updates, `start` being the params at `init`:
  AdamW's decoupled weight decay with the starting weights in place of zero (L2-SP, Li et al. 2018,
  "Explicit inductive bias for transfer learning with convolutional networks"). A fine-tune that
  must keep what its starting checkpoint knows (the conversion to block diffusion: `cft.anchor_decay`)
  drifts at most ~|Adam step| / rate per weight from it. The state holds one copy of the params
  (sharded like them); it is saved and restored with the rest of the optimiser state."""

  def init(params):
    return PullState(count=jnp.zeros([], jnp.int32), start=jax.tree.map(jnp.copy, params))

  def update(updates, state, params=None):
    if params is None:
      raise ValueError("pull_toward_start needs the params in update()")
    step = -schedule(state.count) * rate
    updates = jax.tree.map(lambda u, p, s: u + (step * (p - s)).astype(u.dtype), updates, params, state.start)
    return updates, PullState(count=optax.safe_increment(state.count), start=state.start)

  return optax.GradientTransformation(init, update)


def make_optimizer(opt_cfg, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW (`train.optimizer`); with `anchor_decay` > 0 (a field the CFT stage sets from
  `cft.anchor_decay`; absent means 0) also `pull_toward_start`. Without it the state is AdamW's
  alone, so checkpoints written before the option existed resume."""
  schedule = make_schedule(opt_cfg, total_steps)
  parts = []
  if float(opt_cfg.clip_norm) > 0:
    parts.append(optax.clip_by_global_norm(float(opt_cfg.clip_norm)))
  parts.append(optax.adamw(schedule, b1=float(opt_cfg.b1), b2=float(opt_cfg.b2),
                           eps=float(opt_cfg.eps), weight_decay=float(opt_cfg.weight_decay),
                           mask=decay_mask))
  if float(opt_cfg.get("anchor_decay", 0.0)) > 0:
    parts.append(pull_toward_start(schedule, float(opt_cfg.anchor_decay)))
  return optax.chain(*parts), schedule
