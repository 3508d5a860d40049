"""Training-step time, MFU and memory (measured, XLA's plan, the dry run's plan) of SFT, CFT and OPD.

  python benchmarks/train_step.py                                   # tiny model on whatever devices exist
  python benchmarks/train_step.py --preset=0p6b_like --remat_policies=nothing_saveable,dots_saveable \\
      --json_out=/tmp/train_step.json                               # Qwen3-0.6B shape, seq 2048, bf16
  python benchmarks/train_step.py --preset=1p7b_like --steps=1 --warmup=1   # the largest shape one GPU trains
  python benchmarks/train_step.py --preset=8b_like --compile_only --scan=both   # CPU: compile time from shapes

Times the real jitted `loop.make_train_step` (loss + grads + AdamW, state donated) on synthetic
batches with every slot real, after a compile (reported separately) and warmup steps. The state is
what training holds: f32 master weights and f32 Adam moments (`train.param_dtype`), the model
computing in the preset's dtype (bf16 for the real shapes); OPD's frozen teacher is held in the
compute dtype (`opd.frozen_teacher`). Each row reports the dtypes it found (`master_dtypes`,
`opt_state_dtypes`, `teacher_dtypes`) and the operand dtypes of the lowered program's matmuls
(`dot_operand_dtypes`), so a row shows what the step computed in.

One row per (scan setting, loss, remat policy); `--remat_policies` names entries of
`qwen3.REMAT_POLICIES` or 'none' (no rematerialisation). With more than one row and a run (not
`--compile_only`), each row runs in its own process (`--isolate`): a device's peak memory counter
only grows, so one process per row is what makes the peak that row's. Columns:
  step ms       mean wall time of a step
  tokens/s      example tokens (b * (P + R)) per second
  model tok/s   tokens the model actually runs (SFT: P + R; CFT two-stream: P + 2R; OPD: the
                replay layout P + R + canvases, plus the teacher's P + R forward)
  MFU           (6 N + attention) FLOPs of the model tokens / step time / peak FLOP/s, where N
                counts the matmul parameters (the embedding lookup is not a matmul; the tied LM
                head is) and attention counts 12 x head_dim x heads per visible (query, key) pair
                of the layout's mask (forward 4, backward 8: what a kernel that skips masked
                blocks computes; the dense 'xla' route computes every pair), OPD's teacher 2 N
                per token (forward only); only when the peak is known (--peak_tflops or the table).
                Model FLOPs: rematerialisation's recompute is not counted.
  peak GiB      GPU: `memory_stats()['peak_bytes_in_use']` of the row's process (peak_source
                'device'); elsewhere XLA's plan below (peak_source 'planned')
  XLA GiB       the compiled step's `memory_analysis()`: argument + output + temp - alias bytes
                (the donated state's outputs alias its arguments), each part also in the JSON
  plan GiB      the dry run's plan of the same step (`dry_run.step_bytes`: state + activations +
                logits by `train/memory_plan.py`'s formulas); plan/peak is that over peak GiB
  compile s     lowering + compilation of the step
`--compile_only` lowers and compiles from ShapeDtypeStructs (nothing allocated, any shape on any
machine) and reports compile time and both plans. `--segment_groups=one` runs the 'cudnn' route's
replay segments in one call, as before they were grouped (model/attention.py), for an A/B.
`--json_out` writes {device, jax_version, git_commit, argv, rows}; a row's fields: loss, scan,
remat_policy, params, batch, seq, compute_dtype, master_dtypes, opt_state_dtypes, teacher_dtypes,
dot_operand_dtypes, attention, segment_groups, compile_s, xla_{argument,output,temp,alias,planned}_gib,
plan_gib, and for a run step_ms, tok_s, model_tok_s, mfu, final_loss, peak_gib, peak_source,
plan_over_peak; every row also carries device, jax_version and git_commit ($GIT_COMMIT or $DGR2_GIT_COMMIT, else
`git`, else 'unknown'); a row whose process failed has `error` instead.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dgr2_jax import results  # noqa: E402
from dgr2_jax.aot import hlo  # noqa: E402
from dgr2_jax.model import attention, masks, qwen3, streams  # noqa: E402
from dgr2_jax.model.config import Qwen3Config  # noqa: E402
from dgr2_jax.train import config as train_config_lib  # noqa: E402
from dgr2_jax.train import cft, dry_run, loop, losses, mesh as mesh_lib, opd, optim, synthetic  # noqa: E402

GIB = 2**30
# Dense bf16 peak FLOP/s by device_kind substring (vendor datasheets, no sparsity).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L4": 121.0, "v5p": 459.0, "v5e": 197.0,
               "v4": 275.0}
QWEN3 = dict(vocab_size=151936, num_key_value_heads=8, head_dim=128)
PRESETS = {
    # configs/demo.py's model and batch (the demo's tokenizer has 1,061 tokens).
    "demo": dict(model=dict(vocab_size=1061, hidden_size=64, intermediate_size=192, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
                 batch=16, prompt=160, response=64, dtype="float32", remat=False),
    "tiny": dict(model=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
                 batch=8, prompt=64, response=128, dtype="float32", remat=False),
    "0p6b_like": dict(model=dict(QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, tie_word_embeddings=True),
                      batch=8, prompt=512, response=1536, dtype="bfloat16", remat=True),
    "1p7b_like": dict(model=dict(QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                 num_attention_heads=16, tie_word_embeddings=True),
                      batch=8, prompt=512, response=1536, dtype="bfloat16", remat=True),
    "8b_like": dict(model=dict(QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, tie_word_embeddings=False),
                    batch=8, prompt=512, response=1536, dtype="bfloat16", remat=True),
}
BLOCK = 32
CANVASES = 4  # OPD replay canvases per block in the benchmark batch
NO_REMAT = "none"


def peak_flops(flag: float) -> float | None:
  if flag > 0:
    return flag * 1e12
  kind = jax.devices()[0].device_kind
  for key, tf in PEAK_TFLOPS.items():
    if key.lower() in kind.lower():
      return tf * 1e12
  return None


def matmul_params(mc: Qwen3Config) -> int:
  h, l = mc.hidden_size, mc.num_hidden_layers
  q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
  return l * (h * (q + 2 * kv) + q * h + 3 * h * mc.intermediate_size) + h * mc.vocab_size


def visible_pairs(name: str, p: int, r: int) -> int:
  """(query, key) pairs the layout's mask keeps for one row (all prompt slots real)."""
  if name == "sft":
    return (p + r) * (p + r + 1) // 2
  nb = r // BLOCK
  if name == "cft":
    lay = streams.stream_layout(p, r, BLOCK, np.arange(nb))
  else:
    lay = streams.stream_layout(p, r, BLOCK, np.repeat(np.arange(nb), CANVASES))
  n = len(lay["kind"])
  m = masks.stream_mask(lay["kind"], lay["block"], lay["seg"], lay["kind"], lay["block"], lay["seg"],
                        np.ones((1, n), bool))
  pairs = int(np.asarray(m).sum())
  if name == "opd":  # + the frozen teacher's causal forward over prompt + response
    pairs += (p + r) * (p + r + 1) // 2
  return pairs


def make_case(name: str, mc: Qwen3Config, b: int, p: int, r: int):
  """(loss_fn(params, batch, rng[, frozen]), batch, model tokens per row, uses_frozen)."""
  bc = mc.as_block_diffusion(BLOCK, mc.vocab_size - 1)
  sft_batch = synthetic.SyntheticSFTIterator(b, p, r, mc.vocab_size, seed=0, full=True).batch(0)
  if name == "sft":
    return (lambda prm, bt, rng: losses.sft_loss(mc, prm, bt)), sft_batch, p + r, False
  if name == "cft":
    return ((lambda prm, bt, rng: cft.cft_loss(bc, prm, bt, rng, block_size=BLOCK, mask_id=mc.vocab_size - 1)),
            sft_batch, p + 2 * r, False)
  nb = r // BLOCK
  rs = np.random.RandomState(0)
  batch = {"prompt": sft_batch["prompt_ids"], "prompt_len": sft_batch["prompt_len"],
           "clean": sft_batch["response_ids"],
           "seg_tokens": rs.randint(10, mc.vocab_size - 2, (b, nb * CANVASES, BLOCK)).astype(np.int32),
           "pred_seg": np.tile((np.arange(r) // BLOCK * CANVASES + (np.arange(r) % CANVASES))[None], (b, 1)
                               ).astype(np.int32),
           "loss_mask": np.ones((b, r), np.float32)}
  loss = lambda prm, bt, rng, teacher: opd.opd_loss(bc, prm, bt, rng, teacher, block_size=BLOCK,
                                                    teacher_cache="none", teacher_config=mc)
  return loss, batch, (p + r + nb * CANVASES * BLOCK) + (p + r), True


def model_config(pre: dict, dtype: str, policy: str, attention: str, scan: bool) -> Qwen3Config:
  """The preset's model with remat policy `policy` ('none': no rematerialisation)."""
  if policy != NO_REMAT and policy not in qwen3.REMAT_POLICIES:
    raise ValueError(f"--remat_policies: {policy!r} is not one of {[NO_REMAT, *qwen3.REMAT_POLICIES]}")
  remat = policy != NO_REMAT
  return Qwen3Config(**pre["model"], dtype=dtype, param_dtype="float32", remat=remat,
                     remat_policy=policy if remat else "nothing_saveable", attention_impl=attention,
                     scan_layers=scan, mask_token_id=pre["model"]["vocab_size"] - 1)


def float_dtypes(tree) -> list:
  return sorted({str(x.dtype) for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)})


def xla_memory(compiled) -> dict:
  """XLA's memory plan of a compiled step, GiB (`hlo.memory`: argument + output + temp - alias = planned)."""
  m = hlo.memory(compiled)
  if m is None:
    return {}
  parts = dict(argument=m.arguments, output=m.outputs, temp=m.temporaries, alias=m.aliased)
  row = {f"xla_{k}_gib": v / GIB for k, v in parts.items()}
  row["xla_planned_gib"] = m.peak / GIB
  return row


def plan_config(args):
  """The pipeline config whose stages have this benchmark's shapes (for the dry run's planner)."""
  from configs import base
  c = base.get_config()
  c.task.prompt_len, c.task.response_len = args.prompt, args.response
  c.cft.block_size = c.decode.block_size = BLOCK
  c.decode.max_new_tokens = args.response
  c.train.batch_size, c.train.grad_accum_steps = args.batch, args.grad_accum
  c.train.mesh.data, c.train.mesh.fsdp, c.train.mesh.tensor = map(int, args.mesh.split(","))
  c.opd.prompts_per_step, c.opd.rollouts_per_prompt = args.batch, 1
  c.opd.replay_max_segments, c.opd.grad_accum_steps, c.opd.teacher_cache = CANVASES, args.grad_accum, "none"
  return c


def dry_run_plan_gib(name: str, mc: Qwen3Config, args) -> float:
  return dry_run.step_bytes(plan_config(args), mc, name, jax.device_count())["train_step"] / GIB


def compile_step(name, mc, args, mesh) -> dict:
  """The jitted step of loss `name` lowered and compiled from shapes, with what running it needs."""
  tc = train_config_lib.train_config()
  opt, sched = optim.make_optimizer(tc.optimizer, 1000)
  rules = tuple(tc.logical_axis_rules)
  shapes = jax.eval_shape(functools.partial(qwen3.init_params, mc), jax.random.PRNGKey(0))
  state_shapes, sh = loop.state_shardings(shapes, opt, mesh, rules)
  loss_fn, batch, model_tok, frozen = make_case(name, mc, args.batch, args.prompt, args.response)
  b_sh = mesh_lib.batch_sharding(mesh, rules, args.batch)
  step = loop.make_train_step(loss_fn, opt, sched, args.grad_accum, with_frozen=frozen)
  teacher_shapes = jax.eval_shape(functools.partial(opd.frozen_teacher, mc), shapes) if frozen else None
  in_sh = (sh, b_sh) + ((sh["params"],) if frozen else ())
  jitted = jax.jit(step, in_shardings=in_sh, out_shardings=(sh, None), donate_argnums=(0,))
  abstract_batch = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
  t = time.perf_counter()
  lowered = jitted.lower(state_shapes, abstract_batch, *((teacher_shapes,) if frozen else ()))
  compiled = lowered.compile()
  return dict(compiled=compiled, compile_s=time.perf_counter() - t, text=lowered.as_text(), opt=opt, sh=sh,
              b_sh=b_sh, state_shapes=state_shapes, teacher_shapes=teacher_shapes, batch=batch,
              model_tok=model_tok, frozen=frozen)


def bench_one(name, mc, args, mesh, peak) -> dict:
  c = compile_step(name, mc, args, mesh)
  compiled, frozen, sh = c["compiled"], c["frozen"], c["sh"]
  p, r = args.prompt, args.response
  row = dict(loss=name, scan=mc.scan_layers, remat_policy=mc.remat_policy if mc.remat else NO_REMAT,
             params=qwen3.count_params(c["state_shapes"]["params"]), batch=args.batch, seq=p + r,
             compute_dtype=mc.dtype, master_dtypes=float_dtypes(c["state_shapes"]["params"]),
             opt_state_dtypes=float_dtypes(c["state_shapes"]["opt_state"]),
             teacher_dtypes=float_dtypes(c["teacher_shapes"]) if frozen else None,
             dot_operand_dtypes=hlo.dot_operand_dtypes(c["text"]), attention=mc.attention_impl,
             segment_groups=args.segment_groups, compile_s=c["compile_s"], **xla_memory(compiled))
  row["plan_gib"] = dry_run_plan_gib(name, mc, args)
  if args.compile_only:
    return row
  params_fn = functools.partial(qwen3.init_params, mc)
  state = loop.init_state(params_fn, c["opt"], sh, 0, jnp.float32)
  gbatch = mesh_lib.shard_batch(c["batch"], c["b_sh"], args.batch)
  extra = ()
  if frozen:
    extra = (jax.device_put(opd.frozen_teacher(mc, jax.jit(params_fn)(jax.random.PRNGKey(1))), sh["params"]),)
  for _ in range(args.warmup):
    state, m = compiled(state, gbatch, *extra)
  jax.block_until_ready(state)
  t = time.perf_counter()
  for _ in range(args.steps):
    state, m = compiled(state, gbatch, *extra)
  jax.block_until_ready((state, m))
  step_s = (time.perf_counter() - t) / args.steps
  # Training FLOPs: 6 N per token for the student, 2 N (forward only) for OPD's teacher tokens.
  n_mat = matmul_params(mc)
  attn_flops = 12 * mc.head_dim * mc.num_attention_heads * mc.num_hidden_layers * visible_pairs(name, p, r)
  model_tok = c["model_tok"]
  student_tok = args.batch * (model_tok - (p + r if frozen else 0))
  teacher_tok = args.batch * (p + r) if frozen else 0
  flops = 6 * n_mat * student_tok + 2 * n_mat * teacher_tok + args.batch * attn_flops
  row.update(step_ms=step_s * 1e3, tok_s=args.batch * (p + r) / step_s, model_tok_s=args.batch * model_tok / step_s,
             mfu=flops / step_s / peak if peak else None, final_loss=float(m["loss"]), **measured_peak(row))
  return row


def measured_peak(row: dict) -> dict:
  """peak_gib: the device's peak bytes in use (GPU), else XLA's plan; and the dry-run plan over it."""
  mem = None
  try:
    mem = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
  except Exception:  # pylint: disable=broad-except
    pass
  out = dict(peak_gib=mem / GIB, peak_source="device") if mem else dict(peak_gib=row.get("xla_planned_gib"),
                                                                         peak_source="planned")
  if out["peak_gib"]:
    out["plan_over_peak"] = row["plan_gib"] / out["peak_gib"]
  return out


def parse_args(argv):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
  ap.add_argument("--batch", type=int, default=0, help="global batch (0: preset)")
  ap.add_argument("--prompt", type=int, default=0, help="prompt slots P (0: preset)")
  ap.add_argument("--response", type=int, default=0, help="response slots R (0: preset)")
  ap.add_argument("--dtype", default="", help="compute dtype (default: preset)")
  ap.add_argument("--remat_policies", default="",
                  help=f"comma list of {', '.join([NO_REMAT, *qwen3.REMAT_POLICIES])} ('none' = no remat); "
                       "default: the preset's (nothing_saveable, or none for tiny)")
  ap.add_argument("--attention", default="auto", help="model.attention_impl")
  ap.add_argument("--scan", default="true", choices=["true", "false", "both"], help="model.scan_layers")
  ap.add_argument("--grad_accum", type=int, default=1)
  ap.add_argument("--steps", type=int, default=5)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--losses", default="sft,cft,opd", help="which of sft,cft,opd to run")
  ap.add_argument("--compile_only", action="store_true", help="lower + compile from shapes; no run")
  ap.add_argument("--peak_tflops", type=float, default=0.0, help="override the peak table")
  ap.add_argument("--mesh", default="-1,1,1", help="data,fsdp,tensor")
  ap.add_argument("--segment_groups", default="auto", choices=["auto", "one"],
                  help="'cudnn' route: replay segments in groups of one per block (auto) or all in one "
                       "call ('one': the layout before grouping, for an A/B of memory and time)")
  ap.add_argument("--isolate", default="auto", choices=["auto", "true", "false"],
                  help="one process per row (auto: when running more than one row)")
  ap.add_argument("--row_timeout", type=int, default=0, help="seconds an isolated row may take (0: no limit)")
  ap.add_argument("--json_out", default="", help="write {device, jax_version, git_commit, argv, rows} here")
  ap.add_argument("--only", default="", help=argparse.SUPPRESS)  # scan:loss:policy, one isolated row
  args = ap.parse_args(argv)
  pre = PRESETS[args.preset]
  args.batch = args.batch or pre["batch"]
  args.prompt = args.prompt or pre["prompt"]
  args.response = args.response or pre["response"]
  args.dtype = args.dtype or pre["dtype"]
  args.policies = [x for x in args.remat_policies.split(",") if x] or (
      ["nothing_saveable"] if pre["remat"] else [NO_REMAT])
  for name in args.losses.split(","):
    if name not in ("sft", "cft", "opd"):
      ap.error(f"--losses: {name!r} is not one of sft, cft, opd")
  for pol in args.policies:
    if pol != NO_REMAT and pol not in qwen3.REMAT_POLICIES:
      ap.error(f"--remat_policies: {pol!r} is not one of {', '.join([NO_REMAT, *qwen3.REMAT_POLICIES])}")
  return args


def cases(args) -> list:
  if args.only:
    scan, name, pol = args.only.split(":")
    return [(scan == "True", name, pol)]
  scans = (False, True) if args.scan == "both" else (args.scan == "true",)
  return [(s, n, p) for s in scans for n in args.losses.split(",") for p in args.policies]


def run_isolated(argv, case, timeout: int) -> dict:
  """One row in a fresh process (its own device peak); a failed row comes back with `error`."""
  scan, name, pol = case
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "row.json")
    cmd = [sys.executable, os.path.abspath(__file__), *argv, f"--only={scan}:{name}:{pol}", "--isolate=false",
           f"--json_out={out}"]
    try:
      res = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, timeout=timeout or None)
      err = res.stderr.strip().splitlines()[-1] if res.returncode else ""
    except subprocess.TimeoutExpired:
      err = f"timed out after {timeout} s"
    if not err and os.path.exists(out):
      with open(out) as f:
        return json.load(f)["rows"][0]
  print(f"row {case} failed: {err}", flush=True)
  return dict(loss=name, scan=scan, remat_policy=pol, error=err or "no result")


def print_table(rows, compile_only: bool):
  hdr = ["loss", "scan", "remat_policy", "batch", "seq", "compile_s"] + (
      [] if compile_only else ["step_ms", "tok_s", "model_tok_s", "mfu", "peak_gib", "peak_source"]) + [
      "xla_planned_gib", "plan_gib"] + ([] if compile_only else ["plan_over_peak"])
  print("\n| " + " | ".join(hdr) + " |\n|" + "---|" * len(hdr))
  for r in rows:
    if "error" in r:
      print(f"| {r['loss']} | {r['scan']} | {r['remat_policy']} | error: {r['error'][:200]} |")
      continue
    cells = []
    for h in hdr:
      v = r.get(h)
      cells.append("n/a" if v is None else (f"{v:.3g}" if isinstance(v, float) and (h.endswith("gib") or h in (
          "mfu", "plan_over_peak")) else f"{v:,.2f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int)
                                            and not isinstance(v, bool) else str(v)))
    print("| " + " | ".join(cells) + " |")


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  todo = cases(args)
  if args.segment_groups == "one":
    attention._segment_groups = lambda s, most: 1  # pylint: disable=protected-access
  isolate = args.isolate == "true" or (args.isolate == "auto" and len(todo) > 1 and not args.compile_only)
  env = dict(git_commit=results.git_commit(), jax_version=jax.__version__)
  if isolate:  # this process never starts a backend: the device stays free for the rows' processes
    rows = [run_isolated(argv, c, args.row_timeout) for c in todo]
    env["device"] = next((r["device"] for r in rows if "device" in r), "unknown")
  else:
    mesh = mesh_lib.make_mesh(dict(zip(mesh_lib.AXES, map(int, args.mesh.split(",")))))
    peak = peak_flops(args.peak_tflops)
    env["device"] = f"{jax.device_count()} x {jax.devices()[0].device_kind}"
    print(f"devices: {env['device']}; mesh {dict(mesh.shape)}; preset {args.preset} dtype {args.dtype} remat "
          f"{','.join(args.policies)} attention {args.attention}; peak "
          f"{'%.0f TFLOP/s' % (peak / 1e12) if peak else 'unknown (MFU n/a)'}", flush=True)
    rows = []
    for scan, name, pol in todo:
      mc = model_config(PRESETS[args.preset], args.dtype, pol, args.attention, scan)
      rows.append(dict(bench_one(name, mc, args, mesh, peak), **env))
      if rows[-1].get("peak_source") == "device" and len(rows) > 1:  # the counter only grows
        rows[-1]["peak_source"] = "device, process peak over earlier rows too"
      print(rows[-1], flush=True)
  if args.json_out:
    with open(args.json_out, "w") as f:
      json.dump(dict(env, argv=argv, rows=rows), f, indent=1)
  if not args.only:
    print_table(rows, args.compile_only)
  return rows


if __name__ == "__main__":
  main()
