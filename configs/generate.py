"""The `generate` stage: decode prompts from a JSONL file with any model directory.

  python -m dgr2_jax.main --config=configs/generate.py --config.model_dir=DIR \
      --config.input=prompts.jsonl --config.output=out.jsonl --config.decode.block_size=1 \
      --config.decode.threshold=1.0 --config.decode.max_new_tokens=64 --config.decode.temperature=0.0

Input lines: {"prompt_ids": [...]} | {"prompt": "text"} | {"messages": [{"role":..,"content":..}]}.
Output lines (same order): {"output_ids", "text", "nfe", "commit_step", "logprob"}.
No workdir is needed.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dgr2_jax.decode import config as decode_config  # pylint: disable=g-import-not-at-top


def get_config(arg: str = ""):
  del arg
  import ml_collections  # pylint: disable=g-import-not-at-top
  c = ml_collections.ConfigDict()
  c.stage = "generate"
  c.seed = 0
  c.dry_run = False
  c.model_dir = ""          # HF directory or ours (dgr2_jax.model.checkpoint.load_model_dir)
  c.input = ""              # JSONL of prompts
  c.output = ""             # JSONL written atomically
  c.batch_size = 8          # static; the last batch is padded with a copy of a real prompt
  c.max_prompt_len = 0      # static prompt slots; 0 => longest prompt rounded up to 64
  c.enable_thinking = True  # chat template flag for {"messages": ...} lines
  c.decode = decode_config.decode_config()
  c.decode.max_new_tokens = 64
  return c
