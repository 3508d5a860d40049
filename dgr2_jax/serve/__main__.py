"""Starts the re-ranking server on a pipeline workdir.

  python -m dgr2_jax.serve --config=configs/demo.py --workdir=/tmp/dgr2_demo [--port=8000]

`--config` and `--config.a.b=value` overrides are the pipeline run's (prompts are rendered and
answers parsed exactly as its eval stage did); `--model_dir` / `--verifier_dir` replace the final
model and the AR teacher of the workdir's chain. See docs/serving.md.
"""

from __future__ import annotations

import contextlib
import signal


def main():
  from dgr2_jax.serve import cli
  launch = cli.parse("dgr2_jax.serve")
  import uvicorn
  from dgr2_jax.serve import app as app_lib

  class Server(uvicorn.Server):
    """uvicorn's server, but SIGTERM / SIGINT end with exit code 0 once drained (uvicorn re-raises
    the signal after its graceful shutdown, which reads as a crash to a supervisor)."""

    @contextlib.contextmanager
    def capture_signals(self):
      for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, self.handle_exit)
      yield

  app = app_lib.build_app(cli.make_service(launch), max_body_bytes=launch.max_body_bytes)
  Server(uvicorn.Config(app, host=launch.host, port=launch.port, log_level="warning",
                        timeout_graceful_shutdown=None)).run()


if __name__ == "__main__":
  main()
