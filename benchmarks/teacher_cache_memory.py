"""Teacher-cache memory of OPD per prompt: full-vocabulary log-probs vs top-k (+ rest mass).

  JAX_PLATFORMS=cpu python benchmarks/teacher_cache_memory.py [--response_len 256] [--rollouts 4]

Per prompt the cache holds G' rollouts x R response positions:
  full:  G' * R * V * 4 bytes                 (f32 log-probs)
  top-k: G' * R * (k * (4 + 4) + 4) bytes     (f32 log-probs + int32 indices, + f32 rest mass)
Printed for the demo vocabulary and the real Qwen3 one (151,936 + added tokens: by default
4 x 256 SID tokens + <|mask|>), and measured on the arrays `dgr2_jax.train.opd.cache_from_logprobs`
actually builds for the demo size (asserted equal to the formula).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dgr2_jax.train import opd  # noqa: E402


def formula(g: int, r: int, v: int, k: int) -> int:
  return g * r * v * 4 if k <= 0 else g * r * (k * (4 + 4) + 4)


def measured(g: int, r: int, v: int, k: int) -> int:
  logits = jax.random.normal(jax.random.PRNGKey(0), (g, r, v))
  cache = opd.cache_from_logprobs(jax.nn.log_softmax(logits, -1), k)
  return int(sum(np.asarray(x).nbytes for x in cache.values()))


def human(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024:
      return f"{n:.1f} {unit}"
    n /= 1024
  return f"{n:.1f} TiB"


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--response_len", type=int, default=256)
  ap.add_argument("--rollouts", type=int, default=4, help="G' (opd.rollouts_per_prompt)")
  ap.add_argument("--demo_vocab", type=int, default=1024, help="task.demo_vocab_size of configs/demo.py")
  ap.add_argument("--added_tokens", type=int, default=4 * 256 + 1, help="SID tokens + <|mask|>")
  ap.add_argument("--prompts_per_step", type=int, default=128)
  a = ap.parse_args()
  g, r = a.rollouts, a.response_len
  vocabs = {"demo": a.demo_vocab, "qwen3": 151_936 + a.added_tokens}
  print(f"G'={g} R={r}; bytes per prompt (and per step of {a.prompts_per_step} prompts)")
  print(f"{'vocab':>8} {'V':>8} {'k':>6} {'per prompt':>12} {'per step':>12} {'vs full':>8} {'measured':>12}")
  for name, v in vocabs.items():
    full = formula(g, r, v, 0)
    for k in (0, 16, 64, 256):
      f = formula(g, r, v, k)
      meas = ""
      if name == "demo":
        m = measured(g, r, v, k)
        assert m == f, (name, k, m, f)
        meas = human(m)
      print(f"{name:>8} {v:>8} {k if k else 'full':>6} {human(f):>12} {human(f * a.prompts_per_step):>12} "
            f"{f / full:>8.4f} {meas:>12}")


if __name__ == "__main__":
  main()
