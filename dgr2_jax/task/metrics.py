"""Ranking metrics (single relevant item) and output-validity rates.

Recall@K = 1 if the target's 1-based rank <= K. NDCG@3 = 1/log2(rank+1) for rank <= 3, else 0
(IDCG = 1 with one relevant item). A target absent from the list scores 0 on all three.
Invalid outputs are scored on the retriever's order (fallback); the pre-rank floor is the same
scoring applied to the retriever's order for every example.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from dgr2_jax.task import answer as answer_lib

METRIC_KEYS = ("recall@1", "recall@3", "ndcg@3", "valid_rate", "duplicate_rate", "omission_rate",
               "out_of_set_rate", "unparseable_rate", "fallback_rate", "mean_nfe",
               "mean_reasoning_tokens", "n")


def target_rank(order: Sequence[int], target_pos: int) -> int:
  """1-based rank of candidate position `target_pos` in `order` (0 if absent)."""
  for r, p in enumerate(order):
    if p == target_pos:
      return r + 1
  return 0


def rank_metrics(rank: int) -> dict:
  hit = rank >= 1
  return {"recall@1": float(hit and rank <= 1), "recall@3": float(hit and rank <= 3),
          "ndcg@3": 1.0 / math.log2(rank + 1) if hit and rank <= 3 else 0.0}


def aggregate(records: Iterable[dict]) -> dict:
  """Means over per-example records with keys `rank`, `verdict`, and optional `nfe`,
  `reasoning_tokens`. Returns every key of METRIC_KEYS (n=0 gives zeros)."""
  records = list(records)
  n = len(records)
  out = {k: 0.0 for k in METRIC_KEYS}
  out["n"] = n
  if n == 0:
    return out
  for r in records:  # sums first, one division at the end (exact rates)
    if r["verdict"] not in answer_lib.VERDICTS:
      raise ValueError(f"unknown verdict {r['verdict']!r}")
    for k, v in rank_metrics(int(r["rank"])).items():
      out[k] += v
    out[f"{r['verdict']}_rate"] += 1
    out["mean_nfe"] += float(r.get("nfe", 0) or 0)
    out["mean_reasoning_tokens"] += float(r.get("reasoning_tokens", 0) or 0)
  out["fallback_rate"] = sum(r["verdict"] != answer_lib.VALID for r in records)
  return {k: (v / n if k != "n" else n) for k, v in out.items()}


def score_parsed(parsed: answer_lib.Parsed, target_pos: int) -> dict:
  """Per-example record for a parsed output (fallback order when invalid)."""
  return {"rank": target_rank(parsed.positions, target_pos), "verdict": parsed.verdict,
          "fallback": not parsed.valid}


def prerank_floor(target_positions: Sequence[int], n_candidates: int = 10) -> dict:
  """Metrics of the retriever's own order (target_pos -1 = target not among the candidates)."""
  order = list(range(n_candidates))
  return aggregate({"rank": target_rank(order, int(t)), "verdict": answer_lib.VALID}
                   for t in target_positions)


def reasoning_token_count(ids: Sequence[int], think_id: int, end_think_id: int) -> int:
  """Tokens strictly between the first `<think>` and the next `</think>` (to the end when the
  block is never closed; 0 without `<think>`)."""
  ids = list(ids)
  if think_id not in ids:
    return 0
  s = ids.index(think_id) + 1
  e = ids.index(end_think_id, s) if end_think_id in ids[s:] else len(ids)
  return e - s


def score_output(out_ids, tokenizer, tids, ex: dict, sids) -> dict:
  """Per-example record of one decoded output (ids truncated after EOS)."""
  text = tokenizer.decode(list(out_ids), skip_special_tokens=False)
  cand_sids = [sids[i] for i in ex["candidates"]]
  parsed = answer_lib.parse_response(text, cand_sids)
  rec = score_parsed(parsed, ex["target_pos"])
  rec.update(example_id=ex["example_id"], user=ex["user"], output=text,
             ranking=list(parsed.ranking),
             ranking_items=[ex["candidates"][k] for k in parsed.positions] if parsed.valid else None,
             flags=sorted(parsed.flags), target=ex["target"], target_pos=ex["target_pos"],
             reasoning_tokens=reasoning_token_count(out_ids, tids.think_id, tids.end_think_id))
  return rec
