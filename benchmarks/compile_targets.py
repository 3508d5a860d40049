"""The paper configs' programs compiled for H100 / H200 GPUs and TPU slices, on no accelerator: the
table of docs/accelerators.md.

  pip install -e ".[aot]"
  python benchmarks/compile_targets.py                      # compile, write the JSON and the docs table
  python benchmarks/compile_targets.py --markdown_only      # the docs table again from the committed JSON
  python benchmarks/compile_targets.py --targets=v6e-8 --update   # one target again, the others kept
  python benchmarks/compile_targets.py --replan             # the plan and fits again (no compile)
  python benchmarks/compile_targets.py --configs=beauty_qwen3_0p6b --targets=h100x8 --verify='eval threshold'

For each config (configs/<name>.py, its model section's architecture) and target, every program a
run executes (the dry run's `hardware.compile_for`: dgr2_jax/aot/compile_run.py) is compiled. The
training steps (scanned layers: the same compile time at any depth) at the model's depth; the
decoders, whose layers are unrolled, at 2 and 3 layers, each per-device figure extrapolated linearly
to the model's depth (`--layers`). `--verify` compiles the programs it names at the model's depth
too and records how far the extrapolation is from them. Writes `--json_out` (the rows, the commit,
the jax version, the machine) and rewrites the table between the markers of `--docs`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

GIB = 2**30
NAMES = {"beauty_qwen3_8b": "Qwen3-8B", "beauty_qwen3_0p6b": "Qwen3-0.6B"}


def compile_all(args) -> dict:
  import jax
  from dgr2_jax import results
  from dgr2_jax.aot import compile_run, targets
  runs = []
  layers = tuple(int(x) for x in args.layers.split(",")) if args.layers else ()
  for name in args.configs.split(","):
    config = importlib.import_module(f"configs.{name}").get_config()
    for target in args.targets.split(","):
      t0 = time.time()
      t = targets.resolve(target)
      rows = compile_run.compile_programs(config, t, layers, progress=lambda line: print(line, flush=True),
                                          full_depth=("step",))
      run = dict(compile_run.report(config, rows, t), config=f"configs/{name}.py", model=NAMES.get(name, name),
                 layers=list(layers), wall_s=round(time.time() - t0, 1))
      if args.verify:
        run["full_depth"] = verify(config, t, rows, args.verify.split(","))
      runs.append(run)
      print(compile_run.format_table(rows), flush=True)
  return dict(git_commit=results.git_commit(), jax_version=jax.__version__, machine=results.machine_info(),
              runs=runs)


def verify(config, t, extrapolated: list, names: list) -> list:
  """The programs `names` compiled at the model's own depth beside the extrapolated figures."""
  from dgr2_jax.aot import compile_run
  full = compile_run.compile_programs(config, t, (), progress=lambda line: print(line, flush=True),
                                      only=tuple(names))
  by = {r["program"]: r for r in extrapolated}
  return [dict(program=r["program"], compiled=r["needed"], extrapolated=by[r["program"]]["needed"],
               error=round(by[r["program"]]["needed"] / r["needed"] - 1, 4)) for r in full]


def replan(data: dict) -> dict:
  """`data` with each row's plan (the dry run's, `compile_run.plan_bytes`) and its fit against the
  target's memory (`targets.CHIPS`) recomputed by this checkout: a change to either needs no
  compile. Records the commit in `plan_commit`."""
  from dgr2_jax import results
  from dgr2_jax.aot import compile_run, targets
  for run in data["runs"]:
    name = os.path.splitext(os.path.basename(run["config"]))[0]
    config = importlib.import_module(f"configs.{name}").get_config()
    t = targets.resolve(run["target"])
    run["device_memory"] = t.memory_bytes
    for row in run["programs"]:
      row["device_memory"] = t.memory_bytes
      if not row.get("refused"):
        row["fits"] = row["needed"] <= t.memory_bytes
      job = compile_run.Job(row["program"], row["stage"], row["kind"], build=None)
      row["plan"] = compile_run.plan_for_target(config, t, job)
      row["plan_over_needed"] = None if not row["plan"] or row["memory"]["peak"] is None else round(
          row["plan"] / max(row["needed"], 1), 4)
  data["plan_commit"] = results.git_commit()
  return data


# ---- the docs table -------------------------------------------------------------------------------
def _collectives(row: dict) -> str:
  short = {"all-gather": "all-gather", "all-reduce": "all-reduce", "reduce-scatter": "reduce-scatter",
           "all-to-all": "all-to-all", "collective-permute": "permute"}
  parts = [f"{short.get(op, op)} {c['count']}" + (f" ({c['in_loop']} in loop)" if c["in_loop"] else "")
           for op, c in sorted(row["collectives"].items())]
  return ", ".join(parts) or "none"


def _needed(row: dict) -> str:
  """GiB per device; '>= x' where the TPU compiler refused the program (what its temporaries alone need)."""
  return (">= " if row.get("refused") else "") + f"{row['needed'] / GIB:.1f}"


def markdown(data: dict) -> str:
  """A summary per model (GiB per device, fits or not, per target) and per (model, target) the
  programs' attention routes and collectives."""
  out = [f"Compiled at commit `{data['runs'][-1]['git_commit']}` with jax {data['jax_version']} on a "
         f"{data['machine'].get('cpu_count', '?')}-core CPU (`python benchmarks/compile_targets.py`; "
         "JSON: [benchmarks/results/compile_targets.json](../benchmarks/results/compile_targets.json)). "
         "GiB per device as XLA plans it (the rollouts: with the optimizer state and frozen copies the "
         "devices hold meanwhile); the plan is the dry run's. The training steps compiled at the model's "
         "depth, the decoders (unrolled layers) at "
         f"{' and '.join(map(str, data['runs'][0]['layers'])) or 'full depth'} layers and extrapolated to it; "
         "the collectives are those of the compiled program (a decoder's at its larger depth: those of a layer "
         "repeat per layer), 'in loop' counting the ones a loop body runs (every layer of a scanned step, "
         "every decoding step); '>= x': the TPU compiler refused the program, x being what its temporaries "
         "alone need."]
  if data.get("plan_commit"):
    out.append(f"The plan column: commit `{data['plan_commit']}` (`--replan`).")
  commits = sorted({r["git_commit"] for r in data["runs"]})
  if len(commits) > 1:
    out.append("Runs of several commits: " + ", ".join(f"{r['model']} on {r['target']} at `{r['git_commit']}`"
                                                       for r in data["runs"]) + ".")
  by_model: dict = {}
  for run in sorted(data["runs"], key=lambda r: (r["target"].startswith("v"), r["target"])):
    by_model.setdefault(run["model"], []).append(run)
  for model, runs in by_model.items():
    names = [r["program"] for r in runs[0]["programs"]]
    out += ["", f"### {model}", "", "| program | " + " | ".join(
        f"{r['target']} ({r['device_memory'] / GIB:.0f} GiB)" for r in runs) + " |",
            "|---|" + "---|" * len(runs)]
    for name in names:
      cells = []
      for r in runs:
        row = {x["program"]: x for x in r["programs"]}[name]
        cells.append(_needed(row) + ("" if row["fits"] else " **does not fit**"))
      out.append(f"| {name} | " + " | ".join(cells) + " |")
    for r in runs:
      hosts = f"{r['processes']} hosts" if r["processes"] > 1 else "1 host"
      out += ["", f"{model} on {r['target']} ({r['devices']} devices, {hosts}):", "",
              "| program | GiB / device | plan GiB | attention | collectives |", "|---|---|---|---|---|"]
      for row in r["programs"]:
        plan = "-" if row["plan"] is None else f"{row['plan'] / GIB:.1f}"
        out.append(f"| {row['program']} | {_needed(row)} | {plan} | {row['attention']} | "
                   f"{_collectives(row)} |")
  return "\n".join(out)


def write_docs(path: str, table: str) -> None:
  """`table` between the doc's `<!-- compile-table:targets -->` markers (`results.replace_marked`)."""
  from dgr2_jax import fileio, results
  with open(path) as f:
    text = f.read()
  fileio.write_text_atomic(path, results.replace_marked(text, {"targets": table}, "compile", path))


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--configs", default="beauty_qwen3_8b,beauty_qwen3_0p6b")
  p.add_argument("--targets", default="h100x8,h200x8,v5p-16,v6e-8,v5e-32")
  p.add_argument("--layers", default="2,3", help="two depths to extrapolate from; '' = the model's own")
  p.add_argument("--verify", default="", help="programs to compile at full depth too, e.g. 'eval threshold'")
  p.add_argument("--json_out", default=os.path.join(ROOT, "benchmarks", "results", "compile_targets.json"))
  p.add_argument("--docs", default=os.path.join(ROOT, "docs", "accelerators.md"))
  p.add_argument("--markdown_only", action="store_true", help="rewrite the docs table from --json_out")
  p.add_argument("--update", action="store_true", help="replace only these (config, target) runs in --json_out")
  p.add_argument("--replan", action="store_true", help="recompute the plan and the fits of --json_out (no compile)")
  args = p.parse_args()
  if args.markdown_only or args.replan:
    with open(args.json_out) as f:
      data = json.load(f)
    if args.replan:
      data = replan(data)
      with open(args.json_out, "w") as f:
        json.dump(data, f, indent=1)
      print(f"wrote {args.json_out}")
  else:
    data = compile_all(args)
    if args.update and os.path.exists(args.json_out):   # keep the other (config, target) runs
      with open(args.json_out) as f:
        old = json.load(f)
      new = {(r["config"], r["target"]) for r in data["runs"]}
      data["runs"] = [r for r in old["runs"] if (r["config"], r["target"]) not in new] + data["runs"]
    with open(args.json_out, "w") as f:
      json.dump(data, f, indent=1)
    print(f"wrote {args.json_out}")
  if args.docs:
    write_docs(args.docs, markdown(data))
    print(f"wrote {args.docs}")


if __name__ == "__main__":
  main()
