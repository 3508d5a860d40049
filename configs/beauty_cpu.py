"""Real Amazon Beauty on CPU with a tiny random Qwen3 (plumbing check on real data, not accuracy).

  python -m dgr2_jax.main --config=configs/beauty_cpu.py --config.data.dir=PATH/amazon_beauty \
      --workdir=/tmp/dgr2_beauty_cpu

Same variants as demo.py after ':'.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import base  # pylint: disable=g-import-not-at-top


def get_config(arg: str = ""):
  c = base.get_config()
  c.data.source = "beauty"
  c.data.dir = ""  # required: --config.data.dir
  c.sids.encoder = "minilm"
  c.sids.num_steps = 1000
  c.retriever.num_epochs = 50
  c.task.demo_vocab_size = 4096
  c.task.max_examples = 2000
  c.task.prompt_len = 768
  c.task.response_len = 256
  c.train.total_steps = 500
  c.train.batch_size = 8
  c.eval.max_examples = 256
  c.eval.batch_size = 16
  c.cft.epochs = 1
  c.opd.prompts_per_step = 16
  c.rl.steps = 20
  c.bench.block_sizes = (c.cft.block_size,)
  c.bench.max_examples = 64
  return base.apply_variants(c, arg)
