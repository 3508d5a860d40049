"""Trace policy (task/policy.py), matched insertion and demotion rejection (task/traces.py), the
brief rationale: plain hand-made examples."""

import numpy as np
import pytest

from dgr2_jax.task import policy
from dgr2_jax.task import rationale
from dgr2_jax.task import traces

SB, ST, BS, TP = rationale.RELATIONS


def item(brand, leaf):
  return {"brand": brand, "categories": ["Beauty", "Makeup", leaf]}


def test_relations_and_choice_follow_tiers_and_reach():
  hist = [item("Acme", "Mascara"), item("Nova", "Lipstick")]
  cands = [item("Zed", "Toner"), item("Lux", "Lipstick"), item("Acme", "Brush"),
           item("Nova", "Brush"), item("Nova", "Toner")]
  rels = policy.relations(hist, cands)
  assert rels == [TP, ST, BS, SB, SB]
  assert policy.choose_from(rels, policy.RULE) == 3                 # strongest tier, first in order
  assert policy.choose_from(rels, {"tiers": [SB], "reach": 3}) == 0  # same brand only beyond reach
  assert policy.choose_from(rels, {"tiers": [SB, ST], "reach": 3}) == 1
  assert policy.choose_from(rels, policy.RETRIEVER) == 0
  assert policy.choose(hist, cands, {"tiers": [SB], "reach": 10}) == 3


def test_fit_overrides_only_on_evidence_that_beats_the_top_pick():
  # Same brand at #3 picks the target 3 times in 4; same type at #2 once in 4 while #1 is right
  # twice there: the best policy overrides on same brand only.
  rels, tpos = [], []
  for t in (2, 2, 2, 0):
    rels.append([TP, TP, SB, TP])
    tpos.append(t)
  for t in (1, 0, 0, 3):
    rels.append([TP, ST, TP, TP])
    tpos.append(t)
  for t in (0, 0, 3, -1):             # nothing to go on; one target not listed (ignored)
    rels.append([TP, TP, TP, TP])
    tpos.append(t)
  best, grid = policy.fit(rels, tpos)
  assert best == {"tiers": [SB], "reach": 3}  # reach 3 and 5, 10 tie; the smallest is first
  row = policy.evaluate(rels, tpos, best)
  assert row["n"] == 11 and row["recall@1"] == pytest.approx(7 / 11)
  assert row["floor_recall@1"] == pytest.approx(5 / 11)
  assert row["override_rate"] == pytest.approx(4 / 11)
  assert row["override_precision"] == 0.75 and row["top1_precision_on_overrides"] == 0.25
  # The identity the ladder's diagnostics rest on: gain = rate x (precision - #1's precision).
  assert row["recall@1"] - row["floor_recall@1"] == pytest.approx(
      row["override_rate"] * (row["override_precision"] - row["top1_precision_on_overrides"]))
  both = policy.evaluate(rels, tpos, {"tiers": [SB, ST], "reach": 10})
  assert both["recall@1"] == pytest.approx(6 / 11) and both["recall@1"] < row["recall@1"]
  assert grid[0]["policy"] == "retriever order" and len(grid) == 1 + 3 * 4


def test_matched_insertion_draws_from_the_given_positions():
  seqs = [[1, 2, 3, 4, 5]] * 400
  cands = np.tile(np.arange(10, 20), (400, 1))       # the target (3) is never listed
  probs = [0.5, 0.0, 0.5] + [0.0] * 7
  exs, counts = traces.build_examples(seqs, cands, "train", insert_target="matched",
                                      position_probs=probs, seed=1)
  pos = np.bincount([e["target_pos"] for e in exs], minlength=10)
  assert counts["inserted"] == 400 and pos[[1] + list(range(3, 10))].sum() == 0
  assert 150 < pos[0] < 250 and pos[0] + pos[2] == 400
  assert all(e["candidates"][e["target_pos"]] == 3 and len(e["candidates"]) == 10 for e in exs)
  with pytest.raises(ValueError, match="position_probs"):
    traces.build_examples(seqs, cands, "train", insert_target="matched")


def test_demotion_is_judged_against_the_retriever_order():
  assert traces.demotes_target([2, 0, 1, 3], 0)        # #1 was the target, moved to 2nd
  assert traces.demotes_target([2, 0, 1, 3], 1)        # #2 -> 3rd
  assert not traces.demotes_target([2, 0, 1, 3], 2)    # promoted
  assert not traces.demotes_target([2, 0, 1, 3], 3)    # kept
  assert not traces.demotes_target([0, 1, 2, 3], -1)   # not listed


def test_brief_rationale_names_the_deciding_relation_without_sids():
  hist = [item("Acme", "Mascara")]
  cands = [item("Zed", "Toner"), item("Acme", "Brush")]
  text, order = rationale.generate(hist, ["<a_1>"], cands, ["<b_1>", "<b_2>"], None,
                                   knows_target=False, style="brief", pick=rationale.Pick(1, SB))
  assert order == [1, 0] and "<" not in text
  assert text == ("Recent Acme Mascara. Same brand #2. So #2 goes first, the others keep their "
                  "order.")


def test_marked_candidate_lines_name_the_relation_the_policy_reads():
  from dgr2_jax.task import prompts
  items = [item("Acme", "Mascara"), item("Nova", "Lipstick"), item("Acme", "Brush"),
           item("Lux", "Lipstick"), item("Zed", "Toner")]
  sids = [f"<a_{i}>" for i in range(5)]
  msg = prompts.build_messages([0, 1], [2, 3, 4], items, sids, "minimal", mark_relations=True)
  lines = msg[-1]["content"].splitlines()
  assert lines[-3:] == ["#1 <a_2> Acme Brush (brand seen)", "#2 <a_3> Lux Lipstick (same type)",
                        "#3 <a_4> Zed Toner"]
  plain = prompts.build_messages([0, 1], [2, 3, 4], items, sids, "minimal")
  assert plain[-1]["content"].splitlines()[-3] == "#1 <a_2> Acme Brush"
  assert [prompts.relation(items[i], [items[0], items[1]]) for i in (2, 3, 4)] == [BS, ST, TP]
