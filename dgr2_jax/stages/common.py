"""Work-directory bookkeeping shared by every stage: config hashing, freshness, atomic writes.

A stage owns `workdir/<stage>/`. It is *fresh* when `workdir/<stage>/DONE.json` exists and records
the same config hash the stage would compute now (its own sub-config plus the hashes of the stages
it reads). Outputs are written to a temporary sibling and renamed into place, so an interrupted
stage never leaves a half-written directory that looks finished.

Several processes: freshness is decided on process 0 and broadcast; `atomic_dir` is collective
(one temporary directory, process 0 publishes). How a stage uses these is the stage contract's
(stages/contract.py). See `dgr2_jax.multihost`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any, Iterator

from dgr2_jax import chain
from dgr2_jax import multihost
from dgr2_jax.fileio import is_writer, read_done, to_plain, write_json_atomic, write_text_atomic  # noqa: F401 (re-exported)


def config_hash(*parts: Any, workdir: str | None = None) -> str:
  """Stable short hash of any JSON-able combination of configs and upstream hashes.

  With `workdir`, every string naming a path inside it enters the hash relative to it: a workdir
  that is moved or copied stays fresh (the models it names are keyed by content, `model_hash`).
  """
  plain = [to_plain(p) for p in parts]
  if workdir:
    plain = _relative_paths(plain, os.path.abspath(workdir))
  blob = json.dumps(plain, sort_keys=True, default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _relative_paths(x: Any, root: str) -> Any:
  if isinstance(x, dict):
    return {k: _relative_paths(v, root) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_relative_paths(v, root) for v in x]
  if isinstance(x, str) and x and os.path.isabs(x):
    p = os.path.abspath(x)
    if p == root or p.startswith(root + os.sep):
      return os.path.join("$WORKDIR", os.path.relpath(p, root))
  return x


def stage_dir(workdir: str, name: str) -> str:
  return os.path.join(workdir, name)


def is_fresh(path: str, chash: str) -> bool:
  """Decided on process 0 and broadcast, so every process skips or runs the stage alike."""
  done = read_done(path) if multihost.is_writer() or not multihost.is_multi() else None
  return bool(multihost.broadcast("is_fresh", done is not None and done.get("config_hash") == chash))


@contextlib.contextmanager
def atomic_dir(path: str, chash: str, extra: dict | None = None) -> Iterator[str]:
  """Yields a temporary directory; on success it replaces `path` and gets a DONE.json.

  On an exception the temporary directory is removed and `path` is untouched. With several
  processes it is collective: every process gets the same temporary directory (named by `chash`),
  writes its share, and process 0 publishes it once all are done. A process other than 0 outside
  the collective (inside `multihost.local()`) must never write a stage: that is an error.
  """
  parent = os.path.dirname(os.path.abspath(path)) or "."
  if not multihost.is_writer():
    if not multihost.is_multi():
      raise RuntimeError(f"{path}: process {multihost.process_index()} found this stage stale after "
                         "process 0 built it (its config hash differs between processes)")
    tmp = multihost.broadcast("atomic_dir.tmp")
    multihost.barrier("atomic_dir.open")
    yield tmp
    multihost.barrier("atomic_dir.written")
    multihost.barrier("atomic_dir.published")
    return
  os.makedirs(parent, exist_ok=True)
  if multihost.is_multi():  # a name every process can know: the stage's hash
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{chash}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    multihost.broadcast("atomic_dir.tmp", tmp)
    multihost.barrier("atomic_dir.open")
  else:
    tmp = tempfile.mkdtemp(prefix="." + os.path.basename(path) + ".tmp-", dir=parent)
  try:
    yield tmp
    multihost.barrier("atomic_dir.written")
    with open(os.path.join(tmp, "DONE.json"), "w") as f:
      json.dump({"config_hash": chash, **(extra or {})}, f, indent=1)
    if os.path.exists(path):
      shutil.rmtree(path)
    os.replace(tmp, path)
    multihost.barrier("atomic_dir.published")
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def model_hash(model_dir: str) -> str | None:
  """Identity of a model directory for cache keys: the config hash of the stage that wrote
  `workdir/<stage>/model` (its DONE.json is one level up), else config.json's mtime and size
  (an external directory), else None."""
  done = read_done(os.path.dirname(os.path.abspath(model_dir)))
  if done is not None:
    return done.get("config_hash")
  f = os.path.join(model_dir, "config.json")
  return f"{os.path.getmtime(f)}:{os.path.getsize(f)}" if os.path.exists(f) else None


def previous_model_dir(config, workdir: str, stage: str) -> str:
  """`workdir/<previous model stage>/model`; FileNotFoundError when it was not built."""
  prev = chain.previous_model_stage(config, stage)
  path = chain.model_dir(workdir, prev)
  if read_done(stage_dir(workdir, prev)) is None or not os.path.isdir(path):
    raise FileNotFoundError(f"{path} is not built: run the {prev!r} stage before {stage!r}")
  return path
