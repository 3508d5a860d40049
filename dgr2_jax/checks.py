"""The config checks every section's `validate` shares (stdlib only: the bottom floor).

Each config section is validated by the module that owns it, the one that also defines its
defaults (`dgr2_jax/data/config.py` for `data`, `sids`, `retriever`; `task/config.py` for `task`,
`eval`; `train/config.py` for `train`; `model/config.py`; `decode/config.py`; `train/cft.py`,
`train/opd.py`, `train/grpo.py` (`rl`, `teacher_rl`); `train/dry_run.py` (`hardware`);
`stages/bench.py`, `stages/generate.py`, `stages/pipeline.py`); `dgr2_jax.main.validate` only
dispatches. A check raises ValueError (a bad value) or FileNotFoundError (a missing path) whose
message starts with `config.<field>:`, so the command line prints it as one line.
"""

from __future__ import annotations

import os


def fail(field: str, msg: str):
  raise ValueError(f"config.{field}: {msg}")


def one_of(c, section: str, field: str, allowed) -> None:
  v = c[section][field]
  if v not in allowed:
    fail(f"{section}.{field}", f"must be one of {list(allowed)}, got {v!r}")


def is_int(v, minimum: int) -> bool:
  return not isinstance(v, bool) and isinstance(v, int) and v >= minimum


def positive_int(c, section: str, field: str, minimum: int = 1, note: str = "") -> None:
  v = c[section][field]
  if not is_int(v, minimum):
    fail(f"{section}.{field}", f"must be an int >= {minimum}{note}, got {v!r}")


def exists(path_field: str, path: str, what: str = "path") -> None:
  if not os.path.exists(path):
    raise FileNotFoundError(f"config.{path_field}: {what} {path!r} does not exist")


def is_dir(path_field: str, path: str, what: str = "directory") -> None:
  exists(path_field, path, what)
  if not os.path.isdir(path):
    raise FileNotFoundError(f"config.{path_field}: {what} {path!r} is a file, not a directory")


def is_file(path_field: str, path: str, what: str = "file") -> None:
  exists(path_field, path, what)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"config.{path_field}: {what} {path!r} is a directory, not a file")


def model_dir(path_field: str, path: str, what: str = "model directory") -> None:
  """A model directory (HF or ours) exists and holds a config.json."""
  is_dir(path_field, path, what)
  if not os.path.isfile(os.path.join(path, "config.json")):
    raise FileNotFoundError(f"config.{path_field}: {what} {path!r} has no config.json (not a model "
                            "directory)")
