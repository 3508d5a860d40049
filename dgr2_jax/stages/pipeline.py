"""Stage `pipeline`: every stage of `config.pipeline.stages` in order, then the results tables.

Each stage skips itself when its output in the workdir is fresh (same config hash), so rerunning
the pipeline after a change redoes only what the change reaches. Model stages write
`workdir/<stage>/model`; the chain is sft -> teacher_rl (the AR teacher, SFT then RL) -> convert
(naive block diffusion) -> cft -> opd -> rl, and an ablation that drops a stage makes the next
one start from the previous model that exists (`previous_model_stage`).

The pipeline's `eval` step is the accuracy ladder: the eval stage once per model in the chain,
AR decoding (block 1) for the AR models (`ar_sft` and `ar` when `teacher_rl` runs, else `ar`) and
`config.decode` for the diffusion models (at tau `pipeline.ladder_threshold` and step budget
`pipeline.ladder_steps_per_block` where they are set; 1.0 and no budget decode one position a
step), plus (`pipeline.speculative_row`) the final diffusion model drafting for the AR teacher
(`speculative`, whose metrics equal `ar`'s exactly), into `workdir/eval/<method>/` (a stage that
kept its starting model, keep_best's step 0, holds the previous row's weights: its row is that
row's predictions, copied rather than decoded again, `weights_stage`), summarised in
`workdir/results/accuracy.{md,json}` (with the pre-rank floor of the same examples and each row's
diagnostics from its predictions, task/diagnostics.py: override rate and precision, trace-policy
agreement, paired bootstrap CIs against the floor and the AR teacher `ar`). The `bench` step
writes `workdir/results/frontier.*`. Each stage's wall-clock in this run goes to
`workdir/results/stage_times.json` (`seconds`), beside the wall-clock of the run that built each
stage as it now stands (`built`: recorded whenever a stage is built, by the pipeline or alone with
`--config.stage`, so a workdir built in several sittings still adds up to its end-to-end cost).

The stages themselves are the registry's (stages/registry.py), each run through the stage
contract (stages/contract.py); this module sits above them and imports none of them by name but
the eval stage (the ladder's rows).
The `pipeline` config section is this module's: its defaults (`pipeline_config`) and checks (`validate`).
"""

from __future__ import annotations

import functools
import json
import os
import time

import ml_collections

from dgr2_jax import checks
from dgr2_jax import platform
from dgr2_jax import results
from dgr2_jax.chain import AR_STAGES, MODEL_STAGES, final_model_stage, model_dir, teacher_model_dir  # noqa: F401
from dgr2_jax.chain import previous_model_stage, teacher_stage  # noqa: F401
from dgr2_jax.data import api
from dgr2_jax.stages import common
from dgr2_jax.stages import contract
from dgr2_jax.stages import eval as eval_stage
from dgr2_jax.stages import registry
# The stage table, the order and the prerequisites are the registry's (read by main and the tests here).
from dgr2_jax.stages.registry import NO_WORKDIR, ORDER, STAGES, check_available, enabled_stages  # noqa: F401
from dgr2_jax.task import copurchase, diagnostics
from dgr2_jax.task import traces as traces_lib
from dgr2_jax.train import mesh as mesh_lib

# Ladder method name of each diffusion training stage (prefixed by the earlier ones present).
_TRAINED = ("cft", "opd", "rl")


def stage_fn(name: str):
  """`fn(config, workdir)` running stage `name` through the contract (timed; `pipeline`: this
  module's `run`; a stage of explicit paths: its module's `run`). Clear errors for unknown or
  absent stages."""
  if name == "pipeline":
    return run
  decl = registry.stage(name)
  return functools.partial(contract.execute, decl) if decl.workdir else registry.module(name).run


def pipeline_config() -> ml_collections.ConfigDict:
  """The `pipeline` section: which stages run, and the accuracy ladder's settings."""
  c = ml_collections.ConfigDict()
  c.stages = registry.ORDER  # ablations drop entries; the order is fixed
  c.speculative_row = True    # a `speculative` row in the ladder (equal to the `ar` row's metrics)
  # tau of the ladder's block-diffusion rows (0 => decode.threshold). The paper's accuracy table
  # (Q1) is at tau 1.0, "quality-preserving", with its step budget. The speculative row drafts and
  # the on-policy stages roll out at decode's settings whatever this is.
  c.ladder_threshold = 0.0
  # Step budget of the ladder's block-diffusion rows (-1 => decode.steps_per_block; 0 = none). A
  # budget of S steps per block commits at least block_size/S positions a step whatever tau is, so
  # tau 1.0 is one position a step only with 0 here (~11x the forward passes of tau 0.9 on real
  # Beauty; an untrained conversion then decodes mostly left to right: docs/results.md).
  c.ladder_steps_per_block = -1
  return c


def validate(config, runs: set) -> None:
  """Checks `pipeline.stages`: known stages, in the fixed order, each once."""
  del runs
  if "pipeline" not in config:
    return
  stages = tuple(config.pipeline.stages)
  for s in stages:
    if s not in registry.ORDER:
      checks.fail("pipeline.stages", f"{s!r} is not a pipeline stage; known: {list(registry.ORDER)}")
  if list(stages) != sorted(stages, key=registry.ORDER.index) or len(set(stages)) != len(stages):
    checks.fail("pipeline.stages", f"must be a subsequence of {list(registry.ORDER)}, got {list(stages)}")
  defaults = pipeline_config()  # a field the section leaves out has its default
  tau = config.pipeline.get("ladder_threshold", defaults.ladder_threshold)
  if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0.0 <= tau <= 1.0:
    checks.fail("pipeline.ladder_threshold", f"must be 0 (decode.threshold) or in (0, 1], got {tau!r}")
  budget = config.pipeline.get("ladder_steps_per_block", defaults.ladder_steps_per_block)
  if not checks.is_int(budget, -1):
    checks.fail("pipeline.ladder_steps_per_block",
                f"must be an int >= -1 (-1 = decode.steps_per_block, 0 = no budget), got {budget!r}")


def missing_prerequisites(config, workdir: str, stage: str) -> list[str]:
  """Enabled stages (in order) that `stage`, asked for alone, reads (its declaration's `reads`, and
  a chain stage's earlier models unless `<stage>.init_from` names one) and `workdir` has not built."""
  if stage not in registry.ORDER or not workdir:
    return []
  needed = registry.prerequisites(config, stage)
  return [s for s in needed if common.read_done(common.stage_dir(workdir, s)) is None]


def ladder_methods(config) -> list[tuple[str, str]]:
  """[(method, model stage)] of the accuracy ladder for the enabled stages, in order."""
  on = enabled_stages(config)
  out = []
  if "sft" in on or "teacher_rl" in on:
    # Both AR references when the teacher is trained with RL: the SFT model and SFT + RL.
    out.append(("ar", "sft") if "teacher_rl" not in on else ("ar_sft", "sft"))
  if "teacher_rl" in on:
    out.append(("ar", "teacher_rl"))
  if "convert" in on:
    out.append(("naive", "convert"))
  chain = []
  for s in _TRAINED:
    if s in on:
      chain.append(s)
      out.append(("_".join(chain), s))
  final = final_model_stage(config)
  if final and config.get("pipeline", {}).get("speculative_row", False):
    out.append(("speculative", final))  # the final diffusion model drafts, the AR teacher verifies
  return out


def method_config(config, workdir: str, method: str, stage: str):
  """Copy of `config` for evaluating `stage`'s model as ladder row `method`."""
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.stage = "eval"
    c.eval.model_dir = model_dir(workdir, stage)
    c.eval.name = method
    c.eval.output_dir = ""
    if stage in AR_STAGES:  # the AR models decode left to right
      c.decode.block_size = 1
      c.decode.threshold = 1.0
      c.decode.mode = "threshold"
    elif method == "speculative":
      c.decode.mode = "speculative"
      c.decode.verifier_dir = c.decode.get("verifier_dir", "") or teacher_model_dir(config, workdir)
    else:   # a block-diffusion row, at the ladder's own tau and step budget where they are set
      p = c.get("pipeline", {})
      if p.get("ladder_threshold", 0.0):
        c.decode.threshold = float(p.ladder_threshold)
      if p.get("ladder_steps_per_block", -1) >= 0:
        c.decode.steps_per_block = int(p.ladder_steps_per_block)
  return c


def run_ladder(config, workdir: str) -> dict:
  """Evaluates every model of the chain that exists and writes the accuracy tables: the pre-rank
  floor, the rules that see the prompts' evidence (`rule_picks`), then the models."""
  rows, hashes, floor, preds = [], [], None, {}
  decoded = {}   # (the stage whose weights a row holds, its decode settings) -> that eval's output
  for method, stage in ladder_methods(config):
    if common.read_done(common.stage_dir(workdir, stage)) is None:
      print(f"pipeline: no {stage!r} model in {workdir}; ladder row {method!r} skipped", flush=True)
      continue
    mc = method_config(config, workdir, method, stage)
    key = (weights_stage(config, workdir, stage), json.dumps(common.to_plain(mc.decode), sort_keys=True))
    if key in decoded:
      print(f"pipeline: ladder row {method!r}: {stage!r} kept its starting model, the weights of row "
            f"{decoded[key][0]!r}: its predictions, not decoded again", flush=True)
    out = eval_stage.run(mc, workdir, same_as=decoded[key][1] if key in decoded else None)
    decoded.setdefault(key, (method, out))
    m = _read_json(os.path.join(out, "metrics.json"))
    hashes.append(common.read_done(out)["config_hash"])
    preds[method] = _read_jsonl(os.path.join(out, "predictions.jsonl"))
    if floor is None and m.get("prerank_floor"):
      floor = {"method": "pre_rank", **m["prerank_floor"]}
    rows.append({"method": method, "model_dir": model_dir(workdir, stage),
                 "decode": m.get("decode"), **{k: v for k, v in m.items()
                                               if k not in ("decode", "prerank_floor", "examples")}})
  rules = rule_picks(config, workdir, _examples(preds), config.eval.split)
  if preds:   # the rules on the evaluated prompts (the rows share their users): the teacher's
    ref = preds.get("ar") or next(iter(preds.values()))
    for method, picks in rules.items():
      preds[method] = diagnostics.rule_predictions(ref, picks)
    rows = [diagnostics.rule_row(m, preds[m]) for m in rules] + rows
  diag = diagnostics.ladder_diagnostics(preds, teacher="ar", policy=rules.get("rule_policy"))
  rows = [{**r, **diag[r["method"]]} for r in rows]
  if floor is not None:
    rows.insert(0, floor)
  obj = results.write_accuracy(os.path.join(workdir, "results"), rows,
                               results.meta(common.config_hash(hashes)))
  return obj


def weights_stage(config, workdir: str, stage: str) -> str:
  """The model stage whose weights `workdir/<stage>/model` holds: a stage that kept its starting
  point (keep_best's `best_step` 0 in its DONE.json) and started from the chain's previous model
  (no `<stage>.init_from`) saved that model's weights unchanged (bit for bit, tested)."""
  while stage in MODEL_STAGES and stage != MODEL_STAGES[0]:
    done = common.read_done(common.stage_dir(workdir, stage)) or {}
    if done.get("best_step") != 0 or config.get(stage, {}).get("init_from"):
      break
    stage = previous_model_stage(config, stage)
  return stage


def ladder_diagnostics(config, workdir: str, preds: dict, split: str) -> dict:
  """{method: task/diagnostics.py's columns} of ladder predictions ({method: records} of `split`):
  the AR teacher is row 'ar'; policy agreement when the traces stage chose a trace policy."""
  rules = rule_picks(config, workdir, _examples(preds), split)
  return diagnostics.ladder_diagnostics(preds, teacher="ar", policy=rules.get("rule_policy"))


def _examples(preds: dict) -> list[dict]:
  """The users of the ladder's rows, once each (the rows share them)."""
  return list({p["example_id"]: p for ps in preds.values() for p in ps}.values())


def rule_picks(config, workdir: str, examples: list[dict], split: str) -> dict:
  """{rule: {example_id: its first pick}} of the rules that read the evidence the prompts spell
  out, on `examples` (prediction records: history and candidates as item ids):
  - `rule_bought_next` (prompts with next-purchase counts, `task.mark_copurchase`): the candidate
    most often bought right after the last purchase, counted as the traces stage counts them (the
    split's pre-target interactions, task/copurchase.py), else the retriever's #1;
  - `rule_policy` (when the traces stage chose a trace policy, `workdir/traces/policy.json`): that
    policy's pick, next-purchase tiers included. Its picks are also the `policy_agreement` column's.
  """
  out, counts = {}, None
  if config.task.get("mark_copurchase", False):
    tab = copurchase.table(api.load_sequences(workdir), traces_lib.SPLIT_CUT[split])
    counts = {e["example_id"]: copurchase.counts(tab, e["history"], e["candidates"]) for e in examples}
    out["rule_bought_next"] = {i: diagnostics.most_bought_next(c) for i, c in counts.items()}
  path = os.path.join(workdir, "traces", "policy.json")
  if os.path.exists(path):
    out["rule_policy"] = diagnostics.policy_picks(examples, api.load_items(workdir), _read_json(path)["policy"],
                                                  int(config.task.max_history), bought_next=counts)
  return out


def _read_json(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def _read_jsonl(path: str) -> list:
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} missing: the eval stage's predictions (rerun the eval stage)")
  return traces_lib.read_jsonl(path)


def check_batch_sizes(config) -> None:
  """Before any stage: every enabled training stage's global batch splits over the processes (each
  feeds its own rows) and, for the supervised stages, over the mesh's data x fsdp devices.
  ValueError naming the field."""
  on, tc = enabled_stages(config), config.train
  devices, processes = len(platform.devices()), platform.process_count()   # a compile-only target's too
  for stage, field, size in (("sft", "train.batch_size", tc.batch_size),
                             ("cft", "cft.batch_size" if config.get("cft", {}).get("batch_size", 0)
                              else "train.batch_size",
                              config.get("cft", {}).get("batch_size", 0) or tc.batch_size)):
    if stage in on:
      mesh_lib.check_batch_size(int(size), tc.mesh, devices, processes, field, int(tc.grad_accum_steps))
  for sec, per in (("teacher_rl", "group_size"), ("opd", "rollouts_per_prompt"), ("rl", "group_size")):
    if sec in on and sec in config:
      s = config[sec]
      if int(s.prompts_per_step) % processes:
        raise ValueError(f"{sec}.prompts_per_step ({s.prompts_per_step}) must be divisible by the "
                         f"process count ({processes})")
      # The on-policy batch (its rows) is sharded like a supervised one (loop.train checks it again).
      mesh_lib.check_batch_size(int(s.prompts_per_step) * int(s[per]), tc.mesh, devices, processes,
                                f"{sec}.prompts_per_step x {sec}.{per}", int(s.get("grad_accum_steps", 1)))


def run(config, workdir: str) -> dict:
  """Runs the enabled stages in order; returns {stage: its return value}."""
  out, times = {}, {}
  stages = enabled_stages(config)
  check_batch_sizes(config)
  for i, s in enumerate(stages):
    print(f"pipeline: [{i + 1}/{len(stages)}] {s}", flush=True)
    t0 = time.perf_counter()
    out[s] = contract.timed(s, run_ladder, config, workdir) if s == "eval" else stage_fn(s)(config, workdir)
    times[s] = round(time.perf_counter() - t0, 1)
    print(f"pipeline: {s} took {times[s]:.0f} s", flush=True)
    # This run's wall-clock per stage (a fresh stage that was skipped shows ~0 s), and the
    # wall-clock of the runs that built the stages as they stand.
    built = contract.built_times(workdir, stages)
    common.write_json_atomic(os.path.join(workdir, "results", "stage_times.json"),
                             {"seconds": times, "total": round(sum(times.values()), 1),
                              "built": built, "built_total": round(sum(built.values()), 1)})
  return out
