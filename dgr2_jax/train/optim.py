"""Optimiser: AdamW with linear warmup then cosine decay (or constant), global-norm clipping.

Gradient accumulation is not an optimizer wrapper: `loop.make_train_step` scans the micro-batches
inside one step and applies the optimizer once, so one step always means one update (the schedule,
checkpoints and metrics count updates). Master weights are whatever dtype the params are kept in
(`train.param_dtype`, float32 by default); the optimizer state follows the params' dtype.
"""

from __future__ import annotations

import jax
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


def make_optimizer(opt_cfg, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
  schedule = make_schedule(opt_cfg, total_steps)
  parts = []
  if float(opt_cfg.clip_norm) > 0:
    parts.append(optax.clip_by_global_norm(float(opt_cfg.clip_norm)))
  parts.append(optax.adamw(schedule, b1=float(opt_cfg.b1), b2=float(opt_cfg.b2),
                           eps=float(opt_cfg.eps), weight_decay=float(opt_cfg.weight_decay),
                           mask=decay_mask))
  return optax.chain(*parts), schedule
