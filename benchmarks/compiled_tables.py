"""The docs' compile-only tables, generated from the compiled results in benchmarks/results/*.json.

  python benchmarks/compiled_tables.py           # rewrite the tables in docs/memory.md, docs/decoding_accelerator.md,
                                                 # docs/parallel_decoding.md
  python benchmarks/compiled_tables.py --check   # exit 1, naming the doc, if a table differs from what the JSON gives

A compiled result is the JSON a benchmark writes with `--json_out` (`decode_memory.py`,
`decode_bytes.py`, `decode_mesh.py`, usually with `--target=...`: the program that target
compiles, built on any machine with `pip install -e ".[aot]"`): {"kind": "dgr2-compiled",
"benchmark", "target" ('' for the host's backend), "backend", "git_commit", "jax_version",
"command", "rows"}. Each table sits in its doc between `<!-- compiled-table:NAME -->` and
`<!-- /compiled-table:NAME -->`; everything between the markers is generated, so edit the prose
around them. Every table names the command, commit and JAX version of each result it shows, and
the file it came from. Nothing here is timed: compile-only programs run nothing.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from dgr2_jax import results  # noqa: E402

RESULTS = os.path.join(REPO, "benchmarks", "results")
KIND = "dgr2-compiled"
DOCS = {"docs/memory.md": ("decode_memory",), "docs/decoding_accelerator.md": ("decode_bytes",),
        "docs/parallel_decoding.md": ("decode_mesh",)}
TREES = {"checkpoint": "the checkpoint's (f32, HF layout)", "bf16": "prepared on the host (fused)",
         "float8_e4m3fn": "prepared on the host (float8 kernels)"}


def load(results_dir: str = RESULTS) -> dict:
  """{benchmark: [(file name, result)]}: GPU targets first, then TPU, then the host's compiles."""
  out = {}
  for path in glob.glob(os.path.join(results_dir, "*.json")):
    try:
      with open(path) as f:
        rec = json.load(f)
    except (OSError, ValueError):
      continue
    if isinstance(rec, dict) and rec.get("kind") == KIND:
      out.setdefault(rec.get("benchmark"), []).append((os.path.basename(path), rec))
  order = {"gpu": 0, "tpu": 1}
  for recs in out.values():
    recs.sort(key=lambda r: (order.get(r[1].get("backend"), 2), r[1].get("target") or "", r[0]))
  return out


def where(rec: dict) -> str:
  """'h100', 'v5p-8', or 'CPU' for a program compiled for the host."""
  return rec.get("target") or rec.get("backend", "host").upper()


def sources(recs: list) -> list:
  return [f"- {where(r)}: `{r.get('command', '?')}`, commit {r.get('git_commit', '?')}, jax "
          f"{r.get('jax_version', '?')} (`benchmarks/results/{name}`)" for name, r in recs]


def table(head: list, rows: list) -> list:
  return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def merged(values: list) -> str:
  """One cell for several targets: the value once when they agree, else each in order, ' / '."""
  return values[0] if len(set(values)) == 1 else " / ".join(values)


# ---- the tables ---------------------------------------------------------------------------------------
def decode_memory(recs: list) -> list:
  rows = []
  for _, rec in recs:
    dev = rec.get("device_memory_gib")
    for r in rec["rows"]:
      fits = "" if not dev else f"{'yes' if r['total_gib'] <= dev else 'no'} ({dev:.1f})"
      rows.append([where(rec), r["program"], str(r["batch"]), TREES.get(r["params"], r["params"]),
                   r["dtype"].replace("bfloat16", "bf16").replace("float32", "f32"), f"{r['arguments_gib']:.2f}",
                   f"{r['temporaries_gib']:.2f}", f"{r['total_gib']:.2f}", fits])
  head = ["compiled for", "decoder", "batch", "params handed to the decoder", "compute", "arguments GiB",
          "temporaries GiB", "total GiB", "fits (device GiB)"]
  return table(head, rows) + ["", "Sources:", ""] + sources(recs)


def _reads(r: dict) -> str:
  lo, hi = f"{r['min_read']:.3f}", f"{r['max_read']:.3f}"
  return lo if lo == hi else f"{lo}-{hi}"


def _names(paths) -> list:
  """Leaf paths by name, whatever their layer or model: '[0]/layers_1/mlp/down_proj/kernel' -> 'down_proj/kernel'."""
  return sorted({"/".join(re.sub(r"^\[\d+\]/", "", p).split("/")[-2:]) for p in paths or []})


def _converts(r: dict) -> str:
  """Converts of weights to f32 in the loop, and (apart) the weights a GEMM fusion converts in registers."""
  fused = _names(r.get("f32_in_matmul"))
  return str(r["f32_converts"]) + (f" ({len(fused)} in a GEMM)" if fused else "")


def _small(r: dict) -> str:
  """The small leaves (norm scales, float8 scales) a step reads twice, by name ('-': none)."""
  return ", ".join(_names(r.get("small_reread"))) or "-"


def _trips(r: dict) -> str:
  return "-" if r["round_trips_per_token"] is None else f"{r['round_trips_per_token']:.3f}"


def _num(v, spec: str) -> str:
  return "-" if v is None or v != v else format(v, spec)


BYTES_COLUMNS = (   # (header, cell of a row)
    ("weight GB read / step", lambda r: f"{r['weight_read_gb']:.2f}"),
    ("x weights", lambda r: f"{r['weight_read_ratio']:.3f}"),
    ("x bf16 weights", lambda r: f"{r['vs_bf16']:.3f}"),
    ("reads per leaf", _reads),
    ("matmuls / layer", lambda r: "/".join(map(str, r["matmuls_per_layer"]))),
    ("small leaves read twice", _small),
    ("f32 converts in loop", _converts),
    ("round trips / token", _trips),
    ("XLA GB / step", lambda r: _num(r.get("xla_bytes_gb"), ".2f")),
    ("XLA TFLOP / step", lambda r: _num(r.get("xla_tflops"), ".3f")))


def decode_bytes(recs: list) -> list:
  """One row per decoder, batch and weight dtype; a cell gives each target's value (in the order of
  the header) where they differ."""
  keys, by = [], {}
  for i, (_, rec) in enumerate(recs):
    for r in rec["rows"]:
      k = (r["shape"], r["program"], r["batch"], r["weight_dtype"])
      if k not in by:
        keys.append(k)
        by[k] = [None] * len(recs)
      by[k][i] = r
  rows = []
  for k in keys:   # a target that did not compile this row: 'n/a' in its place
    rows.append([*map(str, k)] + [merged([cell(r) if r else "n/a" for r in by[k]]) for _, cell in BYTES_COLUMNS])
  names = " / ".join(where(r) for _, r in recs)
  head = ["shape", "program", "batch", "weights"] + [h for h, _ in BYTES_COLUMNS]
  counted = sorted({r.get("counted", "lowered") for _, r in recs})
  return ([f"Counted in the program {' and '.join(counted)} for {names} (a cell with several values: one per "
           "target, in that order).", ""] + table(head, rows) + ["", "Sources:", ""] + sources(recs))


def decode_mesh(recs: list) -> list:
  rows = []
  for _, rec in recs:
    for r in rec["rows"]:
      big = r.get("largest_all_gather") or "-"
      rows.append([where(rec), r["decoder"], str(r["tensor"]), f"{r['param_MB_per_dev']:.1f}",
                   f"{r['kv_MB_per_dev']:.1f}", str(r.get("all_gather_in_loop", "-")),
                   str(r.get("all_reduce_in_loop", "-")), _num(r.get("in_loop_bytes"), ",d"),
                   str(r.get("all_gather", "-")), big if big == "-" else f"{big} ({r['largest_all_gather_bytes']:,} B)",
                   _num(r.get("temp_MB_per_dev"), ".1f")])
  head = ["compiled for", "decoder", "tensor", "param MB per device", "KV cache MB per device",
          "all-gathers in the loop", "all-reduces in the loop", "bytes they move", "all-gathers (program)",
          "largest all-gather", "temporaries MB per device"]
  return table(head, rows) + ["", "Sources:", ""] + sources(recs)


RENDER = {"decode_memory": decode_memory, "decode_bytes": decode_bytes, "decode_mesh": decode_mesh}


def render(name: str, recs: list) -> str:
  if not recs:
    return (f"No compiled result of this table is recorded yet (`benchmarks/{name}.py --target=... "
            "--json_out=benchmarks/results/...`, then `python benchmarks/compiled_tables.py`).")
  return "\n".join(RENDER[name](recs))


def generate(results_dir: str = RESULTS, repo: str = REPO) -> dict:
  """{doc path: (current text, generated text)}."""
  recs = load(results_dir)
  return results.marked_docs(repo, DOCS, "compiled", lambda n: render(n, recs.get(n, [])))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--check", action="store_true", help="exit 1 if a doc's tables differ from the JSON's")
  ap.add_argument("--results", default=RESULTS, help="folder of the compiled results")
  ap.add_argument("--root", default=REPO, help="the checkout whose docs/ to update")
  a = ap.parse_args(sys.argv[1:] if argv is None else argv)
  return results.update_docs(generate(a.results, a.root), a.root, a.check, "compiled_tables.py", "compiled")


if __name__ == "__main__":
  sys.exit(main())
