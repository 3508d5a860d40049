"""The serving engine against the batch decoders, and the HTTP server as a subprocess."""

import collections
import concurrent.futures
import contextlib
import itertools
import socket
import subprocess
import threading
import time

import numpy as np
import pytest

from dgr2_jax.decode import sampler
from dgr2_jax.serve import engine as engine_lib
from dgr2_jax.serve import slots as slots_lib


def _prompts(n, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(6, 60, size=int(k)).tolist() for k in rng.integers(3, 12, size=n)]


def _serve_all(eng, reqs, timeout=300):
  sched = engine_lib.Scheduler({eng.mode: eng}).start()
  try:
    for r in reqs:
      sched.submit(eng.mode, r)
    return [r.future.result(timeout=timeout) for r in reqs]
  finally:
    sched.stop()


@pytest.fixture(scope="module")
def block_decoder(tiny_lm):
  """A 3-slot decoder of blocks of 4, 16 new tokens (shared: one compile)."""
  cfg, params = tiny_lm
  dc = sampler.decode_config_for(cfg, block_size=4, threshold=0.7, max_new_tokens=16)
  return slots_lib.SlotDecoder(cfg, params, dc, slots=3, prompt_slots=12)


def test_engine_threshold_equals_batch_decoder(tiny_lm, block_decoder):
  """Requests admitted mid-block into 3 slots (3 steps per round), each with its own tau and
  length limit, decode exactly as the batch decoder decodes them."""
  cfg, params = tiny_lm
  prompts = _prompts(7)
  taus = [0.7 if i % 2 else 1.0 for i in range(7)]
  limits = [16] * 6 + [8]
  eng = engine_lib.Engine("threshold", block_decoder, steps_per_round=3)
  reqs = [engine_lib.Request(p, threshold=t, max_new_tokens=m) for p, t, m in zip(prompts, taus, limits)]
  out = _serve_all(eng, reqs)
  for tau in (0.7, 1.0):
    ref = sampler.generate(cfg, params, prompts, sampler.decode_config_for(
        cfg, block_size=4, threshold=tau, max_new_tokens=16), max_prompt_len=12)
    for i in range(6):
      if taus[i] == tau:
        assert out[i]["output_ids"] == ref["output_ids"][i], (tau, i)
        assert out[i]["nfe"] == ref["nfe"][i], (tau, i)
  ref8 = sampler.generate(cfg, params, prompts[6:], sampler.decode_config_for(
      cfg, block_size=4, threshold=1.0, max_new_tokens=8), max_prompt_len=12)
  assert out[6]["output_ids"] == ref8["output_ids"][0]
  assert {len(o["output_ids"]) for o in out} != {16}       # some rows stop at EOS: slots get reused
  st = eng.stats
  assert st.finished == 7 and eng.occupancy() == 0 and st.rounds > 3
  assert 0 < st.busy_row_iterations <= st.row_iterations


def test_engine_ar_policies_equal_batch_decoder(tiny_lm):
  """AR decoding (block size 1) under each admission policy."""
  cfg, params = tiny_lm
  prompts = _prompts(5, seed=1)
  dc = sampler.decode_config_for(cfg, block_size=1, threshold=1.0, max_new_tokens=8)
  dec = slots_lib.SlotDecoder(cfg, params, dc, slots=2, prompt_slots=12)
  ref = sampler.generate(cfg, params, prompts, dc, max_prompt_len=12)
  for policy in engine_lib.POLICIES:
    for early_exit in (True, False):
      eng = engine_lib.Engine("ar", dec, steps_per_round=3, policy=policy, early_exit=early_exit)
      out = _serve_all(eng, [engine_lib.Request(p) for p in prompts])
      assert [o["output_ids"] for o in out] == ref["output_ids"], (policy, early_exit)


def test_engine_early_exit_ends_round_at_first_finish(block_decoder):
  """With early_exit a round of up to 100 steps ends right after the step in which a row finishes
  (the short request answers, its slot is free, the others keep their state); without it the
  round runs until every row is done."""
  p = _prompts(3, seed=2)
  for early_exit in (True, False):
    eng = engine_lib.Engine("threshold", block_decoder, steps_per_round=100, early_exit=early_exit)
    short = engine_lib.Request(p[0], max_new_tokens=4)              # one block of 4
    longs = [engine_lib.Request(q, max_new_tokens=16) for q in p[1:]]
    for r in [short, *longs]:
      eng.submit(r)
    eng.run_round()
    assert short.future.done()
    if early_exit:
      assert short.future.result(0)["steps"] <= 4 and eng.occupancy() == 2
      assert eng.stats.row_iterations == 3 * short.future.result(0)["steps"]
      while eng.run_round():
        pass
    assert all(r.future.done() for r in longs) and eng.occupancy() == 0
    assert max(r.future.result(0)["steps"] for r in longs) > short.future.result(0)["steps"]


def test_engine_deadline_and_cancel_free_slots(tiny_lm, block_decoder):
  cfg, params = tiny_lm
  eng = engine_lib.Engine("threshold", block_decoder, steps_per_round=1, max_queue=3)
  p = _prompts(7)
  expired = engine_lib.Request(p[0], deadline=time.monotonic() - 1)
  gone = engine_lib.Request(p[1])
  gone.cancel()
  ok = engine_lib.Request(p[2])
  eng.submit(expired), eng.submit(gone), eng.submit(ok)
  with pytest.raises(engine_lib.QueueFull):
    eng.submit(engine_lib.Request(p[3]))
  while eng.run_round():
    pass
  with pytest.raises(engine_lib.DeadlineExceeded):
    expired.future.result(0)
  with pytest.raises(engine_lib.Cancelled):
    gone.future.result(0)
  ref = sampler.generate(cfg, params, p, sampler.decode_config_for(   # the first test's shapes
      cfg, block_size=4, threshold=1.0, max_new_tokens=16), max_prompt_len=12)
  assert ok.future.result(0)["output_ids"] == ref["output_ids"][2]
  # A request cancelled while it holds a slot frees it at the next round.
  running = eng.submit(engine_lib.Request(p[3]))
  eng.run_round()
  assert eng.occupancy() == 1
  running.cancel()
  eng.run_round()
  assert eng.occupancy() == 0 and eng.stats.cancelled == 2 and eng.stats.expired == 1


# ---- the HTTP server as a subprocess -------------------------------------------------------------
BAD = [  # (body, status, field named in the one-line error, metrics reason)
    (b"{bad", 400, "body", "bad_json"),
    (b"[]", 400, "body", "bad_field"),
    (b'{"history": [1]}', 400, "candidates", "bad_field"),
    (b'{"history": "x", "candidates": [1]}', 400, "history", "bad_field"),
    (b'{"history": [true], "candidates": [1]}', 400, "history", "bad_field"),
    (b'{"history": [1], "candidates": [1, 2]}', 400, "candidates", "candidate_count"),
    (b'{"history": [99999], "candidates": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]}', 400, "history", "unknown_item"),
    (b'{"history": [1], "candidates": [0, 1, 2, 3, 4, 5, 6, 7, 8, -1]}', 400, "candidates", "unknown_item"),
    (b'{"history": [1], "candidates": [0, 0, 2, 3, 4, 5, 6, 7, 8, 9]}', 400, "candidates", "bad_field"),
    (b'{"history": [1], "candidates": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], "mode": "fast"}', 400, "mode", "bad_field"),
    (b'{"history": [1], "candidates": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], "threshold": 2}', 400, "threshold", "bad_field"),
    (b'{"history": [1], "candidates": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], "threshold": NaN}', 400, "threshold",
     "bad_field"),
    (b'{"history": [1], "candidates": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], "max_new_tokens": 9999}', 400,
     "max_new_tokens", "bad_field"),
    (b'{"history": [1], "candidates": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], "timeout_s": "soon"}', 400, "timeout_s",
     "bad_field"),
    (b'{"history": [1], "candidates": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], "extra": 1}', 400, "extra", "bad_field"),
    (b"x" * 70000, 413, "body", "too_large"),
]


def test_server_over_http(smoke_workdir):
  """The server on the toy pipeline's workdir: every mode answers the eval stage's test
  impressions as evaluation did (speculative = ar), bad requests interleaved with good ones get
  their 4xx with one line naming the field and are counted, a full queue answers 429 with
  Retry-After, deadlines 504, and SIGTERM lets in-flight requests finish before it exits."""
  httpx = pytest.importorskip("httpx")
  for mod in ("starlette", "uvicorn", "prometheus_client"):   # the `serve` extra
    pytest.importorskip(mod)
  import json
  import os
  from dgr2_jax.serve import client
  from dgr2_jax.task import answer as answer_lib
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", PYTHONPATH=repo)
  proc, url = client.start_server(["--config=configs/demo.py:smoke", f"--workdir={smoke_workdir}", "--slots=2",
                                   "--steps_per_round=4", "--max_queue=2"], client.free_port(), env=env, cwd=repo)
  try:
    imps = client.impressions(smoke_workdir, limit=4)
    expect, extra = {}, {}
    for mode, method in (("threshold", "cft_opd_rl"), ("ar", "ar"), ("speculative", "speculative")):
      rows = [json.loads(l) for l in open(os.path.join(smoke_workdir, "eval", method, "predictions.jsonl"))]
      assert len(rows) == len(imps)
      expect[mode] = [(r["ranking_items"] or imp["candidates"], answer_lib.split_response(r["output"])[0] or "",
                       r["nfe"]) for r, imp in zip(rows, imps)]
    # The ladder decodes its diffusion rows at pipeline.ladder_threshold: ask for that tau.
    extra["threshold"] = dict(threshold=client.eval_threshold(os.path.join(smoke_workdir, "eval", "cft_opd_rl")))
    jobs = [(mode, i) for i in range(len(imps)) for mode in expect]
    bad = iter(BAD * 2)

    def good(job):   # retries on 429 (queue of 2 per mode, 4 concurrent requests per mode)
      mode, i = job
      for _ in range(200):
        r = httpx.post(url + "/v1/rerank", json=dict(imps[i], mode=mode, timeout_s=300, **extra.get(mode, {})),
                       timeout=300)
        if r.status_code != 429:
          return r, 0
        assert r.headers["retry-after"] == "1"
        time.sleep(0.2)
      raise AssertionError("still 429 after 200 tries")

    def bad_one(_):
      body, status, field, _ = next(bad)
      r = httpx.post(url + "/v1/rerank", content=body, timeout=60)
      return r, (status, field)

    with concurrent.futures.ThreadPoolExecutor(16) as ex:
      futs = [ex.submit(good, j) for j in jobs] + [ex.submit(bad_one, k) for k in range(len(BAD) * 2)]
      results = [f.result(timeout=900) for f in futs]
    for (mode, i), (r, _) in zip(jobs, results):
      assert r.status_code == 200, r.text
      out = r.json()
      want_rank, want_reason, want_nfe = expect[mode][i]
      assert (out["ranking"], out["reasoning"], out["nfe"]) == (want_rank, want_reason, want_nfe), (mode, i)
      assert out["fallback"] == (not out["valid"]) and out["latency_ms"] > 0
    for r, (status, field) in (x for x in results[len(jobs):]):
      assert r.status_code == status, r.text
      msg = r.json()["error"]
      assert "\n" not in msg and msg.startswith(field + ":"), msg
    # A burst of 16 at once against 2 slots and a queue of 2: the overflow gets 429 + Retry-After.
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
      burst = list(ex.map(lambda k: httpx.post(url + "/v1/rerank", json=dict(imps[k % len(imps)], mode="speculative"),
                                               timeout=300), range(16)))
    codes = [r.status_code for r in burst]
    assert set(codes) == {200, 429}, codes
    assert all(r.headers["retry-after"] == "1" for r in burst if r.status_code == 429)
    n429 = codes.count(429)
    r = httpx.post(url + "/v1/rerank", json=dict(imps[0], mode="speculative", timeout_s=0.001), timeout=60)
    assert r.status_code == 504 and r.json()["error"].startswith("timeout_s:")
    gen = httpx.post(url + "/v1/generate", json={"prompt_ids": [5, 6, 7], "mode": "ar", "max_new_tokens": 8},
                     timeout=120)
    assert gen.status_code == 200 and 1 <= len(gen.json()["output_ids"]) <= 8, gen.text
    metrics = httpx.get(url + "/metrics", timeout=30).text
    for reason in {b[3] for b in BAD}:
      want = 2 * sum(b[3] == reason for b in BAD)
      assert client.metric_value(metrics, "dgr2_rejected_requests_total", reason=reason) == want, reason
    assert client.metric_value(metrics, "dgr2_rejected_requests_total", reason="deadline") == 1
    assert client.metric_value(metrics, "dgr2_rejected_requests_total", reason="queue_full") >= n429
    for mode in expect:
      assert client.metric_value(metrics, "dgr2_requests_total", endpoint="rerank", mode=mode) == (
          len(imps) + (16 - n429 if mode == "speculative" else 0))
      assert client.metric_value(metrics, "dgr2_slot_occupancy", mode=mode) == 0.0
    assert httpx.get(url + "/healthz", timeout=10).status_code == 200 and proc.poll() is None
    # SIGTERM while requests are in flight: they are answered, then the process exits cleanly.
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
      futs = [ex.submit(httpx.post, url + "/v1/rerank", json=dict(imp, mode="ar"), timeout=300)
              for imp in imps[:2]]
      time.sleep(0.5)
      assert client.stop_server(proc) == 0
      assert [f.result(timeout=300).status_code for f in futs] == [200, 200]
  finally:
    client.stop_server(proc)


def _stub_service():
  """A stand-in `Service` that is ready at once (the HTTP layer's own checks need no model)."""
  import types
  sched = types.SimpleNamespace(start=lambda: None, drain=lambda timeout: None, error=None)
  opts = types.SimpleNamespace(slots=1, steps_per_round=1, policy="continuous")
  return types.SimpleNamespace(scheduler=sched, warmup=lambda: None, modes=("threshold",), options=opts,
                               model_dir="m", verifier_dir="v", num_candidates=10, max_new_tokens=8, engines={})


@contextlib.contextmanager
def _app_on_socket(app):
  """Serves `app` with uvicorn from a thread on a free port of 127.0.0.1 -> the port."""
  uvicorn = pytest.importorskip("uvicorn")
  from dgr2_jax.serve import client
  port = client.free_port()
  server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  try:
    t_end = time.monotonic() + 60
    while not server.started:
      assert thread.is_alive() and time.monotonic() < t_end, "server did not start"
      time.sleep(0.05)
    yield port
  finally:
    server.should_exit = True
    thread.join(30)


def _post_slowly(port: int, body: bytes) -> tuple[int, bytes]:
  """POST /v1/rerank over a plain socket as a client on a slow link does it: the headers (with
  `Connection: close`), a pause in which the server sees the Content-Length, then the body in
  pieces; then the whole answer, to the server's close -> (status, answer body)."""
  with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
    s.sendall(b"POST /v1/rerank HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
    time.sleep(0.02)
    for i in range(0, len(body), 1 << 16):
      s.sendall(body[i:i + (1 << 16)])
    data = b""
    while chunk := s.recv(1 << 16):
      data += chunk
  head, _, answer = data.partition(b"\r\n\r\n")
  return int(head.split(b" ", 2)[1]), answer


def test_oversize_bodies_all_get_413():
  """20 bodies over --max_body_bytes in a row, each sent after its headers: every client reads its
  413 (the server reads the rest of the body before answering instead of closing on a client that
  is still sending), and the server still answers afterwards."""
  pytest.importorskip("starlette")
  import json
  from dgr2_jax.serve import app as app_lib
  with _app_on_socket(app_lib.build_app(_stub_service, max_body_bytes=1024)) as port:
    out = []
    for _ in range(20):
      try:
        out.append(_post_slowly(port, b"x" * (1 << 19)))
      except OSError as e:          # BrokenPipeError, ConnectionResetError: the answer was lost
        out.append((type(e).__name__, b""))
    assert [status for status, _ in out] == [413] * 20, out
    assert all(json.loads(answer)["error"].startswith("body:") for _, answer in out)
    status, answer = _post_slowly(port, b"{bad")
    assert status == 400 and json.loads(answer)["error"].startswith("body:")


def _urllib_post(url: str, body) -> int | str:
  """POST with urllib (it sends `Connection: close` and the whole body before it reads; an iterable
  body goes chunked) -> the status, or the name of the error that lost it."""
  import urllib.error
  import urllib.request
  req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(req, timeout=120) as r:
      return r.status
  except urllib.error.HTTPError as e:
    e.read()
    return e.code
  except urllib.error.URLError as e:
    return type(e.reason).__name__
  except OSError as e:
    return type(e).__name__


def test_oversize_bodies_413_for_urllib_and_httpx():
  """2 MB bodies over the default --max_body_bytes, from urllib (a new connection each, closed after
  the answer) and from one httpx client (kept-alive connections), 100 in a row and 100 from 16
  threads, plus chunked ones: each client reads its 413 (none a broken pipe or reset), and a
  kept-alive connection still serves the next request."""
  pytest.importorskip("starlette")
  httpx = pytest.importorskip("httpx")
  from dgr2_jax.serve import app as app_lib
  body = b"x" * 2_000_000

  def chunks():
    for i in range(0, len(body), 1 << 16):
      yield body[i:i + (1 << 16)]

  with _app_on_socket(app_lib.build_app(_stub_service)) as port, httpx.Client(timeout=120) as http:
    url = f"http://127.0.0.1:{port}/v1/rerank"

    def httpx_post(content) -> int | str:
      try:
        return http.post(url, content=content).status_code
      except httpx.TransportError as e:
        return type(e).__name__

    sends = {"urllib": lambda: _urllib_post(url, body), "httpx": lambda: httpx_post(body),
             "urllib chunked": lambda: _urllib_post(url, chunks()), "httpx chunked": lambda: httpx_post(chunks())}
    got = {}
    for name, send in sends.items():
      n = 100 if "chunked" not in name else 20
      got[name, "sequential"] = [send() for _ in range(n)]
      with concurrent.futures.ThreadPoolExecutor(16) as ex:
        got[name, "16 threads"] = list(ex.map(lambda _, send=send: send(), range(n)))
    lost = {f"{client}, {how}": collections.Counter(s for s in v if s != 413) for (client, how), v in got.items()}
    assert not any(lost.values()), {k: dict(v) for k, v in lost.items() if v}
    assert http.post(url, content=b"{bad").status_code == 400


def _exchange(port: int, request: bytes) -> tuple[int, bytes, bytes]:
  """Sends `request` bytes as they are, then reads to the server's close -> (status, head, body)."""
  with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
    s.sendall(request)
    data = b""
    while chunk := s.recv(1 << 16):
      data += chunk
  head, _, answer = data.partition(b"\r\n\r\n")
  return int(head.split(b" ", 2)[1]), head.lower(), answer


def test_oversize_bodies_past_the_drain_bound():
  """A Content-Length past the drain bound, or one over the limit from a client waiting for
  `100 Continue`, gets its 413 before any body is sent, with `Connection: close`; a chunked body gets
  it once read past the bound. A client gone mid-body counts as client_gone (not a server error),
  and the server answers afterwards."""
  pytest.importorskip("starlette")
  import json
  from dgr2_jax.serve import app as app_lib
  from dgr2_jax.serve import client
  head = b"POST /v1/rerank HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
  with _app_on_socket(app_lib.build_app(_stub_service, max_body_bytes=1024, drain_body_bytes=1 << 16)) as port:
    for extra in (b"Content-Length: 4194304\r\n", b"Content-Length: 2048\r\nExpect: 100-continue\r\n"):
      status, got, answer = _exchange(port, head + extra + b"\r\n")
      assert status == 413 and b"connection: close" in got and b"100 continue" not in got, got
      assert json.loads(answer)["error"].startswith("body:")
    status, got, answer = _exchange(port, head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % ((1 << 16) + 1)
                                    + b"x" * ((1 << 16) + 1))
    assert status == 413 and b"connection: close" in got and json.loads(answer)["error"].startswith("body:")
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
      s.sendall(head + b"Content-Length: 1000\r\n\r\n{\"history\"")
      time.sleep(0.2)
    status, _, answer = _exchange(port, head + b"Content-Length: 4\r\nConnection: close\r\n\r\n{bad")
    assert status == 400 and json.loads(answer)["error"].startswith("body:")
    metrics = _exchange(port, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")[2]
    rejected = {r: client.metric_value(metrics.decode(), "dgr2_rejected_requests_total", reason=r)
                for r in ("too_large", "client_gone", "bad_json", "internal")}
    assert rejected == {"too_large": 3, "client_gone": 1, "bad_json": 1, "internal": 0}, rejected


def test_app_starts_without_deprecation_warning():
  """Building the app and running its lifespan (start, then drain) warns nothing deprecated."""
  pytest.importorskip("starlette")
  pytest.importorskip("httpx")
  import warnings
  from starlette.testclient import TestClient
  from dgr2_jax.serve import app as app_lib
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with TestClient(app_lib.build_app(_stub_service)) as http:
      t_end = time.monotonic() + 30
      while http.get("/readyz").status_code != 200:
        assert time.monotonic() < t_end, "not ready"
        time.sleep(0.05)
  deprecated = [w for w in caught if issubclass(w.category, DeprecationWarning) or "deprecat" in str(w.message).lower()]
  assert not deprecated, [str(w.message) for w in deprecated]


def test_ray_serve_two_replicas(smoke_workdir, tmp_path):
  """Two replicas behind Ray Serve on a local Ray instance answer as evaluation did (and so as one
  server does), both replicas taking requests. Skipped without the `serve-ray` extra."""
  pytest.importorskip("ray.serve")
  httpx = pytest.importorskip("httpx")
  import json
  import os
  import subprocess
  import sys
  from dgr2_jax.serve import client
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", PYTHONPATH=repo, RAY_USAGE_STATS_ENABLED="0")
  port = client.free_port()
  cmd = [sys.executable, "-m", "dgr2_jax.serve.ray_app", "--config=configs/demo.py:smoke",
         f"--workdir={smoke_workdir}", "--replicas=2", "--modes=threshold", "--slots=2", "--host=127.0.0.1",
         f"--port={port}", "--replica_cpus=0.5"]
  log = open(tmp_path / "ray_app.log", "w+")   # a file: Ray's request logs would fill a pipe under load
  # Its own process group, as a supervisor starts it (the SIGTERM below goes to the whole group).
  proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
  url = f"http://127.0.0.1:{port}"
  try:
    def ready_pid(_):
      try:
        r = httpx.get(url + "/readyz", timeout=5)
        return r.headers.get("x-dgr2-pid") if r.status_code == 200 else None
      except httpx.HTTPError:
        return None
    t_end = time.monotonic() + 900
    while True:   # until both replicas answer /readyz
      assert proc.poll() is None, (tmp_path / "ray_app.log").read_text()[-3000:]
      assert time.monotonic() < t_end, "Ray Serve not ready"
      with concurrent.futures.ThreadPoolExecutor(8) as ex:
        if len(set(ex.map(ready_pid, range(8))) - {None}) == 2:
          break
      time.sleep(1)
    imps = client.impressions(smoke_workdir, limit=4)
    rows = [json.loads(l) for l in open(os.path.join(smoke_workdir, "eval", "cft_opd_rl", "predictions.jsonl"))]
    jobs = list(range(len(imps))) * 4
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
      tau = client.eval_threshold(os.path.join(smoke_workdir, "eval", "cft_opd_rl"))
      res = list(ex.map(lambda i: httpx.post(url + "/v1/rerank", json=dict(imps[i], threshold=tau), timeout=300),
                        jobs))
    pids = set()
    for i, r in zip(jobs, res):
      assert r.status_code == 200, r.text
      assert r.json()["ranking"] == (rows[i]["ranking_items"] or imps[i]["candidates"])
      assert r.json()["nfe"] == rows[i]["nfe"]
      pids.add(r.headers["x-dgr2-pid"])
    assert len(pids) == 2, pids
    # SIGTERM to the launcher's process group under load: the requests in flight are answered, new
    # ones are turned away (503, then refused) and the launcher exits 0 within 15 s.
    before, after, rc, took = _sigterm_group_under_load(proc, url, [dict(imp, threshold=tau) for imp in imps])
    assert rc == 0 and took < 15, (rc, took, (tmp_path / "ray_app.log").read_text()[-3000:])
    assert before and all(status == 200 for _, status in before), before
    assert all(status in (200, 503) or isinstance(status, str) for _, status in after)
    assert not [t for t, status in after if status == 200 and t > 1.0], after
  finally:
    client.stop_server(proc, timeout=120)


def _sigterm_group_under_load(proc, url, bodies, clients=8, load_s=3.0):
  """Keeps `clients` clients posting `bodies` to /v1/rerank, sends SIGTERM to `proc`'s process group
  after `load_s`, waits for it -> (status of each request open at the signal, (seconds after the
  signal, status) of each request sent after it, exit code, seconds to exit). A status is the HTTP
  code or the name of the client's error."""
  import os
  import signal
  import httpx
  records, stop = [], threading.Event()

  def post_until_stopped(k):
    with httpx.Client(timeout=60) as http:
      for i in itertools.count(k):
        if stop.is_set():
          return
        t0 = time.monotonic()
        try:
          status = http.post(url + "/v1/rerank", json=bodies[i % len(bodies)]).status_code
        except httpx.HTTPError as e:
          status = type(e).__name__
          time.sleep(0.05)
        records.append((t0, time.monotonic(), status))

  threads = [threading.Thread(target=post_until_stopped, args=(k,), daemon=True) for k in range(clients)]
  for t in threads:
    t.start()
  time.sleep(load_s)
  t_sig = time.monotonic()
  os.killpg(proc.pid, signal.SIGTERM)
  try:
    rc = proc.wait(60)
  except subprocess.TimeoutExpired:
    rc = None
  took = time.monotonic() - t_sig
  stop.set()
  for t in threads:
    t.join(90)
  before = [(t1 - t_sig, status) for t0, t1, status in records if t0 < t_sig <= t1]
  after = [(t0 - t_sig, status) for t0, _, status in records if t0 >= t_sig]
  return before, after, rc, took


def test_serve_replay_matches_modes_to_ladder_rows(tmp_path):
  """benchmarks/serve_replay.py: each mode is checked against its accuracy-ladder row, and a row's
  expected ranking is its parsed one when valid, else the retriever's order."""
  import json
  import os
  import sys
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
  import serve_replay  # pylint: disable=g-import-not-at-top
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  cfg = serve_replay.load_config(os.path.join(repo, "configs", "demo.py"))
  dirs = serve_replay.eval_dirs(cfg, "/w")
  assert dirs == {"threshold": "/w/eval/cft_opd_rl", "ar": "/w/eval/ar", "speculative": "/w/eval/speculative"}
  with cfg.unlocked():
    cfg.pipeline.stages = tuple(s for s in cfg.pipeline.stages if s not in ("teacher_rl", "rl"))
  assert serve_replay.eval_dirs(cfg, "/w")["threshold"] == "/w/eval/cft_opd"
  rows = [dict(history=[1], candidates=[3, 4, 5], ranking_items=[5, 3, 4]),
          dict(history=[], candidates=[6, 7, 8], ranking_items=None)]
  path = tmp_path / "predictions.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  bodies, want = serve_replay.expected(str(path), 5, imps=[])
  assert bodies == [dict(history=[1], candidates=[3, 4, 5]), dict(history=[], candidates=[6, 7, 8])]
  assert want == [[5, 3, 4], [6, 7, 8]]
  (tmp_path / "metrics.json").write_text(json.dumps({"decode": {"threshold": 1.0, "block_size": 32,
                                                                "steps_per_block": 0}}))
  from dgr2_jax.serve import client
  assert client.eval_threshold(str(tmp_path)) == 1.0
  assert client.eval_decode(str(tmp_path))["steps_per_block"] == 0


def test_warmup_compiles_the_prefill_without_the_shared_prefix(smoke_workdir):
  """With a shared prefix, warm-up prefills one prompt that shares it and one that does not, so
  a later /v1/generate prompt without the prefix compiles nothing; re-rank prompts reuse it."""
  import importlib.util
  import os
  from dgr2_jax.serve import service as service_lib
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  spec = importlib.util.spec_from_file_location("demo_config", os.path.join(repo, "configs", "demo.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  config = mod.get_config("smoke")
  config.decode.shared_prefix = 1000   # the probes' whole common prefix (the smoke prompt's: a few tokens)
  svc = service_lib.Service(config, smoke_workdir, options=service_lib.ServeOptions(slots=1, modes=("threshold",)))
  dec = svc.engines["threshold"].decoder
  assert svc.shared_prefix > 0 and len(dec.prefix_tokens) == svc.shared_prefix
  svc.scheduler.start()
  try:
    svc.warmup()
    assert dec.prefill_stats["requests"] == 2 and dec.prefill_stats["reused"] == 1
    compiled = dec._prefill._cache_size()
    assert compiled == 2                                        # with the prefix's K/V and without
    req, mode = svc.generate_request(dict(prompt_ids=[3, 4, 5], max_new_tokens=4))
    svc.scheduler.submit(mode, req)
    req.future.result()
    assert dec.prefill_stats["reused"] == 1 and dec._prefill._cache_size() == compiled
  finally:
    svc.scheduler.stop()
