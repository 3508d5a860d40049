"""Ranking metrics against hand-computed values and a plain DCG reference."""

import math

import numpy as np
import pytest

from dgr2_jax.task import answer, metrics


def test_rank_metrics_hand_computed():
  assert metrics.rank_metrics(1) == {"recall@1": 1.0, "recall@3": 1.0, "ndcg@3": 1.0}
  m = metrics.rank_metrics(2)
  assert (m["recall@1"], m["recall@3"]) == (0.0, 1.0)
  assert m["ndcg@3"] == pytest.approx(0.6309297535714575)  # 1/log2(3)
  assert metrics.rank_metrics(3)["ndcg@3"] == pytest.approx(0.5)  # 1/log2(4)
  assert metrics.rank_metrics(4) == {"recall@1": 0.0, "recall@3": 0.0, "ndcg@3": 0.0}
  assert metrics.rank_metrics(0) == {"recall@1": 0.0, "recall@3": 0.0, "ndcg@3": 0.0}


def test_aggregate_hand_computed():
  recs = [dict(rank=1, verdict="valid", nfe=10, reasoning_tokens=100),
          dict(rank=2, verdict="valid", nfe=20, reasoning_tokens=120),
          dict(rank=3, verdict="duplicate", nfe=30, reasoning_tokens=140),
          dict(rank=5, verdict="unparseable", nfe=40, reasoning_tokens=160)]
  m = metrics.aggregate(recs)
  assert m["n"] == 4
  assert m["recall@1"] == pytest.approx(0.25)
  assert m["recall@3"] == pytest.approx(0.75)
  assert m["ndcg@3"] == pytest.approx((1 + 0.6309297535714575 + 0.5) / 4)
  assert m["valid_rate"] == pytest.approx(0.5)
  assert m["duplicate_rate"] == pytest.approx(0.25)
  assert m["unparseable_rate"] == pytest.approx(0.25)
  assert m["omission_rate"] == 0.0 and m["out_of_set_rate"] == 0.0
  assert m["fallback_rate"] == pytest.approx(0.5)
  assert m["mean_nfe"] == pytest.approx(25.0)
  assert m["mean_reasoning_tokens"] == pytest.approx(130.0)
  assert set(metrics.METRIC_KEYS) <= set(m)


def test_against_plain_dcg_reference():
  rng = np.random.default_rng(0)
  ranks, ref = [], {"recall@1": 0.0, "recall@3": 0.0, "ndcg@3": 0.0}
  n = 200
  for _ in range(n):
    order = list(rng.permutation(10))
    t = int(rng.integers(-1, 10))  # -1: target not among the candidates
    rel = [1.0 if p == t else 0.0 for p in order]
    dcg = sum(r / math.log2(i + 2) for i, r in enumerate(rel[:3]))
    ref["ndcg@3"] += dcg / 1.0 / n  # IDCG = 1 (one relevant item)
    ref["recall@1"] += sum(rel[:1]) / n
    ref["recall@3"] += sum(rel[:3]) / n
    ranks.append(dict(rank=metrics.target_rank(order, t), verdict="valid"))
  m = metrics.aggregate(ranks)
  for k, v in ref.items():
    assert m[k] == pytest.approx(v), k


def test_invalid_output_falls_back_to_retriever_order():
  c = [f"<a_{k}><b_0><c_0><d_0>" for k in range(10)]
  bad = answer.parse_response("<think>x</think>" + '{"ranking": []}', c)
  good = answer.parse_response(answer.format_response("x", [c[4]] + c[:4] + c[5:]), c)
  assert metrics.score_parsed(bad, 4) == {"rank": 5, "verdict": "omission", "fallback": True}
  assert metrics.score_parsed(good, 4) == {"rank": 1, "verdict": "valid", "fallback": False}


def test_prerank_floor():
  m = metrics.prerank_floor([0, 1, -1, 5])
  assert m["recall@1"] == pytest.approx(0.25)
  assert m["recall@3"] == pytest.approx(0.5)
  assert m["ndcg@3"] == pytest.approx((1 + 0.6309297535714575) / 4)
  assert m["valid_rate"] == 1.0 and m["n"] == 4


def test_reasoning_token_count():
  assert metrics.reasoning_token_count([4, 9, 9, 9, 5, 7, 2], 4, 5) == 3
  assert metrics.reasoning_token_count([4, 9, 9], 4, 5) == 2  # never closed
  assert metrics.reasoning_token_count([9, 9], 4, 5) == 0
