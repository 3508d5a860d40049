"""Training metrics sinks: a tqdm progress bar (stdout), `metrics.jsonl` and TensorBoard events.

TensorBoard files are written with tensorboardX (no TensorFlow). JSONL lines are
`{"step": int, "time": float, <name>: float, ...}`, flushed on every write so an external watcher
(or a test) can follow progress. On resume, lines for steps after the restored step are dropped
so the file never holds two different histories for one step.
"""

from __future__ import annotations

import json
import math
import os
import time

import tqdm


def _summary_writer_cls():
  """tensorboardX.SummaryWriter without its optional `import torch` (seconds and a large RSS for
  nothing: we only log floats, and library code must not pull torch in)."""
  import sys  # pylint: disable=import-outside-toplevel
  if "torch" in sys.modules or "tensorboardX" in sys.modules:
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
    return SummaryWriter
  sys.modules["torch"] = None  # makes tensorboardX's `try: import torch` take its ImportError path
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
  finally:
    del sys.modules["torch"]
  return SummaryWriter


class MetricsWriter:
  """`write(step, metrics)` to JSONL (+ TensorBoard); `bar(step, metrics)` updates the progress bar."""

  def __init__(self, workdir: str, total_steps: int, start_step: int = 0, tensorboard: bool = True,
               is_main: bool = True, desc: str = "train"):
    self.is_main = is_main
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._f = None
    self._tb = None
    self._bar = None
    if not is_main:
      return
    os.makedirs(workdir, exist_ok=True)
    if os.path.exists(self.path):  # resume: keep only the history up to the restored step
      with open(self.path) as f:
        keep = [l for l in f if l.strip() and json.loads(l).get("step", 0) <= start_step]
      with open(self.path, "w") as f:
        f.writelines(keep)
    self._f = open(self.path, "a")
    if tensorboard:
      self._tb = _summary_writer_cls()(os.path.join(workdir, "tensorboard"))
    self._bar = tqdm.tqdm(total=total_steps, initial=start_step, desc=desc, dynamic_ncols=True)

  def write(self, step: int, metrics: dict) -> None:
    if not self.is_main:
      return
    rec = {"step": int(step), "time": time.time()}
    rec.update({k: float(v) for k, v in metrics.items()})
    self._f.write(json.dumps({k: (v if math.isfinite(v) else str(v)) for k, v in rec.items()}) + "\n")
    self._f.flush()
    if self._tb is not None:
      for k, v in metrics.items():
        self._tb.add_scalar(k, float(v), int(step))

  def bar(self, step: int, metrics: dict) -> None:
    if self._bar is None:
      return
    self._bar.n = int(step)
    self._bar.set_postfix({k: f"{float(v):.4g}" for k, v in metrics.items() if k in ("loss", "lr", "grad_norm")},
                          refresh=False)
    self._bar.refresh()

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
    if self._tb is not None:
      self._tb.close()
    if self._f is not None:
      self._f.close()
    self._bar = self._tb = self._f = None
