"""Training-step throughput, MFU, memory and compile time of the SFT, CFT and OPD steps.

  python benchmarks/train_step.py                                   # tiny model on whatever devices exist
  python benchmarks/train_step.py --preset=0p6b_like                # Qwen3-0.6B shape, seq 2048, bf16, remat
  python benchmarks/train_step.py --preset=8b_like --compile_only --scan=both   # CPU: compile time from shapes

Times the real jitted `loop.make_train_step` (loss + grads + AdamW, state donated) on synthetic
batches with every slot real, after a compile (reported separately) and warmup steps. Columns:
  tokens/s      example tokens (b * (P + R)) per second
  model tok/s   tokens the model actually runs (SFT: P + R; CFT two-stream: P + 2R; OPD: the
                replay layout P + R + canvases, plus the teacher's P + R forward)
  MFU           (6 N + attention) FLOPs of the model tokens / step time / peak FLOP/s, where N
                counts the matmul parameters (the embedding lookup is not a matmul; the tied LM
                head is) and attention counts 12 x head_dim x heads per visible (query, key) pair
                of the layout's mask (forward 4, backward 8: what a kernel that skips masked
                blocks computes; the dense 'xla' route computes every pair), only when the peak
                is known (--peak_tflops or the table)
  peak GiB      device memory_stats() peak (GPU), else XLA's planned temp + argument bytes
  compile s     lowering + compilation of the step
`--compile_only` lowers and compiles from ShapeDtypeStructs (nothing allocated, any shape on any
machine) and reports compile time and XLA's memory plan, for `--scan` false, true or both.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dgr2_jax.model import masks, qwen3, streams  # noqa: E402
from dgr2_jax.model.config import Qwen3Config  # noqa: E402
from dgr2_jax.train import config as train_config_lib  # noqa: E402
from dgr2_jax.train import cft, loop, losses, mesh as mesh_lib, opd, optim, synthetic  # noqa: E402

# Dense bf16 peak FLOP/s by device_kind substring (vendor datasheets, no sparsity).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L4": 121.0, "v5p": 459.0, "v5e": 197.0,
               "v4": 275.0}
QWEN3 = dict(vocab_size=151936, num_key_value_heads=8, head_dim=128)
PRESETS = {
    "tiny": dict(model=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
                 batch=8, prompt=64, response=128, dtype="float32", remat=False),
    "0p6b_like": dict(model=dict(QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, tie_word_embeddings=True),
                      batch=8, prompt=512, response=1536, dtype="bfloat16", remat=True),
    "8b_like": dict(model=dict(QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, tie_word_embeddings=False),
                    batch=8, prompt=512, response=1536, dtype="bfloat16", remat=True),
}
BLOCK = 32
CANVASES = 4  # OPD replay canvases per block in the benchmark batch


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


def bench_one(name, mc, args, mesh, peak):
  tc = train_config_lib.train_config()
  opt, sched = optim.make_optimizer(tc.optimizer, 1000)
  rules = tuple(tc.logical_axis_rules)
  params_fn = functools.partial(qwen3.init_params, mc)
  shapes = jax.eval_shape(params_fn, jax.random.PRNGKey(0))
  state_shapes, sh = loop.state_shardings(shapes, opt, mesh, rules)
  loss_fn, batch, model_tok, frozen = make_case(name, mc, args.batch, args.prompt, args.response)
  b_sh = mesh_lib.batch_sharding(mesh, rules, args.batch)
  step = loop.make_train_step(loss_fn, opt, sched, args.grad_accum, with_frozen=frozen)
  teacher_sh = sh["params"] if frozen else None
  in_sh = (sh, b_sh) + ((teacher_sh,) if frozen else ())
  jitted = jax.jit(step, in_shardings=in_sh, out_shardings=(sh, None), donate_argnums=(0,))
  abstract_batch = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
  t = time.perf_counter()
  lowered = jitted.lower(state_shapes, abstract_batch, *((shapes,) if frozen else ()))
  compiled = lowered.compile()
  compile_s = time.perf_counter() - t
  ma = compiled.memory_analysis()
  plan_gb = (ma.temp_size_in_bytes + ma.argument_size_in_bytes) / 2**30 if ma is not None else None
  n_mat = matmul_params(mc)
  p, r = args.prompt, args.response
  attn_flops = 12 * mc.head_dim * mc.num_attention_heads * mc.num_hidden_layers * visible_pairs(name, p, r)
  row = dict(loss=name, scan=mc.scan_layers, params=qwen3.count_params(shapes), batch=args.batch, seq=p + r,
             compile_s=compile_s, plan_gb=plan_gb)
  if args.compile_only:
    return row
  state = loop.init_state(params_fn, opt, sh, 0, jnp.float32)
  gbatch = mesh_lib.shard_batch(batch, b_sh, args.batch)
  extra = (jax.device_put(jax.jit(params_fn)(jax.random.PRNGKey(1)), teacher_sh),) if frozen else ()
  for _ in range(args.warmup):
    state, m = compiled(state, gbatch, *extra)
  jax.block_until_ready(m)
  t = time.perf_counter()
  for _ in range(args.steps):
    state, m = compiled(state, gbatch, *extra)
  jax.block_until_ready((state, m))
  step_s = (time.perf_counter() - t) / args.steps
  tokens = args.batch * (p + r)
  model_tokens = args.batch * model_tok
  # Training FLOPs: 6 N per token for the student, 2 N (forward only) for OPD's teacher tokens.
  student_tok = args.batch * (model_tok - (p + r if frozen else 0))
  teacher_tok = args.batch * (p + r) if frozen else 0
  flops = 6 * n_mat * student_tok + 2 * n_mat * teacher_tok + args.batch * attn_flops
  mfu = flops / step_s / peak if peak else None
  mem = None
  try:
    stats = jax.devices()[0].memory_stats() or {}
    mem = stats.get("peak_bytes_in_use")
  except Exception:  # pylint: disable=broad-except
    pass
  row.update(step_ms=step_s * 1e3, tok_s=tokens / step_s, model_tok_s=model_tokens / step_s, mfu=mfu,
             peak_gb=mem / 2**30 if mem else plan_gb, final_loss=float(m["loss"]))
  return row


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
  ap.add_argument("--batch", type=int, default=0, help="global batch (0: preset)")
  ap.add_argument("--prompt", type=int, default=0, help="prompt slots P (0: preset)")
  ap.add_argument("--response", type=int, default=0, help="response slots R (0: preset)")
  ap.add_argument("--dtype", default="", help="compute dtype (default: preset)")
  ap.add_argument("--remat", default="", choices=["", "true", "false"])
  ap.add_argument("--remat_policy", default="nothing_saveable")
  ap.add_argument("--attention", default="auto", help="model.attention_impl")
  ap.add_argument("--scan", default="true", choices=["true", "false", "both"], help="model.scan_layers")
  ap.add_argument("--grad_accum", type=int, default=1)
  ap.add_argument("--steps", type=int, default=5)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--losses", default="sft,cft,opd", help="which of sft,cft,opd to run")
  ap.add_argument("--compile_only", action="store_true", help="lower + compile from shapes; no run")
  ap.add_argument("--peak_tflops", type=float, default=0.0, help="override the peak table")
  ap.add_argument("--mesh", default="-1,1,1", help="data,fsdp,tensor")
  args = ap.parse_args(argv)
  pre = PRESETS[args.preset]
  args.batch = args.batch or pre["batch"]
  args.prompt = args.prompt or pre["prompt"]
  args.response = args.response or pre["response"]
  dtype = args.dtype or pre["dtype"]
  remat = pre["remat"] if not args.remat else args.remat == "true"
  mesh = mesh_lib.make_mesh(dict(zip(mesh_lib.AXES, map(int, args.mesh.split(",")))))
  peak = peak_flops(args.peak_tflops)
  print(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}; mesh {dict(mesh.shape)}; preset "
        f"{args.preset} dtype {dtype} remat {remat} ({args.remat_policy}) attention {args.attention}; peak "
        f"{'%.0f TFLOP/s' % (peak / 1e12) if peak else 'unknown (MFU n/a)'}", flush=True)
  rows = []
  for scan in ((False, True) if args.scan == "both" else (args.scan == "true",)):
    mc = Qwen3Config(**pre["model"], dtype=dtype, param_dtype="float32", remat=remat, remat_policy=args.remat_policy,
                     attention_impl=args.attention, scan_layers=scan, mask_token_id=pre["model"]["vocab_size"] - 1)
    for name in args.losses.split(","):
      rows.append(bench_one(name, mc, args, mesh, peak))
      print(rows[-1], flush=True)
  hdr = ["loss", "scan", "params", "batch", "seq", "compile_s", "plan_gb"] + (
      [] if args.compile_only else ["step_ms", "tok_s", "model_tok_s", "mfu", "peak_gb"])
  print("\n| " + " | ".join(hdr) + " |\n|" + "---|" * len(hdr))
  for r in rows:
    cells = []
    for h in hdr:
      v = r.get(h)
      cells.append("n/a" if v is None else (f"{v:.3g}" if isinstance(v, float) and h == "mfu"
                                            else f"{v:,.2f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int)
                                            and not isinstance(v, bool) else str(v)))
    print("| " + " | ".join(cells) + " |")
  return rows


if __name__ == "__main__":
  main()
