"""What every consumer of a trained model needs to decode with it, below the pipeline's stages:
a model directory loaded onto the devices once, the run's `DecodeConfig` from the config, and the
speculative pair as a `generate_fn`. Eval, bench, generate, OPD and the server share these.
The `decode` section's defaults and checks are decode/config.py's.
"""

from __future__ import annotations

from dgr2_jax import fileio
from dgr2_jax.decode import sampler
from dgr2_jax.decode.config import DecodeConfig, decode_config_from


def decode_config(config, tids, model_config=None) -> DecodeConfig:
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
  return decode_config_from(dec, **ids)


def load_on_device(path: str, model_section=None, models: dict | None = None, mesh=None):
  """(config with the run's runtime fields, params on the device) of a model directory.

  `mesh` (decode/mesh.py `from_config`; None = the default device): the params are placed in the
  decode mesh's shardings slice by slice from the host copy (heads, MLP and vocabulary split over
  its tensor axis, replicated over data), never as a whole copy on each device first. This is the
  one place where a model meets its mesh. `models`, a dict the caller keeps across calls of one
  config (bench: all its rows), holds each directory loaded once: bench keeps every row's decode
  calls until it times them side by side, and a copy per row would not fit at Qwen3-8B."""
  if models is not None and path in models:
    return models[path]
  import jax
  from dgr2_jax.decode import mesh as dmesh
  from dgr2_jax.model.checkpoint import load_model_dir
  cfg, params = load_model_dir(path)
  # once, not with every decode call
  params = dmesh.put_params(mesh, params) if mesh is not None else jax.device_put(params)
  out = cfg.with_runtime(model_section), params
  if models is not None:
    models[path] = out
  return out


def speculative_generate(verifier_path: str, model_section=None, models: dict | None = None, mesh=None):
  """A `generate_fn` (sampler.generate's signature) decoding speculatively with the verifier, on
  `mesh` when given (the drafter's params placed on it too: `load_on_device(..., mesh)`)."""
  from dgr2_jax.decode import speculative
  vcfg, vparams = load_on_device(verifier_path, model_section, models, mesh)

  def fn(model_config, params, prompts, dcfg, rng=None, max_prompt_len=None, return_device=False):
    return speculative.generate(model_config, params, vcfg, vparams, prompts, dcfg, rng, max_prompt_len,
                                return_device=return_device, mesh=mesh)
  return fn


def threshold_generate(mesh=None):
  """`sampler.generate` on `mesh` (None: the default device), with sampler.generate's signature."""
  import functools
  return functools.partial(sampler.generate, mesh=mesh) if mesh is not None else sampler.generate
