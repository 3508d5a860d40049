"""benchmarks/gpu_tables.py: the docs' GPU tables are what the recorded runs in benchmarks/results/
give (the check the docs rely on), and the generator itself on a small fixture: captions with the
device, JAX version and commit, the columns a row has, a failed sub-run, the markers, `collect`."""

import json
import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
import gpu_tables  # noqa: E402


def test_the_docs_tables_are_what_the_recorded_runs_give(capsys):
  records = gpu_tables.load_records()
  if not any(records.values()):
    print("no GPU run recorded in benchmarks/results/ yet: the tables must hold the placeholder")
  assert gpu_tables.main(["--check"]) == 0, capsys.readouterr().err


DECODE_RUN = dict(name="ar_b1_new", part="decode", label="8B, batch 1, AR: fused, CUDA graphs", rc=0, seconds=83,
                  command="python3 benchmarks/decode_throughput.py --preset=qwen3_8b",
                  result=dict(meta=dict(device="NVIDIA H100 80GB HBM3"), rows=[
                      dict(name="ar", batch=1, new_tokens=128.0, request_tokens_per_s=151.25, request_wall_s=0.8463,
                           request_prefill_s=0.0712, request_speedup=1.0, request_decode_tokens_per_s=165.2,
                           decode_tokens_per_s=165.2, speedup=1.0, nfe_per_seq=127.0, roofline_fraction=0.764,
                           compile_s=22.94, roofline_tokens_per_s=216.0),
                      dict(name="replayed schedule", batch=1, new_tokens=96.0, request_tokens_per_s=402.5,
                           request_wall_s=0.2385, request_prefill_s=0.0712, request_speedup=2.661,
                           request_decode_tokens_per_s=float("nan"), decode_tokens_per_s=573.1, speedup=3.469,
                           nfe_per_seq=24.5, compile_s=25.0)]))
FAILED_RUN = dict(name="fp8_b1", part="decode", label="8B, batch 1, AR: float8 weights", rc=124, seconds=130,
                  command="python3 benchmarks/decode_throughput.py --weight_dtype=float8_e4m3fn", result=None,
                  tail=["Traceback", "TimeoutError"])
RECORD = dict(kind=gpu_tables.KIND, part="decode", device="NVIDIA H100 80GB HBM3", jax_version="0.11.2",
              git_commit="abc1234", runs=[DECODE_RUN, FAILED_RUN])
PROFILE = dict(kind=gpu_tables.KIND, part="profile", device="NVIDIA H100 80GB HBM3", jax_version="0.11.2",
               git_commit="abc1234", runs=[dict(name="profile", part="profile", label="AR profile", rc=0, seconds=70,
                                                result=dict(iterations=15, device_us_per_iteration=5100.0,
                                                            us_per_iteration=dict(attention=300.0, mlp=2400.0),
                                                            launch_gaps_us_per_iteration=900.0, step_wall_us=6050.0,
                                                            prefill_device_us=70000.0))])
TRAIN = dict(kind=gpu_tables.KIND, part="train", device="NVIDIA H100 80GB HBM3", jax_version="0.11.2",
             git_commit="abc1234", runs=[dict(name="train_0p6b", part="train", label="0.6B", rc=0, seconds=150,
                                              result=dict(rows=[dict(loss="sft", step_ms=361.2, mfu=0.196,
                                                                     device="NVIDIA H100 80GB HBM3")]))])


@pytest.fixture
def checkout(tmp_path):
  """A checkout with the two docs (prose around empty markers) and a results folder."""
  (tmp_path / "docs").mkdir()
  for doc, names in gpu_tables.DOCS.items():
    blocks = "".join(f"## {n}\n\n<!-- gpu-table:{n} -->\n<!-- /gpu-table:{n} -->\n\nprose after {n}\n" for n in names)
    (tmp_path / doc).write_text(f"# {doc}\n\nprose before\n\n{blocks}")
  results = tmp_path / "results"
  results.mkdir()
  for name, rec in (("h100_decode.json", RECORD), ("h100_profile.json", PROFILE), ("h100_train.json", TRAIN)):
    (results / name).write_text(json.dumps(rec))
  (results / "schedule_demo.json").write_text(json.dumps({"answers": [], "block_size": 32}))   # not a run: ignored
  return tmp_path, results


def test_generated_tables_name_device_versions_commit_and_format_the_rows(checkout):
  root, results = checkout
  assert gpu_tables.main(["--results", str(results), "--root", str(root)]) == 0
  text = (root / "docs/decoding_accelerator.md").read_text()
  caption = "Device NVIDIA H100 80GB HBM3, jax 0.11.2, commit abc1234 (`benchmarks/results/h100_decode.json`)"
  assert text.count(caption) == 1
  assert "| 1 | ar | 128 | 151.2 | 0.846 | 0.071 | 1.00x | 165.2 | 165.2 | 1.00x | 127.0 | 76% | 22.9 |" in text
  # a nan decode-only rate is an empty cell; a column no row has is left out
  assert "| 1 | replayed schedule | 96 | 402.5 | 0.238 | 0.071 | 2.66x |  | 573.1 | 3.47x | 24.5 |  | 25.0 |" in text
  assert "roofline_tokens_per_s" not in text
  assert "**8B, batch 1, AR: float8 weights**: `python3 benchmarks/decode_throughput.py --weight_dtype=float8_e4m3fn`" \
      " (exit status 124, 130 s; no rows)" in text
  assert "| 15 | 5,100 | 300 | 0 | 2,400 |" in text                      # profile: groups in a fixed order
  assert "prose before" in text and "prose after kernels" in text
  assert "No GPU run of this table is recorded yet" in text               # kernels: nothing recorded
  train = (root / "docs/training.md").read_text()
  assert "| loss | step ms | MFU |" in train and "| sft | 361.2 | 0.196 |" in train


def test_check_passes_once_generated_and_fails_on_a_hand_edit(checkout, capsys):
  root, results = checkout
  args = ["--results", str(results), "--root", str(root)]
  assert gpu_tables.main(args + ["--check"]) == 1            # the markers are still empty
  assert "docs/decoding_accelerator.md, docs/training.md" in capsys.readouterr().err
  gpu_tables.main(args)
  assert gpu_tables.main(args + ["--check"]) == 0
  doc = root / "docs/decoding_accelerator.md"
  doc.write_text(doc.read_text().replace("151.2", "160.0"))
  assert gpu_tables.main(args + ["--check"]) == 1
  doc.write_text(doc.read_text().replace("prose before", "other prose"))   # outside the markers: free to edit
  gpu_tables.main(args)
  assert gpu_tables.main(args + ["--check"]) == 0


def test_a_doc_without_its_markers_is_named(checkout):
  root, results = checkout
  doc = root / "docs/training.md"
  doc.write_text("# training\n")
  with pytest.raises(ValueError, match="docs/training.md: no <!-- gpu-table:train -->"):
    gpu_tables.generate(str(results), str(root))


def test_collect_merges_the_sub_runs_by_part(tmp_path):
  parts, out = tmp_path / "parts", tmp_path / "out"
  parts.mkdir()
  out.mkdir()
  (parts / "env.json").write_text(json.dumps(dict(device="NVIDIA H100 80GB HBM3", jax_version="0.11.2",
                                                  git_commit="abc1234")))
  (parts / "ar.status").write_text(json.dumps(dict(name="ar", part="decode", label="AR", rc=0, seconds=80,
                                                   command="x")))
  (parts / "ar.json").write_text(json.dumps(DECODE_RUN["result"]))
  (parts / "broken.status").write_text(json.dumps(dict(name="broken", part="decode", label="B", rc=1, seconds=5,
                                                       command="y")))
  (parts / "broken.log").write_text("\n".join(f"line {i}" for i in range(100)))
  (parts / "attn.status").write_text(json.dumps(dict(name="attn", part="kernels", label="K", rc=0, seconds=9,
                                                     command="z")))
  (parts / "attn.json").write_text(json.dumps(dict(rows=[dict(batch=1, window=1, route="splitkey", key_splits=4,
                                                              ms=0.0123, gbps=2100.0, max_abs_diff_vs_xla=0.0039)])))
  written = gpu_tables.collect(str(parts), str(out), "h100_")
  assert sorted(os.path.basename(p) for p in written) == ["h100_decode.json", "h100_kernels.json"]
  rec = json.loads((out / "h100_decode.json").read_text())
  assert (rec["kind"], rec["device"], rec["jax_version"], rec["git_commit"]) == (
      gpu_tables.KIND, "NVIDIA H100 80GB HBM3", "0.11.2", "abc1234")
  runs = {r["name"]: r for r in rec["runs"]}
  assert runs["ar"]["result"]["rows"][0]["name"] == "ar" and "tail" not in runs["ar"]
  assert runs["broken"]["result"] is None
  assert runs["broken"]["tail"][-1] == "line 99" and len(runs["broken"]["tail"]) == 40
  kernels = gpu_tables.render("kernels", gpu_tables.load_records(str(out))["kernels"])
  assert "| 1 | 1 | splitkey | 4 | 0.012 | 2,100 | 3.90e-03 |" in kernels
  (parts / "env.json").unlink()   # the probe failed: the runs' own JSON names the device
  gpu_tables.collect(str(parts), str(out), "h100_")
  assert json.loads((out / "h100_decode.json").read_text())["device"] == "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("value,spec,want", [(None, ".1f", ""), (float("nan"), ".1f", ""), (1.5, ".2fx", "1.50x"),
                                             (0.764, ".0%", "76%"), (1234.5, ",.1f", "1,234.5"), (3.0, "d", "3"),
                                             ("fused", "s", "fused")])
def test_cells(value, spec, want):
  assert gpu_tables.fmt(value, spec) == want


def test_flash_check_masks_become_a_row_per_route():
  result = dict(meta={}, ok=False, masks=dict(sft=dict(
      tokens=2048, density=0.52, ms=dict(pallas=1.25, xla=3.5), tflops=dict(pallas=180.3, xla=64.4),
      err=dict(pallas=dict(out=0.004, dq=0.006), xla=dict(out=0.003, dq=0.002)), pallas_ok=False,
      failed=dict(cudnn="XlaRuntimeError: no kernel"))))
  lines = gpu_tables.kernels_body(dict(result=result))
  assert lines[0] == ("| mask | route | tokens / row | kept pairs | fwd + bwd ms | TFLOP/s | max rel. error vs f32 | "
                      "pallas within tolerance | failed |")
  assert lines[2:] == ["| sft | cudnn | 2048 | 52% |  |  |  | False | XlaRuntimeError: no kernel |",
                       "| sft | pallas | 2048 | 52% | 1.250 | 180.3 | 6.00e-03 | False |  |",
                       "| sft | xla | 2048 | 52% | 3.500 | 64.4 | 3.00e-03 | False |  |"]
