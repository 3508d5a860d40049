"""Stage `opd`: on-policy distillation of the diffusion student from the frozen AR teacher.

Reads the student (`config.opd.init_from`, else the previous model stage's dir: `workdir/cft/model`
normally, see `common.previous_model_dir`), the teacher (`config.opd.teacher_dir`, else the AR
teacher, `workdir/teacher_rl/model` or `workdir/sft/model`; not read for teacher 'self_tau1') and
the train split's prompts (`workdir/traces/train.jsonl` via `traces.load_split_arrays`). Writes `workdir/opd/model`
(`save_model_dir`, with the tokenizer), `workdir/opd/train/` (checkpoints, metrics.jsonl,
tensorboard) and DONE.json.

Training runs through `rollouts.train_on_policy` (`loop.train` with on-policy batches): per step,
`opd.prompts_per_step` prompts x `opd.rollouts_per_prompt` rollouts are decoded from the CURRENT
params with `config.decode` (temperature `opd.temperature`), the teacher scores them once (its
cache goes into the batch), and one optimizer step of `train.opd.opd_loss` follows. The student
is scored on the canvases `opd.student_context` names (train/opd.py: 'replay', the decode-time
canvas, or 'prefix', P and o_<t). The train config is `config.train` with batch_size = rows,
total_steps = `opd.steps` (0: `opd.epochs` passes over the prompts), a constant lr `opd.lr`
without warmup. Resumes like the SFT stage. With `opd.valid_every` > 0 a greedy validation curve
(`on_policy.validator`, as the RL stages') is written to `workdir/opd/valid_curve.json`, and `opd.keep_best`
keeps the best point's model among those that beat step 0 (the student before distillation) by 2
paired standard errors, else step 0's (`loop.Validation`), instead of the last.
Metrics per step: loss (= KL to the teacher), top1_agreement, reward mean/std, valid_rate,
overlong_rate, mean_nfe, mean_response_tokens, replay_exact, rollout_time_s, update_time_s.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dgr2_jax import chain
from dgr2_jax import multihost
from dgr2_jax.stages import common
from dgr2_jax.stages import contract
from dgr2_jax.stages import on_policy
from dgr2_jax.task import prompts as prompts_lib
from dgr2_jax.stages.on_policy import load_policy, rollout_decode_config, rollout_metrics, score_rollouts
from dgr2_jax.train import grpo, loop, opd, rollouts
from dgr2_jax.train.config import section, without


def teacher_model_dir(config, oc, workdir: str) -> str:
  """`opd.teacher_dir`, else the workdir's AR teacher (`chain.teacher_model_dir`: teacher_rl's
  model when that stage runs, else sft's); '' for the 'self_tau1' teacher."""
  return "" if oc.teacher == "self_tau1" else (oc.teacher_dir or chain.teacher_model_dir(config, workdir))


@dataclasses.dataclass(frozen=True)
class Distillation:
  """On-policy distillation of one student, shared by the stage and `benchmarks/recipe_figures.py`.

  `sample(params, prompts, key) -> (rollouts, scored)` decodes `oc.rollouts_per_prompt` rollouts
  per prompt and scores their rewards (`score_rollouts`); `batch(rollouts, student_context=None)
  -> (batch, segments)` builds the student's canvases for `oc.student_context` (or the one given)
  and caches the teacher's distributions on them; `make_batch(params, prompts, key) -> (batch,
  metrics)` is the two in a row (what `rollouts.train_on_policy` calls).
  `loss_fn(params, batch, rng[, frozen]) -> (KL, metrics)` is `train.opd.opd_loss` (with
  opd.teacher_cache='none' the teacher's params `frozen` come as its 4th argument);
  `token_kl_fn(params, batch)` is `train.opd.token_kl` (per position, jitted).
  """
  model_config: Any
  params: Any
  sample: Callable
  batch: Callable
  loss_fn: Callable
  token_kl_fn: Callable
  frozen: Any = None  # the teacher's params when opd.teacher_cache='none' (loss_fn's 4th argument)
  student_config: Any = None  # the block-diffusion config the rollouts decode with
  decode_config: Any = None   # the rollouts' decode config (temperature oc.temperature)

  def make_batch(self, params, prompts, key):
    roll, scored = self.sample(params, prompts, key)
    batch, seg = self.batch(roll)
    return batch, rollout_metrics(roll, scored, seg)


def distillation(config, oc, task: dict, src: str, teacher_dir: str) -> Distillation:
  """The `Distillation` of the student in `src` against `oc.teacher`."""
  mc, params = load_policy(config, src)
  dc = rollout_decode_config(config, task["tids"], mc, oc.temperature)
  bs, mask_id, g = dc.block_size, dc.mask_token_id, int(oc.rollouts_per_prompt)
  student_cfg = mc.as_block_diffusion(bs, mask_id)
  mode, k = str(oc.teacher_cache), int(oc.teacher_top_k)
  if mode not in opd.TEACHER_CACHES:
    raise ValueError(f"config.opd.teacher_cache must be one of {opd.TEACHER_CACHES}, got {mode!r}")
  if mode == "topk" and not 0 < k <= mc.vocab_size:
    raise ValueError(f"config.opd.teacher_top_k must be in [1, vocab_size={mc.vocab_size}], got {k}")
  if mode == "none" and oc.teacher != "ar":
    raise ValueError("config.opd.teacher_cache='none' scores the AR teacher in the step; "
                     f"teacher {oc.teacher!r} needs a cache ('full' or 'topk')")
  top_k = k if mode == "topk" else 0
  alpha = float(section(config, "rl", grpo.rl_config).alpha)  # the reward's format weight, as RL's

  tcfg = None
  if oc.teacher == "ar":
    tcfg, tparams = load_policy(config, teacher_dir)
    if tcfg.vocab_size != mc.vocab_size:
      raise ValueError(f"teacher {teacher_dir} has vocab {tcfg.vocab_size}, student {src} has {mc.vocab_size}")
    tcfg = tcfg.as_block_diffusion(1)
    score = jax.jit(functools.partial(opd.ar_teacher_cache, tcfg, top_k=top_k, mask_id=mask_id))
  else:  # frozen copy of the starting student, replayed on the serialised (tau=1) trajectory
    tparams = jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), params)
    score = jax.jit(functools.partial(opd.replay_teacher_cache, student_cfg, block_size=bs, top_k=top_k,
                                      mask_id=mask_id))
  # Host arrays to the device; jax arrays stay (several processes: already in their shardings).
  tparams = jax.tree_util.tree_map(lambda x: x if isinstance(x, jax.Array) else jax.device_put(x), tparams)

  if oc.student_context not in opd.STUDENT_CONTEXTS:
    raise ValueError(f"config.opd.student_context must be one of {opd.STUDENT_CONTEXTS}, got "
                     f"{oc.student_context!r}")
  if oc.teacher == "self_tau1" and oc.student_context != "replay":
    raise ValueError("config.opd.teacher='self_tau1' needs config.opd.student_context='replay' (on "
                     "left-to-right canvases the tau=1 teacher is the student itself)")

  if oc.student_context == "prefix" and 0 < int(oc.replay_max_segments) < bs:
    logging.warning("opd.student_context='prefix' with replay_max_segments=%d < block size %d: "
                    "neighbouring tokens share a canvas (inexact, replay_exact=0); set it to 0 for "
                    "the exact P, o_<t", int(oc.replay_max_segments), bs)
  per_call = int(oc.get("rollout_batch_size", 0))

  def sample(p, prompts, key):
    roll = rollouts.sample(student_cfg, p, prompts["prompt_ids"], prompts["prompt_len"], dc, key, g,
                           rows_per_call=per_call)
    return roll, score_rollouts(roll, prompts, g, task, alpha=alpha)

  def teacher_cache(roll, seg):
    """The teacher cache of the rollouts, scored `rollout_batch_size` rows at a time."""
    if mode == "none":
      return {}
    rows = len(roll["prompt_ids"])
    per = per_call or rows
    if oc.teacher == "self_tau1":
      tseg = rollouts.replay_inputs(roll, bs, mask_id, rollouts.serialize_commit_steps(roll["commit_step"], bs),
                                    max_segments_per_block=int(oc.replay_max_segments))
    parts = []
    for i in range(0, rows, per):
      rs = slice(i, i + per)
      if oc.teacher == "ar":
        c = score(tparams, roll["prompt_ids"][rs], roll["prompt_len"][rs], seg["clean"][rs])
      else:
        c = score(tparams, roll["prompt_ids"][rs], roll["prompt_len"][rs],
                  {n: tseg[n][rs] for n in rollouts.SEGMENT_KEYS})
      parts.append({n: np.asarray(v) for n, v in c.items()})
    return {n: np.concatenate([pt[n] for pt in parts]) for n in parts[0]}

  def batch(roll, student_context=None):
    prefix = (student_context or oc.student_context) == "prefix"
    order = rollouts.left_to_right_commit_steps(roll["commit_step"]) if prefix else None
    seg = rollouts.replay_inputs(roll, bs, mask_id, order, max_segments_per_block=int(oc.replay_max_segments))
    return dict(prompt=roll["prompt_ids"], prompt_len=roll["prompt_len"], loss_mask=roll["loss_mask"],
                **{n: seg[n] for n in rollouts.SEGMENT_KEYS}, **teacher_cache(roll, seg)), seg

  kw = dict(block_size=bs, teacher_cache=mode, mask_id=mask_id)
  choice_id = prompts_lib.choice_after_id(task["tokenizer"])
  if float(oc.get("choice_weight", 1.0)) != 1.0 and choice_id < 0:
    raise ValueError("config.opd.choice_weight needs ' #' (before a candidate number) to be one token of "
                     "this tokenizer")
  loss = loss_for(oc, student_cfg, tcfg, mask_id, choice_id)
  if mode == "none":  # held for the whole stage: in the compute dtype (exact, half an f32 copy)
    tparams = opd.frozen_teacher(tcfg, tparams)
  frozen = tparams if mode == "none" else None
  kl_jit = jax.jit(lambda p, b, t: opd.token_kl(student_cfg, p, b, teacher=(tcfg, t) if mode == "none" else None,
                                                **kw))
  return Distillation(mc, params, sample, batch, loss, lambda p, b: kl_jit(p, b, tparams), frozen,
                      student_config=student_cfg, decode_config=dc)


def loss_for(oc, student_cfg, teacher_cfg, mask_id: int, choice_id: int):
  """The OPD step's loss (`opd.opd_loss`) of `student_cfg` against the AR teacher `teacher_cfg` (None:
  the 'self_tau1' teacher's cache) under section `oc`; `choice_id`: ' #' (`prompts.choice_after_id`)."""
  return functools.partial(opd.opd_loss, student_cfg, teacher_config=teacher_cfg,
                           objective=opd.Objective(str(oc.get("divergence", "forward")),
                                                   opd.Choice(choice_id, float(oc.get("choice_weight", 1.0)))),
                           block_size=int(student_cfg.block_size), teacher_cache=str(oc.teacher_cache),
                           mask_id=mask_id)


def heldout_kl(d: Distillation, prompts: dict, n: int):
  """-> `params -> {"heldout_kl", "heldout_reverse_kl"}`: the student's rollouts of the first `n`
  of `prompts` (one each, at the rollouts' temperature, the same key every call), scored by the
  teacher: KL(teacher || student) and KL(student || teacher), token means over the committed
  tokens, the same for any process count (each process decodes users i, i + P, ...). `n` is
  rounded down to a multiple of the device count; None when that is 0."""
  pc, pi = jax.process_count(), jax.process_index()
  # A whole number of rows per device: the rollouts' batch is split over every device's rows.
  n = min(int(n), len(prompts["prompt_ids"])) // jax.device_count() * jax.device_count()
  if n == 0:
    return None
  mine = {k: v[:n][pi::pc] for k, v in prompts.items()}

  def measure(params) -> dict:
    roll = rollouts.sample(d.student_config, params, mine["prompt_ids"], mine["prompt_len"], d.decode_config,
                           jax.random.PRNGKey(0), 1)
    batch, _ = d.batch(roll)
    if pc > 1:   # this process's rows of one global batch, as the rollouts were decoded
      rows = rollouts.global_rows_sharding(params)
      batch = {k: rollouts.to_global(np.asarray(v), rows) for k, v in batch.items()}
    kl, _, rkl = d.token_kl_fn(params, batch)
    m = roll["loss_mask"].astype(np.float64)
    sums = [float((m * rollouts.to_local(x, len(m)) if pc > 1 else m * np.asarray(x)).sum()) for x in (kl, rkl)]
    parts = multihost.allgather("opd_heldout_kl", sums + [float(m.sum())])
    tot = np.sum(np.asarray(parts, np.float64), axis=0)
    return {"heldout_kl": tot[0] / max(tot[2], 1.0), "heldout_reverse_kl": tot[1] / max(tot[2], 1.0)}

  return measure


def _hash(config, workdir: str, upstream: dict) -> str:
  oc = section(config, "opd", opd.opd_config)
  if oc.teacher not in opd.TEACHERS:
    raise ValueError(f"config.opd.teacher must be one of {opd.TEACHERS}, got {oc.teacher!r}")
  src = on_policy.source_dir(config, workdir, "opd", oc)
  teacher_dir = teacher_model_dir(config, oc, workdir)
  if teacher_dir and not os.path.isdir(teacher_dir):
    raise FileNotFoundError(f"config.opd.teacher_dir: {teacher_dir} not found (run the sft / teacher_rl stage)")
  # Fields at the values that train as before they existed, and metrics-only fields, stay out of the
  # hash (built stages stay fresh).
  unset = (["heldout_prompts"] + (["choice_weight"] if float(oc.get("choice_weight", 1.0)) == 1.0 else [])
           + (["divergence"] if oc.get("divergence", "forward") == "forward" else []))
  return common.config_hash(config.seed, without(oc, unset), config.decode, config.task, config.train.mesh,
                            config.train.optimizer, src, common.model_hash(src), teacher_dir,
                            common.model_hash(teacher_dir) if teacher_dir else None, upstream["traces"],
                            workdir=workdir)


def _build(config, workdir: str, build: contract.Build) -> str:
  oc = section(config, "opd", opd.opd_config)
  src = on_policy.source_dir(config, workdir, "opd", oc)
  teacher_dir = teacher_model_dir(config, oc, workdir)
  train_dir = build.train_dir()
  task = on_policy.task_setup(config, workdir)
  d = distillation(config, oc, task, src, teacher_dir)
  n = len(task["prompts"]["prompt_ids"])
  pps, g = int(oc.prompts_per_step), int(oc.rollouts_per_prompt)
  steps = int(oc.steps) or max(1, int(oc.epochs) * n // pps)
  tconf = on_policy.on_policy_config(config, rows=pps * g, steps=steps, lr=oc.lr, grad_accum=oc.grad_accum_steps)
  make_batch = d.make_batch
  n_held = int(oc.get("heldout_prompts", 0))
  held = heldout_kl(d, on_policy.task_setup(config, workdir, "valid")["prompts"], n_held) if n_held else None
  if held is not None:
    def make_batch(params, prompts, key):
      batch, m = d.make_batch(params, prompts, key)
      return batch, dict(m, **held(params))
  state = rollouts.train_on_policy(tconf, train_dir, params=d.params, loss_fn=d.loss_fn, make_batch=make_batch,
                                   prompt_iter=on_policy.prompt_iterator(task["prompts"], pps, int(config.seed)),
                                   desc="opd", frozen=d.frozen,
                                   validation=loop.Validation(on_policy.validator(config, workdir, oc, d.student_config,
                                                                                  d.decode_config),
                                                              int(oc.valid_every), bool(oc.keep_best)))
  extra = {"steps": steps, "source": src, "teacher": teacher_dir or "self_tau1", "examples": task["counts"],
           "best_step": state["best_step"]}
  return on_policy.publish(build, on_policy.Trained(state, d.model_config, oc, extra), task, train_dir)


# Reads the traces, and (a chain stage) its starting student and the AR teacher before it.
STAGE = contract.Stage(name="opd", reads=("traces",), chain=True, hashed=_hash, build=_build)


def run(config, workdir: str) -> str:
  """Distils (or reuses) `workdir/opd`; returns its path."""
  return contract.run(STAGE, config, workdir)
