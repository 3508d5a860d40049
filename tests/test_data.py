"""Data stage: both input formats, k-core fixed point, numbering, split, TFDS round trip, errors."""

import collections
import gzip
import os

import ml_collections
import numpy as np
import pytest

from dgr2_jax.data import api
from dgr2_jax.data import beauty
from dgr2_jax.data import config as data_config
from dgr2_jax.data import synthetic
from dgr2_jax.stages import common
from dgr2_jax.stages import data as data_stage

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REAL_DIR = os.path.join(REPO_ROOT, "..", "shared", "data", "amazon_beauty")


def _config(**data):
  c = ml_collections.ConfigDict({"seed": 0, "data": data_config.data_config()})
  c.data.synthetic.num_users = 120
  c.data.synthetic.num_items = 60
  for k, v in data.items():
    setattr(c.data, k, v)
  return c


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
  """Generated raw rows in both formats, plus users/items that the 5-core must drop."""
  cfg = _config().data.synthetic
  rows, items = synthetic.generate(cfg, seed=3)
  # A user with only 4 interactions, all of an item nobody else has: the 5-core drops both.
  items["9001"] = dict(items["1"], item_id=9001, asin="RARE0009001", title="Rare thing")
  rows += [("Ushort", "9001", 1_400_000_000 + d, d) for d in range(4)]
  base = tmp_path_factory.mktemp("raw")
  synthetic.write_tsv(str(base / "tsv"), rows, items)
  synthetic.write_mcauley(str(base / "mc"), rows, items)
  return {"rows": rows, "items": items, "tsv": str(base / "tsv"), "mc": str(base / "mc")}


def _reference(rows, k):
  """Independent plain-Python reference of the protocol (file order = `rows` order)."""
  rows = list(rows)
  while True:
    uc, ic = collections.Counter(), collections.Counter()
    for u, i, _, _ in rows:
      uc[u] += 1
      ic[i] += 1
    kept = [r for r in rows if uc[r[0]] >= k and ic[r[1]] >= k]
    if len(kept) == len(rows):
      break
    rows = kept
  users = []
  for r in rows:
    if r[0] not in users:
      users.append(r[0])
  seqs = []
  for u in users:
    mine = [(r[2], n, r[1]) for n, r in enumerate(rows) if r[0] == u]
    mine.sort(key=lambda x: (x[0], x[1]))
    seqs.append([i for _, _, i in mine])
  item_ids = {}
  for s in seqs:
    for i in s:
      item_ids.setdefault(i, len(item_ids))
  return users, [[item_ids[i] for i in s] for s in seqs]


def test_mcauley_numbering_matches_reference(raw):
  fmt, rows, items, paths = beauty.read_dir(raw["mc"])
  assert fmt == "mcauley"
  p = beauty.process(rows, items, 5, paths["meta"])
  users, seqs = _reference(rows, 5)
  assert p["users"] == users
  assert p["sequences"] == seqs
  assert "Ushort" not in p["users"]
  assert all(it["raw_id"] != "RARE0009001" for it in p["items"])
  # McAuley meta has several category paths: the one rooted at Beauty is kept.
  assert all(it["categories"][0] == "Beauty" and len(it["categories"]) == 4 for it in p["items"])


def test_both_formats_give_the_same_sequences(raw):
  out = {}
  for name in ("tsv", "mc"):
    fmt, rows, items, paths = beauty.read_dir(raw[name])
    p = beauty.process(rows, items, 5, "items")
    raw_ids = [it["raw_id"] for it in p["items"]]
    asin_of = {str(d["item_id"]): d["asin"] for d in raw["items"].values()}
    to_asin = (lambda r: asin_of[r]) if name == "tsv" else (lambda r: r)
    # Same-day ties are ordered by `position` in tsv but by file order (grouped by item) in McAuley
    # files, so compare day by day.
    out[name] = {}
    for u, s, ts in zip(p["users"], p["sequences"], p["timestamps"]):
      days = collections.defaultdict(set)
      for i, t in zip(s, ts):
        days[t].add(to_asin(raw_ids[i]))
      out[name][u] = sorted(days.items())
      assert ts == sorted(ts)
    assert min(collections.Counter(i for s in p["sequences"] for i in s).values()) >= 5
  assert out["tsv"] == out["mc"]


def test_k_core_iterates_to_fixed_point():
  # k=2. Pass 1 drops user C (1 row); then item y has 1 row -> dropped; then user B has 1 row.
  rows = [("A", "x", 1, 0), ("A", "z", 2, 1), ("B", "x", 1, 2), ("B", "y", 2, 3), ("C", "y", 3, 4),
          ("D", "x", 1, 5), ("D", "z", 5, 6)]
  one_pass = [r for r in rows if collections.Counter(q[0] for q in rows)[r[0]] >= 2]
  assert len(one_pass) == 6  # a single pass would keep B's y
  kept = beauty.k_core(rows, 2)
  assert kept == [("A", "x", 1, 0), ("A", "z", 2, 1), ("D", "x", 1, 5), ("D", "z", 5, 6)]
  assert beauty.k_core(kept, 2) == kept


def test_stable_time_order_with_ties():
  rows = [("u", "b", 5, 0), ("u", "a", 3, 1), ("u", "c", 5, 2), ("u", "d", 5, 3)]
  items = {i: {"raw_id": i, "asin": "", "title": i, "brand": None, "categories": [], "price": None}
           for i in "abcd"}
  p = beauty.process(rows, items, 1)
  assert [p["items"][i]["raw_id"] for i in p["sequences"][0]] == ["a", "b", "c", "d"]


@pytest.fixture(scope="module")
def built(raw, tmp_path_factory):
  wd = str(tmp_path_factory.mktemp("wd"))
  c = _config(source="beauty", dir=raw["tsv"])
  st = data_stage.run(c, wd)
  return wd, c, st


def test_tfds_round_trip_and_split(built, raw):
  wd, c, st = built
  fmt, rows, items, paths = beauty.read_dir(raw["tsv"])
  ref = beauty.process(rows, items, 5, "items")
  seqs = api.load_sequences(wd)
  assert seqs == ref["sequences"]
  assert st["users"] == len(seqs) and st["items"] == len(ref["items"])
  assert st["interactions"] == sum(map(len, seqs))
  assert st["avg_seq_len"] == pytest.approx(st["interactions"] / st["users"], abs=0)
  loaded = api.load_items(wd)
  assert [d["title"] for d in loaded] == [d["title"] for d in ref["items"]]
  assert [d["price"] for d in loaded] == [d["price"] for d in ref["items"]]
  assert [d["brand"] for d in loaded] == [d["brand"] for d in ref["items"]]
  assert any(d["brand"] is None for d in loaded) and any(d["price"] is None for d in loaded)
  # TFDS records through grain: leave-one-out splits agree with the full sequences.
  for split, cut in (("train", 3), ("validation", 2), ("test", 1)):
    recs = list(api.data_source(wd, split))
    assert len(recs) == len(seqs)
    for r, s in zip(recs, seqs):
      assert list(r["history"]) == s[:-cut] and int(r["target"]) == s[-cut]
  h, t = api.split_examples(seqs, "valid")
  assert h[0] == seqs[0][:-2] and t[0] == seqs[0][-2]
  assert api.load_users(wd) == ref["users"]


def test_rerun_is_a_no_op_and_config_change_rebuilds(built, raw):
  wd, c, _ = built
  done = os.path.join(wd, "data", "DONE.json")
  m = os.path.getmtime(done)
  data_stage.run(c, wd)
  assert os.path.getmtime(done) == m
  c2 = _config(source="beauty", dir=raw["mc"])
  assert data_stage.stage_hash(c2) != common.read_done(os.path.join(wd, "data"))["config_hash"]


def test_input_files_are_hashed_by_content_not_mtime(raw, tmp_path):
  import shutil
  d = str(tmp_path / "copy")
  shutil.copytree(raw["tsv"], d)
  c = _config(source="beauty", dir=d)
  h = data_stage.stage_hash(c)
  for f in os.listdir(d):                      # a re-mount or copy: new times, same bytes
    os.utime(os.path.join(d, f), (1e9, 1e9))
  assert data_stage.stage_hash(c) == h
  f = sorted(os.listdir(d))[0]
  with open(os.path.join(d, f), "ab") as fh:  # an edit: rebuild
    fh.write(b"\n")
  assert data_stage.stage_hash(c) != h


def test_synthetic_builder(tmp_path):
  c = _config(source="synthetic")
  st = data_stage.run(c, str(tmp_path))
  seqs = api.load_sequences(str(tmp_path))
  assert st["users"] == len(seqs) > 100 and st["min_seq_len"] >= 5 and st["min_item_count"] >= 5
  # Beyond popularity: the next item shares the previous item's brand far more often than chance.
  items = api.load_items(str(tmp_path))
  same = np.mean([items[a]["brand"] == items[b]["brand"] for s in seqs for a, b in zip(s, s[1:])
                  if items[a]["brand"]])
  brands = collections.Counter(d["brand"] for d in items if d["brand"])
  chance = sum((n / sum(brands.values())) ** 2 for n in brands.values())
  assert same > 3 * chance


def _write(path, text):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  op = gzip.open if path.endswith(".gz") else open
  with op(path, "wt") as f:
    f.write(text)


def test_errors(tmp_path, raw):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    beauty.read_dir(str(tmp_path / "nope"))
  os.makedirs(tmp_path / "empty")
  with pytest.raises(FileNotFoundError, match="is empty"):
    beauty.read_dir(str(tmp_path / "empty"))
  with pytest.raises(ValueError, match="data.dir is empty"):
    data_stage.run(_config(source="beauty", dir=""), str(tmp_path / "wd"))
  d = str(tmp_path / "bad1")
  _write(f"{d}/interactions.tsv.gz", "user_id\titem_id\ttimestamp\n1\t1\t5\n1\t2\n")
  _write(f"{d}/items.jsonl", '{"item_id": 1}\n')
  with pytest.raises(ValueError, match=r"interactions.tsv.gz:3: expected 3 tab-separated"):
    beauty.read_dir(d)
  _write(f"{d}/interactions.tsv.gz", "user_id\titem_id\ttimestamp\n1\t1\tnoon\n")
  with pytest.raises(ValueError, match=r"interactions.tsv.gz:2: timestamp"):
    beauty.read_dir(d)
  _write(f"{d}/interactions.tsv.gz", "user_id\titem_id\ttimestamp\n1\t1\t5\n1\t2\t6\n1\t3\t7\n")
  _write(f"{d}/items.jsonl", '{"item_id": 1}\n{"item_id": 2, "title": \n')
  with pytest.raises(ValueError, match=r"items.jsonl:2: malformed JSON"):
    beauty.read_dir(d)
  _write(f"{d}/items.jsonl", '{"item_id": 1}\n{"item_id": 2}\n')
  fmt, rows, items, paths = beauty.read_dir(d)
  with pytest.raises(ValueError, match=r"item id '3' .* does not resolve in .*items.jsonl"):
    beauty.process(rows, items, 1, paths["items"])
  d = str(tmp_path / "bad2")
  _write(f"{d}/reviews_Beauty_5.json.gz", '{"reviewerID": "a", "asin": "x", "unixReviewTime": 1}\n'
         '{"reviewerID": "a", "asin": "y"}\n')
  _write(f"{d}/meta_Beauty.json.gz", "{'asin': 'x'}\n")
  with pytest.raises(ValueError, match=r"reviews_Beauty_5.json.gz:2: need reviewerID"):
    beauty.read_dir(d)
  _write(f"{d}/reviews_Beauty_5.json.gz", '{"reviewerID": "a", "asin": "x", "unixReviewTime": 1}\n')
  _write(f"{d}/meta_Beauty.json.gz", "{'asin': 'z'}\n{'asin': 'x', 'title': 'oops\n")
  with pytest.raises(ValueError, match=r"meta_Beauty.json.gz:2: malformed Python dict"):
    beauty.read_dir(d)
  # Nothing half-written by a failed stage.
  assert not os.path.exists(tmp_path / "wd" / "data")


def test_real_beauty_statistics():
  if not os.path.isdir(REAL_DIR):
    pytest.skip(f"shared Beauty data not found at {REAL_DIR}")
  fmt, rows, items, paths = beauty.read_dir(REAL_DIR)
  p = beauty.process(rows, items, 5, paths["items"])
  st = beauty.stats(p["sequences"], len(p["items"]))
  assert (st["users"], st["items"], st["interactions"]) == (22363, 12101, 198502)
  assert st["avg_seq_len"] == 198502 / 22363
  assert int(st["avg_seq_len"] * 100) == 887  # the paper's 8.87 (truncated)
  assert f"{st['avg_seq_len']:.3f}" == "8.876"
  # Independent reference: the S3-Rec Beauty.txt file (1-based ids, time order).
  ref = os.path.join(REAL_DIR, "original", "s3rec_Beauty.txt")
  if os.path.exists(ref):
    with open(ref) as f:
      s3 = [[int(x) - 1 for x in line.split()[1:]] for line in f]
    assert p["sequences"] == s3

