"""Deterministic synthetic SFT batches (task batch layout) for tests and the train-step benchmark.

Batch `i` depends only on (seed, i), so `get_state() -> {"index": i}` / `set_state` resume it
exactly, like a grain iterator. Rows have random prompt lengths (left-padded) and response
lengths (right-padded); the first part of each response is "reasoning", the rest "answer".
"""

from __future__ import annotations

import numpy as np


class SyntheticSFTIterator:

  def __init__(self, batch_size: int, prompt_slots: int, response_slots: int, vocab_size: int,
               seed: int = 0, pad_id: int = 0, full: bool = False):
    """`full=True`: every prompt and response fills its slots (benchmarks: all tokens are real)."""
    self.b, self.p, self.r, self.v = batch_size, prompt_slots, response_slots, vocab_size
    self.seed, self.pad, self.full = seed, pad_id, full
    self.index = 0

  def __iter__(self):
    return self

  def get_state(self) -> dict:
    return {"index": int(self.index)}

  def set_state(self, state: dict) -> None:
    self.index = int(state["index"])

  def batch(self, i: int) -> dict:
    rng = np.random.default_rng([self.seed, i])
    b, p, r = self.b, self.p, self.r
    plen = np.full(b, p) if self.full else rng.integers(max(1, p // 2), p + 1, size=b)
    rlen = np.full(b, r) if self.full else rng.integers(max(2, r // 2), r + 1, size=b)
    tok = lambda shape: rng.integers(1, self.v, size=shape).astype(np.int32)
    prompt = np.where(np.arange(p)[None] >= (p - plen)[:, None], tok((b, p)), self.pad)
    resp_mask = np.arange(r)[None] < rlen[:, None]
    response = np.where(resp_mask, tok((b, r)), self.pad)
    think = np.maximum(rlen // 2, 1)
    reasoning = resp_mask & (np.arange(r)[None] < think[:, None])
    return {
        "prompt_ids": prompt.astype(np.int32), "prompt_len": plen.astype(np.int32),
        "response_ids": response.astype(np.int32), "response_mask": resp_mask.astype(np.int32),
        "reasoning_mask": reasoning.astype(np.int32),
        "answer_mask": (resp_mask & ~reasoning).astype(np.int32),
        "target_rank_in_candidates": np.zeros(b, np.int32),
        "example_id": (i * b + np.arange(b)).astype(np.int32),
    }

  def __next__(self) -> dict:
    out = self.batch(self.index)
    self.index += 1
    return out
