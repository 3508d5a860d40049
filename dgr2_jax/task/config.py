"""Defaults of the `task` and `eval` config sections."""

from __future__ import annotations

import ml_collections


def task_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  # Tokenizer directory (a real Qwen3 dir or a model dir). '' => the traces stage builds the
  # demo BPE tokenizer into workdir/traces/tokenizer (see dgr2_jax.stages.traces.tokenizer_dir).
  c.tokenizer = ""
  c.demo_vocab_size = 2048
  c.enable_thinking = True       # passed to the chat template (Qwen3: response starts <think>)
  c.prompt_variant = "compact"   # 'compact' (CPU) | 'full' (~2200 Qwen3 tokens) | 'minimal' (tiny)
  c.short_title_words = 6        # compact variant title length
  c.max_history = 20             # most recent history items rendered (0 = all)
  c.num_candidates = 10
  c.insert_target = "none"       # train only: 'none' | 'replace_last' | 'random_position'
  c.shuffle_train = False        # train only: candidates in a random order (see task/traces.py)
  c.rationale_tokens = 130       # built-in rationale length target, in tokens of the tokenizer
  c.rationale_style = "full"     # 'full' (sentences, length ~ rationale_tokens) | 'terse' (3 sentences)
  c.rationale_knows_target = True
  c.answer_ids = "sid"           # 'sid' (paper) | 'number': `#k` numbers (see task/answer.py)
  c.traces_path = ""             # external teacher JSONL; '' => built-in rationale generator
  c.accept = "top1"              # teacher trace rejection rule: 'top1' | 'promote'
  c.splits = ("train", "valid")  # splits the traces stage writes
  c.max_examples = 0             # per split, 0 = all (small demos)
  c.prompt_len = 512             # static P (history truncated from the oldest side)
  c.response_len = 256           # static R
  c.too_long_response = "drop"   # 'drop' | 'truncate_reasoning'
  c.seed = 0
  return c


def eval_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model_dir = ""
  c.split = "test"
  c.output_dir = ""              # '' => workdir/eval/<name>
  c.name = ""                    # '' => '<split>-<hash of eval+decode config>'
  c.batch_size = 8               # static; the last batch is padded
  c.max_examples = 0             # 0 = the whole split
  return c
