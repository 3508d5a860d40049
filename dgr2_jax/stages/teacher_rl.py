"""Stage `teacher_rl`: the GR2 teacher's RL stage, GRPO/DAPO on the AR re-ranker after SFT.

The paper's starting point is the AR re-ranker after SFT *and* RL (rank-promotion reward plus the
conditional format reward, DAPO). This stage runs the trajectory-replay trainer of the `rl` stage
(`rl.train_grpo`) on the SFT model with B = 1 rollouts and replay (AR decoding: block size 1,
tau 1) and the settings of `config.teacher_rl` (the paper's defaults: G = 8, clip 0.2, alpha 0.2,
its own lr and steps; see `configs/base.py`). Reads `config.teacher_rl.init_from` ('' =
`workdir/sft/model`) and the train split's prompts; writes `workdir/teacher_rl/model` and its
training history. Its model is the AR teacher from then on (`pipeline.teacher_stage`): `convert`
starts from it, OPD distils from it, the ladder's and frontier's `ar` rows decode it, and the
speculative decoder verifies with it; the ladder keeps the SFT model as `ar_sft`.
"""

from __future__ import annotations

STAGE = "teacher_rl"


def run(config, workdir: str) -> str:
  from dgr2_jax.stages import opd as opd_stage
  from dgr2_jax.stages import pipeline
  from dgr2_jax.stages import rl as rl_stage
  from dgr2_jax.train import grpo
  rc = opd_stage.section(config, STAGE, grpo.rl_config)
  src = rc.init_from or pipeline.previous_model_dir(config, workdir, STAGE)
  return rl_stage.train_grpo(config, workdir, STAGE, rc, src, decode_overrides={"block_size": 1, "threshold": 1.0})
