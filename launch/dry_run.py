"""Dry run from the command line: the device mesh and a per-device memory plan for a config.

  python launch/dry_run.py --config=configs/beauty_qwen3_8b.py
  python launch/dry_run.py --config=configs/beauty_qwen3_8b.py --config.hardware.compile_for=h100x8

The same as `python -m dgr2_jax.main --config=... --config.dry_run=True`; the planner is
`dgr2_jax/train/dry_run.py`.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from dgr2_jax.train import dry_run  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py[:arg]).")


def main(argv):
  del argv
  config = _CONFIG.value
  if config.hardware.get("compile_for", ""):   # every program compiled for the target too (docs/accelerators.md)
    from dgr2_jax.aot import compile_run
    compile_run.run(config)
    return
  print(dry_run.format_plan(dry_run.plan(config)), flush=True)


if __name__ == "__main__":
  app.run(main)
