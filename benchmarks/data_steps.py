"""Wall time of the data steps on real Beauty (CPU): build, embed, RQ-VAE, SASRec; prints metrics.

  JAX_PLATFORMS=cpu python benchmarks/data_steps.py --data_dir=../shared/data/amazon_beauty \
      [--workdir=/tmp/dgr2_bench] [--encoder=minilm] [--fresh]

Runs the data, sids and retriever stages with their default configs (`dgr2_jax/data/config.py`) in
`--workdir` (cached: pass --fresh to time everything from scratch) and writes `benchmark.json` there.
"""

import json
import os
import shutil
import time

from absl import app
from absl import flags
import ml_collections

from dgr2_jax.data import config as data_config
from dgr2_jax.stages import data as data_stage
from dgr2_jax.stages import retriever as retriever_stage
from dgr2_jax.stages import sids as sids_stage

flags.DEFINE_string("data_dir", None, "Beauty folder (either input format).", required=True)
flags.DEFINE_string("workdir", "/tmp/dgr2_bench", "Work directory.")
flags.DEFINE_string("encoder", "minilm", "sids.encoder: minilm | hash | npy")
flags.DEFINE_string("embeddings_npy", "", "sids.embeddings_npy when --encoder=npy")
flags.DEFINE_integer("sasrec_epochs", None, "Override retriever.num_epochs.")
flags.DEFINE_bool("fresh", False, "Delete the stage outputs first.")
flags.DEFINE_list("stages", "data,sids,retriever", "Stages to run.")
FLAGS = flags.FLAGS


def _done_mtime(wd, stage):
  p = os.path.join(wd, stage, "DONE.json")
  return os.path.getmtime(p) if os.path.exists(p) else None


def main(_):
  c = ml_collections.ConfigDict({"seed": 0, "data": data_config.data_config(),
                                 "sids": data_config.sids_config(),
                                 "retriever": data_config.retriever_config()})
  c.data.dir = FLAGS.data_dir
  c.sids.encoder = FLAGS.encoder
  c.sids.embeddings_npy = FLAGS.embeddings_npy
  if FLAGS.sasrec_epochs:
    c.retriever.num_epochs = FLAGS.sasrec_epochs
  wd = FLAGS.workdir
  if FLAGS.fresh:
    for s in FLAGS.stages:
      shutil.rmtree(os.path.join(wd, s), ignore_errors=True)
  res = {"wall_seconds": {}}
  bench = os.path.join(wd, "benchmark.json")
  if os.path.exists(bench) and not FLAGS.fresh:  # keep the timings of stages run earlier
    with open(bench) as f:
      res = json.load(f)
  def ran(stage, before):  # a cached (fresh) stage keeps the timing of the run that built it
    return _done_mtime(wd, stage) != before

  if "data" in FLAGS.stages:
    t, m = time.time(), _done_mtime(wd, "data")
    res["data"] = data_stage.run(c, wd)
    if ran("data", m):
      res["wall_seconds"]["build"] = time.time() - t
    res["wall_seconds"].setdefault("build", res["data"]["build_seconds"])
  if "sids" in FLAGS.stages:
    t, m = time.time(), _done_mtime(wd, "sids")
    st = sids_stage.run(c, wd)
    if ran("sids", m):
      res["wall_seconds"]["sids_stage"] = time.time() - t
      res["wall_seconds"]["embed"] = st["embed_seconds"]
      res["wall_seconds"]["rqvae"] = st["rqvae_seconds"]
    res["wall_seconds"].setdefault("embed", st["embed_seconds"])
    res["wall_seconds"].setdefault("rqvae", st["rqvae_seconds"])
    res["sids"] = st
  if "retriever" in FLAGS.stages:
    t, m = time.time(), _done_mtime(wd, "retriever")
    res["retriever"] = retriever_stage.run(c, wd)
    if ran("retriever", m):
      res["wall_seconds"]["sasrec"] = time.time() - t
  print("wall seconds:", json.dumps(res["wall_seconds"], indent=1))
  if "data" in res:
    d = res["data"]
    print(f"stats: users {d['users']} items {d['items']} interactions {d['interactions']} "
          f"avg_seq_len {d['avg_seq_len']:.3f}")
  if "sids" in res:
    s = res["sids"]
    print(f"sids: usage {s['codebook_usage']} collision_rate {s['collision_rate']:.4f} "
          f"unique_rate {s['unique_rate']}")
  if "retriever" in res:
    for split in ("valid", "test"):
      print(f"sasrec {split}: {json.dumps(res['retriever'][split])}")
  if os.path.exists(bench) and not FLAGS.fresh:  # merge with a run that finished meanwhile
    with open(bench) as f:
      old = json.load(f)
    res = {**old, **res, "wall_seconds": {**old.get("wall_seconds", {}), **res["wall_seconds"]}}
  with open(bench, "w") as f:
    json.dump(res, f, indent=1)


if __name__ == "__main__":
  app.run(main)
