"""Sampled decoding at Qwen3's vocabulary: the inverse-CDF draw against the Gumbel-max draw it replaced.

  python benchmarks/sampling_cost.py [--before=fa81dc3] [--batch_sizes=1,8,32]

A random Qwen3 of tiny width (2 layers, 32 wide) with Qwen3's vocabulary plus the SID and mask
tokens (V = 152,961), so the vocabulary-sized work is what a step costs beyond its small forward:
1. Per denoising step, one block of 32 positions per row: the window forward (32 slots against a
   prompt of `--prompt_len`), and the choice of tokens over `[rows, 32, V]`: greedy, sampled as
   now (`sampler.choose`: one exponential, one uniform per position) and sampled as before
   (`decoding_logprobs` + `jax.random.categorical`, V Gumbel numbers per position).
2. Whole sampled decodes (T = 1, a forced schedule of `--commits` tokens per step through the step
   budget, EOS off) with the decoder of this checkout and the one at `--before` (its
   decode/sampler.py and decode/sampling.py loaded side by side in this process): tokens/s.
Everything in one process, medians of `--repeats` timed calls after a warm-up call.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dgr2_jax.decode import sampler, sampling  # noqa: E402
from dgr2_jax.model import logits as logits_lib  # noqa: E402
from dgr2_jax.model import qwen3  # noqa: E402
from dgr2_jax.model.config import Qwen3Config  # noqa: E402

QWEN3_V = 151_936 + 1_024 + 1


def load_before(rev: str):
  """decode/sampler.py and decode/sampling.py at `rev` as modules (the sampler importing that
  sampling), or None where `rev` is not in this clone."""
  mods = {}
  for name in ("sampling", "sampler"):
    try:
      src = subprocess.run(["git", "show", f"{rev}:dgr2_jax/decode/{name}.py"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout
    except subprocess.CalledProcessError:
      return None
    src = src.replace("from dgr2_jax.decode import sampling\n", "import sampling_before as sampling\n")
    path = os.path.join(tempfile.mkdtemp(), f"{name}_before.py")
    with open(path, "w") as f:
      f.write(src)
    spec = importlib.util.spec_from_file_location(f"{name}_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[f"{name}_before"] = mod   # dataclasses look their module up while it executes
    spec.loader.exec_module(mod)
    mods[name] = mod
  return mods["sampler"]


def timed(fn, repeats: int) -> float:
  jax.block_until_ready(fn(0))
  ts = []
  for i in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(i + 1))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts))


def gumbel_choice(cfg, params, hidden, keys, temperature, mask_id):
  """The sampled choice as it was: full log-probs, a Gumbel-max draw, the drawn token's log-prob."""
  def rows(xs):
    h, k = xs
    lp = sampling.decoding_logprobs(qwen3.lm_head(cfg, params, h), temperature, 0, 1.0, mask_id)
    tok = jax.vmap(lambda kk, l: jax.random.categorical(kk, l).astype(jnp.int32))(k, lp)
    return tok, jnp.take_along_axis(lp, tok[..., None], -1)[..., 0]
  b, n = hidden.shape[:2]
  return logits_lib.map_positions(rows, (hidden, keys), sampler._rows_per_chunk(cfg, b, n))


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--before", default="fa81dc3", help="git revision of the decoder to compare ('' = none)")
  ap.add_argument("--batch_sizes", default="1,8,32")
  ap.add_argument("--decode_batch_sizes", default="1,8")
  ap.add_argument("--prompt_len", type=int, default=256)
  ap.add_argument("--max_new_tokens", type=int, default=64)
  ap.add_argument("--commits", type=int, default=4, help="forced commits per step in the whole decodes")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--vocab", type=int, default=QWEN3_V)
  args = ap.parse_args()

  cfg = Qwen3Config(vocab_size=args.vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
                    mask_token_id=args.vocab - 1)
  params = jax.jit(lambda k: qwen3.init_params(cfg, k))(jax.random.PRNGKey(0))
  mask_id, bsz, t = cfg.mask_token_id, 32, np.float32(1.0)
  print(f"# sampling cost: {jax.devices()[0].device_kind}, jax {jax.__version__}; V = {cfg.vocab_size:,}, "
        f"2 layers x 32 wide; block {bsz}, prompt {args.prompt_len}", flush=True)

  print("\n| rows | window forward ms | greedy choice ms | sampled now ms | sampled before (Gumbel) ms | "
        "step now / before |")
  print("|---|---|---|---|---|---|")
  for b in map(int, args.batch_sizes.split(",")):
    dcfg = cfg.as_block_diffusion(bsz, mask_id)
    s = args.prompt_len + 2 * bsz
    plen = jnp.full((b,), args.prompt_len, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    cache = qwen3.init_cache(dcfg, b, s)
    toks = jnp.full((b, bsz), mask_id, jnp.int32)
    fwd = jax.jit(lambda c, i: sampler.window_forward(dcfg, params, toks + 0 * i, args.prompt_len, c, plen,
                                                      args.prompt_len, pos, return_hidden=True))
    f_s = timed(lambda i: fwd(cache, i), args.repeats)
    hidden = jax.random.normal(jax.random.PRNGKey(1), (b, bsz, cfg.hidden_size))
    keys = lambda i: jax.random.split(jax.random.PRNGKey(i), b)
    now = jax.jit(lambda h, k, temp: sampler.choose(cfg, params, h, k, temp, np.int32(0), np.float32(1.0), mask_id))
    before = jax.jit(lambda h, k, temp: gumbel_choice(cfg, params, h, k, temp, mask_id))
    g_s = timed(lambda i: now(hidden, keys(i), np.float32(0.0)), args.repeats)
    n_s = timed(lambda i: now(hidden, keys(i), t), args.repeats)
    b_s = timed(lambda i: before(hidden, keys(i), t), args.repeats)
    print(f"| {b} | {f_s * 1e3:.1f} | {g_s * 1e3:.1f} | {n_s * 1e3:.1f} | {b_s * 1e3:.1f} | "
          f"{(f_s + n_s) / (f_s + b_s):.3f} |", flush=True)

  old = load_before(args.before) if args.before else None
  print(f"\nWhole sampled decodes (T = 1, {args.commits} commits per step, {args.max_new_tokens} new tokens, "
        f"EOS off): this checkout against {args.before or 'nothing'}")
  print("\n| batch | tokens/s now | tokens/s before | speedup | NFE/seq |")
  print("|---|---|---|---|---|")
  rs = np.random.RandomState(0)
  for b in map(int, args.decode_batch_sizes.split(",")):
    prompts = [list(rs.randint(10, cfg.vocab_size - 2, args.prompt_len)) for _ in range(b)]
    toks, lens = sampler.left_pad(prompts, args.prompt_len, 0)
    res = {}
    for tag, mod in (("now", sampler), ("before", old)):
      if mod is None:
        continue
      dc = mod.DecodeConfig(block_size=bsz, threshold=1.0, temperature=1.0, max_new_tokens=args.max_new_tokens,
                            eos_ids=(), mask_token_id=mask_id, pad_id=0, steps_per_block=bsz // args.commits)
      _, fn = mod.decoder_for(cfg, dc)
      out = {}
      def call(i, fn=fn, dc=dc, mod=mod):
        out["o"] = mod.run_decoder(fn, params, toks, lens, dc, jax.random.PRNGKey(i))
        return out["o"]
      res[tag] = (b * args.max_new_tokens / timed(call, args.repeats), float(np.mean(np.asarray(out["o"]["nfe"]))))
    now_tps, nfe = res["now"]
    before_tps = res["before"][0] if "before" in res else None
    vs = "" if before_tps is None else f"{before_tps:.1f} | {now_tps / before_tps:.2f}x"
    print(f"| {b} | {now_tps:.1f} | {vs or ' | '} | {nfe:.1f} |", flush=True)


if __name__ == "__main__":
  main()
