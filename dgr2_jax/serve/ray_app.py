"""Replicas of the re-ranking server behind Ray Serve: the same HTTP API, one model copy per replica.

  pip install -e ".[serve-ray]"
  python -m dgr2_jax.serve.ray_app --config=configs/demo.py --workdir=/tmp/dgr2_demo --replicas=2 --port=8000

Takes the server's flags (serve/cli.py) plus `--replicas`, `--ray_address` (empty: a local Ray
instance; `auto` or `ray://HOST:10001`: an existing cluster), `--replica_cpus` and `--replica_gpus`
(resources per replica: one replica per accelerator with `--replica_gpus=1`). Each replica builds
the whole app (serve/app.py, its models and engines) before Ray counts it as started; Ray's proxy
on `--host:--port` routes each request to a replica. The workdir must be readable from every node.
`/metrics` and `/readyz` answer for the replica that takes the request. SIGTERM / Ctrl-C: Ray Serve
drains the replicas and shuts down.
"""

from __future__ import annotations

import signal
import threading


def deployment(launch, replicas: int, replica_cpus: float = 1.0, replica_gpus: float = 0.0):
  """The Ray Serve deployment (not yet bound) of `replicas` copies of the server of `launch`."""
  from ray import serve
  from dgr2_jax.serve import cli

  def build():
    from dgr2_jax.serve import app as app_lib
    return app_lib.build_app(cli.make_service(launch), max_body_bytes=launch.max_body_bytes, preload=True)

  return serve.deployment(serve.ingress(build)(), name="dgr2_rerank", num_replicas=replicas,
                          max_ongoing_requests=4 * launch.options.max_queue,
                          ray_actor_options={"num_cpus": replica_cpus, "num_gpus": replica_gpus})


def main():
  from dgr2_jax.serve import cli

  def extra(flags):
    return dict(replicas=flags.DEFINE_integer("replicas", 2, "Server replicas."),
                ray_address=flags.DEFINE_string("ray_address", "", "Ray cluster ('' = start a local instance)."),
                replica_cpus=flags.DEFINE_float("replica_cpus", 1.0, "CPUs reserved per replica."),
                replica_gpus=flags.DEFINE_float("replica_gpus", 0.0, "GPUs per replica."))
  launch = cli.parse("dgr2_jax.serve.ray_app", extra)
  if launch.extra["replicas"] < 1:
    raise SystemExit(f"dgr2_jax.serve.ray_app: --replicas must be >= 1, got {launch.extra['replicas']}")
  import ray
  from ray import serve
  ray.init(address=launch.extra["ray_address"] or None, include_dashboard=False)
  serve.start(http_options={"host": launch.host, "port": launch.port})
  dep = deployment(launch, launch.extra["replicas"], launch.extra["replica_cpus"], launch.extra["replica_gpus"])
  serve.run(dep.bind(), name="dgr2", route_prefix="/")
  print(f"dgr2_jax.serve.ray_app: ready ({launch.extra['replicas']} replicas on {launch.host}:{launch.port})",
        flush=True)
  stop = threading.Event()
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda *_: stop.set())
  stop.wait()
  serve.shutdown()
  ray.shutdown()


if __name__ == "__main__":
  main()
