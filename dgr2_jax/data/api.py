"""Read-only access to what the data, sids and retriever stages wrote (never recomputes).

Item / user order is the integer index order of `workdir/data` (see tfds_builders.py). The data
stage reads its TFDS array_record files back through `tfds` data sources fed to grain and keeps
plain JSON copies (`items.jsonl`, `sequences.json`) that these functions read; `data_source()`
gives the TFDS records themselves as a grain MapDataset.
"""

from __future__ import annotations

import functools
import json
import os

import grain
import numpy as np

from dgr2_jax.data import tfds_builders
from dgr2_jax import fileio

SPLITS = ("train", "valid", "test")
_TFDS_SPLIT = {"train": "train", "valid": "validation", "test": "test"}


def _done(workdir: str, stage: str) -> dict:
  path = os.path.join(workdir, stage)
  done = fileio.read_done(path)
  if done is None:
    raise FileNotFoundError(f"{path} is not built: run the {stage!r} stage first")
  return done


@functools.lru_cache(maxsize=4)
def _read_json(path: str, chash: str, lines: bool):
  del chash  # cache key only: a rebuilt stage invalidates the cache
  with open(path) as f:
    return [json.loads(l) for l in f if l.strip()] if lines else json.load(f)


def _data_file(workdir: str, name: str, lines: bool):
  chash = _done(workdir, "data")["config_hash"]
  return _read_json(os.path.abspath(os.path.join(workdir, "data", name)), chash, lines)


def data_source(workdir: str, split: str) -> grain.MapDataset:
  """The TFDS records of a split ('items', 'train', 'validation', 'test') as a grain MapDataset."""
  _done(workdir, "data")
  return grain.MapDataset.source(
      tfds_builders.data_source(os.path.join(workdir, "data", "tfds"))[split])


def load_items(workdir: str) -> list[dict]:
  """Per item index: {item, title, brand (str|None), categories (list[str]), price (float|None),
  raw_id, asin}. A fresh list of fresh dicts (callers may mutate)."""
  return [dict(d, categories=list(d["categories"])) for d in _data_file(workdir, "items.jsonl", True)]


def load_sequences(workdir: str) -> list[list[int]]:
  """Per user index: the full time-ordered item-index sequence (test history + test target)."""
  return [list(s) for s in _data_file(workdir, "sequences.json", False)]


def load_users(workdir: str) -> list[str]:
  """Per user index: the raw user id of the input files."""
  _done(workdir, "data")
  with open(os.path.join(workdir, "data", "user_map.tsv")) as f:
    return [line.rstrip("\n").split("\t")[1] for line in list(f)[1:]]


def load_stats(workdir: str) -> dict:
  with open(os.path.join(workdir, "data", "stats.json")) as f:
    return json.load(f)


def split_examples(sequences: list[list[int]], split: str) -> tuple[list[list[int]], np.ndarray]:
  """(histories, targets) at a split's cutoff: test seq[:-1]/seq[-1], valid [:-2]/[-2], train [:-3]/[-3]."""
  cut = {"train": 3, "valid": 2, "test": 1}[split]
  return [s[:-cut] for s in sequences], np.asarray([s[-cut] for s in sequences], np.int32)


def load_sids(workdir: str) -> list[str]:
  """Per item index, the 4-token SID string, e.g. '<a_12><b_201><c_7><d_0>'."""
  _done(workdir, "sids")
  with open(os.path.join(workdir, "sids", "sids.txt")) as f:
    return [line.rstrip("\n") for line in f]


def load_sid_codes(workdir: str) -> np.ndarray:
  """[n_items, 4] int32 codes (level a, b, c, de-duplication d)."""
  _done(workdir, "sids")
  return np.load(os.path.join(workdir, "sids", "codes.npy"))


def load_sid_tokens(workdir: str) -> list[str]:
  """Every SID token (`<a_0>` ... `<d_k>`), as in `workdir/sids/tokens.txt`."""
  _done(workdir, "sids")
  with open(os.path.join(workdir, "sids", "tokens.txt")) as f:
    return [line.rstrip("\n") for line in f if line.strip()]


def load_candidates(workdir: str, split: str) -> np.ndarray:
  """[n_users, 10] int32 retriever top-10 item indices at the split's cutoff (history excluded)."""
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  _done(workdir, "retriever")
  return np.load(os.path.join(workdir, "retriever", f"candidates_{split}.npy"))


def load_retriever_metrics(workdir: str) -> dict:
  with open(os.path.join(workdir, "retriever", "metrics.json")) as f:
    return json.load(f)
