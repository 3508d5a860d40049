"""Next-purchase counts: how many users bought candidate b right after item a.

The collaborative evidence the minimal prompt can show beside the brand relations
(`task.mark_copurchase`: `#3 <sid> Acme Brush (often bought next)`): for each candidate, how many
transitions last purchase -> candidate occur in the interaction sequences. Counted only over
interactions before every user's target of the split (`table(sequences, cut)` with the split's
leave-one-out cut: each user's `seq[:-cut]`), so no split sees its own targets, or later ones: the
training split counts `seq[:-3]`, validation `seq[:-2]`, test `seq[:-1]`, a live service every
interaction it has (cut 0).

Why this signal: on real Beauty, the SASRec retriever's #1 is the target for ~29% of the users
whose target it lists; among its top 10, the first candidate that other users bought right after
this user's last purchase (3+ times, then twice, then once) is the target more often than #1 is
(benchmarks/trace_policies.py; traces/policy.json), which the brand relations alone are not
enough for. Bucketed (`TIERS`) so a small model reads a word, not a number.
"""

from __future__ import annotations

import collections
from typing import Sequence

# Strongest first; the prompt's mark is the tier in lower case.
TIERS = ("Often bought next", "Bought next twice", "Bought next once")


def table(sequences: Sequence[Sequence[int]], cut: int) -> collections.Counter:
  """Counts of (a, b): users whose `seq[:-cut]` (all of it when cut = 0) has b right after a."""
  out = collections.Counter()
  for seq in sequences:
    s = seq[:len(seq) - cut] if cut > 0 else seq
    out.update(zip(map(int, s[:-1]), map(int, s[1:])))
  return out


def counts(tab: collections.Counter, history: Sequence[int], candidates: Sequence[int]) -> list[int]:
  """Per candidate: how often it was bought right after the last history item (0s without one)."""
  if not len(history):
    return [0] * len(candidates)
  last = int(history[-1])
  return [int(tab.get((last, int(c)), 0)) for c in candidates]


def tier(count: int) -> str | None:
  """The count's tier (`TIERS`), None for 0."""
  return TIERS[0] if count >= 3 else TIERS[1] if count == 2 else TIERS[2] if count == 1 else None
