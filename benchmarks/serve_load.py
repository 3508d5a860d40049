"""Latency under load: the re-ranking server at Poisson arrival rates, three admission policies.

  python benchmarks/serve_load.py --config=configs/demo.py --workdir=/tmp/dgr2_demo \
      --rates=2,4,8 --requests=64 --plot=docs/serve_latency.png

For each admission policy (`--policies`, default continuous,block,static: engine.py; POLICY/noexit
runs it with the engine's early_exit off, every round all `--steps_per_round` steps) it starts
`python -m dgr2_jax.serve` on the workdir (127.0.0.1, a free port) and, per mode (`--modes`) and
arrival rate (`--rates`, requests/s), sends `--requests` impressions replayed from the workdir's
test split (the eval stage's, cycled) as an open-loop Poisson process: request i is sent at its
arrival time whether or not earlier ones were answered (concurrent clients, at most
`--max_in_flight` open). Per (policy, mode, rate) it prints completed requests, throughput
(answers/s over the window from the first arrival to the last answer), client-side p50 / p95 / p99
latency, errors (non-200: 429 queue full, 504 deadline) and the engine's wasted row-iterations
(slot-iterations that decoded nothing while requests waited, from /metrics), the engine's rounds and
the mean time a request waited for a slot vs decoded in it (engine side). Every request has
`--timeout_s`; each server is stopped (SIGTERM, drained) after its rows. `--json_out` writes the
rows; `--plot` draws p99 (solid) and p50 (dashed) latency against throughput per policy and mode.
Numbers depend on the machine; they compare the policies side by side in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from dgr2_jax.serve import client  # noqa: E402


def percentile(xs, q):
  return float(np.percentile(xs, q)) if len(xs) else float("nan")


async def _load(url: str, bodies: list, rate: float, seed: int, max_in_flight: int, timeout_s: float):
  """Open-loop Poisson arrivals -> (latencies of 200s [s], statuses, window seconds)."""
  import httpx
  rng = np.random.default_rng(seed)
  arrivals = np.cumsum(rng.exponential(1.0 / rate, len(bodies)))
  lat, codes = [], []
  sem = asyncio.Semaphore(max_in_flight)
  limits = httpx.Limits(max_connections=max_in_flight, max_keepalive_connections=max_in_flight)
  async with httpx.AsyncClient(timeout=timeout_s + 30, limits=limits) as http:
    t0 = time.monotonic()
    last = [t0]

    async def one(at, body):
      await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
      async with sem:
        t = time.monotonic()
        try:
          r = await http.post(url + "/v1/rerank", json=body)
          code = r.status_code
        except httpx.HTTPError:
          code = -1
        end = time.monotonic()
        codes.append(code)
        if code == 200:
          lat.append(end - t)
          last[0] = max(last[0], end)
    await asyncio.gather(*(one(a, b) for a, b in zip(arrivals, bodies)))
  return lat, codes, last[0] - t0


def run_policy(args, policy: str, bodies_by_mode: dict) -> list[dict]:
  import httpx
  port = client.free_port()
  env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  server_args = [f"--config={args.config}", f"--workdir={args.workdir}", f"--slots={args.slots}",
                 f"--steps_per_round={args.steps_per_round}", f"--policy={policy.split('/')[0]}",
                 f"--max_queue={args.max_queue}", f"--modes={','.join(args.modes)}"] + args.server_args
  if policy.endswith("/noexit"):   # rounds run all --steps_per_round steps (engine.py early_exit off)
    server_args.append("--noearly_exit")
  print(f"serve_load: starting the server (policy {policy})", flush=True)
  proc, url = client.start_server(server_args, port, env=env, cwd=REPO, ready_timeout=args.ready_timeout)
  rows = []
  try:
    for mode in args.modes:
      for rate in args.rates:
        m0 = httpx.get(url + "/metrics", timeout=30).text
        bodies = [dict(b, mode=mode, timeout_s=args.timeout_s) for b in bodies_by_mode]
        lat, codes, window = asyncio.run(_load(url, bodies, rate, args.seed, args.max_in_flight, args.timeout_s))
        m1 = httpx.get(url + "/metrics", timeout=30).text
        delta = lambda name: (client.metric_value(m1, name, mode=mode) - client.metric_value(m0, name, mode=mode))
        row = dict(policy=policy, mode=mode, rate=rate, sent=len(bodies), ok=len(lat),
                   errors=len(codes) - len(lat), throughput=len(lat) / window if window > 0 else 0.0,
                   p50_ms=1e3 * percentile(lat, 50), p95_ms=1e3 * percentile(lat, 95),
                   p99_ms=1e3 * percentile(lat, 99),
                   wasted_row_iterations=delta("dgr2_wasted_row_iterations_total"),
                   row_iterations=delta("dgr2_row_iterations_total"),
                   rounds=delta("dgr2_rounds_total"))
        fin = delta("dgr2_finished_requests_total")
        row.update(queue_ms=1e3 * delta("dgr2_queue_seconds_total") / fin if fin else float("nan"),
                   decode_ms=1e3 * delta("dgr2_service_seconds_total") / fin if fin else float("nan"))
        rows.append(row)
        print(fmt_row(row), flush=True)
  finally:
    client.stop_server(proc)
  return rows


HEADER = ("| policy | mode | rate (req/s) | ok/sent | errors | throughput (req/s) | p50 ms | p95 ms | p99 ms "
          "| mean queue ms | mean decode ms | rounds | wasted row-iters / row-iters |")


def fmt_row(r: dict) -> str:
  return (f"| {r['policy']} | {r['mode']} | {r['rate']:g} | {r['ok']}/{r['sent']} | {r['errors']} | "
          f"{r['throughput']:.2f} | {r['p50_ms']:.0f} | {r['p95_ms']:.0f} | {r['p99_ms']:.0f} | "
          f"{r.get('queue_ms', float('nan')):.0f} | {r.get('decode_ms', float('nan')):.0f} | "
          f"{r.get('rounds', 0):.0f} | {r['wasted_row_iterations']:.0f} / {r['row_iterations']:.0f} |")


def plot(rows, path: str):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  modes = sorted({r["mode"] for r in rows})
  fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 4), squeeze=False)
  for ax, mode in zip(axes[0], modes):
    for k, policy in enumerate(dict.fromkeys(r["policy"] for r in rows)):
      rs = [r for r in rows if r["mode"] == mode and r["policy"] == policy]
      x = [r["throughput"] for r in rs]
      ax.plot(x, [r["p99_ms"] for r in rs], "o-", color=f"C{k}", label=f"{policy} p99")
      ax.plot(x, [r["p50_ms"] for r in rs], "x--", color=f"C{k}", label=f"{policy} p50")
    ax.set_xlabel("throughput (answers/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.set_title(f"mode {mode}")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f"serve_load: plot -> {path}", flush=True)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", required=True)
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--modes", default="threshold,ar,speculative")
  ap.add_argument("--policies", default="continuous,block,static")
  ap.add_argument("--rates", default="1,2,4", help="arrival rates, requests/s")
  ap.add_argument("--requests", type=int, default=32, help="requests per (mode, rate)")
  ap.add_argument("--slots", type=int, default=8)
  ap.add_argument("--steps_per_round", type=int, default=8)
  ap.add_argument("--max_queue", type=int, default=1024)
  ap.add_argument("--max_in_flight", type=int, default=256)
  ap.add_argument("--timeout_s", type=float, default=300.0)
  ap.add_argument("--ready_timeout", type=float, default=1200.0)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--json_out", default="")
  ap.add_argument("--plot", default="")
  ap.add_argument("--server_args", nargs="*", default=[], help="more server flags (--config.x=y overrides)")
  args = ap.parse_args(argv)
  args.modes = [m for m in args.modes.split(",") if m]
  args.rates = [float(r) for r in args.rates.split(",") if r]
  policies = [p for p in args.policies.split(",") if p]
  if args.requests < 1 or any(r <= 0 for r in args.rates):
    sys.exit("serve_load: --requests and every --rates value must be > 0")
  imps = client.impressions(args.workdir)
  if not imps:
    sys.exit(f"serve_load: {args.workdir} has no test impressions")
  bodies = [imps[i % len(imps)] for i in range(args.requests)]
  rows = []
  for policy in policies:
    rows += run_policy(args, policy, bodies)
  print("\n" + HEADER + "\n" + "|---" * 13 + "|")
  for r in rows:
    print(fmt_row(r))
  if args.json_out:
    with open(args.json_out, "w") as f:
      json.dump(rows, f, indent=1)
  if args.plot:
    plot(rows, args.plot)


if __name__ == "__main__":
  main()
