"""Per-device memory of each training stage, as formulas over a config (no arrays).

One plan for the dry run (`dgr2_jax/train/dry_run.py`: the 8-GPU plans of the paper presets) and
`benchmarks/stage_memory.py` (measured against it on CPU at Qwen3's vocabulary). Terms, bytes per
device for one optimizer step, with rows = micro-batch rows on this device (train.batch_size /
grad_accum_steps / (data * fsdp)) and T = the stage's sequence:
  * activations: T x per-token bytes per layer; with remat in a scanned stack (`scan_layers`) each
    layer keeps its input (E values) and one layer at a time its full set (~5E + 2(q + kv) + 3I
    values); an unrolled stack keeps every layer's full set, with remat too (XLA runs every
    layer's recomputed forward ahead of the backward pass: the compiled programs of
    dgr2_jax/aot/compile_run.py). Attention adds, per layer kept, 'xla': two [heads, T, T] f32
    maps (scores and probabilities); the other routes O(T) (the log-sum-exp and output), with a
    transient tile. The route is the one 'auto' takes on the platform built for (a compile-only
    target's in `compile_for`, else the host's).
  * attention copies ('cudnn', CFT / OPD / RL): the multi-stream layout's context keys and values
    copied per clean block and per group of canvases (`context_copies`).
  * the input embedding's gradient: dense [V, E] in the compute dtype, whole on every device.
  * logits: the vocabulary terms run in chunks of `positions_per_chunk` positions
    (model/logits.py); a loss and its gradient hold ~LOGIT_ARRAYS [chunk, V] f32 arrays at once
    (measured: XLA's temporary memory of the compiled OPD step is 5.3 chunks).
  * teacher cache (OPD): the step's rollouts on this device x R x bytes per token of
    `opd.teacher_cache` ('full' 4V, 'topk' 8k + 4, 'none' 0).
  * XLA:TPU (a TPU platform or `compile_for` target): its compiled steps hold more than those
    terms: the chunked logits loop carries the output head's gradient in f32 beside a bf16 copy
    of the table (6 bytes per vocabulary x hidden entry, whole on every device), and about
    TPU_RESIDUAL_COPIES more hidden-state vectors per token and layer than the scanned stack's
    one (measured: the Qwen3-0.6B and -8B steps compiled for TPU v5p-16; docs/accelerators.md).
  * decode (rollouts, eval): the KV cache, rows x (P + R) x layers x 2 x kv heads x head_dim in
    the compute dtype, and a [rows, B, V] chunk of logits.
The dry run adds the state (params, optimizer, gradients, frozen copies) and, with gradient
accumulation, the gradients' f32 sum. The training steps of the Qwen3-0.6B and -8B presets
compile within 10% of the plan on H100 x8, H200 x8 and the TPU slices of docs/accelerators.md.
Sequences: SFT and the AR teacher's RL `P + R`; CFT `P + 2R` (prompt, clean, one canvas per block);
OPD and RL replay `P + R + R/B * cap * B` (cap = replay canvases per block).
"""

from __future__ import annotations

import math

from dgr2_jax import platform
from dgr2_jax.model import logits as logits_lib

LOGIT_ARRAYS = 6          # [chunk, V] f32 arrays a chunked loss + gradient holds at once
CONTEXT_COPIES = 6        # cuDNN multi-stream: context-sized k/v copies alive at once (`context_copies`)
# XLA:TPU: hidden-state vectors per token and layer its compiled steps hold beyond the plan's
# (least squares over the ten training steps of both presets compiled for v5p-16: 2.1; rounded up).
TPU_RESIDUAL_COPIES = 2.25
TPU_HEAD_BYTES = 6        # per vocabulary x hidden entry: the head's f32 gradient + a bf16 copy of it
TRAIN_STAGES = ("sft", "teacher_rl", "cft", "opd", "rl")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(name: str) -> int:
  """Bytes per element of a float dtype's name."""
  return _DTYPE_BYTES[name]


def compute_bytes(mc) -> int:
  """Bytes per element of the model's compute dtype ('auto': the params' dtype)."""
  return _DTYPE_BYTES[mc.param_dtype if mc.dtype == "auto" else mc.dtype]


def decode_slots(config) -> int:
  """KV slots per decoded row: task.prompt_len + decode.max_new_tokens (task.response_len where
  the config has no decode section)."""
  dec = config.get("decode")
  return int(config.task.prompt_len) + (int(dec.max_new_tokens) if dec is not None else int(config.task.response_len))


def kv_cache_bytes(mc, rows: int, slots: int) -> int:
  """The decoder's KV cache whole: rows x slots x layers x (K, V) x kv heads x head_dim in the compute
  dtype (a tensor axis that divides the kv heads splits it)."""
  return rows * slots * mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim * compute_bytes(mc)


def cache_bytes_per_token(mode: str, vocab: int, k: int) -> int:
  return {"full": 4 * vocab, "topk": 8 * k + 4, "none": 0}[mode]


def _section(config, name):
  from dgr2_jax.train import grpo, opd
  from dgr2_jax.train.config import section
  defaults = {"opd": opd.opd_config, "rl": grpo.rl_config, "teacher_rl": grpo.rl_config}
  return section(config, name, defaults[name]) if name in defaults else config[name]


def stage_layout(config, stage: str) -> dict:
  """rows per step (global), micro-batches, sequence T, loss positions, block size of a stage."""
  tk = config.task
  p, r = int(tk.prompt_len), int(tk.response_len)
  bsz = int(config.cft.block_size)
  if stage == "sft":
    return dict(rows=int(config.train.batch_size), micro=int(config.train.grad_accum_steps), seq=p + r, loss=r)
  if stage == "cft":
    rows = int(config.cft.get("batch_size", 0) or config.train.batch_size)
    return dict(rows=rows, micro=int(config.train.grad_accum_steps), seq=p + 2 * r, loss=r)
  sec = _section(config, stage)
  if stage == "opd":
    rows = int(sec.prompts_per_step) * int(sec.rollouts_per_prompt)
  else:
    rows = int(sec.prompts_per_step) * int(sec.group_size)
  cap = int(sec.replay_max_segments) or bsz
  seq = p + r if stage == "teacher_rl" else p + r + (r // bsz) * min(cap, bsz) * bsz
  return dict(rows=rows, micro=int(sec.grad_accum_steps), seq=seq, loss=r)


def plan_stage(config, mc, stage: str, dims: tuple[int, int, int]) -> dict:
  """Per-device bytes of the activations, logits and teacher cache of one step of `stage` on a
  mesh (data, fsdp, tensor), and of its rollout decode (KV cache + logits)."""
  data, fsdp, tensor = dims
  lay = stage_layout(config, stage)
  rows = max(1, math.ceil(lay["rows"] / lay["micro"] / (data * fsdp)))
  t = lay["seq"]
  d = compute_bytes(mc)
  h, inter = mc.hidden_size, mc.intermediate_size
  q = mc.num_attention_heads * mc.head_dim / tensor
  kv = mc.num_key_value_heads * mc.head_dim / tensor
  heads = max(1, mc.num_attention_heads // tensor)
  full_layer = (5 * h + 2 * (q + kv) + 3 * inter / tensor) * d      # bytes per token
  impl = attention_route(mc)
  attn_map = (2 * heads * t * 4) if impl == "xla" else (2 * heads * 4)  # per token, per kept layer
  # Rematerialisation holds one layer's set at a time only in a scanned stack: unrolled, XLA runs
  # every layer's recomputed forward ahead of the backward and holds them all (compiled programs).
  kept = 1 if mc.remat and mc.scan_layers else mc.num_hidden_layers
  act = rows * t * (mc.num_hidden_layers * h * d + kept * (full_layer + attn_map))
  copies = context_copies(config, mc, stage, rows, tensor) if impl == "cudnn" else 0
  # The input embedding's gradient: the lookup's scatter into a dense [V, E] array in the compute
  # dtype, whole on every device until it is reduced (compiled programs).
  embed_grad = mc.vocab_size * h * d
  xla_tpu = 0
  if platform.backend() == "tpu":
    xla_tpu = (TPU_HEAD_BYTES * mc.vocab_size * h
               + TPU_RESIDUAL_COPIES * rows * t * mc.num_hidden_layers * h * d)
  n_pos = rows * lay["loss"]
  chunk = logits_lib.positions_per_chunk(mc.vocab_size, n_pos, getattr(mc, "logits_chunk", 0))
  logits = LOGIT_ARRAYS * chunk * math.ceil(mc.vocab_size / tensor) * 4
  cache = 0
  if stage == "opd":
    oc = _section(config, "opd")
    step_rows = math.ceil(lay["rows"] / (data * fsdp))
    cache = step_rows * lay["loss"] * cache_bytes_per_token(oc.get("teacher_cache", "full"), mc.vocab_size,
                                                             int(oc.teacher_top_k))
  decode = 0
  if stage in ("teacher_rl", "opd", "rl"):
    sec = _section(config, stage)
    dec_rows = int(sec.get("rollout_batch_size", 0)) or lay["rows"]
    dec_rows = math.ceil(dec_rows / (data * fsdp))
    kvc = kv_cache_bytes(mc, dec_rows, decode_slots(config)) / tensor
    window = 1 if stage == "teacher_rl" else int(config.decode.block_size)
    per = logits_lib.CHUNK_ELEMENTS // max(window * mc.vocab_size, 1) or 1
    decode = int(kvc + 4 * min(per, dec_rows) * window * mc.vocab_size * 4)
  return dict(stage=stage, rows_per_device=rows, micro_batches=lay["micro"], sequence=t, attention=impl,
              activations=int(act), attention_copies=int(copies), embedding_gradient=int(embed_grad),
              logits=int(logits), logits_chunk=chunk, teacher_cache=int(cache), decode=decode,
              xla_tpu=int(xla_tpu), total=int(act + copies + embed_grad + logits + cache + xla_tpu))


def attention_route(mc) -> str:
  """The route a training step's attention takes: the config's, 'auto' as the platform built for
  resolves it (model/attention.py `auto_impl`: cuDNN on GPUs, the TPU kernels on TPUs, blockwise
  elsewhere; a compile-only target's inside `aot.targets.compile_for`)."""
  from dgr2_jax.model import attention
  return mc.attention_impl if mc.attention_impl != "auto" else attention.auto_impl(1, 1, None, platform.backend())


def context_copies(config, mc, stage: str, rows: int, tensor: int) -> int:
  """The cuDNN route's copies of the multi-stream layout's context (model/attention.py
  `_cudnn_streams`: each clean block, and each group of as many segments, attends to its own copy
  of the [prompt | clean] keys and values): CONTEXT_COPIES such arrays of rows x blocks x (P + R)
  x kv width, beside one layer's set. SFT and the AR teacher's stages have no such layout."""
  if stage in ("sft", "teacher_rl"):
    return 0
  bsz = int(config.cft.block_size) if stage == "cft" else int(config.decode.block_size)
  p, r = int(config.task.prompt_len), int(config.task.response_len)
  d = compute_bytes(mc)
  kv = mc.num_key_value_heads * mc.head_dim / tensor
  return int(CONTEXT_COPIES * rows * (r // bsz) * (p + r) * kv * d) if bsz > 1 else 0
