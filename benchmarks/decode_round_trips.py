"""Host round trips of the decoders, counted from the compiled program (nothing is run).

  python benchmarks/decode_round_trips.py [--steps_per_sync=8] [--vocab=151936] [--before=283a3f8] [--lower_8b]

For each decoder (AR, block diffusion B = 32 with either K/V write, speculative with its default
verification schedule and with `verify_every` 0; greedy, sampled and top-k routes) it compiles the
decoder for a tiny-width model (the loop structure does not depend on the width) and reads the
optimised HLO (`dgr2_jax.aot.hlo`): the loops whose trip count is data dependent (each
sends its predicate to the host per iteration on a GPU), the conditionals executed per iteration
of the decode loop, and the host predicates per decode step (per loop iteration / the steps an
iteration runs; a speculative decoder's steps are its drafter steps). `--before=REV` counts the
decoders as they were at git revision REV too (their decode/sampler.py and decode/speculative.py).
`--lower_8b` first lowers the decoders at the Qwen3-8B shape from shapes only and counts their
loops and conditionals (the structure at full size; compiling 36 unrolled layers on a CPU would
take long).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile

import jax
import numpy as np

from dgr2_jax.aot import hlo
from dgr2_jax.decode import sampler, speculative
from dgr2_jax.model import qwen3
from dgr2_jax.model.config import Qwen3Config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_rev(rev: str, name: str, alias: str):
  src = subprocess.run(["git", "show", f"{rev}:dgr2_jax/decode/{name}.py"], cwd=REPO, capture_output=True,
                       text=True, check=True).stdout
  path = os.path.join(tempfile.mkdtemp(), f"{alias}.py")
  with open(path, "w") as f:
    f.write(src)
  spec = importlib.util.spec_from_file_location(alias, path)
  mod = importlib.util.module_from_spec(spec)
  sys.modules[alias] = mod   # dataclasses look their module up while it executes
  spec.loader.exec_module(mod)
  return mod


def count(fn, args, steps_per_iteration: int):
  text = fn.lower(*args).compile().as_text()
  loops = hlo.loops(text)
  unknown = [l for l in loops if l.trip_count is None]
  outer = max(unknown, key=lambda l: l.dots)   # the decode loop: the one running the forward
  per_iter = hlo.host_predicates(text, outer)
  return dict(unknown=len(unknown), conds=outer.conditionals, per_iter=per_iter,
              per_step=per_iter / steps_per_iteration)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps_per_sync", type=int, default=8)
  ap.add_argument("--vocab", type=int, default=151_936)
  ap.add_argument("--before", default="", help="git revision of the decoders to compare with")
  ap.add_argument("--lower_8b", action="store_true", help="also lower the decoders at the Qwen3-8B shape")
  a = ap.parse_args()
  if a.lower_8b:
    lower_8b()
  cfg = Qwen3Config(vocab_size=a.vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, mask_token_id=a.vocab - 1,
                    eos_token_id=5, pad_token_id=0)
  params = jax.eval_shape(lambda: qwen3.init_params(cfg, jax.random.PRNGKey(0)))
  toks, lens = sampler.left_pad([[1, 2, 3, 4]] * 2, 64, 0)
  rows = [("AR", 1, "separate", {}), ("AR", 1, "separate", dict(temperature=0.7)),
          ("B=32 fused", 32, "fused", {}), ("B=32 separate", 32, "separate", {}),
          ("B=32 separate", 32, "separate", dict(temperature=0.7)),
          ("B=32 separate", 32, "separate", dict(temperature=0.7, top_k=20)),
          ("speculative B=32", 32, "fused", {}), ("speculative B=32", 32, "fused", dict(temperature=0.7)),
          ("speculative B=32, verify_every 0", 32, "fused", dict(verify_every=0))]
  versions = [("now", sampler, speculative, a.steps_per_sync)]
  if a.before:
    old_sampler = load_rev(a.before, "sampler", "sampler_before")
    old_speculative = load_rev(a.before, "speculative", "speculative_before")
    old_speculative.sampler = old_sampler   # its drafter windows as they were too
    versions.append((a.before, old_sampler, old_speculative, 1))
  print(f"Host predicates per decode step, from the optimised HLO (CPU compile, vocab {a.vocab}, width 32); "
        f"steps_per_sync = {a.steps_per_sync}")
  print("(a cond counts its own predicate plus those of its costliest branch: an upper bound where branches differ)")
  print(f"| {'decoder':17} | {'route':8} | {'code':8} | data-dependent loops | conds in loop | "
        f"predicates per loop iteration | per step |")
  print("|---|---|---|---|---|---|---|")
  for label, bs, kv_write, kw in rows:
    dc = sampler.DecodeConfig(block_size=bs, threshold=0.9, max_new_tokens=64, mask_token_id=a.vocab - 1,
                              eos_ids=(5,), kv_write=kv_write, steps_per_sync=a.steps_per_sync, steps_per_block=0,
                              **kw)
    for name, smod, spmod, k in versions:
      traced = (np.float32(dc.threshold), np.float32(dc.temperature), np.int32(dc.top_k), np.float32(dc.top_p),
                np.zeros((2,), np.uint32), np.int32(0))
      if label.startswith("speculative"):
        if name == "now":
          fn = spmod.decoder_for(cfg, cfg, dc)
        else:
          fn = spmod.compiled_speculative(sampler.model_for_decoding(cfg, dc), cfg.as_block_diffusion(1), bs, 64,
                                          (5,), dc.mask_token_id, kv_write, dc.temperature > 0)
        args = (params, params, toks, lens) + traced
      else:
        if name == "now":
          fn = smod.decoder_for(cfg, dc)[1]
        else:
          fn = smod.compiled_decoder(sampler.model_for_decoding(cfg, dc), bs, 64, (5,), dc.mask_token_id, kv_write)
        args = (params, toks, lens) + traced
      c = count(fn, args, k)
      print(f"| {label:17} | {sampler.sampling_route(dc):8} | {name:8} | {c['unknown']} | {c['conds']} | "
            f"{c['per_iter']} | {c['per_step']:.3g} |", flush=True)


def lower_8b():
  """The Qwen3-8B shape in bf16, batch 1, a 2,200-token prompt: the lowered (not compiled) decoders'
  while loops and conditionals (StableHLO `while`, `case` / `if`), from shapes only."""
  import jax.numpy as jnp
  v = 151_936
  cfg = Qwen3Config(vocab_size=v, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, mask_token_id=v - 1,
                    eos_token_id=5, pad_token_id=0, dtype="bfloat16", param_dtype="bfloat16")
  params = jax.eval_shape(lambda: qwen3.init_params(cfg, jax.random.PRNGKey(0)))
  toks, lens = jax.ShapeDtypeStruct((1, 2200), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)
  sc = lambda d: jax.ShapeDtypeStruct((), d)
  traced = (sc(jnp.float32), sc(jnp.float32), sc(jnp.int32), sc(jnp.float32),
            jax.ShapeDtypeStruct((2,), jnp.uint32), sc(jnp.int32))
  print("Qwen3-8B shape, bf16, batch 1, prompt 2,200, lowered: | decoder | whiles | conds |")
  for label, bs, kv_write, temp in (("AR", 1, "separate", 0.0), ("B=32 fused", 32, "fused", 0.0),
                                    ("B=32 separate sampled", 32, "separate", 0.7),
                                    ("speculative B=32", 32, "fused", 0.0)):
    dc = sampler.DecodeConfig(block_size=bs, threshold=0.9, max_new_tokens=256, mask_token_id=v - 1, eos_ids=(5,),
                              kv_write=kv_write, temperature=temp, steps_per_block=0)
    if label.startswith("speculative"):
      txt = speculative.decoder_for(cfg, cfg, dc).lower(params, params, toks, lens, *traced).as_text()
    else:
      txt = sampler.decoder_for(cfg, dc)[1].lower(params, toks, lens, *traced).as_text()
    print(f"| {label} | {txt.count('stablehlo.while')} | {txt.count('stablehlo.case') + txt.count('stablehlo.if')} |",
          flush=True)


if __name__ == "__main__":
  main()
