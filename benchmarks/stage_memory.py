"""Every stage of the real-checkpoint path at Qwen3's vocabulary: peak memory per stage, measured.

  python benchmarks/stage_memory.py --data_dir=../shared/data/amazon_beauty --workdir=/tmp/stage_memory

The README's real path, on this machine, with a random Qwen3 that is real where memory is
decided (vocabulary 151,936 + the SID and mask tokens the conversion tool adds, the presets'
lengths: prompt slots 2,560 for ~2,200-token prompts, responses of 512, blocks of 32) and tiny
elsewhere (2 layers, 32 wide):
  1. a random Qwen3 HF directory at vocabulary 151,936 (`random_qwen3_dir`: weights from our
     init, a byte-level BPE tokenizer trained on the dataset's item texts);
  2. the `data` and `sids` stages of `configs/beauty_qwen3_0p6b.py`, then
     `tools/convert_hf_to_flax.py --add_tokens=<workdir>/sids/tokens.txt --mask_token='<|mask|>'`;
  3. every other stage of the preset, each in its own process (so each peak is its own): OPD at
     8 prompts x 4 rollouts per step, RL and the teacher's RL at 4 x 8, `--steps` optimizer steps
     per training stage; `eval` is the ladder's heaviest row (the final model drafting for the AR
     teacher: both models and both KV caches), `bench` the frontier, on `--eval_examples` test
     users.
Per stage: the process's peak RSS (`ru_maxrss` of the child), its wall-clock, and beside it the
plan of `dgr2_jax/train/memory_plan.py` (what the dry run prints for the GPU presets:
activations + logits + teacher cache + rollout decode) plus params/optimizer and the measured
RSS of a process that only imports the stack. `--device` also reports JAX's device peak
(`memory_stats()`) when the backend has one (GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
PRESET = os.path.join(REPO, "configs", "beauty_qwen3_0p6b.py")
QWEN3_VOCAB = 151_936
STAGES = ("retriever", "traces", "sft", "teacher_rl", "convert", "cft", "opd", "rl", "eval", "bench")


def random_qwen3_dir(out: str, items_file: str | None, vocab_size: int = QWEN3_VOCAB, hidden: int = 32,
                     layers: int = 2, bpe_vocab: int = 8192) -> str:
  """A random Qwen3 HF directory: our init at `vocab_size` rows, a byte-level BPE tokenizer of
  `bpe_vocab` entries trained on `items_file`'s texts (the task's synthetic items without one)."""
  if os.path.exists(os.path.join(out, "config.json")):
    return out
  import jax
  from dgr2_jax.model import checkpoint, qwen3
  from dgr2_jax.model.config import Qwen3Config
  from dgr2_jax.task import tokenizer as tok_lib
  if items_file and os.path.exists(items_file):
    with open(items_file) as f:
      items = [json.loads(line) for line in f if line.strip()]
  else:
    from dgr2_jax.data import synthetic
    items = synthetic.generate(synthetic.SyntheticConfig(num_users=100, num_items=300)).items
  tok_dir = out + ".tokenizer"
  tok_lib.build_demo_tokenizer(tok_lib.demo_corpus(items), (), tok_dir, vocab_size=bpe_vocab)
  tok = tok_lib.load_tokenizer(tok_dir)
  ids = tok_lib.token_ids(tok)
  cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                    tie_word_embeddings=True, eos_token_id=ids.eos_id, pad_token_id=ids.pad_id,
                    max_position_embeddings=40960)
  params = jax.tree_util.tree_map(lambda x: jax.device_get(x), qwen3.init_params(cfg, jax.random.PRNGKey(0)))
  checkpoint.save_hf_dir(out, cfg, params, tokenizer_src=tok_dir)
  return out


def run_measured(cmd: list[str], env: dict, log) -> tuple[int, float, int]:
  """(return code, seconds, peak RSS bytes of the child)."""
  wrapper = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]).returncode; "
             "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, flush=True); "
             "sys.exit(r)")
  t0 = time.perf_counter()
  proc = subprocess.run([sys.executable, "-c", wrapper, *cmd], cwd=REPO, env=env, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True)
  dt = time.perf_counter() - t0
  log.write(" ".join(cmd) + "\n" + proc.stdout + "\n")
  log.flush()
  kb = [int(l.split()[1]) for l in proc.stdout.splitlines() if l.startswith("PEAK_RSS_KB")]
  return proc.returncode, dt, (kb[-1] * 1024 if kb else 0)


def preset_overrides(args, model_dir: str) -> dict:
  """The overridden preset fields of this run (README: the Done-when of issue #15)."""
  o = {"data.dir": args.data_dir, "model.init_from": model_dir, "retriever.num_epochs": args.retriever_epochs,
       "train.total_steps": args.steps, "train.checkpoint_every": args.steps, "cft.epochs": 0, "cft.steps": args.steps,
       "opd.prompts_per_step": 8, "opd.rollouts_per_prompt": 4, "opd.steps": args.steps,
       "decode.max_new_tokens": 512, "eval.max_examples": args.eval_examples,
       "bench.max_examples": args.eval_examples, "bench.thresholds": (0.9,),
       "train.mesh.data": 1, "hardware.num_devices": 1, "hardware.device_memory_gb": 0.0}
  for sec, g in (("rl", 8), ("teacher_rl", 8)):
    o.update({f"{sec}.prompts_per_step": 4, f"{sec}.group_size": g, f"{sec}.steps": args.steps})
  for sec in ("opd", "rl", "teacher_rl"):  # the whole step's rollouts in one decode and one update
    o.update({f"{sec}.rollout_batch_size": 0, f"{sec}.grad_accum_steps": 1})
  if args.train_batch:
    o["train.batch_size"] = args.train_batch
  return o


def flags_of(overrides: dict) -> list[str]:
  return [f"--config.{k}={v}" for k, v in overrides.items()]


def planned(model_dir: str, overrides: dict) -> dict:
  """memory_plan terms per training stage for the overridden preset on one device."""
  import importlib.util
  from dgr2_jax.model import checkpoint, qwen3
  from dgr2_jax.train import memory_plan
  spec = importlib.util.spec_from_file_location("preset", PRESET)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config()
  with c.unlocked():
    c.update_from_flattened_dict(overrides)
  mc = checkpoint.load_model_dir(model_dir)[0].with_runtime(c.model)
  base = 16 * qwen3.count_params(qwen3.param_shapes(mc))  # f32 params + Adam moments + gradients
  return {st: dict(plan=base + max(row["total"], row["decode"]), **row)
          for st in memory_plan.TRAIN_STAGES for row in [memory_plan.plan_stage(c, mc, st, (1, 1, 1))]}


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--data_dir", default=os.path.join(REPO, "..", "shared", "data", "amazon_beauty"))
  ap.add_argument("--workdir", default="/tmp/dgr2_stage_memory")
  ap.add_argument("--steps", type=int, default=2, help="optimizer steps per training stage")
  ap.add_argument("--train_batch", type=int, default=0, help="SFT/CFT batch (0 = the preset's 64)")
  ap.add_argument("--eval_examples", type=int, default=32)
  ap.add_argument("--retriever_epochs", type=int, default=2)
  ap.add_argument("--stages", default=",".join(STAGES))
  a = ap.parse_args()
  os.makedirs(a.workdir, exist_ok=True)
  env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"), HF_HUB_OFFLINE="1",
             TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
  log = open(os.path.join(a.workdir, "stage_memory.log"), "a")
  hf = random_qwen3_dir(os.path.join(a.workdir, "random_qwen3_hf"), os.path.join(a.data_dir, "items.jsonl"))
  model = os.path.join(a.workdir, "random_qwen3_sids")
  wd = os.path.join(a.workdir, "work")
  main = [sys.executable, "-m", "dgr2_jax.main", f"--config={PRESET}", f"--workdir={wd}"]
  rows = []
  rc, dt, rss = run_measured([sys.executable, "-c", "import jax, transformers, orbax.checkpoint, "
                              "dgr2_jax.main; jax.numpy.zeros(1).block_until_ready()"], env, log)
  rows.append(("(imports only)", rss, dt, None))
  for stage in ("data", "sids"):
    rc, dt, rss = run_measured(main + [f"--config.stage={stage}", f"--config.data.dir={a.data_dir}"], env, log)
    rows.append((stage, rss, dt, None))
    if rc:
      sys.exit(f"stage {stage} failed (see {log.name})")
  if not os.path.exists(os.path.join(model, "config.json")):
    rc, dt, rss = run_measured([sys.executable, "tools/convert_hf_to_flax.py", f"--hf_dir={hf}", f"--flax_dir={model}",
                                f"--add_tokens={wd}/sids/tokens.txt", "--mask_token=<|mask|>"], env, log)
    rows.append(("convert_hf_to_flax", rss, dt, None))
    if rc:
      sys.exit(f"conversion failed (see {log.name})")
  over = preset_overrides(a, model)
  plan = planned(model, over)
  over = flags_of(over)
  for stage in a.stages.split(","):
    cmd = main + [f"--config.stage={stage}"] + over
    if stage == "eval":  # the ladder's heaviest row: the final model drafting for the AR teacher
      cmd += [f"--config.eval.model_dir={wd}/rl/model", "--config.decode.mode=speculative"]
    rc, dt, rss = run_measured(cmd, env, log)
    rows.append((stage, rss, dt, plan.get(stage)))
    print(f"{stage}: peak RSS {rss / 2**30:.2f} GiB, {dt:.0f} s" + ("" if rc == 0 else "  FAILED"), flush=True)
    if rc:
      sys.exit(f"stage {stage} failed (see {log.name})")
  from dgr2_jax.model import checkpoint
  mc = checkpoint.load_model_dir(model)[0]
  print(f"\nStage memory, vocabulary {mc.vocab_size:,} ({mc.num_hidden_layers} layers, hidden {mc.hidden_size}), "
        f"prompt slots 2560, response 512, block 32; OPD 8 x 4, RL / teacher RL 4 x 8 rollouts:")
  print("| stage | peak RSS | wall s | plan (params/opt + activations + logits + cache + decode) | "
        "logits chunk (positions) |")
  print("|---|---|---|---|---|")
  for name, rss, dt, p in rows:
    ptxt = (f"{p['plan'] / 2**30:.2f} GiB = {p['activations'] / 2**20:.0f} + {p['logits'] / 2**20:.0f} + "
            f"{p['teacher_cache'] / 2**20:.0f} + {p['decode'] / 2**20:.0f} MiB") if p else ""
    print(f"| {name} | {rss / 2**30:.2f} GiB | {dt:.0f} | {ptxt} | {p['logits_chunk'] if p else ''} |")
  print(f"\npeak RSS of the whole path: {max(r[1] for r in rows) / 2**30:.2f} GiB (log: {log.name})")


if __name__ == "__main__":
  main()
