"""The ladder's diagnostics (task/diagnostics.py) against hand-computed examples."""

import numpy as np
import pytest

from dgr2_jax.task import diagnostics as diag

CANDS = [10, 11, 12, 13, 14, 15]


def _pred(eid, first, target_pos, fallback=False):
  """A prediction record: the valid ranking puts candidate position `first` first."""
  order = [first] + [k for k in range(len(CANDS)) if k != first]
  return {"example_id": eid, "candidates": CANDS, "target_pos": target_pos, "fallback": fallback,
          "ranking_items": None if fallback else [CANDS[k] for k in order],
          "history": [0, 1]}


# Five examples of one model, by hand:
#   e0 keeps #1, the target           -> no override, hit
#   e1 moves #3 up, the target        -> override, hit (#1 was not the target)
#   e2 moves #2 up, #1 was the target -> override, miss
#   e3 invalid (falls back to #1), target #4 -> no override, miss
#   e4 moves #4 up, target #6         -> override, miss (#1 was not the target either)
MODEL = [_pred(0, 0, 0), _pred(1, 2, 2), _pred(2, 1, 0), _pred(3, 3, 3, fallback=True),
         _pred(4, 3, 5)]
# The teacher on the same users (and one more, e9, the model lacks): hits on e0, e2, e3.
TEACHER = [_pred(0, 0, 0), _pred(1, 0, 2), _pred(2, 0, 0), _pred(3, 3, 3), _pred(4, 0, 5),
           _pred(9, 0, 0)]


def _ref_percentile(xs, q):
  """numpy's default (linear) percentile, by hand."""
  xs = sorted(xs)
  pos = (len(xs) - 1) * q / 100.0
  lo = int(pos)
  hi = min(lo + 1, len(xs) - 1)
  return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ref_ci(a, b, n_boot, seed, stat=lambda v: sum(v) / len(v)):
  rs = np.random.RandomState(seed)
  d = []
  for _ in range(n_boot):
    idx = [int(i) for i in rs.randint(0, len(a), len(a))]
    d.append(stat([b[i] for i in idx]) - stat([a[i] for i in idx]))
  return _ref_percentile(d, 2.5), _ref_percentile(d, 97.5)


def test_first_pick_and_override_stats_by_hand():
  assert [diag.first_pick(p) for p in MODEL] == [0, 2, 1, 0, 3]
  s = diag.override_stats([0, 2, 1, 0, 3], [0, 2, 0, 3, 5])
  assert s == {"override_rate": 3 / 5, "overrides": 3, "override_precision": 1 / 3,
               "top1_precision_on_overrides": 1 / 3}
  assert diag.override_stats([0, 0], [0, 1])["override_precision"] is None
  bad = dict(MODEL[1], ranking_items=[99] + CANDS[1:])
  with pytest.raises(ValueError, match="example 1: first ranked item 99"):
    diag.first_pick(bad)


def test_ladder_diagnostics_by_hand():
  policy = {0: 0, 1: 2, 2: 0, 3: 0, 4: 0, 9: 0}
  out = diag.ladder_diagnostics({"ar": TEACHER, "cft": MODEL}, teacher="ar", policy=policy,
                                n_boot=200, seed=3)
  m = out["cft"]
  assert (m["override_rate"], m["override_precision"], m["top1_precision_on_overrides"]) == (
      0.6, 1 / 3, 1 / 3)
  assert m["policy_agreement"] == pytest.approx(3 / 5)   # e0, e1, e3
  # Recall@1 0.4 against the floor 0.4 (e0, e2): the identity override_rate x (precision gap).
  assert m["delta_floor"] == pytest.approx(0.0) == m["override_rate"] * (
      m["override_precision"] - m["top1_precision_on_overrides"])
  hit, floor = [1, 1, 0, 0, 0], [1, 0, 1, 0, 0]
  assert m["delta_floor_ci95"] == pytest.approx(list(_ref_ci(floor, hit, 200, 3)))
  # Against the teacher on the five shared users: the teacher hits e0, e2, e3 (0.6), the model 0.4.
  assert m["n_paired_teacher"] == 5 and m["delta_teacher"] == pytest.approx(-0.2)
  assert m["delta_teacher_ci95"] == pytest.approx(list(_ref_ci([1, 0, 1, 1, 0], hit, 200, 3)))
  t = out["ar"]
  assert t["delta_teacher"] is None and t["delta_teacher_ci95"] is None
  assert t["override_rate"] == pytest.approx(1 / 6) and t["override_precision"] == 1.0
  assert t["delta_floor"] == pytest.approx(1 / 6)     # e3 gained, nothing lost
  assert diag.ladder_diagnostics({"cft": MODEL}, teacher="ar")["cft"]["policy_agreement"] is None
  with pytest.raises(ValueError, match="'cft': example_id 0 appears twice"):
    diag.ladder_diagnostics({"cft": MODEL + MODEL[:1]})


def test_paired_bootstrap_ci_matches_a_plain_loop_and_is_seeded():
  rng = np.random.default_rng(0)
  a = (rng.random(300) < 0.3).astype(float)
  b = (rng.random(300) < 0.4).astype(float)
  lo, hi = diag.paired_bootstrap_ci(a, b, n_boot=300, seed=7)
  assert (lo, hi) == pytest.approx(_ref_ci(list(a), list(b), 300, 7))
  assert (lo, hi) == diag.paired_bootstrap_ci(a, b, n_boot=300, seed=7)
  assert (lo, hi) != diag.paired_bootstrap_ci(a, b, n_boot=300, seed=8)
  assert lo < b.mean() - a.mean() < hi
  assert diag.paired_bootstrap_ci(a, a + 0.25, n_boot=50) == pytest.approx((0.25, 0.25))
  # A ratio statistic on [n, 2] rows (the OPD KL's sum / token count), resampled by row.
  kl_a, kl_b = rng.random((40, 2)) + 0.5, rng.random((40, 2)) + 0.5
  ratio = lambda v: float(np.asarray(v)[:, 0].sum() / np.asarray(v)[:, 1].sum())
  assert diag.paired_bootstrap_ci(kl_a, kl_b, n_boot=100, seed=0, stat=ratio) == pytest.approx(
      _ref_ci(list(kl_a), list(kl_b), 100, 0, stat=ratio))
  with pytest.raises(ValueError, match="one length"):
    diag.paired_bootstrap_ci([1.0], [1.0, 0.0])


def test_policy_picks_cut_the_history_as_the_prompt_does():
  item = lambda i, brand: {"item": i, "brand": brand, "categories": ["Beauty", f"leaf{i}"]}
  # 0: brand A, 1: brand X (the last purchase); candidates 10..12: brands Y, Z, A.
  items = {0: item(0, "A"), 1: item(1, "X"), 10: item(10, "Y"), 11: item(11, "Z"), 12: item(12, "A")}
  pred = {"example_id": 5, "history": [0, 1], "candidates": [10, 11, 12]}
  full = {"tiers": ["Same brand", "Same type", "Brand seen"], "reach": 10}
  assert diag.policy_picks([pred], items, full, max_history=0) == {5: 2}   # brand A seen -> #3
  assert diag.policy_picks([pred], items, full, max_history=1) == {5: 0}   # only X shown -> #1
  assert diag.policy_picks([pred], items, dict(full, reach=2), max_history=0) == {5: 0}
