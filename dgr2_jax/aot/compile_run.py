"""Every program a run executes, compiled ahead of time for a target: the dry run's
`hardware.compile_for`.

  python -m dgr2_jax.main --config=configs/beauty_qwen3_8b.py --config.dry_run=True \
      --config.hardware.compile_for=h100x8
  python -m dgr2_jax.main --config=configs/beauty_qwen3_8b.py --config.dry_run=True \
      --config.hardware.compile_for=v5p-16 --config.hardware.compile_report=/tmp/v5p16.json

Inside `targets.compile_for(target)` (every route choice and mesh follows the target) and from
shapes (nothing is allocated), through the code a run takes:
  * each enabled training stage's step as `loop.train` jits it (`loop.abstract_step`): the loss the
    stage builds (`loss_for` of stages/sft.py, cft.py, opd.py, rl.py), its train section (batch
    rows, gradient accumulation, optimizer), the shardings of `train.mesh` and
    `train.logical_axis_rules`, the donated state, and the frozen copy the stage passes (OPD's
    teacher with `opd.teacher_cache` 'none', the GRPO stages' starting model with a KL to it). The
    batch is the one the stage feeds at its largest (replay: `replay_max_segments` canvases per
    block, else one per position);
  * each on-policy stage's rollouts decoder (`sampler.decoder_for` over the train state's params,
    as `rollouts.sample` calls it, `rollout_batch_size` rows a call) and, where `opd.teacher_cache`
    keeps a cache, the teacher's scorer;
  * eval's decoders on `decode.mesh` (the ladder's rows, `pipeline.method_config`: the AR teacher
    left to right, the final model's threshold decoding, the speculative pair), their params
    prepared as `runtime.load_on_device` prepares them;
  * the server's slot engine (serve/slots.py: a prompt's prefill into a slot, a round of steps) on
    one device with `ServeOptions`' slots, the final model's decode config.
The model is `model.init_from`'s config.json when set, else the `model` section (`dry_run`).

Per program: XLA's memory plan per device (`hlo.Memory`: arguments, outputs, temporaries, aliased;
`needed` = its peak, plus for a rollouts decoder the optimizer state and frozen copies the devices
hold meanwhile), the dry run's plan of the same (`dry_run.step_bytes` for a step; the stage's
rollout decode row; params + KV cache for a decoder), whether `needed` fits the target's memory,
the collectives (and how many a loop body runs), the custom calls, the attention route they show
(`route`) and the compile time. `compile_programs(..., layers=(2, 3))` compiles each program at two
depths and extrapolates every per-device figure linearly to the model's depth (what
benchmarks/compile_targets.py does to keep compile time down).

What compiling without the device cannot show: XLA autotunes nothing (it keeps its default GEMM and
fusion configurations, so temporaries can differ from an on-device compile), and nothing is timed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from dgr2_jax import chain
from dgr2_jax import platform
from dgr2_jax.aot import hlo, targets
from dgr2_jax.decode import mesh as dmesh
from dgr2_jax.decode import runtime, sampler, speculative
from dgr2_jax.model import qwen3
from dgr2_jax.serve import service as service_lib
from dgr2_jax.serve import slots as slots_lib
from dgr2_jax.stages import cft as cft_stage
from dgr2_jax.stages import on_policy, pipeline
from dgr2_jax.stages import opd as opd_stage
from dgr2_jax.stages import rl as rl_stage
from dgr2_jax.stages import sft as sft_stage
from dgr2_jax.stages import teacher_rl as teacher_rl_stage
from dgr2_jax.task.tokenizer import TokenIds
from dgr2_jax.train import dry_run, grpo, loop, opd
from dgr2_jax.train.config import section

GIB = 2**30
sd = jax.ShapeDtypeStruct
DoesNotFit = targets.DoesNotFit


# ---- the training stages, as their steps are built ----------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StageStep:
  """One training stage's step from shapes, as the stage builds it."""
  name: str
  config: Any              # the config whose `train` section drives the step
  loss_fn: Callable
  params: Any              # ShapeDtypeStructs of the params the stage trains (in the layout it trains in)
  batch: dict              # ShapeDtypeStructs of one step's batch (global rows)
  frozen: Any = None       # of the frozen copy the step scores, or None
  policy: Any = None       # on-policy: the model config the rollouts decode with
  decode: Any = None       # on-policy: their DecodeConfig
  rows_per_call: int = 0   # on-policy: rollout rows per decoder call
  scorer: Any = None       # OPD with a teacher cache: (jitted scorer, its argument shapes but the params, params)


def token_ids(mc) -> TokenIds:
  """Stand-in tokenizer ids for a dry run (no tokenizer is read): the model config's."""
  eos = mc.eos_ids[0] if mc.eos_ids else 0
  pad = mc.pad_token_id if mc.pad_token_id is not None else 0
  return TokenIds(pad_id=pad, eos_id=eos, im_start_id=0, mask_id=mc.mask_token_id, think_id=0, end_think_id=0)


def model_config(config):
  """(the model a run starts from, where it came from): `dry_run.model_config_for` with the ids a
  tokenizer would give (mask: the model's, else the vocabulary's last id)."""
  mc, src = dry_run.model_config_for(config)
  mask = mc.mask_token_id if mc.mask_token_id is not None else mc.vocab_size - 1
  return mc.replace(mask_token_id=mask, eos_token_id=mc.eos_token_id if mc.eos_token_id is not None else 0,
                    pad_token_id=mc.pad_token_id if mc.pad_token_id is not None else 0), src


def _lens(config) -> tuple[int, int]:
  return int(config.task.prompt_len), int(config.task.response_len)


def _i32(*shape):
  return sd(shape, jnp.int32)


def traces_batch(rows: int, p: int, r: int) -> dict:
  """A batch of the traces split (task/pipeline.py's rows): SFT's and CFT's."""
  return dict(prompt_ids=_i32(rows, p), prompt_len=_i32(rows), response_ids=_i32(rows, r),
              response_mask=_i32(rows, r), reasoning_mask=_i32(rows, r), answer_mask=_i32(rows, r))


def replay_batch(rows: int, p: int, r: int, block_size: int, max_segments: int) -> dict:
  """The replay fields of an on-policy batch at their largest (`rollouts.replay_inputs`: up to
  `max_segments` canvases per block, 0 = one per position, rounded to a power of two)."""
  bs = int(block_size)
  cap = min(int(max_segments) or bs, 1 << (bs - 1).bit_length())
  return dict(prompt=_i32(rows, p), prompt_len=_i32(rows), clean=_i32(rows, r),
              seg_tokens=_i32(rows, (r // bs) * cap, bs), pred_seg=_i32(rows, r), loss_mask=sd((rows, r), jnp.bool_))


def _shapes(mc):
  return qwen3.param_shapes(mc)


def sft_step(config, mc) -> StageStep:
  p, r = _lens(config)
  return StageStep("sft", config, sft_stage.loss_for(mc, config.train.sft), _shapes(mc),
                   traces_batch(int(config.train.batch_size), p, r))


def cft_step(config, mc) -> StageStep:
  cc = config.cft
  tconf = cft_stage.stage_train_config(config, cc, int(config.train.batch_size))
  m = mc.as_block_diffusion(int(cc.block_size), mc.mask_token_id).with_runtime(config.get("model"))
  p, r = _lens(config)
  return StageStep("cft", tconf, cft_stage.loss_for(cc, m, m.mask_token_id, choice_id=0), _shapes(m),
                   traces_batch(int(tconf.train.batch_size), p, r))


def grpo_step(config, mc, stage: str) -> StageStep:
  """teacher_rl's or rl's step (stages/rl.py `train_grpo`)."""
  rc = section(config, stage, grpo.rl_config)
  c = rl_stage.with_decode(config, teacher_rl_stage.AR_ROLLOUTS if stage == "teacher_rl" else None)
  dc = on_policy.rollout_decode_config(c, token_ids(mc), mc, rc.temperature)
  policy = mc.as_block_diffusion(dc.block_size, dc.mask_token_id)
  tconf = rl_stage.step_config(c, rc)
  params = _shapes(policy)
  frozen = jax.eval_shape(functools.partial(opd.frozen_teacher, policy), params) if rl_stage.keeps_ref(rc) else None
  rows, (p, r) = int(tconf.train.batch_size), _lens(c)
  batch = dict(replay_batch(rows, p, r, dc.block_size, rc.replay_max_segments),
               old_logp=sd((rows, r), jnp.float32), advantages=sd((rows,), jnp.float32))
  per_call = int(rc.get("rollout_batch_size", 0)) or int(rc.prompts_per_step) * int(rc.group_size)
  return StageStep(stage, tconf, rl_stage.loss_for(rc, policy, dc), params, batch, frozen, policy, dc, per_call)


def opd_step(config, mc) -> StageStep:
  """OPD's step (stages/opd.py `distillation`); the AR teacher is the model's architecture."""
  oc = section(config, "opd", opd.opd_config)
  dc = on_policy.rollout_decode_config(config, token_ids(mc), mc, oc.temperature)
  student = mc.as_block_diffusion(dc.block_size, dc.mask_token_id)
  ar = mc.as_block_diffusion(1)
  teacher = ar if oc.teacher == "ar" else None
  mode, rows = str(oc.teacher_cache), int(oc.prompts_per_step) * int(oc.rollouts_per_prompt)
  tconf = on_policy.on_policy_config(config, rows=rows, steps=max(int(oc.steps), 1), lr=oc.lr,
                                     grad_accum=oc.grad_accum_steps)
  params, tparams = _shapes(student), _shapes(ar)
  frozen = jax.eval_shape(functools.partial(opd.frozen_teacher, ar), tparams) if mode == "none" else None
  p, r = _lens(config)
  batch = replay_batch(rows, p, r, dc.block_size, oc.replay_max_segments)
  per_call = int(oc.get("rollout_batch_size", 0)) or rows
  scorer = None
  if mode != "none":
    top_k = int(oc.teacher_top_k) if mode == "topk" else 0
    score = jax.jit(functools.partial(opd.ar_teacher_cache, ar, top_k=top_k, mask_id=dc.mask_token_id))
    batch.update(jax.eval_shape(score, tparams, batch["prompt"], batch["prompt_len"], batch["clean"]))
    scorer = (score, (_i32(per_call, p), _i32(per_call), _i32(per_call, r)), tparams)
  loss = opd_stage.loss_for(oc, student, teacher, dc.mask_token_id, choice_id=0)
  return StageStep("opd", tconf, loss, params, batch, frozen, student, dc, per_call, scorer)


STEPS = {"sft": sft_step, "cft": cft_step, "opd": opd_step,
         "teacher_rl": functools.partial(grpo_step, stage="teacher_rl"), "rl": functools.partial(grpo_step, stage="rl")}


# ---- programs ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Job:
  """One program to compile: `build()` (inside the target's block) -> (jitted fn, argument shapes,
  bytes the devices hold beside the program meanwhile)."""
  name: str
  stage: str
  kind: str                  # 'step' | 'rollouts' | 'scorer' | 'decoder' | 'server'
  build: Callable


def device_bytes(tree) -> int:
  """Bytes per device of ShapeDtypeStructs (sharded ones: their largest shard)."""
  total = 0
  for x in jax.tree_util.tree_leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    total += math.prod(shape) * np.dtype(x.dtype).itemsize
  return int(total)


def _scalars(sharding=None) -> tuple:
  """threshold, temperature, top_k, top_p, rng, steps_per_block: a decoder call's traced settings."""
  kw = {} if sharding is None else {"sharding": sharding}
  return (sd((), jnp.float32, **kw), sd((), jnp.float32, **kw), sd((), jnp.int32, **kw), sd((), jnp.float32, **kw),
          sd((2,), jnp.uint32, **kw), sd((), jnp.int32, **kw))


def _placed(tree, shardings):
  return jax.tree_util.tree_map(lambda x, s: sd(x.shape, x.dtype, sharding=s), tree, shardings)


def step_jobs(config, mc, stage: str) -> list[Job]:
  """A training stage's step and, on-policy, its rollouts decoder (and OPD's teacher scorer)."""
  st = STEPS[stage](config, mc)

  def abstract():
    return loop.abstract_step(st.config, st.params, st.loss_fn, st.frozen)

  def step():
    a = abstract()
    batch = {k: sd(v.shape, v.dtype, sharding=a.batch_sharding) for k, v in st.batch.items()}
    return a.fn, (a.state, batch) + ((a.frozen,) if a.frozen is not None else ()), 0

  def rollouts():
    a = abstract()
    mesh = a.batch_sharding.mesh
    # One process: the prompts are host arrays (replicated); several: each process's rows of one
    # global batch over the params' data x fsdp axes (`rollouts.global_rows_sharding`).
    axes = tuple(x for x in ("data", "fsdp") if mesh.shape[x] > 1) if platform.process_count() > 1 else ()
    rows, rep = NamedSharding(mesh, P(axes or None)), NamedSharding(mesh, P())
    p = int(st.config.task.prompt_len)
    _, fn = sampler.decoder_for(st.policy, st.decode, None)
    args = (a.state["params"], sd((st.rows_per_call, p), jnp.int32, sharding=rows),
            sd((st.rows_per_call,), jnp.int32, sharding=rows)) + _scalars(rep)
    return fn, args, device_bytes(a.state["opt_state"]) + device_bytes(a.frozen or {})

  def scorer():
    score, args, tparams = st.scorer
    return score, (tparams,) + args, 0

  jobs = [Job(f"{stage} step", stage, "step", step)]
  if st.policy is not None:
    jobs.append(Job(f"{stage} rollouts", stage, "rollouts", rollouts))
  if st.scorer is not None:
    jobs.append(Job(f"{stage} teacher scorer", stage, "scorer", scorer))
  return jobs


def prepared(mc, weight_dtype: str):
  """ShapeDtypeStructs of the params a decoder is handed (`runtime.load_on_device`: read in the
  compute dtype, per layer, projections fused, kernels in `weight_dtype`)."""
  c = mc.replace(scan_layers=False)
  if c.dtype != "auto":
    c = c.replace(param_dtype=c.dtype)
  return jax.eval_shape(lambda p: qwen3.decode_params(c, p, weight_dtype), qwen3.param_shapes(c))


def _eval_models(config, mc):
  """(name, ladder method, the stage whose model it decodes, its model config) of eval's decoders."""
  final_stage = chain.final_model_stage(config) or "cft"
  final = mc.as_block_diffusion(int(config.cft.block_size), mc.mask_token_id).with_runtime(config.get("model"))
  return (("eval ar", "ar", "sft", mc), ("eval threshold", final_stage, final_stage, final),
          ("speculative", "speculative", final_stage, final))


def decoder_jobs(config, mc, evaluates: bool = True) -> list[Job]:
  """Eval's decoders on `decode.mesh` (`evaluates`) and the server's slot engine."""
  tids, wd = token_ids(mc), runtime.weight_dtype(config)
  rows, p = int(config.eval.batch_size), int(config.task.prompt_len)
  jobs = []
  for name, method, stage, model in _eval_models(config, mc) if evaluates else ():
    c = pipeline.method_config(config, "", method, stage)

    def build(c=c, model=model, method=method):
      dc = runtime.decode_config(c, tids, model)
      mesh = dmesh.from_config(c)
      n = -(-rows // dmesh.data_size(mesh)) * dmesh.data_size(mesh)
      put = (lambda t: t) if mesh is None else (lambda t: _placed(t, dmesh.param_shardings(mesh, t)))
      row = (lambda *s: sd(s, jnp.int32)) if mesh is None else (
          lambda *s: sd(s, jnp.int32, sharding=dmesh.sharding(mesh, ("batch",) + (None,) * (len(s) - 1), s)))
      prefix_len = min(max(int(dc.shared_prefix), 0), p - 1)
      if method == "speculative":
        fn = speculative.decoder_for(model, mc, dc, mesh=mesh, prefix_len=prefix_len)
        return fn, (put(prepared(model, wd)), put(prepared(mc, wd)), row(n, p), row(n)) + _scalars(), 0
      _, fn = sampler.decoder_for(model, dc, mesh, prefix_len)
      return fn, (put(prepared(model, wd)), row(n, p), row(n)) + _scalars(), 0
    jobs.append(Job(name, "eval", "decoder", build))
  final = _eval_models(config, mc)[1][3]
  slots = service_lib.ServeOptions().slots

  def server(which):
    dec = slots_lib.SlotDecoder(final, prepared(final, wd), runtime.decode_config(config, tids, final), slots, p)
    state = jax.eval_shape(dec.init_state)
    if which == "prefill":
      return dec._prefill, (dec.params, state, _i32(), _i32(dec.p), _i32(), sd((), jnp.float32),
                            sd((2,), jnp.uint32), _i32()), 0
    return dec._step, (dec.params, state, _i32(), sd((), jnp.float32), _i32(), sd((), jnp.float32), _i32(),
                       sd((), jnp.bool_)), 0
  jobs += [Job(f"server {w}", "serve", "server", functools.partial(server, w)) for w in ("prefill", "step")]
  return jobs


def jobs_for(config, mc, only: tuple = ()) -> list[Job]:
  """Every program a run of `config` executes (module docstring): the enabled training stages',
  eval's decoders when the pipeline evaluates, the server's; `only`: those of these names."""
  on = tuple(config.pipeline.stages) if "pipeline" in config else ()
  jobs = []
  for stage in ("sft", "teacher_rl", "cft", "opd", "rl"):
    if (stage in on or not on) and (not only or any(n.startswith(stage + " ") for n in only)):
      jobs += step_jobs(config, mc, stage)
  jobs += decoder_jobs(config, mc, evaluates=not on or "eval" in on or "bench" in on)
  return [j for j in jobs if not only or j.name in only]


def plan_bytes(config, mc, job: Job, t: targets.Target) -> int | None:
  """The dry run's plan of what `job` needs per device of target `t`, with the routes and compiler
  `t` takes: a step's `dry_run.step_bytes`; a rollouts decoder's train state, frozen copies and
  decode row (`memory_plan.plan_stage`); a decoder's params and KV cache (`dry_run.decode_bytes`;
  the speculative pair: both models')."""
  with platform.target(t.backend, name=t.name):
    return _plan_bytes(config, mc, job, t.num_devices)


def _plan_bytes(config, mc, job: Job, num_devices: int) -> int | None:
  if job.kind == "step":
    return dry_run.step_bytes(config, mc, job.stage, num_devices)["train_step"]
  if job.kind == "rollouts":
    row = dry_run.step_bytes(config, mc, job.stage, num_devices)
    return row["params"] + row["optimizer"] + row["frozen_teacher"] + row["decode"]
  if job.kind == "decoder":
    one = dry_run.decode_bytes(config, mc, int(config.eval.batch_size), num_devices)
    return 2 * one if job.name == "speculative" else one
  if job.kind == "server":
    return dry_run.decode_bytes(config, mc, service_lib.ServeOptions().slots, 1)
  return None


# ---- compiling and reading -------------------------------------------------------------------------
def kernels(text: str) -> list[str]:
  """The Pallas kernels an optimised module calls, by name: a Triton call's `name` (GPU), a Mosaic
  call's instruction (TPU: 'splash_mha_fwd...', 'flash_attention...')."""
  comps, _ = hlo.parse(text)
  found = set()
  for insts in comps.values():
    for ins in insts:
      if ins.opcode != "custom-call":
        continue
      if '"__gpu$xla.gpu.triton"' in ins.attrs:
        names = re.findall(r'name = \\*"([\w.-]+)', ins.attrs)
        found.add(names[-1] if names else "triton")
      elif '"tpu_custom_call"' in ins.attrs:
        found.add(re.sub(r"\.\d+$", "", ins.name))
  return sorted(found)


# Kernel name prefixes -> the route (model/attention.py) they belong to.
ROUTES = (("split_key_decode_attention", "splitkey"), ("splash_mha", "splash"), ("range_flash_forward_tpu", "interval"),
          ("range_flash_dq_tpu", "interval"), ("range_flash_dkv_tpu", "interval"), ("range_flash", "pallas"))


def route(prog: hlo.Program) -> str:
  """The attention routes a compiled program shows: 'cudnn' (cuDNN's fused attention), 'splitkey'
  (the split-key decode kernel), 'pallas' (the block-sparse Triton kernels), 'splash' and
  'interval' (the TPU kernels of 'pallas_tpu'), another kernel by its name; 'xla' when it calls
  none (XLA's own ops: the dense or blockwise routes)."""
  found = {"cudnn"} if any(k.startswith("__cudnn$fmha") for k in prog.custom_calls) else set()
  for name in kernels(prog.text):
    found.add(next((r for prefix, r in ROUTES if name.startswith(prefix)), name))
  return "+".join(sorted(found)) or "xla"


def _with_layers(config, layers: int):
  """`config` whose model section has `layers` layers (a model read from `model.init_from` cannot
  change depth here: ValueError)."""
  if config.model.get("init_from", ""):
    raise ValueError("layers: compiling at another depth needs the model section's architecture, not "
                     "model.init_from")
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.model.num_hidden_layers = int(layers)
  return c


def for_target(config, t: targets.Target):
  """`config` with the dry run's devices and memory from target `t`."""
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.hardware.num_devices = t.num_devices
    c.hardware.device_memory_gb = t.memory_bytes / 1e9
  return c


def _compile(job: Job) -> tuple[hlo.Program, int]:
  fn, args, resident = job.build()
  prog = hlo.compile_program(fn, *args, name=job.name)
  return prog, resident


_REFUSED = re.compile(r"RESOURCE_EXHAUSTED: Ran out of memory.*?required for ([^(]*)\((\d+(?:\.\d+)?)([KMGT])\)", re.S)


def refused_bytes(error: Exception) -> tuple[int, str] | None:
  """(bytes, what) of a compile the target's compiler refused for want of device memory (XLA:TPU
  checks at compile time: "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm ... the total
  memory required for HLO temporaries (36.72G) exceeds available HBM (31.25G)"), else None."""
  m = _REFUSED.search(str(error))
  if not m:
    return None
  return int(float(m.group(2)) * 1024 ** "KMGT".index(m.group(3)) * 1024), m.group(1).strip()


def plan_for_target(config, t: targets.Target, job: Job) -> int | None:
  """`plan_bytes` of `job` on target `t` (its devices, its memory, the routes it takes)."""
  config = for_target(config, t)
  return plan_bytes(config, model_config(config)[0], job, t)


def _refused_row(config, mc, t: targets.Target, job: Job, depth: int, needed: int, what: str, seconds: float) -> dict:
  """The row of a program the target's compiler refused: it does not fit, `needed` (what the
  compiler says the `what` alone require, a lower bound) beside the plan."""
  plan = plan_bytes(config, mc, job, t)
  return dict(program=job.name, stage=job.stage, kind=job.kind, target=t.name, platform=t.backend,
              devices=t.num_devices, model_layers=mc.num_hidden_layers, compiled_layers=[depth],
              memory={k: None for k in ("arguments", "outputs", "temporaries", "aliased", "peak")},
              resident=None, needed=needed, plan=plan, plan_over_needed=None, device_memory=t.memory_bytes,
              fits=False, attention="-", kernels=[], collectives={}, custom_calls={}, flops=None,
              bytes_accessed=None, cost_source=None, compile_s=round(seconds, 1),
              refused=f"the compiler refused it: {what} alone need {needed / GIB:.2f} GiB")


def _numbers(prog: hlo.Program, resident: int) -> dict:
  m = prog.memory
  return dict(arguments=m.arguments, outputs=m.outputs, temporaries=m.temporaries, aliased=m.aliased,
              peak=m.peak, resident=resident, needed=m.peak + resident, flops=prog.flops,
              bytes_accessed=prog.bytes_accessed)


def _extrapolate(runs: list, layers: int) -> dict:
  """Per-device figures at `layers` layers, linear in the depth through the two compiled ones."""
  (l0, n0), (l1, n1) = [(d, _numbers(p, r)) for d, p, r in runs[:2]]
  return {k: int(round(n1[k] + (layers - l1) * (n1[k] - n0[k]) / (l1 - l0))) if isinstance(n1[k], int)
          else n1[k] + (layers - l1) * (n1[k] - n0[k]) / (l1 - l0) for k in n1}


def compile_programs(config, target, layers: tuple = (), progress=print, full_depth: tuple = (),
                     only: tuple = ()) -> list[dict]:
  """Compiles every program of `config` for `target` (a name or `targets.Target`) -> one row per
  program (module docstring). `layers`: one depth to compile at (the model, and its plan, at that
  depth), or two from which each per-device figure is extrapolated to the model's depth; () = the
  model's own depth. Programs of the kinds in `full_depth` ('step': a scanned stack compiles in
  the same time at any depth) compile at the model's depth whatever `layers` says. `only`: the
  programs of these names (default every one)."""
  t = targets.resolve(target) if isinstance(target, str) else target
  config = for_target(config, t)
  mc, _ = model_config(config)
  depths = tuple(int(x) for x in layers) or (mc.num_hidden_layers,)
  if len(depths) not in (1, 2) or (len(depths) == 2 and depths[0] == depths[1]):
    raise ValueError(f"layers: give one depth, or two different depths to extrapolate from, got {layers}")
  if len(depths) == 1:   # every program at that depth (the model, and its plan, at that depth)
    if depths[0] != mc.num_hidden_layers:
      mc = mc.replace(num_hidden_layers=depths[0])
      config = _with_layers(config, depths[0])
    passes = [(depths[0], lambda j: True)]
  else:
    passes = [(d, lambda j: j.kind not in full_depth) for d in depths]
    if full_depth:
      passes.insert(0, (mc.num_hidden_layers, lambda j: j.kind in full_depth))
  runs: dict = {}
  refused: dict = {}   # name -> the row of a program the target's compiler refused (XLA:TPU: out of HBM)
  for depth, wanted in passes:
    at = f" at {depth} layers" if layers else ""
    with targets.compile_for(t):
      for job in filter(wanted, jobs_for(config, mc.replace(num_hidden_layers=depth), only)):
        if job.name in refused:
          continue
        progress(f"compiling {job.name} for {t.name}{at} ...")
        start = time.perf_counter()
        try:
          prog, resident = _compile(job)
        except jax.errors.JaxRuntimeError as e:
          over = refused_bytes(e)
          if over is None:
            raise
          refused[job.name] = _refused_row(config, mc, t, job, depth, *over, time.perf_counter() - start)
          progress(f"  {job.name}: does not fit ({refused[job.name]['refused']})")
          continue
        runs.setdefault(job.name, (job, []))[1].append((depth, prog, resident))
        progress(f"  {job.name}: {(prog.memory.peak + resident) / GIB:.2f} GiB per device, {route(prog)}, "
                 f"compiled in {prog.lower_s + prog.compile_s:.1f} s")
  order = [j.name for j in jobs_for(config, mc, only)]
  return [refused[name] if name in refused else _row(config, mc, t, *runs[name])
          for name in order if name in runs or name in refused]


def _row(config, mc, t: targets.Target, job: Job, runs: list) -> dict:
  depth, prog, resident = runs[-1]
  nums = _extrapolate(runs, mc.num_hidden_layers) if len(runs) == 2 else _numbers(prog, resident)
  plan = plan_bytes(config, mc, job, t)
  return dict(program=job.name, stage=job.stage, kind=job.kind, target=t.name, platform=prog.platform,
              devices=prog.devices, model_layers=mc.num_hidden_layers, compiled_layers=[d for d, _, _ in runs],
              memory={k: nums[k] for k in ("arguments", "outputs", "temporaries", "aliased", "peak")},
              resident=nums["resident"], needed=nums["needed"], plan=plan,
              plan_over_needed=None if not plan else round(plan / max(nums["needed"], 1), 4),
              device_memory=t.memory_bytes, fits=nums["needed"] <= t.memory_bytes, attention=route(prog),
              kernels=kernels(prog.text),
              collectives=prog.row()["collectives"], custom_calls=prog.custom_calls, flops=nums["flops"],
              bytes_accessed=nums["bytes_accessed"], cost_source=prog.cost_source,
              compile_s=round(sum(p.lower_s + p.compile_s for _, p, _ in runs), 1))


# ---- the report -------------------------------------------------------------------------------------
_SHORT = {"all-gather": "ag", "all-reduce": "ar", "reduce-scatter": "rs", "all-to-all": "a2a",
          "collective-permute": "cp"}


def collectives_text(row: dict) -> str:
  """'ag 12 (4 in a loop), rs 3': the collectives by op."""
  parts = []
  for op, c in row["collectives"].items():
    loop_note = f" ({c['in_loop']} in a loop)" if c["in_loop"] else ""
    parts.append(f"{_SHORT.get(op, op)} {c['count']}{loop_note}")
  return ", ".join(parts) or "none"


def format_table(rows: list[dict]) -> str:
  """The compiled programs, per device (GiB), one line each."""
  g = lambda b: "-" if b is None else f"{b / GIB:.2f}"
  head = (f"{'program':<24}{'args':>8}{'temp':>8}{'needed':>9}{'plan':>8}{'plan/need':>10}  {'fits':<5}"
          f"{'attention':<28}{'compile s':>10}  collectives")
  lines = [head]
  for r in rows:
    m = r["memory"]
    ratio = "-" if r["plan_over_needed"] is None else f"{r['plan_over_needed']:.2f}"
    lines.append(f"{r['program']:<24}{g(m['arguments']):>8}{g(m['temporaries']):>8}{g(r['needed']):>9}"
                 f"{g(r['plan']):>8}{ratio:>10}  {'yes' if r['fits'] else 'NO':<5}{r['attention'][:27]:<28}"
                 f"{r['compile_s']:>10.1f}  {collectives_text(r)}")
  return "\n".join(lines)


def report(config, rows: list[dict], t: targets.Target) -> dict:
  """The JSON a compile writes: the target, the model, where it was compiled, the programs."""
  from dgr2_jax import results
  mc, src = model_config(config)
  return dict(target=t.name, backend=t.backend, devices=t.num_devices, processes=t.processes,
              device_memory=t.memory_bytes, model_source=src, model_layers=mc.num_hidden_layers,
              git_commit=results.git_commit(), jax_version=jax.__version__, machine=results.machine_info(),
              programs=rows)


def check_fits(rows: list[dict], t: targets.Target) -> None:
  """DoesNotFit (one line) naming the first program that needs more than a device has."""
  over = [r for r in rows if not r["fits"]]
  if over:
    r = over[0]
    more = f" (and {len(over) - 1} more programs)" if len(over) > 1 else ""
    least = "at least " if r.get("refused") else ""
    raise DoesNotFit(f"{r['program']} does not fit {t.name}: it needs {least}{r['needed']} bytes "
                     f"({r['needed'] / GIB:.2f} GiB) per device, a device has {t.memory_bytes} bytes "
                     f"({t.memory_bytes / GIB:.2f} GiB){more}")


def run(config, workdir: str | None = None) -> str:
  """The dry run with `hardware.compile_for`: the plan for the target, then every program compiled
  (one progress line each), the table, and the JSON report (`hardware.compile_report`, else
  `<workdir>/compile_<target>.json`). Raises `DoesNotFit` after the table when a program does not
  fit, `targets.TargetError` (one line) for an unknown target or a missing compiler."""
  t = targets.resolve(config.hardware.compile_for)
  targets.devices(t)   # a missing compiler: one line before any work
  with platform.target(t.backend, name=t.name):
    text = dry_run.format_plan(dry_run.plan(for_target(config, t)))
  print(text, flush=True)
  rows = compile_programs(config, t, progress=lambda line: print(line, flush=True))
  table = format_table(rows)
  print(f"\ncompiled for {t.name} ({t.num_devices} x {t.chip}, {t.processes} host(s), "
        f"{t.memory_bytes / GIB:.1f} GiB per device), per device, GiB:\n{table}", flush=True)
  path = config.hardware.get("compile_report", "") or (
      os.path.join(workdir, f"compile_{t.name}.json") if workdir else "")
  if path:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
      json.dump(report(config, rows, t), f, indent=1)
    print(f"wrote {path}", flush=True)
  check_fits(rows, t)
  return text + "\n" + table
