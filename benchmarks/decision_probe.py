"""Does a model still make the trace's decision? The first pick, read teacher-forced.

  python benchmarks/decision_probe.py --config=configs/beauty_cpu.py --config.data.dir=PATH/amazon_beauty \
      --workdir=WORKDIR [--models=cft,lr1e-3=DIR/model] [--splits=train,valid] [--max_examples=2400] \
      [--out=benchmarks/results/decision_probe_beauty_cpu.json] [--docs=docs/results.md]
  python benchmarks/decision_probe.py --render=benchmarks/results/decision_probe_beauty_cpu.json --docs=docs/results.md

The rationale names the first pick as a candidate number after ' #' (`Often bought next #3. So #3
goes first`). Each user's trace (the rule's reasoning, traces/<split>.jsonl) is fed up to its first
candidate number, and each model's most likely token there (the mask token excluded) is compared
with the trace's number:
  * the AR teacher reads the prefix causally (teacher forcing);
  * a block-diffusion model reads the left-to-right canvas of the first block: the prefix visible,
    every later position of the block masked (what its decoder sees when it writes the number in
    order).
No decoding: this separates what a model knows from what its decoder does with it. Near 1 on the
users it trained on (`train`) and below it on `valid` is generalisation; below it on `train` too is
underfitting. Users whose first block names no candidate number are left out. The users are the
first `--max_examples` of a fixed shuffle (seed 0) of the split.

`--models`: stage names (`workdir/<stage>/model`) or `label=model_dir`; the chain's AR teacher is
always the first row. `--docs` writes the table, with the commit, command and machine, between the
doc's `<!-- decision-probe-table:<name> -->` markers (name: the config file's stem); `--render`
rewrites it from a recorded JSON without running anything.
"""

from __future__ import annotations

import functools
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from absl import flags
from ml_collections import config_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from dgr2_jax import chain  # noqa: E402
from dgr2_jax import main as main_lib  # noqa: E402
from dgr2_jax import results  # noqa: E402
from dgr2_jax.model import qwen3, streams  # noqa: E402
from dgr2_jax.stages import on_policy  # noqa: E402
from dgr2_jax.stages import traces as traces_stage  # noqa: E402
from dgr2_jax.task import prompts as prompts_lib  # noqa: E402
from dgr2_jax.task import tokenizer as tok_lib  # noqa: E402
from dgr2_jax.train import losses  # noqa: E402


def define_flags() -> dict:
  """The command line's flags, defined when run as a script (importing this module defines none)."""
  return dict(
      config=config_flags.DEFINE_config_file("config", os.path.join(REPO, "configs", "demo.py"), "pipeline config"),
      workdir=flags.DEFINE_string("workdir", "/tmp/dgr2_demo", "a pipeline workdir with the teacher and students"),
      models=flags.DEFINE_list("models", ["cft"], "diffusion models: stage names or label=model_dir"),
      splits=flags.DEFINE_list("splits", ["train", "valid"], "trace splits to read"),
      max_examples=flags.DEFINE_integer("max_examples", 2400, "users per split (0 = all)"),
      batch=flags.DEFINE_integer("batch", 64, "users per forward"),
      out=flags.DEFINE_string("out", "", "JSON path ('' = print only)"),
      docs=flags.DEFINE_string("docs", "", "a doc whose decision-probe table to rewrite ('' = none)"),
      render=flags.DEFINE_string("render", "", "a recorded JSON to render into --docs (runs nothing)"))


def first_choice_index(response_ids: np.ndarray, choice_id: int, block_size: int) -> np.ndarray:
  """[n] response index of the first candidate number (the token after the first `choice_id`,
  ' #') when it lies in the first block, else -1."""
  out = np.full(len(response_ids), -1, np.int64)
  for i, row in enumerate(np.asarray(response_ids)):
    at = np.flatnonzero(row[:block_size - 1] == choice_id)
    if len(at):
      out[i] = at[0] + 1
  return out


@functools.partial(jax.jit, static_argnames=("model_config", "block_size"))
def _diffusion_picks(model_config, params, prompt, prompt_len, response, index, block_size: int):
  # The first block's left-to-right canvas: response[:index] visible, the rest of the block masked.
  # One segment (block 0), so later blocks take no part.
  b = response.shape[0]
  at = jnp.arange(block_size)[None]
  canvas = jnp.where(at >= index[:, None], model_config.mask_token_id, response[:, :block_size])  # [b,B]
  pred_seg = jnp.zeros(response.shape, jnp.int32)
  hid = streams.response_hidden(model_config, params, prompt, prompt_len, response, canvas.reshape(b, 1, block_size),
                                np.zeros(1, np.int32), pred_seg, block_size)   # [b,R,E]
  return _argmax_at(model_config, params, hid, index)


@functools.partial(jax.jit, static_argnames=("model_config",))
def _ar_picks(model_config, params, prompt, prompt_len, response, index):
  hid = losses.response_hidden(model_config, params, {"prompt_ids": prompt, "prompt_len": prompt_len,
                                                      "response_ids": response})   # [b,R,E], causal
  return _argmax_at(model_config, params, hid, index)


def _argmax_at(model_config, params, hid, index):
  h = jnp.take_along_axis(hid, index[:, None, None], axis=1)[:, 0]   # [b,E]
  logits = qwen3.lm_head(model_config, params, h).astype(jnp.float32)   # [b,V]
  if model_config.mask_token_id is not None:
    logits = logits.at[:, model_config.mask_token_id].set(-jnp.inf)
  return jnp.argmax(logits, -1)


def picks(model_config, params, prompt, prompt_len, response, index, batch: int = 64) -> np.ndarray:
  """[n] the model's most likely token at response index `index` [n] (>= 1), teacher-forced on
  `response` [n,R] after left-padded `prompt` [n,P]: causally for an AR model, on the first block's
  left-to-right canvas for a block-diffusion one (`model_config.attention`)."""
  n = len(index)
  out = np.zeros(n, np.int64)
  ar = model_config.attention != "block_causal"
  for lo in range(0, n, batch):
    rows = np.arange(lo, min(n, lo + batch))
    pad = np.concatenate([rows, np.repeat(rows[-1:], batch - len(rows))])   # one compiled shape
    args = (jnp.asarray(prompt[pad]), jnp.asarray(prompt_len[pad]), jnp.asarray(response[pad], jnp.int32),
            jnp.asarray(index[pad], jnp.int32))
    got = (_ar_picks(model_config, params, *args) if ar
           else _diffusion_picks(model_config, params, *args, block_size=int(model_config.block_size)))
    out[rows] = np.asarray(got)[:len(rows)]
  return out


def probe_split(config, workdir: str, split: str, models: dict, max_examples: int, batch: int) -> dict:
  """{label: {"agree", "n", "se"}} for one split: the share of users whose trace's first candidate
  number is each model's most likely token there."""
  tok = tok_lib.load_tokenizer(traces_stage.tokenizer_dir(config, workdir))
  choice = prompts_lib.choice_after_id(tok)
  if choice < 0:
    raise SystemExit(f"decision_probe: ' #' is not one token of this tokenizer ({prompts_lib.encode(tok, ' #')})")
  arrays, _ = traces_stage.load_split_arrays(config, workdir, split, tokenizer=tok)
  order = np.random.default_rng(0).permutation(len(arrays["prompt_ids"]))
  order = order[:max_examples] if max_examples else order
  bs = int(config.cft.block_size)
  index = first_choice_index(arrays["response_ids"][order], choice, bs)
  keep = order[index > 0]
  index = index[index > 0]
  want = arrays["response_ids"][keep, index]
  rows = {}
  for label, (mc, params) in models.items():
    got = picks(mc, params, arrays["prompt_ids"][keep], arrays["prompt_len"][keep], arrays["response_ids"][keep],
                index, batch)
    p = float(np.mean(got == want))
    rows[label] = {"agree": p, "n": int(len(keep)), "se": math.sqrt(p * (1 - p) / max(len(keep), 1))}
  return rows


def render(record: dict) -> str:
  splits = record["splits"]
  lines = ["| model | " + " | ".join(f"{s} users" for s in splits) + " |", "|---" * (len(splits) + 1) + "|"]
  labels = list(next(iter(record["probe"].values())))
  for label in labels:
    cells = [f"{record['probe'][s][label]['agree']:.4f} (SE {record['probe'][s][label]['se']:.4f})" for s in splits]
    lines.append(f"| {label} | " + " | ".join(cells) + " |")
  ns = ", ".join(f"{record['probe'][s][labels[0]]['n']:,} {s}" for s in splits)
  lines += ["", f"Users: {ns} (whose trace names a candidate number in its first block)."]
  return "\n".join(lines)


def write_docs(record: dict, doc: str, json_path: str) -> None:
  head = (f"{results.record_source(record, json_path)} The share of users whose trace's first candidate "
          "number is the model's most likely token there, read teacher-forced (the teacher causally, a "
          "diffusion model on the first block's left-to-right canvas).")
  results.write_marked_table(doc, "decision-probe", record.get("name", "demo"), head + "\n\n" + render(record),
                             "decision_probe")


def load_models(config, workdir: str, specs) -> tuple[dict, dict]:
  """({label: (model config, params)}, {label: what it is}) for the teacher and `specs`."""
  teacher = chain.teacher_model_dir(config, workdir)
  models, where = {"teacher": on_policy.load_policy(config, teacher)}, {"teacher": "the chain's AR teacher"}
  for spec in specs:
    label, _, path = spec.partition("=")
    models[label] = on_policy.load_policy(config, path or os.path.join(workdir, label, "model"))
    where[label] = path or f"WORKDIR/{label}/model"
  return models, where


def measure(config, workdir: str, f: dict) -> dict:
  record = {**results.record_head("benchmarks/decision_probe.py"), "splits": list(f["splits"].value), "probe": {}}
  models, record["models"] = load_models(config, workdir, f["models"].value)
  for split in record["splits"]:
    record["probe"][split] = probe_split(config, workdir, split, models, f["max_examples"].value, f["batch"].value)
  return record


def main(argv, f: dict):
  del argv
  main_lib.quiet_logs(flags.FLAGS.verbosity if flags.FLAGS["verbosity"].present else -1)
  results.benchmark_main(f, lambda: measure(f["config"].value, f["workdir"].value, f), render, write_docs)


if __name__ == "__main__":
  _flags = define_flags()
  app.run(functools.partial(main, f=_flags))
