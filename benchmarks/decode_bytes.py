"""What a decoding step moves, counted in the compiled program: shapes only, nothing allocated.

  python benchmarks/decode_bytes.py                      # 0.6B and 8B shapes, bf16, table
  python benchmarks/decode_bytes.py --check              # exit 1 naming each target missed
  python benchmarks/decode_bytes.py --shapes=qwen3_0p6b --batch_sizes=1 --programs=ar --weight_dtypes=bf16
  python benchmarks/decode_bytes.py --target=h100 --check  # the program an H100 compiles (pip install -e ".[aot]")

For each model shape (Qwen3-0.6B, Qwen3-8B; bf16 parameters, compute dtype 'auto'), program (the AR
decoder, the block-diffusion decoder with a 32-slot window and `kv_write` 'separate', the same with
'fused' (a 64-slot window on every step), a speculative round: that drafter verified by the AR
model), batch size and weight dtype (`--weight_dtypes`: bf16, and float8_e4m3fn: DecodeConfig.
weight_dtype), the decoder is lowered from `jax.ShapeDtypeStruct`s of its params as serving
prepares them (`qwen3.decode_params`: projections fused, kernels in the weight dtype) and
compiled by XLA for this machine's backend (or, with `--target`, for a compile-only target:
dgr2_jax/aot/targets.py), and its HLO is read (the counter: dgr2_jax/aot/weight_reads.py):

  * weight reads per step: the decode loop is the innermost `while` whose body reads a layer's
    weights itself (not through a nested loop); every instruction of its body that consumes a
    weight (or a bitcast / loop-carried alias of one) reads it: a fusion reads the whole operand
    unless the fused computation only slices or gathers it (then: the slice's bytes), a nested
    loop's reads count its known trip count times, a conditional its most expensive branch. A
    nested loop that reads layer weights itself is a decode loop too, whose iterations are steps
    of their own (a speculative round's drafter steps, nested in the cycle that ends with the
    verifier's pass): its reads count per its own step. Per weight leaf: bytes read / the leaf's
    bytes. The untied input embedding is only gathered (a
    few rows a step) and is not a target. Counted in the program as lowered, before XLA's fusion
    passes, where a float8 kernel's convert to bf16 counts inside the matmul that consumes it
    (XLA's GPU GEMM fusions read the float8 operand); target: float8 weight bytes per step <=
    MAX_FLOAT8_VS_BF16 x the bf16 weights a step reads;
  * matmuls per layer and step: the dots (or fusions holding one) that read a layer's weights;
    target 4 (qkv, o, gate_up, down: decode_params' fused layout; 7 unfused);
  * float8 converts hoisted out of the loop (`--hoist_check`, float8 rows): the decoder compiled
    for this backend, each float8 weight that enters the decode loop as a wider copy (loop-
    invariant code motion converting the whole weight once: every step would read the copy);
    target none (`qwen3.in_step` ties the convert to the step's activations);
  * f32 converts of weights in the loop: converts of a weight to f32 inside the loop, and
    weights that enter the loop as f32 copies of bf16 parameters (a convert hoisted out of the
    loop still doubles the bytes every step reads);
  * host round trips per generated token: each iteration of a data-dependent `while` copies its
    predicate to the host, and so does each `conditional` it runs (XLA's GPU runtime; loops of a
    known trip count do not). Per outer iteration: 1 + the conditionals run; divided by the decode
    steps one outer iteration runs (the trip counts of the nested decode loops), at one token per
    step (AR; the diffusion decoder's worst case);
  * XLA's `cost_analysis()` of one step compiled alone (window forward + vocabulary term):
    bytes accessed and FLOPs;
  * the ideal: the weights read once (the gathered rows of an untied input embedding aside) + the
    KV cache read once + the window's K/V written; and the roofline steps/s and tokens/s on an H100
    (3.35 TB/s) and an H200 (4.8 TB/s) that follow (AR: one token per row and step; diffusion and
    speculative: `--commits` tokens per row and step); and the steps/s that XLA's FLOPs per step
    allow at 989 TFLOP/s (dense bf16 on either): a step runs at the lower of the two rates. A
    'fused' window doubles a step's FLOPs and saves each row the step it spends on a block's K/V
    write with 'separate' (decode/sampler.py `resolve_kv_write` picks by rows from these columns).

Depth: every layer is the same program, so the counts are made at `--layers` (default 2) and the
per-layer ones checked equal across those layers; bytes and FLOPs are extrapolated exactly to the
full depth from `--layers` and one layer less (cost(L) = cost(l) + (L - l) * (cost(l) - cost(l-1))).
The counts describe XLA's program for this backend (CPU here, or `--target`'s); a GPU compile fuses
differently, which `--target=h100` shows without a GPU and `run_gpu_benchmarks.sh` on the device.

Compiled counts (`--count=compiled`, the default for a GPU or TPU, a `--target`'s or this machine's;
a CPU's default is the lowered count): the weight reads, matmuls, converts and round trips are read
from the optimised program the target compiles rather than the lowered one (the table's "XLA"
columns then come from that target's compile too, with `--xla_cost`). Two things then count apart,
not as misses: a leaf of at most SMALL_LEAF_BYTES (a norm scale, a float8 kernel's scale) that XLA
reads in two fusions (the matrices, which hold the bytes, must each be read once), and a convert to
f32 inside a GEMM fusion (the GPU computes a batch-1 matrix-vector product in f32 from the bf16 or
float8 bytes it reads). TPU while loops evaluate their condition on the device, so a TPU row has no
host round trips ('-'). Compile-only programs are not autotuned (XLA's default GEMM and fusion
configurations) and nothing is timed.
With `--hlo_dir`, the float8 rows also say what the compiled step reads of a float8 layer kernel per
its bytes: 1 where the backend fuses the convert into the matmul, 3 or more where it materialises a
wider copy each step (XLA's CPU backend: an f32 copy).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time

from absl import app, flags
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dgr2_jax import platform  # noqa: E402
from dgr2_jax.aot import hlo, targets  # noqa: E402
from dgr2_jax.aot.programs import SHAPES, decoder_program, full_weight_bytes, model_config  # noqa: E402
from dgr2_jax.aot.programs import prepared_shapes, step_program  # noqa: E402
from dgr2_jax import results  # noqa: E402
from dgr2_jax.aot.weight_reads import FUSED_MATMUL, HLO_DTYPES, analyse, compiled_text, leaves_of, loop_ops  # noqa: E402
from dgr2_jax.aot.weight_reads import lowered_text  # noqa: E402

# Its own flag registry: importable beside decode_throughput.py, whose flags share names.
FLAGS = flags.FlagValues()


def _flag(define, *args, **kw):
  return define(*args, flag_values=FLAGS, **kw)


_flag(flags.DEFINE_list, "shapes", ["qwen3_0p6b", "qwen3_8b"], "model shapes (dgr2_jax.aot.programs.SHAPES)")
_flag(flags.DEFINE_list, "programs", ["ar", "diffusion", "diffusion_fused", "speculative"], "decoders")
_flag(flags.DEFINE_list, "batch_sizes", ["1", "8", "64"], "batch sizes")
_flag(flags.DEFINE_integer, "prompt_len", 2200, "prompt tokens")
_flag(flags.DEFINE_integer, "max_new_tokens", 128, "response slots (the KV cache holds prompt + these)")
_flag(flags.DEFINE_integer, "block_size", 32, "the diffusion window")
_flag(flags.DEFINE_integer, "layers", 2, "layers compiled (>= 2); counts extrapolate to the full depth")
_flag(flags.DEFINE_integer, "commits", 4, "tokens per row and step of the diffusion/speculative roofline")
_flag(flags.DEFINE_list, "weight_dtypes", ["bf16", "float8_e4m3fn"],
      "the decoders' weight dtypes (DecodeConfig.weight_dtype; bf16 = the compute dtype)")
_flag(flags.DEFINE_bool, "hoist_check", True,
      "compile each float8 decoder and count the weight converts XLA hoisted out of its decode loop")
_flag(flags.DEFINE_bool, "check", False, "exit 1 naming each target missed")
_flag(flags.DEFINE_bool, "xla_cost", True, "compile each step alone for XLA's cost analysis (most of the run time)")
_flag(flags.DEFINE_string, "json_out", "", "also write the rows as JSON here")
_flag(flags.DEFINE_string, "target", "", "compile for this target instead of this machine (dgr2_jax/aot/targets.py: "
      "h100, h200x8, v5e-4, ...)")
_flag(flags.DEFINE_enum, "count", "auto", ["auto", "lowered", "compiled"],
      "count the decoder as lowered (before XLA's passes) or as compiled for the backend ('auto': compiled "
      "for a GPU or TPU, --target's or this machine's; lowered on a CPU)")
_flag(flags.DEFINE_string, "hlo_dir", "", "also compile each decoder for this backend, write its optimised HLO "
                    "here and count the copies, converts and all-gathers inside its decode loop")

HBM = {"H100": 3.35e12, "H200": 4.8e12}   # bytes/s
PEAK = {"H100": 989e12, "H200": 989e12}   # dense bf16 FLOP/s (SXM)
MAX_ROUND_TRIPS_PER_TOKEN = 1 / 8
MAX_B64_DIFFUSION_WEIGHT_RATIO = 1.05
PROJECTIONS_PER_LAYER = 4          # qkv, o, gate_up, down (qwen3.decode_params' fused layout)
MAX_FLOAT8_VS_BF16 = 0.55          # float8 weight bytes per step / the bf16 weights a step reads
# A compiled program may read a vector weight (a norm scale: 8 KB at 8B) in two fusions; the
# matrices, which hold the bytes, must each be read once. Leaves up to this size are listed apart.
SMALL_LEAF_BYTES = 2**20


def cost(fn, args) -> tuple[float, float]:
  """(bytes accessed, FLOPs) of the compiled step (dgr2_jax/aot/hlo.py's cost analysis)."""
  flops, nbytes, _ = hlo.cost(hlo.lower(fn, *args).compile())
  return nbytes, flops


def step_costs(shape: str, program: str, batch: int, weight_dtype: str) -> tuple:
  """XLA's (bytes accessed, FLOPs) of one step at full depth, extrapolated from `--layers` and one less."""
  l_hi = max(FLAGS.layers, 2)
  full = SHAPES[shape]["num_hidden_layers"]
  slots = FLAGS.prompt_len + FLAGS.max_new_tokens
  costs = {}
  for layers in (l_hi - 1, l_hi):
    cfg = model_config(shape, layers)
    if not FLAGS.xla_cost:
      costs[layers] = (float("nan"), float("nan"))
    elif program == "speculative":   # a round: the drafter's window step and the verifier's W+1 window
      b1, f1 = cost(*step_program("diffusion", cfg, batch, slots, FLAGS.block_size, weight_dtype))
      b2, f2 = cost(*step_program("diffusion", cfg, batch, slots + FLAGS.block_size, FLAGS.block_size + 1,
                                  weight_dtype))
      costs[layers] = (b1 + b2, f1 + f2)
    else:
      costs[layers] = cost(*step_program(program, cfg, batch, slots, FLAGS.block_size, weight_dtype))
  return tuple(costs[l_hi][i] + (full - l_hi) * (costs[l_hi][i] - costs[l_hi - 1][i]) for i in (0, 1))


def counted() -> str:
  """'compiled' or 'lowered': which program the counts read (`--count`)."""
  return FLAGS.count if FLAGS.count != "auto" else ("lowered" if platform.backend() == "cpu" else "compiled")


def count_program(shape: str, program: str, batch: int, weight_dtype: str) -> dict:
  """`analyse` of the decoder at `--layers` layers, as lowered or as compiled (`counted`); with a
  float8 weight dtype (or `--hlo_dir`) also of the compiled one: the converts XLA hoisted out of
  the decode loop."""
  fn, args, leaves = decoder_program(program, model_config(shape, max(FLAGS.layers, 2)), batch, FLAGS.prompt_len,
                                     FLAGS.max_new_tokens, FLAGS.block_size, weight_dtype)
  compiled = counted() == "compiled"
  text = compiled_text(fn, args) if compiled or FLAGS.hlo_dir or (weight_dtype and FLAGS.hoist_check) else None
  res = analyse(text, leaves, lowered=False) if compiled else analyse(lowered_text(fn, args), leaves)
  res["hoisted"] = None
  res["sizes"] = {p: int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for p, x in leaves}
  if text is not None:
    # Float8 weights only: XLA's CPU backend hoists its f32 copies of bf16 weights (norm scales, the
    # untied input embedding) out of any loop, a CPU choice the GPU's bf16 matmuls do not need.
    narrow = {p for p, x in leaves if HLO_DTYPES[np.dtype(x.dtype)].startswith("f8")}
    built = res if compiled else analyse(text, leaves, lowered=False)
    res["hoisted"] = sorted({p for p, w in built["converts"] if "before the loop" in w and p in narrow})
    # What the backend's step reads of its float8 layer kernels, per their bytes: 1 where the
    # convert is fused into the matmul (GPU GEMM fusions), 3 or more where it is materialised.
    res["compiled_f8_reads"] = max((built["reads"][p] for p in narrow if "layers_" in p), default=None)
    if FLAGS.hlo_dir:
      os.makedirs(FLAGS.hlo_dir, exist_ok=True)
      name = f"{shape}_{program}_b{batch}_l{max(FLAGS.layers, 2)}{'_' + weight_dtype if weight_dtype else ''}"
      with open(os.path.join(FLAGS.hlo_dir, name + ".hlo.txt"), "w") as f:
        f.write(text)
      res["loop_ops"] = loop_ops(text, leaves)
  return res


def measure(shape: str, program: str, batch: int, weight_dtype: str = "") -> dict:
  """One row of the table."""
  t0 = time.perf_counter()
  res = count_program(shape, program, batch, weight_dtype)
  xla_bytes, xla_flops = step_costs(shape, program, batch, weight_dtype)
  cfg_full = model_config(shape, SHAPES[shape]["num_hidden_layers"])
  models = 2 if program == "speculative" else 1
  weights_all, weights_read = (models * x for x in full_weight_bytes(cfg_full, weight_dtype))
  bf16_read = models * full_weight_bytes(cfg_full)[1]
  layer_ratios = {}
  for path, r in res["reads"].items():
    if "layers_" in path:
      layer_ratios.setdefault(re.sub(r"layers_\d+/", "", path), set()).add(round(r, 6))
  uneven = [k for k, v in layer_ratios.items() if len(v) > 1]
  if uneven:
    raise RuntimeError(f"{shape} {program}: layers read differently ({uneven[:3]}): cannot extrapolate")
  # Weight bytes read per step at full depth: the non-layer leaves as counted, each layer leaf's
  # ratio times its bytes at full depth.
  full_shapes = prepared_shapes(cfg_full, weight_dtype)
  full_leaves = leaves_of(full_shapes if models == 1 else (full_shapes, full_shapes))
  at0 = lambda p: re.sub(r"layers_\d+/", "layers_0/", p)
  ratio_of = lambda p: res["reads"].get(at0(p), 0.0) + res["gathered"].get(at0(p), 0.0)
  read = sum(ratio_of(p) * int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for p, x in full_leaves)
  c = cfg_full
  slots = FLAGS.prompt_len + FLAGS.max_new_tokens
  width = {"ar": 1, "diffusion": FLAGS.block_size, "diffusion_fused": 2 * FLAGS.block_size,
           "speculative": 2 * FLAGS.block_size + 1}[program]
  kv_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2   # bf16 K and V, all layers
  kv_read = batch * slots * kv_token * (2 if program == "speculative" else 1)
  ideal = weights_read + kv_read + batch * width * kv_token
  tokens = batch * (1 if program == "ar" else FLAGS.commits)
  targets = [p for p, r in res["reads"].items()
             if not (p.endswith("embed_tokens/embedding") and not c.tie_word_embeddings)]
  compiled = counted() == "compiled"
  small = lambda p: compiled and res["sizes"][p] <= SMALL_LEAF_BYTES
  off = [p for p in targets if abs(res["reads"][p] - 1.0) > 1e-3]
  converts = [(p, w) for p, w in res["converts"] if FUSED_MATMUL not in w]
  # TPU while loops run their condition on the device: no host round trip to count.
  trips = None if platform.backend() == "tpu" else res["round_trips_per_token"]
  return dict(
      shape=shape, program=program, batch=batch, weight_dtype=weight_dtype or "bf16",
      compile_s=round(time.perf_counter() - t0, 1),
      weight_gb=weights_all / 1e9, weight_read_gb=read / 1e9, weight_read_ratio=read / weights_read,
      vs_bf16=read / bf16_read, matmuls_per_layer=sorted(set(res["matmuls_per_layer"].values())),
      hoisted=res["hoisted"],
      min_read=min(res["reads"][p] for p in targets if not small(p)),
      max_read=max(res["reads"][p] for p in targets if not small(p)),
      not_once=[p for p in off if not small(p)], small_reread=[p for p in off if small(p)],
      f32_converts=len(converts), convert_list=[f"{p}: {w}" for p, w in converts][:5],
      f32_in_matmul=sorted({p for p, w in res["converts"] if FUSED_MATMUL in w}),
      round_trips_per_token=trips, counted=counted(),
      xla_bytes_gb=xla_bytes / 1e9, xla_tflops=xla_flops / 1e12, ideal_gb=ideal / 1e9,
      roofline_steps_h100=HBM["H100"] / ideal, roofline_steps_h200=HBM["H200"] / ideal,
      roofline_tok_h100=tokens * HBM["H100"] / ideal, roofline_tok_h200=tokens * HBM["H200"] / ideal,
      flop_steps_h100=PEAK["H100"] / xla_flops, flop_steps_h200=PEAK["H200"] / xla_flops,
      loop_ops=res.get("loop_ops"), compiled_f8_reads=res.get("compiled_f8_reads"))


def check(rows: list) -> list:
  """The targets each row misses (module docstring of the issue's Done-when)."""
  missed = []
  for r in rows:
    tag = f"{r['shape']} {r['program']} batch {r['batch']} {r['weight_dtype']}"
    if r["not_once"]:
      missed.append(f"{tag}: weights not read exactly once per step: {r['not_once'][:4]} "
                    f"(reads {r['min_read']:.3f}..{r['max_read']:.3f})")
    if r["f32_converts"]:
      missed.append(f"{tag}: {r['f32_converts']} f32 converts of weights in the loop: {r['convert_list']}")
    if r["round_trips_per_token"] is not None and r["round_trips_per_token"] > MAX_ROUND_TRIPS_PER_TOKEN + 1e-9:
      missed.append(f"{tag}: {r['round_trips_per_token']:.3f} host round trips per generated token "
                    f"(target <= {MAX_ROUND_TRIPS_PER_TOKEN:.3f})")
    if (r["program"].startswith("diffusion") and r["batch"] == 64
        and r["weight_read_ratio"] > MAX_B64_DIFFUSION_WEIGHT_RATIO):
      missed.append(f"{tag}: weight bytes per step {r['weight_read_ratio']:.3f}x the weights "
                    f"(target <= {MAX_B64_DIFFUSION_WEIGHT_RATIO}x)")
    if r["matmuls_per_layer"] != [PROJECTIONS_PER_LAYER]:
      missed.append(f"{tag}: {r['matmuls_per_layer']} matmuls per layer and step (target: "
                    f"{PROJECTIONS_PER_LAYER}: qkv, o, gate_up, down)")
    if r["weight_dtype"] != "bf16" and r["vs_bf16"] > MAX_FLOAT8_VS_BF16:
      missed.append(f"{tag}: weight bytes per step {r['vs_bf16']:.3f}x bf16's (target <= {MAX_FLOAT8_VS_BF16}x)")
    if r["hoisted"]:
      missed.append(f"{tag}: weights converted before the decode loop (every step reads the copy): "
                    f"{r['hoisted'][:4]}")
  return missed


def _trips(r: dict) -> str:
  return "-" if r["round_trips_per_token"] is None else f"{r['round_trips_per_token']:.3f}"


def table(rows: list) -> str:
  head = ("| shape | program | batch | weights | weights GB | weight GB read / step | x weights | x bf16 weights | "
          "reads per leaf | matmuls / layer | f32 converts in loop | hoisted converts | round trips / token | "
          "XLA GB / step | XLA TFLOP / step | ideal GB / step | roofline steps/s H100 / H200 | "
          "roofline tokens/s H100 / H200 | FLOP-bound steps/s H100 / H200 |")
  out = [head, "|" + "---|" * (head.count("|") - 1)]
  for r in rows:
    hoisted = "-" if r["hoisted"] is None else len(r["hoisted"])
    fused = r.get("f32_in_matmul") or []
    out.append(f"| {r['shape']} | {r['program']} | {r['batch']} | {r['weight_dtype']} | {r['weight_gb']:.2f} | "
               f"{r['weight_read_gb']:.2f} | {r['weight_read_ratio']:.3f} | {r['vs_bf16']:.3f} | "
               f"{r['min_read']:.3f}-{r['max_read']:.3f} | {'/'.join(map(str, r['matmuls_per_layer']))} | "
               f"{r['f32_converts']}{f' ({len(fused)} in a GEMM)' if fused else ''} | {hoisted} | {_trips(r)} | "
               f"{r['xla_bytes_gb']:.2f} | {r['xla_tflops']:.3f} | "
               f"{r['ideal_gb']:.2f} | {r['roofline_steps_h100']:.0f} / {r['roofline_steps_h200']:.0f} | "
               f"{r['roofline_tok_h100']:.0f} / {r['roofline_tok_h200']:.0f} | "
               f"{r['flop_steps_h100']:.0f} / {r['flop_steps_h200']:.0f} |")
  return "\n".join(out)


def main(_):
  with targets.compile_for(FLAGS.target) if FLAGS.target else contextlib.nullcontext():
    run()


def run():
  rows = []
  for shape in FLAGS.shapes:
    for program in FLAGS.programs:
      for b in (int(x) for x in FLAGS.batch_sizes):
        for wd in FLAGS.weight_dtypes:
          rows.append(measure(shape, program, b, "" if wd == "bf16" else wd))
          print(f"# {shape} {program} batch {b} {wd}: {rows[-1]['compile_s']} s", file=sys.stderr, flush=True)
  where = FLAGS.target or platform.backend()
  print(f"Prompt {FLAGS.prompt_len}, {FLAGS.max_new_tokens} response slots, window {FLAGS.block_size}, bf16 compute; "
        f"counted at {FLAGS.layers} layers in the program {counted()} for {where}; diffusion/speculative tokens at "
        f"{FLAGS.commits} per row and step.\n")
  print(table(rows))
  for r in rows:
    tag = f"{r['shape']} {r['program']} batch {r['batch']} {r['weight_dtype']}"
    if r["small_reread"]:
      print(f"{tag}: small leaves read more than once (<= {SMALL_LEAF_BYTES} bytes each): {r['small_reread'][:4]}")
    if r["f32_in_matmul"]:
      print(f"{tag}: converted to f32 inside a GEMM fusion (its own bytes read): {r['f32_in_matmul'][:4]}")
  if FLAGS.hlo_dir:
    print(f"\nInside the decode loop of the optimised program ({platform.backend()}, {FLAGS.layers} layers; "
          f"HLO in {FLAGS.hlo_dir}; float8 reads: the most a step reads of a float8 layer kernel, per its "
          f"bytes):\n\n| shape | program | batch | weights | copies | converts | all-gathers | float8 reads |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in rows:
      o, f8 = r["loop_ops"], r["compiled_f8_reads"]
      print(f"| {r['shape']} | {r['program']} | {r['batch']} | {r['weight_dtype']} | {o['copy']} | {o['convert']} | "
            f"{o['all-gather']} | {'-' if f8 is None else f'{f8:.2f}'} |")
  if FLAGS.json_out:
    import jax
    meta = dict(kind="dgr2-compiled", benchmark="decode_bytes", git_commit=results.git_commit(),
                jax_version=jax.__version__, backend=platform.backend(), target=FLAGS.target, counted=counted(),
                layers=FLAGS.layers, prompt_len=FLAGS.prompt_len, max_new_tokens=FLAGS.max_new_tokens,
                command="python benchmarks/decode_bytes.py " + " ".join(sys.argv[1:]))
    with open(FLAGS.json_out, "w") as f:
      json.dump(dict(meta, rows=rows), f, indent=1)
  if FLAGS.check:
    missed = check(rows)
    for m in missed:
      print("MISSED:", m)
    if missed:
      sys.exit(1)
    print("every target met")


if __name__ == "__main__":
  # absl's own flags (--help, logging) first, then this script's.
  app.run(main, flags_parser=lambda argv: FLAGS(flags.FLAGS(argv, known_only=True)))
