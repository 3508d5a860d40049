"""Dry run from the command line: the device mesh and a per-device memory plan for a config.

  python launch/dry_run.py --config=configs/beauty_qwen3_8b.py
  python launch/dry_run.py --config=configs/beauty_qwen3_8b.py --config.hardware.compile_for=h100x8

Exactly `python -m dgr2_jax.main --config=... --config.dry_run=True` (its checks, its one-line
errors and exit statuses); the planner is `dgr2_jax/train/dry_run.py`.
"""

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if __name__ == "__main__":
  sys.argv.append("--config.dry_run=True")
  runpy.run_module("dgr2_jax.main", run_name="__main__", alter_sys=True)
