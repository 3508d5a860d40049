"""The full config tree every stage reads, composed of the sections their owners define.

Each section's defaults and checks live in one module, its owner (the `validate` there is what
`dgr2_jax.main` runs on the section): `data`, `sids`, `retriever` (dgr2_jax/data/config.py),
`task`, `eval` (dgr2_jax/task/config.py), `train` (dgr2_jax/train/config.py), `model`
(dgr2_jax/model/config.py), `decode` (dgr2_jax/decode/config.py, beside `DecodeConfig`), `cft`
(dgr2_jax/train/cft.py), `teacher_rl`, `rl` (dgr2_jax/train/grpo.py), `opd` (dgr2_jax/train/opd.py),
`bench` (dgr2_jax/stages/bench.py), `pipeline` (dgr2_jax/stages/pipeline.py), `hardware`
(dgr2_jax/train/dry_run.py). Only the top-level fields are set here.

Presets (`demo.py`, `beauty_*.py`) start from `get_config()` and override fields;
`apply_variants(config, arg)` implements the ablation presets selected with the `file.py:arg`
convention of `ml_collections.config_flags` (e.g. `configs/demo.py:no_cft,block8`).

Config files are loaded by path, not imported as a package, so each preset puts the repository
root on sys.path before `from configs import base` (works from any working directory).
"""

import ml_collections

from dgr2_jax.data import config as data_config
from dgr2_jax.decode import config as decode_config
from dgr2_jax.model import config as model_config
from dgr2_jax.stages import bench, pipeline
from dgr2_jax.task import config as task_config
from dgr2_jax.train import cft, dry_run, grpo, opd
from dgr2_jax.train import config as train_config


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.stage = "pipeline"  # 'pipeline' (every stage of pipeline.stages), one stage, or 'generate'
  c.seed = 0  # seed of every random choice of the run
  c.dry_run = False  # print the mesh and per-device memory plan, then exit (allocates nothing)
  c.data = data_config.data_config()
  c.sids = data_config.sids_config()
  c.retriever = data_config.retriever_config()
  c.task = task_config.task_config()
  c.eval = task_config.eval_config()
  c.train = train_config.train_config()
  c.model = model_config.model_config()
  c.decode = decode_config.decode_config()
  c.cft = cft.cft_config()
  c.teacher_rl = grpo.teacher_rl_config()
  c.opd = opd.opd_config()
  c.rl = grpo.rl_config()
  c.bench = bench.bench_config()
  c.pipeline = pipeline.pipeline_config()
  c.hardware = dry_run.hardware_config()
  return c


# ---- ablation presets ---------------------------------------------------------------------------
def _drop(config, *stages):
  config.pipeline.stages = tuple(s for s in config.pipeline.stages if s not in stages)


def _block(config, b: int):
  config.cft.block_size = b
  config.decode.block_size = b
  config.bench.block_sizes = (b,)


VARIANTS = {
    "": lambda c: None,
    "full": lambda c: None,
    "no_cft": lambda c: _drop(c, "cft"),          # naive conversion -> OPD -> RL
    "no_teacher_rl": lambda c: _drop(c, "teacher_rl"),  # the SFT model is the AR teacher
    "cft_only": lambda c: _drop(c, "opd", "rl"),
    "opd_no_rl": lambda c: _drop(c, "rl"),
    "rl_no_opd": lambda c: _drop(c, "opd"),
    "weight_none": lambda c: setattr(c.cft, "loss_weighting", "none"),
    "complementary": lambda c: setattr(c.cft, "complementary_mask", True),
    **{f"block{b}": (lambda c, b=b: _block(c, b)) for b in (4, 8, 16, 32, 64)},
}


def apply_variants(config, arg) -> ml_collections.ConfigDict:
  """Applies comma-separated ablation presets (`no_cft,block8`); unknown names fail."""
  for name in [a.strip() for a in (arg or "").split(",")]:
    if name not in VARIANTS:
      raise ValueError(f"unknown config preset {name!r}; known: {sorted(k for k in VARIANTS if k)}")
    VARIANTS[name](config)
  return config
