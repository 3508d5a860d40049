"""benchmarks/compiled_tables.py: the docs' compile-only tables are what the compiled results in
benchmarks/results/ give, and the generator on a small fixture (targets merged into one cell where
they differ, fits against the device, the sources named, the markers)."""

import json
import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
import compiled_tables  # noqa: E402


def test_the_docs_tables_are_what_the_compiled_results_give(capsys):
  assert compiled_tables.main(["--check"]) == 0, capsys.readouterr().err


def _bytes_row(**kw):
  row = dict(shape="qwen3_8b", program="ar", batch=1, weight_dtype="bf16", weight_read_gb=15.14,
             weight_read_ratio=1.0, vs_bf16=1.0, min_read=1.0, max_read=1.0, matmuls_per_layer=[4], f32_converts=0,
             f32_in_matmul=[], round_trips_per_token=0.125, xla_bytes_gb=16.2, xla_tflops=0.025, small_reread=[],
             counted="compiled")
  return dict(row, **kw)


def _record(benchmark, target, backend, rows, **kw):
  return dict(kind=compiled_tables.KIND, benchmark=benchmark, target=target, backend=backend, git_commit="abc1234",
              jax_version="0.10.2", command=f"python benchmarks/{benchmark}.py --target={target}", rows=rows, **kw)


@pytest.fixture
def checkout(tmp_path):
  (tmp_path / "docs").mkdir()
  for doc, names in compiled_tables.DOCS.items():
    blocks = "".join(f"<!-- compiled-table:{n} -->\nold\n<!-- /compiled-table:{n} -->\n\nprose after\n" for n in names)
    (tmp_path / doc).write_text(f"# {doc}\n\nprose before\n\n{blocks}")
  results = tmp_path / "results"
  results.mkdir()
  recs = {
      "h100_bytes.json": _record("decode_bytes", "h100", "gpu", [_bytes_row(), _bytes_row(batch=64)]),
      "v5p_bytes.json": _record("decode_bytes", "v5p-8", "tpu", [_bytes_row(round_trips_per_token=None,
                                                                           small_reread=["norm/scale"])]),
      "h100_mem.json": _record("decode_memory", "h100", "gpu", [dict(
          program="speculative", batch=1, params="checkpoint", dtype="bfloat16", arguments_gib=61.03,
          temporaries_gib=31.18, total_gib=92.2)], device_memory_gib=79.14),
      "other.json": {"kind": "dgr2-gpu-run", "part": "decode"}}
  for name, rec in recs.items():
    (results / name).write_text(json.dumps(rec))
  return tmp_path, results


def test_generator_on_a_fixture(checkout):
  root, results = checkout
  assert compiled_tables.main(["--check", f"--results={results}", f"--root={root}"]) == 1   # stale
  assert compiled_tables.main([f"--results={results}", f"--root={root}"]) == 0
  assert compiled_tables.main(["--check", f"--results={results}", f"--root={root}"]) == 0
  acc = (root / "docs/decoding_accelerator.md").read_text()
  assert "for h100 / v5p-8" in acc and "| qwen3_8b | ar | 1 | bf16 | 15.14 |" in acc
  assert "| 0.125 / - |" in acc                                 # the targets differ: both, in order
  assert "| qwen3_8b | ar | 64 | bf16 | 15.14 / n/a |" in acc   # a row one target did not compile
  assert "| - / norm/scale |" in acc                            # small leaves read twice, by name
  assert "commit abc1234, jax 0.10.2 (`benchmarks/results/h100_bytes.json`)" in acc and "prose after" in acc
  mem = (root / "docs/memory.md").read_text()
  assert "| h100 | speculative | 1 | the checkpoint's (f32, HF layout) | bf16 | 61.03 | 31.18 | 92.20 | no (79.1) |" \
      in mem
  assert "old" not in mem and "No compiled result" in (root / "docs/parallel_decoding.md").read_text()


def test_missing_markers_name_the_doc(checkout):
  root, results = checkout
  (root / "docs/memory.md").write_text("no markers\n")
  with pytest.raises(ValueError, match="docs/memory.md: no <!-- compiled-table:decode_memory -->"):
    compiled_tables.main([f"--results={results}", f"--root={root}"])
