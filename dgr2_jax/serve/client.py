"""A small HTTP client of the server (tests, benchmarks/serve_load.py): impressions of a workdir's
split as /v1/rerank bodies, the eval stage's answers for them and the tau it decoded at, and server
start / stop.

Traffic goes to 127.0.0.1 only; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time


def impressions(workdir: str, split: str = "test", limit: int = 0) -> list[dict]:
  """{"history", "candidates"} of the split's evaluated impressions, in the eval stage's order
  (users whose target is among the candidates)."""
  from dgr2_jax.data import api
  from dgr2_jax.task import traces as traces_lib
  examples, _ = traces_lib.build_examples(api.load_sequences(workdir), api.load_candidates(workdir, split), split,
                                          insert_target="none")
  examples = examples[:limit] if limit else examples
  return [dict(history=e["history"], candidates=e["candidates"]) for e in examples]


def expected_rankings(predictions_path: str) -> list[list[int]]:
  """The ranking (item ids) each row of an eval `predictions.jsonl` implies: the parsed ranking
  when valid, else the retriever's order (needs the rows' `candidates`, or pass them)."""
  out = []
  with open(predictions_path) as f:
    for line in f:
      r = json.loads(line)
      out.append(r["ranking_items"] if r.get("ranking_items") is not None else r.get("candidates"))
  return out


def eval_decode(eval_dir: str) -> dict:
  """The decode settings an eval directory's rows were decoded with (its metrics.json). The ladder
  decodes its diffusion rows at `pipeline.ladder_threshold` / `ladder_steps_per_block` where they
  are set, so a replay asks for this tau and starts its server with this step budget."""
  with open(os.path.join(eval_dir, "metrics.json")) as f:
    return json.load(f)["decode"]


def eval_threshold(eval_dir: str) -> float:
  """The tau an eval directory's rows were decoded at (`eval_decode`)."""
  return float(eval_decode(eval_dir)["threshold"])


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_server(args: list[str], port: int, env=None, cwd=None, ready_timeout: float = 600.0, log=None):
  """Starts `python -m dgr2_jax.serve ARGS --host=127.0.0.1 --port=PORT`; waits for /readyz.
  -> (the process, base url). RuntimeError (with the server's output) when it exits or times out."""
  import httpx
  cmd = [sys.executable, "-m", "dgr2_jax.serve", *args, "--host=127.0.0.1", f"--port={port}"]
  out = log if log is not None else subprocess.PIPE
  proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
  url = f"http://127.0.0.1:{port}"
  t_end = time.monotonic() + ready_timeout
  while time.monotonic() < t_end:
    if proc.poll() is not None:
      raise RuntimeError(f"server exited with {proc.returncode}: {proc.stdout.read()[-3000:] if proc.stdout else ''}")
    try:
      if httpx.get(url + "/readyz", timeout=2.0).status_code == 200:
        return proc, url
    except httpx.HTTPError:
      pass
    time.sleep(0.5)
  stop_server(proc)
  raise RuntimeError(f"server not ready after {ready_timeout} s")


def stop_server(proc, timeout: float = 120.0) -> int:
  """SIGTERM (drain), then SIGKILL after `timeout`; -> exit code."""
  if proc.poll() is None:
    proc.send_signal(signal.SIGTERM)
    try:
      proc.wait(timeout)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait(10)
  return proc.returncode


def metric_value(text: str, name: str, **labels) -> float:
  """The value of one sample of a Prometheus text exposition (0.0 when absent)."""
  want = ",".join(f'{k}="{v}"' for k, v in labels.items())
  for line in text.splitlines():
    if line.startswith("#"):
      continue
    key, _, val = line.rpartition(" ")
    if key == name + (f"{{{want}}}" if want else ""):
      return float(val)
  return 0.0


