r"""Peak host memory of checkpoint conversion, relative to the checkpoint size, both directions.

  python benchmarks/convert_memory.py --gb=1 --dtype=bfloat16

Writes a random Qwen3-shaped HF checkpoint of about `--gb` GB (streamed, one tensor at a time) in a
temporary directory, runs `tools/convert_hf_to_flax.py` forward and `--reverse` each in its own
subprocess, and reports each one's peak RSS (ru_maxrss of the child) as a multiple of the checkpoint
size, raw and net of the baseline RSS of a process that only imports the same libraries. The
contract (issue 2) is at most ~1.3x: an 8B bf16 checkpoint (16 GB) converts on a 24 GB host.
"""

import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app, flags

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

FLAGS = flags.FLAGS
flags.DEFINE_float("gb", 1.0, "Approximate checkpoint size in GB (1e9 bytes).")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Checkpoint dtype.")
flags.DEFINE_string("tmp_dir", None, "Where to write the checkpoints (default: system temp).")

TOOL = os.path.join(REPO_ROOT, "tools", "convert_hf_to_flax.py")
# Runs a command and prints its peak RSS (KiB on Linux) so each measurement is of one child only.
_WRAP = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
         "print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
         "sys.exit(r.returncode)")
_IMPORTS = ("import jax, flax, numpy, orbax.checkpoint, safetensors, tqdm; "
            "from dgr2_jax.model import checkpoint")


def make_checkpoint(out_dir: str, gb: float, dtype: str):
  import json

  import numpy as np

  from dgr2_jax.model import checkpoint
  from dgr2_jax.model.config import Qwen3Config

  base = dict(vocab_size=32768, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
              num_key_value_heads=8, head_dim=64, tie_word_embeddings=False, param_dtype=dtype)
  probe = Qwen3Config(num_hidden_layers=1, **base)
  npdt = {"bfloat16": checkpoint.ml_dtypes.bfloat16, "float32": np.float32}[dtype]
  itemsize = np.dtype(npdt).itemsize
  per_layer = sum(math.prod(s) for p, s in checkpoint.expected_shapes(probe).items()
                  if p.startswith("layers_0/")) * itemsize
  fixed = 2 * base["vocab_size"] * base["hidden_size"] * itemsize
  layers = max(1, round((gb * 1e9 - fixed) / per_layer))
  config = Qwen3Config(num_hidden_layers=layers, **base)
  rng = np.random.default_rng(0)
  order = checkpoint._hf_order(config)
  rows = [(n, np.dtype(npdt), s, math.prod(s) * itemsize) for n, _, _, s in order]

  def get(name):
    shape = next(s for n, _, _, s in order if n == name)
    return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(npdt)

  os.makedirs(out_dir)
  checkpoint._write_safetensors(os.path.join(out_dir, checkpoint.SINGLE_FILE), rows, get)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config.to_hf_dict(), f)
  return config, sum(r[-1] for r in rows)


def run_measured(args: list[str]) -> tuple[int, float]:
  """(peak RSS bytes of the child, seconds)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT)
  t = time.time()
  r = subprocess.run([sys.executable, "-c", _WRAP, *args], capture_output=True, text=True, env=env)
  if r.returncode:
    raise RuntimeError(f"{args[:3]} failed:\n{r.stderr[-3000:]}")
  kb = int(next(l for l in r.stdout.splitlines() if l.startswith("MAXRSS_KB")).split()[1])
  return kb * 1024, time.time() - t


def main(argv):
  del argv
  tmp = tempfile.mkdtemp(prefix="convert_memory-", dir=FLAGS.tmp_dir)
  try:
    hf, ours, back = (os.path.join(tmp, n) for n in ("hf", "ours", "hf_back"))
    t = time.time()
    config, size = make_checkpoint(hf, FLAGS.gb, FLAGS.dtype)
    print(f"checkpoint: {config.num_hidden_layers} layers, {FLAGS.dtype}, {size / 1e9:.3f} GB "
          f"(written in {time.time() - t:.0f}s)")
    base, _ = run_measured([sys.executable, "-c", _IMPORTS])
    rows = [("imports only (baseline)", base, 0.0)]
    rss, sec = run_measured([sys.executable, TOOL, f"--hf_dir={hf}", f"--flax_dir={ours}"])
    rows.append(("HF -> ours (Orbax)", rss, sec))
    rss, sec = run_measured([sys.executable, TOOL, "--reverse", f"--flax_dir={ours}",
                             f"--hf_dir={back}", f"--shard_bytes={int(size // 3)}"])
    rows.append(("ours -> HF (3 shards)", rss, sec))
    # Bitwise check of the result, one tensor at a time.
    from dgr2_jax.model import checkpoint
    import numpy as np
    plan, _ = checkpoint._plan_hf(back, config)
    for f, name, _, _, _ in plan:
      a = checkpoint._read_tensor(os.path.join(back, f), name)
      b = checkpoint._read_tensor(os.path.join(hf, checkpoint.SINGLE_FILE), name)
      assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), name
    print(f"round trip bitwise identical ({len(plan)} tensors)\n")
    print(f"{'direction':28s} {'peak RSS GB':>12s} {'x ckpt':>8s} {'net x ckpt':>11s} {'time s':>7s}")
    for name, rss, sec in rows:
      net = (rss - base) / size if sec else 0.0
      print(f"{name:28s} {rss / 1e9:12.3f} {rss / size:8.2f} {net:11.2f} {sec:7.1f}")
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
