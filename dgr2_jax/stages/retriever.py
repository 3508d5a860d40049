"""Stage 'retriever': top-10 candidates per user and split in `workdir/retriever/`.

retriever.source='sasrec' trains SASRec (dgr2_jax/data/sasrec.py) on the train split; 'file' reads
candidate lists of any retriever from retriever.candidates_file: JSON lines
`{"user": <user index>, "split": "train"|"valid"|"test", "candidates": [<item index> x 10]}`, one
line per user and split (all users, all three splits), history items excluded, no duplicates.

Outputs: `candidates_{train,valid,test}.npy` [n_users, 10] int32, `candidates.jsonl` (same, in the
file format above), `metrics.json` ({valid, test} x recall@5, recall@10, ndcg@5, ndcg@10,
n_hits@10, n_users; plus the popularity baseline; `train` too: how often a training list holds its
target), and for SASRec `params.msgpack` and training log. With `retriever.train_lists='holdout'`
a second SASRec trained on seq[:-3] ranks the training split (`params_holdout.msgpack`,
`train_log_holdout.json`): no training list comes from a model that saw its target.
"""

from __future__ import annotations

import json
import os
import time

import flax.serialization
import numpy as np

from dgr2_jax import fileio
from dgr2_jax.data import api
from dgr2_jax.data import sasrec
from dgr2_jax.fileio import InputError
from dgr2_jax.stages import common
from dgr2_jax.stages import contract


def _hash(config, workdir: str, upstream: dict) -> str:
  if upstream["data"] is None:
    raise FileNotFoundError(f"{os.path.join(workdir, 'data')} is not built: run the data stage first")
  parts = [config.retriever.to_dict(), {"seed": config.seed}, upstream["data"]]
  f = config.retriever.candidates_file
  if config.retriever.source == "file" and f and os.path.exists(f):
    parts.append(fileio.file_digest(f))
  return common.config_hash(*parts, workdir=workdir)


def read_candidates_file(path: str, sequences: list[list[int]], n_items: int, k: int) -> dict:
  """{split: [n_users, k] int32} from the JSONL format above; one-line errors with file:line."""
  if not path:
    raise ValueError("retriever.source='file' needs retriever.candidates_file")
  if not os.path.exists(path):
    raise FileNotFoundError(f"retriever.candidates_file {path!r} does not exist")
  n_users = len(sequences)
  out = {s: np.full([n_users, k], -1, np.int32) for s in api.SPLITS}
  cut = {"train": 3, "valid": 2, "test": 1}
  with open(path) as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path}:{n}"
      try:
        d = json.loads(line)
        u, split, c = d["user"], d["split"], d["candidates"]
      except (json.JSONDecodeError, KeyError, TypeError):
        raise InputError(f"{where}: expected a JSON object with user, split, candidates") from None
      if split not in out:
        raise InputError(f"{where}: split must be one of {api.SPLITS}, got {split!r}")
      if not isinstance(u, int) or not 0 <= u < n_users:
        raise InputError(f"{where}: user {u!r} does not resolve (users are 0..{n_users - 1})")
      if (not isinstance(c, list) or len(c) != k
          or not all(isinstance(i, int) and 0 <= i < n_items for i in c)):
        raise InputError(f"{where}: candidates must be {k} item indices in 0..{n_items - 1}")
      if len(set(c)) != k:
        raise InputError(f"{where}: duplicate candidates")
      hist = set(sequences[u][:-cut[split]])
      if hist & set(c):
        raise InputError(f"{where}: candidates {sorted(hist & set(c))} are in the user's history")
      out[split][u] = c
  for split, a in out.items():
    missing = np.flatnonzero(a[:, 0] < 0)
    if missing.size:
      raise InputError(f"{path}: split {split!r} lacks users {missing[:5].tolist()}"
                       f"{'...' if missing.size > 5 else ''} ({missing.size} missing)")
  return out


def _build(config, workdir: str, build: contract.Build) -> dict:
  """Builds `workdir/retriever`; returns the metrics dict."""
  cfg = config.retriever
  if cfg.source not in ("sasrec", "file"):
    raise ValueError(f"retriever.source must be 'sasrec' or 'file', got {cfg.source!r}")
  seqs = api.load_sequences(workdir)
  n_items = len(api.load_items(workdir))
  k = int(cfg.num_candidates)
  t0 = time.time()
  log = {}
  with build.publish({"stage": "retriever"}) as tmp:
    train_seqs = [s[:-2] for s in seqs]
    if cfg.source == "file":
      cands = read_candidates_file(cfg.candidates_file, seqs, n_items, k)
    else:
      trainer = sasrec.Trainer(cfg, n_items, train_seqs, int(config.seed))
      vh, vt = api.split_examples(seqs, "valid")
      log = trainer.fit(vh, vt)
      own = [s for s in api.SPLITS if s != "train" or cfg.train_lists == "same"]
      cands = {s: trainer.rank(api.split_examples(seqs, s)[0], None, k)[0] for s in own}
      with open(os.path.join(tmp, "params.msgpack"), "wb") as f:
        f.write(flax.serialization.to_bytes(trainer.params))
      if cfg.train_lists == "holdout":
        # Early stopping on the same validation users: their targets are unseen by this model
        # too, and the training split's targets stay out of every choice it makes.
        held = sasrec.Trainer(cfg, n_items, [s[:-3] for s in seqs], int(config.seed) + 1)
        hlog = held.fit(vh, vt)
        cands["train"] = held.rank(api.split_examples(seqs, "train")[0], None, k)[0]
        with open(os.path.join(tmp, "params_holdout.msgpack"), "wb") as f:
          f.write(flax.serialization.to_bytes(held.params))
        common.write_json_atomic(os.path.join(tmp, "train_log_holdout.json"), hlog)
    metrics = {"train_lists": cfg.train_lists if cfg.source == "sasrec" else "file"}
    for split in ("train", "valid", "test"):
      h, t = api.split_examples(seqs, split)
      metrics[split] = sasrec.rank_metrics(sasrec.candidate_ranks(cands[split], t))
      pop = sasrec.popularity_topk(train_seqs, h, n_items, k)
      metrics.setdefault("popularity", {})[split] = sasrec.rank_metrics(
          sasrec.candidate_ranks(pop, t))
    metrics["source"] = cfg.source
    metrics["seconds"] = time.time() - t0
    metrics["training"] = {k_: v for k_, v in log.items() if k_ != "history"}
    for split, a in cands.items():
      np.save(os.path.join(tmp, f"candidates_{split}.npy"), a.astype(np.int32))
    with open(os.path.join(tmp, "candidates.jsonl"), "w") as f:
      for split, a in cands.items():
        for u, row in enumerate(a):
          f.write(json.dumps({"user": u, "split": split, "candidates": row.tolist()}) + "\n")
    if log:
      common.write_json_atomic(os.path.join(tmp, "train_log.json"), log)
    common.write_json_atomic(os.path.join(tmp, "metrics.json"), metrics)
  for split in ("train", "valid", "test"):
    m = metrics[split]
    print(f"retriever[{cfg.source}] {split}: R@5 {m['recall@5']:.4f} R@10 {m['recall@10']:.4f} "
          f"N@5 {m['ndcg@5']:.4f} N@10 {m['ndcg@10']:.4f}  users with target in top-10: "
          f"{m['n_hits@10']} / {m['n_users']}", flush=True)
  return metrics


STAGE = contract.Stage(name="retriever", reads=("data",), hashed=_hash, build=_build,
                       fresh=lambda config, workdir, out: api.load_retriever_metrics(workdir),
                       host_only=True)


def run(config, workdir: str) -> dict:
  """Builds (or reuses) `workdir/retriever`; returns the metrics dict."""
  return contract.run(STAGE, config, workdir)
