"""Preemption during training: the notice, the step every process saves, the exit status, and the
time-based save cadence.

A scheduler that takes the machines back (SLURM's `--signal` or preemption, a spot or preemptible
VM, a Cloud TPU maintenance event) sends SIGTERM and kills the job a grace period later.
`loop.train` asks `Watch.reached(step)` after every step; when it is True, the loop saves that
step (params, optimiser, data-iterator position, validation state), waits for the write to
commit, and raises `Preempted`, which ends the process with `EXIT_STATUS` (75, sysexits'
EX_TEMPFAIL): "requeue me". Running the same command again resumes from that step.

One process: `Watch` installs a SIGTERM handler for the duration of training (from the main
thread; the previous handler is restored after) that only sets a flag read at step boundaries, so
a second SIGTERM changes nothing and never interrupts a save. Outside training the process keeps
the default: SIGTERM ends it at once (host-only stages write atomically, so nothing is partial).

Several processes: `jax.distributed.initialize` starts JAX's preemption sync manager, which catches
SIGTERM on any process and tells the others through the coordination service; then
`multihost_utils.reached_preemption_sync_point(step)` (through Orbax's `reached_preemption`) is
True on every process at the same step, one past the furthest process's step when the notice
came. A notice that arrives outside a training's steps (between stages, or during the last step)
is acted on at the next training's start or at this one's end (`outside_steps`), decided by
process 0 for everyone.

`Clock` is the time cadence (`train.checkpoint_every_minutes`): process 0's clock decides and
every process saves the same step.
"""

from __future__ import annotations

import signal
import threading
import time

import jax

from dgr2_jax import multihost

EXIT_STATUS = 75   # EX_TEMPFAIL: the launchers requeue / restart on it
# The coordination-service key JAX's preemption sync manager sets when a process gets the notice.
_NOTICE_KEY = "RECEIVED_PREEMPTION_NOTICE"
_now = time.monotonic   # the time cadence's clock (a test moves it)


class Preempted(SystemExit):
  """Raised by `loop.train` once the preemption step is saved: uncaught, the process exits with
  `EXIT_STATUS` (a SystemExit, so `except Exception` in between does not swallow it)."""

  def __init__(self, step: int, directory: str):
    super().__init__(EXIT_STATUS)
    self.step, self.directory = int(step), str(directory)


class Watch:
  """The preemption notice during one `loop.train` call (module docstring). Use as a context
  manager around the training; `reached(step)` must be called by every process after every step,
  with the step numbers Orbax saves under."""

  def __init__(self, manager):
    self.manager = manager
    self.multi = jax.process_count() > 1
    self.notice = False
    self._installed, self._previous = False, None

  def __enter__(self) -> "Watch":
    # Python runs signal handlers in the main thread only: elsewhere SIGTERM keeps its handler.
    if not self.multi and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
      self._installed = True
    return self

  def __exit__(self, *exc) -> None:
    if self._installed:   # None: a handler not set from Python (restored as the default)
      signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)
      self._installed = False

  def _on_sigterm(self, signum, frame) -> None:
    del signum, frame
    self.notice = True   # nothing else: the step in flight finishes and the loop saves it

  def reached(self, step: int) -> bool:
    """True (on every process alike) when training must save `step` and stop."""
    if self.multi:
      return bool(self.manager.reached_preemption(int(step)))
    return self.notice

  def outside_steps(self, step: int) -> bool:
    """A notice that came before this training's steps or after its last sync point (on every
    process alike). Collective: every process calls it at the same place."""
    if not self.multi:
      return self.notice
    # This training's step numbering for the sync protocol (the counters may still hold another
    # training's last step), then process 0 looks for a notice and tells everyone.
    self.manager.reached_preemption(int(step))
    multihost.barrier("preemption.counters")
    found = False
    if multihost.is_writer():
      try:
        multihost._client().key_value_try_get(_NOTICE_KEY)
        found = True
      except jax.errors.JaxRuntimeError:   # NOT_FOUND: no process got the notice
        found = False
    return bool(multihost.broadcast("preemption.notice", found))


class Clock:
  """`train.checkpoint_every_minutes`: `due()` is True once that many minutes have passed since
  the last save (`saved()`), by process 0's clock for every process (0 minutes: never).
  Collective when on: every process calls `due` after every step."""

  def __init__(self, minutes: float):
    self.seconds = float(minutes) * 60.0
    self.last = _now()

  def due(self) -> bool:
    if self.seconds <= 0:
      return False
    return bool(multihost.broadcast("checkpoint_clock", _now() - self.last >= self.seconds))

  def saved(self) -> None:
    self.last = _now()
