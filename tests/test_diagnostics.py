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


def test_policy_picks_equal_the_traces_stages_picks():
  """With next-purchase counts in the prompt (task.mark_copurchase), the ladder's policy_agreement
  compares with the picks the traces stage's policy makes (counts included), not a brand-only
  policy's."""
  import ml_collections
  from dgr2_jax.stages import traces as traces_stage
  from dgr2_jax.task import copurchase, policy as policy_lib, traces as traces_lib
  rs = np.random.RandomState(0)
  n_items = 20
  items = {i: {"item": i, "brand": f"b{i % 4}", "categories": ["Beauty", f"leaf{i % 3}"]}
           for i in range(n_items)}
  sequences = [[int(x) for x in rs.randint(0, n_items, 6)] for _ in range(300)]
  candidates = np.array([rs.choice(n_items, 10, replace=False) for _ in sequences])
  exs, _ = traces_lib.build_examples(sequences, candidates, "test", bought_next=True)
  assert len(exs) > 100
  tc = ml_collections.ConfigDict({"max_history": 3, "mark_copurchase": True})
  policy = {"tiers": list(copurchase.TIERS) + ["Same brand"], "reach": 10}
  stage = [policy_lib.choose_from(r, policy) for r in traces_stage._relations(exs, items, tc)]
  preds = [{"example_id": e["example_id"], "history": e["history"], "candidates": e["candidates"]}
           for e in exs]
  nxt = {e["example_id"]: e["bought_next"] for e in exs}
  picks = diag.policy_picks(preds, items, policy, 3, bought_next=nxt)
  assert [picks[e["example_id"]] for e in exs] == stage
  brand_only = diag.policy_picks(preds, items, {"tiers": ["Same brand"], "reach": 10}, 3)
  assert sum(brand_only[i] != picks[i] for i in picks) > 10   # the counts change many picks
  with pytest.raises(ValueError, match="bought_next"):
    diag.policy_picks(preds, items, policy, 3)


def test_rule_rows_score_their_picks_like_a_model():
  picks = {0: 0, 1: 2, 2: 1, 3: 0, 4: 3}   # the picks of MODEL, the fallback's as #1
  preds = diag.rule_predictions(MODEL, picks)
  assert [diag.first_pick(p) for p in preds] == [0, 2, 1, 0, 3]
  assert all(sorted(p["ranking_items"]) == sorted(CANDS) for p in preds)
  row = diag.rule_row("rule", preds)
  assert row["method"] == "rule" and row["recall@1"] == 2 / 5 and row["n"] == 5
  assert row["valid_rate"] == 1.0 and row["fallback_rate"] == 0.0 and row["mean_nfe"] == 0.0
  # the target's rank in the rule's ranking (its pick, then the retriever's order): 1, 1, 2, 4, 6
  assert row["recall@3"] == 3 / 5
  assert [diag.most_bought_next(c) for c in ([0, 0, 0], [0, 2, 2], [1, 0, 3])] == [0, 1, 2]


def test_the_ladders_rule_picks_read_the_prompts_evidence(tmp_path, monkeypatch):
  """`pipeline.rule_picks` on evaluated users: the most-bought-next rule from the counts the
  prompts show, the trace policy's picks from `traces/policy.json` with those counts, both equal
  to what the traces stage's examples give."""
  import json
  import ml_collections
  from dgr2_jax.data import api
  from dgr2_jax.stages import pipeline
  from dgr2_jax.stages import traces as traces_stage
  from dgr2_jax.task import copurchase, policy as policy_lib, traces as traces_lib
  rs = np.random.RandomState(1)
  items = [{"item": i, "brand": f"b{i % 4}", "categories": ["Beauty", f"leaf{i % 3}"]} for i in range(20)]
  sequences = [[int(x) for x in rs.randint(0, 20, 6)] for _ in range(300)]
  candidates = np.array([rs.choice(20, 10, replace=False) for _ in sequences])
  exs, _ = traces_lib.build_examples(sequences, candidates, "valid", bought_next=True)
  preds = [{"example_id": e["example_id"], "history": e["history"], "candidates": e["candidates"]} for e in exs]
  policy = {"tiers": list(copurchase.TIERS) + ["Same brand"], "reach": 10}
  (tmp_path / "traces").mkdir()
  (tmp_path / "traces" / "policy.json").write_text(json.dumps({"policy": policy}))
  monkeypatch.setattr(api, "load_sequences", lambda w: sequences)
  monkeypatch.setattr(api, "load_items", lambda w: items)
  config = ml_collections.ConfigDict({"task": {"mark_copurchase": True, "max_history": 3}})
  rules = pipeline.rule_picks(config, str(tmp_path), preds, "valid")
  assert set(rules) == {"rule_bought_next", "rule_policy"}
  assert [rules["rule_bought_next"][e["example_id"]] for e in exs] == [
      int(np.argmax(e["bought_next"])) if max(e["bought_next"]) else 0 for e in exs]
  tc = ml_collections.ConfigDict({"max_history": 3, "mark_copurchase": True})
  assert [rules["rule_policy"][e["example_id"]] for e in exs] == [
      policy_lib.choose_from(r, policy) for r in traces_stage._relations(exs, items, tc)]
  with config.unlocked():
    config.task.mark_copurchase = False   # prompts without counts: no count rule, the policy needs them
  with pytest.raises(ValueError, match="bought_next"):
    pipeline.rule_picks(config, str(tmp_path), preds, "valid")
