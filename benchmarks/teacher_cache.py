"""OPD's teacher side, measured: full cache vs top-k cache vs the teacher scored in the step.

  python benchmarks/teacher_cache.py --workdir=/tmp/dgr2_demo [--prompts=64]

1. Accuracy, on held-out rollouts of a finished demo workdir (the OPD student's own samples of
   `--prompts` validation prompts, `opd.rollouts_per_prompt` each): the OPD loss (token-mean KL
   to the AR teacher on the replayed canvases) computed from the full cache, from the top-k
   cache (k in 16, 64, 256: the KL over the teacher's top-k tokens plus one "rest" bucket,
   train/opd.py) and with the teacher scored in the step ('none'); relative error of the mean
   and the worst per-token error against the full cache, and the relative error of the gradient.
2. Cost at Qwen3's vocabulary (151,936 + 1,024 SID tokens + the mask: 152,961) with a tiny-width
   model, one OPD step of `--rows` rollouts x 512 response tokens: bytes per token of the cache,
   the cache of one step of the paper's 128 prompts x 4 rollouts, XLA's planned temporary memory
   of the step (compiled from shapes; nothing allocated) and its measured wall-clock.
The README's table and the presets' choice come from this script's output.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dgr2_jax.aot import hlo  # noqa: E402
from dgr2_jax.train import opd  # noqa: E402

QWEN3_V = 151_936 + 1_024 + 1


def bytes_per_token(mode: str, v: int, k: int) -> int:
  return {"full": 4 * v, "topk": 8 * k + 4, "none": 0}[mode]


def demo_accuracy(workdir: str, n_prompts: int):
  from configs import demo
  from dgr2_jax.stages import on_policy
  from dgr2_jax.stages import opd as opd_stage
  from dgr2_jax.stages import pipeline
  config = demo.get_config()
  oc = on_policy.section(config, "opd", opd.opd_config)
  task = on_policy.task_setup(config, workdir, "valid")
  prompts = {k: v[:n_prompts] for k, v in task["prompts"].items()}
  student = pipeline.model_dir(workdir, "opd")
  teacher = opd_stage.teacher_model_dir(config, oc, workdir)
  if not os.path.isdir(teacher):  # a workdir from before the teacher's RL stage
    teacher = pipeline.model_dir(workdir, "sft")
  rows = []
  base = None
  for mode, k in (("full", 0), ("topk", 16), ("topk", 64), ("topk", 256), ("none", 0)):
    with oc.unlocked():
      oc.teacher_cache, oc.teacher_top_k = mode, max(k, 1)
    d = opd_stage.distillation(config, oc, task, student, teacher)
    roll, _ = d.sample(d.params, prompts, jax.random.PRNGKey(7))
    batch, _ = d.batch(roll)
    grad = jax.jit(jax.value_and_grad(lambda p, b: d.loss_fn(p, b, None, d.frozen) if d.frozen is not None
                                      else d.loss_fn(p, b, None), has_aux=True))
    (loss, _), g = grad(d.params, batch)
    tok = np.asarray(d.token_kl_fn(d.params, batch)[0])
    m = np.asarray(batch["loss_mask"], bool)
    flat = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(g)])
    if base is None:
      base = (float(loss), tok, flat)
    rows.append(dict(mode=mode if mode != "topk" else f"top-{k}", kl=float(loss),
                     rel=abs(float(loss) - base[0]) / base[0], worst=float(np.abs(tok - base[1])[m].max()),
                     grad_rel=float(np.linalg.norm(flat - base[2]) / np.linalg.norm(base[2])),
                     bytes=bytes_per_token(mode, d.model_config.vocab_size, k),
                     tokens=int(m.sum())))
  return rows


def qwen3_cost(rows: int, r: int, p: int):
  from dgr2_jax.model import qwen3
  from dgr2_jax.model.config import Qwen3Config
  v = QWEN3_V
  cfg = Qwen3Config(vocab_size=v, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, tie_word_embeddings=True, mask_token_id=v - 1,
                    eos_token_id=5, pad_token_id=0, attention_impl="blockwise")
  bcfg = cfg.as_block_diffusion(32, v - 1)
  params = qwen3.init_params(cfg, jax.random.PRNGKey(0))
  teacher = qwen3.init_params(cfg, jax.random.PRNGKey(1))
  rs = np.random.RandomState(0)
  g = r // 32 * 4   # 4 canvases per block
  batch = {"prompt": rs.randint(10, 4000, (rows, p)).astype(np.int32), "prompt_len": np.full(rows, p, np.int32),
           "clean": rs.randint(10, 4000, (rows, r)).astype(np.int32),
           "seg_tokens": rs.randint(10, 4000, (rows, g, 32)).astype(np.int32),
           "pred_seg": np.tile((np.arange(r) // 32 * 4)[None], (rows, 1)).astype(np.int32),
           "loss_mask": np.ones((rows, r), np.float32)}
  out = []
  for mode, k in (("full", 0), ("topk", 64), ("topk", 256), ("none", 0)):
    t0 = time.perf_counter()
    if mode == "none":
      b = batch
    else:
      cache = jax.jit(lambda tp, pr, pl, cl: opd.ar_teacher_cache(cfg, tp, pr, pl, cl, top_k=k, mask_id=v - 1))(
          teacher, batch["prompt"], batch["prompt_len"], batch["clean"])
      b = dict(batch, **{n: np.asarray(x) for n, x in cache.items()})
    t_cache = time.perf_counter() - t0
    fn = jax.jit(jax.value_and_grad(lambda prm, bt, tp: opd.opd_loss(
        bcfg, prm, bt, None, tp, block_size=32, teacher_cache=mode, teacher_config=cfg), has_aux=True))
    temp = hlo.memory(fn.lower(params, b, teacher).compile()).temporaries
    jax.block_until_ready(fn(params, b, teacher))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(params, b, teacher))
    t_step = time.perf_counter() - t0
    cache_bytes = sum(np.asarray(x).nbytes for n, x in b.items() if n.startswith("teacher_"))
    out.append(dict(mode=mode if mode != "topk" else f"top-{k}", per_token=bytes_per_token(mode, v, k),
                    step_cache=cache_bytes, paper_step=bytes_per_token(mode, v, k) * 128 * 4 * 512,
                    temp=temp, t_cache=t_cache, t_step=t_step))
  return out


def human(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024:
      return f"{n:.1f} {unit}"
    n /= 1024
  return f"{n:.1f} PiB"


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--workdir", default="/tmp/dgr2_demo", help="a finished demo workdir ('' = skip part 1)")
  ap.add_argument("--prompts", type=int, default=64)
  ap.add_argument("--rows", type=int, default=8, help="rollouts of the Qwen3-vocabulary step")
  ap.add_argument("--prompt_len", type=int, default=256)
  a = ap.parse_args()
  if a.workdir and os.path.isdir(os.path.join(a.workdir, "opd", "model")):
    rows = demo_accuracy(a.workdir, a.prompts)
    print(f"\nAccuracy on {rows[0]['tokens']} held-out tokens of the demo ({a.workdir}, OPD student, AR teacher):")
    print("| teacher side | OPD loss (KL) | rel. error | worst token error | gradient rel. error "
          "| bytes/token (demo V) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
      print(f"| {r['mode']} | {r['kl']:.5f} | {r['rel']:.2%} | {r['worst']:.4f} | {r['grad_rel']:.2%} "
            f"| {r['bytes']:,} |")
  else:
    print(f"(no finished demo workdir at {a.workdir!r}: accuracy part skipped)")
  cost = qwen3_cost(a.rows, 512, a.prompt_len)
  print(f"\nCost at Qwen3's vocabulary (V = {QWEN3_V:,}; {a.rows} rollouts x 512 tokens, "
        f"prompt {a.prompt_len}, "
        f"2-layer 32-wide model, {jax.devices()[0].platform}):")
  print("| teacher side | bytes/token | cache of this step | cache of a paper step (128 x 4 x 512) "
        "| step temp memory | "
        "cache build s | step s |")
  print("|---|---|---|---|---|---|---|")
  for r in cost:
    print(f"| {r['mode']} | {r['per_token']:,} | {human(r['step_cache'])} | {human(r['paper_step'])} | "
          f"{human(r['temp'])} | {r['t_cache']:.2f} | {r['t_step']:.2f} |")


if __name__ == "__main__":
  main()
