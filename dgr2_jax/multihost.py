"""The processes of one run: initialisation, who writes, barriers and small broadcasts.

Every process of a multi-process run (several hosts, or several processes on one machine) runs the
same program on the same shared workdir. This module owns the few rules that keep them in step:

- `initialize()` runs first in `main`, before any other JAX call, when the environment describes a
  multi-process launch (explicit JAX_COORDINATOR_ADDRESS + JAX_NUM_PROCESSES + JAX_PROCESS_ID, a
  SLURM *step* with more than one task, or a multi-host Cloud TPU slice).
- Process 0 is the writer: `is_writer()`. Files every process would write identically are written
  by process 0 alone; the others wait at a `barrier` and then read.
- `broadcast` sends process 0's JSON-able value to everyone (a freshness decision, a temp name);
  `allgather` collects one JSON-able value per process (the data iterators' states).
- `writer_first(name, fn)`: process 0 runs `fn` alone (inside `local()`, where every collective
  helper here acts as in a single process), the others wait for it, then run `fn` themselves in
  `local()` mode, where they find its outputs fresh and only read them. An error on process 0 is
  re-raised on the others with its message instead of leaving them waiting.

Barriers and broadcasts go through the distributed runtime's key-value store and barrier service
(no device computation), each with a sequence number: every process must reach the same collective
calls in the same order, which holds because every process runs the same stages on the same config.
In a single process every helper is a no-op (barrier) or the identity (broadcast).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from typing import Any, Callable

# Long: a barrier waits while process 0 alone builds data, SIDs, the retriever or the traces.
BARRIER_TIMEOUT_S = int(os.environ.get("DGR2_BARRIER_TIMEOUT_S", str(6 * 3600)))
_STATE = {"seq": 0, "local": 0, "initialized": False}


def launch_kwargs(env=None) -> dict | None:
  """`jax.distributed.initialize` keyword arguments for this environment, or None for a single
  process. SLURM counts only when the *step* has several tasks (SLURM_STEP_NUM_TASKS, set by srun),
  so a lone `python` inside a multi-task allocation does not wait for peers that never come."""
  env = os.environ if env is None else env
  if env.get("JAX_COORDINATOR_ADDRESS"):
    n = env.get("JAX_NUM_PROCESSES")
    i = env.get("JAX_PROCESS_ID")
    if n is None or i is None:
      raise ValueError("JAX_COORDINATOR_ADDRESS is set: JAX_NUM_PROCESSES and JAX_PROCESS_ID must be "
                       f"set too (got {n!r} and {i!r})")
    if not (n.isdigit() and i.isdigit() and int(i) < int(n)):
      raise ValueError(f"JAX_NUM_PROCESSES={n!r} / JAX_PROCESS_ID={i!r}: need integers with 0 <= id < count")
    if int(n) == 1:
      return None
    return dict(coordinator_address=env["JAX_COORDINATOR_ADDRESS"], num_processes=int(n),
                process_id=int(i))
  if int(env.get("SLURM_STEP_NUM_TASKS", "1") or "1") > 1:
    return {}  # jax reads the coordinator, count and id from SLURM
  if len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
    return {}  # jax reads them from the TPU metadata
  return None


def initialize(env=None) -> bool:
  """Calls `jax.distributed.initialize` when the environment describes several processes (see
  `launch_kwargs`). Must run before any other JAX call. Returns True when it initialised."""
  if _STATE["initialized"]:
    return True
  kw = launch_kwargs(env)
  if kw is None:
    return False
  import jax
  jax.distributed.initialize(**kw)
  _STATE["initialized"] = True
  return True


def process_index() -> int:
  import jax
  return jax.process_index()


def process_count() -> int:
  import jax
  return jax.process_count()


def is_multi() -> bool:
  """True when collectives are live: several processes and not inside `local()`."""
  return not _STATE["local"] and process_count() > 1


def is_writer() -> bool:
  """Process 0 (always True in a single process)."""
  return process_index() == 0


@contextlib.contextmanager
def local():
  """Every collective helper acts as in a single process (nesting allowed)."""
  _STATE["local"] += 1
  try:
    yield
  finally:
    _STATE["local"] -= 1


def _client():
  from jax._src import distributed
  client = distributed.global_state.client
  if client is None:
    raise RuntimeError("several JAX processes but no distributed client: call "
                       "dgr2_jax.multihost.initialize() before any other JAX call")
  return client


def _key(name: str) -> str:
  _STATE["seq"] += 1
  return f"dgr2/{_STATE['seq']}/{name}"


def barrier(name: str, timeout_s: int | None = None) -> None:
  """Every process waits here until all arrive (no-op in a single process)."""
  if not is_multi():
    return
  key = _key(name)
  timeout = BARRIER_TIMEOUT_S if timeout_s is None else int(timeout_s)
  _client().wait_at_barrier(key, timeout * 1000)


def broadcast(name: str, value: Any = None, timeout_s: int | None = None) -> Any:
  """Process 0's `value` (JSON-able) on every process; the others' `value` is ignored."""
  if not is_multi():
    return value
  key = _key(name)
  timeout = BARRIER_TIMEOUT_S if timeout_s is None else int(timeout_s)
  if is_writer():
    _client().key_value_set(key, json.dumps(value))
    return value
  return json.loads(_client().blocking_key_value_get(key, timeout * 1000))


def allgather(name: str, value: Any, timeout_s: int | None = None) -> list:
  """[value of process 0, value of process 1, ...] (JSON-able values) on every process."""
  if not is_multi():
    return [value]
  key = _key(name)
  timeout = BARRIER_TIMEOUT_S if timeout_s is None else int(timeout_s)
  client = _client()
  client.key_value_set(f"{key}/{process_index()}", json.dumps(value))
  return [json.loads(client.blocking_key_value_get(f"{key}/{i}", timeout * 1000))
          for i in range(process_count())]


def writer_first(name: str, fn: Callable[[], Any]) -> Any:
  """Process 0 runs `fn()` alone; then every other process runs `fn()` in `local()` mode (it finds
  the outputs fresh and reads them). Returns `fn()`'s value on every process."""
  if not is_multi():
    return fn()
  key = _key(name)
  client = _client()
  if is_writer():
    try:
      with local():
        out = fn()
    except BaseException as e:
      client.key_value_set(key, json.dumps({"error": f"{type(e).__name__}: {e}"}))
      raise
    client.key_value_set(key, json.dumps({"ok": True}))
    return out
  status = json.loads(client.blocking_key_value_get(key, BARRIER_TIMEOUT_S * 1000))
  if "error" in status:
    raise RuntimeError(f"{name}: process 0 failed ({status['error']})")
  with local():
    return fn()


def quiet_other_processes() -> None:
  """Prints, progress bars and logs (native ones too) from process 0 only: the other processes'
  stdout and stderr go to /dev/null (DGR2_LOG_ALL_PROCESSES=1 keeps them), except an uncaught
  error, which is still printed, prefixed with the process index."""
  if process_count() == 1 or is_writer() or os.environ.get("DGR2_LOG_ALL_PROCESSES") == "1":
    return
  sys.stdout.flush()
  sys.stderr.flush()
  real_err = os.fdopen(os.dup(2), "w")
  pid = process_index()

  def hook(kind, value, tb):
    text = "".join(traceback.format_exception(kind, value, tb))
    real_err.write("".join(f"[process {pid}] {line}\n" for line in text.rstrip().splitlines()))
    real_err.flush()
  sys.excepthook = hook
  null = os.open(os.devnull, os.O_WRONLY)
  os.dup2(null, 1)  # the file descriptors: native libraries (XLA, Gloo) write there directly
  os.dup2(null, 2)
