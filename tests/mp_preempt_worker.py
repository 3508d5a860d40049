"""The runs of the preemption checks (tests/test_preemption.py): made in the test process itself (one
process) or as one process of a multi-process run through launch/local_multi_process.sh.

Two tiny stages on the shared training loop, checkpoint_every 100 (so a mid-run checkpoint is the
preemption's own) with async checkpointing:
  sft: a 1-layer Qwen3 on a fixed synthetic split (grain iterator), next-token loss;
  rl: the GRPO toy of tests/rl_toy.py with dynamic sampling (step 1 draws twice) and a keep_best
      validation curve every 2 steps (`toy_validation`: per-user hits that are a function of the
      params, none at the start), so the kept params can be a validated point's, not the last's.

`hook(step)` runs when step `step`'s batch is requested, i.e. in the middle of that step:
`signal_hook` sends this process SIGTERM at step K, and with `again` a second SIGTERM right after
the preemption save has started (its write still in flight).

As a worker: `--stage`, `--workdir`, `--steps`; `--signal_at K` (`--signal_process P`: only process
P; -1: every one; the time it was sent goes to WORKDIR.signalled) and `--again`; `--sleep S`
seconds per step (time for a signal from outside); `--baseline DIR` also trains DIR uninterrupted
after the run. Process 0 then writes `--out` (npz): the run's final params (`param/...`), the
baseline's (`base/...`), the steps this launch computed, and for rl the validation curve and the
kept step of both. A preempted run exits with status 75."""

import argparse
import os
import signal
import time

import mp_train_worker
import numpy as np

STEPS = {"sft": 6, "rl": 6}


def _config(steps: int, batch_size: int):
  import ml_collections
  from dgr2_jax.train import config as train_config
  config = ml_collections.ConfigDict({"seed": 0, "train": train_config.train_config()})
  tc = config.train
  tc.total_steps, tc.batch_size, tc.checkpoint_every, tc.tensorboard = steps, batch_size, 100, False
  tc.optimizer.peak_lr, tc.optimizer.warmup_steps = 1e-2, 1
  return config


def _hooked(source, hook):
  from dgr2_jax.train import loop
  if hook is None:
    return source

  def make(params, step):
    hook(step)
    return source.make(params, step)
  return loop.StepBatches(make, source.data)


def sft(workdir: str, steps: int, hook=None, **train) -> dict:
  """The SFT toy; `train` overrides `config.train` fields."""
  from dgr2_jax.model import qwen3
  from dgr2_jax.task import pipeline
  from dgr2_jax.train import loop, losses
  mc, arrays = mp_train_worker.toy_sft(32)
  it = pipeline.make_iterator(arrays, 8, seed=0, field="train.batch_size")
  config = _config(steps, 8)
  config.train.update(train)
  return loop.train(config, workdir, params=lambda rng: qwen3.init_params(mc, rng),
                    loss_fn=lambda prm, b, rng: losses.sft_loss(mc, prm, b), desc="sft-toy",
                    step_batches=_hooked(loop.iterator_batches(it), hook))


def toy_validation(start_params, users: int = 64):
  """`params -> {"valid_recall@1", "valid_hits"}`: user j hits when weight j of the largest matrix
  has moved from its start by an odd multiple of 1e-3 (a deterministic, non-monotone function of
  the params; nobody hits at the start)."""
  import jax
  leaf = lambda p: max(jax.tree_util.tree_leaves(p), key=lambda x: x.size)
  host = lambda x: np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x, np.float64)
  w0 = host(leaf(start_params)).ravel()[:users]

  def fn(params):
    hits = (np.floor(np.abs(host(leaf(params)).ravel()[:users] - w0) * 1e3) % 2).astype(int).tolist()
    return {"valid_recall@1": float(np.mean(hits)), "valid_hits": hits}
  return fn


def rl(workdir: str, steps: int, hook=None) -> dict:
  import rl_toy
  from dgr2_jax.train import loop, rollouts
  cfg, params = rl_toy.model()
  dead = rl_toy.first_batches(1)[0]   # step 1's first draw has no reward variance: it draws twice
  source = rollouts.on_policy_batches(rl_toy.make_batch_fn(cfg, dead), rl_toy.prompt_iter(), 0,
                                      rollouts.DynamicSampling(2, rl_toy.PPS, rl_toy.G))
  config = _config(steps, 2 * rl_toy.PPS * rl_toy.G)
  config.train.grad_accum_steps = 2
  config.train.optimizer.peak_lr, config.train.optimizer.schedule = 3e-2, "constant"
  return loop.train(config, workdir, params=params, loss_fn=rl_toy.loss_fn(cfg), desc="rl-toy",
                    step_batches=_hooked(source, hook),
                    validation=loop.Validation(toy_validation(params), every=2, keep_best=True))


RUNS = {"sft": sft, "rl": rl}


def signal_hook(at: int, again: bool = False, process: int = -1, sleep: float = 0.0, computed=None,
                mark: str = ""):
  """hook(step): records `step` in `computed`, sleeps `sleep` s, and at step `at` (on process
  `process`; -1: every one) sends this process SIGTERM, writing the time to the file `mark`;
  `again`: once more right after the next save starts (the preemption save, its write in flight)."""
  import jax
  from dgr2_jax.train import checkpoint as ckpt_lib

  def second_during_save():
    real = ckpt_lib.save

    def save(manager, step, *args, **kw):
      real(manager, step, *args, **kw)
      if step >= at:
        ckpt_lib.save = real
        os.kill(os.getpid(), signal.SIGTERM)
    ckpt_lib.save = save

  def hook(step):
    if computed is not None:
      computed.append(step)
    time.sleep(sleep)
    if step == at and process in (-1, jax.process_index()):
      if again:
        second_during_save()
      if mark:
        with open(mark, "w") as f:
          f.write(str(time.time()))
      os.kill(os.getpid(), signal.SIGTERM)
  return hook


def flat_params(state) -> dict:
  import jax
  from jax.experimental import multihost_utils
  from dgr2_jax.model import checkpoint as model_ckpt
  params = multihost_utils.process_allgather(state["params"], tiled=True) if jax.process_count() > 1 \
      else jax.device_get(state["params"])
  return {k: np.asarray(v) for k, v in model_ckpt.flatten(params).items()}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--stage", choices=sorted(RUNS), required=True)
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--steps", type=int, default=0)
  ap.add_argument("--signal_at", type=int, default=0)
  ap.add_argument("--signal_process", type=int, default=-1)
  ap.add_argument("--again", action="store_true")
  ap.add_argument("--sleep", type=float, default=0.0)
  ap.add_argument("--baseline", default="")
  ap.add_argument("--out", default="")
  args = ap.parse_args()

  from dgr2_jax import multihost
  multihost.initialize()  # before any other JAX call
  import jax

  steps = args.steps or STEPS[args.stage]
  computed = []
  hook = signal_hook(args.signal_at, args.again, args.signal_process, args.sleep, computed,
                     mark=args.workdir.rstrip("/") + ".signalled")
  state = RUNS[args.stage](args.workdir, steps, hook)   # preempted: exits 75 here
  out = {"param/" + k: v for k, v in flat_params(state).items()}
  out.update(computed=np.asarray(computed), processes=jax.process_count())
  if args.baseline:
    base = RUNS[args.stage](args.baseline, steps)
    out.update({"base/" + k: v for k, v in flat_params(base).items()})
    for name, st in (("", state), ("base_", base)):
      if "valid_curve" in st:
        out[name + "curve"] = np.asarray([pt["valid_recall@1"] for pt in st["valid_curve"]])
        out[name + "best_step"] = st["best_step"]
  if multihost.is_writer() and args.out:
    np.savez(args.out, **out)


if __name__ == "__main__":
  main()
