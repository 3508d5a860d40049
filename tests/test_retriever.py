"""Retriever: metrics against a plain reference, SASRec learns on synthetic data, file candidates."""

import json
import os

import ml_collections
import numpy as np
import pytest

from dgr2_jax.data import api
from dgr2_jax.data import config as data_config
from dgr2_jax.data import sasrec
from dgr2_jax.stages import data as data_stage
from dgr2_jax.stages import retriever as retriever_stage


def test_rank_metrics_reference():
  ranks = np.array([0, 1, 4, 5, 9, 10, 50])
  m = sasrec.rank_metrics(ranks)
  assert m["recall@5"] == pytest.approx(3 / 7) and m["recall@10"] == pytest.approx(5 / 7)
  ref10 = (1 + 1 / np.log2(3) + 1 / np.log2(6) + 1 / np.log2(7) + 1 / np.log2(11)) / 7
  assert m["ndcg@10"] == pytest.approx(ref10)
  assert m["ndcg@5"] == pytest.approx((1 + 1 / np.log2(3) + 1 / np.log2(6)) / 7)
  assert m["n_hits@10"] == 5
  cands = np.array([[3, 4, 5], [1, 2, 0]])
  assert sasrec.candidate_ranks(cands, np.array([5, 7])).tolist() == [2, 3]


def test_sasrec_causal():
  """Changing a later item must not change earlier positions' states (causal attention)."""
  import jax
  m = sasrec.SASRec(n_items=20, max_len=8, hidden=16, num_blocks=2, dropout=0.0)
  seq = np.array([[0, 0, 3, 4, 5, 6, 7, 8]], np.int32)
  p = m.init(jax.random.PRNGKey(0), seq)
  a = np.asarray(m.apply(p, seq))
  seq2 = seq.copy()
  seq2[0, -1] = 15
  b = np.asarray(m.apply(p, seq2))
  np.testing.assert_allclose(a[0, :-1], b[0, :-1], atol=1e-5)
  assert not np.allclose(a[0, -1], b[0, -1])
  # Left padding: extra padding in front does not change the last state (same positions).
  c = np.asarray(m.apply(p, np.concatenate([np.zeros([1, 0], np.int32), seq], 1)))
  np.testing.assert_allclose(a, c)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  wd = str(tmp_path_factory.mktemp("wd"))
  c = ml_collections.ConfigDict({"seed": 0, "data": data_config.data_config(),
                                 "retriever": data_config.retriever_config()})
  c.data.source = "synthetic"
  c.retriever.num_epochs = 24
  c.retriever.eval_every = 4
  c.retriever.batch_size = 64
  c.retriever.dropout = 0.2
  data_stage.run(c, wd)
  metrics = retriever_stage.run(c, wd)
  return wd, c, metrics


def test_sasrec_learns_beyond_popularity(built):
  wd, c, m = built
  for split in ("valid", "test"):
    assert m[split]["recall@10"] > 2 * m["popularity"][split]["recall@10"] + 0.05, m
    assert m[split]["ndcg@10"] > 2 * m["popularity"][split]["ndcg@10"], m
    assert m[split]["n_hits@10"] == round(m[split]["recall@10"] * m[split]["n_users"])
  with open(os.path.join(wd, "retriever", "metrics.json")) as f:
    disk = json.load(f)
  assert set(disk["test"]) >= {"recall@5", "recall@10", "ndcg@5", "ndcg@10", "n_hits@10"}


def test_candidates_exclude_history_and_match_metrics(built):
  wd, c, m = built
  seqs = api.load_sequences(wd)
  n_items = len(api.load_items(wd))
  for split in api.SPLITS:
    cands = api.load_candidates(wd, split)
    h, t = api.split_examples(seqs, split)
    assert cands.shape == (len(seqs), 10) and cands.dtype == np.int32
    assert cands.min() >= 0 and cands.max() < n_items
    for row, hist in zip(cands, h):
      assert len(set(row.tolist())) == 10 and not set(row.tolist()) & set(hist)
    if split != "train":
      assert sasrec.rank_metrics(sasrec.candidate_ranks(cands, t)) == m[split]


def test_full_ranking_matches_numpy(built):
  """Ranks/top-k from the jitted scorer agree with a direct numpy computation."""
  import flax.serialization
  wd, c, _ = built
  seqs = api.load_sequences(wd)
  n_items = len(api.load_items(wd))
  tr = sasrec.Trainer(c.retriever, n_items, [s[:-2] for s in seqs], 0)
  with open(os.path.join(wd, "retriever", "params.msgpack"), "rb") as f:
    tr.params = flax.serialization.from_bytes(tr.params, f.read())
  h, t = api.split_examples(seqs, "test")
  top, ranks = tr.rank(h[:20], t[:20], 10)
  for u in range(20):
    seq = np.zeros([1, c.retriever.max_len], np.int32)
    hist = [i + 1 for i in h[u]][-c.retriever.max_len:]
    seq[0, -len(hist):] = hist
    hs = np.asarray(tr.model.apply(tr.params, seq))[0, -1]
    table = np.asarray(tr.params["params"]["item_emb"]["embedding"])[1:]
    s = table @ hs
    s[h[u]] = -np.inf
    assert np.sum(s > s[t[u]]) == ranks[u]
    assert set(np.argsort(-s)[:10].tolist()) == set(top[u].tolist())
  np.testing.assert_array_equal(top, api.load_candidates(wd, "test")[:20])


def test_candidates_from_file(built, tmp_path):
  wd, c, m = built
  wd2 = str(tmp_path / "wd2")
  os.makedirs(wd2)
  os.symlink(os.path.join(wd, "data"), os.path.join(wd2, "data"))
  c2 = ml_collections.ConfigDict(c.to_dict())
  c2.retriever.source = "file"
  c2.retriever.candidates_file = os.path.join(wd, "retriever", "candidates.jsonl")
  m2 = retriever_stage.run(c2, wd2)
  assert m2["valid"] == m["valid"] and m2["test"] == m["test"]
  for split in api.SPLITS:
    np.testing.assert_array_equal(api.load_candidates(wd2, split), api.load_candidates(wd, split))


def test_candidate_file_errors(built, tmp_path):
  wd, c, _ = built
  seqs = api.load_sequences(wd)
  n_items = len(api.load_items(wd))
  good = os.path.join(wd, "retriever", "candidates.jsonl")
  with open(good) as f:
    lines = f.read().splitlines()

  def check(mutated, match):
    p = str(tmp_path / "c.jsonl")
    with open(p, "w") as f:
      f.write("\n".join(mutated) + "\n")
    with pytest.raises(ValueError, match=match):
      retriever_stage.read_candidates_file(p, seqs, n_items, 10)

  check(lines[:2] + ["{oops"] + lines[3:], r"c.jsonl:3: expected a JSON object")
  d = json.loads(lines[0])
  check([json.dumps(dict(d, user=len(seqs)))] + lines[1:], r"c.jsonl:1: user .* does not resolve")
  check([json.dumps(dict(d, candidates=d["candidates"][:9]))] + lines[1:], r"c.jsonl:1: candidates")
  hist_item = seqs[d["user"]][0]
  bad = [hist_item] + [i for i in d["candidates"] if i != hist_item][:9]
  check([json.dumps(dict(d, candidates=bad))] + lines[1:], r"c.jsonl:1: .* in the user's history")
  check(lines[1:], r"lacks users \[0\]")
  with pytest.raises(FileNotFoundError, match="does not exist"):
    retriever_stage.read_candidates_file(str(tmp_path / "none.jsonl"), seqs, n_items, 10)


def test_rerun_is_a_no_op(built):
  wd, c, m = built
  done = os.path.join(wd, "retriever", "DONE.json")
  t = os.path.getmtime(done)
  assert retriever_stage.run(c, wd) == m
  assert os.path.getmtime(done) == t


def test_holdout_training_lists_come_from_a_model_that_never_saw_their_targets(tmp_path, monkeypatch):
  """train_lists='holdout': a second SASRec is fitted on seq[:-3] (no training target in it) and
  ranks the training split; valid/test lists still come from the model fitted on seq[:-2]."""
  wd = str(tmp_path)
  c = ml_collections.ConfigDict({"seed": 0, "data": data_config.data_config(),
                                 "retriever": data_config.retriever_config()})
  c.data.source = "synthetic"
  c.retriever.num_epochs = 1
  c.retriever.train_lists = "holdout"
  data_stage.run(c, wd)
  seen, ranked = [], []

  class Recording(sasrec.Trainer):
    def __init__(self, cfg, n_items, train_seqs, seed):
      super().__init__(cfg, n_items, train_seqs, seed)
      self.tag = len(seen)
      seen.append([list(s) for s in train_seqs])

    def rank(self, histories, targets, k):
      ranked.append((self.tag, [len(h) for h in histories]))
      return super().rank(histories, targets, k)

  monkeypatch.setattr(sasrec, "Trainer", Recording)
  m = retriever_stage.run(c, wd)
  seqs = api.load_sequences(wd)
  assert seen == [[s[:-2] for s in seqs], [s[:-3] for s in seqs]]
  train_lens = [len(s) - 3 for s in seqs]
  # The held-out model (tag 1) ranks the training split's histories, and only it does; the test
  # lists are the first model's (the held-out one also ranks validation users to stop early).
  test_lens = [len(s) - 1 for s in seqs]
  assert (1, train_lens) in ranked and (0, train_lens) not in ranked
  assert (0, test_lens) in ranked and (1, test_lens) not in ranked
  assert m["train_lists"] == "holdout" and m["train"]["n_users"] == len(seqs)
  assert os.path.exists(os.path.join(wd, "retriever", "params_holdout.msgpack"))
  # No training target is in the held-out model's training data, by construction above; its
  # lists exclude the training histories as every list does.
  cands = api.load_candidates(wd, "train")
  h, _ = api.split_examples(seqs, "train")
  assert all(not set(h[u]) & set(cands[u].tolist()) for u in range(len(seqs)))
