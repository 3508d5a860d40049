"""Where a diffusion model's gap to its AR teacher lives: the reasoning block or the answer block.

  python benchmarks/gap_by_block.py --config=configs/demo.py --workdir=/tmp/dgr2_demo \
      [--stages=cft,opd] [--split=valid] [--max_examples=0] [--out=benchmarks/results/gap_by_block_demo.json] \
      [--docs=docs/results.md]
  python benchmarks/gap_by_block.py --render=benchmarks/results/gap_by_block_demo.json --docs=docs/results.md

With `task.answer_block` = B the response is a reasoning block (its first B tokens: the rationale,
which names the pick) and then the answer, which starts a block of its own. Each model's greedy
response on the split's users (target listed) is cut after the first B tokens and the rest is
written again by the other model from there, so each user gets four responses:

  reasoning / answer:  teacher / teacher (the teacher itself)   student / student (the student)
                       teacher / student                        student / teacher

The writer of the answer reads the other's reasoning block as part of its prompt: causally, where
its own decoding reads the block it wrote bidirectionally (block-causal attention) from the same
tokens. For the AR teacher the two are the same (tests/test_gap_by_block.py); for a diffusion
student they are not, so a fifth row, `student / student (re-read)`, continues the student after
its own reasoning block read that way: its distance from `student / student` is what the re-reading
alone moves, the yardstick for `teacher / student`.

Recall@1 of each against the teacher's on the same users, with paired bootstrap 95% intervals.
`teacher / student` below the teacher is what the student's answer block loses given the
teacher's reasoning; `student / teacher` below it is what the student's reasoning costs even when
the teacher writes the answer (what distilling the answer alone cannot give back). The teacher
decodes one token a step (as its RL rollouts); a student with the decode section's settings at
temperature 0 (as the stages' validation curves). An output whose reasoning block already ends in
EOS keeps it as it is. Models: `workdir/<stage>/model` for each of `--stages`; the teacher is the
chain's AR teacher. `--docs` writes the tables, with the commit, command and machine, between the
doc's `<!-- gap-by-block-table:<name> -->` markers (name: the config file's stem); `--render`
rewrites them from a recorded JSON without running anything.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

import jax
import numpy as np
from absl import app
from absl import flags
from ml_collections import config_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from dgr2_jax import chain  # noqa: E402
from dgr2_jax import main as main_lib  # noqa: E402
from dgr2_jax import results  # noqa: E402
from dgr2_jax.decode import sampler  # noqa: E402
from dgr2_jax.stages import on_policy  # noqa: E402
from dgr2_jax.stages import teacher_rl  # noqa: E402
from dgr2_jax.task import diagnostics  # noqa: E402
from dgr2_jax.train import rollouts  # noqa: E402

def define_flags() -> dict:
  """The command line's flags, defined when run as a script (so that importing this module, as its
  tests do beside other benchmarks, defines none)."""
  return dict(
      config=config_flags.DEFINE_config_file("config", os.path.join(REPO, "configs", "demo.py"), "pipeline config"),
      workdir=flags.DEFINE_string("workdir", "/tmp/dgr2_demo", "a pipeline workdir with the teacher and students"),
      stages=flags.DEFINE_list("stages", ["cft", "opd"], "the diffusion model stages to split"),
      split=flags.DEFINE_string("split", "valid", "held-out split"),
      max_examples=flags.DEFINE_integer("max_examples", 0, "users (0 = every user whose target is listed)"),
      out=flags.DEFINE_string("out", "", "JSON path ('' = print only)"),
      docs=flags.DEFINE_string("docs", "", "a doc whose gap-by-block table to rewrite ('' = none)"),
      render=flags.DEFINE_string("render", "", "a recorded JSON to render into --docs (runs nothing)"))


@dataclasses.dataclass(frozen=True)
class Writer:
  """A model and how it decodes greedily."""
  config: object
  params: object
  decode: sampler.DecodeConfig


def writer(config, model_dir: str, tids, ar: bool) -> Writer:
  mc, params = on_policy.load_policy(config, model_dir)
  dc = dataclasses.replace(on_policy.rollout_decode_config(config, tids, mc, 0.0), temperature=0.0)
  if ar:
    dc = dataclasses.replace(dc, **teacher_rl.AR_ROLLOUTS)
  return Writer(mc, params, dc)


def respond(w: Writer, prompt_ids, prompt_len) -> np.ndarray:
  """Greedy responses [n, R] (R = the decode's max_new_tokens) of left-padded prompts [n, P]."""
  roll = rollouts.sample(w.config, w.params, prompt_ids, prompt_len, w.decode, jax.random.PRNGKey(0), 1)
  return np.asarray(roll["tokens"])


def continue_after(w: Writer, prompt_ids, prompt_len, head) -> np.ndarray:
  """`w`'s greedy responses [n, R] whose first B tokens are `head` [n, B] (another writer's or its
  own): each prompt with its head is decoded again as a prompt, for the remaining R - B tokens. B is
  a multiple of the block size, so the continuation's blocks are the full response's; the head is
  read causally, as prompt tokens are (exact for an AR writer; module docstring)."""
  prompt_ids, head = np.asarray(prompt_ids), np.asarray(head, np.int32)
  (n, p), b, r = prompt_ids.shape, head.shape[1], w.decode.max_new_tokens
  if b % w.decode.block_size or not 0 < b < r:
    raise ValueError(f"the reasoning block ({b} tokens) must be a multiple of the block size "
                     f"({w.decode.block_size}) and shorter than the response ({r})")
  rows = [np.concatenate([prompt_ids[i, p - int(prompt_len[i]):], head[i]]) for i in range(n)]
  ids, lens = sampler.left_pad([list(x) for x in rows], p + b, w.decode.pad_id)
  tail = respond(dataclasses.replace(w, decode=dataclasses.replace(w.decode, max_new_tokens=r - b)), ids, lens)
  return np.concatenate([head, tail], axis=1)


def hits(tokens, eos_ids, tokenizer, prompts, sids) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Per user: hit at 1, valid answer, first pick (-1 if invalid) of responses [n, R], judged as the
  validation curves judge (`on_policy.judge`: through the first EOS; no EOS = unfinished)."""
  ends = [[j for j, t in enumerate(row) if int(t) in eos_ids] for row in tokens]
  output_ids = [[int(t) for t in row[:e[0] + 1]] if e else [] for row, e in zip(tokens, ends)]
  return tuple(np.array(x) for x in on_policy.judge(output_ids, [bool(e) for e in ends], prompts, tokenizer, sids))


def split_gap(teacher: Writer, student: Writer, prompts: dict, b: int, score) -> dict:
  """The responses' rows: {'teacher/teacher', 'student/student', 'teacher/student',
  'student/teacher', 'student/student (re-read)'} -> `score(tokens)` (hits, valid, first picks)."""
  ids, lens = prompts["prompt_ids"], prompts["prompt_len"]
  own = {"teacher": respond(teacher, ids, lens), "student": respond(student, ids, lens)}
  w = {"teacher": teacher, "student": student}
  out = {f"{k}/{k}": score(v) for k, v in own.items()}
  for rs, ans, name in (("teacher", "student", "teacher/student"), ("student", "teacher", "student/teacher"),
                        ("student", "student", "student/student (re-read)")):
    head = own[rs][:, :b]
    done = np.isin(head, list(w[ans].decode.eos_ids)).any(axis=1)   # the reasoning block already ended
    swapped = continue_after(w[ans], ids, lens, head)
    swapped[done] = own[rs][done]
    out[name] = score(swapped)
  return out


def summary(cells: dict) -> dict:
  t_hits, _, t_first = cells["teacher/teacher"]
  rows = {}
  for k, (h, v, first) in cells.items():
    lo, hi = diagnostics.paired_bootstrap_ci(t_hits, h)
    rows[k] = {"recall@1": float(h.mean()), "valid_rate": float(v.mean()),
               "vs_teacher": float(h.mean() - t_hits.mean()), "vs_teacher_ci95": [lo, hi],
               "first_pick_as_teacher": float(np.mean(first == t_first))}
  return rows


def render(stage: str, n: int, rows: dict) -> str:
  lines = [f"The `{stage}` model (n = {n:,} users):", "",
           "| reasoning / answer | recall@1 | vs teacher [95% CI] | valid | first pick as the teacher's |",
           "|---|---|---|---|---|"]
  for k, r in rows.items():
    lo, hi = r["vs_teacher_ci95"]
    lines.append(f"| {k} | {r['recall@1']:.4f} | {r['vs_teacher']:+.4f} [{lo:+.4f}, {hi:+.4f}] | "
                 f"{r['valid_rate']:.3f} | {r['first_pick_as_teacher']:.3f} |")
  return "\n".join(lines)


def render_all(record: dict) -> str:
  return "\n\n".join(render(stage, record["n"], rows) for stage, rows in record["stages"].items())


def write_docs(record: dict, doc: str, json_path: str) -> None:
  """Each stage's table, after a sentence naming the commit, command and machine, between the doc's
  `<!-- gap-by-block-table:<name> -->` markers (`results.write_marked_table`)."""
  head = (f"{results.record_source(record, json_path)} The {record['split']} split; the reasoning block is the "
          f"first {record['reasoning_tokens']} response tokens; paired bootstrap 95% intervals over users.")
  body = head + "\n\n" + render_all(record)
  results.write_marked_table(doc, "gap-by-block", record.get("name", "demo"), body, "gap_by_block")


def main(argv, f: dict):
  del argv
  main_lib.quiet_logs(flags.FLAGS.verbosity if flags.FLAGS["verbosity"].present else -1)
  opts = {k: v.value for k, v in f.items() if k != "config"}
  results.benchmark_main(f, lambda: measure(f["config"].value, f["workdir"].value, opts),
                         render_all, write_docs)


def measure(config, workdir: str, opts: dict) -> dict:
  """The record of every stage's split on the split (`opts`: the flags' values)."""
  b = int(config.task.get("answer_block", 0))
  if not b:
    raise SystemExit("gap_by_block: task.answer_block is 0: the answer has no block of its own to split at")
  vt = on_policy.task_setup(config, workdir, opts["split"])
  n = len(vt["prompts"]["prompt_ids"])
  n = min(opts["max_examples"], n) if opts["max_examples"] else n
  prompts = {k: v[:n] for k, v in vt["prompts"].items()}
  teacher = writer(config, chain.teacher_model_dir(config, workdir), vt["tids"], ar=True)
  record = {**results.record_head("benchmarks/gap_by_block.py"), "split": opts["split"], "n": n,
            "reasoning_tokens": b, "stages": {}}
  for stage in opts["stages"]:
    student = writer(config, os.path.join(workdir, stage, "model"), vt["tids"], ar=False)
    eos = set(student.decode.eos_ids) | set(teacher.decode.eos_ids)
    cells = split_gap(teacher, student, prompts, b, lambda t: hits(t, eos, vt["tokenizer"], prompts, vt["sids"]))
    record["stages"][stage] = summary(cells)
  return record


if __name__ == "__main__":
  _flags = define_flags()
  app.run(functools.partial(main, f=_flags))
