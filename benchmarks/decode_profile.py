"""Where a decoding step's time goes: XLA's op timeline of one decode call, grouped, before and after.

  python benchmarks/decode_profile.py --workdir=/tmp/dgr2_demo [--before=4096371]

Decodes the demo's test prompts with the AR teacher (block size 1) and the final diffusion model
(block 32, tau 0.9) at batch 1 and 32, under `jax.profiler` (a Perfetto trace of the XLA CPU/GPU
thunks), and sums the device time of each op by what it belongs to (from its HLO `op_name`):
attention (scores, masking, softmax, P.V of every layer), mlp, projections (q/k/v/o and norms),
lm_head (the vocabulary projection), choose (token, confidence, commit rule, sampling) and the rest
(cache writes, gathers, loop bookkeeping). Per loop iteration, in microseconds.

Then what bounds the wall-clock ratio. Five calls per batch size, timed in turn `--rounds` times
(medians; a noisy machine's slow spells fall on all five alike): each decode without the profiler;
the pure forward each of its iterations runs (a 1-slot window for AR, a 32-slot one with its 32
positions projected to the vocabulary for diffusion: decode_throughput.window_loop); and the
call's fixed part, the prompts' prefill and the call itself, the same for both decoders (a jitted
prefill). With a call = fixed part + iterations x per-iteration cost, the speedup is given:
measured; if neither loop cost anything beyond its forwards (the bound that making both loops
lean approaches); if the diffusion loop cost nothing beyond its forwards while AR kept its
measured loop; and the ceiling, a diffusion loop that cost nothing at all (the fixed part alone).
`--before=REV` also profiles the decoder as it was at git revision REV (its decode/sampler.py and
the 5-d einsum attention it used), loaded side by side in this process: the same model, prompts
and machine, so the two columns compare.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dgr2_jax.decode import sampler  # noqa: E402
from dgr2_jax.model import attention, masks, qwen3  # noqa: E402
import decode_throughput  # noqa: E402

GROUPS = (("attention", r"self_attn/(bkqd|bkqs|btkgd|bkgts|jit\(_where\)|reduce_max|reduce_sum|exp|sub|div|softmax)"),
          ("projections", r"self_attn/(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)|layernorm|/norm/"),
          ("mlp", r"/mlp/"), ("lm_head", r"e,ev->|ve->"), ("choose",
                                                        r"branch_\d_fun/(reduce|select|eq|exp|log|argmax|min)|"
                                                          r"sort|categorical|fold_in|threefry|cumsum|top_k"))


def _einsum_dense(q, k, v, mask):
  """The 5-d einsum attention the decoder used before (for --before)."""
  d = q.shape[-1]
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k.astype(q.dtype), preferred_element_type=jnp.float32) * d ** -0.5
  scores = jnp.where(mask[:, None, None, :, :], scores, -1e30)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum("bkgts,bskd->btkgd", probs, v)


def load_before(rev: str):
  src = subprocess.run(["git", "show", f"{rev}:dgr2_jax/decode/sampler.py"], cwd=REPO, capture_output=True,
                       text=True, check=True).stdout
  path = os.path.join(tempfile.mkdtemp(), "sampler_before.py")
  with open(path, "w") as f:
    f.write(src)
  spec = importlib.util.spec_from_file_location("sampler_before", path)
  mod = importlib.util.module_from_spec(spec)
  sys.modules["sampler_before"] = mod   # dataclasses look their module up while it executes
  spec.loader.exec_module(mod)
  return mod


def profile(call, n: int = 3):
  jax.block_until_ready(call())
  d = tempfile.mkdtemp()
  with jax.profiler.trace(d, create_perfetto_trace=True):
    for _ in range(n):
      out = jax.block_until_ready(call())
  f = glob.glob(f"{d}/**/*.json.gz", recursive=True)[0]
  tr = json.load(gzip.open(f))
  ev = tr["traceEvents"] if isinstance(tr, dict) else tr
  dur = collections.Counter()
  for e in ev:
    if e.get("ph") == "X" and "dur" in e and not e["name"].startswith("$") and "Execute" not in e["name"] \
        and "Pjit" not in e["name"] and e["name"] not in ("DevicePut", "ParseArguments") and "Await" not in e["name"]:
      dur[e["name"]] += e["dur"] / n
  return dur, out


def prefill_call(cfg, params, toks, lens, slots: int):
  """A compiled call that prefills the prompts into an empty KV cache (the fixed part of a decode
  call, the same for AR and diffusion)."""
  b, p = toks.shape
  pos = masks.left_pad_positions(jnp.asarray(lens), p, slots)
  fn = jax.jit(lambda prm, t, n: sampler.window_forward(cfg, prm, t, 0, qwen3.init_cache(cfg, b, slots), n, p, pos,
                                                        return_hidden=True)[0][:, -1])
  call = lambda: fn(params, toks, lens)
  jax.block_until_ready(call())
  return call


def interleaved_medians(calls: dict, rounds: int) -> dict:
  """{name: zero-argument call} -> {name: median seconds}, timing one call of each in turn per
  round, so that a noisy machine's slow spells fall on every quantity alike."""
  times = {k: [] for k in calls}
  for _ in range(rounds):
    for k, call in calls.items():
      t0 = time.perf_counter()
      jax.block_until_ready(call())
      times[k].append(time.perf_counter() - t0)
  return {k: float(np.median(v)) for k, v in times.items()}


def group(dur: dict, hlo: str, iterations: int) -> dict:
  names = {}
  for line in hlo.splitlines():
    m = re.match(r"\s*%?([\w.\-]+) = .*?op_name=\"([^\"]*)\"", line)
    if m:
      names[m.group(1)] = m.group(2)
  out = collections.Counter()
  for op, us in dur.items():
    meta = names.get(op, "")
    if "while/body" not in meta and not op.startswith(("cond", "while")):
      out["prefill"] += us
      continue
    if op.startswith(("cond", "while")):
      continue  # containers: their ops are counted themselves
    for g, pat in GROUPS:
      if re.search(pat, meta):
        out[g] += us / iterations
        break
    else:
      out["rest"] += us / iterations
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--workdir", default="/tmp/dgr2_demo")
  ap.add_argument("--before", default="", help="git revision of the decoder to compare with")
  ap.add_argument("--batch_sizes", default="1,32")
  ap.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds of the bound table")
  a = ap.parse_args()
  from configs import demo
  from dgr2_jax.model.checkpoint import load_model_dir
  from dgr2_jax.decode import runtime
  from dgr2_jax.stages import traces as traces_stage
  from dgr2_jax.task import pipeline as pipeline_lib
  from dgr2_jax.task import tokenizer as tok_lib
  from dgr2_jax.task import traces as traces_lib
  config = demo.get_config()
  d = traces_stage.load_task_data(a.workdir)
  ex, _ = traces_lib.build_examples(d["sequences"], d["candidates"]["test"], "test", insert_target="none")
  tok = tok_lib.load_tokenizer(os.path.join(a.workdir, "traces", "tokenizer"))
  tids = tok_lib.token_ids(tok)
  prompts = [pipeline_lib.encode_prompt(tok, e, d["items"], d["sids"], config.task)[0] for e in ex[:32]]
  final = "rl" if os.path.isdir(os.path.join(a.workdir, "rl", "model")) else "cft"
  teacher = "teacher_rl" if os.path.isdir(os.path.join(a.workdir, "teacher_rl", "model")) else "sft"
  before = load_before(a.before) if a.before else None
  results, calls = [], {}
  for label, md, bs, tau in (("AR", teacher, 1, 1.0), ("diffusion tau 0.9", final, 32, 0.9)):
    mc, params = load_model_dir(os.path.join(a.workdir, md, "model"))
    params = jax.device_put(params)
    c = config.copy_and_resolve_references()
    c.decode.block_size, c.decode.threshold = bs, tau
    dc = runtime.decode_config(c, tids, mc)
    for batch in map(int, a.batch_sizes.split(",")):
      toks, lens = sampler.left_pad(prompts[:batch], config.task.prompt_len, dc.pad_id)
      cols = {}
      for name, mod in (("after", sampler), ("before", before)):
        if mod is None:
          continue
        if name == "before":
          fn = mod.compiled_decoder(sampler.model_for_decoding(mc, dc), dc.block_size, dc.max_new_tokens,
                                    tuple(dc.eos_ids), dc.mask_token_id)
          args = (params, jnp.asarray(toks), jnp.asarray(lens), jnp.float32(tau), jnp.float32(0), jnp.int32(0),
                  jnp.float32(1), jax.random.PRNGKey(0), jnp.int32(dc.steps_per_block))
          orig = attention._dense
          attention._dense = _einsum_dense
        else:
          _, fn = sampler.decoder_for(mc, dc)
          args = (params, toks, lens, np.float32(tau), np.float32(0), np.int32(0), np.float32(1),
                  np.zeros(2, np.uint32), np.int32(dc.steps_per_block))
        try:
          dur, out = profile(lambda: fn(*args))
          hlo = fn.lower(*args).compile().as_text()
        finally:
          if name == "before":
            attention._dense = orig
        it = max(int(out["forward_passes"]), 1)
        cols[name] = (group(dur, hlo, it), it)
        if name == "after":
          slots = config.task.prompt_len + dc.max_new_tokens
          mcd = sampler.model_for_decoding(mc, dc)
          tokens = sum(len(x) for x in sampler.output_ids(np.asarray(out["tokens"]), np.asarray(out["eos_pos"])))
          loop, n = decode_throughput.window_loop(mcd, params, batch, slots, bs, head=True)
          calls[(label, batch)] = dict(iterations=it, tokens=tokens, n=n, call=lambda fn=fn, args=args: fn(*args),
                                       loop=loop, prefill=prefill_call(mcd, params, toks, lens, slots))
      results.append((label, batch, cols))
      for name, (g, it) in cols.items():
        tot = sum(v for k, v in g.items() if k != "prefill")
        parts = ", ".join(f"{k} {g.get(k, 0):.0f}" for k, _ in GROUPS + (("rest", None),))
        print(f"{label} batch {batch} [{name}]: {it} iterations, {tot:.0f} us/iteration ({parts}); "
              f"prefill {g.get('prefill', 0) / 1e3:.2f} ms", flush=True)
  print("\n| decoder | batch | version | iterations | us / iteration | attention | projections | mlp | lm_head | "
        "choose | rest |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for label, batch, cols in results:
    for name, (g, it) in cols.items():
      tot = sum(v for k, v in g.items() if k != "prefill")
      cells = " | ".join(f"{g.get(k, 0):.0f}" for k in ("attention", "projections", "mlp", "lm_head", "choose", "rest"))
      print(f"| {label} | {batch} | {name} | {it} | {tot:.0f} | {cells} |")
  print("\n| batch | prefill + call ms | AR us/iteration | AR 1-slot forward us | diffusion us/iteration | "
        "diffusion 32-slot forward us | iterations AR / diffusion | speedup measured | speedup, both loops free | "
        "speedup, diffusion loop free | ceiling: diffusion loop costs nothing |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for batch in map(int, a.batch_sizes.split(",")):
    ar, df = calls.get(("AR", batch)), calls.get(("diffusion tau 0.9", batch))
    if not (ar and df):
      continue
    t = interleaved_medians({"ar": ar["call"], "df": df["call"], "fixed": df["prefill"], "f1": ar["loop"],
                             "fw": df["loop"]}, a.rounds)
    fixed, f1, fw = t["fixed"], t["f1"] / ar["n"], t["fw"] / df["n"]
    loop_us = lambda w, wall: (wall - fixed) / w["iterations"] * 1e6
    tps = lambda w, secs: w["tokens"] / secs
    lean_ar, lean_df = fixed + ar["iterations"] * f1, fixed + df["iterations"] * fw   # loops of forwards only
    print(f"| {batch} | {fixed * 1e3:.2f} | {loop_us(ar, t['ar']):.0f} | {f1 * 1e6:.0f} | {loop_us(df, t['df']):.0f} | "
          f"{fw * 1e6:.0f} | {ar['iterations']} / {df['iterations']} | {tps(df, t['df']) / tps(ar, t['ar']):.2f}x | "
          f"{tps(df, lean_df) / tps(ar, lean_ar):.2f}x | {tps(df, lean_df) / tps(ar, t['ar']):.2f}x | "
          f"{tps(df, fixed) / tps(ar, t['ar']):.2f}x |", flush=True)


if __name__ == "__main__":
  main()
