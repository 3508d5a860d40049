"""Demo tokenizer, prompts, rationales, trace import and the grain pipeline on synthetic data."""

import json

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest
import transformers

from dgr2_jax.task import answer, config, pipeline, prompts, rationale, synthetic, traces
from dgr2_jax.task import tokenizer as tok_lib


@pytest.fixture(scope="module")
def data():
  return synthetic.make(n_items=80, n_users=40, seed=0)


@pytest.fixture(scope="module")
def tok(data, tmp_path_factory):
  d = str(tmp_path_factory.mktemp("tok"))
  tok_lib.build_demo_tokenizer(tok_lib.demo_corpus(data["items"]), data["sid_tokens"], d, 1024)
  return transformers.AutoTokenizer.from_pretrained(d, local_files_only=True)


@pytest.fixture(scope="module")
def cfg():
  c = config.task_config()
  c.prompt_len, c.response_len = 640, 256
  return c


def count_fn(tok):
  return lambda s: len(tok.encode(s, add_special_tokens=False))


@pytest.fixture(scope="module")
def train_traces(data, tok, cfg):
  exs, _ = traces.build_examples(data["sequences"], data["candidates"]["train"], "train",
                                 insert_target="random_position", seed=3)
  return [traces.builtin_trace(e, data["items"], data["sids"], cfg, count_fn(tok)) for e in exs]


@pytest.fixture(scope="module")
def arrays(train_traces, tok, data, cfg):
  return pipeline.build_arrays(train_traces, tok, data["items"], data["sids"], cfg)


# --- tokenizer and prompts ---------------------------------------------------------------------

def test_demo_tokenizer_special_tokens(tok, data):
  ids = tok_lib.token_ids(tok)
  assert (ids.pad_id, ids.im_start_id, ids.eos_id, ids.mask_id) == tuple(
      tok.convert_tokens_to_ids(t) for t in tok_lib.SPECIAL_TOKENS)
  assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
  for t in list(tok_lib.SPECIAL_TOKENS) + list(tok_lib.THINK_TOKENS) + data["sid_tokens"]:
    assert tok.encode(t, add_special_tokens=False) == [tok.convert_tokens_to_ids(t)], t
  sid = data["sids"][7]
  assert len(tok.encode(sid, add_special_tokens=False)) == 4
  assert len(tok) < 2000


def test_chat_template_is_qwen3_style(tok):
  msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
  want = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
  assert prompts.render_prompt_text(tok, msgs) == want
  assert prompts.render_prompt_text(tok, msgs, enable_thinking=False) == (
      want + "<think>\n\n</think>\n\n")


def test_prompt_content_and_lossless_decode(tok, data):
  items, sids = data["items"], data["sids"]
  hist, cands = data["sequences"][0][:-3], list(data["candidates"]["train"][0])
  for variant in prompts.VARIANTS:
    msgs = prompts.build_messages(hist, cands, items, sids, variant)
    if variant == "minimal":  # no system message, one 'SID brand leaf' line per item
      assert [m["role"] for m in msgs] == ["user"]
      lines = msgs[0]["content"].split("\n")
      assert lines[0] == "History:" and lines[len(hist) + 1] == "Candidates:"
      numbered = [f"#{k + 1} " for k in range(len(cands))]
      for line, i, num in zip(lines[1:len(hist) + 1] + lines[len(hist) + 2:], hist + cands,
                              [""] * len(hist) + numbered):
        brand = items[i].get("brand") if items[i].get("brand") != "Unknown" else None
        assert line == f"{num}{sids[i]} {brand or 'unknown'} {items[i]['categories'][-1]}"
    else:
      assert msgs[0]["role"] == "system" and "re-ranker" in msgs[0]["content"]
    for i in hist + cands:
      assert sids[i] in msgs[-1]["content"]
    ids, dropped = prompts.render_prompt_ids(tok, hist, cands, items, sids, style=prompts.PromptStyle(variant))
    assert dropped == 0
    assert tok.decode(ids) == prompts.render_prompt_text(tok, msgs)
  full = prompts.build_messages(hist, cands, items, sids, "full")[1]["content"]
  assert " > ".join(items[cands[0]]["categories"][1:]) in full
  with pytest.raises(ValueError, match="prompt_variant"):
    prompts.build_messages(hist, cands, items, sids, "huge")


def test_prompt_truncates_oldest_history(tok, data):
  items, sids = data["items"], data["sids"]
  hist, cands = list(range(40, 52)), list(range(10))
  full, _ = prompts.render_prompt_ids(tok, hist, cands, items, sids)
  ids, dropped = prompts.render_prompt_ids(tok, hist, cands, items, sids, max_len=len(full) - 30)
  assert 0 < dropped < len(hist) and len(ids) <= len(full) - 30
  text = tok.decode(ids)
  kept = hist[dropped:]
  assert all(sids[i] in text for i in kept + cands)
  assert all(f"1. {sids[i]}" not in text for i in hist[:dropped])
  assert f"1. {sids[kept[0]]}" in text
  with pytest.raises(ValueError, match="prompt_len"):
    prompts.render_prompt_ids(tok, hist, cands, items, sids, max_len=50)


# --- rationales and traces ---------------------------------------------------------------------

def test_every_builtin_answer_is_valid_and_target_first(train_traces, data, tok):
  lens = []
  for t in train_traces:
    cand_sids = [data["sids"][i] for i in t["candidates"]]
    p = answer.parse_response(t["response"] + "<|im_end|>", cand_sids)
    assert p.valid, t["response"]
    rest = [k for k in range(10) if k != t["target_pos"]]
    assert p.positions == tuple([t["target_pos"]] + rest)
    lens.append(count_fn(tok)(p.reasoning))
  assert 110 <= np.mean(lens) <= 150, np.mean(lens)  # tracks rationale_tokens=130


def test_number_answers_are_short_and_parse_like_sids(data, tok, cfg):
  """`task.answer_ids='number'`: the same ranking as candidate numbers, one demo-BPE token each."""
  c = cfg.copy_and_resolve_references()
  c.answer_ids, c.rationale_style = "number", "terse"
  exs, _ = traces.build_examples(data["sequences"], data["candidates"]["train"], "train",
                                 insert_target="random_position", seed=3)
  for ex in exs:
    t = traces.builtin_trace(ex, data["items"], data["sids"], c, count_fn(tok))
    p = answer.parse_response(t["response"], [data["sids"][i] for i in t["candidates"]])
    assert p.valid and p.positions[0] == t["target_pos"], t["response"]
    tail = t["response"][t["response"].rindex("</think>") + len("</think>"):]
    assert json.loads(tail)["ranking"] == [k + 1 for k in p.positions]
    # '{"', 'ranking', '":', ' [', 10 numbers, 9 commas, ']}'
    assert count_fn(tok)(tail) == 24, tail


def test_rationale_length_knob_and_blind_variant(data, tok):
  items, sids = data["items"], data["sids"]
  ex = traces.build_examples(data["sequences"], data["candidates"]["train"], "train",
                             insert_target="replace_last")[0][0]
  args = ([items[i] for i in ex["history"]], [sids[i] for i in ex["history"]],
          [items[i] for i in ex["candidates"]], [sids[i] for i in ex["candidates"]])
  short, _ = rationale.generate(*args, ex["target_pos"], target_tokens=40, count_fn=count_fn(tok))
  long, _ = rationale.generate(*args, ex["target_pos"], target_tokens=200, count_fn=count_fn(tok))
  assert count_fn(tok)(short) < count_fn(tok)(long)
  text, order = rationale.generate(*args, knows_target=False, count_fn=count_fn(tok))
  scores = [rationale.score(c, args[0]) for c in args[2]]
  assert scores[order[0]] == max(scores) and sorted(order) == list(range(10))
  assert order[1:] == [k for k in range(10) if k != order[0]]
  assert text == rationale.generate(*args, knows_target=False, count_fn=count_fn(tok))[0]


def test_terse_rationale_names_recent_item_and_relation(data, tok):
  items, sids = data["items"], data["sids"]
  exs, _ = traces.build_examples(data["sequences"], data["candidates"]["train"], "train",
                                 insert_target="replace_last")
  seen = set()
  for ex in exs:
    hist = [items[i] for i in ex["history"]]
    args = (hist, [sids[i] for i in ex["history"]],
            [items[i] for i in ex["candidates"]], [sids[i] for i in ex["candidates"]])
    text, order = rationale.generate(*args, ex["target_pos"], style="terse")
    tgt, last = items[ex["target"]], hist[-1]
    rel = rationale.relation(tgt, hist)
    seen.add(rel)
    brand = last.get("brand") if last.get("brand") != "Unknown" else None
    brand = brand or "unknown"
    assert text == (f"Recent {sids[ex['history'][-1]]} {brand} {last['categories'][-1]}. "
                    f"{rel} #{ex['target_pos'] + 1} {sids[ex['target']]}. "
                    f"So #{ex['target_pos'] + 1} goes first, the others keep their order.")
    assert order == [ex["target_pos"]] + [k for k in range(10) if k != ex["target_pos"]]
    # The precedence of RELATIONS, from the item fields directly.
    if tgt.get("brand") not in (None, "Unknown") and tgt.get("brand") == last.get("brand"):
      assert rel == "Same brand"
    elif tgt["categories"][-1] == last["categories"][-1]:
      assert rel == "Same type"
    # Blind: the first candidate with the strongest relation to the last purchase.
    _, blind = rationale.generate(*args, knows_target=False, style="terse")
    ranks = [rationale.RELATIONS.index(rationale.relation(items[i], hist)) for i in ex["candidates"]]
    assert ranks[blind[0]] == min(ranks) and ranks.index(min(ranks)) == blind[0]
  assert len(seen) >= 3, seen
  with pytest.raises(ValueError, match="rationale_style"):
    rationale.generate(*args, ex["target_pos"], style="long")


def test_demo_bpe_keeps_mid_line_brand_and_leaf_whole(tok, data):
  """Every 'SID brand leaf' line is SID + one token per word of the brand and of the leaf."""
  for i, it in enumerate(data["items"][:20]):
    words = f"{it.get('brand')} {it['categories'][-1]}"
    if not it.get("brand") or not words.replace(" ", "").isalpha():  # the regex splits "L'Oreal"
      continue
    line = prompts.item_line(it, data["sids"][i], "minimal")
    want = 4 + len(it["brand"].split()) + len(it["categories"][-1].split())
    assert len(tok.encode(line, add_special_tokens=False)) == want, line


def test_build_examples_rules(data):
  seqs, cands = data["sequences"], data["candidates"]
  for split, cut in traces.SPLIT_CUT.items():
    exs, counts = traces.build_examples(seqs, cands[split], split)
    assert counts["kept"] == counts["target_in_candidates"] == len(exs) > 0
    for e in exs:
      u = e["user"]
      assert e["target"] == seqs[u][-cut] and e["history"] == seqs[u][:-cut]
      assert e["candidates"][e["target_pos"]] == e["target"] and not e["inserted"]
  n = len(seqs)
  for rule in ("replace_last", "random_position"):
    exs, counts = traces.build_examples(seqs, cands["train"], "train", insert_target=rule, seed=1)
    assert len(exs) == n and counts["inserted"] == n - counts["target_in_candidates"]
    for e in exs:
      assert e["candidates"][e["target_pos"]] == e["target"] and len(e["candidates"]) == 10
      assert len(set(e["candidates"])) == 10
      orig = list(cands["train"][e["user"]])
      if e["inserted"] and rule == "replace_last":
        assert e["target_pos"] == 9 and e["candidates"][:9] == orig[:9]
      if e["inserted"] and rule == "random_position":
        assert [c for c in e["candidates"] if c != e["target"]] == orig[:9]
  a, _ = traces.build_examples(seqs, cands["train"], "train", insert_target="random_position",
                               seed=1)
  assert a == exs  # deterministic given the seed


def test_import_traces_rejection_sampling(data, cfg):
  items, sids = data["items"], data["sids"]
  exs, _ = traces.build_examples(data["sequences"], data["candidates"]["train"], "train")
  by_key = {("train", e["example_id"]): e for e in exs}
  e0, e1 = exs[0], exs[1]
  c0 = [sids[i] for i in e0["candidates"]]
  t0 = e0["target_pos"]
  top = [c0[t0]] + [c for k, c in enumerate(c0) if k != t0]
  not_top = [c for k, c in enumerate(c0) if k != t0] + [c0[t0]]
  lines = [
      json.dumps({"example_id": e0["example_id"], "response":
                  "<think>\n teacher reasoning \n</think>\n\n" + answer.format_answer(top)}),
      json.dumps({"user": e0["user"], "split": "train",
                  "response": answer.format_response("r", not_top)}),
      json.dumps({"user": e0["user"], "response": answer.format_response("r", top[:9])}),
      json.dumps({"user": e0["user"], "response": "<think>never closed"}),
      json.dumps({"user": 10_000, "response": answer.format_response("r", top)}),
      json.dumps({"user": e1["user"], "split": "valid", "response": "x"}),
      "",
  ]
  got, counts = traces.import_traces(lines, by_key, items, sids, cfg)
  assert counts == {"read": 6, "accepted": 1, "target_not_top1": 1, "omission": 1,
                    "unparseable": 1, "unknown_example": 2}
  assert got[0]["response"] == answer.format_response("teacher reasoning", top)
  assert got[0]["source"] == "import" and got[0]["user"] == e0["user"]
  cfg_p = config.task_config()
  cfg_p.accept = "promote"
  # not_top moves the target to the last rank: a demotion unless it already was last.
  _, counts = traces.import_traces(lines[1:2], by_key, items, sids, cfg_p)
  assert counts.get("target_not_promoted", 0) == (0 if t0 == 9 else 1)
  with pytest.raises(ValueError, match=r"<traces>:2: not valid JSON"):
    traces.import_traces([lines[0], "{bad"], by_key, items, sids, cfg)


# --- pipeline ----------------------------------------------------------------------------------

def test_arrays_layout_and_masks(arrays, train_traces, tok, data, cfg):
  arr, counts = arrays
  tids = tok_lib.token_ids(tok)
  n = len(train_traces)
  assert counts["kept"] == n and counts["ok"] == n
  P, R = cfg.prompt_len, cfg.response_len
  assert arr["prompt_ids"].shape == (n, P) and arr["response_ids"].shape == (n, R)
  for k in pipeline.BATCH_KEYS:
    assert k in arr, k
  for i in range(n):
    t, L = train_traces[i], int(arr["prompt_len"][i])
    p = arr["prompt_ids"][i]
    assert (p[:P - L] == tids.pad_id).all() and p[P - L] == tids.im_start_id
    assert tok.decode(p[P - L:]) == prompts.render_prompt_text(tok, t["messages"])
    r, rm, qm, am = (arr[k][i] for k in ("response_ids", "response_mask", "reasoning_mask",
                                         "answer_mask"))
    assert ((qm + am) == rm).all() and (qm * am == 0).all()
    m = int(rm.sum())
    assert (rm[:m] == 1).all() and (r[m:] == tids.pad_id).all() and r[m - 1] == tids.eos_id
    assert tok.decode(r[:m]) == t["response"] + "<|im_end|>"
    reason = r[qm == 1]
    assert reason[0] == tids.think_id and reason[-1] == tids.end_think_id
    assert tok.decode(r[am == 1]) == answer.format_answer(json.loads(
        t["response"].split("</think>")[1])["ranking"]) + "<|im_end|>"
    assert arr["target_rank_in_candidates"][i] == t["target_pos"] + 1
    assert arr["example_id"][i] == t["example_id"]


def take(it, k):
  return [next(it) for _ in range(k)]


def same(a, b):
  return all(set(x) == set(y) and all(np.array_equal(x[k], y[k]) for k in x)
             for x, y in zip(a, b, strict=True))


def test_iterator_deterministic_and_resumable(arrays, tmp_path):
  arr, _ = arrays  # 40 examples, batch 8 -> 5 batches per epoch
  a = take(pipeline.make_iterator(arr, 8, seed=7), 12)
  b = take(pipeline.make_iterator(arr, 8, seed=7), 12)
  assert same(a, b)
  c = take(pipeline.make_iterator(arr, 8, seed=8), 12)
  assert not same(a, c)
  ep0 = np.concatenate([x["example_id"] for x in a[:5]])
  assert sorted(ep0) == sorted(arr["example_id"])  # one epoch = every example once
  assert not np.array_equal(ep0, np.concatenate([x["example_id"] for x in a[5:10]]))
  # Resume from a plain-JSON state, across the epoch boundary.
  it = pipeline.make_iterator(arr, 8, seed=7)
  take(it, 4)
  pipeline.save_iterator_state(it, str(tmp_path / "state.json"))
  it2 = pipeline.restore_iterator_state(pipeline.make_iterator(arr, 8, seed=7),
                                        str(tmp_path / "state.json"))
  assert same(take(it2, 8), a[4:12])
  # Resume through Orbax with grain's CheckpointHandler.
  it = pipeline.make_iterator(arr, 8, seed=7)
  take(it, 6)
  mgr = ocp.CheckpointManager(str(tmp_path / "ckpt"),
                              item_handlers={"data": pipeline.checkpoint_handler()})
  mgr.save(6, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
  mgr.wait_until_finished()
  fresh = pipeline.make_iterator(arr, 8, seed=7)
  restored = mgr.restore(6, args=ocp.args.Composite(
      data=grain.checkpoint.CheckpointRestore(fresh)))["data"]
  assert same(take(restored, 6), a[6:12])


def test_sharding_per_process(arrays):
  arr, _ = arrays
  shards = []
  for k in range(3):
    opts = grain.sharding.ShardOptions(shard_index=k, shard_count=3, drop_remainder=True)
    it = pipeline.make_iterator(arr, 4, seed=0, num_epochs=1, shard_options=opts)
    shards.append(np.concatenate([b["example_id"] for b in it]))
  assert all(len(s) == 12 for s in shards)  # 39 usable examples -> 13 each -> 3 batches of 4
  allids = np.concatenate(shards)
  assert len(set(allids.tolist())) == len(allids)
  default = take(pipeline.make_iterator(arr, 4, seed=0), 1)[0]  # ShardByJaxProcess: 1 process
  assert default["prompt_ids"].shape == (4, arr["prompt_ids"].shape[1])


def test_too_long_policies(train_traces, arrays, tok, data, cfg):
  items, sids = data["items"], data["sids"]
  plen = int(np.median(arrays[0]["prompt_len"]))
  tids = tok_lib.token_ids(tok)
  small = config.task_config()
  small.update(prompt_len=640, response_len=120, too_long_response="drop")
  with pytest.raises(ValueError, match=f"'response_dropped': {len(train_traces)}"):
    pipeline.build_arrays(train_traces, tok, items, sids, small)  # every response > 120
  small.too_long_response = "truncate_reasoning"
  arr, counts = pipeline.build_arrays(train_traces, tok, items, sids, small)
  assert counts["response_truncated"] == len(train_traces) == counts["kept"]
  assert (arr["response_mask"].sum(1) == 120).all()
  for i, t in enumerate(train_traces):
    text = tok.decode(arr["response_ids"][i])
    p = answer.parse_response(text, [sids[c] for c in t["candidates"]])
    assert p.valid and p.positions[0] == t["target_pos"]
    assert arr["response_ids"][i][arr["reasoning_mask"][i] == 1][-1] == tids.end_think_id
  small.prompt_len = plen
  arr, counts = pipeline.build_arrays(train_traces, tok, items, sids, small)
  assert counts["prompt_truncated"] > 0 and counts["kept"] == len(train_traces)
  assert (arr["prompt_len"] <= plen).all()
  small.prompt_len = 100
  with pytest.raises(ValueError, match="no example fits"):
    pipeline.build_arrays(train_traces, tok, items, sids, small)


def test_prompt_only_arrays_for_decoding(data, tok, cfg):
  exs, _ = traces.build_examples(data["sequences"], data["candidates"]["test"], "test")
  arr, counts = pipeline.build_arrays(exs, tok, data["items"], data["sids"], cfg)
  assert counts["kept"] == len(exs) and "response_ids" not in arr
  for i, e in enumerate(exs):
    ids, _ = pipeline.encode_prompt(tok, e, data["items"], data["sids"], cfg)
    assert arr["prompt_ids"][i, cfg.prompt_len - len(ids):].tolist() == ids
    assert arr["target_rank_in_candidates"][i] == e["target_pos"] + 1 >= 1


def test_shuffled_training_candidates(data):
  seqs, cands = data["sequences"], data["candidates"]["train"]
  plain, _ = traces.build_examples(seqs, cands, "train", insert_target="random_position", seed=3)
  mixed, _ = traces.build_examples(seqs, cands, "train", insert_target="random_position", seed=3,
                                   shuffle=True)
  again, _ = traces.build_examples(seqs, cands, "train", insert_target="random_position", seed=3,
                                   shuffle=True)
  assert mixed == again and len(mixed) == len(plain)
  moved = 0
  for a, b in zip(plain, mixed):
    assert sorted(a["candidates"]) == sorted(b["candidates"]) and a["target"] == b["target"]
    assert b["candidates"][b["target_pos"]] == b["target"]
    moved += a["candidates"] != b["candidates"]
  assert moved >= len(plain) - 1
