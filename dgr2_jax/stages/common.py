"""Work-directory bookkeeping shared by every stage: config hashing, freshness, atomic writes.

A stage owns `workdir/<stage>/`. It is *fresh* when `workdir/<stage>/DONE.json` exists and records
the same config hash the stage would compute now (its own sub-config plus the hashes of the stages
it reads). Outputs are written to a temporary sibling and renamed into place, so an interrupted
stage never leaves a half-written directory that looks finished.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any, Iterator

import ml_collections


def to_plain(obj: Any) -> Any:
  """ConfigDict / nested containers -> JSON-able plain Python."""
  if isinstance(obj, (ml_collections.ConfigDict, ml_collections.FrozenConfigDict)):
    obj = obj.to_dict()
  if isinstance(obj, dict):
    return {str(k): to_plain(v) for k, v in sorted(obj.items())}
  if isinstance(obj, (list, tuple)):
    return [to_plain(v) for v in obj]
  return obj


def config_hash(*parts: Any) -> str:
  """Stable short hash of any JSON-able combination of configs and upstream hashes."""
  blob = json.dumps([to_plain(p) for p in parts], sort_keys=True, default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def stage_dir(workdir: str, name: str) -> str:
  return os.path.join(workdir, name)


def read_done(path: str) -> dict | None:
  done = os.path.join(path, "DONE.json")
  if not os.path.exists(done):
    return None
  with open(done) as f:
    return json.load(f)


def is_fresh(path: str, chash: str) -> bool:
  done = read_done(path)
  return done is not None and done.get("config_hash") == chash


@contextlib.contextmanager
def atomic_dir(path: str, chash: str, extra: dict | None = None) -> Iterator[str]:
  """Yields a temporary directory; on success it replaces `path` and gets a DONE.json.

  On an exception the temporary directory is removed and `path` is untouched.
  """
  parent = os.path.dirname(os.path.abspath(path)) or "."
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix="." + os.path.basename(path) + ".tmp-", dir=parent)
  try:
    yield tmp
    with open(os.path.join(tmp, "DONE.json"), "w") as f:
      json.dump({"config_hash": chash, **(extra or {})}, f, indent=1)
    if os.path.exists(path):
      shutil.rmtree(path)
    os.replace(tmp, path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def write_text_atomic(path: str, text: str) -> None:
  """Writes text via a temporary file + rename (never a partial file)."""
  d = os.path.dirname(os.path.abspath(path))
  os.makedirs(d, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", dir=d)
  try:
    with os.fdopen(fd, "w") as f:
      f.write(text)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.remove(tmp)
    raise


def write_json_atomic(path: str, obj: Any) -> None:
  """Writes JSON via a temporary file + rename (never a partial file)."""
  write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=False))


def model_hash(model_dir: str) -> str | None:
  """Identity of a model directory for cache keys: the config hash of the stage that wrote
  `workdir/<stage>/model` (its DONE.json is one level up), else config.json's mtime and size
  (an external directory), else None."""
  done = read_done(os.path.dirname(os.path.abspath(model_dir)))
  if done is not None:
    return done.get("config_hash")
  f = os.path.join(model_dir, "config.json")
  return f"{os.path.getmtime(f)}:{os.path.getsize(f)}" if os.path.exists(f) else None
