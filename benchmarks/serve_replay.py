"""Replay evaluated impressions against the server: each answer's ranking vs the eval stage's.

  python benchmarks/serve_replay.py --config=configs/demo.py --workdir=/tmp/dgr2_demo --replay=256

Starts `python -m dgr2_jax.serve` on the workdir (127.0.0.1, a free port, `--slots`,
`--steps_per_round`, continuous admission unless `--server_args` say otherwise) and, per mode
(`--modes`), sends the first `--replay` rows of the matching eval `predictions.jsonl` as /v1/rerank
requests, all at once (concurrent clients: they share slots in whatever order the server admits
them). The matching eval directory of a mode is its accuracy-ladder row (stages/pipeline.py
`ladder_methods`): `threshold` -> the final diffusion model's row (asked for at its decode tau),
`ar` -> the AR teacher's row ('ar'), `speculative` -> 'speculative'. The expected ranking of a row
is its parsed ranking when valid, else the retriever's order (the server's fallback). Prints, per
mode, how many answers have the expected ranking, and how many speculative answers equal the ar
answers; exits 1 when any differs. `--json_out` writes the counts and the first mismatches.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from dgr2_jax import chain  # noqa: E402
from dgr2_jax.serve import client  # noqa: E402


def load_config(spec: str):
  """configs/x.py[:arg] -> the file's get_config(arg) (as main's --config reads it)."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    sys.exit(f"serve_replay: --config: no such file {path!r}")
  mod_spec = importlib.util.spec_from_file_location("_serve_replay_config", path)
  mod = importlib.util.module_from_spec(mod_spec)
  mod_spec.loader.exec_module(mod)
  return mod.get_config(arg) if arg else mod.get_config()


def eval_dirs(config, workdir: str) -> dict:
  """mode -> the eval directory of the ladder row it must reproduce (module docstring)."""
  from dgr2_jax.stages import pipeline
  methods = pipeline.ladder_methods(config)
  final, teacher = chain.final_model_stage(config), chain.teacher_stage(config)
  out = {}
  for method, stage in methods:
    if method == "speculative":
      out["speculative"] = method
    elif stage == final:
      out["threshold"] = method
    elif stage == teacher:
      out["ar"] = method
  return {m: os.path.join(workdir, "eval", d) for m, d in out.items()}


def expected(pred_path: str, n: int, imps: list) -> tuple[list, list]:
  """(request bodies, expected rankings) of the first n rows of a predictions.jsonl."""
  bodies, want = [], []
  with open(pred_path) as f:
    for i, line in enumerate(f):
      if i >= n:
        break
      r = json.loads(line)
      if "candidates" in r:
        body = dict(history=r["history"], candidates=r["candidates"])
      else:   # rows of an older eval: the eval stage's order is client.impressions'
        body = imps[i]
      bodies.append(body)
      want.append(r["ranking_items"] if r.get("ranking_items") is not None else list(body["candidates"]))
  return bodies, want


async def _send_all(url: str, bodies: list, timeout_s: float) -> list:
  import httpx
  limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
  async with httpx.AsyncClient(timeout=timeout_s + 30, limits=limits) as http:
    async def one(body):
      r = await http.post(url + "/v1/rerank", json=body)
      return r.json() if r.status_code == 200 else dict(error=r.status_code, text=r.text[:200])
    return await asyncio.gather(*(one(b) for b in bodies))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", required=True)
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--replay", type=int, default=256, help="impressions per mode")
  ap.add_argument("--modes", default="threshold,speculative,ar")
  ap.add_argument("--slots", type=int, default=8)
  ap.add_argument("--steps_per_round", type=int, default=8)
  ap.add_argument("--timeout_s", type=float, default=600.0)
  ap.add_argument("--ready_timeout", type=float, default=1200.0)
  ap.add_argument("--json_out", default="")
  ap.add_argument("--server_args", nargs="*", default=[], help="more server flags (--config.x=y overrides)")
  args = ap.parse_args(argv)
  modes = [m for m in args.modes.split(",") if m]
  if args.replay < 1:
    sys.exit("serve_replay: --replay must be >= 1")
  config = load_config(args.config)
  dirs = eval_dirs(config, args.workdir)
  for m in modes:
    path = os.path.join(dirs.get(m, ""), "predictions.jsonl")
    if m not in dirs or not os.path.isfile(path):
      sys.exit(f"serve_replay: mode {m}: no eval predictions {path!r} (run the pipeline's eval ladder first)")
  imps = client.impressions(args.workdir)
  env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  server_args = [f"--config={args.config}", f"--workdir={args.workdir}", f"--slots={args.slots}",
                 f"--steps_per_round={args.steps_per_round}", f"--modes={','.join(modes)}",
                 f"--max_queue={max(args.replay, 1)}", f"--default_timeout_s={args.timeout_s}"]
  if "threshold" in modes:   # the step budget the ladder row was decoded with (its tau goes per request)
    server_args.append(f"--config.decode.steps_per_block={client.eval_decode(dirs['threshold'])['steps_per_block']}")
  server_args += args.server_args
  print(f"serve_replay: starting the server ({' '.join(server_args)})", flush=True)
  proc, url = client.start_server(server_args, client.free_port(), env=env, cwd=REPO,
                                  ready_timeout=args.ready_timeout)
  report, answers = {}, {}
  try:
    for m in modes:
      bodies, want = expected(os.path.join(dirs[m], "predictions.jsonl"), args.replay, imps)
      if m == "threshold":
        tau = client.eval_threshold(dirs[m])   # read once, not once per body
        bodies = [dict(b, threshold=tau) for b in bodies]
      t0 = time.monotonic()
      got = asyncio.run(_send_all(url, [dict(b, mode=m) for b in bodies], args.timeout_s))
      dt = time.monotonic() - t0
      answers[m] = got
      same = [g.get("ranking") == w for g, w in zip(got, want)]
      report[m] = dict(eval_dir=dirs[m], equal=sum(same), n=len(same), seconds=round(dt, 1),
                       errors=sum("error" in g for g in got),
                       mismatches=[dict(row=i, got=g, want=w) for i, (g, w, s) in enumerate(zip(got, want, same))
                                   if not s][:5])
      print(f"serve_replay: {m}: {sum(same)}/{len(same)} rankings equal to {dirs[m]}/predictions.jsonl "
            f"({report[m]['errors']} errors, {dt:.1f} s)", flush=True)
  finally:
    client.stop_server(proc)
  if "speculative" in answers and "ar" in answers:
    n = min(len(answers["speculative"]), len(answers["ar"]))
    eq = sum(answers["speculative"][i].get("ranking") == answers["ar"][i].get("ranking")
             and answers["speculative"][i].get("reasoning") == answers["ar"][i].get("reasoning") for i in range(n))
    report["speculative_equals_ar"] = dict(equal=eq, n=n)
    print(f"serve_replay: speculative answers equal to ar answers (ranking and reasoning): {eq}/{n}", flush=True)
  if args.json_out:
    with open(args.json_out, "w") as f:
      json.dump(report, f, indent=1)
  bad = any(report[m]["equal"] != report[m]["n"] for m in modes)
  if "speculative_equals_ar" in report:
    bad |= report["speculative_equals_ar"]["equal"] != report["speculative_equals_ar"]["n"]
  sys.exit(1 if bad else 0)


if __name__ == "__main__":
  main()
