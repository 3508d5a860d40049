"""The server's command line, shared by `python -m dgr2_jax.serve` and the Ray Serve launcher."""

from __future__ import annotations

import dataclasses
import os
import sys


@dataclasses.dataclass(frozen=True)
class Launch:
  config: object            # the pipeline run's ConfigDict, overrides applied
  workdir: str
  model_dir: str
  verifier_dir: str
  host: str
  port: int
  max_body_bytes: int
  options: object           # service.ServeOptions
  extra: dict               # values of the caller's extra flags


def parse(prog: str, extra_flags=None) -> Launch:
  """Defines and parses the flags (exits with one line naming the flag on a bad one).
  `extra_flags(flags) -> {name: FlagHolder}` defines a caller's own flags."""
  from absl import flags
  from ml_collections import config_flags
  f = flags
  config_flag = config_flags.DEFINE_config_file("config", None, "The pipeline run's config (configs/*.py[:arg]).")
  workdir = f.DEFINE_string("workdir", None, "The pipeline run's work directory.")
  model_dir = f.DEFINE_string("model_dir", "", "Diffusion model to serve (default: the workdir's final one).")
  verifier_dir = f.DEFINE_string("verifier_dir", "", "AR model for modes ar/speculative (default: the teacher).")
  host = f.DEFINE_string("host", "127.0.0.1", "Interface to bind.")
  port = f.DEFINE_integer("port", 8000, "Port to bind.")
  slots = f.DEFINE_integer("slots", 8, "Rows each engine decodes together.")
  steps = f.DEFINE_integer("steps_per_round", 8, "Denoising steps per host round trip.")
  policy = f.DEFINE_enum("policy", "continuous", ["continuous", "block", "static"], "Admission policy.")
  early_exit = f.DEFINE_boolean("early_exit", True, "End a round right after a row finishes (else run all "
                                "--steps_per_round steps).")
  max_queue = f.DEFINE_integer("max_queue", 256, "Waiting requests per mode before HTTP 429.")
  modes = f.DEFINE_list("modes", "threshold,speculative,ar", "Modes to serve.")
  timeout = f.DEFINE_float("default_timeout_s", 60.0, "Deadline of a request without timeout_s.")
  max_body = f.DEFINE_integer("max_body_bytes", 1 << 16, "Larger bodies get HTTP 413.")
  extra = extra_flags(flags) if extra_flags else {}
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
  try:
    flags.FLAGS(sys.argv)
  except flags.Error as e:
    sys.exit(f"{prog}: {e}")
  except (AttributeError, KeyError) as e:  # ml_collections: unknown field reported as "'name'"
    key = str(e).strip("\"'")
    bad = [a.split("=")[0] for a in sys.argv[1:] if a.startswith("--config.") and key in a.split("=")[0].split(".")]
    sys.exit(f"{prog}: {bad[0] if bad else 'a --config override'}: no such config field ({key!r})")
  if config_flag.value is None:
    sys.exit(f"{prog}: --config is required")
  if not workdir.value or not os.path.isdir(workdir.value):
    sys.exit(f"{prog}: --workdir: {workdir.value!r} is not a directory")
  from dgr2_jax.serve import service as service_lib
  bad = [m for m in modes.value if m not in service_lib.MODES]
  if bad:
    sys.exit(f"{prog}: --modes: unknown mode {bad[0]!r} (one of {list(service_lib.MODES)})")
  for name, v in (("slots", slots.value), ("steps_per_round", steps.value), ("max_queue", max_queue.value),
                  ("max_body_bytes", max_body.value)):
    if v < 1:
      sys.exit(f"{prog}: --{name} must be >= 1, got {v}")
  if not 0 < timeout.value <= service_lib.ServeOptions.max_timeout_s:
    sys.exit(f"{prog}: --default_timeout_s must be in (0, {service_lib.ServeOptions.max_timeout_s}]")
  from dgr2_jax.decode import xla_flags
  try:   # the decode loop's GPU flags, before any JAX call (a Ray replica sets them again in `make_service`)
    xla_flags.configure_gpu_flags()
  except ValueError as e:
    sys.exit(f"{prog}: {e}")
  from dgr2_jax import console
  console.quiet(flags.FLAGS.verbosity if flags.FLAGS["verbosity"].present else -1)   # before JAX starts a backend
  config = config_flag.value
  try:   # fail before binding the socket on a missing model
    service_lib.resolve_models(config, workdir.value, model_dir.value, verifier_dir.value)
  except FileNotFoundError as e:
    sys.exit(f"{prog}: {e}")
  opts = service_lib.ServeOptions(slots=slots.value, steps_per_round=steps.value, policy=policy.value,
                                  early_exit=early_exit.value,
                                  max_queue=max_queue.value, default_timeout_s=timeout.value,
                                  modes=tuple(modes.value))
  return Launch(config, os.path.abspath(workdir.value), model_dir.value, verifier_dir.value, host.value, port.value,
                max_body.value, opts, {k: v.value for k, v in extra.items()})


def make_service(launch: Launch):
  """A function building the launch's `Service` (called where it serves: a thread, a replica)."""
  def make():
    from dgr2_jax.decode import xla_flags
    from dgr2_jax.serve import service as service_lib
    xla_flags.configure_gpu_flags()   # a replica's own process: before its first JAX call
    return service_lib.Service(launch.config, launch.workdir, launch.model_dir, launch.verifier_dir, launch.options)
  return make
