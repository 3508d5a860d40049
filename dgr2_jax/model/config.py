"""The model configuration: Qwen3 hyper-parameters (HF names) plus the block-diffusion fields.

`Qwen3Config` is the single description of a model that every stage passes around. The HF fields
keep transformers' names so that `from_hf_dict(json.load(config.json))` and `to_hf_dict()` are
plain renames. The block-diffusion fields (`block_size`, `mask_token_id`, `attention`) are what
"converting" an AR re-ranker into a block-diffusion one changes: the weights stay as they are.

This module also owns the `model` config section: `model_config()` (its defaults; the runtime
fields' are `Qwen3Config`'s) and `validate`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import ml_collections

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
ATTENTION_KINDS = ("causal", "block_causal")
# The routes of dgr2_jax.model.attention.IMPLS (tests/test_main.py holds them equal).
ATTENTION_IMPLS = ("auto", "xla", "blockwise", "cudnn", "splitkey", "pallas", "pallas_tpu")
# Fields a run chooses and a checkpoint does not record (`with_runtime`).
RUNTIME_FIELDS = ("dtype", "remat", "remat_policy", "scan_layers", "attention_impl", "attention_k_splits",
                  "logits_chunk", "logits_budget_bytes")
# `dtype` may also be 'auto': compute in the parameters' dtype (`param_dtype`).
COMPUTE_DTYPES = ("auto",) + tuple(_DTYPES)
REMAT_POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable", "offload_dots")
# Extra keys we write into config.json so our checkpoints round-trip through HF directories.
DIFFUSION_KEYS = ("block_size", "mask_token_id", "attention")


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1_000_000.0
  # None, or a dict as in HF: {"rope_type": "linear"|"yarn", "factor": ..., ...}.
  rope_scaling: tuple[tuple[str, Any], ...] | None = None
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 40960
  attention_bias: bool = False
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  pad_token_id: int | None = None
  # Numerics: activations/matmuls and the KV cache in `dtype`, parameters stored in `param_dtype`;
  # logits, softmax statistics and log-probs are f32. 'auto' = `param_dtype` (a loaded checkpoint
  # records its tensors' dtype there, so a bf16 checkpoint decodes in bf16). Runtime.
  dtype: str = "auto"
  param_dtype: str = "float32"
  # Rematerialise each decoder layer in the backward pass (saves activation memory), keeping what
  # `remat_policy` names (qwen3.REMAT_POLICIES: nothing_saveable, dots_saveable, ...).
  remat: bool = False
  remat_policy: str = "nothing_saveable"
  # One `nn.scan` over the stacked layers instead of an unrolled stack (qwen3.stack_layers): the
  # compile time no longer grows with depth. Training/scoring only; decoding unstacks. Runtime.
  scan_layers: bool = False
  # Attention route (model/attention.py): 'xla' (einsum over a dense mask), 'blockwise' (pure-JAX
  # online softmax, no [T, S] array), 'cudnn' (fused GPU kernels), 'splitkey' (decode attention
  # split over keys, a Pallas kernel: model/decode_attention.py), 'pallas' (block-sparse flash
  # attention for training, Pallas forward and backward: model/flash_pallas.py), 'auto' (on GPUs
  # splitkey for decode windows and cudnn for the rest, else blockwise). Runtime only, like dtype/remat.
  attention_impl: str = "xla"
  # Key splits of 'splitkey' per call; 0 = enough for two thread blocks per SM at the call's batch
  # (decode_attention.num_splits). Runtime only.
  attention_k_splits: int = 0
  # Positions whose vocabulary-sized logits one chunk of a loss holds (model/logits.py); 0 = as many
  # as fit in logits.CHUNK_ELEMENTS f32 values. Runtime only.
  logits_chunk: int = 0
  # Memory budget (bytes) of the f32 logits of one decoding step's vocabulary term (decode/sampler.py
  # `choose`): within it, one matmul over all of the step's positions (the LM head read once);
  # beyond it, greedy steps walk the vocabulary in tiles (still one read) and the others go a few
  # rows at a time. 2 GiB holds batch 64 x a 33-slot window at Qwen3's vocabulary. Runtime only.
  logits_budget_bytes: int = 2**31
  # Block diffusion. `attention="causal"` with block_size 1 is the AR model.
  block_size: int = 1
  mask_token_id: int | None = None
  attention: str = "causal"

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "block_size"):
      v = getattr(self, name)
      if not isinstance(v, int) or v <= 0:
        raise ValueError(f"model config field '{name}' must be a positive int, got {v!r}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
          f"model config: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
          f"num_key_value_heads ({self.num_key_value_heads})")
    if self.head_dim % 2:
      raise ValueError(f"model config field 'head_dim' must be even for rotary embeddings, got {self.head_dim}")
    if self.dtype not in COMPUTE_DTYPES:
      raise ValueError(f"model config field 'dtype' must be one of {list(COMPUTE_DTYPES)}, got {self.dtype!r}")
    if self.param_dtype not in _DTYPES:
      raise ValueError(f"model config field 'param_dtype' must be one of {sorted(_DTYPES)}, got {self.param_dtype!r}")
    if not isinstance(self.logits_budget_bytes, int) or self.logits_budget_bytes <= 0:
      raise ValueError(f"model config field 'logits_budget_bytes' must be a positive int, got "
                       f"{self.logits_budget_bytes!r}")
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(f"model config field 'remat_policy' must be one of {REMAT_POLICIES}, got "
                       f"{self.remat_policy!r}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"model config field 'attention_impl' must be one of {ATTENTION_IMPLS}, got "
                       f"{self.attention_impl!r}")
    if not isinstance(self.attention_k_splits, int) or self.attention_k_splits < 0:
      raise ValueError(f"model config field 'attention_k_splits' must be an int >= 0, got {self.attention_k_splits!r}")
    if self.attention not in ATTENTION_KINDS:
      raise ValueError(f"model config field 'attention' must be one of {ATTENTION_KINDS}, got {self.attention!r}")
    if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
      raise ValueError(f"model config field 'mask_token_id' ({self.mask_token_id}) is outside the vocabulary "
                       f"(vocab_size {self.vocab_size})")
    if self.rope_scaling is not None:
      rs = dict(self.rope_scaling)
      kind = rs.get("rope_type", rs.get("type"))
      if kind not in ("linear", "yarn", "default"):
        raise ValueError(f"model config field 'rope_scaling' has unsupported rope_type {kind!r} "
                         "(supported: None, 'linear', 'yarn')")

  # ---- numerics -------------------------------------------------------------------------------
  @property
  def jnp_dtype(self):
    """The compute dtype: `dtype`, or `param_dtype` when `dtype` is 'auto'."""
    return _DTYPES[self.param_dtype if self.dtype == "auto" else self.dtype]

  @property
  def jnp_param_dtype(self):
    return _DTYPES[self.param_dtype]

  @property
  def num_kv_groups(self) -> int:
    return self.num_attention_heads // self.num_key_value_heads

  @property
  def eos_ids(self) -> tuple[int, ...]:
    if self.eos_token_id is None:
      return ()
    if isinstance(self.eos_token_id, int):
      return (self.eos_token_id,)
    return tuple(self.eos_token_id)

  def replace(self, **kw) -> "Qwen3Config":
    return dataclasses.replace(self, **kw)

  def with_runtime(self, model_section) -> "Qwen3Config":
    """This config with the runtime fields (not stored in checkpoints: compute dtype, remat,
    attention route, logits chunk) a config's `model` section sets."""
    kw = {k: model_section[k] for k in RUNTIME_FIELDS if model_section is not None and k in model_section}
    for k in ("remat", "scan_layers"):
      if k in kw:
        kw[k] = bool(kw[k])
    if "logits_budget_bytes" in kw:
      kw["logits_budget_bytes"] = int(kw["logits_budget_bytes"])
    return self.replace(**kw)

  def as_block_diffusion(self, block_size: int, mask_token_id: int | None = None) -> "Qwen3Config":
    """The weight-lossless conversion: same tensors, block-causal attention of `block_size`."""
    mask_token_id = self.mask_token_id if mask_token_id is None else mask_token_id
    if block_size > 1 and mask_token_id is None:
      raise ValueError("converting to block diffusion needs a mask token: set mask_token_id "
                       "(convert the checkpoint with --mask_token=<|mask|>)")
    return self.replace(block_size=block_size, mask_token_id=mask_token_id,
                        attention="block_causal" if block_size > 1 else "causal")

  # ---- rotary -------------------------------------------------------------------------------------
  def rope_inv_freq_and_scale(self) -> tuple[list[float], float]:
    """Inverse frequencies [head_dim/2] and cos/sin scale, as transformers computes them for Qwen3."""
    dim = self.head_dim
    base = self.rope_theta
    inv = [1.0 / (base ** (i / dim)) for i in range(0, dim, 2)]
    rs = dict(self.rope_scaling or ())
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "linear":
      return [f / rs["factor"] for f in inv], 1.0
    if kind != "yarn":
      return inv, 1.0
    factor = rs.get("factor")
    orig = rs["original_max_position_embeddings"]
    if factor is None:
      factor = self.max_position_embeddings / orig
    def get_mscale(scale, mscale=1.0):
      return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
    attn = rs.get("attention_factor")
    if attn is None:
      if rs.get("mscale") and rs.get("mscale_all_dim"):
        attn = get_mscale(factor, rs["mscale"]) / get_mscale(factor, rs["mscale_all_dim"])
      else:
        attn = get_mscale(factor)
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1
    def corr_dim(rot):
      return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))
    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rs.get("truncate", True):
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
      high += 0.001
    out = []
    for i in range(dim // 2):
      ramp = min(max((i - low) / (high - low), 0.0), 1.0)
      extra = 1.0 - ramp
      pos_freq = base ** (2 * i / dim)
      out.append((1.0 / (factor * pos_freq)) * (1 - extra) + (1.0 / pos_freq) * extra)
    return out, float(attn)

  # ---- HF interop -----------------------------------------------------------------------------
  @classmethod
  def from_hf_dict(cls, d: dict, **overrides) -> "Qwen3Config":
    """From a transformers `config.json` dict (legacy rope_theta/rope_scaling or rope_parameters)."""
    if d.get("model_type") not in (None, "qwen3"):
      raise ValueError(f"config.json: model_type is {d.get('model_type')!r}, only 'qwen3' is supported")
    rp = d.get("rope_parameters") or {}
    rope_theta = d.get("rope_theta", rp.get("rope_theta", 1_000_000.0))
    scaling = d.get("rope_scaling") or {k: v for k, v in rp.items() if k != "rope_theta"}
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    rope_scaling = None if kind == "default" else tuple(sorted(scaling.items()))
    heads = d["num_attention_heads"]
    eos = d.get("eos_token_id")
    kw = dict(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=float(rope_theta),
        rope_scaling=rope_scaling, tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=d.get("max_position_embeddings", 40960),
        attention_bias=bool(d.get("attention_bias", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        pad_token_id=d.get("pad_token_id"),
    )
    dg = d.get("dgr2", {})
    for key in DIFFUSION_KEYS:
      if key in dg:
        kw[key] = dg[key]
    kw.update(overrides)
    return cls(**kw)

  def to_hf_dict(self) -> dict:
    """A `config.json` dict transformers' Qwen3ForCausalLM loads; diffusion fields under "dgr2"."""
    rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
    if self.rope_scaling is not None:
      rope_parameters.update(dict(self.rope_scaling))
      rope_parameters.pop("type", None)
    eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
        "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
        "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings,
        "attention_bias": self.attention_bias, "attention_dropout": 0.0,
        "use_sliding_window": False, "bos_token_id": self.bos_token_id,
        "eos_token_id": eos, "pad_token_id": self.pad_token_id,
        "torch_dtype": self.param_dtype,
        "dgr2": {k: getattr(self, k) for k in DIFFUSION_KEYS},
    }


# ---- the `model` config section ----------------------------------------------------------------
def model_config() -> ml_collections.ConfigDict:
  """The AR re-ranker the SFT stage starts from.

  `init_from` '' => random init of the architecture below with the tokenizer's vocabulary
  (`vocab_size` 0 = len(tokenizer)); a model directory (HF or ours) => its config.json and weights
  (the architecture fields below are then ignored).
  """
  # The runtime fields' defaults are Qwen3Config's; the architecture is the section's own (a tiny
  # model for the smoke runs, where Qwen3Config's defaults are those of a config.json without the key).
  q = Qwen3Config
  c = ml_collections.ConfigDict()
  c.init_from = ""  # '' = random init of the fields below; a model directory = its config and weights
  c.vocab_size = 0  # 0 = len(tokenizer)
  c.hidden_size = 64  # model width (the architecture fields are ignored with init_from)
  c.intermediate_size = 128  # MLP width
  c.num_hidden_layers = 2  # transformer layers
  c.num_attention_heads = 4  # query heads
  c.num_key_value_heads = 2  # K/V heads (grouped-query attention); divides num_attention_heads
  c.head_dim = 16  # per-head width (even: rotary embeddings)
  c.rms_norm_eps = q.rms_norm_eps  # RMSNorm epsilon
  c.rope_theta = q.rope_theta  # rotary embedding base (Qwen3's)
  c.tie_word_embeddings = True  # the LM head is the embedding matrix
  c.max_position_embeddings = 4096  # longest position the model is configured for
  # Activations / matmuls / KV cache; 'auto' = param_dtype (a loaded checkpoint's own dtype: bf16
  # checkpoints decode in bf16). Logits, softmax statistics and log-probs are f32 in any case.
  c.dtype = q.dtype
  c.param_dtype = q.param_dtype  # stored parameters (master weights: train.param_dtype)
  c.remat = q.remat  # recompute each layer in the backward pass (less memory, more compute)
  # Attention route (dgr2_jax/model/attention.py): 'xla' (dense, fastest for tiny CPU models),
  # 'blockwise' (no [T, S] array; any device), 'cudnn', 'splitkey' (decode attention split over
  # keys, docs/decode_attention.md), 'pallas' (block-sparse flash attention for training, forward
  # and backward; opt-in, docs/training.md), 'auto' (on GPUs splitkey for decode windows and cudnn
  # for the rest, else blockwise).
  c.attention_impl = q.attention_impl
  c.attention_k_splits = q.attention_k_splits   # key splits of 'splitkey'; 0 = two thread blocks per SM at the batch
  c.logits_chunk = q.logits_chunk         # positions per vocabulary chunk of the losses; 0 = 64 MiB of logits
  # f32 logits of one decoding step's positions computed by one LM-head matmul (above: vocabulary
  # tiles for greedy steps, a few rows at a time otherwise); 2 GiB = batch 64 x 33 slots at Qwen3's V.
  c.logits_budget_bytes = q.logits_budget_bytes
  return c


def validate(config, runs: set) -> None:
  """Checks the `model` config section (the architecture only when `init_from` is empty)."""
  from dgr2_jax import checks
  c = config
  if "model" not in c:
    return
  m = c.model
  checks.one_of(c, "model", "dtype", COMPUTE_DTYPES)
  checks.one_of(c, "model", "param_dtype", tuple(_DTYPES))
  if "logits_budget_bytes" in m:
    checks.positive_int(c, "model", "logits_budget_bytes")
  if "attention_k_splits" in m:
    checks.positive_int(c, "model", "attention_k_splits", 0)
  if "attention_impl" in m:
    checks.one_of(c, "model", "attention_impl", ATTENTION_IMPLS)
  if m.get("remat_policy"):
    checks.one_of(c, "model", "remat_policy", REMAT_POLICIES)
  if "logits_chunk" in m:
    checks.positive_int(c, "model", "logits_chunk", 0)
  if m.init_from:
    if "sft" in runs:
      checks.model_dir("model.init_from", m.init_from)
    return
  for f in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim"):
    checks.positive_int(c, "model", f)
  checks.positive_int(c, "model", "vocab_size", 0)
  if m.num_attention_heads % m.num_key_value_heads:
    checks.fail("model.num_key_value_heads", f"({m.num_key_value_heads}) must divide "
                f"model.num_attention_heads ({m.num_attention_heads})")
  if m.head_dim % 2:
    checks.fail("model.head_dim", f"must be even (rotary embeddings), got {m.head_dim}")
