"""Starts the re-ranking server on a pipeline workdir.

  python -m dgr2_jax.serve --config=configs/demo.py --workdir=/tmp/dgr2_demo [--port=8000]

`--config` and `--config.a.b=value` overrides are the pipeline run's (prompts are rendered and
answers parsed exactly as its eval stage did); `--model_dir` / `--verifier_dir` replace the final
model and the AR teacher of the workdir's chain. See docs/serving.md.
"""

from __future__ import annotations

import os
import sys


def main():
  from absl import flags
  from ml_collections import config_flags
  config_flag = config_flags.DEFINE_config_file("config", None, "The pipeline run's config (configs/*.py[:arg]).")
  f = flags
  workdir = f.DEFINE_string("workdir", None, "The pipeline run's work directory.")
  model_dir = f.DEFINE_string("model_dir", "", "Diffusion model to serve (default: the workdir's final one).")
  verifier_dir = f.DEFINE_string("verifier_dir", "", "AR model for modes ar/speculative (default: the teacher).")
  host = f.DEFINE_string("host", "127.0.0.1", "Interface to bind.")
  port = f.DEFINE_integer("port", 8000, "Port to bind.")
  slots = f.DEFINE_integer("slots", 8, "Rows each engine decodes together.")
  steps = f.DEFINE_integer("steps_per_round", 8, "Denoising steps per host round trip.")
  policy = f.DEFINE_enum("policy", "continuous", ["continuous", "block", "static"], "Admission policy.")
  max_queue = f.DEFINE_integer("max_queue", 256, "Waiting requests per mode before HTTP 429.")
  modes = f.DEFINE_list("modes", "threshold,speculative,ar", "Modes to serve.")
  timeout = f.DEFINE_float("default_timeout_s", 60.0, "Deadline of a request without timeout_s.")
  max_body = f.DEFINE_integer("max_body_bytes", 1 << 16, "Larger bodies get HTTP 413.")
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
  try:
    flags.FLAGS(sys.argv)
  except flags.Error as e:
    sys.exit(f"dgr2_jax.serve: {e}")
  except (AttributeError, KeyError) as e:
    sys.exit(f"dgr2_jax.serve: a --config override: no such config field ({str(e)!r})")
  if config_flag.value is None:
    sys.exit("dgr2_jax.serve: --config is required")
  if not workdir.value or not os.path.isdir(workdir.value):
    sys.exit(f"dgr2_jax.serve: --workdir: {workdir.value!r} is not a directory")
  from dgr2_jax.serve import service as service_lib
  bad = [m for m in modes.value if m not in service_lib.MODES]
  if bad:
    sys.exit(f"dgr2_jax.serve: --modes: unknown mode {bad[0]!r} (one of {list(service_lib.MODES)})")
  for name, v in (("slots", slots.value), ("steps_per_round", steps.value), ("max_queue", max_queue.value)):
    if v < 1:
      sys.exit(f"dgr2_jax.serve: --{name} must be >= 1, got {v}")
  config = config_flag.value
  try:   # fail before binding the socket on a missing model
    service_lib.resolve_models(config, workdir.value, model_dir.value, verifier_dir.value)
  except FileNotFoundError as e:
    sys.exit(f"dgr2_jax.serve: {e}")
  opts = service_lib.ServeOptions(slots=slots.value, steps_per_round=steps.value, policy=policy.value,
                                  max_queue=max_queue.value, default_timeout_s=timeout.value,
                                  modes=tuple(modes.value))
  import uvicorn
  from dgr2_jax.serve import app as app_lib
  _Server = _server_class()
  make = lambda: service_lib.Service(config, workdir.value, model_dir.value, verifier_dir.value, opts)
  app = app_lib.build_app(make, max_body_bytes=max_body.value)
  server = _Server(uvicorn.Config(app, host=host.value, port=port.value, log_level="warning",
                                  timeout_graceful_shutdown=None))
  server.run()


def _server_class():
  import contextlib
  import signal
  import uvicorn

  class Server(uvicorn.Server):
    """uvicorn's server, but SIGTERM / SIGINT end with exit code 0 once drained (uvicorn re-raises
    the signal after its graceful shutdown, which reads as a crash to a supervisor)."""

    @contextlib.contextmanager
    def capture_signals(self):
      for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, self.handle_exit)
      yield
  return Server


if __name__ == "__main__":
  main()
