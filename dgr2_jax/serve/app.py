"""The HTTP API (Starlette on uvicorn) over a `service.Service`.

  POST /v1/rerank    {"history", "candidates", "mode", "threshold", "max_new_tokens", "timeout_s"}
                     -> {"ranking", "reasoning", "valid", "fallback", "verdict", "nfe", "latency_ms"}
  POST /v1/generate  {"prompt_ids" | "prompt" | "messages", "enable_thinking", "mode", ...}
                     -> {"output_ids", "text", "nfe", "latency_ms"}
  GET  /healthz      the process is up;  GET /readyz  models loaded and compiled (503 before)
  GET  /metrics      Prometheus text format

Errors are JSON {"error": "<one line naming the field>"}: 400 bad JSON / field, 413 body over
`max_body_bytes`, 429 queue full (with Retry-After), 503 not ready or shutting down, 504 deadline
passed (its slot freed). A client that disconnects cancels its request (its slot is freed at the
engine's next round). The models load in a background thread after the socket is bound, so
/healthz answers at once and /readyz when the engines are warm; SIGTERM (uvicorn's graceful
shutdown) stops accepting, lets in-flight requests finish, then drains the engines and exits.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dgr2_jax.serve import engine as engine_lib
from dgr2_jax.serve import metrics as metrics_lib
from dgr2_jax.serve.service import BadRequest

MAX_BODY_BYTES = 1 << 16


class TooLarge(Exception):
  pass


PID = {"x-dgr2-pid": str(os.getpid())}


def _error(status: int, msg: str, headers=None) -> JSONResponse:
  return JSONResponse({"error": msg.splitlines()[0] if msg else "error"}, status_code=status,
                      headers={**PID, **(headers or {})})


async def _read_json(request: HttpRequest, limit: int):
  n = request.headers.get("content-length")
  if n is not None and (not n.isdigit() or int(n) > limit):
    raise TooLarge(f"body: larger than {limit} bytes")
  chunks, size = [], 0
  async for chunk in request.stream():
    size += len(chunk)
    if size > limit:
      raise TooLarge(f"body: larger than {limit} bytes")
    chunks.append(chunk)
  try:
    return json.loads(b"".join(chunks))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise BadRequest("body", f"not valid JSON ({getattr(e, 'msg', 'not UTF-8')})", "bad_json") from None


def build_app(make_service, max_body_bytes: int = MAX_BODY_BYTES, drain_timeout_s: float = 60.0,
              preload: bool = False) -> Starlette:
  """The ASGI app; `make_service()` builds the `Service` (models, engines) in a background thread
  started by the app's lifespan, or here before returning when `preload` (a Ray Serve replica: it
  counts as started once its constructor returns). Answers carry the serving process's id in the
  `x-dgr2-pid` header."""
  holder = {"service": None, "error": None, "draining": False}
  metrics = metrics_lib.Metrics(lambda: holder["service"])

  def load():
    try:
      svc = make_service()
      svc.scheduler.start()
      svc.warmup()
      holder["service"] = svc
      print(f"dgr2_jax.serve: ready (modes {', '.join(svc.modes)}; {svc.options.slots} slots, "
            f"{svc.options.steps_per_round} steps per round, policy {svc.options.policy})", flush=True)
    except BaseException as e:  # pylint: disable=broad-except
      holder["error"] = f"{type(e).__name__}: {e}"
      print(f"dgr2_jax.serve: loading failed: {holder['error']}", flush=True)

  if preload:
    load()
    if holder["error"]:
      raise RuntimeError(f"dgr2_jax.serve: loading failed: {holder['error']}")

  async def healthz(request):
    del request
    return JSONResponse({"status": "ok"}, headers=PID)

  async def readyz(request):
    del request
    svc = holder["service"]
    if holder["error"]:
      return _error(503, f"not ready: {holder['error']}")
    if svc is None:
      return _error(503, "not ready: loading and compiling the models")
    if svc.scheduler.error is not None:
      return _error(503, f"not ready: the engine failed ({svc.scheduler.error})")
    if holder["draining"]:
      return _error(503, "not ready: shutting down")
    return JSONResponse({"status": "ready", "modes": list(svc.modes), "model_dir": svc.model_dir,
                         "verifier_dir": svc.verifier_dir, "num_candidates": svc.num_candidates,
                         "max_new_tokens": svc.max_new_tokens}, headers=PID)

  async def metrics_endpoint(request):
    del request
    body, ctype = metrics.render()
    return Response(body, media_type=ctype)

  async def serve(request: HttpRequest, parse, respond, kind: str):
    t0 = time.monotonic()
    svc = holder["service"]
    if svc is None or holder["draining"]:
      reason = "shutting_down" if holder["draining"] else "not_ready"
      metrics.reject(reason)
      return _error(503, "the server is shutting down" if holder["draining"] else
                    "the server is not ready (models loading)", {"Retry-After": "5"})
    try:
      body = await _read_json(request, max_body_bytes)
      parsed = parse(svc, body)
    except TooLarge as e:
      metrics.reject("too_large")
      return _error(413, str(e))
    except BadRequest as e:
      metrics.reject(e.reason)
      return _error(400, str(e))
    req, mode = parsed[-2], parsed[-1]
    try:
      svc.scheduler.submit(mode, req)
    except engine_lib.QueueFull as e:
      metrics.reject("queue_full")
      return _error(429, str(e), {"Retry-After": "1"})
    except engine_lib.ShuttingDown as e:
      metrics.reject("shutting_down")
      return _error(503, str(e))
    fut = asyncio.wrap_future(req.future)
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())   # never "unretrieved"

    async def gone():
      # Every waiting request polls its connection: at 20/s each, a few hundred queued requests
      # kept the event loop (and the GIL the scheduler thread needs) busy; 4/s frees a gone
      # client's slot within a quarter second all the same.
      while not await request.is_disconnected():
        await asyncio.sleep(0.25)
    watch = asyncio.ensure_future(gone())
    try:
      done, _ = await asyncio.wait({fut, watch}, timeout=max(req.deadline - time.monotonic(), 0) + 0.5,
                                   return_when=asyncio.FIRST_COMPLETED)
    finally:
      watch.cancel()
    if fut not in done:
      req.cancel()              # the engine frees its slot at its next round
      if watch in done:
        metrics.reject("client_gone")
        return _error(499, "client disconnected")
      metrics.reject("deadline")
      return _error(504, "timeout_s: the deadline passed before the answer was ready")
    try:
      res = fut.result()
    except engine_lib.DeadlineExceeded:
      metrics.reject("deadline")
      return _error(504, "timeout_s: the deadline passed before the answer was ready")
    except engine_lib.Cancelled:
      metrics.reject("client_gone")
      return _error(499, "client disconnected")
    except engine_lib.ShuttingDown as e:
      metrics.reject("shutting_down")
      return _error(503, str(e))
    except Exception as e:  # pylint: disable=broad-except
      metrics.reject("internal")
      return _error(500, f"internal error: {type(e).__name__}: {e}")
    out = respond(svc, parsed, res)
    metrics.observe(kind, mode, time.monotonic() - t0)
    return JSONResponse(out, headers=PID)

  async def rerank(request):
    return await serve(request, lambda svc, body: svc.rerank_request(body),
                       lambda svc, parsed, res: svc.rerank_response(parsed[0], res), "rerank")

  async def generate(request):
    return await serve(request, lambda svc, body: svc.generate_request(body),
                       lambda svc, parsed, res: svc.generate_response(res), "generate")

  async def not_found(request, exc):
    del request
    metrics.reject("not_found" if exc.status_code == 404 else "bad_method")
    return _error(exc.status_code, f"path: {exc.detail}")

  async def crashed(request, exc):
    del request
    metrics.reject("internal")
    return _error(500, f"internal error: {type(exc).__name__}: {exc}")

  async def lifespan(app):
    del app
    if not preload:
      threading.Thread(target=load, name="dgr2-serve-load", daemon=True).start()
    yield
    holder["draining"] = True            # uvicorn already waited for the open requests
    svc = holder["service"]
    if svc is not None:
      svc.scheduler.drain(drain_timeout_s)

  from starlette.exceptions import HTTPException
  return Starlette(
      routes=[Route("/v1/rerank", rerank, methods=["POST"]), Route("/v1/generate", generate, methods=["POST"]),
              Route("/healthz", healthz), Route("/readyz", readyz), Route("/metrics", metrics_endpoint)],
      exception_handlers={HTTPException: not_found, Exception: crashed}, lifespan=lifespan)
