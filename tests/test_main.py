"""The command line: config presets and variants, validation errors naming the field, dispatch,
the dry-run plan (against a hand count of Qwen3-8B's parameters), the ladder and the results
tables."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dgr2_jax import main as main_lib
from dgr2_jax import results
from dgr2_jax.stages import bench as bench_stage
from dgr2_jax.stages import common
from dgr2_jax.stages import pipeline
from dgr2_jax.train import dry_run as dry

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = ("demo.py", "beauty_cpu.py", "beauty_qwen3_0p6b.py", "beauty_qwen3_8b.py", "generate.py")


def load_config(name: str, arg: str = ""):
  path = os.path.join(REPO_ROOT, "configs", name)
  spec = importlib.util.spec_from_file_location(f"cfg_{name[:-3]}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


@pytest.mark.parametrize("name", PRESETS)
def test_presets_load_and_have_valid_values(name):
  c = load_config(name)
  assert c.stage in main_lib.STAGES
  if name == "generate.py":
    return
  assert set(c.pipeline.stages) <= set(main_lib.STAGES)
  for section in ("data", "sids", "retriever", "task", "eval", "train", "model", "decode", "cft",
                  "opd", "rl", "bench", "pipeline", "hardware"):
    assert section in c, section


def test_demo_validates_and_real_data_presets_need_their_paths(tmp_path):
  main_lib.validate(load_config("demo.py"), str(tmp_path))
  with pytest.raises(ValueError, match=r"config\.data\.dir: is required"):
    main_lib.validate(load_config("beauty_cpu.py"), str(tmp_path))
  c = load_config("beauty_cpu.py")
  c.data.dir = str(tmp_path / "absent")
  with pytest.raises(FileNotFoundError, match=r"config\.data\.dir: .*absent"):
    main_lib.validate(c, str(tmp_path))
  c = load_config("beauty_qwen3_8b.py")
  c.data.dir = str(tmp_path)
  c.model.init_from = str(tmp_path / "no_model")
  # task.tokenizer follows model.init_from (a field reference): the first missing path is named.
  assert c.task.tokenizer == c.model.init_from
  with pytest.raises(FileNotFoundError, match=r"config\.task\.tokenizer"):
    main_lib.validate(c, str(tmp_path))


def test_paper_hyper_parameters():
  for name in ("beauty_qwen3_0p6b.py", "beauty_qwen3_8b.py"):
    c = load_config(name)
    assert (c.decode.block_size, c.cft.block_size, c.cft.epochs) == (32, 32, 3)
    assert (c.opd.rollouts_per_prompt, c.opd.lr, c.opd.prompts_per_step) == (4, 1e-6, 128)
    assert (c.rl.group_size, c.rl.lr, c.rl.steps, c.rl.alpha, c.rl.clip_eps) == (8, 5e-7, 600,
                                                                                 0.2, 0.2)
    assert c.hardware.num_devices == 8 and c.hardware.device_memory_gb == 80.0


@pytest.mark.parametrize("overrides,field,exc", [
    ({"stage": "bogus"}, "config.stage", ValueError),
    ({"decode.max_new_tokens": 100}, "config.decode.max_new_tokens", ValueError),
    ({"decode.block_size": 0}, "config.decode.block_size", ValueError),
    ({"decode.threshold": 0.0}, "config.decode.threshold", ValueError),
    ({"decode.threshold": 1.5}, "config.decode.threshold", ValueError),
    ({"decode.top_p": 0.0}, "config.decode.top_p", ValueError),
    ({"decode.steps_per_block": -1}, "config.decode.steps_per_block", ValueError),
    ({"decode.steps_per_sync": 0}, "config.decode.steps_per_sync", ValueError),
    ({"decode.verify_every": -1}, "config.decode.verify_every", ValueError),
    ({"decode.verify_every": 3}, "config.decode.verify_every", ValueError),
    ({"data.source": "movielens"}, "config.data.source", ValueError),
    ({"sids.encoder": "bert"}, "config.sids.encoder", ValueError),
    ({"sids.encoder": "npy"}, "config.sids.embeddings_npy", ValueError),
    ({"retriever.source": "file"}, "config.retriever.candidates_file", ValueError),
    ({"task.splits": ("train", "dev")}, "config.task.splits", ValueError),
    ({"task.response_len": 250, "task.answer_block": 0}, "config.task.response_len", ValueError),
    ({"task.answer_block": 24}, "config.task.answer_block", ValueError),
    ({"task.answer_ids": "index"}, "config.task.answer_ids", ValueError),
    ({"task.prompt_variant": "compact"}, "config.task.mark_relations", ValueError),
    ({"task.prompt_variant": "compact", "task.mark_relations": False}, "config.task.answer_ids", ValueError),
    ({"cft.loss_weighting": "1/t^2"}, "config.cft.loss_weighting", ValueError),
    ({"cft.block_size": 0}, "config.cft.block_size", ValueError),
    ({"train.batch_size": 7, "train.grad_accum_steps": 2}, "config.train.batch_size", ValueError),
    ({"train.mesh.data": -1, "train.mesh.fsdp": -1}, "config.train.mesh", ValueError),
    ({"model.num_key_value_heads": 3}, "config.model.num_key_value_heads", ValueError),
    ({"model.dtype": "int8"}, "config.model.dtype", ValueError),
    ({"model.attention_k_splits": -1}, "config.model.attention_k_splits", ValueError),
    ({"model.init_from": "/nonexistent/model"}, "config.model.init_from", FileNotFoundError),
    ({"pipeline.stages": ("data", "cft", "sft")}, "config.pipeline.stages", ValueError),
    ({"pipeline.stages": ("data", "generate")}, "config.pipeline.stages", ValueError),
    ({"pipeline.ladder_threshold": 1.5}, "config.pipeline.ladder_threshold", ValueError),
    ({"pipeline.ladder_steps_per_block": -2}, "config.pipeline.ladder_steps_per_block", ValueError),
    ({"rl.group_size": 1}, "config.rl.group_size", ValueError),
    ({"rl.clip_eps": 0.0}, "config.rl.clip_eps", ValueError),
    ({"opd.teacher": "gpt"}, "config.opd.teacher", ValueError),
    ({"opd.student_context": "future"}, "config.opd.student_context", ValueError),
    ({"opd.teacher": "self_tau1", "opd.student_context": "prefix"}, "config.opd.student_context", ValueError),
    ({"opd.init_from": "/nonexistent"}, "config.opd.init_from", FileNotFoundError),
    ({"bench.thresholds": (0.9, 1.5)}, "config.bench.thresholds", ValueError),
    ({"bench.block_sizes": (32, 40)}, "config.bench.block_sizes", ValueError),
    ({"bench.timing_rounds": 0}, "config.bench.timing_rounds", ValueError),
    ({"bench.timing_batches": -1}, "config.bench.timing_batches", ValueError),
    ({"stage": "eval"}, "config.eval.model_dir", ValueError),
    ({"stage": "eval", "eval.model_dir": "/nonexistent"}, "config.eval.model_dir",
     FileNotFoundError),
    ({"eval.split": "dev"}, "config.eval.split", ValueError),
])
def test_validation_names_the_field(tmp_path, monkeypatch, overrides, field, exc):
  # A case that validation lets through must fail here, not run the demo pipeline.
  monkeypatch.setattr(main_lib, "stage_fn", lambda name: pytest.fail(f"{overrides} passed validation"))
  c = load_config("demo.py")
  for k, v in overrides.items():
    node = c
    *path, last = k.split(".")
    for p in path:
      node = node[p]
    node[last] = v
  with pytest.raises(exc, match=rf"{field.replace('.', chr(92) + '.')}\b"):
    main_lib.run(c, str(tmp_path / "work"))
  assert not (tmp_path / "work").exists()  # nothing was done


def test_workdir_required_and_unknown_stage_module(tmp_path, monkeypatch):
  with pytest.raises(ValueError, match="--workdir is required"):
    main_lib.validate(load_config("demo.py"), None)
  monkeypatch.setitem(pipeline.STAGES, "absent", "dgr2_jax.stages._absent_stage")
  with pytest.raises(NotImplementedError, match="stage 'absent' is not available"):
    main_lib.stage_fn("absent")
  with pytest.raises(ValueError, match="config.stage 'nope' is not a stage"):
    main_lib.stage_fn("nope")
  assert main_lib.stage_fn("generate").__module__ == "dgr2_jax.stages.generate"
  # A pipeline naming an absent stage fails before running any stage.
  c = load_config("demo.py")
  c.pipeline.stages = ("data", "sids")
  monkeypatch.setitem(pipeline.STAGES, "sids", "dgr2_jax.stages._absent_stage")
  with pytest.raises(NotImplementedError, match=r"\['sids'\] are not available"):
    main_lib.run(c, str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()
  # A stage asked for alone, with an optional stage this checkout lacks dropped from the pipeline:
  # its prerequisites skip the absent one instead of importing it.
  from dgr2_jax.stages import registry
  c = load_config("demo.py")
  c.pipeline.stages = tuple(s for s in c.pipeline.stages if s != "teacher_rl")
  monkeypatch.setitem(registry.STAGES, "teacher_rl", "dgr2_jax.stages._absent_stage")
  assert registry.prerequisites(c, "cft") == ["data", "sids", "retriever", "traces", "sft", "convert"]


def test_known_values_match_the_packages():
  from dgr2_jax.decode import sampler, speculative
  from dgr2_jax.model import attention
  from dgr2_jax.model import config as model_config
  from dgr2_jax.train import cft, opd
  assert set(main_lib.LOSS_WEIGHTINGS) == set(cft.WEIGHTINGS)
  assert set(main_lib.OPD_TEACHERS) == set(opd.TEACHERS)
  assert set(main_lib.OPD_STUDENT_CONTEXTS) == set(opd.STUDENT_CONTEXTS)
  assert set(main_lib.OPD_TEACHER_CACHES) == set(opd.TEACHER_CACHES)
  assert set(main_lib.DECODE_MODES) == set(speculative.MODES)
  assert set(main_lib.KV_WRITES) == set(sampler.KV_WRITES)
  assert set(main_lib.ATTENTION_IMPLS) == set(attention.IMPLS) == set(model_config.ATTENTION_IMPLS)


def test_variants():
  full = load_config("demo.py")
  assert full.pipeline.stages == pipeline.ORDER
  assert "cft" not in load_config("demo.py", "no_cft").pipeline.stages
  c = load_config("demo.py", "cft_only,block8,weight_none")
  assert "opd" not in c.pipeline.stages and "rl" not in c.pipeline.stages
  assert (c.cft.block_size, c.decode.block_size, tuple(c.bench.block_sizes)) == (8, 8, (8,))
  assert c.cft.loss_weighting == "none"
  with pytest.raises(ValueError, match="unknown config preset 'block7'"):
    load_config("demo.py", "block7")
  methods = lambda arg: [m for m, _ in pipeline.ladder_methods(load_config("demo.py", arg))]
  # Both AR references (SFT, SFT + RL: the teacher), the diffusion chain, and the speculative row.
  assert methods("") == ["ar_sft", "ar", "naive", "cft", "cft_opd", "cft_opd_rl", "speculative"]
  assert methods("rl_no_opd") == ["ar_sft", "ar", "naive", "cft", "cft_rl", "speculative"]
  assert methods("no_cft") == ["ar_sft", "ar", "naive", "opd", "opd_rl", "speculative"]
  assert methods("opd_no_rl,no_teacher_rl") == ["ar", "naive", "cft", "cft_opd", "speculative"]
  assert pipeline.ladder_methods(load_config("demo.py", "no_teacher_rl"))[0] == ("ar", "sft")
  assert pipeline.ladder_methods(load_config("demo.py"))[1] == ("ar", "teacher_rl")
  assert pipeline.ladder_methods(load_config("demo.py"))[-1] == ("speculative", "rl")
  assert pipeline.previous_model_stage(load_config("demo.py", "rl_no_opd"), "rl") == "cft"
  assert pipeline.previous_model_stage(load_config("demo.py", "no_cft"), "opd") == "convert"
  assert pipeline.previous_model_stage(load_config("demo.py"), "convert") == "teacher_rl"
  assert pipeline.previous_model_stage(load_config("demo.py", "no_teacher_rl"), "convert") == "sft"
  assert pipeline.teacher_stage(load_config("demo.py")) == "teacher_rl"
  assert pipeline.teacher_stage(load_config("demo.py", "no_teacher_rl")) == "sft"
  assert pipeline.final_model_stage(load_config("demo.py", "cft_only")) == "cft"


def test_command_line(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  run = lambda *a: subprocess.run([sys.executable, "-m", "dgr2_jax.main", *a], cwd=REPO_ROOT,
                                  env=env, capture_output=True, text=True, timeout=120)
  r = run("--config=configs/demo.py:block16", "--config.stage=eval",
          "--config.decode.max_new_tokens=40", f"--workdir={tmp_path}")
  assert r.returncode != 0
  assert "config.decode.max_new_tokens: (40) must be a multiple of decode.block_size (16)" in r.stderr
  r = run("--config=configs/beauty_qwen3_8b.py", "--config.dry_run=True")
  assert r.returncode == 0, r.stderr
  assert "mesh over 8 devices: data=1 x fsdp=8 x tensor=1" in r.stdout
  assert "fits" in r.stdout


def qwen3_param_count(v, h, i, n_layers, heads, kv, hd, tied):
  """Hand count from the Qwen3 architecture (not from our model code)."""
  attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 2 * hd  # q,k,v,o + q/k norms
  layer = attn + 3 * h * i + 2 * h
  return v * h * (1 if tied else 2) + n_layers * layer + h


def test_dry_run_plan_for_8_gpus():
  c = load_config("beauty_qwen3_8b.py")
  p = dry.plan(c)
  n = qwen3_param_count(151936, 4096, 12288, 36, 32, 8, 128, tied=False)
  assert p["num_params"] == n and 8.1e9 < n < 8.3e9  # Qwen3-8B: 8.2 B
  assert p["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1} and p["num_devices"] == 8
  pd = p["per_device_bytes"]
  # f32 master weights, fully sharded over fsdp=8 (every big matrix has a dim divisible by 8;
  # the norm scales are replicated).
  norms = 36 * (2 * 4096 + 2 * 128) + 4096
  assert pd["params"] == 4 * ((n - norms) // 8 + norms)
  assert pd["gradients"] == pd["params"]
  assert abs(pd["optimizer"] - 2 * pd["params"]) < 1024  # Adam mu + nu (+ counters)
  stages = {r["stage"]: r for r in p["stages"]}
  assert set(stages) == {"sft", "teacher_rl", "cft", "opd", "rl"}
  assert all(r["activations"] > 0 and r["logits"] > 0 for r in stages.values())
  assert stages["opd"]["teacher_cache"] == 0 and pd["total_train"] < 80e9 and p["fits"]
  assert stages["cft"]["sequence"] == 2560 + 2 * 512 and stages["opd"]["rows_per_device"] == 4
  text = dry.format_plan(p)
  assert "mesh over 8 devices" in text and "fits" in text and "teacher cache" in text
  # The paper's OPD step with the full-vocabulary teacher cache and no accumulation does not fit:
  # 64 rollouts a device x 512 tokens x 4V bytes of cache, and 64 rows of activations.
  c2 = load_config("beauty_qwen3_8b.py")
  c2.opd.teacher_cache, c2.opd.grad_accum_steps = "full", 1
  q = dry.plan(c2)
  opd2 = next(r for r in q["stages"] if r["stage"] == "opd")
  assert opd2["teacher_cache"] == 64 * 512 * 4 * 151936 and not q["fits"]
  # A mesh that does not divide the device count fails naming train.mesh.
  c.train.mesh.fsdp = 3
  with pytest.raises(ValueError, match="train.mesh"):
    dry.plan(c)


ACC_ROWS = [
    {"method": "pre_rank", "recall@1": 0.2, "valid_rate": 1.0, "n": 10},
    {"method": "ar", "recall@1": 0.5, "recall@3": 0.8, "valid_rate": 1.0, "mean_nfe": 120.0,
     "n": 10},
    {"method": "naive", "recall@1": 0.1, "valid_rate": 0.3, "mean_nfe": 20.5, "n": 10},
]


def test_results_tables_render(tmp_path):
  m = results.meta("abc123")
  assert m["versions"]["jax"] and m["machine"]["cpu_count"]
  results.write_accuracy(str(tmp_path), ACC_ROWS, m)
  md = (tmp_path / "accuracy.md").read_text()
  assert "config hash `abc123`" in md
  assert "| ar | 0.5000 | 0.8000 | - |" in md and "| naive | 0.1000 |" in md
  assert md.count("\n|") == 2 + len(ACC_ROWS) - 1 + 1
  obj = json.loads((tmp_path / "accuracy.json").read_text())
  assert isinstance(obj, list) and [r["method"] for r in obj] == ["pre_rank", "ar", "naive"]
  run = obj[0]["run"]
  assert run["config_hash"] == "abc123" and "machine" in run and "versions" in run
  rows = bench_stage.add_speedups([
      {"block_size": 1, "threshold": 1.0, "recall@1": 0.5, "valid_rate": 1.0,
       "tokens_per_s": 100.0, "nfe_per_seq": 120.0},
      {"block_size": 32, "threshold": 0.9, "recall@1": 0.45, "valid_rate": 0.9,
       "tokens_per_s": 250.0, "nfe_per_seq": 40.0},
      {"block_size": 32, "threshold": 0.4, "recall@1": 0.3, "valid_rate": 0.6,
       "tokens_per_s": 400.0, "nfe_per_seq": 15.0}])
  assert [r["speedup"] for r in rows] == [1.0, 2.5, 4.0]
  assert [r["nfe_speedup"] for r in rows] == [1.0, 3.0, 8.0]
  results.write_frontier(str(tmp_path), rows, m)
  with open(tmp_path / "frontier.png", "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  fmd = (tmp_path / "frontier.md").read_text()
  assert "| 32 | 0.9000 | 0.4500 | 0.9000 | 250.0 | 40.0 | 2.5000 | 3.0000 |" in fmd
  with pytest.raises(ValueError, match="without 'speedup'"):
    results.write_frontier(str(tmp_path), [{"block_size": 1, "threshold": 1, "recall@1": 0}], m)
  assert sorted(p for p in os.listdir(tmp_path) if p.startswith(".")) == []


def test_ladder_reuses_the_rows_of_a_kept_starting_model(tmp_path, monkeypatch):
  """A stage that kept its step 0 holds its previous model's weights: the ladder reads that row
  from the earlier row of the same weights and decode settings (`same_as`), and decodes the rest."""
  workdir = str(tmp_path)
  c = load_config("demo.py")
  kept = {"sft": None, "teacher_rl": 0, "convert": None, "cft": None, "opd": 0, "rl": 0}
  for s, best in kept.items():
    with common.atomic_dir(os.path.join(workdir, s), f"h-{s}", {"best_step": best}) as tmp:
      os.makedirs(os.path.join(tmp, "model"))
  assert [pipeline.weights_stage(c, workdir, s) for s in kept] == ["sft", "sft", "convert", "cft", "cft", "cft"]
  with c.unlocked():
    c.opd.init_from = os.path.join(workdir, "cft", "model")   # an explicit start is not followed
  assert pipeline.weights_stage(c, workdir, "rl") == "opd"
  c = load_config("demo.py")
  calls = []

  def fake_eval(cfg, wd, same_as=None):
    calls.append((cfg.eval.name, same_as and os.path.basename(same_as)))
    out = os.path.join(wd, "eval", cfg.eval.name)
    with common.atomic_dir(out, "e-" + cfg.eval.name) as tmp:
      common.write_json_atomic(os.path.join(tmp, "metrics.json"), {"recall@1": 0.5, "valid_rate": 1.0, "n": 1})
      with open(os.path.join(tmp, "predictions.jsonl"), "w") as f:
        f.write(json.dumps({"example_id": 0, "history": [1], "candidates": [10, 11], "target_pos": 0,
                            "fallback": False, "ranking_items": [10, 11]}) + "\n")
    return out

  from dgr2_jax.stages import eval as eval_stage
  monkeypatch.setattr(eval_stage, "run", fake_eval)
  monkeypatch.setattr(pipeline, "rule_picks", lambda *a: {})
  pipeline.run_ladder(c, workdir)
  # The speculative row decodes (another decoder), though its drafter is CFT's weights too.
  assert calls == [("ar_sft", None), ("ar", "ar_sft"), ("naive", None), ("cft", None), ("cft_opd", "cft"),
                   ("cft_opd_rl", "cft"), ("speculative", None)]


def test_ladder_uses_each_model_and_ar_decoding(tmp_path, monkeypatch):
  """run_ladder with the eval stage replaced: which model/decode each row gets, and the table."""
  workdir = str(tmp_path)
  c = load_config("demo.py", "opd_no_rl")
  # The diffusion rows' tau and budget; AR rows decode at 1.0, the speculative row drafts at decode's.
  with c.unlocked():
    c.pipeline.ladder_threshold, c.decode.threshold = 0.7, 0.8
    c.pipeline.ladder_steps_per_block, c.decode.steps_per_block = 0, 8
  for s in ("sft", "teacher_rl", "convert", "cft"):  # opd not built: its rows are skipped
    with common.atomic_dir(os.path.join(workdir, s), f"h-{s}") as tmp:
      os.makedirs(os.path.join(tmp, "model"))
  seen = []
  # Predictions of four users (candidates 10, 11, 12; targets at #1, #2, #2, #3) and each row's
  # first picks (None: invalid, falls back to #1). The trace policy: same brand as the last
  # purchase (item 1, brand A) within the top 3 -> candidate 11, #2, for every user.
  targets = [0, 1, 1, 2]
  picks = {"ar_sft": [0, 0, 0, 0], "ar": [1, 1, 1, 1], "naive": [None] * 4, "cft": [0, 1, 2, 0]}
  os.makedirs(os.path.join(workdir, "traces"))
  common.write_json_atomic(os.path.join(workdir, "traces", "policy.json"),
                           {"policy": {"tiers": ["Same brand"], "reach": 3}})
  items = {1: {"brand": "A"}, 10: {"brand": "Y"}, 11: {"brand": "A"}, 12: {"brand": "Z"}}
  from dgr2_jax.data import api
  monkeypatch.setattr(api, "load_items", lambda wd: items)

  def fake_eval(cfg, wd, same_as=None):
    assert same_as is None   # no stage here kept its starting model
    seen.append((cfg.eval.name, cfg.eval.model_dir, cfg.decode.block_size, cfg.decode.mode, cfg.decode.threshold,
                 cfg.decode.steps_per_block, common.model_hash(cfg.eval.model_dir)))
    out = os.path.join(wd, "eval", cfg.eval.name)
    with common.atomic_dir(out, "e-" + cfg.eval.name) as tmp:
      common.write_json_atomic(os.path.join(tmp, "metrics.json"), {
          "recall@1": {"ar_sft": 0.45, "ar": 0.5, "naive": 0.1, "cft": 0.4}[cfg.eval.name], "valid_rate": 1.0,
          "n": 7, "decode": cfg.decode.to_dict(), "prerank_floor": {"recall@1": 0.2, "n": 7}})
      with open(os.path.join(tmp, "predictions.jsonl"), "w") as f:
        for u, (k, t) in enumerate(zip(picks[cfg.eval.name], targets)):
          order = None if k is None else [10 + k] + [10 + j for j in range(3) if j != k]
          f.write(json.dumps({"example_id": u, "history": [1], "candidates": [10, 11, 12],
                              "target_pos": t, "fallback": k is None, "ranking_items": order}) + "\n")
    return out

  from dgr2_jax.stages import eval as eval_stage
  monkeypatch.setattr(eval_stage, "run", fake_eval)
  obj = pipeline.run_ladder(c, workdir)
  m = lambda s: os.path.join(workdir, s, "model")
  assert seen == [("ar_sft", m("sft"), 1, "threshold", 1.0, 8, "h-sft"),
                  ("ar", m("teacher_rl"), 1, "threshold", 1.0, 8, "h-teacher_rl"),
                  ("naive", m("convert"), 32, "threshold", 0.7, 0, "h-convert"),
                  ("cft", m("cft"), 32, "threshold", 0.7, 0, "h-cft")]
  # Beside the floor, the trace policy alone on the same users (#2 for all: targets #2 twice in four),
  # with the models' columns: its picks are the teacher's, so it ties with it.
  assert [(r["method"], r["recall@1"]) for r in obj] == [
      ("pre_rank", 0.2), ("rule_policy", 0.5), ("ar_sft", 0.45), ("ar", 0.5), ("naive", 0.1), ("cft", 0.4)]
  rule = obj[1]
  assert (rule["n"], rule["override_rate"], rule["policy_agreement"], rule["delta_teacher"]) == (4, 1.0, 1.0, 0.0)
  # The speculative row: the final diffusion model drafts, the AR teacher (teacher_rl) verifies.
  sc = pipeline.method_config(c, workdir, "speculative", "opd")
  assert (sc.decode.mode, sc.decode.verifier_dir, sc.decode.block_size, sc.decode.threshold,
          sc.decode.steps_per_block) == ("speculative", m("teacher_rl"), 32, 0.8, 8)
  default = load_config("demo.py", "opd_no_rl")   # ladder 0 and -1: the diffusion rows at decode's settings
  dc = pipeline.method_config(default, workdir, "cft", "cft").decode
  assert (dc.threshold, dc.steps_per_block) == (default.decode.threshold, default.decode.steps_per_block)
  assert os.path.exists(os.path.join(workdir, "results", "accuracy.md"))
  # The diagnostics of each row, by hand (floor on these users: #1 is the target once in four).
  d = {r["method"]: r for r in obj}
  assert (d["ar"]["override_rate"], d["ar"]["override_precision"],
          d["ar"]["top1_precision_on_overrides"], d["ar"]["policy_agreement"]) == (1.0, 0.5, 0.25, 1.0)
  assert d["ar"]["delta_floor"] == 0.25 and d["ar"]["delta_teacher"] is None
  assert (d["ar_sft"]["override_rate"], d["ar_sft"]["override_precision"]) == (0.0, None)
  assert d["naive"]["override_rate"] == 0.0 and d["naive"]["delta_teacher"] == -0.25
  assert (d["cft"]["override_rate"], d["cft"]["override_precision"], d["cft"]["policy_agreement"],
          d["cft"]["delta_floor"], d["cft"]["delta_teacher"]) == (0.5, 0.5, 0.25, 0.25, 0.0)
  lo, hi = d["cft"]["delta_floor_ci95"]
  assert lo <= 0.25 <= hi and d["cft"]["n_paired_teacher"] == 4
  md = open(os.path.join(workdir, "results", "accuracy.md")).read()
  assert "| pre_rank | 0.2000 |" in md and md.split("| pre_rank |")[1].split("\n")[0].endswith(
      "| - | - | - | - | - | - | - | - |")
  assert f"| 0.2500 | [{lo:+.4f}, {hi:+.4f}] | 0.0000 |" in md


def test_timed_generate_counts_tokens_like_generate_and_times_its_batches_again(tiny_lm):
  from dgr2_jax.decode import sampler
  cfg, params = tiny_lm
  prompts = [[3, 4, 5, 6], [7, 8]]
  dc = sampler.decode_config_for(cfg, block_size=4, threshold=0.5, max_new_tokens=16)
  timed, other = bench_stage.TimedGenerate(), bench_stage.TimedGenerate()
  import jax
  out = timed(cfg, params, prompts, dc, jax.random.PRNGKey(0), max_prompt_len=8)
  other(cfg, params, prompts[:1], dc, jax.random.PRNGKey(1), max_prompt_len=8)
  ref = sampler.generate(cfg, params, prompts, dc, jax.random.PRNGKey(0), max_prompt_len=8)
  assert out["output_ids"] == ref["output_ids"]
  np.testing.assert_array_equal(out["nfe"], ref["nfe"])
  assert timed.tokens == sum(len(x) for x in ref["output_ids"]) and timed.batches == 1
  assert timed.seconds == 0   # timed afterwards, side by side with the other rows
  # What is timed is the same decode again.
  np.testing.assert_array_equal(np.asarray(timed.calls[0]()["tokens"]), ref["tokens"])
  bench_stage.time_interleaved([timed, other], rounds=3)
  assert timed.seconds > 0 and other.seconds > 0
  row = bench_stage.timing({"decoder": "threshold"}, timed, 3)
  assert row["tokens_per_s"] == timed.tokens / timed.seconds and row["timing_rounds"] == 3
  assert row["timed_batches"] == 1
  # bench.timing_batches: only the first batches are timed, and tokens/s counts only theirs.
  second = timed(cfg, params, [[9, 10, 11]], dc, jax.random.PRNGKey(2), max_prompt_len=8)
  first_tokens = timed.call_tokens[0]
  assert timed.call_tokens == [first_tokens, len(second["output_ids"][0])]
  assert timed.tokens == sum(timed.call_tokens) > first_tokens
  bench_stage.time_interleaved([timed], rounds=1, max_batches=1)
  row = bench_stage.timing({}, timed, 1)
  assert (timed.timed_tokens, row["timed_batches"]) == (first_tokens, 1)
  assert row["tokens_per_s"] == first_tokens / timed.seconds
  bench_stage.time_interleaved([timed], rounds=1)
  assert (timed.timed_tokens, timed.timed_batches) == (timed.tokens, 2)
