"""Amazon Beauty with a real Qwen3-0.6B checkpoint and the paper's hyper-parameters, 8 GPUs.

  python -m dgr2_jax.main --config=configs/beauty_qwen3_0p6b.py \
      --config.data.dir=PATH/amazon_beauty --config.model.init_from=PATH/qwen3-0.6b-sids \
      --workdir=/scratch/dgr2_0p6b

`model.init_from` is our model dir made by `tools/convert_hf_to_flax.py --add_tokens
workdir/sids/tokens.txt --mask_token '<|mask|>'` (or an HF dir that already holds the SID and
mask tokens); the tokenizer follows it (task.tokenizer is a reference to model.init_from).
Paper settings: block size 32, CFT 3 epochs, OPD G'=4 / lr 1e-6 / 128 prompts per step, RL G=8 /
lr 5e-7 / 600 steps / alpha 0.2 / clip 0.2, and the teacher's own RL (teacher_rl) with RL's
reward and G. The paper's "64 denoising steps" eval budget is
`decode.steps_per_block = 8` (configs/base.py explains the mapping), with tau 0.9.
Same ablation variants as demo.py after ':'.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import base  # pylint: disable=g-import-not-at-top


def paper_config(arg: str, *, fsdp: int, batch_size: int, grad_accum: int, on_policy_accum: dict):
  c = base.get_config()
  c.data.source = "beauty"
  c.data.dir = ""  # required: --config.data.dir
  c.sids.encoder = "minilm"
  c.model.init_from = ""  # required: --config.model.init_from
  c.task.tokenizer = c.model.get_ref("init_from")
  c.task.prompt_variant = "full"
  c.task.prompt_len = 2560
  c.task.response_len = 512
  c.model.dtype = "bfloat16"
  c.model.param_dtype = "bfloat16"
  c.model.remat = True
  # One scanned layer over the stacked params: rematerialisation then holds one layer's activations
  # at a time (an unrolled stack keeps every layer's recomputed set: XLA runs them all ahead of the
  # backward), and the step compiles in the same time at any depth (docs/training.md).
  c.model.scan_layers = True
  c.model.attention_impl = "auto"   # GPUs: split-key decode kernel + cuDNN; TPUs: splash / Pallas TPU; else blockwise
  c.train.param_dtype = "float32"
  c.train.batch_size = batch_size
  c.train.grad_accum_steps = grad_accum
  c.train.total_steps = 2000
  c.train.optimizer.peak_lr = 1e-5
  c.train.optimizer.warmup_steps = 100
  c.train.checkpoint_every = 200
  c.train.mesh.data = -1
  c.train.mesh.fsdp = fsdp
  c.train.mesh.tensor = 1
  c.decode.block_size = 32
  c.decode.threshold = 0.9
  c.decode.max_new_tokens = 512
  c.cft.epochs = 3
  c.cft.block_size = 32
  c.opd.rollouts_per_prompt = 4
  c.opd.lr = 1e-6
  c.opd.prompts_per_step = 128
  # The teacher scored exactly inside the step (no cache: docs/memory.md, benchmarks/teacher_cache.py),
  # rollouts decoded 64 rows (8 per GPU) at a time, and the 512 rollouts of a step accumulated in
  # micro-batches (launch/dry_run.py prints what each stage holds per device).
  c.opd.teacher_cache = "none"
  for sec in (c.opd, c.rl, c.teacher_rl):
    sec.rollout_batch_size = 64
  c.opd.grad_accum_steps = on_policy_accum["opd"]
  c.rl.grad_accum_steps = c.teacher_rl.grad_accum_steps = on_policy_accum["rl"]
  c.rl.group_size = 8
  c.rl.lr = 5e-7
  c.rl.steps = 600
  c.rl.alpha = 0.2
  c.rl.clip_eps = 0.2
  c.rl.clip_eps_high = 0.2
  # The GR2 teacher's own RL stage (paper: DAPO on the SFT model, same reward and G).
  c.teacher_rl.group_size = 8
  c.teacher_rl.alpha = 0.2
  c.teacher_rl.lr = 5e-7
  c.teacher_rl.steps = 600
  c.eval.batch_size = 32
  c.bench.thresholds = (1.0, 0.9, 0.6, 0.4)
  c.bench.block_sizes = (32,)
  c.bench.timing_batches = 8   # metrics over the whole split, speed over 8 batches per row
  c.hardware.num_devices = 8
  c.hardware.device_memory_gb = 80.0
  return base.apply_variants(c, arg)


def get_config(arg: str = ""):
  c = paper_config(arg, fsdp=1, batch_size=64, grad_accum=1, on_policy_accum={"opd": 4, "rl": 1})
  # Qwen3-0.6B (config.json of Qwen/Qwen3-0.6B); ignored when model.init_from is set.
  c.model.vocab_size = 151936
  c.model.hidden_size = 1024
  c.model.intermediate_size = 3072
  c.model.num_hidden_layers = 28
  c.model.num_attention_heads = 16
  c.model.num_key_value_heads = 8
  c.model.head_dim = 128
  c.model.tie_word_embeddings = True
  c.model.max_position_embeddings = 40960
  return c
