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
  c.data.synthetic.num_users = 200
  c.data.synthetic.num_items = 100
  c.sids.encoder = "hash"
  c.sids.codebook_size = 16
  c.sids.latent_dim = 16
  c.sids.hidden_dims = (64, 32)
  c.sids.batch_size = 128
  c.sids.num_steps = 300
  c.retriever.hidden = 32
  c.retriever.num_epochs = 20
  c.task.demo_vocab_size = 1024
  # Train on every user (the target is inserted among the candidates when the retriever missed
  # it): the synthetic retriever hits only ~20% of targets, too few examples otherwise.
  c.task.insert_target = "random_position"
  c.task.prompt_len = 640
  c.task.response_len = 256
  c.train.total_steps = 150
  c.train.batch_size = 8
  c.train.checkpoint_every = 50
  c.train.optimizer.peak_lr = 1e-3
  c.decode.max_new_tokens = 256
  c.eval.max_examples = 32
  c.eval.batch_size = 8
  c.cft.epochs = 1
  c.opd.prompts_per_step = 4
  c.opd.steps = 10
  c.opd.lr = 1e-4
  c.rl.steps = 10
  c.rl.group_size = 4
  c.rl.prompts_per_step = 2
  c.rl.lr = 1e-5
  c.bench.block_sizes = (c.cft.block_size,)
  c.bench.max_examples = 16
  return base.apply_variants(c, arg)
