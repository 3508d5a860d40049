"""The recovery figure: what each stage after the conversion gets back, from a gap made on purpose.

  python benchmarks/recovery.py --config=configs/demo.py --workdir=/tmp/dgr2_demo \
      [--fractions=0.25,0.5,1.0] [--splits=valid,test] [--out=benchmarks/results/recovery_demo.json] \
      [--docs=docs/results.md]
  python benchmarks/recovery.py --render=benchmarks/results/recovery_demo.json --docs=docs/results.md

A machine whose CFT lands at the teacher shows nothing of OPD and RL. This script makes the gap:
for each fraction f of `cft.steps` it runs CFT for f x its steps, then OPD and RL from it exactly as
the preset runs them (validation, keep_best), in `WORKDIR/recovery/cft<f%>` (the data, the teacher
and the conversion copied from WORKDIR, so only CFT, OPD and RL run; f = 1 is WORKDIR's own chain,
built first when missing). Each model is then evaluated on each split against the AR teacher on
the same users (the pipeline's eval stage, cached by its hash), and per fraction it prints and
writes to `--out`:
  * gap: CFT's Recall@1 minus the teacher's, with its paired bootstrap 95% interval;
  * OPD: the Recall@1 OPD adds to CFT, and its share of the gap (the CI resamples users jointly);
  * RL: the Recall@1 RL adds to OPD, and the share of the gap CFT + OPD + RL closes; OPD's and
    RL's kept step (0 = kept its start).
`--docs` writes the table (with the commit, command and machine that produced it) between the
doc's `<!-- recovery-table:<name> -->` markers, name the config file's stem; `--render` rewrites
it from a recorded JSON without running anything.
"""

from __future__ import annotations

import os
import shutil
import sys

import numpy as np
from absl import app
from absl import flags
from ml_collections import config_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from dgr2_jax import fileio  # noqa: E402
from dgr2_jax import main as main_lib  # noqa: E402
from dgr2_jax import results  # noqa: E402
from dgr2_jax.task import diagnostics  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", os.path.join(REPO, "configs", "demo.py"), "pipeline config file")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/dgr2_demo", "the pipeline's workdir (its chain is the f = 1 row)")
_FRACTIONS = flags.DEFINE_list("fractions", ["0.25", "0.5", "1.0"], "fractions of cft.steps")
_SPLITS = flags.DEFINE_list("splits", ["valid", "test"], "held-out splits to evaluate on")
_MAX = flags.DEFINE_integer("max_examples", 0, "users per split (0 = every user whose target is listed)")
_OUT = flags.DEFINE_string("out", "", "JSON path for the figure ('' = print only)")
_DOCS = flags.DEFINE_string("docs", "", "a doc whose recovery table to rewrite ('' = none)")
_RENDER = flags.DEFINE_string("render", "", "a recorded JSON to render into --docs (runs nothing)")

UPSTREAM = ("data", "sids", "retriever", "traces", "sft", "teacher_rl", "convert")
ROWS = (("ar", "teacher_rl"), ("cft", "cft"), ("cft_opd", "opd"), ("cft_opd_rl", "rl"))


def fraction_workdir(workdir: str, f: float) -> str:
  """WORKDIR for f = 1, else WORKDIR/recovery/cft<f%> holding copies of the stages before CFT."""
  if f >= 1.0:
    return workdir
  out = os.path.join(workdir, "recovery", f"cft{int(round(100 * f))}")
  # The teacher's evaluations too (the same model and users: cached by their hash).
  evals = [os.path.join("eval", n) for n in (os.listdir(os.path.join(workdir, "eval"))
                                             if os.path.isdir(os.path.join(workdir, "eval")) else [])
           if n.startswith("ar-")]
  for s in UPSTREAM + tuple(evals):
    src, dst = os.path.join(workdir, s), os.path.join(out, s)
    if os.path.isdir(src) and not os.path.isdir(dst):
      shutil.copytree(src, dst + ".tmp", dirs_exist_ok=True)
      os.replace(dst + ".tmp", dst)
  return out


def run_chain(config, workdir: str, steps: int) -> None:
  """CFT for `steps` steps, then OPD and RL as configured (stages already built are fresh)."""
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.cft.steps = int(steps)
    c.stage = "pipeline"
    c.pipeline.stages = tuple(s for s in c.pipeline.stages if s not in ("eval", "bench"))
  main_lib.run(c, workdir)


def hits(config, workdir: str, split: str, max_examples: int) -> dict:
  """{row: {example_id: Recall@1 hit}} of the teacher and the chain's models on `split`."""
  from dgr2_jax.stages import eval as eval_stage
  from dgr2_jax.stages import pipeline
  from dgr2_jax.task import traces as traces_lib
  out = {}
  for method, stage in ROWS:
    if not os.path.isdir(pipeline.model_dir(workdir, stage)):
      stage = "sft" if method == "ar" else stage   # no teacher RL stage: the teacher is the SFT model
    c = pipeline.method_config(config, workdir, method, stage)
    with c.unlocked():
      c.eval.split, c.eval.name, c.eval.max_examples = split, f"{method}-{split}", int(max_examples)
    preds = traces_lib.read_jsonl(os.path.join(eval_stage.run(c, workdir), "predictions.jsonl"))
    out[method] = {p["example_id"]: int(p["rank"] == 1) for p in preds}
  return out


def share_ci(teacher, start, end, n_boot: int = diagnostics.N_BOOT, seed: int = diagnostics.SEED):
  """(end - start) / (teacher - start) of per-user hits and its 95% interval, resampling users
  jointly (None where a resample has no gap)."""
  t, s, e = (np.asarray(x, np.float64) for x in (teacher, start, end))
  gap = t.mean() - s.mean()
  point = float((e.mean() - s.mean()) / gap) if gap != 0 else None
  rs, vals = np.random.RandomState(seed), []
  for _ in range(n_boot):
    i = rs.randint(0, len(t), len(t))
    g = t[i].mean() - s[i].mean()
    if g != 0:
      vals.append((e[i].mean() - s[i].mean()) / g)
  lo, hi = (np.percentile(vals, [2.5, 97.5]) if vals else (np.nan, np.nan))
  return point, [float(lo), float(hi)]


def figure(h: dict) -> dict:
  """The gap, OPD's and RL's Recall@1 gains and shares of it, paired over the users all rows have."""
  ids = sorted(set.intersection(*(set(v) for v in h.values())))
  t, c, o, r = ([h[m][i] for i in ids] for m, _ in ROWS)
  d = lambda a, b: (float(np.mean(b) - np.mean(a)), list(diagnostics.paired_bootstrap_ci(a, b)))
  (gap, gap_ci), (opd, opd_ci), (rl, rl_ci) = d(t, c), d(c, o), d(o, r)
  # Shares of a gap only where CFT is below the teacher.
  opd_share, opd_share_ci = share_ci(t, c, o) if gap < 0 else (None, None)
  rl_share, rl_share_ci = share_ci(t, c, r) if gap < 0 else (None, None)
  return {"n": len(ids), "teacher": float(np.mean(t)), "cft": float(np.mean(c)), "opd": float(np.mean(o)),
          "rl": float(np.mean(r)), "gap": gap, "gap_ci95": gap_ci, "opd_gain": opd, "opd_gain_ci95": opd_ci,
          "opd_share": opd_share, "opd_share_ci95": opd_share_ci, "rl_gain": rl, "rl_gain_ci95": rl_ci,
          "rl_share": rl_share, "rl_share_ci95": rl_share_ci}


def kept_step(workdir: str, stage: str):
  done = fileio.read_done(os.path.join(workdir, stage)) if os.path.isdir(os.path.join(workdir, stage)) else None
  return None if done is None else done.get("best_step")


def measure(config, workdir: str) -> dict:
  """The figure's record: every fraction's chain built (or found fresh) and scored on each split;
  each row printed as it is done (an hour-long run)."""
  head = results.record_head("benchmarks/recovery.py")  # its commit: the code the run starts with
  rows = []
  for f in sorted((float(x) for x in _FRACTIONS.value), reverse=True):   # the full chain (and its teacher rows) first
    steps = max(1, int(round(f * int(config.cft.steps))))
    wd = fraction_workdir(workdir, f)
    print(f"recovery: CFT at {f:.0%} of its steps ({steps}) in {wd}", flush=True)
    run_chain(config, wd, steps)
    for split in _SPLITS.value:
      row = {"fraction": f, "cft_steps": steps, "split": split, "opd_kept_step": kept_step(wd, "opd"),
             "rl_kept_step": kept_step(wd, "rl"), **figure(hits(config, wd, split, _MAX.value))}
      rows.append(row)
      print(render([row]), flush=True)
  return {**head, "rows": rows}


def main(argv):
  del argv
  main_lib.quiet_logs(flags.FLAGS.verbosity if flags.FLAGS["verbosity"].present else -1)
  results.benchmark_main({"render": _RENDER, "out": _OUT, "docs": _DOCS},
                         lambda: measure(_CONFIG.value, _WORKDIR.value), lambda record: render(record["rows"]),
                         write_docs)


def write_docs(record: dict, doc: str, json_path: str) -> None:
  """`render(record's rows)` with a sentence naming the commit, command and machine, between the
  doc's `<!-- recovery-table:<name> -->` markers (`results.write_marked_table`)."""
  head = (f"{results.record_source(record, json_path)} Paired bootstrap 95% intervals over users; a share is of "
          f"the gap CFT leaves (where CFT is below the teacher).")
  results.write_marked_table(doc, "recovery", record.get("name", "demo"), f"{head}\n\n{render(record['rows'])}",
                             "recovery")


def render(rows: list[dict]) -> str:
  """The figure's rows as a Markdown table."""
  ci = lambda v, c: "-" if v is None else f"{v:+.4f} [{c[0]:+.4f}, {c[1]:+.4f}]"
  pc = lambda v, c: "-" if v is None else f"{v:.0%} [{c[0]:.0%}, {c[1]:.0%}]"
  lines = ["| CFT steps | split | n | teacher | CFT | gap CFT - teacher [95% CI] | OPD adds [95% CI] | "
           "OPD's share of the gap | OPD kept step | RL adds [95% CI] | share closed after RL | RL kept step |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['cft_steps']} ({r['fraction']:.0%}) | {r['split']} | {r['n']:,} | {r['teacher']:.4f} | "
                 f"{r['cft']:.4f} | {ci(r['gap'], r['gap_ci95'])} | {ci(r['opd_gain'], r['opd_gain_ci95'])} | "
                 f"{pc(r['opd_share'], r['opd_share_ci95'])} | {r['opd_kept_step']} | "
                 f"{ci(r['rl_gain'], r['rl_gain_ci95'])} | {pc(r['rl_share'], r['rl_share_ci95'])} | "
                 f"{r['rl_kept_step']} |")
  return "\n".join(lines)


if __name__ == "__main__":
  app.run(main)
