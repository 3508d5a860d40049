"""What every consumer of a trained model needs to decode with it, below the pipeline's stages:
a model directory loaded onto the devices once, the run's `DecodeConfig` from the config, and the
speculative pair as a `generate_fn`. Eval, bench, generate, OPD and the server share these.
"""

from __future__ import annotations

from dgr2_jax import fileio
from dgr2_jax.decode import sampler


def decode_config(config, tids, model_config=None) -> sampler.DecodeConfig:
  """`DecodeConfig` from `config.decode`; EOS/mask ids from the model config when it has them,
  else from the tokenizer's `TokenIds` `tids`; pad from the tokenizer; `max_new_tokens` defaults
  to `config.task.response_len`."""
  dec = fileio.to_plain(config.decode) if "decode" in config else {}
  dec.setdefault("max_new_tokens", config.task.response_len)
  eos = tuple(getattr(model_config, "eos_ids", None) or (tids.eos_id,))
  mask = getattr(model_config, "mask_token_id", None)
  ids = dict(eos_ids=tuple(dec.get("eos_ids") or eos),
             mask_token_id=dec.get("mask_token_id") or (mask if mask is not None else tids.mask_id),
             pad_id=tids.pad_id)
  return sampler.decode_config_from(dec, **ids)


def load_on_device(path: str, model_section=None, models: dict | None = None):
  """(config with the run's runtime fields, params on the device) of a model directory.

  `models`, a dict the caller keeps across calls of one config (bench: all its rows), holds each
  directory loaded once: bench keeps every row's decode calls until it times them side by side,
  and a copy per row would not fit at Qwen3-8B."""
  if models is not None and path in models:
    return models[path]
  import jax
  from dgr2_jax.model.checkpoint import load_model_dir
  cfg, params = load_model_dir(path)
  out = cfg.with_runtime(model_section), jax.device_put(params)   # once, not with every decode call
  if models is not None:
    models[path] = out
  return out


def speculative_generate(verifier_path: str, model_section=None, models: dict | None = None):
  """A `generate_fn` (sampler.generate's signature) decoding speculatively with the verifier."""
  from dgr2_jax.decode import speculative
  vcfg, vparams = load_on_device(verifier_path, model_section, models)

  def fn(model_config, params, prompts, dcfg, rng=None, max_prompt_len=None, return_device=False):
    return speculative.generate(model_config, params, vcfg, vparams, prompts, dcfg, rng, max_prompt_len,
                                return_device=return_device)
  return fn
