"""Decode attention alone, route against route: the split-key kernel, cuDNN and the dense route.

  python benchmarks/decode_attention.py [--shape=8b] [--batch_sizes=1,8,64] [--widths=1,32,64]
      [--routes=splitkey,cudnn,xla] [--prompt_len=2200] [--response_len=1024] [--splits=0]

One attention call of one layer, as the decoder makes it (model/attention.py `attend` on
`attention.Ranges`): queries of a window of W slots (1 = the AR step) against a KV cache of
prompt + response slots, left-padded prompts (row b has `prompt_len - 37 * b mod prompt_len / 4`
real tokens), the window halfway through the response, block-causal key ends (blocks of 32;
W = 64 spans two blocks, as kv_write='fused' does). Per call: the median time of `--repeats`
timed calls after a warm-up, the bytes the call must read at least (the visible keys and
values of every row once, q and the output), the bandwidth that time gives, and the largest
difference of its output from the dense route's (the check that the compiled kernel on a GPU
equals 'xla', as interpret mode does on CPU). On a GPU the
default routes are 'splitkey', 'cudnn' and 'xla'; elsewhere 'xla' and 'blockwise' ('splitkey'
off the GPU runs in Pallas interpret mode: a correctness tool, not a speed). `--json_out=FILE`
writes {"meta": device, versions, commit and the case's settings, "rows": one per table line}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dgr2_jax import results as results_lib  # noqa: E402
from dgr2_jax.model import attention, decode_attention, masks  # noqa: E402

SHAPES = {"8b": (32, 8, 128), "0.6b": (16, 8, 128), "tiny": (4, 2, 16)}   # q heads, kv heads, head dim
BLOCK = 32


def case(b, w, heads, kv, d, p, r, dtype, seed=0):
  """q, k, v, ranges and the visible key count of a window of w slots halfway through the response."""
  rs = np.random.RandomState(seed)
  s = p + r
  plen = np.array([p - (37 * i) % max(1, p // 4) for i in range(b)], np.int32)
  start = p + (r // 2) // BLOCK * BLOCK - (w == 1)      # AR: the slot before a block's start
  slots = jnp.full((b, 1), start, jnp.int32) + jnp.arange(w)[None]
  rng = masks.sequence_ranges(plen, p, s, 1 if w == 1 else BLOCK, q_slots=slots)
  g = heads // kv
  q = jnp.asarray(rs.randn(b, w, kv, g, d), dtype)
  k = jnp.asarray(rs.randn(b, s, kv, d), dtype)
  v = jnp.asarray(rs.randn(b, s, kv, d), dtype)
  visible = int(np.sum(np.asarray(rng.hi).max(1) - np.asarray(rng.lo)))
  return (q, k, v), rng, visible


def timed(fn, args, repeats):
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts))


def main():
  gpu = jax.default_backend() == "gpu"
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--shape", default="8b" if gpu else "tiny", choices=sorted(SHAPES))
  ap.add_argument("--batch_sizes", default="1,8,64" if gpu else "1,8")
  ap.add_argument("--widths", default="1,32,64")
  ap.add_argument("--routes", default="splitkey,cudnn,xla" if gpu else "xla,blockwise")
  ap.add_argument("--prompt_len", type=int, default=2200 if gpu else 256)
  ap.add_argument("--response_len", type=int, default=1024 if gpu else 128)
  ap.add_argument("--splits", type=int, default=0, help="key splits of 'splitkey' (0 = the rule)")
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--repeats", type=int, default=20 if gpu else 3)
  ap.add_argument("--json_out", default="", help="also write the rows as JSON here")
  args = ap.parse_args()
  if not gpu:
    attention.DPA_IMPLEMENTATION = None    # 'cudnn''s calls through XLA's implementation

  heads, kv, d = SHAPES[args.shape]
  dtype = jnp.dtype(args.dtype)
  print(f"# decode attention, one layer: {jax.devices()[0].device_kind}, jax {jax.__version__}; "
        f"{args.shape} shape ({heads} q heads, {kv} kv heads, head dim {d}), {args.dtype}, "
        f"prompt {args.prompt_len} + response {args.response_len} slots")
  print("\n| batch | window | route | key splits | ms | min bytes MB | GB/s | max abs diff vs xla |")
  print("|---|---|---|---|---|---|---|---|")
  results = []
  for b in map(int, args.batch_sizes.split(",")):
    for w in map(int, args.widths.split(",")):
      (q, k, v), rng, visible = case(b, w, heads, kv, d, args.prompt_len, args.response_len, dtype)
      need = (2 * visible * kv * d + 2 * b * w * heads * d) * dtype.itemsize
      ref = jax.jit(lambda q, k, v, rng: attention.attend(q, k, v, rng, "xla"))(q, k, v, rng)
      for route in args.routes.split(","):
        fn = jax.jit(lambda q, k, v, rng, route=route: attention.attend(q, k, v, rng, route, args.splits))
        sec = timed(fn, (q, k, v, rng), args.repeats)
        diff = float(jnp.max(jnp.abs(fn(q, k, v, rng).astype(jnp.float32) - ref.astype(jnp.float32))))
        splits = "-"
        if route == "splitkey":
          rb, rows, bk = decode_attention.tiling(w * heads // kv, k.shape[1])
          splits = decode_attention.num_splits(b, kv, rows // rb, k.shape[1], bk, args.splits)
        print(f"| {b} | {w} | {route} | {splits} | {sec * 1e3:.3f} | {need / 1e6:.1f} | {need / sec / 1e9:.1f} | "
              f"{diff:.2e} |",
              flush=True)
        results.append(dict(batch=b, window=w, route=route, key_splits=splits, ms=sec * 1e3, min_bytes_mb=need / 1e6,
                         gbps=need / sec / 1e9, max_abs_diff_vs_xla=diff))
  if args.json_out:
    meta = dict(results_lib.run_meta(), shape=args.shape, heads=heads, kv_heads=kv, head_dim=d, dtype=args.dtype,
                prompt_len=args.prompt_len, response_len=args.response_len, repeats=args.repeats)
    with open(args.json_out, "w") as f:
      json.dump({"meta": meta, "rows": results}, f, indent=1)


if __name__ == "__main__":
  main()
