"""Next-purchase counts (task/copurchase.py), their tiers in the prompt and the trace policy, the
brief rationale's length cap, and the answer aligned to a block (task/pipeline.py): plain
hand-made examples, counted by hand."""

import numpy as np
import pytest

from dgr2_jax.task import answer
from dgr2_jax.task import config as task_config
from dgr2_jax.task import copurchase
from dgr2_jax.task import pipeline
from dgr2_jax.task import policy
from dgr2_jax.task import prompts
from dgr2_jax.task import rationale
from dgr2_jax.task import tokenizer as tok_lib
from dgr2_jax.task import traces

SB, ST, BS, TP = rationale.RELATIONS
OFTEN, TWICE, ONCE = copurchase.TIERS


def item(brand, leaf):
  return {"brand": brand, "categories": ["Beauty", "Makeup", leaf]}


def plain_counts(sequences, cut):
  """Reference: every adjacent pair of every user's pre-cut sequence, one at a time."""
  out = {}
  for seq in sequences:
    s = list(seq) if cut == 0 else list(seq)[:-cut]
    for i in range(len(s) - 1):
      out[(s[i], s[i + 1])] = out.get((s[i], s[i + 1]), 0) + 1
  return out


def test_table_counts_only_interactions_before_the_splits_targets():
  seqs = [[1, 2, 3, 4], [1, 2, 5], [7, 1, 2, 3], [2, 3]]
  for cut in (0, 1, 2, 3):
    assert dict(copurchase.table(seqs, cut)) == plain_counts(seqs, cut)
  # Validation (cut 2): (2, 3) is user 0's validation target after its last history item, and
  # (1, 2) user 2's: neither is counted from them; (1, 2) is once, from user 0's history.
  val = copurchase.table(seqs, 2)
  assert val[(2, 3)] == 0 and val[(1, 2)] == 1
  assert copurchase.table(seqs, 1)[(2, 3)] == 1       # test: user 2's validation pair is known
  exs, _ = traces.build_examples(seqs, np.array([[3, 5, 4, 2]] * 4), "valid", bought_next=True,
                                 require_target=False)
  by_user = {e["user"]: e for e in exs}
  assert by_user[0]["history"] == [1, 2] and by_user[0]["bought_next"] == [0, 0, 0, 0]
  assert by_user[2]["history"] == [7, 1] and by_user[2]["bought_next"] == [0, 0, 0, 1]
  assert copurchase.counts(val, [], [3, 5]) == [0, 0]
  assert [copurchase.tier(n) for n in (0, 1, 2, 3, 9)] == [None, ONCE, TWICE, OFTEN, OFTEN]


def test_tiers_lead_the_mark_and_the_policy_reads_the_strongest_label():
  items = [item("Acme", "Mascara"), item("Nova", "Lipstick"), item("Acme", "Brush"),
           item("Lux", "Lipstick"), item("Zed", "Toner")]
  sids = [f"<a_{i}>" for i in range(5)]
  msg = prompts.build_messages([0, 1], [2, 3, 4], items, sids, "minimal", mark_relations=True,
                               bought_next=[0, 3, 1])
  assert msg[-1]["content"].splitlines()[-3:] == [
      "#1 <a_2> Acme Brush (brand seen)", "#2 <a_3> Lux Lipstick (often bought next, same type)",
      "#3 <a_4> Zed Toner (bought next once)"]
  only = prompts.build_messages([0, 1], [2, 3, 4], items, sids, "minimal", bought_next=[2, 0, 0])
  assert only[-1]["content"].splitlines()[-3:] == [
      "#1 <a_2> Acme Brush (bought next twice)", "#2 <a_3> Lux Lipstick", "#3 <a_4> Zed Toner"]
  hist = [items[0], items[1]]
  rels = policy.relations(hist, [items[i] for i in (2, 3, 4)], [0, 3, 1])
  assert rels == [(None, BS), (OFTEN, ST), (ONCE, TP)]
  assert policy.choose_from(rels, {"tiers": [OFTEN, SB], "reach": 10}) == 1
  assert policy.choose_from(rels, {"tiers": [ONCE], "reach": 10}) == 2
  assert policy.choose_from(rels, {"tiers": [BS, OFTEN], "reach": 10}) == 0   # tier order rules
  assert policy.choose_from(rels, {"tiers": [OFTEN], "reach": 1}) == 0
  assert policy.strongest(rels[1], [SB, ST, OFTEN]) == ST
  assert policy.strongest(rels[2], [SB]) is None
  # The grid with tiers: every prefix of them, alone and ahead of the relations' prefixes.
  assert [OFTEN, TWICE, SB] in policy.GRID_TIERS_NEXT and [SB] in policy.GRID_TIERS_NEXT
  assert len(policy.GRID_TIERS_NEXT) == 3 + 3 * 4


def test_fit_prefers_the_tier_that_picks_the_target_more_often_than_the_top_pick():
  # "Often bought next" at #4 is the target 3 times in 4; same brand at #2 once in 4.
  rels, tpos = [], []
  for t in (3, 3, 3, 0):
    rels.append([(None, TP), (None, TP), (None, TP), (OFTEN, TP)])
    tpos.append(t)
  for t in (1, 0, 0, 2):
    rels.append([(None, TP), (None, SB), (None, TP), (None, TP)])
    tpos.append(t)
  best, grid = policy.fit(rels, tpos, policy.GRID_TIERS_NEXT)
  assert best == {"tiers": [OFTEN], "reach": 5}    # reach 2, 3 miss #4; 5 and 10 tie
  assert policy.evaluate(rels, tpos, best)["recall@1"] == pytest.approx(5 / 8)
  assert len(grid) == 1 + len(policy.GRID_TIERS_NEXT) * len(policy.GRID_REACH)
  # The trace of an example names the tier that decided.
  c = task_config.task_config()
  c.update(prompt_variant="minimal", rationale_style="brief", rationale_knows_target=False,
           mark_relations=True, mark_copurchase=True, answer_ids="number")
  items = [item("Acme", "Mascara")] + [item(f"B{k}", "Toner") for k in range(4)]
  ex = dict(example_id=0, user=0, split="train", history=[0], target=4, candidates=[1, 2, 3, 4],
            target_pos=3, inserted=False, bought_next=[0, 1, 0, 5])
  t = traces.builtin_trace(ex, items, [f"<a_{i}>" for i in range(5)], c, policy=best)
  assert t["order"] == [3, 0, 1, 2]
  assert "Often bought next #4. So #4 goes first" in t["response"]
  assert "#4 <a_4> B3 Toner (often bought next)" in t["messages"][-1]["content"]
  with pytest.raises(ValueError, match="bought_next=True"):
    traces.example_messages({k: v for k, v in ex.items() if k != "bought_next"}, items,
                            [f"<a_{i}>" for i in range(5)], c)


def test_brief_rationale_is_cut_to_its_token_budget():
  hist = [item("Mally Beauty Volumizing Black Boxed", "Mascara")]
  cands = [item("Zed", "Toner"), item("Acme", "Brush")]
  words = lambda s: len(s.split())
  full, _ = rationale.generate(hist, ["<a>"], cands, ["<b>", "<c>"], None, knows_target=False,
                               style="brief", pick=rationale.Pick(0, TP), count_fn=words)
  assert full.startswith("Recent Mally Beauty Volumizing Black Boxed Mascara. Top pick #1.")
  n = words(full)
  cut, _ = rationale.generate(hist, ["<a>"], cands, ["<b>", "<c>"], None, knows_target=False,
                              style="brief", pick=rationale.Pick(0, TP), count_fn=words,
                              target_tokens=n - 3)
  assert cut == full.replace(" Black Boxed Mascara.", ".") and words(cut) == n - 3
  tiny, _ = rationale.generate(hist, ["<a>"], cands, ["<b>", "<c>"], None, knows_target=False,
                               style="brief", pick=rationale.Pick(0, TP), count_fn=words,
                               target_tokens=1)
  assert tiny.startswith("Recent Mally. Top pick #1.")   # at least one word is kept


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  items = [item(f"Brand{k}", leaf) for k, leaf in enumerate(["Mascara", "Toner", "Brush"] * 4)]
  path = tok_lib.build_demo_tokenizer(tok_lib.demo_corpus(items), [f"<a_{i}>" for i in range(8)],
                                      str(tmp_path_factory.mktemp("tok")), 600)
  return tok_lib.load_tokenizer(path)


@pytest.mark.parametrize("block", [8, 16])
def test_answer_starts_a_new_block_after_newline_fillers(tok, block):
  tids = tok_lib.token_ids(tok)
  resp = answer.format_response("Recent Brand1 Toner. Top pick #1. So #1 goes first.",
                                list(range(1, 11)))
  plain, n_reason, st = pipeline.encode_response(tok, tids, resp, 96, "drop")
  ids, n_reason2, st2 = pipeline.encode_response(tok, tids, resp, 96, "drop", align=block)
  assert st == st2 == "ok" and n_reason == n_reason2
  start = -(-n_reason // block) * block
  nl = pipeline.filler_id(tok)
  assert ids[:n_reason] == plain[:n_reason] and ids[start:] == plain[n_reason:]
  assert ids[n_reason:start] == [nl] * (start - n_reason) and start % block == 0
  text = tok.decode(ids)
  assert "</think>\n" in text or start == n_reason
  p = answer.parse_response(text, [f"<a_{i}>" for i in range(10)])
  assert p.valid and p.positions == tuple(range(10))
  # Too long once aligned: 'drop' drops; 'truncate_reasoning' ends the reasoning a block earlier.
  tight = start - block + len(plain) - n_reason
  assert pipeline.encode_response(tok, tids, resp, tight, "drop", align=block)[0] is None
  cut, n_cut, st3 = pipeline.encode_response(tok, tids, resp, tight, "truncate_reasoning",
                                             align=block)
  assert st3 == "response_truncated" and n_cut <= start - block and len(cut) <= tight
  assert cut[n_cut - 1] == tids.end_think_id and cut[-(len(plain) - n_reason):] == plain[n_reason:]
  assert (len(cut) - (len(plain) - n_reason)) % block == 0


def test_answer_block_config_check():
  import ml_collections
  c = task_config.task_config()
  c.update(response_len=64, answer_block=24)
  cfg = ml_collections.ConfigDict({"task": c})
  with pytest.raises(ValueError, match="config.task.answer_block"):
    task_config.validate(cfg, set())
  cfg.task.answer_block = 32
  task_config.validate(cfg, set())


def test_served_impression_reads_as_the_eval_stage_built_it(tok):
  """The service's prompt for a test impression equals the eval stage's for that user: the same
  next-purchase counts (the interactions before the test targets)."""
  from dgr2_jax.serve import service as service_lib
  items = [item(f"Brand{k % 5}", ["Mascara", "Toner", "Brush"][k % 3]) for k in range(12)]
  sids = [f"<a_{i % 8}>" for i in range(12)]
  rng = np.random.default_rng(0)
  seqs = [[int(x) for x in rng.choice(12, size=int(rng.integers(4, 8)))] for _ in range(30)]
  cands = np.array([rng.permutation(12)[:10] for _ in seqs])
  c = task_config.task_config()
  c.update(prompt_variant="minimal", mark_relations=True, mark_copurchase=True, prompt_len=400)
  exs, _ = traces.build_examples(seqs, cands, "test", bought_next=True)
  assert exs and any(sum(e["bought_next"]) for e in exs)
  svc = object.__new__(service_lib.Service)
  svc.task, svc.next_table = c, copurchase.table(seqs, 1)
  for e in exs:
    ex = svc.example(e["history"], e["candidates"])
    assert ex["bought_next"] == e["bought_next"]
    assert (pipeline.encode_prompt(tok, ex, items, sids, c)
            == pipeline.encode_prompt(tok, e, items, sids, c))
