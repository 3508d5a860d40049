"""The pipeline's stage order and model chain: which model directory each stage writes and reads.

Below `stages/` (the stages, the server and the benchmarks read it; stages/common.py re-exports it).
"""

from __future__ import annotations

import os

ORDER = ("data", "sids", "retriever", "traces", "sft", "teacher_rl", "convert", "cft", "opd", "rl",
         "eval", "bench")
MODEL_STAGES = ("sft", "teacher_rl", "convert", "cft", "opd", "rl")
AR_STAGES = ("sft", "teacher_rl")


def model_dir(workdir: str, stage: str) -> str:
  return os.path.join(workdir, stage, "model")


def enabled_stages(config) -> tuple:
  return tuple(config.pipeline.stages) if "pipeline" in config else ORDER


def teacher_stage(config) -> str:
  """The AR teacher's stage: `teacher_rl` (SFT then RL, the paper's GR2) when the pipeline runs
  it, else `sft`."""
  return "teacher_rl" if "teacher_rl" in enabled_stages(config) else "sft"


def teacher_model_dir(config, workdir: str) -> str:
  return model_dir(workdir, teacher_stage(config))


def final_model_stage(config) -> str | None:
  """The last diffusion model stage of the chain (what the frontier benchmarks and the server
  serve)."""
  on = [s for s in MODEL_STAGES if s in enabled_stages(config) and s not in AR_STAGES]
  return on[-1] if on else None
