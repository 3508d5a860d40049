"""What the on-policy stages share (`opd`, `rl`, `teacher_rl`): the prompts, the policy, its
rollouts' decode config, their rewards and metrics, the greedy validation curve, and publishing
the trained policy.

Each of those stages reads the train split's prompts (`task_setup`: the users whose target is among
the candidates, rejected traces included), loads its starting policy (`load_policy`), decodes
rollouts from the current params (`rollout_decode_config`), scores them with the rank-promotion
reward (`score_rollouts`, train/grpo.py), trains with the on-policy loop on `on_policy_config`'s
train section, and publishes `workdir/<stage>/model` beside its training history (`publish`).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

from dgr2_jax import multihost
from dgr2_jax.decode import runtime
from dgr2_jax.model import checkpoint as model_ckpt
from dgr2_jax.model import qwen3
from dgr2_jax.stages import common
from dgr2_jax.stages import contract
from dgr2_jax.stages import traces as traces_stage
from dgr2_jax.task import answer as answer_lib
from dgr2_jax.task import metrics as metrics_lib
from dgr2_jax.task import pipeline
from dgr2_jax.task import tokenizer as tok_lib
from dgr2_jax.task import traces as traces_lib
from dgr2_jax.train import grpo, loop, rollouts
from dgr2_jax.train.config import section  # noqa: F401 (the on-policy stages and benchmarks read it here)

PROMPT_KEYS = ("prompt_ids", "prompt_len", "target_rank_in_candidates", "candidates", "example_id")


def source_dir(config, workdir: str, stage: str, sc) -> str:
  """The policy stage `stage` starts from: `<stage>.init_from` (section `sc`), else the chain's
  previous model (`common.previous_model_dir`)."""
  return sc.init_from or common.previous_model_dir(config, workdir, stage)


def task_setup(config, workdir: str, split: str = "train", pool: str = "all") -> dict:
  """Tokenizer, token ids, SIDs and the split's prompts: rows whose target is among the candidates,
  and with `pool` 'natural' only those whose target the retriever listed itself (not inserted by
  `task.insert_target`; `counts["pool"]` says how many of how many)."""
  tok_dir = traces_stage.tokenizer_dir(config, workdir)
  tokenizer = tok_lib.load_tokenizer(tok_dir)
  arrays, counts = traces_stage.load_split_arrays(config, workdir, split, tokenizer=tokenizer,
                                                 rejected=True)
  keep = arrays["target_rank_in_candidates"] >= 1
  if pool == "natural":
    inserted = [r["example_id"] for r in traces_lib.read_jsonl(os.path.join(workdir, "traces", f"{split}.jsonl"))
                if r.get("inserted", False)]
    listed = int(keep.sum())
    keep &= ~np.isin(arrays["example_id"], inserted)
    counts = dict(counts, pool={"natural": int(keep.sum()), "listed": listed})
  if not keep.any():
    raise ValueError(f"{workdir}/traces/{split}.jsonl: no {split} example has its target among the candidates"
                     + (" as the retriever listed it (prompt_pool 'natural')" if pool == "natural" else ""))
  prompts = {k: arrays[k][keep] for k in PROMPT_KEYS}
  _, sids = traces_stage.load_items_sids(workdir)
  return dict(tok_dir=tok_dir, tokenizer=tokenizer, tids=tok_lib.token_ids(tokenizer), sids=sids,
              prompts=prompts, counts=counts)


def on_policy_config(config, *, rows: int, steps: int, lr: float, grad_accum: int):
  """Copy of `config` whose `train` section drives the on-policy loop (constant lr, no warmup)."""
  c = config.copy_and_resolve_references()
  c.train.batch_size = int(rows)
  c.train.total_steps = int(steps)
  c.train.grad_accum_steps = int(grad_accum)
  c.train.optimizer.peak_lr = float(lr)
  c.train.optimizer.schedule = "constant"
  c.train.optimizer.warmup_steps = 0
  return c


def load_policy(config, model_dir: str):
  """(config, params) of a model dir, with `config.model`'s runtime fields (compute dtype, remat,
  attention route, logits chunk: `Qwen3Config.with_runtime`)."""
  # Several processes: read straight into the training shardings (no whole copy per process).
  mc, params = model_ckpt.load_model_dir(model_dir, shardings=loop.model_shardings(config))
  mc = mc.with_runtime(config.get("model"))
  return mc, qwen3.to_layout(mc, params)


def rollout_decode_config(config, tids, model_config, temperature: float):
  dc = runtime.decode_config(config, tids, model_config)
  # Rollouts decode with the weights being trained, never float8 copies (decode.weight_dtype is
  # eval's and serving's): the loss scores them under those weights, so they must be on-policy.
  return dataclasses.replace(dc, temperature=float(temperature), weight_dtype="")


def score_rollouts(roll: dict, prompts: dict, group_size: int, task: dict, alpha: float) -> dict:
  """Parses every rollout and computes its reward (grpo.rewards); overlong => None => -1."""
  cands = np.repeat(prompts["candidates"], group_size, axis=0)
  r_d = np.repeat(prompts["target_rank_in_candidates"], group_size, axis=0)
  parsed = []
  for ids, fin, cand in zip(roll["output_ids"], roll["finished"], cands):
    if not fin:
      parsed.append(None)
      continue
    text = task["tokenizer"].decode(ids, skip_special_tokens=False)
    parsed.append(answer_lib.parse_response(text, [task["sids"][int(i)] for i in cand]))
  rew = grpo.rewards(parsed, r_d, cands.shape[1], alpha)
  valid = np.asarray([p is not None and p.valid for p in parsed])
  return dict(rewards=rew, valid=valid)


def rollout_metrics(roll: dict, scored: dict, seg: dict) -> dict:
  return {"reward_mean": float(scored["rewards"].mean()), "reward_std": float(scored["rewards"].std()),
          "valid_rate": float(scored["valid"].mean()), "overlong_rate": float(1 - roll["finished"].mean()),
          "mean_nfe": float(roll["nfe"].mean()), "mean_response_tokens": float(roll["loss_mask"].sum(1).mean()),
          "replay_exact": float(seg["exact"].mean())}


def prompt_iterator(prompts: dict, prompts_per_step: int, seed: int):
  n = len(prompts["prompt_ids"])
  if n < prompts_per_step:
    raise ValueError(f"prompts_per_step ({prompts_per_step}) is more than the {n} train prompts")
  return pipeline.make_iterator(prompts, prompts_per_step, seed=seed, field="prompts_per_step")


def judge(output_ids, finished, prompts: dict, tokenizer, sids) -> tuple[list[int], list[int], list[int]]:
  """Per row of `prompts`: hit at 1, valid answer, first pick (candidate index, -1 when invalid) of
  its output ids (through EOS); an unfinished or invalid answer falls back to the retriever's
  order, as in evaluation."""
  hits, valid, first = [], [], []
  for ids, fin, cand, r_d in zip(output_ids, finished, prompts["candidates"], prompts["target_rank_in_candidates"]):
    parsed = answer_lib.parse_response(tokenizer.decode(ids, skip_special_tokens=False),
                                       [sids[int(i)] for i in cand]) if fin else None
    ok = parsed is not None and parsed.valid
    rank = metrics_lib.target_rank(parsed.positions, int(r_d) - 1) if ok else int(r_d)
    hits.append(int(rank == 1))
    valid.append(int(ok))
    first.append(int(parsed.positions[0]) if ok else -1)
  return hits, valid, first


def validator(config, workdir: str, rc, policy_cfg, dc):
  """`params -> {"valid_recall@1", "valid_valid_rate", "valid_hits"}` for an on-policy stage whose
  section `rc` has valid_every / valid_prompts (opd, rl, teacher_rl): greedy decoding (the
  rollouts' decode config at temperature 0) of the first `rc.valid_prompts` validation users whose
  target is listed, `rc.valid_batch_size` of them per call (the last call padded with copies of
  its last user); an invalid output falls back to the retriever's order, as in evaluation.
  `valid_hits`: each user's hit (0/1) in user order, which pairs the curve's points (keep_best,
  `loop.Validation`). None when `rc.valid_every` is 0. Several processes: each decodes users
  i, i + P, ..., a call holding valid_batch_size / P of each process's users (the same users
  per call for any P), and the hits are gathered back into user order (the same for any P)."""
  if not int(rc.get("valid_every", 0)) or not int(rc.get("valid_prompts", 0)):
    return None
  vt = task_setup(config, workdir, "valid")
  pc, pi = jax.process_count(), jax.process_index()
  n = min(int(rc.valid_prompts), len(vt["prompts"]["prompt_ids"])) // pc * pc
  prompts = {k: v[:n][pi::pc] for k, v in vt["prompts"].items()}
  greedy = dataclasses.replace(dc, temperature=0.0)
  mine = n // pc
  per = min(-(-int(rc.get("valid_batch_size", 0)) // pc), mine) or mine   # this process's users per call
  pad = lambda x: np.concatenate([x, np.repeat(x[-1:], -mine % per, axis=0)])

  def evaluate(params) -> dict:
    roll = rollouts.sample(policy_cfg, params, pad(prompts["prompt_ids"]), pad(prompts["prompt_len"]), greedy,
                           jax.random.PRNGKey(0), 1, rows_per_call=per)
    hits, valid, _ = judge(roll["output_ids"][:mine], roll["finished"][:mine], prompts, vt["tokenizer"], vt["sids"])
    parts = multihost.allgather("valid_curve", [hits, valid])   # [process][hits | valid][its j-th user]
    user_order = lambda k: [parts[p][k][j] for j in range(n // pc) for p in range(pc)]   # user j * P + p
    all_hits, all_valid = user_order(0), user_order(1)
    return {"valid_recall@1": float(np.mean(all_hits)), "valid_valid_rate": float(np.mean(all_valid)),
            "valid_hits": all_hits}

  return evaluate


def write_valid_curve(tmp: str, state: dict, sc) -> None:
  """`tmp/valid_curve.json`: the validation curve of `train_on_policy`'s state, the best step,
  which model the stage kept (section `sc`'s keep_best) and, with keep_best, the paired standard
  errors a later point had to beat the start by (`loop.keep_bar`); nothing without a curve."""
  if state["valid_curve"]:
    common.write_json_atomic(os.path.join(tmp, "valid_curve.json"),
                             {"curve": state["valid_curve"], "best_step": state["best_step"],
                              "kept": "best" if sc.get("keep_best", False) else "last",
                              "keep_bar_se": state.get("keep_bar_se")})


@dataclasses.dataclass(frozen=True)
class Trained:
  """What an on-policy stage publishes: the trained state (params, validation curve), the policy's
  model config, the stage's section and the DONE.json record."""
  state: dict
  model_config: object
  section: object
  extra: dict


def publish(build: contract.Build, trained: Trained, task: dict, train_dir: str) -> str:
  """Publishes `workdir/<stage>/`: the model (with the tokenizer), the validation curve and the
  training history; returns its path."""
  with build.publish(trained.extra) as tmp:
    write_valid_curve(tmp, trained.state, trained.section)
    model_ckpt.save_model_dir(os.path.join(tmp, "model"), trained.model_config, trained.state["params"],
                              tokenizer_src=task["tok_dir"])
    if jax.process_index() == 0:
      os.replace(train_dir, os.path.join(tmp, "train"))
  return build.out
