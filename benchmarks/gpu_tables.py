"""The GPU tables of the docs, generated from the recorded runs in benchmarks/results/*.json.

  python benchmarks/gpu_tables.py            # rewrite the tables in docs/decoding_accelerator.md, docs/training.md
  python benchmarks/gpu_tables.py --check    # exit 1, naming the table, if a doc differs from what the JSON gives
  python benchmarks/gpu_tables.py collect --parts=DIR --out=DIR [--prefix=NAME]   # (run_gpu_benchmarks.sh)

A recorded run is a JSON file that `collect` wrote on the device (benchmarks/run_gpu_benchmarks.sh):
{"kind": "dgr2-gpu-run", "part": "decode" | "kernels" | "profile" | "train", "device", "jax_version",
"git_commit", "runs": [{"name", "label", "rc", "seconds", "command", "result": the benchmark's own
JSON or null, "tail": its last output lines when it failed}]}. Other JSON files in the folder (a
recorded schedule, say) are ignored. Each table sits in its doc between `<!-- gpu-table:NAME -->`
and `<!-- /gpu-table:NAME -->`; everything between the two markers is generated, so edit the prose
around them, not inside. Every table names the device, the JAX version and the commit of the run
it shows, and the file it came from.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from dgr2_jax import results  # noqa: E402

RESULTS = os.path.join(REPO, "benchmarks", "results")
KIND = "dgr2-gpu-run"
# doc -> the tables it holds
DOCS = {"docs/decoding_accelerator.md": ("decode", "profile", "kernels"), "docs/training.md": ("train",)}
PARTS = ("decode", "kernels", "profile", "train")
META_KEYS = {"device", "device_count", "jax_version", "jaxlib_version", "git_commit", "platform", "backend",
             "xla_flags", "command_buffers", "answers"}

# (header, key, format) of the columns a table shows where a row has them.
DECODE_COLUMNS = (
    ("batch", "batch", "d"), ("decoder", "name", "s"), ("new tokens / row", "new_tokens", ".0f"),
    ("request tok/s", "request_tokens_per_s", ",.1f"), ("request s", "request_wall_s", ".3f"),
    ("prefill s", "request_prefill_s", ".3f"), ("request vs AR", "request_speedup", ".2fx"),
    ("decode-only tok/s / request", "request_decode_tokens_per_s", ",.1f"),
    ("decode-only tok/s, batch", "decode_tokens_per_s", ",.1f"), ("decode vs AR", "speedup", ".2fx"),
    ("NFE / row", "nfe_per_seq", ".1f"), ("AR roofline", "roofline_fraction", ".0%"), ("compile s", "compile_s", ".1f"))
KERNEL_COLUMNS = (("batch", "batch", "d"), ("window", "window", "d"), ("route", "route", "s"),
                  ("key splits", "key_splits", "s"), ("ms", "ms", ".3f"), ("GB/s", "gbps", ",.0f"),
                  ("max abs diff vs xla", "max_abs_diff_vs_xla", ".2e"))
PROFILE_GROUPS = ("attention", "projections", "mlp", "norms", "rope", "kv_cache", "lm_head", "choose", "rest")


# ---- formatting ---------------------------------------------------------------------------------------
def fmt(value, spec: str) -> str:
  """One cell: '' for a missing or non-finite value; `spec` a format spec, 'x' / '%' suffixes kept."""
  if value is None or value == "":
    return ""
  if isinstance(value, float) and not math.isfinite(value):
    return ""
  if spec == "s":
    return str(value)
  if spec.endswith("x"):
    return format(float(value), spec[:-1]) + "x"
  if spec == "d":
    return str(int(value))
  if not isinstance(value, (int, float)) or isinstance(value, bool):
    return str(value)
  return format(value, spec)


def table(rows: list, columns) -> list:
  """Markdown lines of `rows` (dicts) in the `columns` any row has."""
  cols = [c for c in columns if any(r.get(c[1]) not in (None, "") for r in rows)]
  if not cols:
    return []
  out = ["| " + " | ".join(c[0] for c in cols) + " |", "|" + "---|" * len(cols)]
  for r in rows:
    out.append("| " + " | ".join(fmt(r.get(k), spec) for _, k, spec in cols) + " |")
  return out


def generic_columns(rows: list, first=()) -> tuple:
  """Columns of every scalar field the rows have (first-seen order, `first` leading), for a
  benchmark whose rows this module has no spec for."""
  keys = list(first)
  for r in rows:
    for k, v in r.items():
      if k not in keys and k not in META_KEYS and (v is None or isinstance(v, (int, float, str, bool))):
        keys.append(k)
  return tuple((k, k, ".4g" if any(isinstance(r.get(k), float) for r in rows) else "s") for k in keys[:14])


def rows_of(result) -> list:
  """A benchmark JSON's rows: its "rows" list, a list itself, or the one dict of its scalars."""
  if isinstance(result, list):
    return [r for r in result if isinstance(r, dict)]
  if not isinstance(result, dict):
    return []
  for key in ("rows", "results", "checks", "cases"):
    if isinstance(result.get(key), list):
      return [r for r in result[key] if isinstance(r, dict)]
  return [{k: v for k, v in result.items() if isinstance(v, (int, float, str, bool))}]


# ---- the tables -----------------------------------------------------------------------------------------
def caption(path: str, rec: dict) -> str:
  return (f"Device {rec.get('device', '?')}, jax {rec.get('jax_version', '?')}, commit {rec.get('git_commit', '?')} "
          f"(`benchmarks/results/{os.path.basename(path)}`).")


def run_lines(run: dict, body: list) -> list:
  """A run's heading line and its table, or why it has none."""
  head = f"**{run.get('label') or run['name']}**"
  if run.get("command"):
    head += f": `{run['command']}`"
  if not body:
    why = "skipped" if run.get("rc") is None else f"exit status {run.get('rc')}"
    return [head + f" ({why}, {fmt(run.get('seconds'), '.0f')} s; no rows)", ""]
  return [head + f" ({fmt(run.get('seconds'), '.0f')} s)", "", *body, ""]


def decode_body(run: dict) -> list:
  return table(rows_of(run.get("result")), DECODE_COLUMNS)


def flash_rows(result: dict) -> list:
  """flash_check.py's {"masks": {mask: {ms, tflops, err, failed, pallas_ok}}} -> a row per (mask, route)."""
  rows = []
  for mask, m in result["masks"].items():
    for route in sorted(set(m.get("ms", {})) | set(m.get("failed", {}))):
      err = m.get("err", {}).get(route) or {}
      rows.append(dict(mask=mask, route=route, tokens=m.get("tokens"), density=m.get("density"),
                       ms=m.get("ms", {}).get(route), tflops=m.get("tflops", {}).get(route),
                       max_rel_err=max(err.values()) if err else None, pallas_ok=m.get("pallas_ok"),
                       failed=(m.get("failed", {}).get(route) or "")[:80] or None))
  return rows


FLASH_COLUMNS = (("mask", "mask", "s"), ("route", "route", "s"), ("tokens / row", "tokens", "d"),
                 ("kept pairs", "density", ".0%"), ("fwd + bwd ms", "ms", ".3f"), ("TFLOP/s", "tflops", ".1f"),
                 ("max rel. error vs f32", "max_rel_err", ".2e"), ("pallas within tolerance", "pallas_ok", "s"),
                 ("failed", "failed", "s"))


def kernels_body(run: dict) -> list:
  res = run.get("result")
  if isinstance(res, dict) and isinstance(res.get("masks"), dict):
    return table(flash_rows(res), FLASH_COLUMNS)
  rows = rows_of(res)
  if rows and all("route" in r for r in rows):
    return table(rows, KERNEL_COLUMNS)
  return table(rows, generic_columns(rows))


def profile_body(run: dict) -> list:
  res = run.get("result")
  if not isinstance(res, dict) or "us_per_iteration" not in res:
    return []
  g = res["us_per_iteration"]
  cols = [("steps", "iterations", "d"), ("device us / step", "device_us_per_iteration", ",.0f")] + [
      (k, k, ",.0f") for k in PROFILE_GROUPS] + [("launch gaps us", "launch_gaps_us_per_iteration", ",.0f"),
                                                  ("wall us / step", "step_wall_us", ",.0f"),
                                                  ("prefill ms", "prefill_ms", ".2f")]
  row = dict(res, **{k: g.get(k, 0.0) for k in PROFILE_GROUPS}, prefill_ms=res.get("prefill_device_us", 0) / 1e3)
  return table([row], cols)


TRAIN_COLUMNS = (("loss", "loss", "s"), ("scanned", "scan", "s"), ("remat", "remat_policy", "s"),
                 ("batch", "batch", "d"), ("tokens / row", "seq", "d"), ("step ms", "step_ms", ",.1f"),
                 ("tokens/s", "tok_s", ",.0f"), ("MFU", "mfu", ".3f"), ("peak GiB", "peak_gib", ".1f"),
                 ("XLA plan GiB", "xla_planned_gib", ".1f"), ("dry-run plan GiB", "plan_gib", ".1f"),
                 ("plan / peak", "plan_over_peak", ".2f"), ("compile s", "compile_s", ".1f"), ("error", "error", "s"))


def train_body(run: dict) -> list:
  rows = rows_of(run.get("result"))
  if rows and all("loss" in r for r in rows):
    return table(rows, TRAIN_COLUMNS)
  return table(rows, generic_columns(rows))


BODIES = {"decode": decode_body, "kernels": kernels_body, "profile": profile_body, "train": train_body}


def render(part: str, records: list) -> str:
  """The markdown between a table's markers, from [(path, record)] of that part."""
  if not records:
    return ("No GPU run of this table is recorded yet (`benchmarks/run_gpu_benchmarks.sh` on a device,\n"
            "its JSON in `benchmarks/results/`, then `python benchmarks/gpu_tables.py`).")
  lines = []
  for path, rec in records:
    lines += [caption(path, rec), ""]
    for run in rec.get("runs", []):
      lines += run_lines(run, BODIES[part](run))
  return "\n".join(lines).rstrip()


def load_records(results_dir: str = RESULTS) -> dict:
  """{part: [(path, record)]} of the recorded runs in `results_dir`, by file name."""
  out = {p: [] for p in PARTS}
  for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
    try:
      with open(path) as f:
        rec = json.load(f)
    except (OSError, ValueError):
      continue
    if isinstance(rec, dict) and rec.get("kind") == KIND and rec.get("part") in out:
      out[rec["part"]].append((path, rec))
  return out


def generate(results_dir: str = RESULTS, repo: str = REPO) -> dict:
  """{doc path: (current text, generated text)}."""
  records = load_records(results_dir)
  return results.marked_docs(repo, DOCS, "gpu", lambda n: render(n, records[n]))


# ---- collect: the device's sub-runs -> a few JSON files ----------------------------------------------
def collect(parts_dir: str, out_dir: str, prefix: str = "") -> list:
  """Merges the sub-runs in `parts_dir` (NAME.status: {name, part, label, rc, seconds, command};
  NAME.json: the benchmark's own JSON; NAME.log: its output) into one file per part in `out_dir`,
  with the device, JAX version and commit of env.json (else of the first run's JSON that names
  them). Returns the paths written."""
  env = _read_json(os.path.join(parts_dir, "env.json")) or {}
  by_part = {}
  for status_path in sorted(glob.glob(os.path.join(parts_dir, "*.status")), key=os.path.getmtime):
    st = _read_json(status_path)
    if not st:
      continue
    name = st["name"]
    run = dict(st, result=_read_json(os.path.join(parts_dir, f"{name}.json")))
    if run["result"] is None or st.get("rc"):
      run["tail"] = _tail(os.path.join(parts_dir, f"{name}.log"), 40)
    by_part.setdefault(st.get("part", "other"), []).append(run)
  written = []
  for part, runs in by_part.items():
    metas = [r["result"].get("meta") or r["result"] for r in runs if isinstance(r.get("result"), dict)]
    pick = lambda k: env.get(k) or next((m[k] for m in metas if isinstance(m, dict) and m.get(k)), None)
    rec = dict(kind=KIND, part=part, device=pick("device"), jax_version=pick("jax_version"),
               jaxlib_version=pick("jaxlib_version"), git_commit=pick("git_commit"), env=env, runs=runs)
    path = os.path.join(out_dir, f"{prefix}{part}.json")
    with open(path, "w") as f:
      json.dump(rec, f, indent=1, default=str)
    written.append(path)
  return written


def _read_json(path: str):
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _tail(path: str, n: int) -> list:
  try:
    with open(path, errors="replace") as f:
      return f.read().splitlines()[-n:]
  except OSError:
    return []


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if argv and argv[0] == "collect":
    ap = argparse.ArgumentParser(prog="gpu_tables.py collect")
    ap.add_argument("--parts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prefix", default="")
    a = ap.parse_args(argv[1:])
    for p in collect(a.parts, a.out, a.prefix):
      print(p)
    return 0
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--check", action="store_true", help="exit 1 if a doc's tables differ from the JSON's")
  ap.add_argument("--results", default=RESULTS, help="folder of the recorded runs")
  ap.add_argument("--root", default=REPO, help="the checkout whose docs/ to update")
  a = ap.parse_args(argv)
  return results.update_docs(generate(a.results, a.root), a.root, a.check, "gpu_tables.py", "GPU")


if __name__ == "__main__":
  sys.exit(main())
