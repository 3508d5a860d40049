"""Diagnostics of the accuracy ladder: how each model departs from its retriever, and whether that
departure is more than noise. Pure numpy (no jax); the callers read the files.

Every quantity is computed from one model's predictions (eval stage, `predictions.jsonl`: one
record per example with `example_id`, `candidates` in the retriever's order, `target_pos`,
`fallback`, `ranking_items`):
- the first pick: the 0-based retriever position of the item the model ranks first; an invalid
  output falls back to the retriever's order, so its first pick is 0 (the retriever's #1);
- override rate: the share of examples whose first pick is not the retriever's #1;
- override precision: on the overridden examples, how often the first pick is the target, beside
  #1's precision on the same examples (how often the retriever's #1 was the target there). An
  override gains Recall@1 exactly when its pick is the target and loses it exactly when #1 was, so
  Recall@1 - floor = override_rate x (override_precision - top1_precision_on_overrides);
- policy agreement: the share of examples whose first pick is the trace policy's (task/policy.py);
- paired bootstrap 95% CIs of the Recall@1 difference against the floor (the retriever's order on
  the same examples) and against the AR teacher (its predictions on the same example ids).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from dgr2_jax.task import answer as answer_lib
from dgr2_jax.task import copurchase
from dgr2_jax.task import metrics as metrics_lib
from dgr2_jax.task import policy as policy_lib

N_BOOT = 2000
SEED = 0


def first_pick(pred: dict) -> int:
  """0-based retriever position of the prediction's first pick (0 for a fallback)."""
  items = pred.get("ranking_items")
  if pred.get("fallback") or not items:
    return 0
  cands = list(pred["candidates"])
  if items[0] not in cands:
    raise ValueError(f"prediction of example {pred.get('example_id')}: first ranked item "
                     f"{items[0]} is not among its candidates")
  return cands.index(items[0])


def override_stats(picks: Sequence[int], target_pos: Sequence[int]) -> dict:
  """Override rate, override precision and #1's precision on the overridden examples
  (None without overrides)."""
  p, t = np.asarray(picks, np.int64), np.asarray(target_pos, np.int64)
  over = p != 0
  k = int(over.sum())
  return {"override_rate": float(over.mean()) if p.size else None, "overrides": k,
          "override_precision": float((p[over] == t[over]).mean()) if k else None,
          "top1_precision_on_overrides": float((t[over] == 0).mean()) if k else None}


def paired_bootstrap_ci(a, b, n_boot: int = N_BOOT, seed: int = SEED,
                        stat: Callable = np.mean) -> tuple[float, float]:
  """95% percentile interval of stat(b) - stat(a), resampling the pairs (row i of `a` goes with
  row i of `b`) `n_boot` times with replacement; the same `seed` gives the same interval."""
  a, b = np.asarray(a), np.asarray(b)
  if len(a) != len(b) or len(a) == 0:
    raise ValueError(f"paired bootstrap needs two non-empty arrays of one length, got {len(a)} "
                     f"and {len(b)}")
  rs = np.random.RandomState(seed)
  d = np.empty(n_boot)
  for j in range(n_boot):
    i = rs.randint(0, len(a), len(a))
    d[j] = stat(b[i]) - stat(a[i])
  lo, hi = np.percentile(d, [2.5, 97.5])
  return float(lo), float(hi)


def policy_picks(preds: Sequence[dict], items: Sequence[dict], policy: dict, max_history: int,
                 bought_next: Mapping | None = None) -> dict:
  """{example_id: the trace policy's first pick} from each prediction's history and candidates
  (item ids), the history cut to the `max_history` most recent items as the prompt shows it, and
  `bought_next` ({example_id: next-purchase count per candidate}, task/copurchase.py) when the
  prompts show them. A policy with next-purchase tiers needs them: without, its picks would be a
  brand-only policy's."""
  needs_counts = any(t in copurchase.TIERS for t in policy["tiers"])
  if needs_counts and bought_next is None:
    raise ValueError(f"trace policy {policy_lib.name(policy)!r} ranks by next-purchase counts: "
                     "policy_picks needs bought_next")
  out = {}
  for p in preds:
    h = p["history"][-max_history:] if max_history > 0 else p["history"]
    nxt = bought_next[p["example_id"]] if needs_counts else None
    out[p["example_id"]] = policy_lib.choose([items[i] for i in h],
                                             [items[i] for i in p["candidates"]], policy, nxt)
  return out


def most_bought_next(counts: Sequence[int]) -> int:
  """0-based position of the candidate most often bought right after the last purchase (the
  earlier one on a tie), the retriever's #1 when none was."""
  return int(np.argmax(counts)) if len(counts) and max(counts) > 0 else 0


def rule_predictions(preds: Sequence[dict], picks: Mapping) -> list[dict]:
  """Prediction records of a rule ({example_id: first pick}) on the examples of `preds` (one
  model's predictions): its pick first, the retriever's order after it, never a fallback, so the
  rule sits in the ladder with the models' columns."""
  out = []
  for p in preds:
    cands, k = list(p["candidates"]), int(picks[p["example_id"]])
    out.append({"example_id": p["example_id"], "candidates": cands, "target_pos": int(p["target_pos"]),
                "fallback": False, "ranking_items": [cands[k]] + cands[:k] + cands[k + 1:]})
  return out


def rule_row(method: str, preds: Sequence[dict]) -> dict:
  """The ladder row of a rule's `rule_predictions`, with the models' metric columns: a rule always
  answers (valid, no fallback) in no forward pass (diagnostics join it later)."""
  recs = [{"rank": metrics_lib.target_rank([list(p["candidates"]).index(i) for i in p["ranking_items"]],
                                           int(p["target_pos"])), "verdict": answer_lib.VALID} for p in preds]
  return {"method": method, **metrics_lib.aggregate(recs)}


def _by_id(method: str, preds: Sequence[dict]) -> dict:
  out = {}
  for p in preds:
    if p["example_id"] in out:
      raise ValueError(f"predictions of {method!r}: example_id {p['example_id']} appears twice")
    out[p["example_id"]] = (first_pick(p), int(p["target_pos"]))
  return out


def _delta(a, b, n_boot: int, seed: int) -> tuple[float, list]:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(b.mean() - a.mean()), list(paired_bootstrap_ci(a, b, n_boot, seed))


def ladder_diagnostics(preds: Mapping[str, Sequence[dict]], teacher: str | None = "ar",
                       policy: Mapping | None = None, n_boot: int = N_BOOT,
                       seed: int = SEED) -> dict:
  """{method: diagnostics} for every method of `preds` ({method: its prediction records}).

  `teacher`: the method the delta_teacher columns compare with (absent: None there; the teacher
  itself gets None). `policy`: {example_id: the policy's first pick} (None: no policy_agreement).
  Keys: override_rate, overrides, override_precision, top1_precision_on_overrides,
  policy_agreement, delta_floor, delta_floor_ci95, delta_teacher, delta_teacher_ci95,
  n_paired_teacher.
  """
  by = {m: _by_id(m, ps) for m, ps in preds.items()}
  out = {}
  for m, rows in by.items():
    ids = list(rows)
    picks = [rows[i][0] for i in ids]
    tpos = [rows[i][1] for i in ids]
    hit = [float(p == t) for p, t in zip(picks, tpos)]
    d = override_stats(picks, tpos)
    d["policy_agreement"] = (float(np.mean([rows[i][0] == policy[i] for i in ids]))
                             if policy is not None and ids else None)
    d["delta_floor"], d["delta_floor_ci95"] = (_delta([float(t == 0) for t in tpos], hit, n_boot, seed)
                                               if ids else (None, None))
    d["delta_teacher"] = d["delta_teacher_ci95"] = d["n_paired_teacher"] = None
    if teacher in by and m != teacher:
      common = [i for i in ids if i in by[teacher]]
      if common:
        t_hit = [float(by[teacher][i][0] == by[teacher][i][1]) for i in common]
        r_hit = [float(rows[i][0] == rows[i][1]) for i in common]
        d["delta_teacher"], d["delta_teacher_ci95"] = _delta(t_hit, r_hit, n_boot, seed)
        d["n_paired_teacher"] = len(common)
    out[m] = d
  return out
