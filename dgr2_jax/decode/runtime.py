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


def validate(config, runs: set, name: str = "decode") -> None:
  """Checks the `decode` config section (`name` picks another section of the same form)."""
  from dgr2_jax import checks
  from dgr2_jax.decode import speculative
  if name not in config:
    return
  d = config[name]
  for f in ("block_size", "max_new_tokens"):
    checks.positive_int(config, name, f)
  if d.max_new_tokens % d.block_size:
    checks.fail(f"{name}.max_new_tokens", f"({d.max_new_tokens}) must be a multiple of "
                f"{name}.block_size ({d.block_size})")
  if not 0.0 < float(d.threshold) <= 1.0:
    checks.fail(f"{name}.threshold", f"must be in (0, 1], got {d.threshold}")
  if float(d.temperature) < 0:
    checks.fail(f"{name}.temperature", f"must be >= 0, got {d.temperature}")
  checks.positive_int(config, name, "top_k", 0)
  if not 0.0 < float(d.top_p) <= 1.0:
    checks.fail(f"{name}.top_p", f"must be in (0, 1], got {d.top_p}")
  if not checks.is_int(d.get("steps_per_block", 0), 0):
    checks.fail(f"{name}.steps_per_block", f"must be an int >= 0 (0 = no budget), got {d.steps_per_block!r}")
  if d.get("mode", "threshold") not in speculative.MODES:
    checks.fail(f"{name}.mode", f"must be one of {list(speculative.MODES)}, got {d.mode!r}")
  if not checks.is_int(d.get("steps_per_sync", 8), 1):
    checks.fail(f"{name}.steps_per_sync", f"must be an int >= 1, got {d.steps_per_sync!r}")
  if d.get("kv_write", "auto") not in sampler.KV_WRITES:
    checks.fail(f"{name}.kv_write", f"must be one of {list(sampler.KV_WRITES)}, got {d.kv_write!r}")
  if not checks.is_int(d.get("verify_every", 2), 0):
    checks.fail(f"{name}.verify_every", f"must be an int >= 0, got {d.verify_every!r}")
  # Checked in every mode: the bench and the pipeline run speculative rows beside threshold ones.
  if d.get("verify_every", 2) and d.get("steps_per_sync", 8) % d.get("verify_every", 2):
    checks.fail(f"{name}.verify_every", f"({d.verify_every}) must be 0 or divide {name}.steps_per_sync "
                f"({d.get('steps_per_sync', 8)}): speculative decoding verifies after every that many drafter steps")
  if d.get("mode", "threshold") == "speculative":
    if d.block_size < 2:
      checks.fail(f"{name}.block_size", f"must be >= 2 with {name}.mode='speculative' (the drafter's "
                  f"blocks), got {d.block_size}")
    if d.get("verifier_dir", ""):
      checks.model_dir(f"{name}.verifier_dir", d.verifier_dir, "verifier model directory")
