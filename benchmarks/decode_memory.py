"""Device memory of one decode call at a model's shape: the parameters a stage hands the decoder,
counted in the compiled program (shapes only, nothing allocated).

  python benchmarks/decode_memory.py                      # Qwen3-8B shape, AR / diffusion / speculative
  python benchmarks/decode_memory.py --dtype=float32      # what a CPU compile can show (below)

For each decoder and batch size the decoder is compiled twice for this machine's backend: given
the checkpoint's own tree (the HF layout in f32, the training stages' master weights, which the
decoder casts to the compute dtype `--dtype` and fuses inside its program) and given the tree
`decode.runtime.load_on_device` places (`prepare_on_host`: per layer, q/k/v and gate/up fused,
in the compute dtype, or float8 kernels with `--weight_dtypes`). XLA's memory analysis gives the
call's arguments (parameters, prompts) and its temporaries (the KV cache, the window, logits chunks, and any
prepared copy of the parameters the program builds); both are per device with the parameters
replicated (the default decode mesh: data-parallel). Counted at 2 and 3 layers and extrapolated
exactly to the full depth, as `decode_bytes.py` does. Speculative decoding holds two models.
`--target=h100` (or any of dgr2_jax/aot/targets.py) compiles for that device instead, without one.

The arguments are what the devices hold between calls whatever the backend. The temporaries are
the compiled program's for this backend: XLA's CPU backend computes bf16 dots in f32 and keeps an
f32 copy of every bf16 weight (`decode_bytes.py`), which hides the prepared copy in a bf16 compile
here; `--dtype=float32` shows it on a CPU, and a GPU compile shows it at bf16.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from dgr2_jax import platform, results  # noqa: E402
from dgr2_jax.aot import hlo, programs, targets  # noqa: E402
from dgr2_jax.model import qwen3  # noqa: E402

_SHAPE = flags.DEFINE_string("shape", "qwen3_8b", "a model shape of dgr2_jax.aot.programs.SHAPES")
_PROGRAMS = flags.DEFINE_list("programs", ["ar", "diffusion", "speculative"], "decoders")
_BATCHES = flags.DEFINE_list("batch_sizes", ["1", "32"], "batch sizes (32: the eval batch)")
_WEIGHT_DTYPES = flags.DEFINE_list("weight_dtypes", ["bf16", "float8_e4m3fn"], "prepared trees' kernels")
_PROMPT = flags.DEFINE_integer("prompt_len", 2200, "prompt tokens")
_NEW = flags.DEFINE_integer("max_new_tokens", 128, "response slots")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "the compute dtype")
_ATTENTION = flags.DEFINE_string("attention", "auto", "model.attention_impl ('auto': the route a run takes here)")
_JSON = flags.DEFINE_string("json_out", "", "also write the rows as JSON here")
_TARGET = flags.DEFINE_string("target", "", "compile for this target instead of this machine "
                              "(dgr2_jax/aot/targets.py: h100, h200x8, v5e-4, ...)")
GIB = 2 ** 30


def memory(program: str, layers: int, batch: int, tree: str) -> tuple[int, int]:
  """(argument bytes, temporary bytes) of the compiled decoder at `layers` layers. `tree`:
  'checkpoint' (f32, HF layout) or a weight dtype of the prepared tree ('bf16': the compute dtype's,
  'float8_e4m3fn')."""
  cfg = programs.model_config(_SHAPE.value, layers).replace(param_dtype=_DTYPE.value,   # compute: 'auto'
                                                                attention_impl=_ATTENTION.value)
  wd = "" if tree in ("checkpoint", "bf16") else tree
  fn, args, _ = programs.decoder_program(program, cfg, batch, _PROMPT.value, _NEW.value, 32, wd)
  if tree == "checkpoint":
    raw = qwen3.param_shapes(cfg.replace(param_dtype="float32"))
    args = ((raw, raw) if program == "speculative" else (raw,)) + tuple(args[2 if program == "speculative" else 1:])
  m = hlo.memory(hlo.lower(fn, *args).compile())
  return m.arguments, m.temporaries


def row(program: str, batch: int, tree: str) -> dict:
  full = programs.SHAPES[_SHAPE.value]["num_hidden_layers"]
  lo, hi = memory(program, 2, batch, tree), memory(program, 3, batch, tree)
  args, temp = (hi[i] + (full - 3) * (hi[i] - lo[i]) for i in (0, 1))
  return {"shape": _SHAPE.value, "program": program, "batch": batch, "params": tree, "dtype": _DTYPE.value,
          "attention": _ATTENTION.value,
          "arguments_gib": args / GIB, "temporaries_gib": temp / GIB, "total_gib": (args + temp) / GIB}


def main(argv):
  del argv
  with targets.compile_for(_TARGET.value) if _TARGET.value else contextlib.nullcontext():
    run()


def run():
  rows = []
  print(f"{_SHAPE.value}, compute {_DTYPE.value}, attention {_ATTENTION.value}, prompt {_PROMPT.value} + "
        f"{_NEW.value} slots, {_TARGET.value or platform.backend()} compile, per device (parameters replicated)\n")
  print("| decoder | batch | params handed to the decoder | arguments GiB | temporaries GiB | total GiB |")
  print("|---|---|---|---|---|---|")
  for program in _PROGRAMS.value:
    for batch in map(int, _BATCHES.value):
      for tree in ["checkpoint"] + list(_WEIGHT_DTYPES.value):
        r = row(program, batch, tree)
        rows.append(r)
        name = {"checkpoint": "checkpoint (f32, HF layout; cast and fused in the call)",
                "bf16": f"prepared on the host ({_DTYPE.value}, fused)"}.get(
                    tree, f"prepared on the host ({tree} kernels)")
        print(f"| {program} | {batch} | {name} | {r['arguments_gib']:.2f} | {r['temporaries_gib']:.2f} | "
              f"{r['total_gib']:.2f} |", flush=True)
  if _JSON.value:
    import jax
    device_bytes = targets.resolve(_TARGET.value).memory_bytes if _TARGET.value else None
    with open(_JSON.value, "w") as f:
      json.dump(dict(kind="dgr2-compiled", benchmark="decode_memory", git_commit=results.git_commit(),
                     jax_version=jax.__version__, backend=platform.backend(), target=_TARGET.value,
                     device_memory_gib=device_bytes / GIB if device_bytes else None, prompt_len=_PROMPT.value,
                     max_new_tokens=_NEW.value, command="python benchmarks/decode_memory.py " + " ".join(sys.argv[1:]),
                     rows=rows), f, indent=1)


if __name__ == "__main__":
  app.run(main)
