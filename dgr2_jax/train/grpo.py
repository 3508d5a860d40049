"""Trajectory-replay GRPO/DAPO: the RL trainer for the AR teacher (B = 1) and the diffusion model.

Reward (GR2's rank promotion, `rewards`): with r_D = the target's 1-based rank in the retriever
list D and r_o its rank in the output ranking,
    R = (r_D - r_o) / N + alpha * R_fmt,  R_fmt = 1 if r_o < r_D or r_D = r_o = 1 else 0.
An invalid output (parser verdict != valid) or an overlong one (no EOS within max_new_tokens,
passed as `None`) gets R = -1 and stays in its group.

Advantages (`group_advantages`): rewards come in consecutive groups of G rollouts of one prompt;
A = (R - mean) / std within the group (population std, ddof 0). A group whose rewards have
std <= 1e-6 has no defined advantage and is dropped (keep_mask 0, A = 0). With `informative`
'valid' a group is also dropped when its variance comes only from invalid rollouts (the valid
rollouts' rewards all equal, or fewer than two valid): such a group teaches the format by pushing
up whatever answer the model already gives, and on a peaked policy most groups with any variance
are of that kind. DAPO's dynamic sampling (`dynamic_sampling` > 1, `min_informative_groups`;
train/rollouts.py) draws more prompt batches in a step until enough groups have reward variance,
and trains on the kept groups of every draw.

Objective (`ppo_terms`, DAPO token-level): with rho = exp(logp - old_logp) per committed token,
    J = sum_tokens min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) / (number of tokens in the batch)
where the tokens are the committed ones at or before the first EOS of rollouts in kept groups
(`loss_mask`); loss = -J + kl_coef * mean_tokens k3, with the k3 estimator of KL(pi || pi_ref):
k3 = exp(ref - logp) - (ref - logp) - 1. `logp` are the current params' REPLAYED log-probs under
the decoding distribution of the rollout (same temperature/top-k/top-p), `old_logp` the ones the
decoder recorded, so rho = 1 exactly before the first update (tests/test_cft_replay.py).
The token count is metrics["denominator"] (gradient accumulation = the big batch).
The `rl` and `teacher_rl` config sections are this module's: their defaults (`rl_config`,
`teacher_rl_config`) and their checks (`validate`, `validate_teacher_rl`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from dgr2_jax.task import metrics as metrics_lib
from dgr2_jax.train import replay


PROMPT_POOLS = ("all", "natural")
INFORMATIVE = ("any", "valid")


def rl_config() -> ml_collections.ConfigDict:
  """Trajectory-level GRPO against the re-ranking reward (defaults: the paper's Appendix B/C)."""
  c = ml_collections.ConfigDict()
  c.init_from = ""             # '' => the previous model stage's dir (workdir/opd/model normally)
  c.group_size = 8             # G
  c.lr = 5e-7                  # constant
  c.steps = 600  # optimiser steps
  c.prompts_per_step = 16      # groups per step (batch rows = prompts_per_step * group_size)
  c.alpha = 0.2                # weight of the conditional format reward
  c.clip_eps = 0.2             # eps_low
  c.clip_eps_high = 0.2        # eps_high (DAPO clip-higher when > clip_eps)
  c.kl_coef = 0.0              # > 0: k3 KL to the starting (reference) model
  # Log kl_ref (the k3 KL to the starting model over the loss tokens) every step even at kl_coef 0:
  # keeps a frozen copy of the starting params and scores the step's informative rows under it
  # (one forward of those rows, no gradient). Metrics only: the update is unchanged.
  c.log_kl_ref = True
  c.temperature = 1.0          # rollout sampling temperature
  # Which train users' prompts: 'all' (whose target is listed, task.insert_target's inserted ones
  # included) | 'natural' (only lists where the retriever found the target itself, as on validation
  # and test; an inserted target is one the prompt's evidence rarely points to).
  c.prompt_pool = "all"
  c.grad_accum_steps = 1  # micro-batches per optimiser step
  # DAPO dynamic sampling: up to this many prompt batches per step, until min_informative_groups
  # groups (all processes) have reward variance; 1 = one batch per step. The update's batch has the
  # shape of all draws (undrawn ones masked), as many more micro-batches as draws (same memory;
  # the micro-batches of draws not made are skipped).
  c.dynamic_sampling = 1
  c.min_informative_groups = 0  # groups with reward variance that end a step's drawing (0 = prompts_per_step)
  # Which groups train: 'any' reward variance, or 'valid': variance among the valid rollouts'
  # rewards (a group whose only variance is an invalid rollout's -1 is dropped; its invalid
  # rollouts still get their negative advantage in the groups that train). Dynamic sampling counts
  # the groups this keeps.
  c.informative = "any"
  c.replay_max_segments = 8    # replay canvases per block: as opd.opd_config() explains
  c.rollout_batch_size = 0     # rows decoded per call (0 = all at once): as opd.opd_config() explains
  # Validation curve: greedy Recall@1 on the first `valid_prompts` validation users before the
  # first step and every `valid_every` steps (0 = none), in the stage's valid_curve.json.
  c.valid_every = 0
  c.valid_prompts = 512        # validation users decoded per point of the curve
  # Validation users decoded per call, over all processes (0 = all at once). A call's users are
  # split over the data x fsdp devices, so a value > 0 must be a multiple of their count, as
  # valid_prompts is at 0. On 2 CPU cores calls of 64 decoded 1,536 users 2.5x (AR) and 1.3x
  # (block diffusion) as fast as one call of all (configs/demo.py sets 64).
  c.valid_batch_size = 0
  c.keep_best = False          # the best point beating the start by >= 2 paired SEs (loop.keep_bar), else the start
  return c


def teacher_rl_config() -> ml_collections.ConfigDict:
  """The AR teacher's RL (stage teacher_rl: GRPO/DAPO with B = 1 on the SFT model, the paper's GR2)."""
  c = rl_config()
  c.lr = 1e-6  # constant
  c.steps = 200  # optimiser steps
  return c


def reward(parsed, target_rank_in_d: int, n: int, alpha: float) -> float:
  """One rollout's reward; `parsed` is an `answer.Parsed`, or None for an overlong rollout."""
  if target_rank_in_d < 1:
    raise ValueError(f"target_rank_in_D must be a 1-based rank (target among the candidates), got "
                     f"{target_rank_in_d}")
  if parsed is None or not parsed.valid:
    return -1.0
  r_o = metrics_lib.target_rank(parsed.positions, target_rank_in_d - 1)
  r_rank = (target_rank_in_d - r_o) / n
  fmt = 1.0 if (r_o < target_rank_in_d or (target_rank_in_d == 1 and r_o == 1)) else 0.0
  return float(r_rank + alpha * fmt)


def rewards(parsed: Sequence, target_rank_in_d: Sequence[int], n: int, alpha: float) -> np.ndarray:
  """Vectorised `reward` -> float32 [len(parsed)]."""
  return np.asarray([reward(p, int(t), n, alpha) for p, t in zip(parsed, target_rank_in_d)], np.float32)


def group_advantages(rewards_: np.ndarray, group_size: int, eps: float = 1e-6, valid=None):
  """-> (advantages [n*G] f32, keep_mask [n*G] bool); see the module docstring. `valid` [n*G]
  bool (the parser's verdicts): keep only groups whose valid rollouts' rewards vary."""
  r = np.asarray(rewards_, np.float64)
  if r.size % group_size:
    raise ValueError(f"{r.size} rewards are not a whole number of groups of {group_size}")
  g = r.reshape(-1, group_size)
  mean, std = g.mean(1, keepdims=True), g.std(1, keepdims=True)
  ok = std > eps
  if valid is not None:
    v = np.asarray(valid, bool).reshape(g.shape)
    # The valid rewards' range: 0 with one valid rollout, -inf with none.
    ok &= np.where(v, g, -np.inf).max(1, keepdims=True) - np.where(v, g, np.inf).min(1, keepdims=True) > eps
  keep = np.broadcast_to(ok, g.shape)
  adv = np.where(keep, (g - mean) / np.where(keep, std, 1.0), 0.0)
  return adv.reshape(-1).astype(np.float32), keep.reshape(-1)


def ppo_terms(logp, old_logp, adv, mask, *, clip_low: float = 0.2, clip_high: float = 0.2,
              kl_coef: float = 0.0, ref_logp=None) -> tuple[jax.Array, dict]:
  """The clipped token-level objective from given log-probs [b,R], advantages [b], mask [b,R]."""
  m = mask.astype(jnp.float32)
  denom = jnp.sum(m)
  # Uncommitted positions score the mask token (log-prob ~ -1e30): zero them so no inf/NaN leaks.
  on = mask.astype(bool)
  logp, old_logp = jnp.where(on, logp, 0.0), jnp.where(on, old_logp, 0.0)
  ref_logp = None if ref_logp is None else jnp.where(on, ref_logp, 0.0)
  norm = lambda x: jnp.sum(m * x) / jnp.maximum(denom, 1.0)
  a = adv.astype(jnp.float32)[:, None]
  ratio = jnp.exp(logp - old_logp)
  clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
  surr = jnp.minimum(ratio * a, clipped * a)
  loss = -norm(surr)
  # Tokens whose gradient the clip removes (the min picks the clipped term and it is constant).
  clip_active = ((a > 0) & (ratio > 1.0 + clip_high)) | ((a < 0) & (ratio < 1.0 - clip_low))
  metrics = {"policy_loss": loss, "clip_fraction": norm(clip_active.astype(jnp.float32)),
             "ratio_mean": norm(ratio), "tokens": denom, "denominator": denom}
  if ref_logp is not None:
    d = ref_logp - logp
    kl = norm(jnp.exp(d) - d - 1.0)
    if kl_coef > 0:
      loss = loss + kl_coef * kl
    else:  # logged only: no term in the loss, so no gradient path through it
      kl = jax.lax.stop_gradient(kl)
    metrics["kl_ref"] = kl
  return loss, metrics


@dataclasses.dataclass(frozen=True)
class Objective:
  """`grpo_loss`'s objective options (`ppo_terms`): the clip range [1 - clip_low, 1 + clip_high]
  of the ratio and the weight of the k3 KL to the reference policy (0 = none)."""
  clip_low: float = 0.2
  clip_high: float = 0.2
  kl_coef: float = 0.0


def grpo_loss(model_config, params, batch: dict, rng=None, ref_params=None, *, block_size: int,
              objective: Objective = Objective(), **sampling) -> tuple[jax.Array, dict]:
  """-> (loss, metrics). batch: prompt [b,P], prompt_len [b], clean/seg_tokens/pred_seg (replay),
  old_logp [b,R], advantages [b], loss_mask [b,R] (already 0 on dropped groups). `ref_params`:
  the reference (starting) policy, scored here under the same replay with no gradient; needed when
  objective.kl_coef > 0, and with kl_coef 0 it makes kl_ref a logged metric only. `sampling`: the
  rollouts' decoding distribution, `replay.replay_logprobs`'s temperature / top_k / top_p /
  mask_id (defaults here: temperature 1, the model's mask token)."""
  del rng
  kl_coef = objective.kl_coef
  replayed = {k: batch[k] for k in ("clean", "seg_tokens", "pred_seg")}
  dist = {"temperature": 1.0, **sampling}
  dist["mask_id"] = model_config.mask_token_id if dist.get("mask_id") is None else dist["mask_id"]
  logp = replay.replay_logprobs(model_config, params, batch["prompt"], batch["prompt_len"], replayed, block_size,
                                **dist)
  if kl_coef > 0 and ref_params is None:
    raise ValueError("rl.kl_coef > 0 needs the reference policy (ref_params)")
  ref = None if ref_params is None else jax.lax.stop_gradient(replay.replay_logprobs(
      model_config, ref_params, batch["prompt"], batch["prompt_len"], replayed, block_size, **dist))
  return ppo_terms(logp, batch["old_logp"], batch["advantages"], batch["loss_mask"], clip_low=objective.clip_low,
                   clip_high=objective.clip_high, kl_coef=kl_coef, ref_logp=ref)


def validate(config, runs: set, section: str = "rl") -> None:
  """Checks an RL config section: `rl` (the diffusion model's GRPO) or `teacher_rl` (the AR teacher's)."""
  from dgr2_jax import checks
  from dgr2_jax.train import cft
  c = config
  if section not in c:
    return
  cft._model_dirs(c, runs, section)  # pylint: disable=protected-access
  checks.positive_int(c, section, "group_size", 2)
  checks.positive_int(c, section, "steps")
  checks.positive_int(c, section, "prompts_per_step")
  if float(c[section].lr) <= 0:
    checks.fail(f"{section}.lr", f"must be > 0, got {c[section].lr}")
  if not 0.0 <= float(c[section].alpha) <= 1.0:
    checks.fail(f"{section}.alpha", f"must be in [0, 1], got {c[section].alpha}")
  for f in ("clip_eps", "clip_eps_high"):
    if not 0.0 < float(c[section][f]) < 1.0:
      checks.fail(f"{section}.{f}", f"must be in (0, 1), got {c[section][f]}")
  checks.one_of(c, section, "prompt_pool", PROMPT_POOLS)
  checks.one_of(c, section, "informative", INFORMATIVE)
  _validate_sampling(c, section)
  if not checks.is_int(c[section].get("rollout_batch_size", 0), 0):
    checks.fail(f"{section}.rollout_batch_size", f"must be an int >= 0 (0 = all rollouts at once), got "
                f"{c[section].rollout_batch_size!r}")
  if not checks.is_int(c[section].get("valid_batch_size", 0), 0):
    checks.fail(f"{section}.valid_batch_size", f"must be an int >= 0 (0 = all at once), got "
                f"{c[section].valid_batch_size!r}")


def _validate_sampling(c, section: str) -> None:
  """dynamic_sampling an int >= 1; min_informative_groups an int in [0, dynamic_sampling x
  prompts_per_step] (more could never be reached)."""
  from dgr2_jax import checks
  sc = c[section]
  draws = sc.get("dynamic_sampling", 1)
  if not checks.is_int(draws, 1):
    checks.fail(f"{section}.dynamic_sampling", f"must be an int >= 1 (1 = one prompt batch per step), got {draws!r}")
  target, most = sc.get("min_informative_groups", 0), int(draws) * int(sc.prompts_per_step)
  if not checks.is_int(target, 0) or target > most:
    checks.fail(f"{section}.min_informative_groups", f"must be an int in [0, dynamic_sampling x prompts_per_step = "
                f"{most}] (0 = prompts_per_step), got {target!r}")


def sampling_settings(sc) -> tuple[int, int]:
  """(max draws per step, informative groups that end a step's drawing) of an RL section."""
  draws = int(sc.get("dynamic_sampling", 1))
  return draws, int(sc.get("min_informative_groups", 0)) or int(sc.prompts_per_step)


def validate_teacher_rl(config, runs: set) -> None:
  """Checks the `teacher_rl` config section (an RL section: `validate`)."""
  validate(config, runs, "teacher_rl")
