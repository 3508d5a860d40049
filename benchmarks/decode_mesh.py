"""The decode mesh at Qwen3 shapes, from shapes only: what tensor parallelism puts on each device.

  python benchmarks/decode_mesh.py                       # Qwen3-8B, tensor 1/2/4/8, AR and W=32, bf16
  python benchmarks/decode_mesh.py --layers=36 --compile=false   # the full depth, lowered only

Simulates `--devices` CPU devices (XLA_FLAGS, set before jax starts), or takes a compile-only
target's (`--target=h100x8`: the program those GPUs run, without them), builds the decode mesh
(decode/mesh.py) with data=1 and tensor=t, and lowers the jitted decoders (sampler.compiled_decoder:
AR = block size 1, diffusion = block size 32 at tau 0.9) with every parameter and input a
`jax.ShapeDtypeStruct` carrying its NamedSharding: nothing is allocated. Per row: the parameter
bytes each device holds (from the shardings), the KV cache bytes per device, and, compiled
(`--compile`), the collectives of the optimised program (all-gathers and all-reduces, those a
loop body runs and the bytes these move, and the largest all-gather's bytes: a weight gathered per
step would show here as tens of MB) and XLA's memory analysis per device. `--layers` < 36 keeps
the 8B widths at a smaller depth (compile time grows with depth; every layer is sharded alike).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

from absl import app, flags

flags.DEFINE_integer("devices", 8, "simulated CPU devices")
flags.DEFINE_integer("layers", 2, "decoder layers (36 = Qwen3-8B's depth)")
flags.DEFINE_integer("batch", 1, "rows per decode call")
flags.DEFINE_integer("prompt_len", 2200, "prompt slots")
flags.DEFINE_integer("max_new_tokens", 256, "response slots")
flags.DEFINE_list("tensor", ["1", "2", "4", "8"], "tensor sizes")
flags.DEFINE_bool("compile", True, "compile and count collectives (else lower only)")
flags.DEFINE_string("target", "", "compile for this target's devices instead of simulated CPU devices "
                    "(dgr2_jax/aot/targets.py: h100x8, v5e-8, ...; pip install -e \".[aot]\")")
flags.DEFINE_string("json_out", "", "also write the rows as JSON here")
FLAGS = flags.FLAGS

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)


def _bytes_per_device(tree) -> int:
  import jax
  import numpy as np
  total = 0
  for x in jax.tree_util.tree_leaves(tree):
    shard = x.sharding.shard_shape(x.shape)
    total += int(np.prod(shard)) * x.dtype.itemsize
  return total


def _collectives(text: str) -> dict:
  """Counts of all-gathers / all-reduces in an optimised HLO text (dgr2_jax/aot/hlo.py), how many
  of each a loop body runs (every step) and the bytes of those, and the largest all-gather's result
  bytes and the computation it sits in (a branch of the sampling-route switch only runs when that
  route does)."""
  from dgr2_jax.aot import hlo
  found = hlo.collectives(text)
  gathers = [c for c in found if c.op == "all-gather"]
  big = max(gathers, key=lambda c: c.bytes, default=None)
  looped = [c for c in found if c.in_loop]
  return {"all_gather": len(gathers), "all_gather_in_loop": sum(c.in_loop for c in gathers),
          "all_reduce": sum(c.op == "all-reduce" for c in found),
          "all_reduce_in_loop": sum(c.op == "all-reduce" for c in looped),
          "in_loop_bytes": sum(c.bytes for c in looped),
          "largest_all_gather_bytes": big.bytes if big else 0,
          "largest_all_gather": f"{big.shape} in {big.computation}" if big else "-"}


def main(_):
  if not FLAGS.target:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={FLAGS.devices}")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from dgr2_jax.aot import targets
  with targets.compile_for(FLAGS.target) if FLAGS.target else contextlib.nullcontext():
    run()


def run():
  import jax
  import jax.numpy as jnp
  import numpy as np
  from dgr2_jax import platform
  from dgr2_jax.aot import hlo
  from dgr2_jax.decode import mesh as dmesh
  from dgr2_jax.decode import sampler
  from dgr2_jax.model import qwen3
  from dgr2_jax.model.config import Qwen3Config

  cfg = Qwen3Config(rope_theta=1e6, **dict(QWEN3_8B, num_hidden_layers=FLAGS.layers), dtype="bfloat16",
                    param_dtype="bfloat16", mask_token_id=151669, eos_token_id=151645, pad_token_id=151643)
  shapes = qwen3.param_shapes(cfg)
  print(f"Qwen3-8B widths, {FLAGS.layers} layers, bf16, batch {FLAGS.batch}, prompt {FLAGS.prompt_len}, "
        f"{FLAGS.max_new_tokens} new tokens, {len(platform.devices())} "
        f"{FLAGS.target or 'simulated ' + platform.backend()} devices; "
        f"params {qwen3.count_params(shapes) / 1e9:.2f} B")
  cols = ("decoder", "tensor", "param_MB_per_dev", "kv_MB_per_dev", "lower_s", "compile_s", "all_gather",
          "all_gather_in_loop", "all_reduce", "all_reduce_in_loop", "in_loop_bytes", "largest_all_gather_bytes",
          "largest_all_gather", "temp_MB_per_dev")
  table = []
  print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
  dump = os.environ.get("DECODE_MESH_HLO", "")   # a directory: each compiled program's text goes there
  for t in map(int, FLAGS.tensor):
    mesh = dmesh.make_mesh(1, t)
    sh = dmesh.param_shardings(mesh, shapes)
    params = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, sh)
    rows = dmesh.sharding(mesh, ("batch", None), (FLAGS.batch, FLAGS.prompt_len))
    toks = jax.ShapeDtypeStruct((FLAGS.batch, FLAGS.prompt_len), jnp.int32, sharding=rows)
    lens = jax.ShapeDtypeStruct((FLAGS.batch,), jnp.int32, sharding=dmesh.sharding(mesh, ("batch",), (FLAGS.batch,)))
    cache = jax.eval_shape(lambda: qwen3.init_cache(cfg, FLAGS.batch, FLAGS.prompt_len + FLAGS.max_new_tokens))
    kv_sh = dmesh.sharding(mesh, ("batch", "length", "kv_heads", None), cache[0]["k"].shape)
    kv = sum(int(np.prod(kv_sh.shard_shape(x.shape))) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(cache))
    for name, bs in (("ar", 1), ("diffusion_w32", 32)):
      dc = sampler.decode_config_for(cfg, block_size=bs, threshold=0.9 if bs > 1 else 1.0,
                                     max_new_tokens=FLAGS.max_new_tokens, steps_per_block=0)
      _, fn = sampler.decoder_for(cfg, dc, mesh)
      scal = lambda d: jax.ShapeDtypeStruct((), d)
      t0 = time.perf_counter()
      lowered = fn.lower(params, toks, lens, scal(jnp.float32), scal(jnp.float32), scal(jnp.int32),
                         scal(jnp.float32), jax.ShapeDtypeStruct((2,), jnp.uint32), scal(jnp.int32))
      lower_s = time.perf_counter() - t0
      row = {"decoder": name, "tensor": t, "param_MB_per_dev": _bytes_per_device(params) / 2**20,
             "kv_MB_per_dev": kv / 2**20, "lower_s": lower_s}
      if FLAGS.compile:
        t0 = time.perf_counter()
        compiled = lowered.compile()
        row["compile_s"] = time.perf_counter() - t0
        text = compiled.as_text()
        row.update(_collectives(text))
        if dump:
          with open(os.path.join(dump, f"{name}_t{t}.hlo"), "w") as f:
            f.write(text)
        mem = hlo.memory(compiled)
        if mem is not None:
          row["temp_MB_per_dev"] = mem.temporaries / 2**20
      table.append(row)
      print("| " + " | ".join(f"{row[c]:.1f}" if isinstance(row.get(c), float) else str(row.get(c, "-"))
                              for c in cols) + " |", flush=True)
  if FLAGS.json_out:
    import json
    from dgr2_jax import results
    with open(FLAGS.json_out, "w") as f:
      json.dump(dict(kind="dgr2-compiled", benchmark="decode_mesh", git_commit=results.git_commit(),
                     jax_version=jax.__version__, backend=platform.backend(), target=FLAGS.target,
                     layers=FLAGS.layers, batch=FLAGS.batch, prompt_len=FLAGS.prompt_len,
                     max_new_tokens=FLAGS.max_new_tokens,
                     command="python benchmarks/decode_mesh.py " + " ".join(sys.argv[1:]), rows=table), f, indent=1)


if __name__ == "__main__":
  app.run(main)
