"""The trace policy: when the built-in rationale moves a candidate above the retriever's #1.

A policy is a plain dict `{"tiers": [relation, ...], "reach": k}`. Among the first `reach`
candidates (retriever order), the first whose relation to the last purchase
(`rationale.relation`, and with `task.mark_copurchase` its next-purchase tier,
task/copurchase.py) is the strongest of `tiers` goes first; when none has one of `tiers`, the
retriever's #1 stays first. A candidate's relations are one label, or a tuple of labels (its
next-purchase tier and its brand relation): the strongest of them in `tiers` counts. `tiers=[]` is
the retriever's own order; `RULE` (every relation but
"Top pick", all ten candidates) is the rule the demo's terse rationale follows.

`fit` chooses a policy on the training split's lists by Recall@1 over a small grid (prefixes of
the relations, strongest first, x reach). Why a grid over a rule's knobs rather than a learned
scorer: the traces must state a reason the prompt shows ("Same brand #3"), and a tiny model must
be able to follow it; the label only chooses among label-free policies. Only training users whose
target the retriever itself listed count (an inserted target's position says nothing about the
retriever), so the lists the policy is chosen on are made the way test lists are (with
`retriever.train_lists='holdout'`). A policy that overrides #1 on some evidence wins on Recall@1
exactly when that evidence picks the target more often than #1 does on the same users; `evaluate`
reports both precisions so the choice can be read off.
"""

from __future__ import annotations

from typing import Sequence

from dgr2_jax.task import copurchase
from dgr2_jax.task import rationale

RULE = {"tiers": list(rationale.RELATIONS[:3]), "reach": 10}
RETRIEVER = {"tiers": [], "reach": 10}
GRID_TIERS = [list(rationale.RELATIONS[:j]) for j in range(1, 4)]
GRID_REACH = (2, 3, 5, 10)
# With next-purchase tiers: their prefixes, alone and ahead of the brand relations' prefixes.
GRID_TIERS_NEXT = GRID_TIERS + [list(copurchase.TIERS[:i]) + b
                                for i in range(1, 4) for b in [[]] + GRID_TIERS]


def relations(history: Sequence[dict], candidates: Sequence[dict],
              bought_next: Sequence[int] | None = None) -> list:
  """Each candidate's relation to the last purchase; with `bought_next` counts, a tuple
  (next-purchase tier or None, relation)."""
  rels = [rationale.relation(c, history) for c in candidates]
  if bought_next is None:
    return rels
  return [(copurchase.tier(n), r) for n, r in zip(bought_next, rels)]


def _labels(r) -> tuple:
  return (r,) if isinstance(r, str) else tuple(x for x in r if x)


def strongest(r, tiers: Sequence[str]) -> str | None:
  """The strongest of a candidate's relations that is one of `tiers` (None: none is)."""
  hit = [tiers.index(x) for x in _labels(r) if x in tiers]
  return tiers[min(hit)] if hit else None


def choose_from(rels: Sequence, policy: dict) -> int:
  """0-based position of the candidate the policy puts first, from the candidates' relations."""
  tiers = list(policy["tiers"])
  hits = [(tiers.index(s), k) for k, r in enumerate(rels[:int(policy["reach"])])
          if (s := strongest(r, tiers)) is not None]
  return min(hits)[1] if hits else 0


def choose(history: Sequence[dict], candidates: Sequence[dict], policy: dict,
           bought_next: Sequence[int] | None = None) -> int:
  return choose_from(relations(history, candidates, bought_next), policy)


def name(policy: dict) -> str:
  if not policy["tiers"]:
    return "retriever order"
  return f"{' > '.join(policy['tiers'])} within the top {policy['reach']}, else #1"


def evaluate(rels: Sequence[Sequence[str]], target_pos: Sequence[int], policy: dict) -> dict:
  """Recall@1 of the policy's first pick on examples whose target is listed (target_pos >= 0),
  its override rate, the override precision and #1's precision on the same (overridden) users."""
  n = hits = over = over_hits = top1_on_over = 0
  for r, t in zip(rels, target_pos):
    if t < 0:
      continue
    k = choose_from(r, policy)
    n += 1
    hits += k == t
    if k != 0:
      over += 1
      over_hits += k == t
      top1_on_over += t == 0
  top1 = sum(1 for t in target_pos if t == 0)
  return {"policy": name(policy), "tiers": list(policy["tiers"]), "reach": int(policy["reach"]),
          "n": n, "recall@1": hits / max(n, 1), "floor_recall@1": top1 / max(n, 1),
          "override_rate": over / max(n, 1),
          "override_precision": over_hits / over if over else None,
          "top1_precision_on_overrides": top1_on_over / over if over else None}


def fit(rels: Sequence[Sequence], target_pos: Sequence[int],
        grid: Sequence[Sequence[str]] | None = None) -> tuple[dict, list[dict]]:
  """(the policy with the best Recall@1 on these examples, every grid row). Ties go to the
  retriever's order, then to fewer overrides. `grid`: the tier lists tried (default
  `GRID_TIERS`; `GRID_TIERS_NEXT` when the relations carry next-purchase tiers)."""
  rows = [evaluate(rels, target_pos, RETRIEVER)]
  for tiers in (GRID_TIERS if grid is None else grid):
    for reach in GRID_REACH:
      rows.append(evaluate(rels, target_pos, {"tiers": tiers, "reach": reach}))
  best = max(rows, key=lambda r: (round(r["recall@1"], 12), -r["override_rate"]))
  return {"tiers": best["tiers"], "reach": best["reach"]}, rows
