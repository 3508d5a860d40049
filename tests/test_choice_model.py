"""benchmarks/trace_policies.py's list-wise choice model: fit on lists where one mark decides, it
picks the marked candidate wherever it sits; where no mark decides, it keeps the majority position."""

import os
import sys

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
import trace_policies  # noqa: E402


def _list(often_at, rng):
  fs = [{"rel": "Same type" if rng.rand() < 0.3 else "Top pick", "next": None} for _ in range(10)]
  if often_at is not None:
    fs[often_at]["next"] = "Often bought next"
  return fs


def test_choice_model_learns_the_deciding_mark_and_the_default():
  rng = np.random.RandomState(0)
  feats, tpos = [], []
  for i in range(400):
    at = None if i % 2 else int(rng.randint(10))
    feats.append(_list(at, rng))
    tpos.append(at if at is not None else 0)   # the marked candidate is the target, else #1
  pick = trace_policies.choice_model(feats, tpos, steps=400)
  for at in range(10):
    assert pick(_list(at, rng)) == at
  assert pick(_list(None, rng)) == 0
