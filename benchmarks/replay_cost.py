"""Cost of scoring replayed rollouts (OPD / RL update), dense vs segmented attention, side by side.

  python benchmarks/replay_cost.py [--rows=16] [--prompt_len=128] [--response_len=64] [--block=32]

Times one jitted value-and-grad of `model.streams.response_predictions` (the replay/CFT scorer)
on the demo's model shape, for canvases per block = 4, 8 and the block size (exact replay of any
rollout, and the 'prefix' OPD context), with the dense [N, N]-masked attention and with
`qwen3.segment_attention`. Prints a table of seconds per step (median of --repeats after one
compile) and the ratio.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_ROWS = flags.DEFINE_integer("rows", 16, "rollouts per step")
_P = flags.DEFINE_integer("prompt_len", 128, "prompt slots")
_R = flags.DEFINE_integer("response_len", 64, "response length")
_B = flags.DEFINE_integer("block", 32, "block size")
_REPEATS = flags.DEFINE_integer("repeats", 3, "timed steps per row of the table")


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  import numpy as np
  from dgr2_jax.model import qwen3, streams
  from dgr2_jax.model.config import Qwen3Config
  cfg = Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=192, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16).as_block_diffusion(_B.value, 3)
  params = qwen3.init_params(cfg, jax.random.PRNGKey(0))
  b, p, r, bs = _ROWS.value, _P.value, _R.value, _B.value
  nb = r // bs
  rs = np.random.RandomState(0)
  prompt = jnp.asarray(rs.randint(4, 1024, (b, p)), jnp.int32)
  plen = jnp.full((b,), p, jnp.int32)
  clean = jnp.asarray(rs.randint(4, 1024, (b, r)), jnp.int32)
  print(f"replay scoring, value-and-grad, {b} rows x (prompt {p} + response {r}), block {bs}, "
        f"{jax.devices()[0].platform}")
  print("| canvases per block | tokens per row | dense s/step | segmented s/step | dense / segmented |")
  print("|---|---|---|---|---|")
  for cap in sorted({4, 8, bs}):
    seg_block = np.repeat(np.arange(nb), cap)
    seg_tokens = jnp.asarray(rs.randint(3, 1024, (b, nb * cap, bs)), jnp.int32)
    pred_seg = jnp.asarray((np.arange(r) // bs) * cap + rs.randint(0, cap, (b, r)), jnp.int32)
    times = {}
    for dense in (True, False):
      def loss(prm, dense=dense):
        lg = streams.response_predictions(cfg, prm, prompt, plen, clean, seg_tokens, seg_block, pred_seg, bs,
                                          dense_mask=dense)
        return jnp.mean(jax.nn.logsumexp(lg, -1))
      fn = jax.jit(jax.value_and_grad(loss))
      jax.block_until_ready(fn(params))
      ts = []
      for _ in range(_REPEATS.value):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(params))
        ts.append(time.perf_counter() - t0)
      times[dense] = statistics.median(ts)
    print(f"| {cap} | {p + r + nb * cap * bs} | {times[True]:.3f} | {times[False]:.3f} | "
          f"{times[True] / times[False]:.1f}x |", flush=True)


if __name__ == "__main__":
  app.run(main)
