"""Training-step throughput: tokens/s and model FLOPs utilisation of the SFT (and CFT) step.

  python benchmarks/train_step.py                          # tiny model on whatever devices exist
  python benchmarks/train_step.py --preset=0p6b_like       # Qwen3-0.6B shape, seq 2048, bf16, remat

Times the real jitted `loop.make_train_step` (loss + grads + AdamW, state donated) on synthetic
batches with every slot real, after a compile (reported separately) and warmup steps. Columns:
  tokens/s      example tokens (b * (P + R)) per second
  model tok/s   tokens the model actually runs (SFT: P + R; CFT two-stream: P + 2R per example)
  MFU           6 * N * model tokens / step time / peak FLOP/s (N = all parameters; attention
                FLOPs not counted), only when the peak is known (--peak_tflops or the table).
CFT is benchmarked when `dgr2_jax.train.cft.cft_loss` is importable.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dgr2_jax.model import qwen3  # noqa: E402
from dgr2_jax.model.config import Qwen3Config  # noqa: E402
from dgr2_jax.train import config as train_config_lib  # noqa: E402
from dgr2_jax.train import loop, losses, mesh as mesh_lib, optim, synthetic  # noqa: E402

# Dense bf16 peak FLOP/s by device_kind substring (vendor datasheets, no sparsity).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L4": 121.0, "v5p": 459.0, "v5e": 197.0,
               "v4": 275.0}

PRESETS = {
    # The tiny demo model (configs/base.py model section with the demo tokenizer's order of vocab).
    "tiny": dict(model=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            tie_word_embeddings=True),
                 batch=8, prompt=64, response=128, dtype="float32", remat=False),
    # Qwen3-0.6B's shape (random init), bf16 compute with f32 master weights, sequence 2048.
    "0p6b_like": dict(model=dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                 head_dim=128, tie_word_embeddings=True),
                      batch=8, prompt=512, response=1536, dtype="bfloat16", remat=True),
}


def peak_flops(flag: float) -> float | None:
  if flag > 0:
    return flag * 1e12
  kind = jax.devices()[0].device_kind
  for key, tf in PEAK_TFLOPS.items():
    if key.lower() in kind.lower():
      return tf * 1e12
  return None


def make_losses(mc: Qwen3Config, block_size: int):
  out = {"sft": (lambda p, b, r: losses.sft_loss(mc, p, b), 1)}
  try:
    from dgr2_jax.train import cft  # pylint: disable=import-outside-toplevel
  except ImportError:
    return out
  kw = {}
  sig = inspect.signature(cft.cft_loss).parameters
  if "block_size" in sig:
    kw["block_size"] = block_size
  if "mask_id" in sig:
    kw["mask_id"] = mc.vocab_size - 1
  out["cft"] = (lambda p, b, r: cft.cft_loss(mc, p, b, r, **kw), 2)
  return out


def bench_one(name, loss_fn, resp_copies, mc, params_fn, batch, args, mesh, peak):
  tc = train_config_lib.train_config()
  opt, sched = optim.make_optimizer(tc.optimizer, 1000)
  rules = tuple(tc.logical_axis_rules)
  shapes = jax.eval_shape(params_fn, jax.random.PRNGKey(0))
  _, sh = loop.state_shardings(shapes, opt, mesh, rules)
  state = loop.init_state(params_fn, opt, sh, 0, jnp.float32)
  b_sh = mesh_lib.batch_sharding(mesh, rules, args.batch)
  gbatch = mesh_lib.shard_batch(batch, b_sh, args.batch)
  step = jax.jit(loop.make_train_step(loss_fn, opt, sched, args.grad_accum), in_shardings=(sh, b_sh),
                 out_shardings=(sh, None), donate_argnums=(0,))
  t = time.perf_counter()
  compiled = step.lower(state, gbatch).compile()
  compile_s = time.perf_counter() - t
  for _ in range(args.warmup):
    state, m = compiled(state, gbatch)
  jax.block_until_ready(m)
  t = time.perf_counter()
  for _ in range(args.steps):
    state, m = compiled(state, gbatch)
  jax.block_until_ready((state, m))
  step_s = (time.perf_counter() - t) / args.steps
  n_params = qwen3.count_params(shapes)
  p, r = args.prompt, args.response
  tokens = args.batch * (p + r)
  model_tokens = args.batch * (p + resp_copies * r)
  mfu = 6 * n_params * model_tokens / step_s / peak if peak else None
  mem = None
  try:
    stats = jax.devices()[0].memory_stats() or {}
    mem = stats.get("peak_bytes_in_use")
  except Exception:  # pylint: disable=broad-except
    pass
  return dict(loss=name, params=n_params, batch=args.batch, seq=p + r, compile_s=compile_s,
              step_ms=step_s * 1e3, tok_s=tokens / step_s, model_tok_s=model_tokens / step_s,
              mfu=mfu, peak_gb=None if mem is None else mem / 2**30, final_loss=float(m["loss"]))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
  ap.add_argument("--batch", type=int, default=0, help="global batch (0: preset)")
  ap.add_argument("--prompt", type=int, default=0, help="prompt slots P (0: preset)")
  ap.add_argument("--response", type=int, default=0, help="response slots R (0: preset)")
  ap.add_argument("--dtype", default="", help="compute dtype (default: preset)")
  ap.add_argument("--remat", default="", choices=["", "true", "false"])
  ap.add_argument("--grad_accum", type=int, default=1)
  ap.add_argument("--block_size", type=int, default=32, help="CFT block size")
  ap.add_argument("--steps", type=int, default=5)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--losses", default="sft,cft", help="which of sft,cft to run (cft if importable)")
  ap.add_argument("--peak_tflops", type=float, default=0.0, help="override the peak table")
  ap.add_argument("--mesh", default="-1,1,1", help="data,fsdp,tensor")
  args = ap.parse_args(argv)
  pre = PRESETS[args.preset]
  args.batch = args.batch or pre["batch"]
  args.prompt = args.prompt or pre["prompt"]
  args.response = args.response or pre["response"]
  dtype = args.dtype or pre["dtype"]
  remat = pre["remat"] if not args.remat else args.remat == "true"
  mc = Qwen3Config(**pre["model"], dtype=dtype, param_dtype="float32", remat=remat,
                   mask_token_id=pre["model"]["vocab_size"] - 1)
  mesh = mesh_lib.make_mesh(dict(zip(mesh_lib.AXES, map(int, args.mesh.split(",")))))
  batch = synthetic.SyntheticSFTIterator(args.batch, args.prompt, args.response, mc.vocab_size,
                                         seed=0, full=True).batch(0)
  peak = peak_flops(args.peak_tflops)
  params_fn = functools.partial(qwen3.init_params, mc)
  print(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}; mesh {dict(mesh.shape)}; "
        f"preset {args.preset} dtype {dtype} remat {remat}; peak "
        f"{'%.0f TFLOP/s' % (peak / 1e12) if peak else 'unknown (MFU n/a)'}", flush=True)
  rows = []
  for name, (fn, copies) in make_losses(mc, args.block_size).items():
    if name not in args.losses.split(","):
      continue
    rows.append(bench_one(name, fn, copies, mc, params_fn, batch, args, mesh, peak))
    print(rows[-1], flush=True)
  hdr = ["loss", "params", "batch", "seq", "compile_s", "step_ms", "tok_s", "model_tok_s", "mfu", "peak_gb"]
  print("\n| " + " | ".join(hdr) + " |\n|" + "---|" * len(hdr))
  for r in rows:
    cells = []
    for h in hdr:
      v = r[h]
      cells.append("n/a" if v is None else (f"{v:.3g}" if isinstance(v, float) and h == "mfu"
                                            else f"{v:,.1f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v)))
    print("| " + " | ".join(cells) + " |")
  return rows


if __name__ == "__main__":
  main()
