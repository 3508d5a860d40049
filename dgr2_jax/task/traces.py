"""Task examples from the data splits, built-in reasoning traces, and teacher-trace import.

Example (plain dict): example_id (= user index; unique within a split), user, split, history
(item indices, oldest first), target, candidates (10 item indices, retriever order, possibly with
the target inserted), target_pos (0-based position of the target in candidates, -1 if absent),
inserted (bool).

`task.shuffle_train` shuffles the training candidates: a tiny model that sees the retriever's
lists only learns their frequent successions (and copies them where a test list differs) instead
of copying the list it is shown.

Splits (leave-one-out): train target = seq[-3] (history seq[:-3]); valid seq[-2]; test seq[-1].
Eval sets (`insert_target='none'`, `require_target=True`) keep only users whose target is among
the candidates: the paper's test set. For training, `task.insert_target` decides what happens
when the retriever missed the target: 'none' drops the example, 'replace_last' overwrites the
last candidate, 'random_position' removes the last candidate and inserts the target at a
position drawn from a generator seeded by (seed, user), uniformly, 'matched' the same but at a
position drawn from `position_probs` (the traces stage passes the validation split's histogram of
where the retriever puts the target, so inserted targets sit where real ones do: ~1/4 at #1).

With `bought_next=True` (`task.mark_copurchase`) each example also carries `bought_next`: per
candidate, how many users bought it right after this user's last history item, counted over the
split's pre-target interactions only (task/copurchase.py).

Trace (JSONL record): the example fields plus `messages` (chat messages of the prompt),
`response` (`<think>..</think>{"ranking": [...]}`, no EOS), `source` ('builtin' | 'import'), and
for built-in traces `order` (the response's ranking as 0-based candidate positions).
"""

from __future__ import annotations

import json
from typing import Callable, Iterable, Sequence

import numpy as np

from dgr2_jax.fileio import InputError
from dgr2_jax.task import answer as answer_lib
from dgr2_jax.task import copurchase
from dgr2_jax.task import metrics as metrics_lib
from dgr2_jax.task import policy as policy_lib
from dgr2_jax.task import prompts as prompts_lib
from dgr2_jax.task import rationale as rationale_lib

SPLIT_CUT = {"train": 3, "valid": 2, "test": 1}
INSERT_RULES = ("none", "replace_last", "random_position", "matched")
ACCEPT_RULES = ("top1", "promote")


def build_examples(sequences: Sequence[Sequence[int]], candidates: np.ndarray, split: str, *,
                   insert_target: str = "none", require_target: bool = True,
                   seed: int = 0, shuffle: bool = False,
                   position_probs: Sequence[float] | None = None,
                   bought_next: bool = False) -> tuple[list[dict], dict]:
  """Examples of one split plus counts of what was kept, inserted and dropped.

  `shuffle=True` presents each user's candidates in an order drawn from a generator seeded by
  (seed, user, 1) instead of the retriever's (a training augmentation, `task.shuffle_train`).
  """
  if split not in SPLIT_CUT:
    raise ValueError(f"split must be one of {tuple(SPLIT_CUT)}, got {split!r}")
  if insert_target not in INSERT_RULES:
    raise ValueError(f"task.insert_target must be one of {INSERT_RULES}, got {insert_target!r}")
  candidates = np.asarray(candidates)
  if candidates.ndim != 2 or candidates.shape[0] != len(sequences):
    raise ValueError(f"candidates shape {candidates.shape} does not match {len(sequences)} users")
  cut = SPLIT_CUT[split]
  tab = copurchase.table(sequences, cut) if bought_next else None
  counts = dict(users=len(sequences), skipped_short=0, target_in_candidates=0, inserted=0,
                dropped_no_target=0, kept=0)
  out = []
  for u, seq in enumerate(sequences):
    if len(seq) < cut + 1:  # needs at least one history item
      counts["skipped_short"] += 1
      continue
    target = int(seq[-cut])
    history = [int(x) for x in seq[:-cut]]
    cands = [int(x) for x in candidates[u]]
    pos = cands.index(target) if target in cands else -1
    inserted = False
    if pos >= 0:
      counts["target_in_candidates"] += 1
    elif insert_target == "replace_last":
      cands[-1], pos, inserted = target, len(cands) - 1, True
    elif insert_target in ("random_position", "matched"):
      rng = np.random.default_rng([seed, u])
      if insert_target == "matched":
        if position_probs is None or len(position_probs) != len(cands):
          raise ValueError(f"insert_target='matched' needs position_probs of length {len(cands)}")
        pos = int(rng.choice(len(cands), p=np.asarray(position_probs, np.float64)))
      else:
        pos = int(rng.integers(len(cands)))
      cands = cands[:-1]
      cands.insert(pos, target)
      inserted = True
    elif require_target:
      counts["dropped_no_target"] += 1
      continue
    counts["inserted"] += inserted
    if shuffle:
      perm = np.random.default_rng([seed, u, 1]).permutation(len(cands))
      cands = [cands[k] for k in perm]
      pos = cands.index(target) if target in cands else -1
    out.append(dict(example_id=u, user=u, split=split, history=history, target=target,
                    candidates=cands, target_pos=pos, inserted=inserted))
    if tab is not None:
      out[-1]["bought_next"] = copurchase.counts(tab, history, cands)
  counts["kept"] = len(out)
  return out, counts


def bought_next(ex: dict, task_cfg) -> list[int] | None:
  """The example's next-purchase counts when the prompt shows them (`task.mark_copurchase`)."""
  if not task_cfg.get("mark_copurchase", False):
    return None
  if "bought_next" not in ex:
    raise ValueError("task.mark_copurchase needs examples built with bought_next=True "
                     "(task/traces.py build_examples)")
  return ex["bought_next"]


def example_messages(ex: dict, items, sids, task_cfg) -> list[dict]:
  hist = ex["history"][-task_cfg.max_history:] if task_cfg.max_history > 0 else ex["history"]
  return prompts_lib.build_messages(hist, ex["candidates"], items, sids,
                                    task_cfg.prompt_variant, task_cfg.short_title_words,
                                    bool(task_cfg.get("mark_relations", False)),
                                    bought_next(ex, task_cfg))


def builtin_trace(ex: dict, items, sids, task_cfg, count_fn: Callable[[str], int] | None = None,
                  knows_target: bool = True, policy: dict | None = None) -> dict:
  """A trace from the rationale generator: the target first (`knows_target`), the first pick of
  `policy` (task/policy.py; its sentence names the relation that decided, or "Top pick" when #1
  stays first), or the rationale's own rule; the retriever's order for the rest."""
  hist = ex["history"][-task_cfg.max_history:] if task_cfg.max_history > 0 else ex["history"]
  hist_items, cand_items = [items[i] for i in hist], [items[i] for i in ex["candidates"]]
  first = rel = None
  if policy is not None:
    rels = policy_lib.relations(hist_items, cand_items, bought_next(ex, task_cfg))
    first = policy_lib.choose_from(rels, policy)
    rel = policy_lib.strongest(rels[first], policy["tiers"]) or rationale_lib.RELATIONS[-1]
  reasoning, order = rationale_lib.generate(
      hist_items, [sids[i] for i in hist], cand_items, [sids[i] for i in ex["candidates"]],
      ex["target_pos"], knows_target=knows_target, target_tokens=task_cfg.rationale_tokens,
      count_fn=count_fn, style=task_cfg.get("rationale_style", "full"),
      pick=None if first is None else rationale_lib.Pick(first, rel))
  ranking = answer_lib.ranking_entries(order, [sids[i] for i in ex["candidates"]],
                                       task_cfg.get("answer_ids", "sid"))
  return dict(ex, messages=example_messages(ex, items, sids, task_cfg),
              response=answer_lib.format_response(reasoning, ranking), source="builtin",
              order=order)


def demotes_target(order: Sequence[int], target_pos: int) -> bool:
  """True when a ranking (0-based candidate positions) puts the listed target lower than the
  retriever did: the paper's rejection of teacher traces that do not serve the target, which
  uses the label without ranking by it."""
  return target_pos >= 0 and metrics_lib.target_rank(order, target_pos) > target_pos + 1


def accept_reason(parsed: answer_lib.Parsed, target_pos: int, accept: str) -> str | None:
  """None when a teacher output is accepted, else the rejection reason."""
  if accept not in ACCEPT_RULES:
    raise ValueError(f"task.accept must be one of {ACCEPT_RULES}, got {accept!r}")
  if not parsed.valid:
    return parsed.verdict
  rank = metrics_lib.target_rank(parsed.positions, target_pos)
  if accept == "top1":
    return None if rank == 1 else "target_not_top1"
  # 'promote': strictly promoted, or kept at rank 1 (the paper's conditional format reward rule).
  return None if rank == 1 or rank < target_pos + 1 else "target_not_promoted"


def import_traces(lines: Iterable[str], examples: dict, items, sids, task_cfg, *,
                  source_name: str = "<traces>", default_split: str = "train") -> tuple[list, dict]:
  """Rejection-samples external teacher traces.

  `examples` maps (split, example_id) -> example. Each JSONL line has `example_id` or `user`,
  optional `split` (default `default_split`) and `response`. Accepted responses are re-written
  canonically (`<think>` + stripped reasoning + `</think>` + canonical JSON with the candidates'
  own SID strings, or their numbers under `task.answer_ids='number'`). Returns (traces, counts
  with `read`, `accepted` and one count per reason).
  """
  counts = {"read": 0, "accepted": 0}
  out = []
  for lineno, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      rec = json.loads(line)
    except json.JSONDecodeError as e:
      raise InputError(f"{source_name}:{lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(rec, dict) or not isinstance(rec.get("response"), str):
      raise InputError(f"{source_name}:{lineno}: needs a string field 'response'")
    key = rec.get("example_id", rec.get("user"))
    if not isinstance(key, int):
      raise InputError(f"{source_name}:{lineno}: needs an integer 'example_id' or 'user'")
    counts["read"] += 1
    ex = examples.get((rec.get("split", default_split), key))
    reason = "unknown_example" if ex is None else (
        "target_not_in_candidates" if ex["target_pos"] < 0 else None)
    if reason is None:
      cand_sids = [sids[i] for i in ex["candidates"]]
      parsed = answer_lib.parse_response(rec["response"], cand_sids)
      reason = accept_reason(parsed, ex["target_pos"], task_cfg.accept)
    if reason is not None:
      counts[reason] = counts.get(reason, 0) + 1
      continue
    ranking = answer_lib.ranking_entries(parsed.positions, cand_sids,
                                         task_cfg.get("answer_ids", "sid"))
    out.append(dict(ex, messages=example_messages(ex, items, sids, task_cfg),
                    response=answer_lib.format_response(parsed.reasoning.strip(), ranking),
                    source="import"))
    counts["accepted"] += 1
  return out, counts


def read_jsonl(path: str) -> list[dict]:
  out = []
  with open(path) as f:
    for lineno, line in enumerate(f, 1):
      if line.strip():
        try:
          out.append(json.loads(line))
        except json.JSONDecodeError as e:
          raise InputError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
  return out


def write_jsonl(path: str, records: Iterable[dict]) -> None:
  with open(path, "w") as f:
    for r in records:
      f.write(json.dumps(r, ensure_ascii=False) + "\n")
