"""Replicas of the re-ranking server behind Ray Serve: the same HTTP API, one model copy per replica.

  pip install -e ".[serve-ray]"
  python -m dgr2_jax.serve.ray_app --config=configs/demo.py --workdir=/tmp/dgr2_demo --replicas=2 --port=8000

Takes the server's flags (serve/cli.py) plus `--replicas`, `--ray_address` (empty: a local Ray
instance; `auto` or `ray://HOST:10001`: an existing cluster), `--replica_cpus` and `--replica_gpus`
(resources per replica: one replica per accelerator with `--replica_gpus=1`). Each replica builds
the whole app (serve/app.py, its models and engines) before Ray counts it as started; Ray's proxy
on `--host:--port` routes each request to a replica. The workdir must be readable from every node.
`/metrics` and `/readyz` answer for the replica that takes the request.

Shutdown: the launcher runs the Ray driver (and so a local Ray instance's GCS, raylet and workers)
in a session of its own and forwards SIGTERM / SIGINT to it. A supervisor signals the launcher's
whole process group; were Ray's processes in it, they would die before Serve could drain. The
driver, signalled, closes intake (the replicas answer new requests 503 at once), waits up to
`DRAIN_S` for the replicas to answer the requests they hold, then shuts Serve and Ray down and
exits 0.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time

_DRIVER_ENV = "DGR2_RAY_DRIVER"     # set in the driver process the launcher starts
_PR_SET_PDEATHSIG = 1
DRAIN_S = 8.0                       # longest wait for the requests taken before Serve shuts down


class Intake:
  """Whether the replicas take requests, and how many each holds (a Ray actor owned by the driver:
  replicas report to it every `REPORT_S` and read whether intake is closed)."""

  def __init__(self):
    self.closed = False
    self.held = {}         # replica -> requests it holds
    self.acked = set()     # replicas that reported after the close

  def close(self):
    self.closed = True

  def report(self, replica: str, held: int) -> bool:
    self.held[replica] = held
    if self.closed:
      self.acked.add(replica)
    return self.closed

  def drained(self, replicas: int) -> bool:
    """Every replica saw the close and holds no request."""
    return len(self.acked) >= replicas and not any(self.held[r] for r in self.acked)


REPORT_S = 0.2


def follow_intake(intake, api):
  """In a replica: a thread reporting the app's held requests to `intake` every REPORT_S and
  stopping the app's intake once `intake` is closed (until the driver is gone)."""
  import ray   # the optional `serve-ray` extra
  name = f"{socket.gethostname()}:{os.getpid()}"

  def loop():
    while True:
      try:
        closed = ray.get(intake.report.remote(name, api.in_flight), timeout=10)
      except Exception:  # pylint: disable=broad-except  # the driver and its actor are gone
        return
      if closed and not api.draining:
        api.stop_intake()
      time.sleep(REPORT_S)
  threading.Thread(target=loop, name="dgr2-intake", daemon=True).start()


def deployment(launch, replicas: int, replica_cpus: float = 1.0, replica_gpus: float = 0.0, intake=None):
  """The Ray Serve deployment (not yet bound) of `replicas` copies of the server of `launch`; with
  `intake` (an `Intake` actor) the replicas follow it."""
  from ray import serve   # the optional `serve-ray` extra: imported where used
  from dgr2_jax.serve import app as app_lib
  from dgr2_jax.serve import cli

  def build():
    app = app_lib.build_app(cli.make_service(launch), max_body_bytes=launch.max_body_bytes, preload=True)
    if intake is not None:
      follow_intake(intake, app.state.api)
    return app

  return serve.deployment(serve.ingress(build)(), name="dgr2_rerank", num_replicas=replicas,
                          max_ongoing_requests=4 * launch.options.max_queue, graceful_shutdown_wait_loop_s=0.5,
                          ray_actor_options={"num_cpus": replica_cpus, "num_gpus": replica_gpus})


def _term_with_parent():
  """In the driver, before exec: SIGTERM (a graceful stop) when the launcher dies, even by SIGKILL."""
  if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def supervise(argv: list[str]) -> int:
  """Runs the driver (this module with `argv`) in a new session, forwards SIGTERM / SIGINT to it as
  SIGTERM, and returns its exit status."""
  driver = subprocess.Popen([sys.executable, "-m", "dgr2_jax.serve.ray_app", *argv],
                            env={**os.environ, _DRIVER_ENV: "1"}, start_new_session=True,
                            preexec_fn=_term_with_parent)

  def forward(signum, frame):
    del signum, frame
    if driver.poll() is None:
      driver.send_signal(signal.SIGTERM)
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, forward)
  rc = driver.wait()
  return 128 - rc if rc < 0 else rc


def drive():
  """Starts Ray and Serve, serves until SIGTERM / SIGINT, then shuts Serve and Ray down."""
  from dgr2_jax.serve import cli

  def extra(flags):
    return dict(replicas=flags.DEFINE_integer("replicas", 2, "Server replicas."),
                ray_address=flags.DEFINE_string("ray_address", "", "Ray cluster ('' = start a local instance)."),
                replica_cpus=flags.DEFINE_float("replica_cpus", 1.0, "CPUs reserved per replica."),
                replica_gpus=flags.DEFINE_float("replica_gpus", 0.0, "GPUs per replica."))
  launch = cli.parse("dgr2_jax.serve.ray_app", extra)
  if launch.extra["replicas"] < 1:
    raise SystemExit(f"dgr2_jax.serve.ray_app: --replicas must be >= 1, got {launch.extra['replicas']}")
  import ray   # the optional `serve-ray` extra
  from ray import serve
  stop = threading.Event()
  ray.init(address=launch.extra["ray_address"] or None, include_dashboard=False)
  for sig in (signal.SIGINT, signal.SIGTERM):    # after ray.init, which sets its own
    signal.signal(sig, lambda *_: stop.set())
  intake = ray.remote(num_cpus=0)(Intake).remote()
  serve.start(http_options={"host": launch.host, "port": launch.port})
  dep = deployment(launch, launch.extra["replicas"], launch.extra["replica_cpus"], launch.extra["replica_gpus"],
                   intake)
  serve.run(dep.bind(), name="dgr2", route_prefix="/")
  print(f"dgr2_jax.serve.ray_app: ready ({launch.extra['replicas']} replicas on {launch.host}:{launch.port})",
        flush=True)
  stop.wait()
  drain(intake, launch.extra["replicas"])
  serve.shutdown()
  ray.shutdown()


def drain(intake, replicas: int, timeout_s: float = DRAIN_S):
  """Closes intake (new requests get 503) and waits, at most `timeout_s`, for the replicas to answer
  the requests they hold: Serve's own shutdown removes the proxy at once, answers in flight with it."""
  import ray   # the optional `serve-ray` extra
  t0 = time.monotonic()
  print("dgr2_jax.serve.ray_app: stopping intake, answering the requests taken", flush=True)
  ray.get(intake.close.remote())
  while not ray.get(intake.drained.remote(replicas)) and time.monotonic() - t0 < timeout_s:
    time.sleep(REPORT_S / 2)
  print(f"dgr2_jax.serve.ray_app: drained in {time.monotonic() - t0:.1f} s; shutting down", flush=True)


def main():
  if os.environ.get(_DRIVER_ENV) == "1":
    drive()
  else:
    sys.exit(supervise(sys.argv[1:]))


if __name__ == "__main__":
  main()
