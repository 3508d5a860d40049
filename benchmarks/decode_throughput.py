"""Decode wall-clock at the paper's operating point: AR vs block diffusion at forced commit schedules.

  python benchmarks/decode_throughput.py                                   # tiny random model, CPU
  python benchmarks/decode_throughput.py --preset=qwen3_8b --dtype=bfloat16  # Qwen3-8B shape (GPU)
  python benchmarks/decode_throughput.py --model_dir=DIR                   # a real checkpoint (HF or ours)

Random weights are confident nowhere, so a threshold would commit one token per step. Instead the
diffusion rows force a schedule through the step budget: tau = 1 and `steps_per_block` = B / c
commit exactly c tokens per step (c = `--commits`), i.e. NFE = tokens / c (+ one K/V write per block
when `kv_write` is separate): wall-clock at a known NFE, without a trained model. Prompts of
`--prompt_len` tokens (paper ~2200), `--max_new_tokens` generated (128 and 512), EOS disabled so
every row generates exactly that many. All rows in one process, side by side:
  * AR (block size 1) tokens/s and its fraction of the HBM roofline: at batch b a decode step
    reads every weight once plus the KV cache, so roofline tokens/s = b * bandwidth / (weight
    bytes + KV bytes read per step) (`--hbm_gbps`, default from the device kind);
  * diffusion tokens/s per schedule, its ratio to AR, NFE per sequence;
  * window cost: one forward of a 32- and a 64-slot window against the full KV cache relative to
    a 1-slot AR step (each timed in a `fori_loop`).
Throughput = generated tokens / wall time of the jitted generate call after a warm-up call, and
the decode rate without the prompt's prefill (generated tokens / (wall - one prefill of the same
prompts, timed alone)); compile time = the first call's time less a timed call's. The roofline
counts the weights a step reads: all of them but an untied input embedding (a step gathers a few
of its rows). `--json_out` writes the rows.
"""

from __future__ import annotations

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
from dgr2_jax.decode import sampler  # noqa: E402
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

PRESETS = {
    "tiny": dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "small": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32),
    "qwen3_0p6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3_8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}
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
  return cfg, jax.device_put(params)


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
  shapes = qwen3.param_shapes(cfg)
  total = sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(shapes))
  emb = shapes["embed_tokens"]["embedding"]
  return total - (0 if cfg.tie_word_embeddings else int(np.prod(emb.shape)) * jnp.dtype(emb.dtype).itemsize)


def window_loop(cfg, params, batch: int, slots: int, width: int, head: bool = False, n: int = 50):
  """A compiled call running `n` forwards of a `width`-slot window against a `slots` KV cache in
  one `fori_loop` (each writing the cache the next one reads; `head`: the window's positions
  projected to the vocabulary too, as a decoding step does). Returns (call, n)."""
  p = slots - 64
  plen = jnp.full((batch,), p, jnp.int32)
  pos = masks.left_pad_positions(plen, p, slots)
  c = cfg.as_block_diffusion(1) if width == 1 else cfg.as_block_diffusion(min(width, 32), cfg.mask_token_id)
  toks = jnp.zeros((batch, width), jnp.int32)

  @jax.jit
  def loop(cache):
    def body(i, carry):
      cache, acc = carry
      h, cache = sampler.window_forward(c, params, toks + i % 2, p, cache, plen, p, pos, return_hidden=True)
      return cache, acc + (qwen3.lm_head(c, params, h).max() if head else h[0, 0, 0])
    return jax.lax.fori_loop(0, n, body, (cache, jnp.float32(0)))
  cache = qwen3.init_cache(c, batch, slots)
  call = lambda: loop(cache)
  jax.block_until_ready(call())
  return call, n


def window_costs(cfg, params, batch: int, slots: int, widths=(1, 32, 64), head: bool = False) -> dict:
  """Seconds of one forward of a W-slot window against a `slots` KV cache, for W in `widths`
  (`window_loop`, best of 3 calls)."""
  out = {}
  for w in widths:
    call, n = window_loop(cfg, params, batch, slots, w, head)
    best = float("inf")
    for _ in range(3):
      t0 = time.perf_counter()
      jax.block_until_ready(call())
      best = min(best, time.perf_counter() - t0)
    out[w] = best / n
  return out


def main(_):
  cfg, params = load_model()
  n_params = qwen3.count_params(qwen3.param_shapes(cfg))
  weight_bytes = read_weight_bytes(cfg)
  kind = jax.devices()[0].device_kind
  hbm = FLAGS.hbm_gbps or next((v for k, v in HBM_GBPS.items() if k.lower() in kind.lower()), 0.0)
  rs = np.random.RandomState(0)
  rows = []
  print(f"# decode throughput: {kind} x{jax.device_count()}, jax {jax.__version__}, {platform.machine()}; model "
        f"{FLAGS.model_dir or FLAGS.preset} ({n_params / 1e6:.1f}M params, {cfg.dtype}, "
        f"attention {cfg.attention_impl}); "
        f"prompt {FLAGS.prompt_len}, EOS off, kv_write " +
        ", ".join(f"{sampler.resolve_kv_write(FLAGS.kv_write, int(b))} at batch {b}" for b in FLAGS.batch_sizes),
        flush=True)
  for new in map(int, FLAGS.max_new_tokens):
    for bsz in map(int, FLAGS.batch_sizes):
      prompts = [list(rs.randint(10, cfg.vocab_size - 2, FLAGS.prompt_len)) for _ in range(bsz)]
      toks, lens = sampler.left_pad(prompts, FLAGS.prompt_len, 0)
      settings = [("ar", 1, 1.0, 0)] + [(f"diffusion c={c}", FLAGS.block_size, 1.0, FLAGS.block_size // int(c))
                                        for c in FLAGS.commits]
      ar = None
      for name, block, tau, spb in settings:
        dc = sampler.DecodeConfig(block_size=block, threshold=tau, max_new_tokens=new, eos_ids=(),
                                  mask_token_id=cfg.mask_token_id, pad_id=0, steps_per_block=spb,
                                  kv_write=FLAGS.kv_write)
        mc, fn = sampler.decoder_for(cfg, dc)
        wall, out, compile_s = time_call(
            lambda i: sampler.run_decoder(fn, params, toks, lens, dc, jax.random.PRNGKey(i)), FLAGS.repeats)
        slots = max(FLAGS.prompt_len, block) + new
        prefill = prefill_seconds(mc, params, toks, lens, slots, FLAGS.repeats)
        row = dict(name=name, batch=bsz, new_tokens=new, block_size=block, steps_per_block=spb, wall_s=wall,
                   prefill_s=prefill,
                   # nan where the prefill timed alone is not shorter than the whole call (tiny models)
                   decode_tokens_per_s=bsz * new / (wall - prefill) if wall > prefill else float("nan"),
                   compile_s=compile_s, tokens_per_s=bsz * new / wall,
                   nfe_per_seq=float(np.mean(np.asarray(out["nfe"]))), forward_passes=int(out["forward_passes"]))
        if name == "ar":
          kv_bytes = (FLAGS.prompt_len + new / 2) * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * \
              cfg.head_dim * jnp.dtype(cfg.jnp_dtype).itemsize * bsz
          row["roofline_tokens_per_s"] = bsz * hbm * 1e9 / (weight_bytes + kv_bytes) if hbm else None
          row["roofline_fraction"] = row["decode_tokens_per_s"] / row["roofline_tokens_per_s"] if hbm else None
          ar = row
        row["speedup"] = row["decode_tokens_per_s"] / ar["decode_tokens_per_s"]
        rows.append(row)
        print(f"  new {new} batch {bsz} {name}: {row['decode_tokens_per_s']:.1f} decode tok/s "
              f"({row['speedup']:.2f}x AR; {row['tokens_per_s']:.1f} with the prefill), "
              f"NFE {row['nfe_per_seq']:.1f}, compile {compile_s:.1f}s", flush=True)
  costs = window_costs(cfg, params, 1, FLAGS.prompt_len + 64)
  print()
  print("| new tokens | batch | decoder | decode tokens/s | vs AR | tokens/s with prefill | prefill s | NFE/seq | "
        "AR roofline tok/s | AR roofline fraction | compile s |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    rf = r.get("roofline_tokens_per_s")
    fr = r.get("roofline_fraction")
    print(f"| {r['new_tokens']} | {r['batch']} | {r['name']} | {r['decode_tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
          f"{r['tokens_per_s']:.1f} | {r['prefill_s']:.3f} | {r['nfe_per_seq']:.1f} | "
          f"{'' if rf is None else f'{rf:.0f}'} | {'' if fr is None else f'{fr:.0%}'} | "
          f"{r['compile_s']:.1f} |")
  print(f"\nwindow cost at batch 1 (prompt {FLAGS.prompt_len} + 64 cache slots): 1 slot {costs[1] * 1e3:.3f} ms, "
        f"32 slots {costs[32] * 1e3:.3f} ms ({costs[32] / costs[1]:.2f}x), 64 slots {costs[64] * 1e3:.3f} ms "
        f"({costs[64] / costs[1]:.2f}x)")
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as f:
      json.dump({"rows": rows, "window_cost_s": costs, "device": kind}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
