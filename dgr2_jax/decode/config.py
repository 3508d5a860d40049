"""The `decode` config section's one owner: its defaults, its checks and the `DecodeConfig` that
every decoder (decode/sampler.py, decode/speculative.py) runs.

The defaults live in `DecodeConfig`'s fields; `decode_config()` builds the `config.decode` section
from them and adds the fields only the section has (`mode`, `verifier_dir`, `mesh`). The checks
are written once, in `_check_values`: `DecodeConfig` runs them when it is made, `validate` runs them
(and the section's own) on a config before any work, naming the field.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Mapping

import ml_collections

from dgr2_jax import checks


KV_WRITES = ("auto", "fused", "separate")
WEIGHT_DTYPES = ("", "float8_e4m3fn")   # '' = the compute dtype; the others: model/qwen3.py QUANTIZED
MODES = ("threshold", "speculative")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """One decoder's settings: the `decode` section's fields plus the token ids the caller resolved."""
  block_size: int = 32
  threshold: float = 0.9          # tau; traced (no recompile)
  temperature: float = 0.0        # 0 = greedy; traced
  top_k: int = 0                  # 0 = off; traced
  top_p: float = 1.0              # 1.0 = off; traced
  steps_per_block: int = 8        # 0 = no budget; else at most this many steps per block; traced
  max_new_tokens: int = 256       # multiple of block_size; static
  eos_ids: tuple[int, ...] = ()
  mask_token_id: int | None = None
  pad_id: int = 0
  # How block j-1's clean K/V are written when a row moves to block j (static): 'fused' into the
  # row's first step of block j (a [previous block | canvas] window of 2B slots for the batch
  # that iteration), 'separate' (a B-slot window that only writes, one more forward for that row,
  # counted in its NFE), or 'auto' (`sampler.resolve_kv_write`): 'separate' on CPU, where a 2B
  # window costs over twice a B window; on accelerators 'fused' at a few rows per device, where a
  # window's cost barely depends on its width, and 'separate' beyond, where the 2B window's FLOPs
  # bound it.
  kv_write: str = "auto"
  # Decode steps per host round trip (static): the loop checks "every row finished?" on the host
  # once per `steps_per_sync` steps and runs that many steps on the device in between, a finished
  # row's steps masked (decode/sampler.py's docstring, "Host round trips").
  steps_per_sync: int = 8
  # Speculative decoding (decode/speculative.py; static): the verifier runs after every
  # `verify_every` drafter steps, on every row whose draft is ready, a fixed schedule with no host
  # round trip (a divisor of `steps_per_sync`); 0 = whenever enough rows are ready, decided on the
  # device (a `lax.cond` per drafter step: a host round trip each on a GPU, but no row waits).
  verify_every: int = 2
  # Shared-prefix KV reuse (decode/prefix.py; static per prefix length): the token prefix every
  # prompt of a batch shares (the system prompt and instructions) is prefilled once and its K/V
  # copied into each row, so each row prefills only what follows it. 0 = off (a full prefill);
  # -1 = the batch's longest common prefix, rounded down to a multiple of 16 tokens; N > 0 = that
  # prefix capped at N tokens. The same tokens as a full prefill in every test, but the copied K/V
  # may differ from the batched prefill's in the last float bits (decode/prefix.py), so off by default.
  shared_prefix: int = 0
  # The dtype the decoder stores its projection kernels in (static; model/qwen3.py decode_params):
  # '' = the compute dtype; 'float8_e4m3fn' = every projection and the LM head in e4m3 with an f32
  # scale per output channel, dequantized in the matmul: about half the weight bytes a step reads.
  weight_dtype: str = ""

  def __post_init__(self):
    _check_values(dataclasses.asdict(self), "decode")
    if self.block_size > 1 and self.mask_token_id is None:
      checks.fail("decode.block_size", "> 1 needs a mask token (model config mask_token_id)")


def decode_config() -> ml_collections.ConfigDict:
  """Block-diffusion decoding (dgr2_jax.decode.config.DecodeConfig); block_size 1 = AR."""
  d = DecodeConfig  # the defaults are its fields'
  c = ml_collections.ConfigDict()
  c.block_size = d.block_size  # tokens decoded in parallel per block; 1 = AR (left to right)
  c.threshold = d.threshold  # tau: commit each masked position whose top probability >= tau (1.0: one a step)
  c.temperature = d.temperature  # 0 = greedy; > 0 samples
  c.top_k = d.top_k  # sampling: keep the k most likely tokens (0 = all)
  c.top_p = d.top_p  # sampling: nucleus mass (1.0 = all)
  c.max_new_tokens = d.max_new_tokens  # response slots decoded (a multiple of block_size)
  # Step budget per block (dgr2_jax.decode.sampler; 0 = none: tau alone decides, >= 1 commit per
  # step). The paper evaluates with 64 denoising steps for responses of ~180 tokens (~130
  # reasoning + the ranking): 8 steps for each of their 6 blocks of 32 is 48 <= 64, so 8 per block
  # never exceeds the paper's budget. Without a budget, a model that is confident nowhere (the
  # naive conversion) decodes one token per step, left to right: AR in disguise, at no speedup.
  c.steps_per_block = d.steps_per_block
  # 'threshold' (decode/sampler.py) | 'speculative' (decode/speculative.py: this model drafts,
  # `verifier_dir` verifies; '' = the workdir's AR teacher). Speculative output is the verifier's.
  c.mode = "threshold"
  c.verifier_dir = ""  # mode='speculative': the verifying AR model ('' = the workdir's AR teacher)
  # How a finished block's clean K/V are written (decode/sampler.py): 'auto' = 'separate' on CPU;
  # on accelerators 'fused' up to 2 rows per device, 'separate' beyond; 'fused' | 'separate' force one.
  c.kv_write = d.kv_write
  # Decode steps per host round trip (decode/sampler.py): the decode loop asks "is every row
  # finished?" once per this many steps; up to this many - 1 steps after the last row finished
  # are masked (wasted). 1 = ask after every step.
  c.steps_per_sync = d.steps_per_sync
  # mode='speculative' (decode/speculative.py): the verifier's pass runs after every this many
  # drafter steps, a fixed schedule with no host round trip (must divide steps_per_sync; a draft
  # completed earlier waits for the pass); 0 = as soon as enough drafts are ready, decided on the
  # device: no wait, but a host round trip per drafter step on a GPU.
  c.verify_every = d.verify_every
  # Shared-prefix KV reuse (decode/prefix.py): the prompt prefix every row shares is prefilled once
  # and its K/V copied into each row (and each serving slot). 0 = off; -1 = the batch's longest
  # common token prefix (rounded down to a multiple of 16); N > 0 = that prefix, at most N tokens.
  c.shared_prefix = d.shared_prefix
  # Weight-only quantization for decoding (model/qwen3.py decode_params): '' = the compute dtype;
  # 'float8_e4m3fn' = projections and LM head in e4m3, a per-output-channel scale (half the bytes).
  c.weight_dtype = d.weight_dtype
  # The decode mesh of eval, generate and bench (dgr2_jax/decode/mesh.py): `data` splits each
  # batch's rows, `tensor` the model (heads, MLP, vocabulary, KV cache); 0 or -1 = all remaining
  # devices. Default: every device decodes its own rows. An 8B model at batch 1: data=1, tensor=8.
  m = ml_collections.ConfigDict()
  m.data = -1   # devices that split each batch's rows; 0 or -1 = all remaining devices
  m.tensor = 1  # devices that split the model (heads, MLP, vocabulary, KV cache); 0/-1 as above
  c.mesh = m
  return c


def decode_config_from(section, **ids) -> DecodeConfig:
  """DecodeConfig from a `config.decode` section (its DecodeConfig fields; others, such as
  `mode` and `verifier_dir`, are ignored) and the token ids `ids` (eos_ids, mask_token_id,
  pad_id) the caller resolved."""
  names = {f.name for f in dataclasses.fields(DecodeConfig)} - set(ids)
  return DecodeConfig(**{k: section[k] for k in names if k in section}, **ids)


# ---- checks ---------------------------------------------------------------------------------------
def _is_int(v, minimum: int) -> bool:
  """An int (numpy's too: a DecodeConfig may be made from array values) >= minimum; not a bool."""
  return not isinstance(v, bool) and isinstance(v, numbers.Integral) and v >= minimum


def _check_values(d: Mapping, name: str) -> None:
  """The checks a `DecodeConfig` and a `decode` section share (`d`: every DecodeConfig field);
  the first bad field fails, named `<name>.<field>`."""
  for f in ("block_size", "max_new_tokens"):
    if not _is_int(d[f], 1):
      checks.fail(f"{name}.{f}", f"must be an int >= 1, got {d[f]!r}")
  if d["max_new_tokens"] % d["block_size"]:
    checks.fail(f"{name}.max_new_tokens", f"({d['max_new_tokens']}) must be a multiple of "
                f"{name}.block_size ({d['block_size']})")
  if not 0.0 < float(d["threshold"]) <= 1.0:
    checks.fail(f"{name}.threshold", f"must be in (0, 1], got {d['threshold']}")
  if float(d["temperature"]) < 0:
    checks.fail(f"{name}.temperature", f"must be >= 0, got {d['temperature']}")
  if not 0.0 < float(d["top_p"]) <= 1.0:
    checks.fail(f"{name}.top_p", f"must be in (0, 1], got {d['top_p']}")
  if not _is_int(d["steps_per_block"], 0):
    checks.fail(f"{name}.steps_per_block", f"must be an int >= 0 (0 = no budget), got {d['steps_per_block']!r}")
  if not _is_int(d["steps_per_sync"], 1):
    checks.fail(f"{name}.steps_per_sync", f"must be an int >= 1, got {d['steps_per_sync']!r}")
  if d["kv_write"] not in KV_WRITES:
    checks.fail(f"{name}.kv_write", f"must be one of {list(KV_WRITES)}, got {d['kv_write']!r}")
  if not _is_int(d["shared_prefix"], -1):
    checks.fail(f"{name}.shared_prefix", f"must be an int >= -1 (0 = off, -1 = detected, N = at most N tokens), "
                f"got {d['shared_prefix']!r}")
  if d["weight_dtype"] not in WEIGHT_DTYPES:
    checks.fail(f"{name}.weight_dtype", f"must be one of {list(WEIGHT_DTYPES)} ('' = the compute dtype), "
                f"got {d['weight_dtype']!r}")
  if not _is_int(d["verify_every"], 0):
    checks.fail(f"{name}.verify_every", f"must be an int >= 0, got {d['verify_every']!r}")


def schedule_fits(steps_per_sync: int, verify_every: int) -> bool:
  """A group of `steps_per_sync` drafter steps holds whole verification cycles (speculative
  decoding verifies after every `verify_every` drafter steps; 0 = when drafts are ready)."""
  return verify_every >= 0 and not (verify_every and steps_per_sync % verify_every)


def check_schedule(steps_per_sync: int, verify_every: int) -> None:
  """Raises ValueError unless `schedule_fits` (decode/speculative.py, when it builds a decoder)."""
  if not schedule_fits(steps_per_sync, verify_every):
    raise ValueError(f"decode.verify_every ({verify_every}) must be 0 or divide decode.steps_per_sync "
                     f"({steps_per_sync})")


def validate(config, runs: set, name: str = "decode") -> None:
  """Checks the `decode` config section (`name` picks another section of the same form); a field
  the section leaves out has its default."""
  del runs  # every run decodes with the section it has
  if name not in config:
    return
  d = {**decode_config(), **config[name]}
  _check_values(d, name)
  if not checks.is_int(d["top_k"], 0):
    checks.fail(f"{name}.top_k", f"must be an int >= 0, got {d['top_k']!r}")
  if d["mode"] not in MODES:
    checks.fail(f"{name}.mode", f"must be one of {list(MODES)}, got {d['mode']!r}")
  # Checked in every mode: the bench and the pipeline run speculative rows beside threshold ones.
  if not schedule_fits(d["steps_per_sync"], d["verify_every"]):
    checks.fail(f"{name}.verify_every", f"({d['verify_every']}) must be 0 or divide {name}.steps_per_sync "
                f"({d['steps_per_sync']}): speculative decoding verifies after every that many drafter steps")
  if d["mode"] == "speculative":
    if d["block_size"] < 2:
      checks.fail(f"{name}.block_size", f"must be >= 2 with {name}.mode='speculative' (the drafter's "
                  f"blocks), got {d['block_size']}")
    if d["verifier_dir"]:
      checks.model_dir(f"{name}.verifier_dir", d["verifier_dir"], "verifier model directory")
