"""Results tables: the accuracy ladder and the speed/accuracy frontier (Markdown + JSON + PNG).

`workdir/results/accuracy.{md,json}`: one row per method of the ladder (pre_rank, ar, naive, cft,
cft_opd, cft_opd_rl; methods of ablated stages are absent) with the eval metric keys and the
diagnostics of task/diagnostics.py (override rate and precision, trace-policy agreement, paired
bootstrap 95% CIs of the Recall@1 difference against the floor and the AR teacher).
`workdir/results/frontier.{md,json,png}`: one row per (decoder, batch size, block_size, threshold)
plus the AR row of each batch size, with recall@1, valid_rate, tokens_per_s, nfe_per_seq, speedup
(tokens/s over AR at the same batch size), nfe_speedup and, for speculative rows, the drafts
accepted per verifier pass; the PNG plots Recall@1 against speedup. Every JSON carries the machine,
library versions and the
config hash, so a table is never separated from what produced it. Files are written atomically.
A benchmark's JSON says where it ran with `run_meta()` (device, versions, `git_commit()`, XLA flags).
A doc's generated tables sit between `<!-- KIND-table:NAME -->` markers: `marked_docs` regenerates
them (`replace_marked`), `update_docs` writes (or, with --check, names) the docs whose tables changed.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import sys
from typing import Callable, Sequence

from dgr2_jax import fileio

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The ladder's diagnostics (task/diagnostics.py; '-' where a row has none, e.g. the floor's).
DIAGNOSTIC_COLUMNS = ("override_rate", "override_precision", "top1_precision_on_overrides",
                      "policy_agreement", "delta_floor", "delta_floor_ci95", "delta_teacher",
                      "delta_teacher_ci95")
ACCURACY_COLUMNS = ("method", "recall@1", "recall@3", "ndcg@3", "valid_rate", "duplicate_rate",
                    "omission_rate", "out_of_set_rate", "unparseable_rate", "fallback_rate",
                    "mean_nfe", "mean_reasoning_tokens", "n") + DIAGNOSTIC_COLUMNS
FRONTIER_COLUMNS = ("decoder", "batch_size", "block_size", "threshold", "recall@1", "valid_rate",
                    "tokens_per_s", "nfe_per_seq", "speedup", "nfe_speedup", "accepted_per_pass", "n")


# The vector instruction sets XLA:CPU's code generation and its libraries' kernels choose between,
# widest first: the same program compiles to other instructions (and other rounding) on each.
ISA_FLAGS = ("avx512_bf16", "avx512_vnni", "avx512f", "avx2", "fma", "avx", "sse4_2")


def cpu_info(cpuinfo: str = "/proc/cpuinfo") -> dict:
  """{cpu_model, cpu_isa (the widest of ISA_FLAGS the CPU has), cpu_flags (those it has), xla_flags
  (the `--xla_cpu_*` ones of XLA_FLAGS: the GPU flags decode/xla_flags.py adds change nothing on a
  CPU)}: what decides the bits a CPU run computes (docs/results.md, "Runs on other machines")."""
  model, flags = platform.processor() or platform.machine(), set()
  try:
    with open(cpuinfo) as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
          model = value.strip()
        elif key.strip() == "flags":
          flags = set(value.split())
        if flags and model:
          break
  except OSError:
    pass
  have = [f for f in ISA_FLAGS if f in flags]
  return {"cpu_model": model, "cpu_isa": have[0] if have else "unknown", "cpu_flags": have,
          "xla_flags": " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith("--xla_cpu"))}


def machine_info() -> dict:
  info = {"platform": platform.platform(), "python": platform.python_version(),
          "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(), **cpu_info()}
  try:
    import psutil
    info["memory_gb"] = round(psutil.virtual_memory().total / 2**30, 1)
  except ImportError:
    pass
  try:
    import jax
    devs = jax.devices()
    info.update(backend=jax.default_backend(), device_count=len(devs),
                device_kind=devs[0].device_kind if devs else None)
  except Exception as e:  # pylint: disable=broad-except  (no backend: still write the table)
    info["backend_error"] = str(e)
  return info


def git_commit() -> str:
  """The commit a result comes from: $GIT_COMMIT or $DGR2_GIT_COMMIT when set (a device machine
  receives a working tree without its .git), else git's short HEAD in this repository, '+dirty'
  with uncommitted changes to tracked files, else 'unknown'."""
  env = os.environ.get("GIT_COMMIT") or os.environ.get("DGR2_GIT_COMMIT")
  if env:
    return env
  try:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                         timeout=20)
    if rev.returncode != 0:
      return "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True, timeout=20).stdout.strip()
    return rev.stdout.strip() + ("+dirty" if dirty else "")
  except (OSError, subprocess.SubprocessError):
    return "unknown"


def run_meta() -> dict:
  """{device, device_count, backend, jax_version, jaxlib_version, git_commit, xla_flags, command_buffers}
  of this process: where a benchmark ran (the key names the decode benchmarks' rows use; starts
  JAX's backend)."""
  import jax
  import jaxlib
  from dgr2_jax.decode import xla_flags
  dev, flags = jax.devices()[0], os.environ.get("XLA_FLAGS", "")
  cpu = cpu_info()
  return dict(device=dev.device_kind, device_count=jax.device_count(), backend=jax.default_backend(),
              jax_version=jax.__version__, jaxlib_version=jaxlib.__version__, git_commit=git_commit(),
              xla_flags=flags, command_buffers=xla_flags.command_buffers(flags), cpu_model=cpu["cpu_model"],
              cpu_isa=cpu["cpu_isa"])


def versions() -> dict:
  out = {}
  for name in ("jax", "jaxlib", "flax", "optax", "orbax.checkpoint", "transformers", "numpy"):
    try:
      module = __import__(name, fromlist=["__version__"])
      out[name] = getattr(module, "__version__", "?")
    except ImportError:
      out[name] = None
  return out


def meta(config_hash: str, **extra) -> dict:
  return {"config_hash": config_hash, "machine": machine_info(), "versions": versions(),
          "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          **extra}


def _fmt(v) -> str:
  if v is None:
    return "-"
  if isinstance(v, bool):
    return str(v)
  if isinstance(v, int):
    return str(v)
  if isinstance(v, float):
    return f"{v:.4f}" if abs(v) < 10 else f"{v:.1f}"
  if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, float) for x in v):
    return f"[{v[0]:+.4f}, {v[1]:+.4f}]"   # a confidence interval
  return str(v)


def markdown_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  for r in rows:
    lines.append("| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |")
  return "\n".join(lines) + "\n"


def _header(title: str, m: dict) -> str:
  mc = m.get("machine", {})
  cpu = f"; {mc['cpu_model']} ({mc.get('cpu_isa')}, {mc.get('cpu_count')} cores)" if mc.get("cpu_model") else ""
  xla = f"; XLA_FLAGS `{mc['xla_flags']}`" if mc.get("xla_flags") else ""
  return (f"# {title}\n\nconfig hash `{m.get('config_hash')}`; {mc.get('backend', '?')} x"
          f"{mc.get('device_count', '?')} ({mc.get('device_kind', '?')}), {mc.get('platform')}{cpu}{xla}; "
          f"jax {m.get('versions', {}).get('jax')}; written {m.get('written')}\n\n")


def write_accuracy(out_dir: str, rows: Sequence[dict], m: dict) -> list:
  """accuracy.json (a list of rows, each with the run info `m` under "run") and accuracy.md."""
  for r in rows:
    if "method" not in r:
      raise ValueError(f"accuracy row without 'method': {r}")
  obj = [{**r, "run": m} for r in rows]
  fileio.write_json_atomic(os.path.join(out_dir, "accuracy.json"), obj)
  fileio.write_text_atomic(os.path.join(out_dir, "accuracy.md"),
              _header("Accuracy ladder", m) + markdown_table(rows, ACCURACY_COLUMNS))
  return obj


def plot_frontier(rows: Sequence[dict], path: str) -> None:
  """Recall@1 vs speedup, one line per (decoder, block size, batch size) (AR: the reference point
  at speedup 1). Process 0 only."""
  if not fileio.is_writer():
    return
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(5.5, 4))
  groups = {}
  for r in rows:
    groups.setdefault((r.get("decoder", "threshold"), r["block_size"], r.get("batch_size")), []).append(r)
  for (dec, b, batch), rs in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
    rs = sorted(rs, key=lambda r: r["speedup"] or 0.0)
    xs = [r["speedup"] for r in rs]
    ys = [r["recall@1"] for r in rs]
    at = f", batch {batch}" if batch is not None else ""
    if b == 1:
      ax.scatter(xs, ys, marker="*", s=120, color="k", label=f"AR (B=1){at}" if batch in (None, 1) else None,
                 zorder=3)
      continue
    ax.plot(xs, ys, marker="o" if dec == "threshold" else "s", label=f"{dec} B={b}{at}")
    for r in rs:
      ax.annotate(f"τ={r['threshold']:g}", (r["speedup"], r["recall@1"]), fontsize=7,
                  xytext=(3, 3), textcoords="offset points")
  ax.set_xlabel("decode speedup over AR (tokens/s ratio)")
  ax.set_ylabel("Recall@1")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  d = os.path.dirname(os.path.abspath(path))
  os.makedirs(d, exist_ok=True)
  tmp = os.path.join(d, "." + os.path.basename(path) + ".tmp.png")
  fig.savefig(tmp, dpi=120)
  plt.close(fig)
  os.replace(tmp, path)


def write_frontier(out_dir: str, rows: Sequence[dict], m: dict) -> list:
  """frontier.json (a list of rows, each with the run info `m` under "run"), .md and .png."""
  for r in rows:
    for k in ("block_size", "threshold", "recall@1", "speedup"):
      if k not in r:
        raise ValueError(f"frontier row without {k!r}: {r}")
  obj = [{**r, "run": m} for r in rows]
  fileio.write_json_atomic(os.path.join(out_dir, "frontier.json"), obj)
  fileio.write_text_atomic(os.path.join(out_dir, "frontier.md"),
              _header("Speed / accuracy frontier", m) + markdown_table(rows, FRONTIER_COLUMNS))
  plot_frontier(rows, os.path.join(out_dir, "frontier.png"))
  return obj


# ---- generated tables in the docs (benchmarks/gpu_tables.py, benchmarks/compiled_tables.py) ------------
def config_stem(argv, default: str = "demo") -> str:
  """The stem of the `--config=` file among `argv` ('demo', 'beauty_cpu'; variants after ':'
  dropped): the name of a benchmark's doc markers."""
  for a in argv:
    if a.startswith("--config="):
      return os.path.splitext(os.path.basename(a.split("=", 1)[1].split(":")[0]))[0]
  return default


def replace_marked(text: str, tables: dict, kind: str, doc: str = "") -> str:
  """`text` with the block between each `<!-- {kind}-table:NAME -->` and `<!-- /{kind}-table:NAME -->`
  replaced by tables[NAME]. A marker pair missing is an error naming the doc and the table."""
  for name, body in tables.items():
    pat = re.compile(rf"(<!-- {kind}-table:{name} -->\n)(?:.*?\n)?(<!-- /{kind}-table:{name} -->)", re.S)
    if not pat.search(text):
      raise ValueError(f"{doc}: no <!-- {kind}-table:{name} --> ... <!-- /{kind}-table:{name} --> markers")
    text = pat.sub(lambda m: m.group(1) + body.rstrip("\n") + "\n" + m.group(2), text)
  return text


def record_head(script: str, argv: Sequence[str] | None = None) -> dict:
  """The fields a benchmark's record opens with: `command` (`python SCRIPT ARGS`, this machine's
  paths out: the workdir as WORKDIR, the data directory as PATH/<its name>), `commit` (read now, so
  call this when the run starts), `name` (`config_stem`), `machine` and `cores`."""
  argv = list(sys.argv[1:] if argv is None else argv)

  def portable(a: str) -> str:
    if a.startswith("--workdir="):
      return "--workdir=WORKDIR"
    if a.startswith("--config.data.dir="):
      return "--config.data.dir=PATH/" + os.path.basename(a.split("=", 1)[1].rstrip("/"))
    return a
  return {"command": " ".join([f"python {script}"] + [portable(a) for a in argv]), "commit": git_commit(),
          "name": config_stem(argv), "machine": cpu_info(), "cores": os.cpu_count()}


def record_source(record: dict, json_path: str) -> str:
  """"Commit `C`, `COMMAND`, on N CPU cores (CPU, ISA); JSON: `PATH`." for a benchmark's record
  (its commit, command, machine and cores fields): the sentence above a generated table."""
  m = record.get("machine") or {}
  return (f"Commit `{record['commit']}`, `{record['command']}`, on {record.get('cores', '?')} CPU cores "
          f"({m.get('cpu_model', '?')}, {m.get('cpu_isa', '?')}); JSON: `{json_path}`.")


def write_marked_table(doc: str, kind: str, name: str, body: str, tool: str) -> None:
  """Rewrites `doc`'s `<!-- {kind}-table:{name} -->` block with `body` (`replace_marked`), atomically;
  a missing `doc` or marker pair exits with one line naming `tool`."""
  if not doc:
    raise SystemExit(f"{tool}: --render needs --docs=<the doc to rewrite>")
  with open(doc) as f:
    text = f.read()
  try:
    text = replace_marked(text, {name: body}, kind, doc)
  except ValueError as e:
    raise SystemExit(f"{tool}: {e}") from None
  fileio.write_text_atomic(doc, text)
  print(f"wrote {doc}")


def benchmark_main(f: dict, measure: Callable[[], dict], render: Callable[[dict], str],
                   write_docs: Callable[[dict, str, str], None]) -> None:
  """What a benchmark whose record renders into a doc does with its `render`, `out` and `docs` flags
  (`f`: name -> absl flag): with `--render=JSON` the doc's table rewritten from that recorded JSON,
  nothing run; else `measure()`'s record printed, written to `--out` and into `--docs` when given."""
  if f["render"].value:
    with open(f["render"].value) as fh:
      write_docs(json.load(fh), f["docs"].value, f["render"].value)
    return
  record = measure()
  print(render(record), flush=True)
  if f["out"].value:
    fileio.write_json_atomic(f["out"].value, record)
    print(f"wrote {f['out'].value}")
  if f["docs"].value:
    write_docs(record, f["docs"].value, f["out"].value)


def marked_docs(repo: str, docs: dict, kind: str, table) -> dict:
  """{doc path: (current text, generated text)} of each doc of `docs` ({path under `repo`: its table
  names}), every table's markers (`replace_marked`) holding table(NAME)."""
  out = {}
  for doc, names in docs.items():
    path = os.path.join(repo, doc)
    with open(path) as f:
      text = f.read()
    out[path] = (text, replace_marked(text, {n: table(n) for n in names}, kind, doc))
  return out


def update_docs(docs: dict, root: str, check: bool, script: str, what: str) -> int:
  """Writes each doc of {path: (current text, generated text)} whose text changed (printing 'updated
  DOC'), or with `check` writes nothing and names the stale ones on stderr. The exit status: 1 when
  `check` found a stale doc, else 0. `script` is benchmarks/SCRIPT, `what` the tables' kind in words."""
  stale = []
  for path, (text, new) in docs.items():
    if text == new:
      continue
    if check:
      stale.append(os.path.relpath(path, root))
    else:
      fileio.write_text_atomic(path, new)
      print(f"updated {os.path.relpath(path, root)}")
  if stale:
    print(f"{script}: the {what} tables of {', '.join(stale)} differ from benchmarks/results/*.json; "
          f"run python benchmarks/{script}", file=sys.stderr)
    return 1
  return 0
