"""Multi-process test harness: N CPU processes on this machine through launch/local_multi_process.sh
(not named `multiprocess`: that is a PyPI package `datasets` imports).

`launch(n, k, argv)` runs `argv` as n processes with k CPU devices each (the launch script sets
JAX_COORDINATOR_ADDRESS on a free port, JAX_NUM_PROCESSES, JAX_PROCESS_ID, XLA_FLAGS and
JAX_PLATFORMS=cpu); the script kills every process on the first failure, and this helper kills the
whole process group on a timeout. n = 1 runs the same command as one process (no coordinator).
A Python argv starts with sys.executable, and the script's own helper runs under it too (PYTHON):
the `python` first on PATH need not be the environment under test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO_ROOT, "launch", "local_multi_process.sh")


def launch(n: int, k: int, argv: list[str], *, env: dict | None = None, delays: tuple = (),
           timeout: float = 900, on_start=None) -> subprocess.CompletedProcess:
  """-> CompletedProcess (returncode, stdout and stderr as text) of n processes x k devices.
  `on_start(popen)` runs once the script started (its process group id is popen.pid)."""
  e = dict(os.environ)
  e.update(PYTHONPATH=REPO_ROOT, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
           DGR2_START_DELAYS=" ".join(str(d) for d in delays), PYTHON=sys.executable)
  e.pop("XLA_FLAGS", None)
  e.update(env or {})
  assert argv[0] not in ("python", "python3"), f"start {argv} with sys.executable, not the python on PATH"
  cmd = ["bash", SCRIPT, str(n), str(k), *argv]
  p = subprocess.Popen(cmd, cwd=REPO_ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, start_new_session=True)
  if on_start is not None:
    on_start(p)
  try:
    out, err = p.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(p.pid, signal.SIGKILL)
    out, err = p.communicate()
    raise AssertionError(f"{n} x {k} run of {argv} timed out after {timeout} s\n{out[-3000:]}\n{err[-3000:]}")
  return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def check(res: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
  """Asserts exit 0, showing the tail of both streams otherwise."""
  assert res.returncode == 0, (f"exit {res.returncode}\n--- stdout\n{res.stdout[-4000:]}\n"
                               f"--- stderr\n{res.stderr[-6000:]}")
  return res
