"""The grain input pipeline: traces -> static-shape numpy batches with loss masks.

Tokenisation (`encode_example`):
- prompt: the chat template's rendering with the generation prompt, LEFT-padded to P. Too long
  => history items are dropped from the OLDEST side until it fits (counted `prompt_truncated`);
  if even an empty history does not fit, the example is dropped (`prompt_too_long`).
- response: `<think>` + reasoning + `</think>` + answer JSON + EOS, RIGHT-padded to R. The pieces
  are encoded separately, which equals encoding the whole text because `<think>`/`</think>` are
  added tokens (the tokenizer splits on them first). Too long => `task.too_long_response`:
  'drop' drops the example (`response_dropped`); 'truncate_reasoning' cuts reasoning tokens from
  the end so the closing `</think>`, the full answer and EOS still fit (`response_truncated`;
  dropped anyway when the answer alone does not fit).
- `task.answer_block` = B > 0: newline tokens after `</think>` (Qwen3's own separator there) until
  the answer starts at a multiple of B, i.e. at the first position of a diffusion block. Why: a
  block-diffusion decoder denoises a block's positions in parallel; when the answer starts at a
  varying offset inside the block that also finishes the reasoning, every answer token must be
  placed relative to where the reasoning will end, which is itself still masked, and a small
  model commits doubled or dropped separators (`[2,, 1 3`). Aligned, the answer block is decoded
  with the whole reasoning (and its choice) committed, and each answer token has a fixed offset.
  Costs up to B-1 filler tokens per response, the AR teacher writes them too (one format).
- masks: `response_mask` on real response tokens incl. EOS; `reasoning_mask` on `<think>` ..
  `</think>` inclusive; `answer_mask` on everything after `</think>` incl. EOS.
- `target_rank_in_candidates`: the target's 1-BASED rank in the retriever's candidate list (the
  r^D of the rank-promotion reward); also `candidates [b,N]` and `target [b]` for reward code.

Batching: the whole split lives in memory as stacked arrays; a grain MapDataset over example
indices is shuffled per epoch from `seed` (one global order, the same in every process), batched
into global batches with drop_remainder (static shapes), and each process gathers its slice of each
global batch, so the data order does not depend on the process count. The iterator is a grain
`DatasetIterator`: `get_state()`/`set_state()` resume exactly; `checkpoint_handler()` is the
Orbax-compatible `grain.checkpoint.CheckpointHandler`.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import grain
import numpy as np
import tqdm

from dgr2_jax.task import answer as answer_lib
from dgr2_jax.task import prompts as prompts_lib
from dgr2_jax.task import tokenizer as tok_lib
from dgr2_jax.task import traces as traces_lib

RESPONSE_POLICIES = ("drop", "truncate_reasoning")
BATCH_KEYS = ("prompt_ids", "prompt_len", "response_ids", "response_mask", "reasoning_mask",
              "answer_mask", "target_rank_in_candidates", "example_id", "candidates", "target")


def encode_prompt(tokenizer, ex: dict, items, sids, task_cfg) -> tuple[list[int], int]:
  """(prompt ids, history items dropped beyond the max_history cap); ValueError if too long."""
  n_hist = len(ex["history"])
  cap = min(n_hist, task_cfg.max_history) if task_cfg.max_history > 0 else n_hist
  style = prompts_lib.PromptStyle(variant=task_cfg.prompt_variant, short_words=task_cfg.short_title_words,
                                  mark_relations=bool(task_cfg.get("mark_relations", False)),
                                  enable_thinking=task_cfg.enable_thinking)
  ids, dropped = prompts_lib.render_prompt_ids(
      tokenizer, ex["history"], ex["candidates"], items, sids, style=style, max_history=cap,
      max_len=task_cfg.prompt_len, bought_next=traces_lib.bought_next(ex, task_cfg))
  return ids, dropped - (n_hist - cap)


def encode_response(tokenizer, tids: tok_lib.TokenIds, response: str, max_len: int,
                    policy: str, align: int = 0) -> tuple[list[int] | None, int, str]:
  """(ids incl. EOS or None if dropped, n_reasoning_ids (incl. think tags), status). `align` > 0:
  newline fillers after `</think>` so the answer starts at a multiple of `align` (module doc)."""
  if policy not in RESPONSE_POLICIES:
    raise ValueError(f"task.too_long_response must be one of {RESPONSE_POLICIES}, got {policy!r}")
  reasoning, answer = answer_lib.split_response(response)
  if reasoning is None or not response.startswith(answer_lib.THINK_OPEN):
    raise ValueError(f"response does not follow <think>..</think>{{json}}: {response[:80]!r}")
  r = prompts_lib.encode(tokenizer, reasoning)
  a = prompts_lib.encode(tokenizer, answer) + [tids.eos_id]
  status = "ok"
  start = lambda n: -(-n // align) * align if align > 0 else n  # where the answer starts
  if start(len(r) + 2) + len(a) > max_len:
    keep = max_len - len(a)
    keep = (keep // align) * align - 2 if align > 0 else keep - 2
    if policy == "drop" or keep < 0:
      return None, 0, "response_dropped"
    r, status = r[:keep], "response_truncated"
  fill = [] if align <= 0 else [filler_id(tokenizer)] * (start(len(r) + 2) - len(r) - 2)
  return [tids.think_id] + r + [tids.end_think_id] + fill + a, len(r) + 2, status


def filler_id(tokenizer) -> int:
  """The token of one newline: the answer-alignment filler (`task.answer_block`)."""
  ids = prompts_lib.encode(tokenizer, "\n")
  if len(ids) != 1:
    raise ValueError(f"task.answer_block needs a one-token newline; this tokenizer gives {ids}")
  return ids[0]


def encode_example(tokenizer, tids: tok_lib.TokenIds, ex: dict, items, sids,
                   task_cfg) -> tuple[dict | None, tuple[str, ...]]:
  """One row of fixed-shape arrays (None when dropped) and what happened to it (('ok',) or
  the events: prompt_truncated, prompt_too_long, response_truncated, response_dropped)."""
  P, R = task_cfg.prompt_len, task_cfg.response_len
  try:
    p, hist_dropped = encode_prompt(tokenizer, ex, items, sids, task_cfg)
  except ValueError:
    return None, ("prompt_too_long",)
  status = ["prompt_truncated"] if hist_dropped else []
  row = {"prompt_ids": np.full([P], tids.pad_id, np.int32), "prompt_len": np.int32(len(p)),
         "example_id": np.int32(ex["example_id"]), "target": np.int32(ex["target"]),
         "candidates": np.asarray(ex["candidates"], np.int32),
         "target_rank_in_candidates": np.int32(ex["target_pos"] + 1)}
  row["prompt_ids"][P - len(p):] = p
  if "response" in ex:
    resp, n_reason, rstatus = encode_response(tokenizer, tids, ex["response"], R,
                                              task_cfg.too_long_response,
                                              int(task_cfg.get("answer_block", 0)))
    if resp is None:
      return None, tuple(status) + (rstatus,)
    status += [rstatus] if rstatus != "ok" else []
    ids = np.full([R], tids.pad_id, np.int32)
    ids[:len(resp)] = resp
    pos = np.arange(R)
    row.update(response_ids=ids, response_mask=(pos < len(resp)).astype(np.int32),
               reasoning_mask=(pos < n_reason).astype(np.int32),
               answer_mask=((pos >= n_reason) & (pos < len(resp))).astype(np.int32))
  return row, tuple(status) or ("ok",)


def build_arrays(examples: Sequence[dict], tokenizer, items, sids, task_cfg,
                 desc: str = "tokenize") -> tuple[dict, dict]:
  """Stacked arrays of every kept example (in input order) and per-status counts."""
  tids = tok_lib.token_ids(tokenizer)
  rows, counts = [], {"in": len(examples), "ok": 0, "prompt_truncated": 0, "prompt_too_long": 0,
                      "response_dropped": 0, "response_truncated": 0}
  for ex in tqdm.tqdm(examples, desc=desc, leave=False, disable=len(examples) < 2000):
    row, status = encode_example(tokenizer, tids, ex, items, sids, task_cfg)
    for s in status:
      counts[s] += 1
    if row is not None:
      rows.append(row)
  counts["kept"] = len(rows)
  if not rows:
    raise ValueError(f"no example fits task.prompt_len={task_cfg.prompt_len} / task.response_len="
                     f"{task_cfg.response_len} (raise the one whose count is high, or set "
                     f"task.too_long_response='truncate_reasoning'): {counts}")
  return {k: np.stack([r[k] for r in rows]) for k in rows[0]}, counts


def make_dataset(arrays: dict, batch_size: int, *, seed: int, num_epochs: int | None = None,
                 shuffle: bool = True, shard_options: grain.sharding.ShardOptions | None = None,
                 process: tuple[int, int] | None = None,
                 field: str = "batch_size") -> grain.MapDataset:
  """MapDataset of batches (dicts of numpy arrays). `num_epochs=None` repeats forever.

  Default: one global order whatever the process count. `batch_size` is the GLOBAL batch: every
  process shuffles all examples alike (`seed`, re-shuffled each epoch), cuts global batches of
  `batch_size` (drop_remainder), and process k of n keeps rows [k*b/n, (k+1)*b/n) of each, so
  2 processes x 2 devices see exactly the batches 1 process x 4 devices sees. `process` =
  (index, count) overrides jax's; `field` names the batch size in the divisibility error.

  `shard_options` (explicit) instead shards the examples per process (strided: shard k of n reads
  examples k, k+n, ... of the first n*floor(N/n)), each shard shuffled and batched by `batch_size`
  on its own (the order then depends on the shard count).
  """
  n = len(next(iter(arrays.values())))
  if shard_options is not None:
    ds = grain.MapDataset.range(n)
    count, index = shard_options.shard_count, shard_options.shard_index
    if count > 1:
      ds = ds[:n - n % count] if shard_options.drop_remainder else ds
      ds = ds[index::count]
    if len(ds) < batch_size:
      raise ValueError(f"shard has {len(ds)} examples < batch size {batch_size}")
    if shuffle:
      ds = ds.shuffle(seed=seed)  # re-shuffled every epoch by grain (seed + epoch)
    ds = ds.repeat(num_epochs).batch(batch_size, drop_remainder=True)
    return ds.map(lambda idx: {k: v[idx] for k, v in arrays.items()})
  if process is None:
    from dgr2_jax import multihost
    process = (multihost.process_index(), multihost.process_count())
  index, count = process
  if batch_size % count:
    raise ValueError(f"{field} ({batch_size}) must be divisible by the process count ({count})")
  if n < batch_size:
    raise ValueError(f"{n} examples < {field} {batch_size}")
  ds = grain.MapDataset.range(n)
  if shuffle:
    ds = ds.shuffle(seed=seed)  # re-shuffled every epoch by grain (seed + epoch)
  ds = ds.repeat(num_epochs).batch(batch_size, drop_remainder=True)
  lo, hi = index * (batch_size // count), (index + 1) * (batch_size // count)
  return ds.map(lambda idx: {k: v[idx[lo:hi]] for k, v in arrays.items()})


def make_iterator(arrays: dict, batch_size: int, *, seed: int, num_epochs: int | None = None,
                  shuffle: bool = True, shard_options=None, process: tuple[int, int] | None = None,
                  field: str = "batch_size") -> grain.DatasetIterator:
  """A checkpointable iterator of batches (`get_state()` / `set_state(state)`); `make_dataset`
  says which rows each process gets."""
  ds = make_dataset(arrays, batch_size, seed=seed, num_epochs=num_epochs, shuffle=shuffle,
                    shard_options=shard_options, process=process, field=field)
  # One reader thread and a small buffer: the gather is cheap and the CPUs are shared.
  return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)))


def checkpoint_handler() -> grain.checkpoint.CheckpointHandler:
  """Orbax handler: register as an item handler and save with
  `grain.checkpoint.CheckpointSave(iterator)`, restore with `CheckpointRestore(iterator)`."""
  return grain.checkpoint.CheckpointHandler()


def save_iterator_state(iterator, path: str) -> None:
  """Plain-file alternative to Orbax (one JSON per process), written via a temporary file."""
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(iterator.get_state(), f)
  os.replace(tmp, path)


def restore_iterator_state(iterator, path: str):
  with open(path) as f:
    iterator.set_state(json.load(f))
  return iterator
