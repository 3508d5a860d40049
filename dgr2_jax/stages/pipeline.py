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
step), plus (`pipeline.speculative_row`) the final diffusion model drafting for the AR teacher (`speculative`, whose metrics equal `ar`'s exactly), into
`workdir/eval/<method>/`, summarised in `workdir/results/accuracy.{md,json}` (with the pre-rank
floor of the same examples and each row's diagnostics from its predictions, task/diagnostics.py:
override rate and precision, trace-policy agreement, paired bootstrap CIs against the floor and
the AR teacher `ar`). The `bench` step writes `workdir/results/frontier.*`. Each stage's
wall-clock in this run goes to `workdir/results/stage_times.json` (`seconds`), beside the
wall-clock of the run that built each stage as it now stands (`built`: recorded whenever a stage is
built, by the pipeline or alone with `--config.stage`, so a workdir built in several sittings
still adds up to its end-to-end cost).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import time

from dgr2_jax.stages import common
# The stage order and the model chain live with the workdir's layout; re-exported here.
from dgr2_jax.stages.common import (AR_STAGES, MODEL_STAGES, ORDER, enabled_stages, model_dir,  # noqa: F401
                                    previous_model_dir, previous_model_stage, teacher_model_dir,
                                    teacher_stage)
from dgr2_jax.chain import final_model_stage  # noqa: F401

# Stage name -> module with `run(config, workdir)`. Imported lazily by `stage_fn`, so a missing
# optional stage does not break the others.
STAGES = {
    "data": "dgr2_jax.stages.data",
    "sids": "dgr2_jax.stages.sids",
    "retriever": "dgr2_jax.stages.retriever",
    "traces": "dgr2_jax.stages.traces",
    "sft": "dgr2_jax.stages.sft",
    "teacher_rl": "dgr2_jax.stages.teacher_rl",
    "convert": "dgr2_jax.stages.convert",
    "cft": "dgr2_jax.stages.cft",
    "opd": "dgr2_jax.stages.opd",
    "rl": "dgr2_jax.stages.rl",
    "eval": "dgr2_jax.stages.eval",
    "bench": "dgr2_jax.stages.bench",
    "generate": "dgr2_jax.stages.generate",
    "pipeline": "dgr2_jax.stages.pipeline",
}
NO_WORKDIR = ("generate",)
# Stages that compute on the host alone: with several processes, process 0 runs them.
HOST_STAGES = ("data", "sids", "retriever", "traces", "convert")  # stages that read/write only explicit paths
# Ladder method name of each diffusion training stage (prefixed by the earlier ones present).
_TRAINED = ("cft", "opd", "rl")


def check_available(names) -> None:
  """NotImplementedError listing every stage of `names` whose module is absent (nothing imported),
  so a pipeline does not stop hours in at a stage this checkout lacks."""
  missing = [n for n in names if n in STAGES and importlib.util.find_spec(STAGES[n]) is None]
  if missing:
    raise NotImplementedError(f"stage(s) {missing} are not available in this checkout (no module "
                              f"{', '.join(STAGES[n] for n in missing)}); drop them from "
                              "config.pipeline.stages or add the module")


def stage_fn(name: str):
  """The `run` function of stage `name` (imported now); clear errors for unknown/missing ones."""
  if name not in STAGES:
    raise ValueError(f"config.stage {name!r} is not a stage; known: {', '.join(STAGES)}")
  try:
    module = importlib.import_module(STAGES[name])
  except ModuleNotFoundError as e:
    if e.name and STAGES[name].startswith(e.name):
      raise NotImplementedError(f"stage {name!r} is not available: module {STAGES[name]} does not "
                                "exist in this checkout") from None
    raise
  if name in HOST_STAGES:  # several processes: process 0 builds, the others wait and read
    return functools.partial(common.run_host_stage, name, module.run)
  return module.run


def validate(config, runs: set) -> None:
  """Checks `pipeline.stages`: known stages, in the fixed order, each once."""
  del runs
  from dgr2_jax import checks
  if "pipeline" not in config:
    return
  stages = tuple(config.pipeline.stages)
  for s in stages:
    if s not in ORDER:
      checks.fail("pipeline.stages", f"{s!r} is not a pipeline stage; known: {list(ORDER)}")
  if list(stages) != sorted(stages, key=ORDER.index) or len(set(stages)) != len(stages):
    checks.fail("pipeline.stages", f"must be a subsequence of {list(ORDER)}, got {list(stages)}")
  tau = config.pipeline.get("ladder_threshold", 0.0)
  if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0.0 <= tau <= 1.0:
    checks.fail("pipeline.ladder_threshold", f"must be 0 (decode.threshold) or in (0, 1], got {tau!r}")
  budget = config.pipeline.get("ladder_steps_per_block", -1)
  if not checks.is_int(budget, -1):
    checks.fail("pipeline.ladder_steps_per_block",
                f"must be an int >= -1 (-1 = decode.steps_per_block, 0 = no budget), got {budget!r}")


# What a stage run alone reads from the workdir besides its own section's paths: eval and bench
# read the traces (their models are named by eval.model_dir / bench.*model_dir or are the chain's
# built models), and so does a model stage whose `init_from` names its starting model; every other
# stage reads the enabled stages before it.
_DATA_STAGES = ("data", "sids", "retriever", "traces")


def missing_prerequisites(config, workdir: str, stage: str) -> list[str]:
  """Enabled stages (in order) that `stage`, asked for alone, needs and `workdir` has not built."""
  if stage not in ORDER or not workdir:
    return []
  on = enabled_stages(config)
  section = config.get(stage) or {}
  if stage in ("sids", "retriever"):  # each reads the data stage only
    needed = ["data"] if "data" in on else []
  elif stage in ("eval", "bench") or section.get("init_from"):  # the model is named, not the chain's
    needed = [s for s in _DATA_STAGES if s in on]
  else:
    needed = [s for s in on if ORDER.index(s) < ORDER.index(stage)]
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
  """Evaluates every model of the chain that exists and writes the accuracy tables."""
  from dgr2_jax import results
  from dgr2_jax.stages import eval as eval_stage
  rows, hashes, floor, preds = [], [], None, {}
  for method, stage in ladder_methods(config):
    if common.read_done(common.stage_dir(workdir, stage)) is None:
      print(f"pipeline: no {stage!r} model in {workdir}; ladder row {method!r} skipped", flush=True)
      continue
    out = eval_stage.run(method_config(config, workdir, method, stage), workdir)
    m = _read_json(os.path.join(out, "metrics.json"))
    hashes.append(common.read_done(out)["config_hash"])
    preds[method] = _read_jsonl(os.path.join(out, "predictions.jsonl"))
    if floor is None and m.get("prerank_floor"):
      floor = {"method": "pre_rank", **m["prerank_floor"]}
    rows.append({"method": method, "model_dir": model_dir(workdir, stage),
                 "decode": m.get("decode"), **{k: v for k, v in m.items()
                                               if k not in ("decode", "prerank_floor", "examples")}})
  diag = ladder_diagnostics(config, workdir, preds)
  rows = [{**r, **diag[r["method"]]} for r in rows]
  if floor is not None:
    rows.insert(0, floor)
  obj = results.write_accuracy(os.path.join(workdir, "results"), rows,
                               results.meta(common.config_hash(hashes)))
  return obj


def ladder_diagnostics(config, workdir: str, preds: dict) -> dict:
  """{method: task/diagnostics.py's columns} of the ladder's predictions ({method: records}): the
  AR teacher is row 'ar'; policy agreement only when the traces stage chose a trace policy
  (`workdir/traces/policy.json`)."""
  from dgr2_jax.task import diagnostics
  path = os.path.join(workdir, "traces", "policy.json")
  picks = None
  if os.path.exists(path):
    from dgr2_jax.data import api
    items = api.load_items(workdir)
    every = {p["example_id"]: p for ps in preds.values() for p in ps}   # the rows share users
    picks = diagnostics.policy_picks(list(every.values()), items, _read_json(path)["policy"],
                                     int(config.task.max_history))
  return diagnostics.ladder_diagnostics(preds, teacher="ar", policy=picks)


def _read_json(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def _read_jsonl(path: str) -> list:
  from dgr2_jax.task import traces as traces_lib  # its JSONL reader names file:line on a bad line
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} missing: the eval stage's predictions (rerun the eval stage)")
  return traces_lib.read_jsonl(path)


def check_batch_sizes(config) -> None:
  """Before any stage: every enabled training stage's global batch splits over the processes (each
  feeds its own rows) and, for the supervised stages, over the mesh's data x fsdp devices.
  ValueError naming the field."""
  import jax
  from dgr2_jax.train import mesh as mesh_lib
  on, tc = enabled_stages(config), config.train
  devices, processes = jax.device_count(), jax.process_count()
  for stage, field, size in (("sft", "train.batch_size", tc.batch_size),
                             ("cft", "cft.batch_size" if config.get("cft", {}).get("batch_size", 0)
                              else "train.batch_size",
                              config.get("cft", {}).get("batch_size", 0) or tc.batch_size)):
    if stage in on:
      mesh_lib.check_batch_size(int(size), tc.mesh, devices, processes, field, int(tc.grad_accum_steps))
  for sec in ("teacher_rl", "opd", "rl"):
    if sec in on and sec in config and int(config[sec].prompts_per_step) % processes:
      raise ValueError(f"{sec}.prompts_per_step ({config[sec].prompts_per_step}) must be divisible by the "
                       f"process count ({processes})")


BUILT_TIMES = os.path.join("results", "stage_built_times.json")


def _read_built(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):  # none yet, or unreadable: times are a record, not an input
    return {}


def _done_stamp(workdir: str, stage: str):
  """When the stage was last built: its DONE.json's mtime (the ladder: its newest row's)."""
  d = common.stage_dir(workdir, stage)
  files = [os.path.join(d, "DONE.json")]
  if stage == "eval" and os.path.isdir(d):
    files += [os.path.join(d, m, "DONE.json") for m in sorted(os.listdir(d))]
  stamps = [os.path.getmtime(f) for f in files if os.path.exists(f)]
  return max(stamps) if stamps else None


def run_timed(stage: str, fn, config, workdir: str):
  """`fn(config, workdir)`; when it (re)built `stage` (its DONE.json changed; the ladder: any
  row's), the wall-clock goes to `workdir/results/stage_built_times.json` ({stage: {seconds,
  config_hash}})."""
  from dgr2_jax import multihost
  before = _done_stamp(workdir, stage)
  t0 = time.perf_counter()
  out = fn(config, workdir)
  seconds = round(time.perf_counter() - t0, 1)
  after = _done_stamp(workdir, stage)
  if workdir and multihost.is_writer() and after != before:
    path = os.path.join(workdir, BUILT_TIMES)
    built = _read_built(path)
    done = common.read_done(common.stage_dir(workdir, stage)) or {}
    built[stage] = {"seconds": seconds, "config_hash": done.get("config_hash")}
    common.write_json_atomic(path, built)
  return out


def built_times(workdir: str, stages) -> dict:
  """{stage: seconds of the run that built it as it now stands} for the stages recorded with
  their current config hash (the ladder, which has none of its own: its last build)."""
  path = os.path.join(workdir, BUILT_TIMES)
  built = _read_built(path)
  out = {}
  for s in stages:
    b = built.get(s)
    done = common.read_done(common.stage_dir(workdir, s)) or {}
    if b and (s == "eval" or b.get("config_hash") == done.get("config_hash")):
      out[s] = b["seconds"]
  return out


def run(config, workdir: str) -> dict:
  """Runs the enabled stages in order; returns {stage: its return value}."""
  out, times = {}, {}
  stages = enabled_stages(config)
  check_batch_sizes(config)
  for i, s in enumerate(stages):
    print(f"pipeline: [{i + 1}/{len(stages)}] {s}", flush=True)
    t0 = time.perf_counter()
    out[s] = run_timed(s, run_ladder if s == "eval" else stage_fn(s), config, workdir)
    times[s] = round(time.perf_counter() - t0, 1)
    print(f"pipeline: {s} took {times[s]:.0f} s", flush=True)
    # This run's wall-clock per stage (a fresh stage that was skipped shows ~0 s), and the
    # wall-clock of the runs that built the stages as they stand.
    built = built_times(workdir, stages)
    common.write_json_atomic(os.path.join(workdir, "results", "stage_times.json"),
                             {"seconds": times, "total": round(sum(times.values()), 1),
                              "built": built, "built_total": round(sum(built.values()), 1)})
  return out
