"""The recipe's quality figures on one workdir, from one script: each stage's valid rate, accuracy,
sampled reward and KL to the teacher on held-out prompts, and whether each stage did its job.

  python benchmarks/recipe_figures.py --config=configs/demo.py --workdir=/tmp/dgr2_demo \
      [--split=valid] [--max_examples=256] [--kl_prompts=64] [--plot=ladder_ci.png] [--config.x.y=...]

1. Runs the pipeline of `--config` in `--workdir` (finished stages are skipped, so after the demo
   this costs seconds), without the frontier benchmark.
2. Evaluates every model of the chain on `--split` (the training stages never read it): the AR
   teacher with AR decoding, the diffusion models with `config.decode` -> valid rate, Recall@1,
   pre-rank floor, mean reward (`train.grpo.reward`, alpha = `config.rl.alpha`), mean NFE.
3. On-policy figures on held-out prompts, for the CFT, OPD and RL models alike: each decodes
   `--kl_prompts` prompts of `--split` with the rollout decoder (`config.opd.rollouts_per_prompt`
   samples each at `config.opd.temperature`; the same PRNG keys for every model). The AR teacher
   scores them and KL(teacher || student) (`train.opd.token_kl`, OPD's per-token loss) is averaged
   over the committed tokens, on exact canvases in both student contexts ('replay', 'prefix';
   train/opd.py) of the same rollouts, with a paired bootstrap CI of the OPD change; and every
   sample gets its GRPO reward (`train.grpo.rewards`).
   "OPD lowers the KL" compares the OPD model with the CFT model; "RL raises the mean reward over
   its run" compares the RL model with the model it started from (OPD, or CFT under
   `rl_no_opd`): the expected reward of the sampling policy is what RL maximises. An RL stage
   that kept its start (`keep_best`: no later step beat it on validation by two paired standard
   errors; DONE.json's best_step 0) published that model, so its check says so instead. The training
   log's per-step reward is drawn on different prompts every step, so with the demo's 16 steps of
   16 rollouts its first-vs-last-quarter trend (printed too, from rl/train/metrics.jsonl) is
   mostly prompt noise.
4. The AR models (sft, teacher_rl) likewise: the mean reward of their own sampled rollouts of the
   same held-out prompts, which the teacher's RL maximises.
5. Every row's diagnostics, as in `results/accuracy.md` (task/diagnostics.py): override rate,
   override precision against #1's precision on the same users, agreement with the trace policy
   (when `traces/policy.json` exists), and paired bootstrap 95% CIs of the Recall@1 difference
   against the floor and against the AR teacher (`--plot`: both as a PNG).
Then prints the checks, each with its measured values.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app
from absl import flags
from ml_collections import config_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from dgr2_jax import fileio  # noqa: E402
from dgr2_jax import main as main_lib  # noqa: E402
from dgr2_jax.task import diagnostics  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", os.path.join(REPO, "configs", "demo.py"),
                                          "pipeline config file")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/dgr2_demo", "pipeline workdir")
_SPLIT = flags.DEFINE_enum("split", "valid", ["valid", "test"], "held-out split to score on")
_MAX = flags.DEFINE_integer("max_examples", 256, "examples of the split per model (0 = all)")
_PLOT = flags.DEFINE_string("plot", "", "PNG path for the ladder's Recall@1 differences against the "
                            "floor and the AR teacher with their 95% CIs ('' = no plot)")
_KL_PROMPTS = flags.DEFINE_integer("kl_prompts", 256, "held-out prompts for the on-policy KL and "
                                   "sampled reward (0 = skip)")


def ladder(config, workdir: str, split: str, max_examples: int) -> list[dict]:
  """Eval rows of every model of the chain on `split` (cached by the eval stage's own hash)."""
  from dgr2_jax.stages import eval as eval_stage
  from dgr2_jax.stages import pipeline
  from dgr2_jax.stages import traces as traces_stage
  from dgr2_jax.task import answer as answer_lib
  from dgr2_jax.task import traces as traces_lib
  from dgr2_jax.train import grpo
  alpha = float(config.rl.alpha) if "rl" in config else 0.2
  _, sids = traces_stage.load_items_sids(workdir)
  examples = {e["example_id"]: e for e in traces_lib.read_jsonl(
      os.path.join(workdir, "traces", f"{split}.jsonl"))}
  rows, preds = [], {}
  for method, stage in pipeline.ladder_methods(config):
    c = pipeline.method_config(config, workdir, method, stage)
    with c.unlocked():
      c.eval.split = split
      c.eval.name = f"{method}-{split}"
      c.eval.max_examples = max_examples
    out = eval_stage.run(c, workdir)
    with open(os.path.join(out, "metrics.json")) as f:
      m = json.load(f)
    preds[method] = traces_lib.read_jsonl(os.path.join(out, "predictions.jsonl"))
    cands = [examples[p["example_id"]]["candidates"] for p in preds[method]]
    parsed = [answer_lib.parse_response(p["output"], [sids[i] for i in c])
              for p, c in zip(preds[method], cands)]
    rew = grpo.rewards(parsed, [p["target_pos"] + 1 for p in preds[method]], len(cands[0]), alpha)
    rows.append(dict(method=method, valid_rate=m["valid_rate"], recall1=m["recall@1"],
                     floor=m["prerank_floor"]["recall@1"], reward=float(rew.mean()),
                     nfe=m["mean_nfe"], n=m["n"]))
  diag = pipeline.ladder_diagnostics(config, workdir, preds, split)   # the same columns as accuracy.md
  return [{**r, **diag[r["method"]]} for r in rows]


def print_diagnostics(rows: list[dict]) -> None:
  """The ladder's diagnostics (task/diagnostics.py) of `ladder`'s rows, '-' where none applies."""
  f = lambda v: "-" if v is None else f"{v:.4f}"
  ci = lambda d, c: "-" if d is None else f"{d:+.4f} [{c[0]:+.4f}, {c[1]:+.4f}]"
  print("\nDiagnostics (first pick against the retriever's #1; paired bootstrap 95% CIs):")
  print("| method | override rate | override precision | #1 precision on overrides | "
        "policy agreement | R@1 - floor [95% CI] | R@1 - AR teacher [95% CI] |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['method']} | {f(r['override_rate'])} | {f(r['override_precision'])} | "
          f"{f(r['top1_precision_on_overrides'])} | {f(r['policy_agreement'])} | "
          f"{ci(r['delta_floor'], r['delta_floor_ci95'])} | "
          f"{ci(r['delta_teacher'], r['delta_teacher_ci95'])} |")


def plot_deltas(rows: list[dict], path: str) -> None:
  """Two panels, one point per model with its paired bootstrap 95% CI: Recall@1 minus the floor,
  and minus the AR teacher (rows without the difference are left out of a panel)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(9, 0.45 * len(rows) + 1.5), sharey=True)
  names = [r["method"] for r in rows]
  for ax, key, title in zip(axes, ("delta_floor", "delta_teacher"),
                            ("Recall@1 - pre-rank floor", "Recall@1 - AR teacher")):
    for y, r in enumerate(rows):
      if r[key] is None:
        continue
      lo, hi = r[key + "_ci95"]
      ax.errorbar([r[key]], [y], xerr=[[r[key] - lo], [hi - r[key]]], fmt="o", color="k", capsize=3)
    ax.axvline(0.0, color="gray", lw=1, ls="--")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
  axes[0].set_yticks(range(len(names)), names)
  axes[0].invert_yaxis()
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  print(f"wrote {path}")


def heldout_on_policy(config, workdir: str, split: str, n_prompts: int) -> dict:
  """{stage: {'kl': {context: [n, 2] per-prompt (KL sum, token count)}, 'reward': mean}} of each
  diffusion model's own sampled rollouts of `n_prompts` held-out prompts (the same keys for every
  model); the KL to the AR teacher in both student contexts on the same rollouts."""
  import jax
  import numpy as np
  from dgr2_jax.stages import on_policy
  from dgr2_jax.stages import opd as opd_stage
  from dgr2_jax.stages import pipeline
  from dgr2_jax.train import opd
  oc = on_policy.section(config, "opd", opd.opd_config)
  with oc.unlocked():
    oc.replay_max_segments = 0   # exact canvases for both contexts ('prefix' needs one per token)
  task = on_policy.task_setup(config, workdir, split)
  prompts = {k: v[:n_prompts] for k, v in task["prompts"].items()}
  per, g = max(1, int(oc.prompts_per_step)), int(oc.rollouts_per_prompt)
  out = {}
  for stage in ("cft", "opd", "rl"):
    src = pipeline.model_dir(workdir, stage)
    if not os.path.isdir(src):
      continue
    d = opd_stage.distillation(config, oc, task, src, opd_stage.teacher_model_dir(config, oc, workdir))
    kl_fn = d.token_kl_fn
    kl = {c: [] for c in opd.STUDENT_CONTEXTS}
    rewards = []
    for i in range(0, len(prompts["prompt_ids"]), per):
      chunk = {k: v[i:i + per] for k, v in prompts.items()}
      if len(chunk["prompt_ids"]) < per:  # static shapes: the last partial chunk is dropped
        break
      roll, scored = d.sample(d.params, chunk, jax.random.PRNGKey(1000 + i))
      rewards.append(scored["rewards"])
      mask = roll["loss_mask"].reshape(per, g, -1)
      for c in opd.STUDENT_CONTEXTS:   # the same rollouts, scored in each context
        batch, _ = d.batch(roll, c)
        tok_kl = np.asarray(kl_fn(d.params, batch)[0]).reshape(per, g, -1)
        kl[c].append(np.stack([np.where(mask, tok_kl, 0.0).sum((1, 2)), mask.sum((1, 2))], 1))
    rewards = np.concatenate(rewards)
    rows = len(rewards)
    out[stage] = {"kl": {c: np.concatenate(v) for c, v in kl.items()}, "reward": float(rewards.mean())}
    kls = ", ".join(f"{c} {mean_kl(v):.4f}" for c, v in out[stage]["kl"].items())
    print(f"held-out on-policy, {stage} model: KL to teacher ({kls}; {oc.student_context} is OPD's "
          f"loss) over {int(out[stage]['kl'][oc.student_context][:, 1].sum())} tokens, mean sampled reward "
          f"{out[stage]['reward']:.4f} over {rows} rollouts", flush=True)
  return out


def heldout_ar_reward(config, workdir: str, split: str, n_prompts: int) -> dict:
  """{stage: mean reward} of the AR models' (sft, teacher_rl) own sampled rollouts (B = 1,
  `teacher_rl.temperature`, `teacher_rl.group_size` per prompt; the same keys for both) of
  `n_prompts` held-out prompts: the expected reward the teacher's RL maximises."""
  import dataclasses
  import jax
  import numpy as np
  from dgr2_jax.stages import on_policy
  from dgr2_jax.stages import pipeline
  from dgr2_jax.train import grpo, rollouts
  tc = on_policy.section(config, "teacher_rl", grpo.rl_config)
  task = on_policy.task_setup(config, workdir, split)
  prompts = {k: v[:n_prompts] for k, v in task["prompts"].items()}
  per, g = max(1, int(tc.prompts_per_step)), int(tc.group_size)
  out = {}
  for stage in ("sft", "teacher_rl"):
    src = pipeline.model_dir(workdir, stage)
    if not os.path.isdir(src):
      continue
    mc, params = on_policy.load_policy(config, src)
    dc = dataclasses.replace(on_policy.rollout_decode_config(config, task["tids"], mc, tc.temperature),
                             block_size=1, threshold=1.0)
    rewards = []
    for i in range(0, len(prompts["prompt_ids"]) - per + 1, per):
      chunk = {k: v[i:i + per] for k, v in prompts.items()}
      roll = rollouts.sample(mc.as_block_diffusion(1), params, chunk["prompt_ids"], chunk["prompt_len"], dc,
                             jax.random.PRNGKey(2000 + i), g)
      rewards.append(on_policy.score_rollouts(roll, chunk, g, task, float(tc.alpha))["rewards"])
    out[stage] = float(np.concatenate(rewards).mean())
    print(f"held-out on-policy, {stage} (AR) model: mean sampled reward {out[stage]:.4f} over "
          f"{sum(len(r) for r in rewards)} rollouts", flush=True)
  return out


def mean_kl(per_prompt) -> float:
  return float(per_prompt[:, 0].sum() / max(per_prompt[:, 1].sum(), 1.0))


def kept_start(workdir: str, stage: str) -> bool:
  """Whether an on-policy stage published its starting model (`keep_best` kept step 0)."""
  return (fileio.read_done(os.path.join(workdir, stage)) or {}).get("best_step", -1) == 0


def rl_reward_trend(workdir: str) -> tuple[float, float, int] | None:
  path = os.path.join(workdir, "rl", "train", "metrics.jsonl")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    r = [json.loads(line)["reward_mean"] for line in f if line.strip()]
  q = max(1, len(r) // 4)
  return sum(r[:q]) / q, sum(r[-q:]) / q, len(r)


def main(argv):
  del argv
  main_lib.quiet_logs(flags.FLAGS.verbosity if flags.FLAGS["verbosity"].present else -1)
  config, workdir = _CONFIG.value, _WORKDIR.value
  with config.unlocked():
    config.stage = "pipeline"
    config.pipeline.stages = tuple(s for s in config.pipeline.stages if s != "bench")
  main_lib.run(config, workdir)
  rows = ladder(config, workdir, _SPLIT.value, _MAX.value)
  print(f"\nModels on the {_SPLIT.value} split ({workdir}):")
  print("| method | valid_rate | recall@1 | pre-rank recall@1 | mean reward | mean NFE | n |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['method']} | {r['valid_rate']:.4f} | {r['recall1']:.4f} | {r['floor']:.4f} | "
          f"{r['reward']:.4f} | {r['nfe']:.1f} | {r['n']} |")
  print_diagnostics(rows)
  if _PLOT.value:
    plot_deltas(rows, _PLOT.value)
  by = {r["method"]: r for r in rows}
  onp = heldout_on_policy(config, workdir, _SPLIT.value, _KL_PROMPTS.value) if _KL_PROMPTS.value else {}
  ar_rew = heldout_ar_reward(config, workdir, _SPLIT.value, _KL_PROMPTS.value) if _KL_PROMPTS.value else {}
  trend = rl_reward_trend(workdir)

  checks = []
  kept = {st: kept_start(workdir, st) for st in ("teacher_rl", "rl")}
  if kept["teacher_rl"]:
    checks.append(("teacher_rl kept the SFT model (no later step beat it on validation)", True,
                   "best_step 0"))
  elif "sft" in ar_rew and "teacher_rl" in ar_rew:
    a, b = ar_rew["sft"], ar_rew["teacher_rl"]
    checks.append(("teacher_rl raises the AR model's held-out mean sampled reward (sft -> teacher_rl)",
                   b > a, f"{a:.4f} -> {b:.4f}"))
  if "ar_sft" in by and "ar" in by:
    a, b = by["ar_sft"]["recall1"], by["ar"]["recall1"]
    checks.append(("teacher_rl Recall@1 not below the SFT model's", b >= a, f"{a:.4f} -> {b:.4f}"))
  if "speculative" in by and "ar" in by:
    same = all(by["speculative"][k] == by["ar"][k] for k in ("valid_rate", "recall1", "reward"))
    checks.append(("speculative row equals the AR row (valid rate, Recall@1, reward)", same,
                   f"{by['speculative']['recall1']:.4f} vs {by['ar']['recall1']:.4f}"))
  if "ar" in by:
    ar = by["ar"]
    checks.append(("AR teacher valid rate > 0.95", ar["valid_rate"] > 0.95, f"{ar['valid_rate']:.4f}"))
    checks.append(("AR teacher Recall@1 > pre-rank floor", ar["recall1"] > ar["floor"],
                   f"{ar['recall1']:.4f} vs {ar['floor']:.4f}"))
    d, (lo, hi) = ar["delta_floor"], ar["delta_floor_ci95"]
    checks.append(("AR teacher Recall@1 at least 0.010 above the floor (paired 95% CI of the "
                   "difference)", d >= 0.010, f"{d:+.4f} [{lo:+.4f}, {hi:+.4f}]"))
    if "naive" in by:
      nv = by["naive"]
      checks.append(("naive conversion valid rate far below the teacher's (< half)",
                     nv["valid_rate"] < 0.5 * ar["valid_rate"], f"{nv['valid_rate']:.4f}"))
  if "cft" in by:
    checks.append(("CFT valid rate > 0.95", by["cft"]["valid_rate"] > 0.95,
                   f"{by['cft']['valid_rate']:.4f}"))
  if "cft" in onp and "opd" in onp:
    from dgr2_jax.stages import on_policy
    from dgr2_jax.train import opd
    ctx = on_policy.section(config, "opd", opd.opd_config).student_context
    a, b = onp["cft"]["kl"][ctx], onp["opd"]["kl"][ctx]
    lo, hi = diagnostics.paired_bootstrap_ci(a, b, stat=mean_kl)   # resampling prompts
    checks.append((f"OPD lowers held-out KL to the teacher (its loss, {ctx} context)",
                   mean_kl(b) < mean_kl(a),
                   f"{mean_kl(a):.4f} -> {mean_kl(b):.4f} (paired 95% CI of the change [{lo:+.4f}, {hi:+.4f}])"))
  if "cft" in by and "cft_opd" in by:
    a, b = by["cft"]["recall1"], by["cft_opd"]["recall1"]
    checks.append(("OPD does not lower Recall@1", b >= a, f"{a:.4f} -> {b:.4f}"))
  if trend is not None:
    print(f"RL training log, mean reward of the first vs last quarter of its {trend[2]} steps: "
          f"{trend[0]:.4f} -> {trend[1]:.4f}")
  start = "opd" if "opd" in onp else "cft"
  if kept["rl"]:
    checks.append((f"RL kept its starting model ({start}; no later step beat it on validation)", True,
                   "best_step 0"))
  elif "rl" in onp and start in onp:
    a, b = onp[start]["reward"], onp["rl"]["reward"]
    checks.append((f"RL raises the held-out mean reward of its sampled rollouts ({start} -> rl)",
                   b > a, f"{a:.4f} -> {b:.4f}"))
  diffusion = [r for r in rows if r["method"] not in ("ar", "ar_sft", "speculative")]
  last = diffusion[-1] if diffusion else None
  if last is not None and "ar" in by:
    gap = by["ar"]["recall1"] - last["recall1"]
    checks.append((f"final model ({last['method']}) within 0.01 Recall@1 of the AR teacher",
                   gap <= 0.01, f"{last['recall1']:.4f} vs {by['ar']['recall1']:.4f}"))
  print("\nChecks:")
  for name, ok, value in checks:
    print(f"  [{'PASS' if ok else 'FAIL'}] {name}: {value}")


if __name__ == "__main__":
  app.run(main)
