"""Embedded demo: synthetic data, hash SIDs, tiny Qwen3, the whole pipeline on 2 CPU cores.

  python -m dgr2_jax.main --config=configs/demo.py --workdir=/tmp/dgr2_demo
  python -m dgr2_jax.main --config=configs/demo.py:no_cft,block8 --workdir=/tmp/dgr2_demo_ablation

Variants after ':' (comma-separated, see configs/base.py VARIANTS): no_cft, cft_only, opd_no_rl,
rl_no_opd, weight_none, complementary, block4/8/16/32/64.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import base  # pylint: disable=g-import-not-at-top


def get_config(arg: str = ""):
  c = base.get_config()
  c.data.source = "synthetic"
  c.data.synthetic.num_users = 800
  c.data.synthetic.num_items = 120
  c.sids.encoder = "hash"
  c.sids.codebook_size = 16
  c.sids.latent_dim = 16
  c.sids.hidden_dims = (64, 32)
  c.sids.batch_size = 128
  c.sids.num_steps = 300
  # A stronger synthetic retriever (test R@10 ~0.8 vs ~0.2 for popularity, ~100 s on CPU).
  c.retriever.hidden = 32
  c.retriever.batch_size = 32
  c.retriever.dropout = 0.2
  c.retriever.learning_rate = 3e-3
  c.retriever.num_epochs = 40
  c.retriever.eval_every = 5
  c.task.demo_vocab_size = 1024
  # Train on every user (the target is inserted among the candidates when the retriever missed it).
  c.task.insert_target = "random_position"
  # Short prompts and rationales for CPU: <= 4 history items, 2-word titles; ~90 reasoning tokens.
  c.task.max_history = 4
  c.task.short_title_words = 2
  c.task.rationale_tokens = 24
  c.task.prompt_len = 352
  c.task.response_len = 160
  c.model.hidden_size = 64
  c.model.intermediate_size = 192
  c.model.num_hidden_layers = 3
  c.model.head_dim = 16
  c.train.total_steps = 300
  c.train.batch_size = 16
  c.train.checkpoint_every = 100
  c.train.optimizer.peak_lr = 3e-3
  c.train.optimizer.warmup_steps = 20
  c.decode.max_new_tokens = 160
  c.eval.max_examples = 64
  c.eval.batch_size = 16
  c.cft.epochs = 0
  c.cft.steps = 100
  c.opd.prompts_per_step = 4
  c.opd.rollouts_per_prompt = 4
  c.opd.steps = 8
  c.opd.lr = 1e-4
  c.opd.replay_max_segments = 4
  c.rl.steps = 8
  c.rl.group_size = 4
  c.rl.prompts_per_step = 4
  c.rl.lr = 1e-5
  c.rl.replay_max_segments = 4
  c.bench.block_sizes = (c.cft.block_size,)
  c.bench.max_examples = 32
  return base.apply_variants(c, arg)
