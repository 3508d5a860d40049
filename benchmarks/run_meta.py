"""Writes this process's device, versions and commit as JSON (`dgr2_jax.results.run_meta`), after
checking that a data-dependent `while` loop of matmuls (what the decode loop is, to XLA's command
buffers) compiles, runs and matches NumPy under its XLA_FLAGS (exit 3 if it does not match).

  python benchmarks/run_meta.py --out env.json     # run_gpu_benchmarks.sh, once per XLA_FLAGS setting
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dgr2_jax import results  # noqa: E402


def probe() -> dict:
  """`results.run_meta()` and the while-loop check (module docstring)."""
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
  return dict(results.run_meta(), probe_max_abs_err=err, probe_ok=bool(err < 1e-3))


if __name__ == "__main__":
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", required=True)
  res = probe()
  with open(ap.parse_args().out, "w") as f:
    json.dump(res, f, indent=1)
  print(json.dumps(res))
  raise SystemExit(0 if res["probe_ok"] else 3)
