"""Commit schedules: how many tokens each answer committed at each denoising step, as a file.

The eval stage records one per block-diffusion run (`schedule.json` beside `predictions.jsonl`);
`benchmarks/decode_throughput.py --schedule=FILE` replays it at any model shape, so a random-weight
model decodes with a trained model's exact step counts. The file (JSON, written atomically by
process 0):

  {"format": "dgr2_jax commit schedule", "version": 1, "model": <model dir>, "split": ...,
   "block_size": B, "threshold": tau, "steps_per_block": S, "temperature": T,
   "max_new_tokens": R, "kv_write": the resolved K/V write ('fused' | 'separate'),
   "answers": [{"example_id": ..., "prompt_len": ..., "nfe": ..., "commits": [n_0, n_1, ...]}, ...]}

`commits[s]` is how many positions the answer committed at its denoising step s (every step
commits at least one): the sum is the answer's length (through its EOS, or R), the length its
denoising steps. Its NFE is that many forwards, plus one K/V write per block after the first when
`kv_write` is 'separate' (that forward commits nothing, so it has no entry).

Replay (`forced_commits`): row i of a batch runs answer i's schedule through the decoder's
`commits` input: at its step s it commits exactly n_s of its masked positions, the most confident
ones (tau 1, no step budget), and it finishes when its schedule ends, as at an EOS.
"""

from __future__ import annotations

import json

import numpy as np

from dgr2_jax import fileio

FORMAT = "dgr2_jax commit schedule"
VERSION = 1
FILENAME = "schedule.json"


def commits_per_step(commit_steps) -> list[int]:
  """An answer's commit step per output token (the decoder's `commit_step` cut to the answer) ->
  tokens committed at each of its denoising steps."""
  steps = np.asarray(commit_steps, np.int64)
  if steps.size == 0 or steps.min() < 0:
    raise ValueError("commit_steps: every output token needs the step that committed it (>= 0)")
  return np.bincount(steps).tolist()


def make(answers: list[dict], **settings) -> dict:
  """The schedule file's object: `settings` (model, split, block_size, threshold, steps_per_block,
  temperature, max_new_tokens, kv_write) and the answers ({example_id, prompt_len, nfe, commits})."""
  return {"format": FORMAT, "version": VERSION, **settings, "answers": answers}


def write(path: str, obj: dict) -> None:
  """Writes a schedule atomically (process 0 only), after checking it."""
  check(obj, path)
  fileio.write_json_atomic(path, obj)


def read(path: str) -> dict:
  """A schedule file, checked (`check`)."""
  try:
    with open(path) as f:
      obj = json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"{path}: cannot read a commit schedule ({e})") from None
  check(obj, path)
  return obj


def check(obj: dict, where: str = "schedule") -> None:
  """Raises ValueError naming the first bad field: the header, and every answer's commits fit the
  blocks (`block_walk`)."""
  if not isinstance(obj, dict) or obj.get("format") != FORMAT:
    raise ValueError(f"{where}: format: not a {FORMAT!r} file")
  for k in ("block_size", "max_new_tokens"):
    if not isinstance(obj.get(k), int) or obj[k] < 1:
      raise ValueError(f"{where}: {k}: must be an int >= 1, got {obj.get(k)!r}")
  answers = obj.get("answers")
  if not isinstance(answers, list) or not answers:
    raise ValueError(f"{where}: answers: must be a non-empty list")
  for i, a in enumerate(answers):
    c = a.get("commits") if isinstance(a, dict) else None
    if not isinstance(c, list) or not c or not all(isinstance(n, int) and n >= 1 for n in c):
      raise ValueError(f"{where}: answers[{i}].commits: must be a non-empty list of ints >= 1")
    try:
      block_walk(c, obj["block_size"], obj["max_new_tokens"])
    except ValueError as e:
      raise ValueError(f"{where}: answers[{i}].commits: {e}") from None


def block_walk(commits, block_size: int, max_new_tokens: int) -> list[int]:
  """The block each step of a schedule commits in, checking the decoder could run it: a step
  commits inside one block, and a block is finished (every position committed) before the next
  starts; the last block may end early (the answer's EOS). -> [block of step s]."""
  blocks, filled = [], 0
  for s, n in enumerate(commits):
    j = filled // block_size
    if n > (j + 1) * block_size - filled:
      raise ValueError(f"step {s} commits {n} but block {j} has {(j + 1) * block_size - filled} masked "
                       f"positions left (block size {block_size})")
    blocks.append(j)
    filled += n
  if filled > max_new_tokens:
    raise ValueError(f"commits sum to {filled}, more than max_new_tokens {max_new_tokens}")
  return blocks


def nfe(commits, block_size: int, kv_write: str) -> int:
  """Forwards after the prefill of an answer decoded with this schedule: one per denoising step,
  plus one K/V write per block after the first with kv_write 'separate' (block size > 1); AR's
  step 0 is predicted by the prefill."""
  if block_size == 1:
    return len(commits) - 1
  writes = block_walk(commits, block_size, 1 << 30)[-1] if kv_write == "separate" else 0
  return len(commits) + writes


def draw(obj: dict, batch: int, seed: int = 0) -> list[dict]:
  """`batch` answers of a schedule, one per row: drawn by `np.random.default_rng(seed)`, without
  replacement when the file holds at least `batch` answers, with replacement otherwise."""
  answers = obj["answers"]
  idx = np.random.default_rng(seed).choice(len(answers), size=batch, replace=len(answers) < batch)
  return [answers[i] for i in idx]


def forced_commits(schedules, steps: int | None = None) -> np.ndarray:
  """Per-row schedules -> the decoder's `commits` input [B, T + 1] int32: row i's n_s at column s,
  0 after its last step (the end the decoder reads as the row's finish). `steps`: T (default the
  longest schedule); a fixed T lets one compilation serve every draw."""
  longest = max(len(c) for c in schedules)
  t = longest if steps is None else steps
  if t < longest:
    raise ValueError(f"steps ({t}) is fewer than the longest schedule ({longest})")
  out = np.zeros((len(schedules), t + 1), np.int32)
  for i, c in enumerate(schedules):
    out[i, :len(c)] = c
  return out
