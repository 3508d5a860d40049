"""The stages: one line each, in pipeline order. Everything else about a stage is its module's
`STAGE` declaration (stages/contract.py); the pipeline order, the stage table, the prerequisites
of a stage asked for alone and the host-only stages all come from here and from the declarations.

Adding a stage is its module plus one line in `PIPELINE` (or `TOOLS`, for a stage of explicit
paths outside the pipeline). A stage's name is its module's last name. Modules are imported when
their declaration is first needed, so a checkout without an optional stage runs the others.
"""

from __future__ import annotations

import importlib
import importlib.util

from dgr2_jax import chain

PIPELINE = (
    "dgr2_jax.stages.data",
    "dgr2_jax.stages.sids",
    "dgr2_jax.stages.retriever",
    "dgr2_jax.stages.traces",
    "dgr2_jax.stages.sft",
    "dgr2_jax.stages.teacher_rl",
    "dgr2_jax.stages.convert",
    "dgr2_jax.stages.cft",
    "dgr2_jax.stages.opd",
    "dgr2_jax.stages.rl",
    "dgr2_jax.stages.eval",
    "dgr2_jax.stages.bench",
)
TOOLS = (
    "dgr2_jax.stages.generate",
)
PIPELINE_MODULE = "dgr2_jax.stages.pipeline"


def _name(module: str) -> str:
  return module.rsplit(".", 1)[-1]


def derive(pipeline: tuple, tools: tuple) -> tuple[tuple, tuple, dict]:
  """(ORDER, NO_WORKDIR, STAGES) of the module lists: the pipeline order, the stages without a
  workdir, and {stage name: module} ("pipeline": every stage of config.pipeline.stages in order).
  A test that adds a stage derives them again with its module added (tests/test_stage_contract.py)."""
  return (tuple(_name(m) for m in pipeline), tuple(_name(m) for m in tools),
          {**{_name(m): m for m in pipeline + tools}, "pipeline": PIPELINE_MODULE})


# Read them as `registry.ORDER` etc. where a test may add a stage (the pipeline, the prerequisites).
ORDER, NO_WORKDIR, STAGES = derive(PIPELINE, TOOLS)


def enabled_stages(config) -> tuple:
  """The stages of `config.pipeline.stages` (every pipeline stage without a pipeline section)."""
  return tuple(config.pipeline.stages) if "pipeline" in config else ORDER


def module(name: str):
  """The module of stage `name` (imported now); clear errors for unknown or absent ones."""
  if name not in STAGES:
    raise ValueError(f"config.stage {name!r} is not a stage; known: {', '.join(STAGES)}")
  if name == "pipeline":   # it sits above the stages: stages/pipeline.py runs them, never the reverse
    raise ValueError("'pipeline' runs the stages (stages/pipeline.py `run`); it has no stage module")
  try:
    return importlib.import_module(STAGES[name])
  except ModuleNotFoundError as e:
    if e.name and STAGES[name].startswith(e.name):
      raise NotImplementedError(f"stage {name!r} is not available: module {STAGES[name]} does not "
                                "exist in this checkout") from None
    raise


def stage(name: str):
  """The `STAGE` declaration of stage `name` (a `contract.Stage`)."""
  decl = module(name).STAGE
  if decl.name != name:
    raise ValueError(f"{STAGES[name]}: declares stage {decl.name!r}, registered as {name!r}")
  return decl


def check_available(names) -> None:
  """NotImplementedError listing every stage of `names` whose module is absent (nothing imported),
  so a pipeline does not stop hours in at a stage this checkout lacks."""
  missing = [n for n in names if n in STAGES and importlib.util.find_spec(STAGES[n]) is None]
  if missing:
    raise NotImplementedError(f"stage(s) {missing} are not available in this checkout (no module "
                              f"{', '.join(STAGES[n] for n in missing)}); drop them from "
                              "config.pipeline.stages or add the module")


def host_stages() -> tuple:
  """The pipeline stages that compute on the host alone (process 0 builds them)."""
  return tuple(n for n in ORDER if stage(n).host_only)


def _reads(config, name: str) -> set:
  """The stages `name` reads directly: its declared reads, and for a chain stage without
  `<name>.init_from` every model stage before it (its starting model, the AR teacher)."""
  if importlib.util.find_spec(STAGES[name]) is None:   # an optional stage this checkout lacks reads nothing
    return set()
  decl = stage(name)
  out = set(decl.reads)
  if decl.chain and not (config.get(name) or {}).get("init_from"):
    out |= set(chain.MODEL_STAGES[:chain.MODEL_STAGES.index(name)])
  return out


def prerequisites(config, name: str) -> list[str]:
  """The enabled stages (in order) that stage `name` reads, directly or through the stages it
  reads."""
  seen, todo = set(), [name]
  while todo:
    for s in _reads(config, todo.pop()) - seen:
      seen.add(s)
      todo.append(s)
  on = enabled_stages(config)
  return [s for s in ORDER if s in seen and s in on]
