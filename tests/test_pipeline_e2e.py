"""The whole pipeline at toy size through the command line, then a re-run that skips every stage."""

import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import jax
import numpy as np

from dgr2_jax.model import checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "--config=configs/demo.py:smoke"  # every stage at toy size (configs/demo.py `smoke`)


def _main(workdir, timeout):
  env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
  cmd = [sys.executable, "-m", "dgr2_jax.main", CONFIG, f"--workdir={workdir}"]
  t0 = time.time()
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return time.time() - t0


def test_toy_pipeline_end_to_end(smoke_workdir):
  workdir = smoke_workdir   # conftest.py: the same command as _main, run once per session
  res = os.path.join(workdir, "results")
  acc = json.load(open(os.path.join(res, "accuracy.json")))
  assert isinstance(acc, list)
  rows = acc
  methods = [r["method"] for r in rows]
  # The rule row: the trace policy the traces follow (task.trace_policy='fit'), on the same users.
  assert methods == ["pre_rank", "rule_policy", "ar_sft", "ar", "naive", "cft", "cft_opd", "cft_opd_rl",
                     "speculative"], methods
  for r in rows:
    for k in ("recall@1", "recall@3", "ndcg@3", "valid_rate", "n"):
      assert k in r, (r["method"], k)
    assert 0.0 <= r["recall@1"] <= r["recall@3"] <= 1.0
  by = {r["method"]: r for r in rows}
  for k in ("recall@1", "recall@3", "ndcg@3", "valid_rate", "unparseable_rate"):  # lossless
    assert by["speculative"][k] == by["ar"][k], k
  # The diagnostics: every model row has them (the floor none); the speculative row is the
  # teacher's output, so its difference to the teacher is exactly zero.
  assert "override_rate" not in by["pre_rank"]
  for r in rows[1:]:
    lo, hi = r["delta_floor_ci95"]
    assert lo <= r["delta_floor"] <= hi and 0.0 <= r["override_rate"] <= 1.0, r["method"]
    assert abs(r["recall@1"] - by["pre_rank"]["recall@1"] - r["delta_floor"]) < 1e-9, r["method"]
  assert by["speculative"]["delta_teacher"] == 0.0 and by["speculative"]["delta_teacher_ci95"] == [0.0, 0.0]
  assert by["ar"]["delta_teacher"] is None
  assert by["rule_policy"]["policy_agreement"] == 1.0 and by["rule_policy"]["valid_rate"] == 1.0
  # The on-policy stages' validation curves (smoke: a point every step) and the kept point: of the
  # points that beat the first by 2 paired standard errors, the highest Recall@1, then valid rate,
  # then the earliest step; else the first.
  for stage in ("teacher_rl", "opd", "rl"):
    done = json.load(open(os.path.join(workdir, stage, "DONE.json")))
    vc = json.load(open(os.path.join(workdir, stage, "valid_curve.json")))
    assert [c["step"] for c in vc["curve"]] == list(range(done["steps"] + 1)) and vc["kept"] == "best", vc
    # The bar: 2 standard errors, raised by Bonferroni over the later points (one-sided 2.5%).
    bar = max(2.0, statistics.NormalDist().inv_cdf(1 - 0.025 / max(len(vc["curve"]) - 1, 1)))
    assert abs(vc["keep_bar_se"] - bar) < 1e-9, (stage, vc)
    beat = [c for c in vc["curve"][1:] if 0 < c["valid_gain_over_start"] > bar * c["valid_gain_se"]]
    top = max(beat, key=lambda c: (c["valid_recall@1"], c["valid_valid_rate"], -c["step"])) if beat else vc["curve"][0]
    assert vc["best_step"] == done["best_step"] == top["step"], (stage, vc, done)
  # A stage that kept its starting point saved its starting model bit for bit, so the ladder reads
  # that row from the row of the same weights instead of decoding it again (pipeline.weights_stage).
  source = {"teacher_rl": ("sft", "ar_sft"), "opd": ("cft", "cft"), "rl": ("opd", "cft_opd")}
  for stage, method in (("teacher_rl", "ar"), ("opd", "cft_opd"), ("rl", "cft_opd_rl")):
    kept_start = json.load(open(os.path.join(workdir, stage, "DONE.json")))["best_step"] == 0
    metrics = json.load(open(os.path.join(workdir, "eval", method, "metrics.json")))
    if not kept_start:
      assert "same_weights_as" not in metrics, (stage, metrics)
      continue
    prev, _ = source[stage]
    mine, theirs = (checkpoint.load_model_dir(os.path.join(workdir, s, "model"))[1] for s in (stage, prev))
    assert jax.tree_util.tree_structure(mine) == jax.tree_util.tree_structure(theirs), stage
    for a, b in zip(jax.tree_util.tree_leaves(mine), jax.tree_util.tree_leaves(theirs)):
      assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)), stage
    twin = metrics["same_weights_as"]
    prev_kept = prev in source and json.load(open(os.path.join(workdir, prev, "DONE.json")))["best_step"] == 0
    expected = source[prev][1] if prev_kept else source[stage][1]   # the first row of these weights
    assert os.path.basename(twin) == expected, (stage, twin)
    decoded = json.load(open(os.path.join(twin, "metrics.json")))
    assert {k: v for k, v in metrics.items() if k not in ("model_dir", "same_weights_as")} == {
        k: v for k, v in decoded.items() if k != "model_dir"}, stage
  # The RL stages log the KL to their starting model on every step that updates (rl.log_kl_ref).
  for stage in ("teacher_rl", "rl"):
    recs = [json.loads(x) for x in open(os.path.join(workdir, stage, "train", "metrics.jsonl"))]
    assert recs and all(r["kl_ref"] >= 0.0 for r in recs if "loss" in r), (stage, recs)
  front = json.load(open(os.path.join(res, "frontier.json")))
  assert isinstance(front, list)
  frows = front
  assert {(r["decoder"], r["batch_size"], r["block_size"], r["threshold"]) for r in frows} >= {
      ("ar", b, 1, 1.0) for b in (1, 4)} | {("threshold", b, 32, t) for b in (1, 4) for t in (1.0, 0.5)} | {
      ("speculative", b, 32, t) for b in (1, 4) for t in (1.0, 0.5)}
  for r in frows:
    for k in ("recall@1", "valid_rate", "tokens_per_s", "nfe_per_seq", "speedup"):
      assert k in r
    assert r["tokens_per_s"] > 0 and r["nfe_per_seq"] > 0
    if r["decoder"] == "speculative":
      assert r["verifier_passes_per_seq"] >= 1 and r["accepted_per_pass"] >= 0
  for f in ("accuracy.md", "frontier.md", "frontier.png"):
    assert os.path.getsize(os.path.join(res, f)) > 0
  times = json.load(open(os.path.join(res, "stage_times.json")))
  assert list(times["seconds"]) == ["data", "sids", "retriever", "traces", "sft", "teacher_rl", "convert", "cft",
                                    "opd", "rl", "eval", "bench"], times
  assert times["seconds"]["sft"] > 0 and abs(times["total"] - sum(times["seconds"].values())) < 1.0
  # Built in this run: the build times are this run's times.
  assert list(times["built"]) == list(times["seconds"]), times
  assert all(abs(times["built"][s] - times["seconds"][s]) < 1.0 for s in times["seconds"]), times
  # Re-running finds every stage fresh and does no work; the build times stay those of the run
  # that built the stages.
  assert _main(workdir, timeout=300) < 60
  again = json.load(open(os.path.join(res, "stage_times.json")))
  assert again["built"]["sft"] == times["built"]["sft"] and again["seconds"]["sft"] < 30, again
  # A copied (or moved) workdir is as fresh as the original: paths inside it enter the stages'
  # cache keys relative to it.
  copy = workdir.rstrip("/") + "_copy"
  shutil.copytree(workdir, copy)
  try:
    assert _main(copy, timeout=300) < 60
    moved = json.load(open(os.path.join(copy, "results", "stage_times.json")))
    assert moved["built"] == times["built"], moved
  finally:
    shutil.rmtree(copy, ignore_errors=True)
  # The quality-figures script on the same workdir: pipeline fresh, then held-out evals and KL.
  env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
  cmd = [sys.executable, "benchmarks/recipe_figures.py", CONFIG, f"--workdir={workdir}", "--max_examples=4",
         "--kl_prompts=4", f"--plot={workdir}/figures/ladder_ci.png"]
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  for method in ("ar_sft", "ar", "naive", "cft", "cft_opd", "cft_opd_rl", "speculative"):
    assert f"| {method} | " in out, out
  for stage in ("cft", "opd", "rl"):
    assert f"held-out on-policy, {stage} model: KL to teacher" in out, out
  for stage in ("sft", "teacher_rl"):
    assert f"held-out on-policy, {stage} (AR) model: mean sampled reward" in out, out
  checks = [l for l in out.splitlines() if l.strip().startswith(("[PASS]", "[FAIL]"))]
  assert len(checks) == 12, out   # 11 of the recipe, one of the AR teacher against the floor
  assert "[PASS] speculative row equals the AR row" in out, out
  # An RL stage that kept its start is reported as such, not as a reward comparison of one model.
  for stage, label in (("teacher_rl", "teacher_rl kept the SFT model"), ("rl", "RL kept its starting model")):
    kept = json.load(open(os.path.join(workdir, stage, "DONE.json")))["best_step"] == 0
    assert (f"[PASS] {label}" in out) == kept, (stage, out)
  assert "| method | override rate | override precision |" in out, out
  assert "| speculative | " in out.split("Diagnostics")[1], out
  with open(os.path.join(workdir, "figures", "ladder_ci.png"), "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  for split_dir in ("ar-valid", "cft_opd_rl-valid"):
    assert os.path.exists(os.path.join(workdir, "eval", split_dir, "metrics.json"))


def test_natural_prompt_pool_leaves_out_inserted_targets(smoke_workdir):
  """`rl.prompt_pool='natural'`: the RL stages' prompts are the train users whose target the
  retriever listed itself; the users whose target `task.insert_target` put in the list are left out."""
  import importlib.util
  import numpy as np
  from dgr2_jax.stages import on_policy
  from dgr2_jax.task import traces as traces_lib
  spec = importlib.util.spec_from_file_location("demo_cfg", os.path.join(REPO, "configs", "demo.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config("smoke")
  every = on_policy.task_setup(config, smoke_workdir)
  natural = on_policy.task_setup(config, smoke_workdir, pool="natural")
  inserted = {r["example_id"] for r in traces_lib.read_jsonl(os.path.join(smoke_workdir, "traces", "train.jsonl"))
              if r["inserted"]}
  ids, kept = set(every["prompts"]["example_id"].tolist()), natural["prompts"]["example_id"].tolist()
  assert ids & inserted and ids - inserted   # the smoke run inserts some targets, not all
  assert sorted(kept) == sorted(ids - inserted) and len(kept) == len(set(kept))
  assert natural["counts"]["pool"] == {"natural": len(kept), "listed": len(ids)}
  order = [int(np.flatnonzero(every["prompts"]["example_id"] == i)[0]) for i in kept]
  assert order == sorted(order)   # the pool keeps the traces' order


def test_validation_in_calls_equals_one_call(smoke_workdir):
  """`valid_batch_size`: the validation curve's users decoded a few per call (the last call padded)
  give each user the hit one call of all of them gives, for the AR and the block-diffusion decoder."""
  import dataclasses
  import importlib.util
  from dgr2_jax.stages import on_policy
  spec = importlib.util.spec_from_file_location("demo_cfg", os.path.join(REPO, "configs", "demo.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config("smoke")
  task = on_policy.task_setup(config, smoke_workdir, "valid")
  users = len(task["prompts"]["prompt_ids"])
  assert users >= 3, users   # at least one full call of 2 and a padded one
  for stage in ("sft", "cft"):
    mc, params = on_policy.load_policy(config, os.path.join(smoke_workdir, stage, "model"))
    dc = on_policy.rollout_decode_config(config, task["tids"], mc, 0.0)
    if stage == "sft":
      dc = dataclasses.replace(dc, block_size=1, threshold=1.0)
    policy = mc.as_block_diffusion(dc.block_size, dc.mask_token_id)
    out = {}
    for per in (0, 2):
      rc = config.rl.copy_and_resolve_references()
      with rc.unlocked():
        rc.valid_every, rc.valid_prompts, rc.valid_batch_size = 1, users, per
      out[per] = on_policy.validator(config, smoke_workdir, rc, policy, dc)(params)
    assert len(out[0]["valid_hits"]) == users and out[2] == out[0], (stage, out)
