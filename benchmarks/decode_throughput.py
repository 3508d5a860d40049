"""Decode wall-clock as a re-ranker user pays for it: per request, prefill + decode, AR vs block diffusion.

  python benchmarks/decode_throughput.py                                   # tiny random model, CPU
  python benchmarks/decode_throughput.py --preset=qwen3_8b --dtype=bfloat16  # Qwen3-8B shape (GPU)
  python benchmarks/decode_throughput.py --model_dir=DIR                   # a real checkpoint (HF or ours)
  python benchmarks/decode_throughput.py --preset=qwen3_8b --dtype=bfloat16 --prompt_len=2200 \
      --schedule=/tmp/dgr2_demo/eval/cft_opd_rl/schedule.json             # a trained model's commit counts

The lead figure is the request's. A request waits for its prompt's prefill and its whole decode, and
in a static batch every row returns with the call, so a request's wall time is the call's
(prefill + decode) and request tokens/s = the tokens one request generated / that wall time (the
mean over the batch's rows). Beside it, decode-only figures: the same tokens / (wall - one prefill
of the same prompts, timed alone), and the batch's rates (every row's tokens / the same times).
Walls are medians of `--repeats` calls of the jitted decoder after a warm-up call; compile time =
the first call's time less that median.

Random weights are confident nowhere, so a threshold would commit one token per step. The
diffusion rows force a schedule instead, so the NFE is known without a trained model:
  * forced c (default): tau = 1 and `steps_per_block` = B / c commit exactly c tokens per step
    (c = `--commits`), NFE = tokens / c (+ one K/V write per block after the first when `kv_write`
    is separate). Prompts of `--prompt_len` tokens (paper ~2200), `--max_new_tokens` generated
    (128 and 512), EOS off, so every row generates exactly that many;
  * `--schedule=FILE`: the commit schedule an eval stage recorded (its `schedule.json`,
    dgr2_jax/decode/schedule.py: per answer, the tokens committed at each denoising step). Row i of
    a batch of b replays answer i of `schedule.draw(FILE, b, --schedule_seed)` (numpy
    `default_rng(seed)`, without replacement when the file holds >= b answers): at its step s it
    commits exactly n_s of its masked positions, the most confident ones, EOS off, and finishes
    where the recorded answer ended, so its steps and NFE are the recorded ones (checked; the NFE
    equals the file's when the resolved `kv_write` is the file's). Block size and response slots
    are the file's. Its AR row generates the same number of tokens per row (one per step), so the
    two are compared on equal work. The rows' `schedule` field says where the schedule came from.
Every batch also runs AR (block size 1): its tokens/s and fraction of the HBM roofline (at batch b
a decode step reads every weight once plus the KV cache, so roofline tokens/s = b * bandwidth /
(weight bytes + KV bytes read per step); `--hbm_gbps`, default from the device kind; the weights
counted are all but an untied input embedding, of which a step gathers a few rows). Last, the
window cost: one forward of a 32- and a 64-slot window against the full KV cache relative to a
1-slot AR step (each timed in a `fori_loop`).

`--json_out` writes {"meta", "rows", "window_cost_s", "device"}; every row carries the request
figures (request_wall_s = request_prefill_s + request_decode_s, request_tokens_per_s,
request_decode_tokens_per_s, request_speedup) and the decode-only and batch ones (decode_tokens_per_s,
speedup, tokens_per_s, wall_s, prefill_s), nfe_per_seq, and the run's device, jax_version,
git_commit and the rest of `dgr2_jax.results.run_meta()`, and how the params were
prepared for decoding (`qwen3.decode_params`): weight_dtype (`--weight_dtype`, 'compute' = the compute
dtype) and fuse_projections (`--fuse_projections`: q/k/v and gate/up one matmul each, or separate).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dgr2_jax import results as results_lib  # noqa: E402
from dgr2_jax.aot import programs  # noqa: E402
from dgr2_jax.decode import sampler  # noqa: E402
from dgr2_jax.decode import schedule as schedule_lib  # noqa: E402
from dgr2_jax.decode import xla_flags  # noqa: E402
from dgr2_jax.model import masks, qwen3  # noqa: E402
from dgr2_jax.model.config import Qwen3Config  # noqa: E402


FLAGS = flags.FLAGS
flags.DEFINE_string("model_dir", "", "HF or dgr2_jax model directory; empty = --preset random model")
flags.DEFINE_enum("preset", "tiny", ["tiny", "small", "qwen3_0p6b", "qwen3_8b"], "random model shape")
flags.DEFINE_integer("prompt_len", 2200, "prompt tokens")
flags.DEFINE_list("max_new_tokens", ["128", "512"], "generated tokens (multiples of the block size)")
flags.DEFINE_list("batch_sizes", ["1", "8"], "batch sizes")
flags.DEFINE_list("commits", ["1", "2", "4", "8"], "forced commits per denoising step")
flags.DEFINE_integer("block_size", 32, "block size of the diffusion rows")
flags.DEFINE_enum("kv_write", "auto", ["auto", "fused", "separate"], "decode.kv_write")
flags.DEFINE_string("attention", "", "model.attention_impl override ('' = the model's)")
flags.DEFINE_integer("repeats", 3, "timed calls per row (median reported)")
flags.DEFINE_string("dtype", "", "compute/param dtype override (bfloat16 on GPU)")
flags.DEFINE_float("hbm_gbps", 0.0, "memory bandwidth GB/s for the roofline (0 = from the device kind)")
flags.DEFINE_string("json_out", "", "also write the rows as JSON here")
flags.DEFINE_string("schedule", "", "replay this recorded commit schedule (an eval stage's schedule.json) "
                    "instead of the forced c-commit rows")
flags.DEFINE_integer("schedule_draws", 4, "--schedule: batches of drawn answers per batch size (seeds "
                     "schedule_seed, +1, ...), timed in turn and pooled: a batch-1 row rests on this many answers")
flags.DEFINE_integer("schedule_seed", 0, "--schedule: seed of the answers each batch's rows draw")
flags.DEFINE_string("weight_dtype", "", "decode.weight_dtype: '' = the compute dtype, float8_e4m3fn = "
                    "weight-only float8 (qwen3.decode_params)")
flags.DEFINE_bool("fuse_projections", True, "fused q/k/v and gate/up matmuls (qwen3.decode_params); False = "
                  "the separate projections, for an A/B")

PRESETS = programs.SHAPES   # model shapes by name (--preset)
HBM_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L4": 300.0}


def load_model():
  if FLAGS.model_dir:
    from dgr2_jax.model import checkpoint
    cfg, params = checkpoint.load_model_dir(FLAGS.model_dir)
  else:
    cfg = Qwen3Config(rope_theta=1e6, **PRESETS[FLAGS.preset])
    params = None
  if FLAGS.dtype:
    cfg = cfg.replace(dtype=FLAGS.dtype, param_dtype=FLAGS.dtype)
  if FLAGS.attention:
    cfg = cfg.replace(attention_impl=FLAGS.attention)
  if params is None:  # initialised on the device, in the parameter dtype (no f32 host copy)
    params = jax.jit(lambda k: qwen3.init_params(cfg, k))(jax.random.PRNGKey(0))
  if cfg.mask_token_id is None:  # a random/AR model: the last id as the mask for the benchmark
    cfg = cfg.replace(mask_token_id=cfg.vocab_size - 1)
  # Prepared once for decoding, as serving does (--weight_dtype, --fuse_projections); each decoder's
  # own qwen3.decode_params then does nothing.
  prepare = lambda p: qwen3.decode_params(cfg, p, FLAGS.weight_dtype, FLAGS.fuse_projections)
  return cfg, jax.jit(prepare)(jax.device_put(params))


def time_call(fn, n):
  """(median seconds of n calls after the first, last output, compile seconds: the first call's
  time less that median)."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn(0))
  first = time.perf_counter() - t0
  times = []
  for i in range(n):
    s = time.perf_counter()
    out = fn(i + 1)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - s)
  wall = float(np.median(times))
  return wall, out, max(first - wall, 0.0)


def prefill_seconds(mc, params, toks, lens, slots: int, n: int) -> float:
  """Median seconds of the decoder's prefill alone: the prompt's window forward into an empty KV
  cache of `slots`, as `sampler._decode` runs it."""
  p = toks.shape[1]
  pos = masks.left_pad_positions(jnp.asarray(lens), p, slots)
  fn = jax.jit(lambda prm, t, n_: sampler.window_forward(mc, prm, t, 0, qwen3.init_cache(mc, t.shape[0], slots),
                                                         n_, p, pos, return_hidden=True)[0][:, -1])
  return time_call(lambda i: fn(params, toks, lens), n)[0]


def read_weight_bytes(cfg) -> int:
  """Bytes of the weights a decoding step reads: all but an untied input embedding."""
  shapes = jax.eval_shape(lambda p: qwen3.decode_params(cfg, p, FLAGS.weight_dtype), qwen3.param_shapes(cfg))
  total = sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(shapes))
  emb = shapes["embed_tokens"]["embedding"]
  return total - (0 if cfg.tie_word_embeddings else int(np.prod(emb.shape)) * jnp.dtype(emb.dtype).itemsize)


def window_costs(cfg, params, batch: int, slots: int, widths=(1, 32, 64), head: bool = False) -> dict:
  """Seconds of one forward of a W-slot window against a `slots` KV cache, for W in `widths`
  (`programs.window_loop`, best of 3 calls)."""
  out = {}
  for w in widths:
    call, n = programs.window_loop(cfg, params, batch, slots, w, head)
    best = float("inf")
    for _ in range(3):
      t0 = time.perf_counter()
      jax.block_until_ready(call())
      best = min(best, time.perf_counter() - t0)
    out[w] = best / n
  return out


def rows_meta() -> dict:
  """What every JSON row carries: where and with what it ran (device, jax_version, git_commit, ...:
  `dgr2_jax.results.run_meta()`) and how the params were prepared."""
  return dict(results_lib.run_meta(), platform=platform.machine(), weight_dtype=FLAGS.weight_dtype or "compute",
              fuse_projections=FLAGS.fuse_projections)


def request_figures(wall: float, prefill: float, generated) -> dict:
  """A row's figures from the call's wall time, one prefill's, and the tokens each row generated:
  per request (a row of the static batch: it waits for the whole call) and for the batch."""
  generated = np.asarray(generated, np.float64)
  per, total, decode = float(generated.mean()), float(generated.sum()), wall - prefill
  nan = float("nan")   # decode-only is nan where the prefill timed alone is not shorter than the call
  return dict(new_tokens=per, request_wall_s=wall, request_prefill_s=prefill, request_decode_s=decode,
              request_tokens_per_s=per / wall, request_decode_tokens_per_s=per / decode if decode > 0 else nan,
              wall_s=wall, prefill_s=prefill, tokens_per_s=total / wall,
              decode_tokens_per_s=total / decode if decode > 0 else nan)


def decode_row(cfg, params, toks, lens, dc, commits=None, repeats: int = 3):
  """Times one decoder (a forced schedule `commits` [B, T+1] or None) -> (row, last output)."""
  dc = dataclasses.replace(dc, weight_dtype=FLAGS.weight_dtype)
  mc, fn = sampler.decoder_for(cfg, dc, fuse_projections=FLAGS.fuse_projections)
  wall, out, compile_s = time_call(
      lambda i: sampler.run_decoder(fn, params, toks, lens, dc, jax.random.PRNGKey(i), commits), repeats)
  prefill = prefill_seconds(mc, params, toks, lens, max(toks.shape[1], dc.block_size) + dc.max_new_tokens, repeats)
  generated = (np.asarray(out["commit_step"]) >= 0).sum(1)   # EOS is off: every committed token is output
  row = dict(batch=int(toks.shape[0]), block_size=dc.block_size, steps_per_block=dc.steps_per_block,
             **request_figures(wall, prefill, generated), compile_s=compile_s,
             nfe_per_seq=float(np.mean(np.asarray(out["nfe"]))), forward_passes=int(out["forward_passes"]))
  return row, out


def check_replay(out, schedules, block_size: int, kv_write: str) -> None:
  """A replay must run each row's recorded steps: its step count and NFE (`schedule_lib.nfe`)."""
  steps, nfe = np.asarray(out["steps"]), np.asarray(out["nfe"])
  want_steps = [len(c) for c in schedules]
  want_nfe = [schedule_lib.nfe(c, block_size, kv_write) for c in schedules]
  per_step = [np.bincount(c[c >= 0]).tolist() for c in np.asarray(out["commit_step"])]
  if steps.tolist() != want_steps or nfe.tolist() != want_nfe or per_step != [list(c) for c in schedules]:
    raise RuntimeError(f"replay: rows ran steps {steps.tolist()} / NFE {nfe.tolist()}, the schedule has "
                       f"{want_steps} / {want_nfe}")


def replay_rows(cfg, params, obj: dict, toks, lens, seed: int, kv_write: str, repeats: int, source: str):
  """AR and the replayed schedule `obj` (decode/schedule.py) on the prompts toks/lens, each row drawing
  one recorded answer (`schedule_lib.draw`); AR generates the same tokens per row. -> [AR row, replay row]."""
  b = toks.shape[0]
  drawn = schedule_lib.draw(obj, b, seed)
  scheds = [a["commits"] for a in drawn]
  longest = max(len(a["commits"]) for a in obj["answers"])   # one compilation for every draw
  bs, r = obj["block_size"], obj["max_new_tokens"]
  rows = []
  for name, block, sch, t in (("ar (replayed lengths)", 1, [[1] * sum(c) for c in scheds], r),
                              ("replayed schedule", bs, scheds, longest)):
    dc = sampler.DecodeConfig(block_size=block, threshold=1.0, max_new_tokens=r, eos_ids=(),
                              mask_token_id=cfg.mask_token_id, pad_id=0, steps_per_block=0, kv_write=kv_write)
    row, out = decode_row(cfg, params, toks, lens, dc, schedule_lib.forced_commits(sch, t), repeats)
    resolved = sampler.resolve_kv_write(kv_write, b)
    check_replay(out, sch, block, resolved)
    row.update(name=name, kv_write=resolved, schedule=f"{'AR at the lengths of the ' if block == 1 else ''}"
               f"replayed schedule from {source}", answers=[a.get("example_id") for a in drawn])
    if block > 1:
      row.update(recorded_nfe_per_seq=float(np.mean([a.get("nfe", np.nan) for a in drawn])),
                 recorded_kv_write=obj.get("kv_write"), recorded_threshold=obj.get("threshold"),
                 recorded_model=obj.get("model"))
    rows.append(row)
  return rows


def pooled_replay_rows(cfg, params, obj: dict, toks, lens, source: str):
  """`replay_rows` for `--schedule_draws` draws of answers (seeds schedule_seed + i), pooled per row
  kind: the mean call and prefill times and the mean tokens per request over the draws (so the
  request figure is all the draws' tokens over all their time), NFE averaged, answers listed."""
  draws = [replay_rows(cfg, params, obj, toks, lens, FLAGS.schedule_seed + i, FLAGS.kv_write, FLAGS.repeats, source)
           for i in range(max(1, FLAGS.schedule_draws))]
  pooled = []
  for kind in zip(*draws):
    mean = lambda key: float(np.mean([r[key] for r in kind]))
    row = dict(kind[0], **request_figures(mean("wall_s"), mean("prefill_s"),
                                          [mean("new_tokens")] * kind[0]["batch"]))
    row.update(nfe_per_seq=mean("nfe_per_seq"), compile_s=kind[0]["compile_s"], draws=len(kind),
               answers=[a for r in kind for a in r["answers"]])
    if "recorded_nfe_per_seq" in row:
      row["recorded_nfe_per_seq"] = mean("recorded_nfe_per_seq")
    pooled.append(row)
  return pooled


def forced_rows(cfg, params, toks, lens, new: int, repeats: int):
  """AR and the forced c-commit rows (tau 1, steps_per_block = B / c) at `new` tokens per row."""
  settings = [("ar", 1, 0)] + [(f"diffusion c={c}", FLAGS.block_size, FLAGS.block_size // int(c))
                               for c in FLAGS.commits]
  rows = []
  for name, block, spb in settings:
    dc = sampler.DecodeConfig(block_size=block, threshold=1.0, max_new_tokens=new, eos_ids=(),
                              mask_token_id=cfg.mask_token_id, pad_id=0, steps_per_block=spb, kv_write=FLAGS.kv_write)
    row, _ = decode_row(cfg, params, toks, lens, dc, None, repeats)
    rows.append(dict(name=name, kv_write=sampler.resolve_kv_write(FLAGS.kv_write, toks.shape[0]), **row))
  return rows


def add_ar_figures(rows: list, cfg, weight_bytes: int, hbm: float, prompt_len: int) -> None:
  """The AR row's roofline, and every row's speedups against the AR row (rows[0]) of its group."""
  ar = rows[0]
  bsz, new = ar["batch"], ar["new_tokens"]
  kv_bytes = (prompt_len + new / 2) * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * \
      cfg.head_dim * jnp.dtype(cfg.jnp_dtype).itemsize * bsz
  ar["roofline_tokens_per_s"] = bsz * hbm * 1e9 / (weight_bytes + kv_bytes) if hbm else None
  ar["roofline_fraction"] = ar["decode_tokens_per_s"] / ar["roofline_tokens_per_s"] if hbm else None
  for r in rows:
    r["request_speedup"] = r["request_tokens_per_s"] / ar["request_tokens_per_s"]
    r["speedup"] = r["decode_tokens_per_s"] / ar["decode_tokens_per_s"]


def print_table(rows: list) -> None:
  print("| new tokens | batch | decoder | request tok/s | request s (prefill + decode) | prefill s | "
        "vs AR (request) | request decode-only tok/s | batch decode-only tok/s | vs AR (decode) | "
        "batch tok/s with prefill | NFE/seq | AR roofline tok/s | AR roofline fraction | compile s |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    rf, fr = r.get("roofline_tokens_per_s"), r.get("roofline_fraction")
    print(f"| {r['new_tokens']:.1f} | {r['batch']} | {r['name']} | {r['request_tokens_per_s']:.1f} | "
          f"{r['request_wall_s']:.3f} | {r['request_prefill_s']:.3f} | {r['request_speedup']:.2f}x | "
          f"{r['request_decode_tokens_per_s']:.1f} | {r['decode_tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
          f"{r['tokens_per_s']:.1f} | {r['nfe_per_seq']:.1f} | "
          f"{'' if rf is None else f'{rf:.0f}'} | {'' if fr is None else f'{fr:.0%}'} | {r['compile_s']:.1f} |")


def main(_):
  # The decode loop in CUDA graphs on a GPU, as the decode entry points set it (DGR2_COMMAND_BUFFERS=0: off).
  xla_flags.configure_gpu_flags()
  cfg, params = load_model()
  n_params = qwen3.count_params(qwen3.param_shapes(cfg))
  weight_bytes = read_weight_bytes(cfg)
  meta = rows_meta()
  kind = meta["device"]
  hbm = FLAGS.hbm_gbps or next((v for k, v in HBM_GBPS.items() if k.lower() in kind.lower()), 0.0)
  sched = schedule_lib.read(FLAGS.schedule) if FLAGS.schedule else None
  source = f"{FLAGS.schedule}, {'weights of ' + FLAGS.model_dir if FLAGS.model_dir else 'random weights'}"
  rs = np.random.RandomState(0)
  rows = []
  print(f"# decode throughput: {kind} x{jax.device_count()}, jax {jax.__version__}, commit {meta['git_commit']}, "
        f"{platform.machine()}; model {FLAGS.model_dir or FLAGS.preset} ({n_params / 1e6:.1f}M params, {cfg.dtype}, "
        f"attention {cfg.attention_impl}, weights {FLAGS.weight_dtype or cfg.dtype}, fused projections "
        f"{FLAGS.fuse_projections}); prompt {FLAGS.prompt_len}, EOS off, kv_write " +
        ", ".join(f"{sampler.resolve_kv_write(FLAGS.kv_write, int(b))} at batch {b}" for b in FLAGS.batch_sizes) +
        (f"; replaying {FLAGS.schedule} ({len(sched['answers'])} answers, block {sched['block_size']}, "
         f"tau {sched.get('threshold')})" if sched else ""), flush=True)
  for new in ([sched["max_new_tokens"]] if sched else map(int, FLAGS.max_new_tokens)):
    for bsz in map(int, FLAGS.batch_sizes):
      prompts = [list(rs.randint(10, cfg.vocab_size - 2, FLAGS.prompt_len)) for _ in range(bsz)]
      toks, lens = sampler.left_pad(prompts, FLAGS.prompt_len, 0)
      group = (pooled_replay_rows(cfg, params, sched, toks, lens, source) if sched
               else forced_rows(cfg, params, toks, lens, new, FLAGS.repeats))
      add_ar_figures(group, cfg, weight_bytes, hbm, FLAGS.prompt_len)
      for row in group:
        row.update(meta)
        print(f"  batch {bsz} {row['name']}: {row['new_tokens']:.1f} tokens/request in {row['request_wall_s']:.3f}s "
              f"= {row['request_tokens_per_s']:.1f} request tok/s ({row['request_speedup']:.2f}x AR); decode only "
              f"{row['request_decode_tokens_per_s']:.1f} per request, {row['decode_tokens_per_s']:.1f} per batch "
              f"({row['speedup']:.2f}x AR), NFE {row['nfe_per_seq']:.1f}"
              + (f" (recorded {row['recorded_nfe_per_seq']:.1f})" if "recorded_nfe_per_seq" in row else "")
              + f", compile {row['compile_s']:.1f}s", flush=True)
      rows += group
  costs = window_costs(cfg, params, 1, FLAGS.prompt_len + 64)
  print()
  print_table(rows)
  print(f"\nwindow cost at batch 1 (prompt {FLAGS.prompt_len} + 64 cache slots): 1 slot {costs[1] * 1e3:.3f} ms, "
        f"32 slots {costs[32] * 1e3:.3f} ms ({costs[32] / costs[1]:.2f}x), 64 slots {costs[64] * 1e3:.3f} ms "
        f"({costs[64] / costs[1]:.2f}x)")
  if FLAGS.json_out:
    meta.update(model=FLAGS.model_dir or FLAGS.preset, dtype=str(cfg.dtype), prompt_len=FLAGS.prompt_len,
                schedule=FLAGS.schedule or None, schedule_seed=FLAGS.schedule_seed if sched else None)
    with open(FLAGS.json_out, "w") as f:
      json.dump({"meta": meta, "rows": rows, "window_cost_s": costs, "device": kind}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
