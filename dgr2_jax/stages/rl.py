"""Stage `rl`: trajectory-replay GRPO/DAPO on the rank-promotion reward (`train.grpo`).

Reads the policy (`config.rl.init_from`, else the previous model stage's dir: `workdir/opd/model`
normally) and the train split's prompts; writes `workdir/rl/model`, `workdir/rl/train/`
(checkpoints, metrics.jsonl, tensorboard) and DONE.json. The same trainer serves the AR teacher
(stage `teacher_rl`: B = 1 rollouts and replay on the SFT model).

Per step (`rollouts.on_policy_batches` in `loop.train`): `rl.prompts_per_step` prompts x
`rl.group_size` rollouts are decoded from the CURRENT params (`config.decode`, temperature
`rl.temperature`), parsed and rewarded, group advantages computed (zero-variance groups dropped:
their tokens get loss mask 0), and one optimizer step of `grpo.grpo_loss` is taken on the replayed
log-probs (one update per batch, so the PPO ratio is 1 at the start of every step unless
train.grad_accum_steps splits it; the clip matters once updates reuse rollouts). With `rl.kl_coef` >
0 (or `rl.log_kl_ref`, the default) a frozen copy of the starting params scores the step's rows
inside the loss (`ref_params`). A step in which no group has reward variance (on any process) makes
no update (`rollouts.on_policy_batches`). With `rl.dynamic_sampling` D > 1 (DAPO's dynamic
sampling) a step draws up to D prompt batches from the same prompt iterator, stopping once
`rl.min_informative_groups` groups (0 = prompts_per_step; counted over all processes) have reward
variance, and makes one update on the kept groups of every draw (train batch: D x the rows of a
draw, undrawn draws masked; D x train.grad_accum_steps micro-batches). Metrics: loss, policy_loss,
clip_fraction, ratio_mean, kl_ref (the mean k3 KL to the starting model over the loss tokens:
trained on when kl_coef > 0, logged only otherwise, absent when log_kl_ref is False too), reward
mean/std, valid_rate, overlong_rate, groups_dropped (1 - the informative share), update_skipped,
mean_nfe, rollout/update time; with D > 1 also draws, informative_groups (in the update) and
informative_fraction (of every group drawn), the draws' metrics averaged.
`grpo_stage` declares both this stage and `teacher_rl` (the AR teacher's RL); `train_grpo` trains.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dgr2_jax.stages import common
from dgr2_jax.stages import contract
from dgr2_jax.stages import on_policy
from dgr2_jax.train import grpo, loop, rollouts
from dgr2_jax.train import opd as opd_lib
from dgr2_jax.train.config import section, without


def _settings(config, workdir: str, stage: str, overrides: dict | None):
  """-> (config with the rollouts' decode overrides, section `stage`, the starting policy's dir)."""
  rc = section(config, stage, grpo.rl_config)
  src = on_policy.source_dir(config, workdir, stage, rc)
  if int(rc.group_size) < 2:
    raise ValueError(f"config.{stage}.group_size must be >= 2 (group-normalised advantages), got {rc.group_size}")
  return with_decode(config, overrides), rc, src


def with_decode(config, overrides: dict | None):
  """`config` with the rollouts' `decode` overrides (`grpo_stage`'s; None: as it is)."""
  if overrides:
    config = config.copy_and_resolve_references()
    with config.unlocked():
      for k, v in overrides.items():
        config.decode[k] = v
  return config


def _hash(config, workdir: str, upstream: dict, stage: str, overrides: dict | None) -> str:
  config, rc, src = _settings(config, workdir, stage, overrides)
  # Fields at the values that train as before they existed stay out of the hash (built stages stay fresh).
  unset = ["dynamic_sampling", "min_informative_groups"] if grpo.sampling_settings(rc)[0] == 1 else []
  unset += ["informative"] if str(rc.get("informative", "any")) == "any" else []
  unset += ["log_kl_ref"]  # metrics only: the trained model does not depend on it
  return common.config_hash(config.seed, without(rc, unset), config.decode, config.task, config.train.mesh,
                            config.train.optimizer, src, common.model_hash(src), upstream["traces"],
                            workdir=workdir)


def _build(config, workdir: str, build: contract.Build, stage: str, overrides: dict | None) -> str:
  config, rc, src = _settings(config, workdir, stage, overrides)
  return train_grpo(config, workdir, build, rc, src)


def grpo_stage(name: str, decode_overrides: dict | None = None) -> contract.Stage:
  """The declaration of a GRPO stage `name` (settings `config.<name>`, a `grpo.rl_config` section):
  it reads the traces and (a chain stage) its starting policy. `decode_overrides` replace
  `config.decode` fields for the rollouts (the AR teacher's RL: block_size 1, threshold 1)."""
  kw = dict(stage=name, overrides=decode_overrides)
  return contract.Stage(name=name, reads=("traces",), chain=True, hashed=functools.partial(_hash, **kw),
                        build=functools.partial(_build, **kw))


STAGE = grpo_stage("rl")


def run(config, workdir: str) -> str:
  """Trains (or reuses) `workdir/rl`; returns its path."""
  return contract.run(STAGE, config, workdir)


def train_grpo(config, workdir: str, build: contract.Build, rc, src: str) -> str:
  """Trajectory-replay GRPO/DAPO of the policy in `src` with the settings `rc` (a `grpo.rl_config`
  section) -> `workdir/<stage>/` (`build`'s); `config.decode` drives the rollouts."""
  stage = build.stage
  train_dir = build.train_dir()
  task = on_policy.task_setup(config, workdir, pool=str(rc.get("prompt_pool", "all")))
  mc, params = on_policy.load_policy(config, src)
  dc = on_policy.rollout_decode_config(config, task["tids"], mc, rc.temperature)
  bs, mask_id, g = dc.block_size, dc.mask_token_id, int(rc.group_size)
  policy_cfg = mc.as_block_diffusion(bs, mask_id)
  per_call = int(rc.get("rollout_batch_size", 0))
  informative = str(rc.get("informative", "any"))
  # The starting model, for kl_ref (trained on at kl_coef > 0, else logged): a frozen copy that
  # every step's loss scores its rows under (`grpo.grpo_loss`'s ref_params; the loop skips the
  # micro-batches without a loss token). A copy, not the same buffers: the train state is donated.
  ref_params = None
  if keeps_ref(rc):
    ref_params = opd_lib.frozen_teacher(policy_cfg, jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), params))

  def make_batch(p, prompts, key):
    roll = rollouts.sample(policy_cfg, p, prompts["prompt_ids"], prompts["prompt_len"], dc, key, g,
                           rows_per_call=per_call)
    seg = rollouts.replay_inputs(roll, bs, mask_id, max_segments_per_block=int(rc.replay_max_segments))
    scored = on_policy.score_rollouts(roll, prompts, g, task, float(rc.alpha))
    adv, keep = grpo.group_advantages(scored["rewards"], g,
                                      valid=scored["valid"] if informative == "valid" else None)
    batch = dict(prompt=roll["prompt_ids"], prompt_len=roll["prompt_len"], old_logp=roll["logprob"],
                 advantages=adv, loss_mask=roll["loss_mask"] & keep[:, None],
                 **{n: seg[n] for n in rollouts.SEGMENT_KEYS})
    m = on_policy.rollout_metrics(roll, scored, seg)
    m["groups_dropped"] = float(1.0 - keep.reshape(-1, g)[:, 0].mean())
    return batch, m

  pps, steps = int(rc.prompts_per_step), int(rc.steps)
  draws, target = grpo.sampling_settings(rc)
  tconf = step_config(config, rc)
  loss_fn = loss_for(rc, policy_cfg, dc)
  prompt_iter = on_policy.prompt_iterator(task["prompts"], pps, int(config.seed))
  sampling = rollouts.DynamicSampling(draws, target, g, int(rc.grad_accum_steps))
  state = loop.train(tconf, train_dir, params=params, loss_fn=loss_fn, desc=stage, frozen=ref_params,
                     step_batches=rollouts.on_policy_batches(make_batch, prompt_iter, int(config.seed), sampling),
                     validation=loop.Validation(on_policy.validator(config, workdir, rc, policy_cfg, dc),
                                                int(rc.get("valid_every", 0)), bool(rc.get("keep_best", False))))
  extra = {"steps": steps, "source": src, "examples": task["counts"], "best_step": state["best_step"]}
  return on_policy.publish(build, on_policy.Trained(state, mc, rc, extra), task, train_dir)


def keeps_ref(rc) -> bool:
  """Whether a GRPO stage (section `rc`) holds a frozen copy of its starting model: for the KL to it,
  trained on (kl_coef > 0) or logged (log_kl_ref)."""
  return float(rc.kl_coef) > 0 or bool(rc.get("log_kl_ref", True))


def loss_for(rc, policy_cfg, dc):
  """The GRPO step's loss (`grpo.grpo_loss`) of `policy_cfg` under section `rc`, replaying the
  rollouts' decoding distribution (DecodeConfig `dc`)."""
  dist = dict(temperature=dc.temperature, top_k=dc.top_k, top_p=dc.top_p, mask_id=dc.mask_token_id)
  return functools.partial(grpo.grpo_loss, policy_cfg, block_size=dc.block_size, objective=grpo.Objective(
      clip_low=float(rc.clip_eps), clip_high=float(rc.clip_eps_high), kl_coef=float(rc.kl_coef)), **dist)


def step_config(config, rc):
  """The train section of a GRPO stage's step: the rows of every draw it may make (dynamic
  sampling: the batch of each draw, in as many more micro-batches), constant lr `rc.lr`."""
  draws, _ = grpo.sampling_settings(rc)
  return on_policy.on_policy_config(config, rows=draws * int(rc.prompts_per_step) * int(rc.group_size),
                                    steps=int(rc.steps), lr=rc.lr, grad_accum=draws * int(rc.grad_accum_steps))
