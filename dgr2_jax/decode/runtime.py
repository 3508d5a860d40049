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


def weight_dtype(config) -> str:
  """`config.decode.weight_dtype` ('' = the compute dtype): how `load_on_device` prepares a model."""
  return str(config.get("decode", {}).get("weight_dtype", "") or "")


def prepare_on_host(model_config, params, weight_dtype: str = ""):
  """`qwen3.decode_params` of `params` computed on the host (the CPU backend) -> host numpy arrays:
  per layer, in `model_config`'s compute dtype, q/k/v and gate/up fused, kernels in `weight_dtype`.

  Placed after this, a device holds only what the decoder reads: one copy in the compute dtype (a
  quarter of an f32 checkpoint's bytes with float8 kernels, half at bf16), and a decode call finds
  the tree prepared (`decode_params` is idempotent) instead of building a fused, cast copy inside
  its program beside the checkpoint's. Done on the host, so the fused columns are placed by the
  mesh's rules like any other parameter, slice by slice."""
  import contextlib

  import jax
  import numpy as np
  from dgr2_jax.model import qwen3
  try:
    host = jax.default_device(jax.local_devices(backend="cpu")[0])
  except RuntimeError:   # JAX_PLATFORMS without cpu: prepared on the default device, then fetched
    host = contextlib.nullcontext()
  with host:
    out = qwen3.decode_params(model_config, params, weight_dtype)
  return jax.tree_util.tree_map(np.asarray, out)


def load_on_device(path: str, model_section=None, models: dict | None = None, mesh=None, weight_dtype: str = ""):
  """(config with the run's runtime fields, params on the device as the decoders read them) of a
  model directory.

  The checkpoint is read in the run's compute dtype (`model.dtype`; 'auto': its own) and prepared
  on the host (`prepare_on_host`: projections fused, kernels in `weight_dtype`, the run's
  `decode.weight_dtype`) before it reaches a device: an f32 checkpoint decoding in bf16 puts half
  its bytes there, no decode call prepares a copy of its own, and the host holds the bf16 tree and
  its fused copies, never the f32 tree beside them. `mesh` (decode/mesh.py `from_config`; None =
  the default device): the params are placed in the decode mesh's shardings slice by slice from
  the host copy (heads, MLP and vocabulary split over its tensor axis, replicated over data), never
  as a whole copy on each device first. This is the one place where a model meets its mesh.
  `models`, a dict the caller keeps across calls of one config (bench: all its rows), holds each
  (directory, compute dtype, weight dtype) loaded once: bench keeps every row's decode calls until
  it times them side by side, and a copy per row would not fit at Qwen3-8B."""
  compute = str(model_section.get("dtype", "auto")) if model_section is not None else "auto"
  key = (path, compute, weight_dtype)
  if models is not None and key in models:
    return models[key]
  import jax
  from dgr2_jax.decode import mesh as dmesh
  from dgr2_jax.model.checkpoint import load_model_dir
  # Read in the compute dtype when the run names one (each tensor cast as it is read, as
  # decode_params would cast it): the host never holds the f32 tree beside the prepared one.
  cfg, params = load_model_dir(path, dtype=None if compute == "auto" else compute)
  cfg = cfg.with_runtime(model_section)
  params = prepare_on_host(cfg, params, weight_dtype)
  # once, not with every decode call
  params = dmesh.put_params(mesh, params) if mesh is not None else jax.device_put(params)
  out = cfg, params
  if models is not None:
    models[key] = out
  return out


def speculative_generate(verifier_path: str, model_section=None, models: dict | None = None, mesh=None,
                         weight_dtype: str = ""):
  """A `generate_fn` (sampler.generate's signature) decoding speculatively with the verifier, on
  `mesh` when given (the drafter's params placed on it too: `load_on_device(..., mesh)`), the
  verifier prepared for `weight_dtype` (the decode config's, as the drafter)."""
  from dgr2_jax.decode import speculative
  vcfg, vparams = load_on_device(verifier_path, model_section, models, mesh, weight_dtype)

  def fn(model_config, params, prompts, dcfg, rng=None, max_prompt_len=None, return_device=False):
    return speculative.generate(model_config, params, vcfg, vparams, prompts, dcfg, rng, max_prompt_len,
                                return_device=return_device, mesh=mesh)
  return fn


def threshold_generate(mesh=None):
  """`sampler.generate` on `mesh` (None: the default device), with sampler.generate's signature."""
  import functools
  return functools.partial(sampler.generate, mesh=mesh) if mesh is not None else sampler.generate
