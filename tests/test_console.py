"""A command's console: its own progress and results; the libraries' INFO lines only with --verbosity=0."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# JAX reporting a backend it could not start, and tfds announcing a download for data made locally.
NOISE = ("xla_bridge", "Unable to initialize backend", "Downloading and preparing dataset", "downloaded and prepared")


def _data_stage(workdir, *flags) -> str:
  # Without JAX_PLATFORMS (the tests' conftest sets it): JAX picks its backends as on a user's machine.
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  p = subprocess.run([sys.executable, "-m", "dgr2_jax.main", "--config=configs/demo.py", "--config.stage=data",
                      f"--workdir={workdir}", *flags], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  return p.stdout + p.stderr


def test_data_stage_prints_no_library_notices(tmp_path):
  out = _data_stage(tmp_path / "quiet")
  assert [line for line in out.splitlines() if any(n in line for n in NOISE)] == [], out[-3000:]
  assert "data: users" in out          # the stage's own result
  loud = _data_stage(tmp_path / "loud", "--verbosity=0")
  assert "dataset_builder.py" in loud and "Generating dataset synthetic_seq_rec" in loud, loud[-3000:]   # tfds INFO
