"""Stage `sft`: trains the AR teacher (next-token loss on the assistant message) -> `workdir/sft/`.

Reads `config.model` (init: `model.init_from` model dir, or a fresh init of the architecture fields
with `vocab_size` 0 = the tokenizer's size), `config.train` (+ `train.sft`), `config.task` and the
traces stage's output (`workdir/traces/<split>.jsonl`, tokenised by `dgr2_jax.task.pipeline`).
Writes `workdir/sft/model` (`dgr2_jax.model.checkpoint.save_model_dir`, with the tokenizer),
`workdir/sft/train/` (checkpoints, metrics.jsonl, tensorboard) and DONE.json.

While training, `workdir/sft/train/` is the live (resumable) training directory: a killed run
resumes from its latest checkpoint when rerun with the same config (a different config hash wipes
it first). The finished stage is published atomically with the model.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax

from dgr2_jax.model import checkpoint as model_ckpt
from dgr2_jax.model import qwen3
from dgr2_jax.model.config import Qwen3Config
from dgr2_jax.stages import common
from dgr2_jax.stages import contract
from dgr2_jax.stages import traces as traces_stage
from dgr2_jax.task import pipeline
from dgr2_jax.task import tokenizer as tok_lib
from dgr2_jax.train import config as train_config
from dgr2_jax.train import loop, losses


def model_from_config(model_cfg, vocab_size: int | None = None, pad_id=None, eos_id=None, shardings=None):
  """-> (Qwen3Config, params or `fn(rng) -> params`) from `config.model`; `shardings`: see
  `checkpoint.load_model_dir` (several processes: `loop.model_shardings(config)`)."""
  if model_cfg.get("init_from", ""):
    mc, params = model_ckpt.load_model_dir(model_cfg.init_from, shardings=shardings)
    mc = mc.with_runtime(model_cfg)
    return mc, qwen3.to_layout(mc, params)
  fields = {f.name for f in dataclasses.fields(Qwen3Config)}
  kw = {k: v for k, v in model_cfg.items() if k in fields}
  if not kw.get("vocab_size"):
    if vocab_size is None:
      raise ValueError("model.vocab_size is 0 and no tokenizer size is known; set model.vocab_size")
    kw["vocab_size"] = int(vocab_size)
  kw.setdefault("pad_token_id", pad_id)
  kw.setdefault("eos_token_id", eos_id)
  mc = Qwen3Config(**kw)
  return mc, (lambda rng: qwen3.init_params(mc, rng))


def loss_for(mc, sft_section):
  """The SFT step's loss of model `mc` with the weights of `train.sft` (`losses.sft_loss`)."""
  rw, aw = float(sft_section.reasoning_weight), float(sft_section.answer_weight)

  def loss_fn(p, batch, rng):
    del rng
    return losses.sft_loss(mc, p, batch, reasoning_weight=rw, answer_weight=aw)
  return loss_fn


def _hash(config, workdir: str, upstream: dict) -> str:
  return common.config_hash(config.seed, config.model, train_config.hashed(config.train), config.task,
                            [upstream["traces"]], workdir=workdir)


def _build(config, workdir: str, build: contract.Build) -> str:
  config = config.copy_and_resolve_references()  # train.total_steps may be derived below
  train_dir = build.train_dir()

  tok_dir = traces_stage.tokenizer_dir(config, workdir)
  tokenizer = tok_lib.load_tokenizer(tok_dir)
  arrays, counts = traces_stage.load_split_arrays(config, workdir, "train", tokenizer=tokenizer)
  logging.info("sft: %s", counts)
  tc = config.train
  n = len(arrays["prompt_ids"])
  epochs = int(tc.sft.get("epochs", 0))
  if epochs > 0:
    with tc.unlocked():
      tc.total_steps = max(1, epochs * n // int(tc.batch_size))
  batch_iter = pipeline.make_iterator(arrays, int(tc.batch_size), seed=int(config.seed),
                                      field="train.batch_size")

  mc, params = model_from_config(config.model, vocab_size=len(tokenizer),
                                 pad_id=tokenizer.pad_token_id, eos_id=tokenizer.convert_tokens_to_ids(tok_lib.IM_END),
                                 shardings=loop.model_shardings(config))
  state = loop.train(config, train_dir, params=params, loss_fn=loss_for(mc, tc.sft), batch_iter=batch_iter,
                     desc="sft")

  with build.publish({"steps": int(tc.total_steps), "examples": counts}) as tmp:
    model_ckpt.save_model_dir(os.path.join(tmp, "model"), mc, state["params"], tokenizer_src=tok_dir)
    if jax.process_index() == 0:
      os.replace(train_dir, os.path.join(tmp, "train"))  # keep the history with the result
  return build.out


STAGE = contract.Stage(name="sft", reads=("traces",), hashed=_hash, build=_build)


def run(config, workdir: str) -> str:
  """Trains (or reuses) `workdir/sft`; returns its path."""
  return contract.run(STAGE, config, workdir)
