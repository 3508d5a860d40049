"""The `task` and `eval` config sections: their defaults and their checks (`validate`, `validate_eval`)."""

from __future__ import annotations

import os

import ml_collections


def task_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  # Tokenizer directory (a real Qwen3 dir or a model dir). '' => the traces stage builds the
  # demo BPE tokenizer into workdir/traces/tokenizer (see dgr2_jax.stages.traces.tokenizer_dir).
  c.tokenizer = ""
  c.demo_vocab_size = 2048  # size of the demo BPE tokenizer built when task.tokenizer=''
  c.enable_thinking = True       # passed to the chat template (Qwen3: response starts <think>)
  c.prompt_variant = "compact"   # 'compact' (CPU) | 'full' (~2200 Qwen3 tokens) | 'minimal' (tiny)
  # 'minimal' only: each candidate line ends with its relation to the last purchase, e.g.
  # '(same brand)' (task/prompts.py relation_mark)
  c.mark_relations = False
  # 'minimal' only: each candidate's mark leads with how often other users bought it right after
  # this user's last purchase, e.g. '(often bought next)' (task/copurchase.py)
  c.mark_copurchase = False
  c.short_title_words = 6        # compact variant title length
  c.max_history = 20             # most recent history items rendered (0 = all)
  c.num_candidates = 10  # candidates shown in the prompt
  # train only, when the retriever missed the target: 'none' (drop the user) | 'replace_last' |
  # 'random_position' (uniform) | 'matched' (where the retriever puts targets on validation)
  c.insert_target = "none"
  c.shuffle_train = False        # train only: candidates in a random order (see task/traces.py)
  c.rationale_tokens = 130       # built-in rationale length target, in tokens of the tokenizer
  c.rationale_style = "full"     # 'full' (sentences, length ~ rationale_tokens) | 'terse' (3 sentences)
  c.rationale_knows_target = True  # built-in rationale may rank the label first (False: a label-free rule)
  # Label-free first pick of the built-in rationale: 'rule' (the rationale style's own) | 'fit'
  # (task/policy.py: which relations to the last purchase may move a candidate above the
  # retriever's #1, and how far down, chosen on the training lists; traces/policy.json)
  c.trace_policy = "rule"
  c.reject_demoting = False      # train only: drop traces whose ranking puts the target lower than the retriever did
  c.answer_ids = "sid"           # 'sid' (paper) | 'number': `#k` numbers (see task/answer.py)
  c.traces_path = ""             # external teacher JSONL; '' => built-in rationale generator
  c.accept = "top1"              # teacher trace rejection rule: 'top1' | 'promote'
  c.splits = ("train", "valid")  # splits the traces stage writes
  c.max_examples = 0             # per split, 0 = all (small demos)
  c.prompt_len = 512             # static P (history truncated from the oldest side)
  c.response_len = 256           # static R
  c.too_long_response = "drop"   # 'drop' | 'truncate_reasoning'
  # > 0: newline fillers after </think> so the answer starts a new block of this size
  # (task/pipeline.py: the answer block is denoised with the reasoning committed); 0 = none
  c.answer_block = 0
  c.seed = 0  # seed of the trace building (shuffles, insertions)
  return c


def eval_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model_dir = ""  # model to evaluate (required for stage='eval'; the pipeline sets it per ladder row)
  c.split = "test"  # 'train' | 'valid' | 'test'
  c.output_dir = ""              # '' => workdir/eval/<name>
  c.name = ""                    # '' => '<split>-<hash of eval+decode config>'
  c.batch_size = 8               # static; the last batch is padded
  c.max_examples = 0             # 0 = the whole split
  return c


SPLITS = ("train", "valid", "test")
INSERT_TARGET = ("none", "replace_last", "random_position", "matched")
TRACE_POLICIES = ("rule", "fit")
TOO_LONG = ("drop", "truncate_reasoning")
ACCEPT = ("top1", "promote")
# Stages that read the tokenizer.
_TOKENIZER_STAGES = {"traces", "sft", "eval", "bench", "pipeline"}


def validate(config, runs: set) -> None:
  """Checks `task` (paths only for the stages in `runs`)."""
  from dgr2_jax import checks
  from dgr2_jax.task import answer, prompts, rationale
  c = config
  if "task" not in c:
    return
  t = c.task
  checks.one_of(c, "task", "prompt_variant", prompts.VARIANTS)
  checks.one_of(c, "task", "rationale_style", rationale.STYLES)
  checks.one_of(c, "task", "answer_ids", answer.ANSWER_IDS)
  if t.mark_relations and t.prompt_variant != "minimal":
    checks.fail("task.mark_relations", f"needs task.prompt_variant='minimal' (got {t.prompt_variant!r})")
  if t.get("mark_copurchase", False) and t.prompt_variant != "minimal":
    checks.fail("task.mark_copurchase", f"needs task.prompt_variant='minimal' (got {t.prompt_variant!r})")
  if t.answer_ids == "number" and t.prompt_variant != "minimal":
    checks.fail("task.answer_ids", f"'number' needs task.prompt_variant='minimal' (the "
                f"{t.prompt_variant!r} prompt's instructions ask for SIDs)")
  checks.one_of(c, "task", "insert_target", INSERT_TARGET)
  checks.one_of(c, "task", "trace_policy", TRACE_POLICIES)
  if t.trace_policy == "fit" and t.rationale_knows_target:
    checks.fail("task.trace_policy", "'fit' chooses a label-free first pick: needs "
                "task.rationale_knows_target=False")
  checks.one_of(c, "task", "too_long_response", TOO_LONG)
  checks.one_of(c, "task", "accept", ACCEPT)
  for f in ("prompt_len", "response_len", "num_candidates", "demo_vocab_size"):
    checks.positive_int(c, "task", f)
  ab = t.get("answer_block", 0)
  if not isinstance(ab, int) or ab < 0 or (ab and t.response_len % ab):
    checks.fail("task.answer_block", f"must be 0 or a block size that divides task.response_len "
                f"({t.response_len}), got {ab!r}")
  for s in t.splits:
    if s not in SPLITS:
      checks.fail("task.splits", f"{s!r} is not a split; known: {list(SPLITS)}")
  if t.tokenizer and runs & _TOKENIZER_STAGES:
    checks.is_dir("task.tokenizer", t.tokenizer, "tokenizer directory")
  if t.traces_path and "traces" in runs:
    checks.is_file("task.traces_path", t.traces_path, "teacher traces file")


def validate_eval(config, runs: set) -> None:
  """Checks `eval`; `eval.model_dir` is required when the eval stage runs alone."""
  from dgr2_jax import checks
  c = config
  if "eval" not in c:
    return
  checks.one_of(c, "eval", "split", SPLITS)
  checks.positive_int(c, "eval", "batch_size")
  if c.eval.output_dir and os.path.isfile(c.eval.output_dir):
    checks.fail("eval.output_dir", f"{c.eval.output_dir!r} is a file; give a directory (created if missing)")
  if c.get("stage") == "eval":
    if not c.eval.model_dir:
      checks.fail("eval.model_dir", "is required for config.stage='eval'")
    checks.model_dir("eval.model_dir", c.eval.model_dir)
