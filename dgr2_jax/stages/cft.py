"""Stage `cft`: conversion fine-tuning of the block-diffusion copy of the AR teacher -> `workdir/cft/`.

Starts from `config.cft.init_from` ('' = the previous model stage's: `workdir/convert/model`, the naive
conversion, or `workdir/sft/model`, the AR teacher, when convert is not in the pipeline), converts it without
touching the weights (`Qwen3Config.as_block_diffusion(cft.block_size)`; the mask token is the
tokenizer's `<|mask|>`), and trains `dgr2_jax.train.cft.cft_loss` with the shared loop on the traces
stage's training split. `cft.epochs` (paper: 3) sets the step count; `cft.lr` (0 = train.optimizer
.peak_lr) and `cft.batch_size` (0 = train.batch_size) override the training section for this stage.
Writes `workdir/cft/model` (block-diffusion config) and the training history `workdir/cft/train/`.
"""

from __future__ import annotations

import logging
import os

import jax

from dgr2_jax import chain
from dgr2_jax.model import checkpoint as model_ckpt
from dgr2_jax.model import qwen3
from dgr2_jax.stages import common
from dgr2_jax.stages import contract
from dgr2_jax.stages import traces as traces_stage
from dgr2_jax.task import pipeline
from dgr2_jax.task import prompts as prompts_lib
from dgr2_jax.task import tokenizer as tok_lib
from dgr2_jax.train import config as train_config
from dgr2_jax.train import cft, loop


def stage_train_config(config, workdir_stage_cfg, n_examples: int):
  """config copy whose `train` section carries this stage's lr / batch size / step count."""
  config = config.copy_and_resolve_references()
  sc = workdir_stage_cfg
  with config.unlocked():
    if sc.get("lr", 0):
      config.train.optimizer.peak_lr = float(sc.lr)
    if sc.get("batch_size", 0):
      config.train.batch_size = int(sc.batch_size)
    if sc.get("steps", 0):
      config.train.total_steps = int(sc.steps)
    elif sc.get("epochs", 0):
      config.train.total_steps = max(1, int(sc.epochs) * n_examples // int(config.train.batch_size))
  return config


def choice_after_id(tokenizer) -> int:
  """The one token of ' #' that precedes a candidate number in the reasoning (`cft.choice_weight`)."""
  choice = prompts_lib.choice_after_id(tokenizer)
  if choice < 0:
    raise ValueError(f"cft.choice_weight needs ' #' to be one token; this tokenizer gives "
                     f"{prompts_lib.encode(tokenizer, ' #')}")
  return choice


def loss_for(cc, mc, mask_id: int, choice_id: int = -1):
  """The CFT step's loss (`cft.cft_loss`) of the block-diffusion model `mc` with the settings of
  section `cc`; `choice_id`: the token before a candidate number (`choice_after_id`), read only
  when cft.choice_weight != 1."""
  kw = dict(eps=float(cc.eps), weighting=str(cc.loss_weighting),
            reasoning_weight=float(cc.reasoning_weight), answer_weight=float(cc.answer_weight),
            complementary=bool(cc.complementary_mask))
  if float(cc.get("choice_weight", 1.0)) != 1.0:
    kw.update(choice_weight=float(cc.choice_weight), choice_after_id=int(choice_id))
  options = cft.LossOptions(**kw)
  bs = int(cc.block_size)

  def loss_fn(p, batch, rng):
    return cft.cft_loss(mc, p, batch, rng, block_size=bs, mask_id=int(mask_id), options=options)
  return loss_fn


def _source(config, workdir: str) -> tuple[str, str]:
  """(the previous model stage, the model to convert: `cft.init_from` or that stage's model)."""
  prev = chain.previous_model_stage(config, "cft")
  return prev, config.cft.get("init_from", "") or chain.model_dir(workdir, prev)


def _hash(config, workdir: str, upstream: dict) -> str:
  prev, init_from = _source(config, workdir)
  up = [upstream["traces"], contract.upstream(workdir, [prev])[prev]]
  return common.config_hash(config.seed, config.cft, train_config.hashed(config.train), config.task, init_from, up,
                            workdir=workdir)


def _build(config, workdir: str, build: contract.Build) -> str:
  cc = config.cft
  prev, init_from = _source(config, workdir)
  if not os.path.isdir(init_from):
    raise FileNotFoundError(f"cft: the model to convert does not exist: {init_from} (run the {prev} stage, "
                            "or set cft.init_from)")
  train_dir = build.train_dir()

  tok_dir = traces_stage.tokenizer_dir(config, workdir)
  tokenizer = tok_lib.load_tokenizer(tok_dir)
  ids = tok_lib.token_ids(tokenizer)
  # Several processes: read straight into the training shardings (no whole copy per process).
  mc, params = model_ckpt.load_model_dir(init_from, shardings=loop.model_shardings(config))
  mask_id = mc.mask_token_id if mc.mask_token_id is not None else ids.mask_id
  if mask_id is None:
    raise ValueError(f"cft: no mask token: the tokenizer in {tok_dir} has no <|mask|> and the model config "
                     "records no mask_token_id (convert the checkpoint with --mask_token)")
  bs = int(cc.block_size)
  mc = mc.as_block_diffusion(bs, mask_id).with_runtime(config.get("model"))
  params = qwen3.to_layout(mc, params)
  arrays, counts = traces_stage.load_split_arrays(config, workdir, "train", tokenizer=tokenizer)
  n = len(arrays["prompt_ids"])
  tconfig = stage_train_config(config, cc, n)
  logging.info("cft: %d examples, %d steps, block size %d", n, tconfig.train.total_steps, bs)
  batch_iter = pipeline.make_iterator(arrays, int(tconfig.train.batch_size), seed=int(config.seed),
                                      field="train.batch_size")
  choice = choice_after_id(tokenizer) if float(cc.get("choice_weight", 1.0)) != 1.0 else -1
  loss_fn = loss_for(cc, mc, int(mask_id), choice)
  state = loop.train(tconfig, train_dir, params=params, loss_fn=loss_fn, batch_iter=batch_iter, desc="cft")
  with build.publish({"steps": int(tconfig.train.total_steps), "examples": counts}) as tmp:
    model_ckpt.save_model_dir(os.path.join(tmp, "model"), mc, state["params"], tokenizer_src=tok_dir)
    if jax.process_index() == 0:
      os.replace(train_dir, os.path.join(tmp, "train"))
  return build.out


# Reads the traces and (a chain stage) the model it converts.
STAGE = contract.Stage(name="cft", reads=("traces",), chain=True, hashed=_hash, build=_build)


def run(config, workdir: str) -> str:
  """Trains (or reuses) `workdir/cft`; returns its path."""
  return contract.run(STAGE, config, workdir)
