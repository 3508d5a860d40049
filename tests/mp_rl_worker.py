"""One process of the multi-process dynamic-sampling check (tests/test_dynamic_sampling.py): the toy
GRPO run of tests/rl_toy.py for 2 steps with up to 3 draws per step on a mesh of data 2, step 1's
first draw without reward variance. Process 0 writes `--out` (npz): the per-step draws,
informative groups, loss and mean reward, and the final parameters."""

import argparse
import json
import os


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--out", required=True)
  args = ap.parse_args()

  from dgr2_jax import multihost
  multihost.initialize()  # before any other JAX call
  import jax
  import numpy as np
  from jax.experimental import multihost_utils
  from dgr2_jax.model import checkpoint as model_ckpt
  import rl_toy

  dead = rl_toy.first_batches(1)[0]
  state = rl_toy.train(args.workdir, steps=2, draws=3, target=rl_toy.PPS, dead=dead, data=2)
  params = multihost_utils.process_allgather(state["params"], tiled=True)
  if multihost.is_writer():
    with open(os.path.join(args.workdir, "metrics.jsonl")) as f:
      recs = [json.loads(line) for line in f if line.strip()]
    flat = {k: np.asarray(v) for k, v in model_ckpt.flatten(params).items()}
    np.savez(args.out, processes=jax.process_count(), **{k: np.asarray([r[k] for r in recs]) for k in
                                                         ("draws", "informative_groups", "loss", "reward_mean")},
             **{"param/" + k: v for k, v in flat.items()})


if __name__ == "__main__":
  main()
