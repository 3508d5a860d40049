"""Shared-prefix KV reuse (`decode.shared_prefix`, dgr2_jax/decode/prefix.py): prefilled tokens per
request without and with it, and the wall time of both, side by side.

  python benchmarks/prefix_reuse.py                       # real Beauty prompts if ../shared/data exists
  python benchmarks/prefix_reuse.py --synthetic           # the demo's synthetic catalogue
  python benchmarks/prefix_reuse.py --tokenizer=DIR       # a real (Qwen3) tokenizer instead of the demo BPE

Prompts: the re-ranking prompts of `--batch` users (dgr2_jax/task/prompts.py, every variant for
the counts, `--variant` for the timing), rendered with the demo BPE unless `--tokenizer` is given.
Real data: Amazon Beauty metadata and purchase sequences from ../shared/data/amazon_beauty, with
placeholder SIDs and random candidates (`data.beauty.load_with_placeholder_sids`); the prompt's shape is
what matters here, not the ranking. Synthetic: dgr2_jax.task.synthetic, the demo's catalogue.

Counts, per request of one batch (`prefix.prefill_counts`): slots the prefill runs through the
model (the left-padded window: P per row without reuse; P - L per row plus the prefix's own L
shared by the batch with it) and real prompt tokens (len without; len - L + L / batch with). The
prefix L is `prefix.resolve(-1, prompts)`: the batch's longest common prefix rounded down to 16.

Timing (this machine, a random Qwen3 of `--hidden`/`--layers` at the tokenizer's vocabulary): the
prefill alone (one jitted call: the full window vs the prefix's forward, its copy and the window
after it) and a whole `sampler.generate` call (prefill + `--max_new_tokens` of block diffusion at
block 32, 8 steps per block), medians of `--repeats` calls each, alternated, after a warm-up; the outputs of the two
generate calls are compared (tokens equal, largest log-prob difference).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dgr2_jax.decode import prefix, sampler  # noqa: E402
from dgr2_jax.model import masks, qwen3  # noqa: E402
from dgr2_jax.model.config import Qwen3Config  # noqa: E402
from dgr2_jax.task import prompts as prompts_lib  # noqa: E402
from dgr2_jax.task import synthetic  # noqa: E402
from dgr2_jax.task import tokenizer as tok_lib  # noqa: E402

BEAUTY = os.path.join(REPO, "..", "shared", "data", "amazon_beauty")


def load_data(synthetic_only: bool) -> tuple[dict, str]:
  if not synthetic_only and os.path.exists(os.path.join(BEAUTY, "items.jsonl")):
    from dgr2_jax.data import beauty   # the real-metadata loader (placeholder SIDs)
    return beauty.load_with_placeholder_sids(BEAUTY), "real Beauty metadata (placeholder SIDs, random candidates)"
  return synthetic.make(n_items=400, n_users=300), "synthetic (the demo's catalogue)"


def batch_prompts(d: dict, tok, variant: str, batch: int, prompt_len: int, seed: int) -> list[list[int]]:
  """Prompts of `batch` users with >= 3 purchases: history = all but the last, 10 candidates."""
  rng = np.random.default_rng(seed)
  users = [u for u in rng.permutation(len(d["sequences"])) if len(d["sequences"][u]) >= 3][:batch]
  out = []
  for u in users:
    hist = d["sequences"][u][:-1]
    cands = [int(i) for i in rng.choice(len(d["items"]), 10, replace=False)]
    ids, _ = prompts_lib.render_prompt_ids(tok, hist, cands, d["items"], d["sids"],
                                           style=prompts_lib.PromptStyle(variant), max_len=prompt_len)
    out.append(ids)
  return out


def paired_times(fa, fb, repeats: int) -> tuple[float, float]:
  """Medians of `repeats` calls of fa and of fb, alternated (a busy machine slows both alike),
  after a warm-up call of each (compiles)."""
  jax.block_until_ready(fa())
  jax.block_until_ready(fb())
  times = ([], [])
  for _ in range(repeats):
    for t, fn in zip(times, (fa, fb)):
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      t.append(time.perf_counter() - t0)
  return float(np.median(times[0])), float(np.median(times[1]))


def prefill_fn(cfg, p: int, s: int, n: int):
  """A jitted prefill of left-padded prompts [B,P] into a fresh cache of s slots, prefix n."""
  def f(params, toks, lens):
    pos = masks.left_pad_positions(lens, p, s)
    run = lambda t, start, cache: sampler.window_forward(cfg, params, t, start, cache, lens, p, pos,
                                                         return_hidden=True)
    h, cache = prefix.prefill(cfg, params, toks, lens, qwen3.init_cache(cfg, toks.shape[0], s), n, p, run)
    return h[:, -1], cache
  return jax.jit(f)


def model(vocab: int, args, mask_id: int, pad_id: int, eos_id: int):
  cfg = Qwen3Config(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                    num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=args.hidden // 4, mask_token_id=mask_id, pad_token_id=pad_id, eos_token_id=eos_id,
                    attention_impl=args.attention)
  return cfg, qwen3.init_params(cfg, jax.random.PRNGKey(0))


def report_counts(tok, d, args):
  print(f"\nprefilled per request, batch {args.batch}, prompts <= {args.prompt_len} tokens "
        "(slots = the padded window; tokens = real prompt tokens):")
  print(f"  {'variant':8s} {'prefix':>6s} {'P':>5s} {'slots before':>12s} {'after':>8s} "
        f"{'tokens before':>13s} {'after':>8s}")
  for variant in prompts_lib.VARIANTS:
    ps = batch_prompts(d, tok, variant, args.batch, args.prompt_len, args.seed)
    n = prefix.resolve(-1, ps)
    c = prefix.prefill_counts([len(x) for x in ps], max(len(x) for x in ps), n)
    print(f"  {variant:8s} {n:6d} {c['prompt_slots']:5d} {c['full_slots']:12.1f} {c['reuse_slots']:8.1f} "
          f"{c['full_tokens']:13.1f} {c['reuse_tokens']:8.1f}")


def report_times(tok, d, args):
  ps = batch_prompts(d, tok, args.variant, args.batch, args.prompt_len, args.seed)
  tids = tok_lib.token_ids(tok)
  cfg, params = model(len(tok), args, tids.mask_id, tids.pad_id, tids.eos_id)
  n = prefix.resolve(-1, ps)
  toks, lens = sampler.left_pad(ps, max(len(x) for x in ps), tids.pad_id)
  p, r = toks.shape[1], args.max_new_tokens
  dparams = qwen3.decode_params(cfg, params)
  print(f"\nwall time on {jax.devices()[0].device_kind} ({args.variant} prompts, batch {args.batch}, P = {p}, "
        f"prefix {n}; model E={args.hidden} x {args.layers} layers, V={len(tok)}, attention {args.attention}; "
        f"medians of {args.repeats}):")
  x = (jnp.asarray(toks), jnp.asarray(lens))
  f_full, f_reuse = prefill_fn(cfg, p, p + r, 0), prefill_fn(cfg, p, p + r, n)
  t_full, t_reuse = paired_times(lambda: f_full(dparams, *x), lambda: f_reuse(dparams, *x), args.repeats)
  print(f"  prefill alone        full {1e3 * t_full:9.1f} ms   shared prefix {1e3 * t_reuse:9.1f} ms   "
        f"({t_full / t_reuse:.2f}x)")
  dc = sampler.decode_config_for(cfg, block_size=32, threshold=0.9, max_new_tokens=r, steps_per_block=8)
  outs = {}

  def gen(shared):
    outs[shared] = sampler.generate(cfg, params, ps, dataclasses.replace(dc, shared_prefix=shared))
    return outs[shared]["tokens"]
  g_full, g_reuse = paired_times(lambda: gen(0), lambda: gen(-1), args.repeats)
  same = np.array_equal(outs[0]["tokens"], outs[-1]["tokens"])
  diff = float(np.abs(outs[0]["logprob"] - outs[-1]["logprob"]).max())
  print(f"  generate ({r} tokens) full {1e3 * g_full:9.1f} ms   shared prefix {1e3 * g_reuse:9.1f} ms   "
        f"({g_full / g_reuse:.2f}x); tokens equal: {same}, max |logprob diff| {diff:.2e}")


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--synthetic", action="store_true", help="the demo's synthetic data, not ../shared/data")
  ap.add_argument("--tokenizer", default="", help="a tokenizer directory (default: a demo BPE)")
  ap.add_argument("--variant", default="compact", choices=prompts_lib.VARIANTS, help="prompts timed")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--prompt_len", type=int, default=2048)
  ap.add_argument("--max_new_tokens", type=int, default=64)
  ap.add_argument("--hidden", type=int, default=256)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--attention", default="auto", help="model.attention_impl ('auto': 'blockwise' on CPU)")
  args = ap.parse_args()
  d, source = load_data(args.synthetic)
  tok_dir = args.tokenizer or tok_lib.build_demo_tokenizer(tok_lib.demo_corpus(d["items"]), d["sid_tokens"],
                                                           tempfile.mkdtemp(), 2048)
  tok = tok_lib.load_tokenizer(tok_dir)
  print(f"data: {source}; tokenizer: {args.tokenizer or 'demo BPE'} ({len(tok)} tokens)")
  report_counts(tok, d, args)
  report_times(tok, d, args)


if __name__ == "__main__":
  main()
