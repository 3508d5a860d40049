"""The whole pipeline at toy size through the command line, then a re-run that skips every stage."""

import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY = [
    "--config.data.synthetic.num_users=60", "--config.data.synthetic.num_items=40",
    "--config.sids.num_steps=30", "--config.sids.codebook_size=16", "--config.retriever.num_epochs=2",
    "--config.model.hidden_size=32", "--config.model.intermediate_size=64",
    "--config.model.num_hidden_layers=1", "--config.model.head_dim=8",
    "--config.train.total_steps=2", "--config.train.batch_size=4", "--config.train.checkpoint_every=1",
    "--config.cft.steps=2", "--config.opd.steps=1", "--config.opd.prompts_per_step=2",
    "--config.opd.rollouts_per_prompt=2", "--config.rl.steps=1", "--config.rl.prompts_per_step=2",
    "--config.rl.group_size=2", "--config.eval.max_examples=4", "--config.eval.batch_size=4",
    "--config.bench.max_examples=4", "--config.bench.thresholds=(1.0,0.5)",
]


def _main(workdir, timeout):
  env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
  cmd = [sys.executable, "-m", "dgr2_jax.main", "--config=configs/demo.py", f"--workdir={workdir}"] + TOY
  t0 = time.time()
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return time.time() - t0


def test_toy_pipeline_end_to_end(tmp_path):
  workdir = str(tmp_path / "wd")
  _main(workdir, timeout=1500)
  res = os.path.join(workdir, "results")
  acc = json.load(open(os.path.join(res, "accuracy.json")))
  assert isinstance(acc, list)
  rows = acc
  methods = [r["method"] for r in rows]
  assert methods == ["pre_rank", "ar", "naive", "cft", "cft_opd", "cft_opd_rl"], methods
  for r in rows:
    for k in ("recall@1", "recall@3", "ndcg@3", "valid_rate", "n"):
      assert k in r, (r["method"], k)
    assert 0.0 <= r["recall@1"] <= r["recall@3"] <= 1.0
  front = json.load(open(os.path.join(res, "frontier.json")))
  assert isinstance(front, list)
  frows = front
  assert {(r["block_size"], r["threshold"]) for r in frows} >= {(1, 1.0), (32, 1.0), (32, 0.5)}
  for r in frows:
    for k in ("recall@1", "valid_rate", "tokens_per_s", "nfe_per_seq", "speedup"):
      assert k in r
    assert r["tokens_per_s"] > 0 and r["nfe_per_seq"] > 0
  for f in ("accuracy.md", "frontier.md", "frontier.png"):
    assert os.path.getsize(os.path.join(res, f)) > 0
  # Re-running finds every stage fresh and does no work.
  assert _main(workdir, timeout=300) < 60
  # The quality-figures script on the same workdir: pipeline fresh, then held-out evals and KL.
  env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
  cmd = [sys.executable, "benchmarks/recipe_figures.py", "--config=configs/demo.py",
         f"--workdir={workdir}", "--max_examples=4", "--kl_prompts=4"] + TOY
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  for method in ("ar", "naive", "cft", "cft_opd", "cft_opd_rl"):
    assert f"| {method} | " in out, out
  for stage in ("cft", "opd", "rl"):
    assert f"held-out on-policy, {stage} model: KL to teacher" in out, out
  checks = [l for l in out.splitlines() if l.strip().startswith(("[PASS]", "[FAIL]"))]
  assert len(checks) == 8, out
  for split_dir in ("ar-valid", "cft_opd_rl-valid"):
    assert os.path.exists(os.path.join(workdir, "eval", split_dir, "metrics.json"))
