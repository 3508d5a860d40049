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


def _sid_list(code2_at, rng):
  fs = [{"rel": "Top pick", "next": None, "code1": False, "code2": False, "brand_last2": False}
        for _ in range(10)]
  if code2_at is not None:
    fs[code2_at]["code2"] = fs[code2_at]["code1"] = True
  return fs


def test_cross_validated_sees_the_sid_codes_only_with_their_features():
  """Targets follow the shared SID codes: the learner with those features finds them on held-out
  folds, the marks-only learner cannot and keeps #1."""
  rng = np.random.RandomState(1)
  feats, tpos = [], []
  for i in range(300):
    at = int(rng.randint(1, 10)) if i % 3 else None
    feats.append(_sid_list(at, rng))
    tpos.append(at if at is not None else 0)
  tpos = np.asarray(tpos)
  rich = trace_policies.cross_validated([], [], feats, tpos, phi=trace_policies._phi_sid_brand, steps=300)
  marks = trace_policies.cross_validated([], [], feats, tpos, steps=300)
  assert np.mean(rich == tpos) > 0.95
  assert np.all(marks == 0)


def test_cross_validated_never_reads_a_folds_own_targets():
  """Changing the targets of the lists in one fold leaves that fold's picks as they were; changing
  the other folds' targets changes them."""
  rng = np.random.RandomState(2)
  feats = [_list(int(rng.randint(10)) if i % 2 else None, rng) for i in range(200)]
  tpos = np.asarray([next((k for k, f in enumerate(fs) if f["next"]), 0) for fs in feats])
  fold = np.random.default_rng(0).integers(0, 5, len(feats))
  before = trace_policies.cross_validated(feats[:50], tpos[:50], feats, tpos, steps=200)
  moved = tpos.copy()
  moved[fold == 0] = rng.randint(0, 10, (fold == 0).sum())
  after = trace_policies.cross_validated(feats[:50], tpos[:50], feats, moved, steps=200)
  assert np.array_equal(before[fold == 0], after[fold == 0])
  others = np.where(fold == 0, tpos, 7)
  taught = trace_policies.cross_validated([], [], feats, others, steps=200)
  assert np.mean(taught[fold == 0] == 7) > 0.9
