"""Decode throughput: AR (B = 1) vs block diffusion (B = 32, several tau), one model, one run.

  python benchmarks/decode_throughput.py                        # tiny random model, CPU
  python benchmarks/decode_throughput.py --preset=qwen3_0p6b    # Qwen3-0.6B-shaped random model (GPU)
  python benchmarks/decode_throughput.py --model_dir=DIR        # a real checkpoint (HF or ours)

Prompts of ~`--prompt_len` tokens (paper: ~2200) and `--max_new_tokens` generated (paper: ~130; a
multiple of the block size). EOS is disabled so every row generates exactly max_new_tokens tokens
and rows are comparable. Throughput = generated tokens / wall time of the jitted generate call
(after a warm-up call; compile time is reported separately). NFE = forward passes after prefill.
On a random model the confidence rarely reaches tau, so block diffusion commits ~1 token per step
and its speedup is small: that is expected; the table's rows all come from this one run.
`--hf_baseline` adds transformers' generate (torch, static cache) on the same weights (CPU torch).
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
from dgr2_jax.model import qwen3  # noqa: E402
from dgr2_jax.model.config import Qwen3Config  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model_dir", "", "HF or dgr2_jax model directory; empty = --preset random model")
flags.DEFINE_enum("preset", "tiny", ["tiny", "small", "qwen3_0p6b"], "random model shape")
flags.DEFINE_integer("prompt_len", 2200, "prompt tokens")
flags.DEFINE_integer("max_new_tokens", 128, "generated tokens (multiple of every block size)")
flags.DEFINE_list("batch_sizes", ["1", "8"], "batch sizes")
flags.DEFINE_list("thresholds", ["1.0", "0.9", "0.6", "0.4"], "tau values for block diffusion")
flags.DEFINE_integer("block_size", 32, "block size of the diffusion rows")
flags.DEFINE_integer("repeats", 3, "timed calls per row (median reported)")
flags.DEFINE_string("dtype", "", "compute dtype override (bfloat16 on GPU)")
flags.DEFINE_bool("hf_baseline", False, "also time transformers generate (torch, static cache; CUDA if available)")
flags.DEFINE_string("json_out", "", "also write the rows as JSON here")

PRESETS = {
    "tiny": dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "small": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32),
    "qwen3_0p6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
}


def load_model():
  if FLAGS.model_dir:
    from dgr2_jax.model import checkpoint
    cfg, params = checkpoint.load_model_dir(FLAGS.model_dir)
  else:
    cfg = Qwen3Config(rope_theta=1e6, **PRESETS[FLAGS.preset])
    params = qwen3.init_params(cfg, jax.random.PRNGKey(0))
  if FLAGS.dtype:
    cfg = cfg.replace(dtype=FLAGS.dtype, param_dtype=FLAGS.dtype)
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, cfg.jnp_param_dtype), params)
  if cfg.mask_token_id is None:  # a random/AR model: use the last id as the mask for the benchmark
    cfg = cfg.replace(mask_token_id=cfg.vocab_size - 1)
  params = jax.device_put(params)
  return cfg, params


def time_row(cfg, params, prompts, dc):
  t0 = time.perf_counter()
  out = sampler.generate(cfg, params, prompts, dc, rng=jax.random.PRNGKey(0), return_device=True)
  jax.block_until_ready(out)
  first = time.perf_counter() - t0
  times = []
  for i in range(FLAGS.repeats):
    t0 = time.perf_counter()
    out = sampler.generate(cfg, params, prompts, dc, rng=jax.random.PRNGKey(i + 1), return_device=True)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - t0)
  wall = float(np.median(times))
  return dict(wall_s=wall, compile_s=max(first - wall, 0.0), nfe_per_seq=float(np.mean(np.asarray(out["nfe"]))),
              forward_passes=int(out["forward_passes"]),
              tokens_per_s=len(prompts) * FLAGS.max_new_tokens / wall)


def hf_row(cfg, params, prompts):
  import tempfile
  import torch
  from transformers import AutoModelForCausalLM
  from dgr2_jax.model import checkpoint
  with tempfile.TemporaryDirectory() as d:
    checkpoint.save_hf_dir(os.path.join(d, "hf"), cfg.replace(param_dtype="float32"),
                           jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), params))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tdtype = torch.bfloat16 if (dev == "cuda" and cfg.dtype == "bfloat16") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(os.path.join(d, "hf"), dtype=tdtype).to(dev).eval()
  ids = torch.tensor(prompts, device=dev)
  kw = dict(do_sample=False, max_new_tokens=FLAGS.max_new_tokens, min_new_tokens=FLAGS.max_new_tokens,
            cache_implementation="static", pad_token_id=0, attention_mask=torch.ones_like(ids))
  with torch.no_grad():
    t0 = time.perf_counter()
    model.generate(ids, **kw)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.generate(ids, **kw)
    if dev == "cuda":
      torch.cuda.synchronize()
    wall = time.perf_counter() - t0
  return dict(wall_s=wall, compile_s=max(first - wall, 0.0), nfe_per_seq=float(FLAGS.max_new_tokens - 1),
              forward_passes=FLAGS.max_new_tokens - 1, tokens_per_s=len(prompts) * FLAGS.max_new_tokens / wall)


def main(_):
  cfg, params = load_model()
  rs = np.random.RandomState(0)
  rows = []
  print(f"# decode throughput: {jax.devices()[0].device_kind} x{jax.device_count()}, jax {jax.__version__}, "
        f"{platform.machine()}; model {FLAGS.model_dir or FLAGS.preset} "
        f"({qwen3.count_params(qwen3.param_shapes(cfg)) / 1e6:.1f}M params, {cfg.dtype}); "
        f"prompt {FLAGS.prompt_len} tokens, {FLAGS.max_new_tokens} generated, EOS off", flush=True)
  for bsz in map(int, FLAGS.batch_sizes):
    prompts = [list(rs.randint(10, cfg.vocab_size - 2, FLAGS.prompt_len)) for _ in range(bsz)]
    settings = [(1, 1.0)] + [(FLAGS.block_size, float(t)) for t in FLAGS.thresholds]
    ar = None
    for block, tau in settings:
      dc = sampler.DecodeConfig(block_size=block, threshold=tau, max_new_tokens=FLAGS.max_new_tokens,
                                eos_ids=(), mask_token_id=cfg.mask_token_id, pad_id=0)
      row = dict(engine="dgr2_jax", batch=bsz, block_size=block, threshold=tau, **time_row(cfg, params, prompts, dc))
      ar = ar or row
      row["speedup"] = row["tokens_per_s"] / ar["tokens_per_s"]
      row["nfe_speedup"] = ar["nfe_per_seq"] / max(row["nfe_per_seq"], 1e-9)
      rows.append(row)
      print(f"  batch {bsz} B={block} tau={tau}: {row['tokens_per_s']:.1f} tok/s, NFE {row['nfe_per_seq']:.1f}, "
            f"compile {row['compile_s']:.1f}s", flush=True)
    if FLAGS.hf_baseline:
      row = dict(engine="transformers generate (torch, static cache)", batch=bsz, block_size=1, threshold=1.0,
                 **hf_row(cfg, params, prompts))
      row["speedup"] = row["tokens_per_s"] / ar["tokens_per_s"]
      row["nfe_speedup"] = 1.0
      rows.append(row)
  print()
  print("| engine | batch | B | tau | tokens/s | NFE/seq | speedup vs AR (tok/s) | NFE ratio | compile s |")
  print("|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['engine']} | {r['batch']} | {r['block_size']} | {r['threshold']} | {r['tokens_per_s']:.1f} | "
          f"{r['nfe_per_seq']:.1f} | {r['speedup']:.2f}x | {r['nfe_speedup']:.2f}x | {r['compile_s']:.1f} |")
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  app.run(main)
