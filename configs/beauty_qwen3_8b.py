"""Amazon Beauty with a real Qwen3-8B checkpoint and the paper's hyper-parameters, 8 x 80 GB GPUs.

  python -m dgr2_jax.main --config=configs/beauty_qwen3_8b.py \
      --config.data.dir=PATH/amazon_beauty --config.model.init_from=PATH/qwen3-8b-sids \
      --workdir=/scratch/dgr2_8b
  python launch/dry_run.py --config=configs/beauty_qwen3_8b.py   # mesh + per-device memory plan

As beauty_qwen3_0p6b.py, with the parameters and optimizer state fully sharded over the 8 devices
(FSDP 8) and gradient accumulation (SFT/CFT 4 micro-batches per step; OPD 16 over its 512
rollouts, RL 4 over its 128: 4 rollouts per GPU at a time). The dry run without
`model.init_from` plans for the Qwen3-8B architecture below.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import beauty_qwen3_0p6b  # pylint: disable=g-import-not-at-top


def get_config(arg: str = ""):
  c = beauty_qwen3_0p6b.paper_config(arg, fsdp=8, batch_size=64, grad_accum=4,
                                     on_policy_accum={"opd": 16, "rl": 4})
  # Qwen3-8B (config.json of Qwen/Qwen3-8B); ignored when model.init_from is set.
  c.model.vocab_size = 151936
  c.model.hidden_size = 4096
  c.model.intermediate_size = 12288
  c.model.num_hidden_layers = 36
  c.model.num_attention_heads = 32
  c.model.num_key_value_heads = 8
  c.model.head_dim = 128
  c.model.tie_word_embeddings = False
  c.model.max_position_embeddings = 40960
  c.model.rope_theta = 1_000_000.0
  return c
