"""The pipeline's model chain: which model directory each model stage writes and reads.

Below `stages/` (the stages, the server and the benchmarks read it). The stage order itself is the
stage registry's (stages/registry.py).
"""

from __future__ import annotations

import os

MODEL_STAGES = ("sft", "teacher_rl", "convert", "cft", "opd", "rl")
AR_STAGES = ("sft", "teacher_rl")


def model_dir(workdir: str, stage: str) -> str:
  return os.path.join(workdir, stage, "model")


def enabled_models(config) -> tuple:
  """The model stages of `config.pipeline.stages` (all of them without a pipeline section)."""
  on = tuple(config.pipeline.stages) if "pipeline" in config else MODEL_STAGES
  return tuple(s for s in MODEL_STAGES if s in on)


def teacher_stage(config) -> str:
  """The AR teacher's stage: `teacher_rl` (SFT then RL, the paper's GR2) when the pipeline runs
  it, else `sft`."""
  return "teacher_rl" if "teacher_rl" in enabled_models(config) else "sft"


def teacher_model_dir(config, workdir: str) -> str:
  return model_dir(workdir, teacher_stage(config))


def final_model_stage(config) -> str | None:
  """The last diffusion model stage of the chain (what the frontier benchmarks and the server
  serve)."""
  on = [s for s in enabled_models(config) if s not in AR_STAGES]
  return on[-1] if on else None


def previous_model_stage(config, stage: str) -> str:
  """The model stage `stage` starts from: the last enabled model stage before it."""
  if stage not in MODEL_STAGES:
    raise ValueError(f"{stage!r} is not a model stage ({MODEL_STAGES})")
  on = enabled_models(config)
  # sft counts even when dropped from the list: its model may come from an earlier run.
  before = [s for s in MODEL_STAGES[:MODEL_STAGES.index(stage)] if s in on or s == "sft"]
  if not before:
    raise ValueError(f"stage {stage!r} has no model stage before it")
  return before[-1]
