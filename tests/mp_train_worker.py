"""One process of the multi-process training check (tests/test_multiprocess.py): a tiny Qwen3
trained with the shared loop on a fixed synthetic split, mesh data x fsdp from the arguments, then
saved as a model directory and read back (several processes: straight into the training
shardings). Process 0 writes `--out` (npz): the per-step losses, the
final parameters and the model directory's round-trip difference. `--kill_at S` exits (status 3)
when the batch of step S is requested, after step S-1's checkpoint is committed."""

import argparse
import json
import os


def toy_sft(n: int):
  """(the tiny Qwen3's config, a fixed synthetic SFT split of `n` rows: left-padded prompts of up to 6
  tokens, responses of 3 to 8, the first 3 reasoning); also tests/mp_preempt_worker.py's SFT toy."""
  import numpy as np
  from dgr2_jax.model.config import Qwen3Config
  mc = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                   eos_token_id=5, pad_token_id=0)
  rs = np.random.RandomState(0)
  p, r = 6, 8
  plen = rs.randint(2, p + 1, n).astype(np.int32)
  prompt = rs.randint(1, 64, (n, p)).astype(np.int32) * (np.arange(p)[None] >= p - plen[:, None])
  rlen = rs.randint(3, r + 1, n)
  resp_mask = (np.arange(r)[None] < rlen[:, None]).astype(np.int32)
  arrays = {"prompt_ids": prompt.astype(np.int32), "prompt_len": plen,
            "response_ids": (rs.randint(1, 64, (n, r)) * resp_mask).astype(np.int32),
            "response_mask": resp_mask, "reasoning_mask": resp_mask * (np.arange(r)[None] < 3),
            "answer_mask": resp_mask * (np.arange(r)[None] >= 3)}
  return mc, arrays


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--out", default="")
  ap.add_argument("--steps", type=int, default=4)
  ap.add_argument("--data", type=int, default=2)
  ap.add_argument("--fsdp", type=int, default=2)
  ap.add_argument("--kill_at", type=int, default=0)
  args = ap.parse_args()

  from dgr2_jax import multihost
  multihost.initialize()  # before any other JAX call
  import jax
  import ml_collections
  import numpy as np
  from jax.experimental import multihost_utils
  from dgr2_jax.model import checkpoint as model_ckpt
  from dgr2_jax.model import qwen3
  from dgr2_jax.task import pipeline
  from dgr2_jax.train import config as train_config
  from dgr2_jax.train import loop, losses

  mc, arrays = toy_sft(24)

  config = ml_collections.ConfigDict({"seed": 0, "train": train_config.train_config()})
  tc = config.train
  tc.total_steps, tc.batch_size, tc.checkpoint_every = args.steps, 8, 1
  tc.async_checkpointing, tc.tensorboard = False, False
  tc.optimizer.peak_lr, tc.optimizer.warmup_steps = 1e-2, 1
  tc.mesh.data, tc.mesh.fsdp = args.data, args.fsdp

  class KillAt:
    """The batch iterator, exiting when step `at`'s batch is requested (a killed run)."""

    def __init__(self, it, at):
      self.it, self.at, self.n = it, at, 0

    def __next__(self):
      self.n += 1
      if self.n == self.at:
        os._exit(3)
      return next(self.it)

    def get_state(self):
      return self.it.get_state()

    def set_state(self, st):
      self.it.set_state(st)

  it = pipeline.make_iterator(arrays, int(tc.batch_size), seed=0, field="train.batch_size")
  it = KillAt(it, args.kill_at) if args.kill_at else it

  def loss_fn(params, batch, rng):
    del rng
    return losses.sft_loss(mc, params, batch)

  train_dir = os.path.join(args.workdir, "train")
  state = loop.train(config, train_dir, params=lambda rng: qwen3.init_params(mc, rng), loss_fn=loss_fn,
                     batch_iter=it, desc="mp")
  spans = any(not x.is_fully_addressable for x in jax.tree_util.tree_leaves(state["params"]))
  model_dir = os.path.join(args.workdir, "model")
  model_ckpt.save_model_dir(model_dir, mc, state["params"], overwrite=True)
  params = multihost_utils.process_allgather(state["params"], tiled=True)
  # Collective (Orbax), like the save; several processes: straight into the training shardings.
  sh = loop.model_shardings(config)
  _, loaded = model_ckpt.load_model_dir(model_dir, shardings=sh)
  loaded_spans = any(isinstance(x, jax.Array) and not x.is_fully_addressable
                     for x in jax.tree_util.tree_leaves(loaded))
  if sh is not None:
    loaded = multihost_utils.process_allgather(loaded, tiled=True)
  if multihost.is_writer() and args.out:
    flat = {k: np.asarray(v) for k, v in model_ckpt.flatten(params).items()}
    diff = max(float(np.max(np.abs(np.asarray(a, np.float32) - flat[k])))
               for k, a in model_ckpt.flatten(loaded).items())
    with open(os.path.join(train_dir, "metrics.jsonl")) as f:
      loss = [json.loads(line)["loss"] for line in f if line.strip()]
    np.savez(args.out, loss=np.asarray(loss), roundtrip=diff, spans=spans, loaded_spans=loaded_spans,
             processes=jax.process_count(), **{"param/" + k: v for k, v in flat.items()})
    print(f"mp_train_worker: {jax.process_count()} process(es) x {jax.local_device_count()} devices, "
          f"loss {loss}", flush=True)


if __name__ == "__main__":
  main()
