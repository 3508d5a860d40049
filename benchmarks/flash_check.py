"""The 'pallas' training attention (model/flash_pallas.py) on a GPU: equal to the dense route, and
its forward + backward time against 'xla' and 'cudnn', for the recipe's three training masks.

  python benchmarks/flash_check.py [--json_out=FILE] [--batch=4] [--impls=pallas,xla,cudnn]
  python benchmarks/flash_check.py --small          # tiny shapes: a CPU smoke run (interpret mode)

One attention call of one layer at Qwen3-0.6B's attention shape (16 query heads, 8 kv heads, head
dim 128), bf16, 2,048 tokens per row, rows with different left padding:
  sft      causal [prompt 512 | response 1536];
  cft      the two streams [prompt 512 | clean 768 | noised 768], blocks of 32;
  replay   RL replay's layout [prompt 512 | clean 512 | 2 canvases per block of 32 (1024)].
Correctness: each route's bf16 output and dq, dk, dv against the same call in f32 through 'xla'
(the truth), as max |error| / max |truth| over the queries that see a key (left padding is left
out: 'xla' defines those rows differently); 'pallas' passes when its error is at most twice the
bf16 'xla' route's plus 1e-3. Speed: the median of --repeats timed calls of the jitted
value-and-grad (forward + backward) after a warm-up, and the TFLOP/s that gives over the kept
(query, key) pairs (12 x head_dim x heads per pair, as benchmarks/train_step.py counts).
Prints one JSON object (also written to --json_out): {"meta", "masks": {name: {...}}, "ok"}.
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
from dgr2_jax.model import attention, flash_pallas, masks, streams  # noqa: E402

BLOCK = 32


def layouts(p: int, r: int, b: int):
  """name -> (Ranges/Streams, dense [b, N, N] bool mask, N); row i has i * p / (2 b) padding slots."""
  plen = np.array([p - (i * p) // (2 * b) for i in range(b)])
  valid = np.arange(p)[None] >= (p - plen)[:, None]
  out = {}
  n = p + r
  kv = np.concatenate([valid, np.ones((b, r), bool)], 1)
  out["sft"] = (masks.sequence_ranges(plen, p, n, 1), masks.sequence_mask(p, n, 1, jnp.asarray(kv)), n)
  if r % (6 * BLOCK):
    raise SystemExit(f"--response must be a multiple of {6 * BLOCK} (cft uses half, replay a third, blocks of {BLOCK})")
  for name, resp, seg_block in (("cft", r // 2, np.arange(r // 2 // BLOCK)),
                                ("replay", r // 3, np.repeat(np.arange(r // 3 // BLOCK), 2))):
    lay = streams.stream_layout(p, resp, BLOCK, seg_block)
    n = len(lay["kind"])
    kv = np.concatenate([valid, np.ones((b, n - p), bool)], 1)
    dense = masks.stream_mask(lay["kind"], lay["block"], lay["seg"], lay["kind"], lay["block"], lay["seg"],
                              jnp.asarray(kv))
    out[name] = (streams.stream_ranges(plen, p, resp, BLOCK, seg_block), dense, n)
  return out


def value_and_grad(mask, impl, sees, w):
  def loss(q, k, v):
    out = attention.attend(q, k, v, mask, impl)
    return jnp.sum(jnp.where(sees, out.astype(jnp.float32), 0.0) * w), out
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def rel_err(a, truth, sees=None):
  a, truth = jnp.asarray(a, jnp.float32), jnp.asarray(truth, jnp.float32)
  if sees is not None:
    a, truth = jnp.where(sees, a, 0.0), jnp.where(sees, truth, 0.0)
  return float(jnp.max(jnp.abs(a - truth)) / jnp.maximum(jnp.max(jnp.abs(truth)), 1e-30))


def timed(fn, args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def check_mask(spec, dense, n, shape, impls, repeats, tilings):
  """One mask: every route's errors against the f32 truth, its time and TFLOP/s."""
  b, heads, kv_heads, d = shape
  g = heads // kv_heads
  rs = np.random.RandomState(0)
  mk = lambda *s: jnp.asarray(rs.randn(*s).astype(np.float32))
  q32, k32, v32 = mk(b, n, kv_heads, g, d), mk(b, n, kv_heads, d), mk(b, n, kv_heads, d)
  w = mk(b, n, kv_heads, g, d)
  sees = jnp.any(dense, -1)[:, :, None, None, None]
  (_, truth_out), truth_grads = value_and_grad(dense, "xla", sees, w)(q32, k32, v32)
  args = tuple(x.astype(jnp.bfloat16) for x in (q32, k32, v32))
  pairs = int(jnp.sum(dense))
  row = dict(tokens=n, kept_pairs=pairs, density=pairs / (b * n * n), err={}, ms={}, tflops={})
  for impl in impls:
    flash_pallas.DEFAULT_BLOCKS = tilings.get(impl, tilings["pallas"])
    route = "pallas" if impl in tilings else impl
    fn = value_and_grad(spec if impl != "xla" else dense, route, sees, w)
    t0 = time.perf_counter()
    try:
      (_, out), grads = jax.block_until_ready(fn(*args))
    except Exception as e:  # noqa: BLE001 - a route that fails to compile is a result, not the end of the run
      row.setdefault("failed", {})[impl] = f"{type(e).__name__}: {str(e)[:2000]}"
      continue
    compile_s = time.perf_counter() - t0
    errs = dict(out=rel_err(out, truth_out, sees))
    errs.update({k: rel_err(a, t) for k, a, t in zip(("dq", "dk", "dv"), grads, truth_grads)})
    sec = timed(fn, args, repeats)
    row["err"][impl] = errs
    row["ms"][impl] = round(sec * 1e3, 3)
    row["tflops"][impl] = round(12 * d * heads * pairs / sec / 1e12, 1)
    row.setdefault("first_call_s", {})[impl] = round(compile_s, 2)
  flash_pallas.DEFAULT_BLOCKS = tilings["pallas"]
  if "xla" in row["err"]:
    row["pallas_ok"] = all(p in row["err"] and row["err"][p][k] <= 2 * row["err"]["xla"][k] + 1e-3
                           for p in impls if p in tilings for k in row["err"]["xla"])
  return row


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--prompt", type=int, default=512)
  ap.add_argument("--response", type=int, default=1536, help="sft response; cft uses half, replay a third")
  ap.add_argument("--impls", default="", help="routes (default: pallas,xla,cudnn on a GPU, else pallas,xla)")
  ap.add_argument("--masks", default="sft,cft,replay")
  ap.add_argument("--repeats", type=int, default=10)
  ap.add_argument("--tiles", default="", help="extra 'pallas' tilings to time, ';'-separated, each flash_pallas.Blocks "
                                              "as q,k,q_dq,k_dq,q_dkv,k_dkv[,warps_fwd,warps_bwd,stages]: routes "
                                              "pallas#1, pallas#2, ...")
  ap.add_argument("--small", action="store_true", help="tiny shapes (b 2, prompt 32, response 192, 4/2 heads, D 32)")
  ap.add_argument("--json_out", default="")
  a = ap.parse_args()
  shape = (a.batch, 16, 8, 128)
  if a.small:
    a.batch, a.prompt, a.response, a.repeats = 2, 32, 192, 2
    shape = (2, 4, 2, 32)
  gpu = jax.default_backend() == "gpu"
  impls = [x for x in (a.impls or ("pallas,xla,cudnn" if gpu else "pallas,xla")).split(",") if x]
  names = ("q", "k", "q_dq", "k_dq", "q_dkv", "k_dkv", "warps_fwd", "warps_bwd", "stages")
  tilings = {"pallas": flash_pallas.DEFAULT_BLOCKS}
  for i, t in enumerate(x for x in a.tiles.split(";") if x):
    tilings[f"pallas#{i + 1}"] = flash_pallas.Blocks(**dict(zip(names, (int(v) for v in t.split(",")))))
  impls += [x for x in tilings if x != "pallas"]
  lay = layouts(a.prompt, a.response, a.batch)
  result = {"meta": dict(results_lib.run_meta(), shape=dict(zip(("batch", "heads", "kv_heads", "head_dim"), shape)),
                         dtype="bfloat16", impls=impls, blocks={k: str(v) for k, v in tilings.items()},
                         interpret=not gpu), "masks": {}}
  for name in a.masks.split(","):
    spec, dense, n = lay[name]
    result["masks"][name] = check_mask(spec, dense, n, shape, impls, a.repeats, tilings)
    print(name, json.dumps(result["masks"][name]), file=sys.stderr, flush=True)
  result["ok"] = all(m.get("pallas_ok", False) for m in result["masks"].values())
  text = json.dumps(result, indent=1)
  print(text)
  if a.json_out:
    with open(a.json_out, "w") as f:
      f.write(text + "\n")
  return 0 if result["ok"] else 1


if __name__ == "__main__":
  sys.exit(main())
