"""Stage `convert`: the weight-lossless (naive) conversion of the AR teacher to block diffusion.

Reads `workdir/sft/model` (the model stage before `convert`, see `common.previous_model_dir`)
and writes `workdir/convert/model`: the same weight files, byte for byte (hard links where the
filesystem allows, else copies), and a `config.json` whose only change is the "dgr2" block of
`Qwen3Config.as_block_diffusion(config.cft.block_size)`: block size, mask token id and
block-causal attention. The mask token is the model config's, else the model dir tokenizer's
`<|mask|>`; neither => a clear error. Nothing is trained here.
"""

from __future__ import annotations

import json
import os
import shutil

from dgr2_jax import chain
from dgr2_jax.model import checkpoint
from dgr2_jax.model.config import Qwen3Config
from dgr2_jax.stages import common
from dgr2_jax.stages import contract
from dgr2_jax.task import tokenizer as tok_lib

CONFIG_FILE = "config.json"
MASK_TOKEN = "<|mask|>"


def _mask_token_id(src: str, model_config) -> int:
  if model_config.mask_token_id is not None:
    return int(model_config.mask_token_id)
  if checkpoint.has_tokenizer(src):
    vocab = tok_lib.load_tokenizer(src).get_vocab()
    if MASK_TOKEN in vocab:
      return int(vocab[MASK_TOKEN])
  raise ValueError(f"{src}: no mask token (config.json has no dgr2.mask_token_id and the "
                   f"tokenizer has no {MASK_TOKEN}); convert the checkpoint with --mask_token")


def _link_or_copy(src: str, dst: str) -> None:
  try:
    os.link(src, dst)
  except OSError:
    shutil.copy2(src, dst)


def convert_dir(src: str, dst: str, block_size: int) -> dict:
  """Writes `dst` (which must not exist) from model dir `src`; returns the new config.json dict."""
  cfg_file = os.path.join(src, CONFIG_FILE)
  if not os.path.isfile(cfg_file):
    raise FileNotFoundError(f"missing {CONFIG_FILE} in {src}")
  with open(cfg_file) as f:
    d = json.load(f)
  try:
    mc = Qwen3Config.from_hf_dict(d)
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"{cfg_file}: {e}") from None
  new = mc.as_block_diffusion(int(block_size), _mask_token_id(src, mc))
  # config.json is written fresh (never through a hard link into the source directory).
  shutil.copytree(src, dst, copy_function=_link_or_copy,
                  ignore=lambda d_, names: [CONFIG_FILE] if os.path.samefile(d_, src) else [])
  out = dict(d)
  out["dgr2"] = new.to_hf_dict()["dgr2"]
  with open(os.path.join(dst, CONFIG_FILE), "w") as f:
    json.dump(out, f, indent=2)
    f.write("\n")
  return out


def _hash(config, workdir: str, upstream: dict) -> str:
  del upstream  # its source is the chain's previous model, whichever stage that is
  common.previous_model_dir(config, workdir, "convert")   # FileNotFoundError when not built
  src_stage = chain.previous_model_stage(config, "convert")
  return common.config_hash({"block_size": int(config.cft.block_size)},
                            contract.upstream(workdir, [src_stage])[src_stage], workdir=workdir)


def _build(config, workdir: str, build: contract.Build) -> str:
  src = common.previous_model_dir(config, workdir, "convert")
  block = int(config.cft.block_size)
  with build.publish({"stage": "convert", "source": src, "block_size": block}) as tmp:
    d = convert_dir(src, os.path.join(tmp, "model"), block)
  print(f"convert: {src} -> {os.path.join(build.out, 'model')} (block_size {block}, mask token id "
        f"{d['dgr2']['mask_token_id']})", flush=True)
  return build.out


STAGE = contract.Stage(name="convert", chain=True, hashed=_hash, build=_build, host_only=True)


def run(config, workdir: str) -> str:
  """Converts (or reuses) `workdir/convert`; returns its path."""
  return contract.run(STAGE, config, workdir)
