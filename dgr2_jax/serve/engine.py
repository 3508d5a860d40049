"""The serving engine: requests in, decoded token ids out, continuous batching over fixed slots.

One `Engine` per decoding mode holds a `slots.SlotDecoder` (a fixed number of slots over the
static KV cache) and a FIFO of waiting requests. `Scheduler` runs every engine from one thread:
a *round* of an engine is
  1. free the slots of requests that were cancelled (client gone) or are past their deadline;
  2. admit waiting requests into free slots (prefill into that slot; the other slots keep their
     state), under the engine's admission policy:
       'continuous': whenever a slot is free, at any denoising step of the others;
       'block':      only when every busy slot is at the start of a block (the lockstep-by-block
                     admission of vLLM's TPU block-diffusion backend);
       'static':     only when every slot is free (static batches, the `generate` stage's);
  3. at most `steps_per_round` denoising steps of every busy slot (one device call, one host round
     trip); the round ends early right after the step in which a row finishes (`early_exit`), so
     its answer is not held back by the round and its slot takes a waiting request at once
     (without it, a row finishing at step 1 of k idles k-1 iterations, and its request waits them);
  4. finished rows leave: their output ids resolve the request's future.
Wasted row-iterations: in a round after which requests are still waiting, every slot-iteration
that decoded nothing (an empty slot, or a row finished earlier in the round) is counted; it is
what the admission policies are compared by (benchmarks/serve_load.py).

Modes: 'threshold' (block diffusion, the final model, per-request tau) and 'ar' (the AR teacher,
block size 1) run on slot engines. 'speculative' (the final model drafts, the AR teacher
verifies, decode/speculative.py) is served by `StaticEngine`: waiting requests are grouped into
static micro-batches of `slots` rows (padded with copies) decoded by `speculative.generate` to
completion, one batch per round. Its latency is a static batch's (no admission mid-batch,
deadlines checked between batches only); its output is exactly the verifier's greedy output,
i.e. the 'ar' mode's.

Greedy outputs equal the batch decoder's (decode/sampler.py `generate`, decode/speculative.py
`generate`) for the same prompt whatever shares the slots (tests/test_serve.py).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import sys
import threading
import time

import jax
import numpy as np

from dgr2_jax.decode import sampler

POLICIES = ("continuous", "block", "static")


class QueueFull(Exception):
  """The engine's queue holds `max_queue` requests (HTTP 429)."""


class DeadlineExceeded(Exception):
  """The request's deadline passed before it finished (HTTP 504)."""


class Cancelled(Exception):
  """The client went away; its slot was freed."""


class ShuttingDown(Exception):
  """The server is draining and takes no new requests (HTTP 503)."""


@dataclasses.dataclass(eq=False)
class Request:
  prompt: list
  threshold: float = 1.0
  max_new_tokens: int | None = None
  deadline: float = float("inf")          # time.monotonic() seconds
  future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
  submitted: float = dataclasses.field(default_factory=time.monotonic)
  admitted: float = 0.0
  cancelled: bool = False

  def cancel(self):
    """Called from any thread (client gone, or its deadline reached on the HTTP side)."""
    self.cancelled = True

  def fail(self, exc: Exception):
    if not self.future.done():
      self.future.set_exception(exc)

  def finish(self, result: dict):
    if not self.future.done():
      self.future.set_result(result)


@dataclasses.dataclass
class Stats:
  """Counters of one engine (read by the metrics endpoint)."""
  rounds: int = 0
  row_iterations: int = 0            # slots x iterations run
  busy_row_iterations: int = 0       # of which a row was decoding
  wasted_row_iterations: int = 0     # idle while requests waited (module docstring)
  tokens: int = 0                    # output tokens of finished requests
  finished: int = 0
  expired: int = 0
  cancelled: int = 0
  decode_seconds: float = 0.0        # device time of the rounds
  queue_seconds: float = 0.0         # finished requests: submitted -> admitted (waiting for a slot)
  service_seconds: float = 0.0       # finished requests: admitted -> answered (decoding)


class Engine:
  """Continuous batching over a `slots.SlotDecoder` (see the module docstring)."""

  def __init__(self, mode: str, decoder, steps_per_round: int = 8, policy: str = "continuous",
               max_queue: int = 256, early_exit: bool = True):
    if policy not in POLICIES:
      raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if steps_per_round < 1:
      raise ValueError(f"steps_per_round must be >= 1, got {steps_per_round}")
    self.mode, self.decoder, self.k, self.policy = mode, decoder, steps_per_round, policy
    self.max_queue, self.early_exit = max_queue, early_exit
    self.slots = decoder.slots
    self.owner: list[Request | None] = [None] * self.slots
    self.queue: collections.deque[Request] = collections.deque()
    self.lock = threading.Lock()
    self.state = decoder.init_state()
    self.at_block_start = np.ones((self.slots,), bool)
    self.stats = Stats()

  # ---- any thread -----------------------------------------------------------------------------
  def submit(self, req: Request) -> Request:
    with self.lock:
      if len(self.queue) >= self.max_queue:
        raise QueueFull(f"{self.mode} queue is full ({self.max_queue} waiting)")
      self.queue.append(req)
    return req

  def queue_depth(self) -> int:
    return len(self.queue)

  def occupancy(self) -> int:
    return sum(o is not None for o in self.owner)

  def idle(self) -> bool:
    return not self.queue and self.occupancy() == 0

  # ---- the scheduler thread -------------------------------------------------------------------
  def _drop_dead(self, now: float):
    """Frees slots (and queue entries) of cancelled or expired requests."""
    for s, req in enumerate(self.owner):
      if req is not None and (req.cancelled or now > req.deadline):
        self.state = self.decoder.release(self.state, s)
        self.owner[s] = None
        self._fail(req, now)
    self._drop_dead_queued(now)

  def _drop_dead_queued(self, now: float):
    with self.lock:
      live = [r for r in self.queue if not (r.cancelled or now > r.deadline)]
      dead = [r for r in self.queue if r.cancelled or now > r.deadline]
      self.queue = collections.deque(live)
    for req in dead:
      self._fail(req, now)

  def _finish(self, req: Request, ids: list, nfe: int, steps: int, end: float):
    if req.max_new_tokens:
      ids = ids[:req.max_new_tokens]
    s_ = self.stats
    s_.finished += 1
    s_.tokens += len(ids)
    s_.queue_seconds += req.admitted - req.submitted
    s_.service_seconds += end - req.admitted
    req.finish(dict(output_ids=ids, nfe=nfe, steps=steps, queue_ms=1e3 * (req.admitted - req.submitted),
                    latency_ms=1e3 * (end - req.submitted)))

  def _fail(self, req: Request, now: float):
    if req.cancelled:
      self.stats.cancelled += 1
      req.fail(Cancelled("client went away"))
    else:
      self.stats.expired += 1
      req.fail(DeadlineExceeded(f"deadline passed after {now - req.submitted:.3f} s"))

  def _admit(self):
    free = [s for s, o in enumerate(self.owner) if o is None]
    busy = [s for s, o in enumerate(self.owner) if o is not None]
    if not free or not self.queue:
      return
    if self.policy == "static" and busy:
      return
    if self.policy == "block" and not self.at_block_start[busy].all():
      return
    for s in free:
      with self.lock:
        if not self.queue:
          break
        req = self.queue.popleft()
      try:
        self.state = self.decoder.prefill(self.state, s, req.prompt, req.threshold, req.max_new_tokens)
      except ValueError as e:   # a request the decoder cannot take (checked by the API first)
        req.fail(e)
        continue
      req.admitted = time.monotonic()
      self.owner[s] = req

  def run_round(self) -> bool:
    """One round (module docstring); False when there was nothing to do."""
    now = time.monotonic()
    self._drop_dead(now)
    self._admit()
    if all(o is None for o in self.owner):
      return False
    t0 = time.monotonic()
    self.state, iters, busy = self.decoder.step(self.state, self.k, self.early_exit)
    st = self.state
    done, canvas, eos_pos, nfe, first, steps, iters, busy = jax.device_get((   # one host transfer
        st["done"], st["canvas"], st["eos_pos"], st["nfe"], st["first"], st["step"], iters, busy))
    iters = int(iters)
    dt = time.monotonic() - t0
    s_ = self.stats
    s_.rounds += 1
    s_.decode_seconds += dt
    s_.row_iterations += iters * self.slots
    s_.busy_row_iterations += int(busy.sum())
    if self.queue:
      s_.wasted_row_iterations += iters * self.slots - int(busy.sum())
    self.at_block_start = first | done
    end = time.monotonic()
    for s, req in enumerate(self.owner):
      if req is None or not done[s]:
        continue
      self.owner[s] = None
      ids = sampler.output_ids(canvas[s:s + 1], eos_pos[s:s + 1])[0]
      self._finish(req, ids, int(nfe[s]), int(steps[s]), end)
    return True

  def fail_all(self, exc: Exception):
    for s, req in enumerate(self.owner):
      if req is not None:
        self.owner[s] = None
        req.fail(exc)
    with self.lock:
      q, self.queue = list(self.queue), collections.deque()
    for req in q:
      req.fail(exc)


class StaticEngine(Engine):
  """Static micro-batches of a batch decoder `generate_fn(prompts, threshold) -> sampler.generate's
  dict`, one batch per round (the speculative mode; module docstring)."""

  def __init__(self, mode: str, generate_fn, slots: int, max_queue: int = 256):
    self.mode, self.generate_fn, self.slots, self.max_queue = mode, generate_fn, slots, max_queue
    self.policy, self.k = "static", 0
    self.owner = [None] * slots
    self.queue = collections.deque()
    self.lock = threading.Lock()
    self.stats = Stats()

  def run_round(self) -> bool:
    now = time.monotonic()
    self._drop_dead_queued(now)  # no slot holds a request between rounds
    with self.lock:
      if not self.queue:
        return False
      tau = self.queue[0].threshold      # one batch decodes at one threshold
      batch = [r for r in self.queue if r.threshold == tau][:self.slots]
      self.queue = collections.deque(r for r in self.queue if r not in batch)
    for s, r in enumerate(batch):
      r.admitted = now
      self.owner[s] = r
    prompts = [r.prompt for r in batch]
    t0 = time.monotonic()
    try:
      out = self.generate_fn(prompts + [prompts[-1]] * (self.slots - len(batch)), tau)
    except Exception as e:  # pylint: disable=broad-except
      for r in batch:
        r.fail(e)
      self.owner = [None] * self.slots
      return True
    end = time.monotonic()
    s_ = self.stats
    s_.rounds += 1
    s_.decode_seconds += end - t0
    # Loop iterations of the batch; a real row is busy for its drafter passes (one per iteration
    # while it drafts); padding rows and finished rows idle.
    iters = int(np.asarray(out.get("forward_passes", 0)))
    busy = int(np.asarray(out["drafter_passes"])[:len(batch)].sum()) if "drafter_passes" in out else iters * len(batch)
    s_.row_iterations += iters * self.slots
    s_.busy_row_iterations += busy
    if self.queue:
      s_.wasted_row_iterations += iters * self.slots - busy
    self.owner = [None] * self.slots
    for i, req in enumerate(batch):
      if req.cancelled or end > req.deadline:
        self._fail(req, end)
        continue
      ids = [int(t) for t in out["output_ids"][i]]
      self._finish(req, ids, int(np.asarray(out["nfe"])[i]), int(np.asarray(out.get("rounds", out["nfe"]))[i]), end)
    return True


class Scheduler:
  """Runs the engines' rounds from one background thread (device calls release the GIL, so the
  HTTP event loop stays responsive). `drain()` lets queued and running requests finish first."""

  def __init__(self, engines: dict):
    self.engines = engines
    self._wake = threading.Event()
    self._stop = False
    self._draining = False
    self.error: BaseException | None = None
    self._thread = threading.Thread(target=self._loop, name="dgr2-serve-scheduler", daemon=True)

  def start(self):
    # The scheduler thread takes the GIL back after every device call, competing with the HTTP
    # event loop; at the default 5 ms switch interval each of a round's few re-acquisitions can
    # wait that long, which at short rounds (continuous admission ends one per finished row) is
    # most of a round. 0.5 ms keeps a round's host part near its own cost.
    sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
    self._thread.start()
    return self

  def submit(self, mode: str, req: Request) -> Request:
    if self._draining or self._stop:
      raise ShuttingDown("the server is shutting down")
    if self.error is not None:
      raise ShuttingDown(f"the engine failed: {self.error}")
    self.engines[mode].submit(req)
    self._wake.set()
    return req

  def _loop(self):
    try:
      while not self._stop:
        did = False
        for eng in self.engines.values():
          did |= eng.run_round()
        if not did:
          if self._draining:
            break
          self._wake.wait(0.05)
          self._wake.clear()
    except BaseException as e:  # pylint: disable=broad-except
      self.error = e            # /readyz turns red; every waiting request gets the error
      for eng in self.engines.values():
        eng.fail_all(ShuttingDown(f"the engine failed: {e}"))
      raise

  def drain(self, timeout: float = 60.0):
    """Stops admitting new requests, finishes those queued and running, stops the thread."""
    self._draining = True
    self._wake.set()
    self._thread.join(timeout)
    self._stop = True
    for eng in self.engines.values():
      eng.fail_all(ShuttingDown("the server shut down"))

  def stop(self):
    self._stop = True
    self._wake.set()
    self._thread.join(10)
