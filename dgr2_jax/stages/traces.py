"""Traces stage: supervised reasoning traces per split, the demo tokenizer, and task stats.

Reads `workdir/data`, `workdir/sids`, `workdir/retriever` through `dgr2_jax.data.api` and writes
`workdir/traces/`:
- `tokenizer/`: the demo BPE tokenizer, only when `config.task.tokenizer` is '' (a real Qwen3 or
  model tokenizer dir is used in place otherwise). `tokenizer_dir(config, workdir)` is where
  every later stage finds the tokenizer in use; the model-init stage copies it into model dirs.
- `<split>.jsonl` for each of `config.task.splits`: one trace per line (example_id, user, split,
  history, target, candidates, target_pos, inserted, messages, prompt_text, response, source).
  Built-in rationales unless `config.task.traces_path` names a teacher JSONL (rejection-sampled).
  With `task.reject_demoting`, training traces whose ranking demotes the target carry
  `"sft": false`: supervised stages skip them, on-policy stages still prompt with them.
- `stats.json`: example counts, rejection counts, prompt/response token statistics, what the
  static shapes would truncate or drop, the pre-rank floor per split, and where the target sits
  among the candidates in each split (`target_positions`: the retriever's lists, and the training
  split as built, insertions included), side by side.
- `policy.json` (`task.trace_policy='fit'`): the trace policy chosen on the training lists
  (task/policy.py), its grid, and the policy alone on validation against the floor and the
  rationale's rule, measured before anything is trained on it.
"""

from __future__ import annotations

import os

import numpy as np

from dgr2_jax.data import api
from dgr2_jax.stages import common
from dgr2_jax.stages import contract
from dgr2_jax.task import metrics as metrics_lib
from dgr2_jax.task import pipeline as pipeline_lib
from dgr2_jax.task import policy as policy_lib
from dgr2_jax.task import prompts as prompts_lib
from dgr2_jax.task import tokenizer as tok_lib
from dgr2_jax.task import traces as traces_lib

UPSTREAM = ("data", "sids", "retriever")


tokenizer_dir = tok_lib.tokenizer_dir   # the tokenizer in use (the server reads it too)


def load_items_sids(workdir: str):
  return api.load_items(workdir), api.load_sids(workdir)


def load_task_data(workdir: str) -> dict:
  """Everything the task needs from the data API (tests replace this function)."""
  return dict(items=api.load_items(workdir), sids=api.load_sids(workdir),
              sid_tokens=api.load_sid_tokens(workdir), sequences=api.load_sequences(workdir),
              candidates={s: api.load_candidates(workdir, s) for s in ("train", "valid", "test")})


def load_split_arrays(config, workdir: str, split: str = "train", tokenizer=None,
                      rejected: bool = False) -> tuple[dict, dict]:
  """Arrays of `workdir/traces/<split>.jsonl` (written by this stage), for the trainers. Traces
  marked `"sft": false` (rejected: `task.reject_demoting`) are left out unless `rejected` (the
  on-policy stages' prompts: every user, whatever its trace said)."""
  path = os.path.join(workdir, "traces", f"{split}.jsonl")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} missing: run --config.stage=traces first")
  if tokenizer is None:
    tokenizer = tok_lib.load_tokenizer(tokenizer_dir(config, workdir))
  items, sids = load_items_sids(workdir)
  records = [r for r in traces_lib.read_jsonl(path) if rejected or r.get("sft", True)]
  return pipeline_lib.build_arrays(records, tokenizer, items, sids, config.task,
                                   desc=f"tokenize {split}")


def upstream_hashes(upstream: dict) -> list:
  """The hashes of the stages the traces are built from, as they enter a hash ({stage: hash})."""
  return [upstream[s] for s in UPSTREAM]


def _summary(xs) -> dict:
  xs = np.asarray(xs, np.float64)
  if xs.size == 0:
    return {"n": 0}
  return {"n": int(xs.size), "mean": float(xs.mean()), "p50": float(np.percentile(xs, 50)),
          "p90": float(np.percentile(xs, 90)), "max": float(xs.max()), "min": float(xs.min())}


def trace_stats(traces, tokenizer, items, sids, task_cfg) -> dict:
  """Token statistics of traces (untruncated) and the pipeline's truncation/drop counts."""
  enc = lambda s: prompts_lib.encode(tokenizer, s)
  prompt_lens, reason_lens, resp_lens = [], [], []
  for t in traces:
    prompt_lens.append(len(enc(t["prompt_text"])))
    reasoning, _ = traces_lib.answer_lib.split_response(t["response"])
    reason_lens.append(len(enc(reasoning)))
    resp_lens.append(len(enc(t["response"])) + 1)  # + EOS
  _, counts = pipeline_lib.build_arrays(traces, tokenizer, items, sids, task_cfg) if traces else (
      None, {})
  return {"prompt_tokens": _summary(prompt_lens), "reasoning_tokens": _summary(reason_lens),
          "response_tokens": _summary(resp_lens), "static_shapes": counts,
          "mean_reasoning_tokens": float(np.mean(reason_lens)) if reason_lens else 0.0}


def position_histogram(examples, k: int) -> list[int]:
  """Counts of the target's 0-based position among the candidates (examples with it listed)."""
  return np.bincount([e["target_pos"] for e in examples if e["target_pos"] >= 0],
                     minlength=k)[:k].tolist()


def _relations(examples, items, tc) -> list[list]:
  cut = lambda h: h[-tc.max_history:] if tc.max_history > 0 else h
  return [policy_lib.relations([items[i] for i in cut(e["history"])],
                               [items[i] for i in e["candidates"]],
                               traces_lib.bought_next(e, tc)) for e in examples]


def fit_policy(d: dict, tc) -> dict:
  """The trace policy chosen on the training split's listed targets, and the policy alone on
  validation beside the floor and the rationale's rule (nothing trained yet)."""
  nxt = bool(tc.get("mark_copurchase", False))
  split_exs = {s: traces_lib.build_examples(d["sequences"], d["candidates"][s], s,
                                            bought_next=nxt)[0]
               for s in ("train", "valid")}
  rels = {s: _relations(e, d["items"], tc) for s, e in split_exs.items()}
  tpos = {s: [x["target_pos"] for x in e] for s, e in split_exs.items()}
  policy, grid = policy_lib.fit(rels["train"], tpos["train"],
                                policy_lib.GRID_TIERS_NEXT if nxt else None)
  valid = {n: policy_lib.evaluate(rels["valid"], tpos["valid"], p) for n, p in
           (("chosen", policy), ("rule", policy_lib.RULE), ("retriever", policy_lib.RETRIEVER))}
  return {"policy": policy, "name": policy_lib.name(policy), "chosen_on": "train",
          "grid_train": grid, "valid": valid}


def _hash(config, workdir: str, upstream: dict) -> str:
  return common.config_hash(config.task, config.get("seed", 0), upstream_hashes(upstream), workdir=workdir)


def _build(config, workdir: str, build: contract.Build) -> str:
  tc = config.task
  d = load_task_data(workdir)
  items, sids = d["items"], d["sids"]
  with build.publish() as tmp:
    if tc.tokenizer:
      tok_path = tc.tokenizer
    else:
      tok_path = tok_lib.build_demo_tokenizer(tok_lib.demo_corpus(items), d["sid_tokens"],
                                              os.path.join(tmp, "tokenizer"), tc.demo_vocab_size)
    tokenizer = tok_lib.load_tokenizer(tok_path)
    count_fn = lambda s: len(tokenizer.encode(s, add_special_tokens=False))
    stats = {"tokenizer": tc.tokenizer or "traces/tokenizer", "splits": {}}
    k = int(tc.num_candidates)
    listed = {s: traces_lib.build_examples(d["sequences"], d["candidates"][s], s)[0]
              for s in ("train", "valid", "test")}
    stats["target_positions"] = {s: position_histogram(e, k) for s, e in listed.items()}
    probs = np.asarray(stats["target_positions"]["valid"], np.float64)
    probs = probs / probs.sum() if probs.sum() else np.full(k, 1.0 / k)
    policy = None
    if tc.get("trace_policy", "rule") == "fit" and not tc.traces_path:
      record = fit_policy(d, tc)
      policy = record["policy"]
      common.write_json_atomic(os.path.join(tmp, "policy.json"), record)
      v = record["valid"]
      print(f"traces: trace policy '{record['name']}' (chosen on the training lists): valid "
            f"Recall@1 {v['chosen']['recall@1']:.4f} against the floor "
            f"{v['chosen']['floor_recall@1']:.4f} (the rationale's rule: "
            f"{v['rule']['recall@1']:.4f}; n = {v['chosen']['n']})", flush=True)
    examples = {}
    for split in tc.splits:
      insert = tc.insert_target if split == "train" else "none"
      exs, counts = traces_lib.build_examples(
          d["sequences"], d["candidates"][split], split, insert_target=insert, seed=tc.seed,
          shuffle=split == "train" and bool(tc.get("shuffle_train", False)),
          position_probs=probs if insert == "matched" else None,
          bought_next=bool(tc.get("mark_copurchase", False)))
      if split == "train":
        stats["target_positions"]["train_as_built"] = position_histogram(exs, k)
      if tc.max_examples:
        exs = exs[:tc.max_examples]
      examples[split] = exs
      stats["splits"][split] = {"examples": counts}
    # Pre-rank floor per split on the paper's filtered set (target among the candidates).
    for split in ("train", "valid", "test"):
      exs, counts = traces_lib.build_examples(d["sequences"], d["candidates"][split], split)
      stats.setdefault("prerank_floor", {})[split] = dict(
          metrics_lib.prerank_floor([e["target_pos"] for e in exs], tc.num_candidates),
          users=counts["users"], target_in_candidates=counts["target_in_candidates"])
    if tc.traces_path:
      by_key = {(s, e["example_id"]): e for s, exs in examples.items() for e in exs}
      with open(tc.traces_path) as f:
        imported, rej = traces_lib.import_traces(f, by_key, items, sids, tc,
                                                 source_name=tc.traces_path)
      stats["import"] = rej
      traces = {s: [t for t in imported if t["split"] == s] for s in tc.splits}
    else:
      traces = {s: [traces_lib.builtin_trace(e, items, sids, tc, count_fn,
                                             tc.rationale_knows_target, policy) for e in exs]
                for s, exs in examples.items()}
      if tc.get("reject_demoting", False) and "train" in traces:
        # Kept in the file, marked: SFT and CFT skip them, the on-policy stages' prompts do not.
        for t in traces["train"]:
          if traces_lib.demotes_target(t["order"], t["target_pos"]):
            t["sft"] = False
        stats["splits"]["train"]["rejected_demoting"] = sum(
            1 for t in traces["train"] if not t.get("sft", True))
    for split, ts in traces.items():
      for t in ts:
        t["prompt_text"] = prompts_lib.render_prompt_text(tokenizer, t["messages"],
                                                          tc.enable_thinking)
      traces_lib.write_jsonl(os.path.join(tmp, f"{split}.jsonl"), ts)
      stats["splits"][split].update(traces=len(ts), **trace_stats(ts, tokenizer, items, sids, tc))
    common.write_json_atomic(os.path.join(tmp, "stats.json"), stats)
  return build.out


STAGE = contract.Stage(name="traces", reads=UPSTREAM, hashed=_hash, build=_build, host_only=True)


def run(config, workdir: str) -> str:
  """Builds (or reuses) `workdir/traces`; returns its path."""
  return contract.run(STAGE, config, workdir)
