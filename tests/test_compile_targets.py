"""The dry run's `hardware.compile_for`: every program of a run (each training stage's step and
rollouts decoder, eval's decoders, the server's slot engine) compiled, on this CPU, for a 2-GPU H100
host and a TPU v5e 2x2 slice, through the dry-run entry point; and a config too large for its
target fails with one line naming the program, the bytes it needs and the bytes a device has.

The compiles need `pip install -e ".[aot]"` and skip without it (the README's test command installs
no extra; .ci/run does). The smoke config (configs/demo.py:smoke) computing in bf16 with the 'auto'
attention route, so the programs hold the kernels each target runs.
"""

import json
import os
import subprocess
import sys

import pytest

from dgr2_jax.aot import targets
from tests.conftest import REPO_ROOT

_HAVE = {b: targets.available(b) for b in ("gpu", "tpu")}
gpu_compiler = pytest.mark.skipif(not _HAVE["gpu"], reason=f"no GPU compiler here: {targets.AOT_EXTRA} installs it")
tpu_compiler = pytest.mark.skipif(not _HAVE["tpu"], reason=f"no TPU compiler here: {targets.AOT_EXTRA} installs it")
STEPS = ("sft", "teacher_rl", "cft", "opd", "rl")
PROGRAMS = ([f"{s} step" for s in STEPS] + [f"{s} rollouts" for s in ("teacher_rl", "opd", "rl")]
            + ["eval ar", "eval threshold", "speculative", "server prefill", "server step"])


def _smoke(target: str, report: str):
  sys.path.insert(0, REPO_ROOT)
  try:
    from configs import demo
  finally:
    sys.path.pop(0)
  c = demo.get_config("smoke")
  with c.unlocked():
    c.dry_run = True
    c.model.attention_impl = "auto"
    c.model.dtype = "bfloat16"   # cuDNN's attention computes in 16 bits
    c.hardware.compile_for = target
    c.hardware.compile_report = report
  return c


def _compiled(target: str, tmp_path, capsys) -> dict:
  from dgr2_jax import main
  report = str(tmp_path / f"{target}.json")
  text = main.run(_smoke(target, report), None)
  out = capsys.readouterr().out
  for name in PROGRAMS:   # one progress line per program, then the table
    assert f"compiling {name} for {target} ..." in out, name
  assert "per-device memory (train" in text and "needed" in text
  with open(report) as f:
    data = json.load(f)
  rows = {r["program"]: r for r in data["programs"]}
  assert sorted(rows) == sorted(PROGRAMS) and data["target"] == target and data["git_commit"]
  for r in rows.values():
    assert r["fits"] and r["needed"] > 0 and r["memory"]["peak"] > 0 and r["compile_s"] >= 0, r["program"]
  return rows


# ---- the report's readers (no compiler needed) ------------------------------------------------------
KERNELS_HLO = "\n".join([
    "HloModule m", "",
    "ENTRY %main (q: bf16[8,4], k: bf16[8,4]) -> bf16[8,4] {",
    "  %q = bf16[8,4]{1,0} parameter(0)",
    "  %k = bf16[8,4]{1,0} parameter(1)",
    '  %fmha = bf16[8,4]{1,0} custom-call(%q, %k), custom_call_target="__cudnn$fmhaSoftmax"',
    '  %pallas_call.3 = bf16[8,4]{1,0} custom-call(%fmha, %k), custom_call_target="__gpu$xla.gpu.triton", '
    'backend_config={ir = "\\01", name = "split_key_decode_attention", num_warps = 4 : i32}',
    "  ROOT %splash_mha_fwd_segmented_residuals.2 = bf16[8,4]{1,0} custom-call(%pallas_call.3), "
    'custom_call_target="tpu_custom_call"',
    "}", ""])


def test_kernels_and_route_read_from_the_compiled_text():
  from dgr2_jax.aot import compile_run, hlo
  assert compile_run.kernels(KERNELS_HLO) == ["splash_mha_fwd_segmented_residuals", "split_key_decode_attention"]
  prog = hlo.Program("p", "gpu", "h100", 1, 0.0, 0.0, None, 0.0, 0.0, "", [], hlo.custom_calls(KERNELS_HLO), {},
                     KERNELS_HLO)
  assert compile_run.route(prog) == "cudnn+splash+splitkey"
  plain = hlo.Program("p", "gpu", "h100", 1, 0.0, 0.0, None, 0.0, 0.0, "", [], {}, {}, "HloModule m\n")
  assert compile_run.route(plain) == "xla"


def test_figures_extrapolate_linearly_in_depth():
  import types
  from dgr2_jax.aot import compile_run, hlo
  prog = lambda layers: types.SimpleNamespace(memory=hlo.Memory(100 + 10 * layers, 50, 7 * layers, 50, 1),
                                              flops=2.0 * layers, bytes_accessed=3.0 * layers)
  got = compile_run._extrapolate([(2, prog(2), 5), (3, prog(3), 5)], 36)
  want = compile_run._numbers(prog(36), 5)
  assert got == want and got["needed"] == 100 + 360 + 50 + 7 * 36 - 50 + 5


def test_a_program_that_does_not_fit_is_one_line():
  from dgr2_jax.aot import compile_run
  t = targets.resolve("h100x8")
  rows = [dict(program="sft step", needed=1, fits=True), dict(program="opd step", needed=96 * 2**30, fits=False),
          dict(program="rl step", needed=90 * 2**30, fits=False)]
  with pytest.raises(targets.DoesNotFit) as e:
    compile_run.check_fits(rows, t)
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith(f"opd step does not fit h100x8: it needs {96 * 2**30} bytes (96.00 GiB)")
  assert f"a device has {t.memory_bytes} bytes" in msg and "(and 1 more programs)" in msg
  compile_run.check_fits(rows[:1], t)


# ---- compiled for a GPU host and a TPU slice (the aot extra) -------------------------------------------
@gpu_compiler
def test_smoke_run_compiles_for_two_h100s(tmp_path, capsys):
  """Steps over both GPUs (data = 2: gradients all-reduced), cuDNN attention in every step, the
  split-key Triton kernel in every decoder, the server on one device."""
  rows = _compiled("h100x2", tmp_path, capsys)
  for s in STEPS:
    step = rows[f"{s} step"]
    assert step["platform"] == "gpu" and step["devices"] == 2 and step["attention"].startswith("cudnn"), step
    assert "all-reduce" in step["collectives"], step["collectives"]
  for name in ("opd rollouts", "eval threshold", "speculative", "server step"):
    assert "splitkey" in rows[name]["attention"], rows[name]
  assert rows["server step"]["devices"] == 1
  assert 0.5 < rows["sft step"]["plan_over_needed"] < 2


@tpu_compiler
def test_smoke_run_compiles_for_a_v5e_2x2_slice(tmp_path, capsys):
  """Steps over the slice's 4 chips with the TPU kernels (splash attention for SFT's causal and
  CFT's two-stream masks, the interval kernel for replay's canvases), the decoders with XLA
  attention in the loop."""
  rows = _compiled("v5e-4", tmp_path, capsys)
  for s in STEPS:
    step = rows[f"{s} step"]
    assert step["platform"] == "tpu" and step["devices"] == 4 and step["attention"] != "xla", step
  for s, kernel in (("sft", "splash"), ("cft", "splash"), ("opd", "interval"), ("rl", "interval")):
    assert kernel in rows[f"{s} step"]["attention"], rows[f"{s} step"]


@gpu_compiler
def test_a_run_too_large_for_its_target_exits_1_with_one_line(tmp_path):
  """The smoke model 4096 wide with a 2M-token vocabulary (8.2 G embedding parameters: 131 GB of f32
  train state on one H100): the SFT step does not fit; the table is printed, then one line names
  the program, the bytes it needs and the bytes the device has."""
  cmd = [sys.executable, "-m", "dgr2_jax.main", "--config=configs/demo.py:smoke", "--config.dry_run=True",
         "--config.hardware.compile_for=h100", "--config.task.demo_vocab_size=2000000",
         "--config.model.hidden_size=4096",
         "--config.pipeline.stages=('sft',)", f"--config.hardware.compile_report={tmp_path / 'r.json'}"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 1, proc.stderr[-2000:]
  line = proc.stderr.strip().splitlines()[-1]
  assert line.startswith("dgr2_jax.main: sft step does not fit h100: it needs "), line
  assert "bytes" in line and f"a device has {targets.resolve('h100').memory_bytes} bytes" in line, line
  assert "sft step" in proc.stdout and "NO" in proc.stdout


@pytest.mark.parametrize("target,fix", [("a100x8", "known targets: h100,"), ("v5p-4", "known targets: h100,")])
def test_unknown_target_is_one_line_exit_2(target, fix):
  cmd = [sys.executable, "-m", "dgr2_jax.main", "--config=configs/demo.py:smoke", "--config.dry_run=True",
         f"--config.hardware.compile_for={target}"]
  proc = subprocess.run(cmd, cwd=REPO_ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and repr(target) in lines[0] and fix in lines[0], lines


def test_compile_for_needs_a_dry_run():
  cmd = [sys.executable, "-m", "dgr2_jax.main", "--config=configs/demo.py:smoke", "--config.hardware.compile_for=h100",
         "--workdir=/tmp/unused"]
  proc = subprocess.run(cmd, cwd=REPO_ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 2 and "hardware.compile_for" in proc.stderr and "dry_run" in proc.stderr, proc.stderr


def test_committed_table_is_fresh_and_the_plan_holds_on_every_target():
  """benchmarks/results/compile_targets.json (benchmarks/compile_targets.py) renders to the table of
  docs/accelerators.md; its plan and fits are this checkout's (`--replan` changes nothing); and there
  the dry run's plan of every training step is within 10% of the compiled program's figure, on
  the GPUs and the TPU slices alike (a step the TPU compiler refused: the plan above its bound)."""
  sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
  try:
    import compile_targets
  finally:
    sys.path.pop(0)
  with open(os.path.join(REPO_ROOT, "benchmarks", "results", "compile_targets.json")) as f:
    data = json.load(f)
  with open(os.path.join(REPO_ROOT, "docs", "accelerators.md")) as f:
    assert compile_targets.markdown(data) in f.read(), "stale: python benchmarks/compile_targets.py --markdown_only"
  def planned(d):
    return {(run["config"], run["target"], row["program"]): (row["plan"], row["fits"], row["device_memory"])
            for run in d["runs"] for row in run["programs"]}
  fresh = compile_targets.replan(json.loads(json.dumps(data)))
  assert planned(fresh) == planned(data), "stale plan: python benchmarks/compile_targets.py --replan"
  names = {run["target"] for run in data["runs"]}
  assert {"h100x8", "h200x8"} <= names and sum(t.startswith("v") for t in names) >= 2, names
  steps = [(run["model"], run["target"], row) for run in data["runs"] for row in run["programs"]
           if row["kind"] == "step"]
  assert len(steps) == 10 * len(names) and data["git_commit"]
  for model, target, row in steps:
    if row.get("refused"):
      assert row["plan"] >= row["needed"], (model, target, row["program"], row["plan"], row["needed"])
    else:
      assert 0.9 <= row["plan"] / row["needed"] <= 1.1, (model, target, row["program"], row["plan"], row["needed"])


def test_a_program_the_tpu_compiler_refuses_reads_as_not_fitting():
  """XLA:TPU refuses, at compile time, a program whose buffers exceed the chip's HBM: the error's
  figure becomes the row's (lower-bound) bytes; any other error is not read as a refusal."""
  from dgr2_jax.aot import compile_run
  # As XLA:TPU words it (the OPD step of Qwen3-8B compiled for v6e-8).
  msg = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (36.72G) "
         "exceeds available HBM (31.25G).")
  assert compile_run.refused_bytes(RuntimeError(msg)) == (int(36.72 * 2**30), "HLO temporaries")
  assert compile_run.refused_bytes(RuntimeError("INTERNAL: Mosaic failed to compile")) is None
