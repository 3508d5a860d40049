"""Stage `teacher_rl`: the GR2 teacher's RL stage, GRPO/DAPO on the AR re-ranker after SFT.

The paper's starting point is the AR re-ranker after SFT *and* RL (rank-promotion reward plus the
conditional format reward, DAPO). This stage runs the trajectory-replay trainer of the `rl` stage
(`rl.grpo_stage`) on the SFT model with B = 1 rollouts and replay (AR decoding: block size 1,
tau 1) and the settings of `config.teacher_rl` (the paper's defaults: G = 8, clip 0.2, alpha 0.2,
its own lr and steps: `train/grpo.teacher_rl_config`). Reads `config.teacher_rl.init_from` ('' =
`workdir/sft/model`) and the train split's prompts; writes `workdir/teacher_rl/model` and its
training history. Its model is the AR teacher from then on (`chain.teacher_stage`): `convert`
starts from it, OPD distils from it, the ladder's and frontier's `ar` rows decode it, and the
speculative decoder verifies with it; the ladder keeps the SFT model as `ar_sft`.
"""

from __future__ import annotations

from dgr2_jax.stages import contract
from dgr2_jax.stages import rl as rl_stage

# The RL stage's trainer on the AR teacher: AR rollouts (block size 1, tau 1).
AR_ROLLOUTS = {"block_size": 1, "threshold": 1.0}
STAGE = rl_stage.grpo_stage("teacher_rl", decode_overrides=AR_ROLLOUTS)


def run(config, workdir: str) -> str:
  """Trains (or reuses) `workdir/teacher_rl`; returns its path."""
  return contract.run(STAGE, config, workdir)
