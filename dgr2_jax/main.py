"""Command-line entry point: one config file, one stage (or the whole pipeline), one workdir.

  python -m dgr2_jax.main --config=configs/demo.py --workdir=/tmp/dgr2_demo
  python -m dgr2_jax.main --config=configs/demo.py:no_cft --config.stage=eval \
      --config.eval.model_dir=/tmp/dgr2_demo/cft/model --workdir=/tmp/dgr2_demo
  python -m dgr2_jax.main --config=configs/beauty_qwen3_8b.py --config.dry_run=True

Every config field can be overridden with `--config.a.b=value`. `config.stage` picks the entry
point from `STAGES`; each stage module is imported only when it runs, so a missing optional stage
does not break the others; a stage asked for alone first runs the stages it reads that the workdir
has not built. `validate` checks the config before any work and names the field of the first
problem it finds; each config section is checked by the module that owns it, main only
dispatches. `--config.dry_run=True` prints the mesh and per-device memory plan (dgr2_jax/train/dry_run.py)
and exits without allocating anything; with `--config.hardware.compile_for=TARGET` (h100x8, v5p-16, ...)
it also compiles every program of the run for that target, on no accelerator (dgr2_jax/aot/compile_run.py),
and exits 1 when one does not fit. Library logs (Orbax, TFDS, JAX) are kept at WARNING and JAX
probes no accelerator the machine lacks (dgr2_jax/console.py); `--verbosity=0` shows their INFO lines too.

Every mistake is one line on stderr naming what to fix, no traceback: exit status 2 for the
command line (a flag, a field, a value, a path, the config file), 1 for an input file that cannot
be read (`fileio.InputError`) or a stage whose inputs are missing. A training stage that gets
SIGTERM saves the step in flight and exits with 75, "requeue me" (dgr2_jax/train/preemption.py):
the same command resumes it.
"""

from __future__ import annotations

import os
import sys

# First: imports JAX with the CUDA compiler plugin's native notices dropped (dgr2_jax/console.py).
from dgr2_jax.console import quiet as quiet_logs  # benchmarks/recipe_figures.py calls main.quiet_logs too
from dgr2_jax.console import start_backends
from dgr2_jax.aot.targets import DoesNotFit
from dgr2_jax.fileio import InputError
# The allowed values live with the code that uses them (re-exported for the tests that compare).
from dgr2_jax.decode.config import KV_WRITES  # noqa: F401
from dgr2_jax.decode.config import MODES as DECODE_MODES  # noqa: F401
from dgr2_jax.model.config import ATTENTION_IMPLS  # noqa: F401
from dgr2_jax.train.cft import WEIGHTINGS as LOSS_WEIGHTINGS  # noqa: F401
from dgr2_jax.train.opd import STUDENT_CONTEXTS as OPD_STUDENT_CONTEXTS  # noqa: F401
from dgr2_jax.train.opd import TEACHER_CACHES as OPD_TEACHER_CACHES  # noqa: F401
from dgr2_jax.train.opd import TEACHERS as OPD_TEACHERS  # noqa: F401
from dgr2_jax.train import dry_run
# The stage registry (stages/registry.py: name -> module declaring `STAGE`, imported when it runs),
# read through the pipeline that chains the stages; main validates and dispatches.
from dgr2_jax.stages import pipeline
from dgr2_jax.stages.pipeline import NO_WORKDIR, ORDER, STAGES, check_available, stage_fn  # noqa: F401

USAGE, RUNTIME = 2, 1  # exit statuses: a mistake on the command line / in an input file
PROG = "dgr2_jax.main"


# ---- validation ----------------------------------------------------------------------------------
def _section_validators():
  """(name, validate(config, runs)) of every config section, each owned by its package."""
  from dgr2_jax.data import config as data_config
  from dgr2_jax.decode import config as decode_config
  from dgr2_jax.model import config as model_config
  from dgr2_jax.stages import bench, generate, pipeline
  from dgr2_jax.task import config as task_config
  from dgr2_jax.train import cft, grpo, opd
  from dgr2_jax.train import config as train_config
  return (("pipeline", pipeline.validate), ("decode", decode_config.validate),
          ("data, sids, retriever", data_config.validate), ("task", task_config.validate),
          ("cft", cft.validate), ("model", model_config.validate), ("train", train_config.validate),
          ("teacher_rl", grpo.validate_teacher_rl), ("opd", opd.validate),
          ("rl", grpo.validate), ("eval", task_config.validate_eval), ("bench", bench.validate),
          ("generate", generate.validate), ("hardware", dry_run.validate))


def _runs(config) -> set:
  """Stages this invocation will run."""
  if config.stage == "pipeline":
    return set(config.pipeline.stages)
  return {config.stage}


def validate(config, workdir: str | None) -> None:
  """Raises ValueError / FileNotFoundError naming the first bad field; does no work. Each config
  section's owner checks it (dgr2_jax/checks.py); paths only for the stages that will run (a dry
  run runs none: it reads no data)."""
  from dgr2_jax import checks
  stage = config.get("stage")
  if stage not in STAGES:
    checks.fail("stage", f"{stage!r} is not a stage; known: {', '.join(STAGES)}")
  if not config.get("dry_run", False) and stage not in NO_WORKDIR and not workdir:
    raise ValueError(f"--workdir is required for config.stage={stage!r}")
  if workdir and os.path.isfile(workdir):
    raise ValueError(f"--workdir: {workdir!r} is a file; give a directory (created if missing)")
  runs = set() if config.get("dry_run", False) else (_runs(config) if "pipeline" in config else {stage})
  if runs and stage != "pipeline":  # a stage alone also runs what it needs that is not built
    runs |= set(pipeline.missing_prerequisites(config, workdir, stage))
  for _, check in _section_validators():
    check(config, runs)


# ---- running -------------------------------------------------------------------------------------
def run(config, workdir: str | None):
  """Validates, then runs `config.stage` (or prints the dry-run plan). Returns the stage's result.

  A stage asked for alone first runs the enabled stages it reads that `workdir` has not built
  (`pipeline.missing_prerequisites`: `--config.stage=sids` in a fresh workdir builds `data` first).
  """
  validate(config, workdir)
  if config.get("dry_run", False) and config.get("hardware", {}).get("compile_for", ""):
    from dgr2_jax.aot import compile_run   # every program compiled for the target (the aot extra)
    return compile_run.run(config, workdir)
  if config.get("dry_run", False):
    text = dry_run.format_plan(dry_run.plan(config))
    print(text, flush=True)
    return text
  first = [] if config.stage == "pipeline" else pipeline.missing_prerequisites(config, workdir, config.stage)
  check_available(_runs(config) | set(first))
  if workdir:
    os.makedirs(workdir, exist_ok=True)
  for s in first:
    print(f"{PROG}: {config.stage!r} needs {s!r}, which {workdir} has not built: running it first",
          flush=True)
    stage_fn(s)(config, workdir)
  return stage_fn(config.stage)(config, workdir)


def fail(msg, status: int):
  """One line on stderr naming what to fix, and the exit status (USAGE or RUNTIME)."""
  line = f"{PROG}: {' '.join(str(msg).split())}\n"
  if status == RUNTIME:
    # A failed read can leave library threads (Orbax's event loop, tensorstore) that print their
    # own traceback while we exit: stderr goes to /dev/null first, our line to the real stderr.
    sys.stdout.flush()
    real = os.dup(2)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    os.write(real, line.encode())
    os._exit(status)
  sys.stderr.write(line)
  sys.stderr.flush()
  sys.exit(status)


def start_processes() -> None:
  """Several processes (dgr2_jax.multihost.launch_kwargs): `jax.distributed.initialize` before any
  other JAX call, and prints/logs from process 0 only. A single process: nothing."""
  from dgr2_jax import multihost
  try:
    multihost.initialize()
  except ValueError as e:  # inconsistent launch variables: one line
    fail(e, USAGE)
  start_backends()   # after jax.distributed.initialize, the CUDA compiler plugin's notices dropped
  multihost.quiet_other_processes()


def configure_xla() -> None:
  """The decode loop's GPU flags (decode/xla_flags.py: CUDA graphs of the whole loop;
  DGR2_COMMAND_BUFFERS=0 keeps XLA's defaults). XLA reads them once, when its backend starts."""
  from dgr2_jax.decode import xla_flags
  try:
    xla_flags.configure_gpu_flags()
  except ValueError as e:
    fail(e, USAGE)


def main(argv):
  from absl import flags
  configure_xla()    # before the first JAX call
  quiet_logs(flags.FLAGS.verbosity if flags.FLAGS["verbosity"].present else -1)   # before JAX starts a backend
  start_processes()  # before any other JAX call
  if len(argv) > 1:
    fail(f"unexpected arguments {argv[1:]}: every setting is a --config.<field>=value flag", USAGE)
  config = _CONFIG.value
  if config is None:
    fail("--config is required (e.g. --config=configs/demo.py)", USAGE)
  try:  # a bad config is one line, not a traceback
    validate(config, _WORKDIR.value)
  except (ValueError, FileNotFoundError) as e:
    fail(e, USAGE)
  try:  # ... and so is an input file that cannot be read, or a stage whose inputs are not built
    run(config, _WORKDIR.value)
  except (InputError, FileNotFoundError, NotImplementedError) as e:
    fail(e, RUNTIME)
  except DoesNotFit as e:   # a program compiled for hardware.compile_for that does not fit its devices
    fail(e, RUNTIME)
  except ValueError as e:
    # A value only a stage can check names its field (`config.x: ...`), as does a dry run's plan that
    # does not fit the machine (train.mesh, hardware.*); any other ValueError is a bug: traceback.
    if not (config.get("dry_run", False) or str(e).startswith("config.")):
      raise
    fail(e, USAGE)


# ---- the command line's own mistakes (before a config exists) ---------------------------------------
def config_arg(argv) -> str | None:
  """The value of --config in `argv` (either `--config=X` or `--config X`), or None."""
  for i, a in enumerate(argv):
    if a.startswith("--config="):
      return a.split("=", 1)[1]
    if a == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return None


def check_config_file(argv) -> str | None:
  """The one-line problem with the --config file itself (missing, not a .py file), or None."""
  value = config_arg(argv)
  if value is None:
    if any(a.startswith("--config.") for a in argv):
      return "--config is required before --config.<field> overrides (e.g. --config=configs/demo.py)"
    return None
  path = value.split(":", 1)[0]
  if not os.path.exists(path):
    return f"--config={value}: no such config file {path!r} (the presets are in configs/*.py)"
  if not os.path.isfile(path) or not path.endswith(".py"):
    return f"--config={value}: {path!r} is not a Python config file (e.g. configs/demo.py)"
  return None


def parse_error(e: BaseException, argv) -> str:
  """One line for an exception raised while parsing flags (and loading the config file)."""
  while isinstance(e, (AttributeError, KeyError)) and e.args and isinstance(e.args[0], BaseException):
    e = e.args[0]  # ml_collections wraps the KeyError in an AttributeError
  text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
  if isinstance(e, (AttributeError, KeyError)):  # ml_collections: unknown field "'name'\nDid you mean..."
    first, *rest = text.split("\n")
    key = first.strip("\"'")
    bad = [a.split("=")[0] for a in argv[1:]
           if a.startswith("--config.") and key in a.split("=")[0].split(".")]
    hint = (" " + " ".join(r.strip() for r in rest)) if rest else ""
    return f"{bad[0] if bad else 'a --config override'}: no such config field {key!r}.{hint}"
  if "Error whilst parsing config file" in text:  # get_config raised: keep the exception's own line
    last = [line for line in text.strip().splitlines() if line.strip()][-1]
    return f"--config={config_arg(argv)}: {last.split(': ', 1)[-1]}"
  return text.splitlines()[0] if text else type(e).__name__


if __name__ == "__main__":
  from absl import app, flags
  from ml_collections import config_flags

  _CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py[:arg]).")
  _WORKDIR = flags.DEFINE_string("workdir", None, "Work directory: every stage's outputs.")
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

  def parse(argv):
    problem = check_config_file(argv)
    if problem:
      fail(problem, USAGE)
    try:
      return flags.FLAGS(argv)
    except (flags.Error, AttributeError, KeyError, ValueError, TypeError) as e:
      fail(parse_error(e, argv), USAGE)

  app.run(main, flags_parser=parse)
