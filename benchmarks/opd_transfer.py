"""Does an OPD update transfer? Repeated steps on one batch of rollouts, the loss on other prompts'.

  python benchmarks/opd_transfer.py --config=configs/demo.py --workdir=/tmp/dgr2_demo \
      [--rows=64,256] [--steps=40] [--every=5] [--lr=0] [--out=benchmarks/results/opd_transfer_demo.json] \
      [--docs=docs/results.md]
  python benchmarks/opd_transfer.py --render=benchmarks/results/opd_transfer_demo.json --docs=docs/results.md

On-policy distillation learns only what carries over from the rollouts it trains on to the prompts
it has not seen. This measures that directly, without the noise of new rollouts each step: the
workdir's OPD start (the CFT model, `opd.init_from`) decodes one rollout of each of `rows` training
prompts (the "train" batch, as the stage samples them: `opd.temperature`, the decode section) and
of 64 other training prompts (the "held-out" batch), once. Then `--steps` Adam steps at the
preset's learning rate (`--lr` 0 = `opd.lr`; no clipping, no weight decay) on the train batch alone,
with the preset's loss (`opd.divergence`, `opd.choice_weight`, the teacher scored exactly), and
every `--every` steps the loss on both batches. A step that lowers the train loss and not the
held-out one fits its batch; only the held-out column is progress. One process; a CPU diagnostic.
`--docs` writes the table, with the commit, command and machine, between the doc's
`<!-- opd-transfer-table:<name> -->` markers (name: the config file's stem); `--render` rewrites it
from a recorded JSON without running anything.
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import numpy as np
import optax
from absl import app
from absl import flags
from ml_collections import config_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from dgr2_jax import main as main_lib  # noqa: E402
from dgr2_jax import results  # noqa: E402
from dgr2_jax.stages import on_policy  # noqa: E402
from dgr2_jax.stages import opd as opd_stage  # noqa: E402
from dgr2_jax.train import opd  # noqa: E402
from dgr2_jax.train.config import section  # noqa: E402

HELD_OUT = 64


def define_flags() -> dict:
  """The command line's flags, defined when run as a script."""
  return dict(
      config=config_flags.DEFINE_config_file("config", os.path.join(REPO, "configs", "demo.py"), "pipeline config"),
      workdir=flags.DEFINE_string("workdir", "/tmp/dgr2_demo", "a pipeline workdir with the CFT model and teacher"),
      rows=flags.DEFINE_list("rows", ["64", "256"], "train batch sizes (rollouts) to try"),
      steps=flags.DEFINE_integer("steps", 40, "Adam steps on the train batch"),
      every=flags.DEFINE_integer("every", 5, "measure every this many steps"),
      lr=flags.DEFINE_float("lr", 0.0, "learning rate (0 = opd.lr)"),
      out=flags.DEFINE_string("out", "", "JSON path ('' = print only)"),
      docs=flags.DEFINE_string("docs", "", "a doc whose opd-transfer table to rewrite ('' = none)"),
      render=flags.DEFINE_string("render", "", "a recorded JSON to render into --docs (runs nothing)"))


def curve(d: opd_stage.Distillation, train: dict, held: dict, lr: float, steps: int, every: int) -> list[dict]:
  """[{step, train_loss, heldout_loss[, train_choice_kl, heldout_choice_kl]}] of `steps` Adam steps on
  the batch `train` (module docstring); the choice KLs where the loss reports them."""
  value = jax.jit(lambda p, b: d.loss_fn(p, b, None, d.frozen))
  # The train batch's loss comes with its gradient: one forward per step, measured or not.
  value_and_grad = jax.jit(jax.value_and_grad(lambda p, b: d.loss_fn(p, b, None, d.frozen), has_aux=True))
  tx = optax.adam(lr)
  params = d.params
  state = tx.init(params)
  out = []
  for s in range(steps + 1):
    train_value, grads = value_and_grad(params, train)
    if s % every == 0 or s == steps:
      row = {"step": s}
      for name, b in (("train", train), ("heldout", held)):
        v, m = train_value if name == "train" else value(params, b)
        row[f"{name}_loss"] = float(v)
        if "choice_kl" in m:   # the KL at the candidate numbers alone (opd.choice_weight != 1)
          row[f"{name}_choice_kl"] = float(m["choice_kl"])
      out.append(row)
      print(f"  step {s:3d}  train {row['train_loss']:.4f}  held-out {row['heldout_loss']:.4f}"
            + (f"  held-out at the numbers {row['heldout_choice_kl']:.4f}" if "heldout_choice_kl" in row else ""),
            flush=True)
    if s < steps:
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
  return out


def measure(config, workdir: str, opts: dict) -> dict:
  oc = section(config, "opd", opd.opd_config)
  task = on_policy.task_setup(config, workdir)
  src = on_policy.source_dir(config, workdir, "opd", oc)
  d = opd_stage.distillation(config, oc, task, src, opd_stage.teacher_model_dir(config, oc, workdir))
  prompts = task["prompts"]
  order = np.random.default_rng(int(config.seed)).permutation(len(prompts["prompt_ids"]))
  pick = lambda idx: {k: v[idx] for k, v in prompts.items()}

  def batch(idx, key):
    roll, _ = d.sample(d.params, pick(idx), jax.random.PRNGKey(key))
    return d.batch(roll)[0]

  held = batch(order[:HELD_OUT], 1)
  lr = float(opts["lr"]) or float(oc.lr)
  record = {**results.record_head("benchmarks/opd_transfer.py"), "lr": lr, "heldout_rows": HELD_OUT,
            "divergence": str(oc.get("divergence", "forward")), "choice_weight": float(oc.choice_weight),
            "curves": {}}
  for n in (int(r) for r in opts["rows"]):
    print(f"train batch of {n} rollouts, lr {lr:g}:", flush=True)
    train = batch(order[HELD_OUT:HELD_OUT + n], 2)
    record["curves"][str(n)] = curve(d, train, held, lr, int(opts["steps"]), int(opts["every"]))
  return record


def render(record: dict) -> str:
  """The record's table: per train batch, the train loss and the held-out loss at step 0, at the
  held-out loss's lowest point, and at the last step."""
  choice = "heldout_choice_kl" in record["curves"][next(iter(record["curves"]))][0]
  lines = ["| train batch (rollouts) | train loss: start -> last | held-out loss: start | lowest (step) | last "
           "| held-out's best change |" + (" held-out KL at the candidate numbers: start -> last |" if choice else ""),
           "|---|---|---|---|---|---|" + ("---|" if choice else "")]
  for n, c in record["curves"].items():
    best = min(c, key=lambda r: r["heldout_loss"])
    h0 = c[0]["heldout_loss"]
    lines.append(f"| {n} | {c[0]['train_loss']:.4f} -> {c[-1]['train_loss']:.4f} "
                 f"({c[-1]['train_loss'] / c[0]['train_loss'] - 1:+.0%}) | {h0:.4f} | {best['heldout_loss']:.4f} "
                 f"({best['step']}) | {c[-1]['heldout_loss']:.4f} | {best['heldout_loss'] / h0 - 1:+.1%} |"
                 + (f" {c[0]['heldout_choice_kl']:.4f} -> {c[-1]['heldout_choice_kl']:.4f} |" if choice else ""))
  return "\n".join(lines)


def write_docs(record: dict, doc: str, json_path: str) -> None:
  """The table after a sentence naming the commit, command and machine, between the doc's
  `<!-- opd-transfer-table:<name> -->` markers (`results.write_marked_table`)."""
  head = (f"`{record['name']}`: {results.record_source(record, json_path)} Adam at lr {record['lr']:g}, "
          f"{record['divergence']} KL, choice weight {record['choice_weight']:g}; the held-out batch is "
          f"{record['heldout_rows']} other training prompts' rollouts.")
  results.write_marked_table(doc, "opd-transfer", record["name"], f"{head}\n\n{render(record)}", "opd_transfer")


def main(argv, f: dict):
  del argv
  main_lib.quiet_logs(flags.FLAGS.verbosity if flags.FLAGS["verbosity"].present else -1)
  opts = {k: v.value for k, v in f.items() if k != "config"}
  results.benchmark_main(f, lambda: measure(f["config"].value, f["workdir"].value, opts), render, write_docs)


if __name__ == "__main__":
  _flags = define_flags()
  app.run(functools.partial(main, f=_flags))
