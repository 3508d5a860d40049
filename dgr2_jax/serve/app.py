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
import contextlib
import json
import os
import threading
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dgr2_jax.serve import engine as engine_lib
from dgr2_jax.serve import metrics as metrics_lib
from dgr2_jax.serve.service import BadRequest

MAX_BODY_BYTES = 1 << 16
# A body over the limit is still read to its end (and thrown away) before its 413 goes out, up to
# this many bytes in all. Clients such as urllib, requests and httpx send the whole body before they
# read the answer; a server that answers and closes while body bytes are still arriving makes the
# kernel reset the connection, and the client sees a broken pipe or a reset instead of its 413.
# (uvicorn itself discards the rest of a body after the answer, but only on a kept-alive
# connection: urllib asks for `Connection: close`.) A longer body, by its Content-Length or once
# read this far, gets its 413 at once with `Connection: close`, so that the work a request costs
# stays bounded; its client may see the reset.
DRAIN_BODY_BYTES = 16 << 20

PID = {"x-dgr2-pid": str(os.getpid())}


class TooLarge(Exception):
  """A body over the limit; `close`: the connection is closed with the answer (its rest is unread)."""

  def __init__(self, limit: int, close: bool):
    super().__init__(f"body: larger than {limit} bytes")
    self.close = close


def _error(status: int, msg: str, headers=None) -> JSONResponse:
  return JSONResponse({"error": msg.splitlines()[0] if msg else "error"}, status_code=status,
                      headers={**PID, **(headers or {})})


async def _read_body(request: HttpRequest, limit: int, drain: int) -> bytes:
  """The body; TooLarge when it is over `limit` bytes, after reading it to its end (discarded) when
  it is at most `drain` bytes. A client that waits for `100 Continue` before sending a body whose
  Content-Length is over the limit gets the 413 instead, and sends nothing."""
  n = request.headers.get("content-length", "")
  waits = request.headers.get("expect", "").lower() == "100-continue"
  if n.isdigit() and int(n) > limit and (int(n) > drain or waits):
    raise TooLarge(limit, close=True)
  chunks, size = [], 0
  async for chunk in request.stream():
    size += len(chunk)
    if size > drain:
      raise TooLarge(limit, close=True)
    if size <= limit:
      chunks.append(chunk)
  if size > limit:
    raise TooLarge(limit, close=False)
  return b"".join(chunks)


async def _read_json(request: HttpRequest, limit: int, drain: int):
  body = await _read_body(request, limit, drain)
  try:
    return json.loads(body)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise BadRequest("body", f"not valid JSON ({getattr(e, 'msg', 'not UTF-8')})", "bad_json") from None


def _outcome_error(exc: BaseException):
  """(status, metrics reason, message) of a request whose engine future failed."""
  if isinstance(exc, engine_lib.DeadlineExceeded):
    return 504, "deadline", "timeout_s: the deadline passed before the answer was ready"
  if isinstance(exc, engine_lib.Cancelled):
    return 499, "client_gone", "client disconnected"
  if isinstance(exc, engine_lib.ShuttingDown):
    return 503, "shutting_down", str(exc)
  return 500, "internal", f"internal error: {type(exc).__name__}: {exc}"


async def _until_disconnected(request: HttpRequest):
  # Every waiting request polls its connection: at 20/s each, a few hundred queued requests kept
  # the event loop (and the GIL the scheduler thread needs) busy; 4/s frees a gone client's slot
  # within a quarter second all the same.
  while not await request.is_disconnected():
    await asyncio.sleep(0.25)


class Api:
  """The app's state (the service once loaded, whether it takes requests, how many it holds) and its
  endpoints. `build_app(...).state.api` is this object."""

  def __init__(self, make_service, max_body_bytes: int, drain_body_bytes: int, drain_timeout_s: float, preload: bool):
    self.make_service = make_service
    self.max_body_bytes = max_body_bytes
    self.drain_body_bytes = max(drain_body_bytes, max_body_bytes)
    self.drain_timeout_s = drain_timeout_s
    self.preload = preload
    self.service = None
    self.load_error = None
    self.draining = False
    self.in_flight = 0               # requests between arrival and answer
    self.metrics = metrics_lib.Metrics(lambda: self.service)

  def load(self):
    """Builds, starts and warms up the service (errors are reported by /readyz)."""
    try:
      svc = self.make_service()
      svc.scheduler.start()
      svc.warmup()
      self.service = svc
      print(f"dgr2_jax.serve: ready (modes {', '.join(svc.modes)}; {svc.options.slots} slots, "
            f"{svc.options.steps_per_round} steps per round, policy {svc.options.policy})", flush=True)
    except BaseException as e:  # pylint: disable=broad-except
      self.load_error = f"{type(e).__name__}: {e}"
      print(f"dgr2_jax.serve: loading failed: {self.load_error}", flush=True)

  @contextlib.asynccontextmanager
  async def lifespan(self, app):
    del app
    if not self.preload:
      threading.Thread(target=self.load, name="dgr2-serve-load", daemon=True).start()
    yield
    self.draining = True            # uvicorn already waited for the open requests
    if self.service is not None:
      self.service.scheduler.drain(self.drain_timeout_s)

  def stop_intake(self):
    """From now on requests get 503 and /readyz 503; those already taken are answered."""
    self.draining = True

  def reject(self, status: int, reason: str, msg: str, headers=None) -> JSONResponse:
    self.metrics.reject(reason)
    return _error(status, msg, headers)

  async def healthz(self, request):
    del request
    return JSONResponse({"status": "ok"}, headers=PID)

  async def readyz(self, request):
    del request
    svc = self.service
    if self.load_error:
      return _error(503, f"not ready: {self.load_error}")
    if svc is None:
      return _error(503, "not ready: loading and compiling the models")
    if svc.scheduler.error is not None:
      return _error(503, f"not ready: the engine failed ({svc.scheduler.error})")
    if self.draining:
      return _error(503, "not ready: shutting down")
    return JSONResponse({"status": "ready", "modes": list(svc.modes), "model_dir": svc.model_dir,
                         "verifier_dir": svc.verifier_dir, "num_candidates": svc.num_candidates,
                         "max_new_tokens": svc.max_new_tokens}, headers=PID)

  async def metrics_endpoint(self, request):
    del request
    body, ctype = self.metrics.render()
    return Response(body, media_type=ctype)

  async def rerank(self, request):
    return await self.serve(request, lambda svc, body: svc.rerank_request(body),
                            lambda svc, parsed, res: svc.rerank_response(parsed[0], res), "rerank")

  async def generate(self, request):
    return await self.serve(request, lambda svc, body: svc.generate_request(body),
                            lambda svc, parsed, res: svc.generate_response(res), "generate")

  async def serve(self, request: HttpRequest, parse, respond, kind: str):
    """Parses the body with `parse(svc, body) -> (..., engine request, mode)`, queues the request,
    waits for its answer (or its deadline, or the client leaving), answers `respond(svc, parsed, result)`."""
    self.in_flight += 1
    try:
      return await self.handle(request, parse, respond, kind)
    finally:
      self.in_flight -= 1

  async def handle(self, request: HttpRequest, parse, respond, kind: str):
    t0 = time.monotonic()
    svc = self.service
    if self.draining:   # and close the connection: a client's next request goes where intake is open
      return self.reject(503, "shutting_down", "the server is shutting down",
                         {"Retry-After": "5", "Connection": "close"})
    if svc is None:
      return self.reject(503, "not_ready", "the server is not ready (models loading)", {"Retry-After": "5"})
    try:
      parsed = parse(svc, await _read_json(request, self.max_body_bytes, self.drain_body_bytes))
    except TooLarge as e:
      return self.reject(413, "too_large", str(e), {"Connection": "close"} if e.close else None)
    except ClientDisconnect:   # gone before its body ended: nobody reads this answer
      return self.reject(499, "client_gone", "client disconnected")
    except BadRequest as e:
      return self.reject(400, e.reason, str(e))
    req, mode = parsed[-2], parsed[-1]
    try:
      svc.scheduler.submit(mode, req)
    except engine_lib.QueueFull as e:
      return self.reject(429, "queue_full", str(e), {"Retry-After": "1"})
    except engine_lib.ShuttingDown as e:
      return self.reject(503, "shutting_down", str(e))
    try:
      res = await self.answer(request, req)
    except Exception as e:  # pylint: disable=broad-except
      return self.reject(*_outcome_error(e))
    out = respond(svc, parsed, res)
    self.metrics.observe(kind, mode, time.monotonic() - t0)
    return JSONResponse(out, headers=PID)

  async def answer(self, request: HttpRequest, req):
    """The engine's result for the queued `req`; raises as its future does, Cancelled when the client
    left first, DeadlineExceeded when its deadline passed first (either way the engine frees its slot
    at its next round)."""
    fut = asyncio.wrap_future(req.future)
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())   # never "unretrieved"
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
      done, _ = await asyncio.wait({fut, watch}, timeout=max(req.deadline - time.monotonic(), 0) + 0.5,
                                   return_when=asyncio.FIRST_COMPLETED)
    finally:
      watch.cancel()
    if fut not in done:
      req.cancel()
      raise engine_lib.Cancelled() if watch in done else engine_lib.DeadlineExceeded()
    return fut.result()

  async def not_found(self, request, exc):
    del request
    return self.reject(exc.status_code, "not_found" if exc.status_code == 404 else "bad_method",
                       f"path: {exc.detail}")

  async def crashed(self, request, exc):
    del request
    return self.reject(500, "internal", f"internal error: {type(exc).__name__}: {exc}")


def build_app(make_service, max_body_bytes: int = MAX_BODY_BYTES, drain_body_bytes: int = DRAIN_BODY_BYTES,
              drain_timeout_s: float = 60.0, preload: bool = False) -> Starlette:
  """The ASGI app; `make_service()` builds the `Service` (models, engines) in a background thread
  started by the app's lifespan, or here before returning when `preload` (a Ray Serve replica: it
  counts as started once its constructor returns). An oversize body is read up to `drain_body_bytes`
  before its 413 (DRAIN_BODY_BYTES). Answers carry the serving process's id in the `x-dgr2-pid`
  header; `.state.api` is the app's `Api`."""
  api = Api(make_service, max_body_bytes, drain_body_bytes, drain_timeout_s, preload)
  if preload:
    api.load()
    if api.load_error:
      raise RuntimeError(f"dgr2_jax.serve: loading failed: {api.load_error}")
  routes = [Route("/v1/rerank", api.rerank, methods=["POST"]), Route("/v1/generate", api.generate, methods=["POST"]),
            Route("/healthz", api.healthz), Route("/readyz", api.readyz), Route("/metrics", api.metrics_endpoint)]
  app = Starlette(routes=routes, exception_handlers={HTTPException: api.not_found, Exception: api.crashed},
                  lifespan=api.lifespan)
  app.state.api = api
  return app
