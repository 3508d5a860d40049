"""Plain data and atomic files: the bottom floor every writer of the package shares.

`to_plain` turns configs into JSON-able Python (for hashes and records); the writers go through a
temporary file + rename in the same directory, so a reader never sees a partial file. With several
processes only process 0 writes (`multihost.is_writer`); the others' calls return without writing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from typing import Any

import ml_collections

from dgr2_jax import multihost
from dgr2_jax.multihost import is_writer  # noqa: F401 (re-exported)


def to_plain(obj: Any) -> Any:
  """ConfigDict / nested containers -> JSON-able plain Python."""
  if isinstance(obj, (ml_collections.ConfigDict, ml_collections.FrozenConfigDict)):
    obj = obj.to_dict()
  if isinstance(obj, dict):
    return {str(k): to_plain(v) for k, v in sorted(obj.items())}
  if isinstance(obj, (list, tuple)):
    return [to_plain(v) for v in obj]
  return obj


def file_digest(path: str) -> list:
  """[size, sha256] of a file: what a stage hashes of an input file (content, not mtime, so a
  copied or re-mounted input does not rebuild, and an edited one does)."""
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return [os.path.getsize(path), h.hexdigest()]


def write_text_atomic(path: str, text: str) -> None:
  """Writes text via a temporary file + rename (never a partial file); process 0 only."""
  if not multihost.is_writer():
    return
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


def read_done(path: str) -> dict | None:
  """The DONE.json a finished directory carries (stages/common.py), None when unfinished."""
  done = os.path.join(path, "DONE.json")
  if not os.path.exists(done):
    return None
  with open(done) as f:
    return json.load(f)


class InputError(ValueError):
  """A file the user gave (or a stage wrote) cannot be read: truncated, not the format it should
  be. The message names the file; the command line prints it as one line (exit status 1)."""
