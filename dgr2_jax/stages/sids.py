"""Stage 'sids': item embeddings -> RQ-VAE -> unique 4-token semantic IDs in `workdir/sids/`.

Outputs: `embeddings.npy` [n_items, D], `codes.npy` [n_items, 4] int32, `sids.txt` (one SID per item
index), `tokens.txt` (every SID token, for the conversion tool's --add_tokens), `stats.json`
(unique_rate, codebook_usage per level, collision_rate before the 4th token, timings).
"""

from __future__ import annotations

import os
import time

import numpy as np

from dgr2_jax import fileio
from dgr2_jax.data import api
from dgr2_jax.data import sids
from dgr2_jax.stages import common
from dgr2_jax.stages import contract


def _hash(config, workdir: str, upstream: dict) -> str:
  if upstream["data"] is None:
    raise FileNotFoundError(f"{os.path.join(workdir, 'data')} is not built: run the data stage first")
  parts = [config.sids.to_dict(), {"seed": config.seed}, upstream["data"]]
  if config.sids.encoder == "npy" and config.sids.embeddings_npy and os.path.exists(
      config.sids.embeddings_npy):
    parts.append(fileio.file_digest(config.sids.embeddings_npy))
  return common.config_hash(*parts, workdir=workdir)


def _build(config, workdir: str, build: contract.Build) -> dict:
  """Builds `workdir/sids`; returns its stats dict."""
  cfg = config.sids
  items = api.load_items(workdir)
  n_combos = cfg.codebook_size ** cfg.num_levels
  if cfg.num_levels + 1 > len(sids.LEVEL_NAMES):
    raise ValueError(f"sids.num_levels must be <= {len(sids.LEVEL_NAMES) - 1}")
  with build.publish({"stage": "sids"}) as tmp:
    t0 = time.time()
    emb = sids.embed_items(cfg, items, int(config.seed))
    t1 = time.time()
    codes, info = sids.train_rqvae(cfg, emb, int(config.seed))
    t2 = time.time()
    full = sids.dedup_codes(codes)
    st = sids.code_stats(codes, full, cfg.codebook_size)
    st.update(info, encoder=cfg.encoder, embed_dim=int(emb.shape[1]), embed_seconds=t1 - t0,
              rqvae_seconds=t2 - t1, code_combinations=n_combos)
    if st["unique_rate"] != 1.0:
      raise RuntimeError("SIDs are not unique after the 4th token")
    np.save(os.path.join(tmp, "embeddings.npy"), emb)
    np.save(os.path.join(tmp, "codes.npy"), full)
    with open(os.path.join(tmp, "sids.txt"), "w") as f:
      f.writelines(sids.sid_string(c) + "\n" for c in full)
    with open(os.path.join(tmp, "tokens.txt"), "w") as f:
      f.writelines(t + "\n" for t in sids.sid_tokens(cfg.codebook_size, cfg.num_levels,
                                                       st["max_collision_group"]))
    common.write_json_atomic(os.path.join(tmp, "stats.json"), st)
  usage = " ".join(f"{u:.1%}" for u in st["codebook_usage"])
  print(f"sids: {len(items)} items, usage per level {usage}, collision rate (3 codes) "
        f"{st['collision_rate']:.2%}, unique with 4th token {st['unique_rate']:.0%}  "
        f"(embed {st['embed_seconds']:.1f}s, rqvae {st['rqvae_seconds']:.1f}s)", flush=True)
  return st


STAGE = contract.Stage(name="sids", reads=("data",), hashed=_hash, build=_build,
                       fresh=contract.result_json("stats.json"), host_only=True)


def run(config, workdir: str) -> dict:
  """Builds (or reuses) `workdir/sids`; returns its stats dict."""
  return contract.run(STAGE, config, workdir)
