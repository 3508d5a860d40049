"""The dry run: the device mesh and a per-device memory plan for a config, without allocating.

  python -m dgr2_jax.main --config=configs/beauty_qwen3_8b.py --config.dry_run=True
  python launch/dry_run.py --config=configs/beauty_qwen3_8b.py

The plan is arithmetic over `jax.eval_shape` results on an abstract mesh of
`config.hardware.num_devices` devices (0 = the devices present), so the 8-GPU plan of the paper
configs prints on a laptop CPU. Per device:
  * params, gradients: in `train.param_dtype` (master weights), sharded by
    `train.logical_axis_rules` exactly as the training loop shards them (dgr2_jax.train.mesh);
  * optimizer state: optax's state of `train.optimizer` (Adam mu/nu mirror the parameters and
    share their sharding; counters replicated);
  * per training stage (sft, teacher_rl, cft, opd, rl): activations, logits (in chunks of
    positions) and OPD's teacher cache, plus the rollout decode, by the formulas of
    `dgr2_jax/train/memory_plan.py` (the ones benchmarks/stage_memory.py measures on CPU, and
    `hardware.compile_for` compares with the compiled programs), with gradient accumulation the
    gradients' f32 sum (`accumulator_bytes`); OPD
    also holds a frozen copy of the teacher's params (in the compute dtype when the step scores
    the teacher, `opd.frozen_teacher`), and the RL stages one of their starting model (in the
    compute dtype; for the KL to it, `rl.log_kl_ref` or `rl.kl_coef` > 0). The plan fits when
    its largest stage does.
    `step_bytes` is one stage's training step alone (benchmarks/train_step.py compares it
    with XLA's plan and the measured peak).
  * decode KV cache for `eval.batch_size` rows of prompt_len + decode.max_new_tokens (inference).
The model is `model.init_from`'s config.json when set (weights are not read), else the
architecture fields of `config.model` (vocab_size 0 => task.demo_vocab_size, an estimate).
The `hardware` config section is this module's: its defaults (`hardware_config`) and checks (`validate`).
With `hardware.compile_for` the dry run also compiles every program of the run for that target
(dgr2_jax/aot/compile_run.py, dispatched by main) and plans for its devices, memory and routes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding

from dgr2_jax import checks
from dgr2_jax import platform
from dgr2_jax.model import qwen3
from dgr2_jax.model.config import Qwen3Config
from dgr2_jax.train import grpo, memory_plan, opd, optim
from dgr2_jax.train.config import section
from dgr2_jax.train import mesh as mesh_lib

GIB = 2**30


def hardware_config() -> ml_collections.ConfigDict:
  """What the dry run plans for (dgr2_jax/train/dry_run.py): no devices are needed to plan."""
  c = ml_collections.ConfigDict()
  c.num_devices = 0          # 0 => the platform's devices (platform.devices(): a target's, else the host's)
  c.device_memory_gb = 0.0   # 0 => unknown (no fit check)
  # With dry_run: also compile every program a run executes for this target, on no accelerator
  # (dgr2_jax/aot/compile_run.py: h100x8, h200x8, h100x8x2, v5p-16, v5e-32, v6e-8, ...; the
  # compilers: pip install -e ".[aot]"); devices and memory then come from the target. '' = plan only.
  c.compile_for = ""
  c.compile_report = ""      # JSON of the compiled programs; '' => <workdir>/compile_<target>.json (no --workdir: none)
  return c


def validate(config, runs: set) -> None:
  """Checks the `hardware` config section."""
  del runs  # no paths
  if "hardware" not in config:
    return
  checks.positive_int(config, "hardware", "num_devices", 0, " (0 = the devices present)")
  mem = config.hardware.device_memory_gb
  if isinstance(mem, bool) or not isinstance(mem, (int, float)) or mem < 0:
    checks.fail("hardware.device_memory_gb", f"must be a number >= 0 (0 = unknown), got {mem!r}")
  for field in ("compile_for", "compile_report"):
    if not isinstance(config.hardware.get(field, ""), str):
      checks.fail(f"hardware.{field}", f"must be a string, got {config.hardware.get(field)!r}")
  if config.hardware.get("compile_for", "") and not config.get("dry_run", False):
    checks.fail("hardware.compile_for", "compiles ahead of time in a dry run only: add --config.dry_run=True")


def model_config_for(config):
  m = config.model
  if m.init_from:
    f = os.path.join(m.init_from, "config.json")
    if not os.path.isfile(f):
      raise FileNotFoundError(f"config.model.init_from: no config.json in {m.init_from!r}")
    with open(f) as fh:
      mc = Qwen3Config.from_hf_dict(json.load(fh))
    return mc.with_runtime(m), "init_from"   # the runtime fields a run sets (`load_policy`, `model_from_config`)
  fields = {f.name for f in dataclasses.fields(Qwen3Config)}
  kw = {k: v for k, v in m.items() if k in fields}
  src = "config.model"
  if not kw.get("vocab_size"):
    kw["vocab_size"] = int(config.task.demo_vocab_size)
    src += " (vocab_size from task.demo_vocab_size: an estimate)"
  return Qwen3Config(**kw), src


def _sharded_bytes(shapes, shardings) -> int:
  total = 0
  for x, s in zip(np.asarray(_leaves(shapes), dtype=object), _leaves(shardings)):
    total += math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
  return int(total)


def _leaves(tree):
  return jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, NamedSharding))


def state_bytes(config, mc, num_devices: int) -> dict:
  """Per-device bytes of the train state on `config.train.mesh` over `num_devices` devices, sharded
  as the training loop shards it: params and gradients in `train.param_dtype` (master weights),
  the optimizer's state, and the frozen copies of the params (OPD's teacher; `frozen_ref`, per RL
  stage, its starting model when it logs or trains on the KL to it). Also the mesh dims and the
  parameter count."""
  tc = config.train
  dims = mesh_lib.mesh_shape(tc.mesh, num_devices)
  mesh = AbstractMesh(tuple(dims), mesh_lib.AXES)
  rules = tuple(tc.logical_axis_rules)
  master = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[tc.param_dtype]
  shapes = qwen3.param_shapes(mc)
  shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, master), shapes)
  p_sh = mesh_lib.param_shardings(shapes, mesh, rules)
  optimizer, _ = optim.make_optimizer(tc.optimizer, int(tc.total_steps))
  o_shapes = jax.eval_shape(optimizer.init, shapes)
  o_sh = mesh_lib.opt_state_shardings(o_shapes, shapes, p_sh, mesh)
  params_b = _sharded_bytes(shapes, p_sh)
  # OPD's teacher scored in the step (teacher_cache 'none') is held in the compute dtype
  # (opd.frozen_teacher); a teacher that fills a cache stays as loaded.
  # The RL stages' starting model (kl_ref, grpo.grpo_loss's ref_params) is held the same way.
  ref_dt = mc.param_dtype if mc.dtype == "auto" else mc.dtype
  mode = section(config, "opd", opd.opd_config).get("teacher_cache", "none")
  frozen_dt = ref_dt if mode == "none" else mc.param_dtype
  in_dtype = lambda dt: params_b * memory_plan.dtype_bytes(dt) // memory_plan.dtype_bytes(tc.param_dtype)
  ref = {}
  for stage in ("teacher_rl", "rl"):
    rc = section(config, stage, grpo.rl_config)
    held = float(rc.kl_coef) > 0 or bool(rc.get("log_kl_ref", True))
    ref[stage] = in_dtype(ref_dt) if held else 0
  return {"dims": tuple(dims), "num_params": qwen3.count_params(shapes), "params": params_b,
          "optimizer": _sharded_bytes(o_shapes, o_sh), "gradients": params_b,
          "frozen": in_dtype(frozen_dt), "frozen_ref": ref}


def frozen_bytes(st: dict, stage: str) -> int:
  """Per-device bytes of the frozen params `stage`'s step holds (`state_bytes` `st`): OPD's teacher,
  the RL stages' starting model; 0 for the others."""
  return st["frozen"] if stage == "opd" else st["frozen_ref"].get(stage, 0)


def step_bytes(config, mc, stage: str, num_devices: int) -> dict:
  """One training step of `stage` per device as the dry run plans it, the rollout decode left
  out: `memory_plan.plan_stage`'s row plus the state (`state_bytes`; the frozen teacher in OPD's
  row only) and `train_step`, their sum (benchmarks/train_step.py prints it beside XLA's plan and
  the measured peak)."""
  st = state_bytes(config, mc, num_devices)
  row = memory_plan.plan_stage(config, mc, stage, st["dims"])
  row.update(params=st["params"], optimizer=st["optimizer"], gradients=st["gradients"],
             frozen_teacher=frozen_bytes(st, stage), accumulator=accumulator_bytes(st, row))
  row["train_step"] = (st["params"] + st["optimizer"] + st["gradients"] + row["accumulator"] + row["frozen_teacher"]
                       + row["total"])
  return row


def accumulator_bytes(st: dict, row: dict) -> int:
  """Gradient accumulation's sum (`loop.make_train_step`: f32, sharded as the params) beside each
  micro-batch's gradients; 0 with one micro-batch."""
  return st["gradients"] if row["micro_batches"] > 1 else 0


def decode_bytes(config, mc, rows: int, num_devices: int) -> int:
  """One decoder's params (in the compute dtype) and KV cache for `rows` rows of task.prompt_len +
  decode.max_new_tokens slots, per device on `decode.mesh` over `num_devices`: the params and the
  cache's kv heads over its tensor axis (kv heads that do not divide: replicated), rows over data."""
  from dgr2_jax.decode import mesh as dmesh
  dec = config.get("decode")
  data, tensor = dmesh.mesh_shape(dec.get("mesh", None) if dec is not None else None, num_devices)
  kv_split = tensor if mc.num_key_value_heads % tensor == 0 else 1
  kv = memory_plan.kv_cache_bytes(mc, math.ceil(rows / data), memory_plan.decode_slots(config))
  return int(qwen3.count_params(qwen3.param_shapes(mc)) * memory_plan.compute_bytes(mc) / tensor + kv / kv_split)


def plan(config) -> dict:
  mc, src = model_config_for(config)
  n_dev = int(config.hardware.num_devices) or len(platform.devices())
  tc = config.train
  st = state_bytes(config, mc, n_dev)
  dims, n_params = st["dims"], st["num_params"]
  params_b, opt_b, grads_b = st["params"], st["optimizer"], st["gradients"]
  rules = tuple(tc.logical_axis_rules)

  # Per training stage: activations, logits and teacher cache (dgr2_jax/train/memory_plan.py, the
  # formulas benchmarks/stage_memory.py checks against measurements).
  on = tuple(config.pipeline.stages) if "pipeline" in config else memory_plan.TRAIN_STAGES
  stages = []
  for st_name in memory_plan.TRAIN_STAGES:
    if st_name not in on:
      continue
    row = memory_plan.plan_stage(config, mc, st_name, dims)
    teacher = frozen_bytes(st, st_name)  # a frozen teacher/ref copy
    row["frozen_teacher"] = teacher
    row["accumulator"] = accumulator_bytes(st, row)
    row["total_train"] = params_b + opt_b + grads_b + teacher + max(row["total"] + row["accumulator"], row["decode"])
    stages.append(row)
  total = max([r["total_train"] for r in stages] or [params_b + opt_b + grads_b])

  eval_rows = int(config.eval.batch_size)
  slots = memory_plan.decode_slots(config)
  kv_b = int(memory_plan.kv_cache_bytes(mc, eval_rows, slots))
  params_infer_b = int(n_params * memory_plan.dtype_bytes(mc.param_dtype))
  cap = float(config.hardware.device_memory_gb) * 1e9
  return {
      "model_source": src, "model": {k: getattr(mc, k) for k in (
          "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "dtype", "remat", "attention_impl")},
      "num_params": n_params, "num_devices": n_dev,
      "mesh": dict(zip(mesh_lib.AXES, dims)), "logical_axis_rules": [list(r) for r in rules],
      "master_dtype": tc.param_dtype,
      "per_device_bytes": {"params": params_b, "optimizer": opt_b, "gradients": grads_b,
                           "total_train": total},
      "stages": stages,
      "inference_bytes": {"params_unsharded": params_infer_b, "kv_cache": kv_b,
                          "eval_batch": eval_rows, "slots": slots},
      "device_memory_bytes": cap or None,
      "fits": (total <= cap) if cap else None,
  }


def format_plan(p: dict) -> str:
  g = lambda b: f"{b / GIB:8.2f} GiB" if b >= GIB / 10 else f"{b / 2**20:8.2f} MiB"
  m = p["model"]
  pd = p["per_device_bytes"]
  lines = [
      f"model ({p['model_source']}): {p['num_params'] / 1e6:,.1f} M params; hidden "
      f"{m['hidden_size']}, layers {m['num_hidden_layers']}, heads {m['num_attention_heads']}/"
      f"{m['num_key_value_heads']}, head_dim {m['head_dim']}, vocab {m['vocab_size']}, "
      f"compute {m['dtype']}, remat {m['remat']}, attention {m['attention_impl']}",
      f"mesh over {p['num_devices']} devices: " + " x ".join(f"{k}={v}" for k, v in p["mesh"].items()),
      f"per-device memory (train; master weights {p['master_dtype']}):",
      f"  params       {g(pd['params'])}",
      f"  optimizer    {g(pd['optimizer'])}",
      f"  gradients    {g(pd['gradients'])}",
  ]
  cap = p["device_memory_bytes"]
  if p["stages"]:
    lines.append("  per training stage (rows x sequence per device and micro-batch; logits in chunks of positions):")
    lines.append(f"    {'stage':<11}{'rows x T':>13}{'activations':>14}{'logits':>13}{'teacher cache':>15}"
                 f"{'other':>13}{'rollout decode':>16}{'total':>13}  fits")
    for r in p["stages"]:
      fits = "-" if not cap else ("yes" if r["total_train"] <= cap else "NO")
      other = r["accumulator"] + r["attention_copies"] + r["embedding_gradient"] + r["xla_tpu"]
      lines.append(f"    {r['stage']:<11}{str(r['rows_per_device']) + ' x ' + str(r['sequence']):>13}"
                   f"{g(r['activations']):>14}{g(r['logits']):>13}{g(r['teacher_cache']):>15}{g(other):>13}"
                   f"{g(r['decode']):>16}{g(r['total_train']):>13}  {fits}")
    lines.append("    (other: gradient accumulation's sum, the input embedding's dense gradient and, on the cuDNN "
                 "route, the multi-stream layout's context copies; on a TPU, what XLA:TPU holds beyond these: "
                 "dgr2_jax/train/memory_plan.py)")
  lines.append(f"  total (largest stage) {g(pd['total_train'])}")
  if cap:
    lines.append(f"  device       {g(cap)}  -> {'fits' if p['fits'] else 'DOES NOT FIT'} "
                 f"({100 * pd['total_train'] / cap:.0f}% used by the largest stage)")
  inf = p["inference_bytes"]
  lines.append(f"inference: params {g(inf['params_unsharded'])} unsharded, KV cache "
               f"{g(inf['kv_cache'])} for {inf['eval_batch']} rows x {inf['slots']} slots")
  return "\n".join(lines)
