"""The stage contract: what a stage declares once, and what every stage gets from it.

A stage module declares `STAGE = Stage(name=..., reads=(...), hashed=..., build=...)`; `run` does,
for every stage alike: the hashes of the stages it reads, its config hash, the freshness check
(a fresh stage is skipped), the atomic output directory (`Build.publish`), process 0 alone for a
host-only stage when there are several processes, and (`execute`) the wall-clock of each build in
`workdir/results/stage_built_times.json`. The registry (stages/registry.py) lists the stages; the
pipeline and `main` run them through `execute`. See docs/architecture.md, "Adding a stage".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import time
from typing import Any, Callable, Iterator

from dgr2_jax import multihost
from dgr2_jax.stages import common


def _output_dir(config, workdir: str, chash: str, name: str) -> str:
  del config, chash
  return common.stage_dir(workdir, name)


@dataclasses.dataclass(frozen=True)
class Stage:
  """One stage, declared once in its module.

  name: the stage's name (`config.stage`, `workdir/<name>/`): its module's name in the registry.
  hashed: `(config, workdir, upstream) -> config hash`; `upstream` maps each stage of `reads` to
    its DONE.json hash (None when not built). May raise when an input is missing.
  build: `(config, workdir, Build, **options) -> result`: builds the stage, publishing its output
    with `Build.publish`; runs only when the stage is not fresh.
  fresh: `(config, workdir, out) -> result` of a fresh stage (default: `out`).
  reads: the stages whose outputs it reads from the workdir (their hashes enter its own).
  chain: a model stage that starts from the chain's previous model (chain.py), unless
    `config.<name>.init_from` names one.
  host_only: computes on the host alone: with several processes, process 0 builds it while the
    others wait, then they find it fresh.
  workdir: False for a stage of explicit paths (no workdir, no freshness: `build(config, None)`).
  output: `(config, workdir, chash, name) -> output directory` (default `workdir/<name>`).
  """
  name: str
  build: Callable[..., Any]
  hashed: Callable[..., str] | None = None
  fresh: Callable[..., Any] | None = None
  reads: tuple[str, ...] = ()
  chain: bool = False
  host_only: bool = False
  workdir: bool = True
  output: Callable[..., str] = _output_dir


@dataclasses.dataclass(frozen=True)
class Build:
  """What a stage's `build` gets: its output directory and config hash, and `publish`."""
  stage: str
  out: str
  chash: str

  @contextlib.contextmanager
  def publish(self, extra: dict | None = None) -> Iterator[str]:
    """A temporary directory that replaces `out`, with a DONE.json (this hash, `extra`), once the
    block ends without an exception (`common.atomic_dir`: collective with several processes)."""
    with common.atomic_dir(self.out, self.chash, extra) as tmp:
      yield tmp

  def train_dir(self) -> str:
    """`out/train`, the live (resumable) training directory of a training stage: a finished stage
    or a partial run of another config is wiped first, a partial run of this one is kept."""
    train_dir = os.path.join(self.out, "train")
    stamp = os.path.join(train_dir, "config_hash")
    if common.is_writer():  # several processes: process 0 decides and prepares, the others wait
      if os.path.exists(self.out) and (common.read_done(self.out) is not None or not os.path.exists(stamp)
                                       or open(stamp).read().strip() != self.chash):
        shutil.rmtree(self.out)
      os.makedirs(train_dir, exist_ok=True)
      with open(stamp, "w") as f:
        f.write(self.chash)
    multihost.barrier("prepare_train_dir")
    return train_dir


def result_json(name: str) -> Callable[..., Any]:
  """A `Stage.fresh` returning the JSON file `name` of the stage's output (what `build` returned)."""
  def fresh(config, workdir: str, out: str) -> Any:
    del config, workdir
    with open(os.path.join(out, name)) as f:
      return json.load(f)
  return fresh


def upstream(workdir: str, stages) -> dict:
  """{stage: its DONE.json config hash, None when not built}."""
  return {s: (common.read_done(common.stage_dir(workdir, s)) or {}).get("config_hash") for s in stages}


def run(stage: Stage, config, workdir: str | None, **options) -> Any:
  """Runs `stage` unless it is fresh; returns its result (`build`'s, or `fresh`'s when skipped).
  `options` go to `build` (e.g. the eval stage's generate function)."""
  if not stage.workdir:
    return stage.build(config, workdir, **options)
  if stage.host_only:  # several processes: process 0 builds, the others wait and read
    return multihost.writer_first(f"stage.{stage.name}", lambda: _run(stage, config, workdir, options))
  return _run(stage, config, workdir, options)


def _run(stage: Stage, config, workdir: str, options: dict) -> Any:
  chash = stage.hashed(config, workdir, upstream(workdir, stage.reads))
  out = stage.output(config, workdir, chash, stage.name)
  if common.is_fresh(out, chash):
    logging.info("%s: fresh (%s)", stage.name, chash)
    return stage.fresh(config, workdir, out) if stage.fresh else out
  return stage.build(config, workdir, Build(stage.name, out, chash), **options)


def execute(stage: Stage, config, workdir: str | None) -> Any:
  """`run`, timed: what the pipeline and `main` call for every stage."""
  if not stage.workdir or not workdir:
    return run(stage, config, workdir)
  return timed(stage.name, lambda c, w: run(stage, c, w), config, workdir)


# ---- wall-clock of each build ----------------------------------------------------------------------
BUILT_TIMES = os.path.join("results", "stage_built_times.json")


def _read_built(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):  # none yet, or unreadable: times are a record, not an input
    return {}


def _done_stamp(workdir: str, stage: str):
  """When the stage was last built: its DONE.json's mtime (the ladder: its newest row's)."""
  d = common.stage_dir(workdir, stage)
  files = [os.path.join(d, "DONE.json")]
  if stage == "eval" and os.path.isdir(d):
    files += [os.path.join(d, m, "DONE.json") for m in sorted(os.listdir(d))]
  stamps = [os.path.getmtime(f) for f in files if os.path.exists(f)]
  return max(stamps) if stamps else None


def timed(name: str, fn, config, workdir: str):
  """`fn(config, workdir)`; when it (re)built stage `name` (its DONE.json changed; the ladder: any
  row's), the wall-clock goes to `workdir/results/stage_built_times.json` ({stage: {seconds,
  config_hash}})."""
  before = _done_stamp(workdir, name)
  t0 = time.perf_counter()
  out = fn(config, workdir)
  seconds = round(time.perf_counter() - t0, 1)
  after = _done_stamp(workdir, name)
  if workdir and multihost.is_writer() and after != before:
    path = os.path.join(workdir, BUILT_TIMES)
    built = _read_built(path)
    done = common.read_done(common.stage_dir(workdir, name)) or {}
    built[name] = {"seconds": seconds, "config_hash": done.get("config_hash")}
    common.write_json_atomic(path, built)
  return out


def built_times(workdir: str, stages) -> dict:
  """{stage: seconds of the run that built it as it now stands} for the stages recorded with
  their current config hash (the ladder, which has none of its own: its last build)."""
  built = _read_built(os.path.join(workdir, BUILT_TIMES))
  out = {}
  for s in stages:
    b = built.get(s)
    done = common.read_done(common.stage_dir(workdir, s)) or {}
    if b and (s == "eval" or b.get("config_hash") == done.get("config_hash")):
      out[s] = b["seconds"]
  return out
