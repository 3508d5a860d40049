"""Stage 'data': builds the TFDS dataset (array_record) into `workdir/data/` and its statistics.

Outputs: `data/tfds/` (the TFDS build), `data/stats.json` (users, items, interactions, avg_seq_len
(exact), ...), `data/items.jsonl` and `data/sequences.json` (plain copies of the records read back
through TFDS + grain), `data/user_map.tsv` and `data/item_map.tsv` (index -> raw id), `DONE.json`.
"""

from __future__ import annotations

import json
import os
import time

from absl import logging
import grain

from dgr2_jax import fileio
from dgr2_jax.data import api
from dgr2_jax.data import beauty
from dgr2_jax.data import tfds_builders
from dgr2_jax.stages import common
from dgr2_jax.stages import contract


def stage_hash(config, workdir: str | None = None, upstream: dict | None = None) -> str:
  del workdir, upstream  # reads no other stage; its inputs are named by config.data
  parts = [config.data.to_dict()]
  if config.data.source == "synthetic":
    parts.append({"seed": config.seed})
  else:  # a changed input file must rebuild; a copied or re-mounted one (new mtime) need not
    fmt, paths = beauty.resolve_format(config.data.dir, config.data.format)
    parts.append({p: fileio.file_digest(v) for p, v in sorted(paths.items())})
  return common.config_hash(*parts)


def _fresh(config, workdir: str, out: str) -> dict:
  del config, out
  st = api.load_stats(workdir)
  logging.info("data: %s", beauty.format_stats(st))
  return st


def _build(config, workdir: str, build: contract.Build) -> dict:
  """Builds `workdir/data`; returns the stats dict."""
  del workdir
  t0 = time.time()
  with build.publish({"stage": "data"}) as tmp:
    tfds_dir = os.path.join(tmp, "tfds")
    tfds_builders.build(config.data, int(config.seed), tfds_dir)
    # Read back through the TFDS data source + grain: the stats check the stored records.
    src = tfds_builders.data_source(tfds_dir)
    test = list(grain.MapDataset.source(src["test"]))
    items = list(grain.MapDataset.source(src["items"]))
    seqs = [[int(i) for i in r["history"]] + [int(r["target"])] for r in test]
    item_dicts = []
    for r in items:
      price = r["price"].decode()
      item_dicts.append({
          "item": int(r["item"]), "title": r["title"].decode(), "brand": r["brand"].decode() or None,
          "categories": [c.decode() for c in r["categories"]],
          "price": float(price) if price else None,
          "raw_id": r["raw_id"].decode(), "asin": r["asin"].decode()})
    if [d["item"] for d in item_dicts] != list(range(len(items))) or [
        int(r["user"]) for r in test] != list(range(len(test))):
      raise RuntimeError("TFDS records came back out of index order")
    # Plain copies for fast reads by dgr2_jax.data.api (decoding TFDS records costs ~1 ms each).
    with open(os.path.join(tmp, "items.jsonl"), "w") as f:
      for d in item_dicts:
        f.write(json.dumps(d) + "\n")
    with open(os.path.join(tmp, "sequences.json"), "w") as f:
      json.dump(seqs, f)
    st = beauty.stats(seqs, len(items))
    st["build_seconds"] = time.time() - t0
    common.write_json_atomic(os.path.join(tmp, "stats.json"), st)
    with open(os.path.join(tmp, "user_map.tsv"), "w") as f:
      f.write("user\traw_user\n")
      for r in test:
        f.write(f"{int(r['user'])}\t{r['raw_user'].decode()}\n")
    with open(os.path.join(tmp, "item_map.tsv"), "w") as f:
      f.write("item\traw_id\tasin\n")
      for r in items:
        f.write(f"{int(r['item'])}\t{r['raw_id'].decode()}\t{r['asin'].decode()}\n")
  print(f"data: {beauty.format_stats(st)}  ({st['build_seconds']:.1f}s)", flush=True)
  return st


STAGE = contract.Stage(name="data", hashed=stage_hash, build=_build, fresh=_fresh, host_only=True)


def run(config, workdir: str) -> dict:
  """Builds (or reuses) `workdir/data`; returns the stats dict."""
  return contract.run(STAGE, config, workdir)
