"""What a benchmark's JSON says about where it ran: device, JAX versions, git commit, XLA flags.

The commit comes from `GIT_COMMIT` when set (a device machine receives a working tree without its
.git), else from `git rev-parse` in the repository, else 'unknown'; a checkout with uncommitted
changes is marked '+dirty' (only where git can tell).
"""

from __future__ import annotations

import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit() -> str:
  if os.environ.get("GIT_COMMIT"):
    return os.environ["GIT_COMMIT"]
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


def meta() -> dict:
  """{device, device_count, backend, jax_version, jaxlib_version, git_commit, xla_flags, command_buffers}
  of this process (the key names decode_throughput.py's rows use; starts JAX's backend)."""
  import jax
  import jaxlib
  dev, flags = jax.devices()[0], os.environ.get("XLA_FLAGS", "")
  return dict(device=dev.device_kind, device_count=jax.device_count(), backend=jax.default_backend(),
              jax_version=jax.__version__, jaxlib_version=jaxlib.__version__, git_commit=git_commit(),
              xla_flags=flags, command_buffers=command_buffers(flags))


def command_buffers(xla_flags: str) -> str:
  """What XLA_FLAGS asks of XLA's command buffers (CUDA graphs): 'loops' (the decode loop graphed too,
  dgr2_jax/decode/xla_flags.py), 'none' or 'xla default'."""
  values = [f.split("=", 1)[1] if "=" in f else "" for f in xla_flags.split()
            if f.lstrip("-").split("=", 1)[0] == "xla_gpu_enable_command_buffer"]
  if not values:
    return "xla default"
  if not values[-1]:
    return "none"
  types = [t.strip().upper() for t in values[-1].split(",")]
  return "loops" if ("WHILE" in types or "+WHILE" in types) else values[-1]


def probe() -> dict:
  """This process's `meta()` and a check that a data-dependent `while` loop of matmuls (what the
  decode loop is, to XLA's command buffers) compiles, runs and matches NumPy under its XLA_FLAGS."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  rs = np.random.RandomState(0)
  w = (rs.randn(64, 64) / 8).astype(np.float32)
  x0 = rs.randn(4, 64).astype(np.float32)

  @jax.jit
  def loop(w, x, n):
    def body(c):
      i, y = c
      return i + 1, jnp.tanh(y @ w) + jnp.where(y.sum() > 0, 0.01, -0.01)
    return jax.lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), x))[1]

  want = x0.astype(np.float64)
  for _ in range(37):
    want = np.tanh(want @ w) + (0.01 if want.sum() > 0 else -0.01)
  got = np.asarray(loop(w, x0, np.int32(37)))
  err = float(np.max(np.abs(got - want)))
  return dict(meta(), probe_max_abs_err=err, probe_ok=bool(err < 1e-3))


if __name__ == "__main__":
  import argparse
  import json
  ap = argparse.ArgumentParser(description="Writes this process's device, versions and commit as JSON, after "
                               "checking that a while loop runs under its XLA_FLAGS (exit 3 if it does not match).")
  ap.add_argument("--out", required=True)
  res = probe()
  with open(ap.parse_args().out, "w") as f:
    json.dump(res, f, indent=1)
  print(json.dumps(res))
  raise SystemExit(0 if res["probe_ok"] else 3)
