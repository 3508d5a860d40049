"""Command-line entry point: one config file, one stage (or the whole pipeline), one workdir.

  python -m dgr2_jax.main --config=configs/demo.py --workdir=/tmp/dgr2_demo
  python -m dgr2_jax.main --config=configs/demo.py:no_cft --config.stage=eval \
      --config.eval.model_dir=/tmp/dgr2_demo/cft/model --workdir=/tmp/dgr2_demo
  python -m dgr2_jax.main --config=configs/beauty_qwen3_8b.py --config.dry_run=True

Every config field can be overridden with `--config.a.b=value`. `config.stage` picks the entry
point from `STAGES`; each stage module is imported only when it runs, so a missing optional stage
does not break the others. `validate` checks the config before any work and names the field of
the first problem it finds. `--config.dry_run=True` prints the mesh and per-device memory plan
(launch/dry_run.py) and exits without allocating anything. Library logs (Orbax, TFDS) are kept
at WARNING; `--verbosity=0` shows their INFO lines too.
"""

from __future__ import annotations

import importlib.util
import os
import sys

# Task vocabularies come from their (stdlib-only) modules; stage modules stay lazy.
from dgr2_jax.task import answer as answer_lib
from dgr2_jax.task import prompts as prompts_lib
from dgr2_jax.task import rationale as rationale_lib

# The stage registry (name -> module with `run(config, workdir)`, imported when it runs) lives with
# the pipeline that chains the stages; main validates and dispatches.
from dgr2_jax.stages.pipeline import NO_WORKDIR, ORDER, STAGES, check_available, stage_fn  # noqa: E402,F401

DATA_SOURCES = ("beauty", "synthetic")
DATA_FORMATS = ("auto", "tsv", "mcauley")
SID_ENCODERS = ("minilm", "npy", "hash")
RETRIEVER_SOURCES = ("sasrec", "file")
SPLITS = ("train", "valid", "test")
INSERT_TARGET = ("none", "replace_last", "random_position")
TOO_LONG = ("drop", "truncate_reasoning")
ACCEPT = ("top1", "promote")
LOSS_WEIGHTINGS = ("1/t", "none")  # dgr2_jax.train.cft.WEIGHTINGS
OPD_TEACHERS = ("ar", "self_tau1")  # dgr2_jax.train.opd.TEACHERS
OPD_STUDENT_CONTEXTS = ("prefix", "replay")  # dgr2_jax.train.opd.STUDENT_CONTEXTS
OPD_TEACHER_CACHES = ("full", "none", "topk")  # dgr2_jax.train.opd.TEACHER_CACHES
DTYPES = ("float32", "bfloat16", "float16")
DECODE_MODES = ("threshold", "speculative")  # dgr2_jax.decode.speculative.MODES
ATTENTION_IMPLS = ("auto", "xla", "blockwise", "cudnn", "splitkey")  # dgr2_jax.model.attention.IMPLS
KV_WRITES = ("auto", "fused", "separate")  # dgr2_jax.decode.sampler.KV_WRITES
SCHEDULES = ("cosine", "constant")


# ---- validation ----------------------------------------------------------------------------------
def _fail(field: str, msg: str):
  raise ValueError(f"config.{field}: {msg}")


def _one_of(c, section: str, field: str, allowed):
  v = c[section][field]
  if v not in allowed:
    _fail(f"{section}.{field}", f"must be one of {list(allowed)}, got {v!r}")


def _positive_int(c, section: str, field: str, minimum: int = 1):
  v = c[section][field]
  if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
    _fail(f"{section}.{field}", f"must be an int >= {minimum}, got {v!r}")


def _exists(path_field: str, path: str, what: str = "path"):
  if not os.path.exists(path):
    raise FileNotFoundError(f"config.{path_field}: {what} {path!r} does not exist")


def _check_decode(d, name: str = "decode"):
  for f in ("block_size", "max_new_tokens"):
    v = d[f]
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      _fail(f"{name}.{f}", f"must be an int >= 1, got {v!r}")
  if d.max_new_tokens % d.block_size:
    _fail(f"{name}.max_new_tokens", f"({d.max_new_tokens}) must be a multiple of "
          f"{name}.block_size ({d.block_size})")
  if not 0.0 < float(d.threshold) <= 1.0:
    _fail(f"{name}.threshold", f"must be in (0, 1], got {d.threshold}")
  if float(d.temperature) < 0:
    _fail(f"{name}.temperature", f"must be >= 0, got {d.temperature}")
  if isinstance(d.top_k, bool) or not isinstance(d.top_k, int) or d.top_k < 0:
    _fail(f"{name}.top_k", f"must be an int >= 0, got {d.top_k!r}")
  if not 0.0 < float(d.top_p) <= 1.0:
    _fail(f"{name}.top_p", f"must be in (0, 1], got {d.top_p}")
  spb = d.get("steps_per_block", 0)
  if isinstance(spb, bool) or not isinstance(spb, int) or spb < 0:
    _fail(f"{name}.steps_per_block", f"must be an int >= 0 (0 = no budget), got {spb!r}")
  if d.get("mode", "threshold") not in DECODE_MODES:
    _fail(f"{name}.mode", f"must be one of {list(DECODE_MODES)}, got {d.mode!r}")
  sps = d.get("steps_per_sync", 8)
  if isinstance(sps, bool) or not isinstance(sps, int) or sps < 1:
    _fail(f"{name}.steps_per_sync", f"must be an int >= 1, got {sps!r}")
  if d.get("kv_write", "auto") not in KV_WRITES:
    _fail(f"{name}.kv_write", f"must be one of {list(KV_WRITES)}, got {d.kv_write!r}")
  if d.get("mode", "threshold") == "speculative":
    if d.block_size < 2:
      _fail(f"{name}.block_size", f"must be >= 2 with {name}.mode='speculative' (the drafter's blocks), got "
            f"{d.block_size}")
    if d.get("verifier_dir", ""):
      _exists(f"{name}.verifier_dir", d.verifier_dir, "verifier model directory")


def _runs(config) -> set:
  """Stages this invocation will run."""
  if config.stage == "pipeline":
    return set(config.pipeline.stages)
  return {config.stage}


def validate(config, workdir: str | None) -> None:
  """Raises ValueError / FileNotFoundError naming the first bad field; does no work."""
  stage = config.get("stage")
  if stage not in STAGES:
    _fail("stage", f"{stage!r} is not a stage; known: {', '.join(STAGES)}")
  if not config.get("dry_run", False) and stage not in NO_WORKDIR and not workdir:
    raise ValueError(f"--workdir is required for config.stage={stage!r}")
  c = config
  # Paths are checked for the stages that will run; a dry run runs none (it reads no data).
  runs = set() if c.get("dry_run", False) else (_runs(c) if "pipeline" in c else {stage})

  if "pipeline" in c:
    stages = tuple(c.pipeline.stages)
    for s in stages:
      if s not in ORDER:
        _fail("pipeline.stages", f"{s!r} is not a pipeline stage; known: {list(ORDER)}")
    if list(stages) != sorted(stages, key=ORDER.index) or len(set(stages)) != len(stages):
      _fail("pipeline.stages", f"must be a subsequence of {list(ORDER)}, got {list(stages)}")

  if "decode" in c:
    _check_decode(c.decode)

  if "data" in c:
    _one_of(c, "data", "source", DATA_SOURCES)
    _one_of(c, "data", "format", DATA_FORMATS)
    _positive_int(c, "data", "min_count")
    if "data" in runs and c.data.source == "beauty":
      if not c.data.dir:
        _fail("data.dir", "is required for data.source='beauty' (the Amazon Beauty folder)")
      _exists("data.dir", c.data.dir, "data folder")

  if "sids" in c:
    _one_of(c, "sids", "encoder", SID_ENCODERS)
    for f in ("num_levels", "codebook_size", "latent_dim", "batch_size", "num_steps"):
      _positive_int(c, "sids", f)
    if "sids" in runs and c.sids.encoder == "npy":
      if not c.sids.embeddings_npy:
        _fail("sids.embeddings_npy", "is required for sids.encoder='npy'")
      _exists("sids.embeddings_npy", c.sids.embeddings_npy, "embeddings file")

  if "retriever" in c:
    _one_of(c, "retriever", "source", RETRIEVER_SOURCES)
    if c.retriever.num_candidates != 10:
      _fail("retriever.num_candidates", f"must be 10 (the task's candidate lists), got "
            f"{c.retriever.num_candidates}")
    if "retriever" in runs and c.retriever.source == "file":
      if not c.retriever.candidates_file:
        _fail("retriever.candidates_file", "is required for retriever.source='file'")
      _exists("retriever.candidates_file", c.retriever.candidates_file, "candidates file")

  if "task" in c:
    t = c.task
    _one_of(c, "task", "prompt_variant", prompts_lib.VARIANTS)
    _one_of(c, "task", "rationale_style", rationale_lib.STYLES)
    _one_of(c, "task", "answer_ids", answer_lib.ANSWER_IDS)
    if t.answer_ids == "number" and t.prompt_variant != "minimal":
      _fail("task.answer_ids", f"'number' needs task.prompt_variant='minimal' (the "
            f"{t.prompt_variant!r} prompt's instructions ask for SIDs)")
    _one_of(c, "task", "insert_target", INSERT_TARGET)
    _one_of(c, "task", "too_long_response", TOO_LONG)
    _one_of(c, "task", "accept", ACCEPT)
    for f in ("prompt_len", "response_len", "num_candidates", "demo_vocab_size"):
      _positive_int(c, "task", f)
    for s in t.splits:
      if s not in SPLITS:
        _fail("task.splits", f"{s!r} is not a split; known: {list(SPLITS)}")
    if t.tokenizer and runs & {"traces", "sft", "eval", "bench", "pipeline"}:
      _exists("task.tokenizer", t.tokenizer, "tokenizer directory")
    if t.traces_path and "traces" in runs:
      _exists("task.traces_path", t.traces_path, "teacher traces file")

  if "cft" in c:
    _positive_int(c, "cft", "block_size")
    _one_of(c, "cft", "loss_weighting", LOSS_WEIGHTINGS)
    if not 0.0 < float(c.cft.eps) < 1.0:
      _fail("cft.eps", f"must be in (0, 1), got {c.cft.eps}")
    if "task" in c and c.task.response_len % c.cft.block_size:
      _fail("task.response_len", f"({c.task.response_len}) must be a multiple of cft.block_size "
            f"({c.cft.block_size})")

  if "model" in c:
    m = c.model
    _one_of(c, "model", "dtype", ("auto",) + DTYPES)
    _one_of(c, "model", "param_dtype", DTYPES)
    if "logits_budget_bytes" in m:
      _positive_int(c, "model", "logits_budget_bytes")
    if "attention_impl" in m:
      _one_of(c, "model", "attention_impl", ATTENTION_IMPLS)
    if "logits_chunk" in m:
      _positive_int(c, "model", "logits_chunk", 0)
    if "attention_k_splits" in m:
      _positive_int(c, "model", "attention_k_splits", 0)
    if m.init_from:
      if runs & {"sft"}:
        _exists("model.init_from", m.init_from, "model directory")
    else:
      for f in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim"):
        _positive_int(c, "model", f)
      _positive_int(c, "model", "vocab_size", 0)
      if m.num_attention_heads % m.num_key_value_heads:
        _fail("model.num_key_value_heads", f"({m.num_key_value_heads}) must divide "
              f"model.num_attention_heads ({m.num_attention_heads})")
      if m.head_dim % 2:
        _fail("model.head_dim", f"must be even (rotary embeddings), got {m.head_dim}")

  if "train" in c:
    tr = c.train
    _positive_int(c, "train", "total_steps")
    _positive_int(c, "train", "batch_size")
    _positive_int(c, "train", "grad_accum_steps")
    if tr.batch_size % tr.grad_accum_steps:
      _fail("train.batch_size", f"({tr.batch_size}) must be divisible by train.grad_accum_steps "
            f"({tr.grad_accum_steps})")
    if tr.param_dtype not in DTYPES:
      _fail("train.param_dtype", f"must be one of {list(DTYPES)}, got {tr.param_dtype!r}")
    if tr.optimizer.schedule not in SCHEDULES:
      _fail("train.optimizer.schedule", f"must be one of {list(SCHEDULES)}, got "
            f"{tr.optimizer.schedule!r}")
    dims = [tr.mesh[a] for a in ("data", "fsdp", "tensor")]
    if sum(d == -1 for d in dims) > 1 or any(d == 0 or d < -1 for d in dims):
      _fail("train.mesh", f"each axis must be >= 1 and at most one -1, got {tr.mesh.to_dict()}")

  for sec in ("teacher_rl", "cft", "opd", "rl"):
    for f in ("init_from", "teacher_dir"):
      if sec in c and c[sec].get(f) and sec in runs:
        _exists(f"{sec}.{f}", c[sec][f], "model directory")
  if "opd" in c:
    _positive_int(c, "opd", "rollouts_per_prompt")
    _positive_int(c, "opd", "prompts_per_step")
    _one_of(c, "opd", "teacher", OPD_TEACHERS)
    if "student_context" in c.opd:
      _one_of(c, "opd", "student_context", OPD_STUDENT_CONTEXTS)
      if c.opd.teacher == "self_tau1" and c.opd.student_context != "replay":
        _fail("opd.student_context", "must be 'replay' with opd.teacher='self_tau1'")
    if float(c.opd.lr) <= 0:
      _fail("opd.lr", f"must be > 0, got {c.opd.lr}")
    if c.opd.get("teacher_cache", "full") not in OPD_TEACHER_CACHES:
      _fail("opd.teacher_cache", f"must be one of {list(OPD_TEACHER_CACHES)}, got {c.opd.teacher_cache!r}")
    if c.opd.get("teacher_cache", "full") == "none" and c.opd.teacher != "ar":
      _fail("opd.teacher_cache", f"'none' scores the AR teacher in the step; teacher {c.opd.teacher!r} needs "
            "'full' or 'topk'")
    for sec in ("opd", "rl"):
      rb = c[sec].get("rollout_batch_size", 0)
      if isinstance(rb, bool) or not isinstance(rb, int) or rb < 0:
        _fail(f"{sec}.rollout_batch_size", f"must be an int >= 0 (0 = all rollouts at once), got {rb!r}")
  for sec in ("teacher_rl", "rl"):
    if sec not in c:
      continue
    _positive_int(c, sec, "group_size", 2)
    _positive_int(c, sec, "steps")
    _positive_int(c, sec, "prompts_per_step")
    if float(c[sec].lr) <= 0:
      _fail(f"{sec}.lr", f"must be > 0, got {c[sec].lr}")
    if not 0.0 <= float(c[sec].alpha) <= 1.0:
      _fail(f"{sec}.alpha", f"must be in [0, 1], got {c[sec].alpha}")
    for f in ("clip_eps", "clip_eps_high"):
      if not 0.0 < float(c[sec][f]) < 1.0:
        _fail(f"{sec}.{f}", f"must be in (0, 1), got {c[sec][f]}")

  if "eval" in c:
    _one_of(c, "eval", "split", SPLITS)
    _positive_int(c, "eval", "batch_size")
    if stage == "eval":
      if not c.eval.model_dir:
        _fail("eval.model_dir", "is required for config.stage='eval'")
      _exists("eval.model_dir", c.eval.model_dir, "model directory")

  if "bench" in c:
    b = c.bench
    if not b.thresholds:
      _fail("bench.thresholds", "must not be empty")
    for tau in b.thresholds:
      if not 0.0 < float(tau) <= 1.0:
        _fail("bench.thresholds", f"every threshold must be in (0, 1], got {tau}")
    for bsz in b.get("batch_sizes", (0,)):
      if isinstance(bsz, bool) or not isinstance(bsz, int) or bsz < 0:
        _fail("bench.batch_sizes", f"every batch size must be an int >= 0 (0 = eval.batch_size), got {bsz!r}")
    rounds = b.get("timing_rounds", 5)
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
      _fail("bench.timing_rounds", f"must be an int >= 1, got {rounds!r}")
    nb = b.get("timing_batches", 0)
    if isinstance(nb, bool) or not isinstance(nb, int) or nb < 0:
      _fail("bench.timing_batches", f"must be an int >= 0 (0 = every batch), got {nb!r}")
    for bs in b.block_sizes:
      if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
        _fail("bench.block_sizes", f"every block size must be an int >= 1, got {bs!r}")
      if "decode" in c and c.decode.max_new_tokens % bs:
        _fail("bench.block_sizes", f"block size {bs} does not divide decode.max_new_tokens "
              f"({c.decode.max_new_tokens})")
    if b.split:
      _one_of(c, "bench", "split", SPLITS)
    if "bench" in runs:
      for f in ("model_dir", "ar_model_dir"):
        if b[f]:
          _exists(f"bench.{f}", b[f], "model directory")

  if stage == "generate":
    for f in ("model_dir", "input", "output"):
      if not c.get(f):
        _fail(f, "is required for config.stage='generate'")
    _exists("model_dir", c.model_dir, "model directory")
    _exists("input", c.input, "input file")
    out_parent = os.path.dirname(os.path.abspath(c.output))
    _exists("output", out_parent, "output folder")
    if isinstance(c.batch_size, bool) or not isinstance(c.batch_size, int) or c.batch_size < 1:
      _fail("batch_size", f"must be an int >= 1, got {c.batch_size!r}")
    if not isinstance(c.max_prompt_len, int) or c.max_prompt_len < 0:
      _fail("max_prompt_len", f"must be an int >= 0 (0 = automatic), got {c.max_prompt_len!r}")


# ---- running -------------------------------------------------------------------------------------
def load_dry_run():
  """launch/dry_run.py as a module (it lives next to the launch scripts, outside the package)."""
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch",
                      "dry_run.py")
  if not os.path.exists(path):
    raise FileNotFoundError(f"dry run needs {path} (run from a source checkout)")
  spec = importlib.util.spec_from_file_location("dgr2_dry_run", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def run(config, workdir: str | None):
  """Validates, then runs `config.stage` (or prints the dry-run plan). Returns the stage's result."""
  validate(config, workdir)
  if config.get("dry_run", False):
    dry = load_dry_run()
    text = dry.format_plan(dry.plan(config))
    print(text, flush=True)
    return text
  check_available(_runs(config) if config.stage == "pipeline" else {config.stage})
  fn = stage_fn(config.stage)
  if workdir:
    os.makedirs(workdir, exist_ok=True)
  return fn(config, workdir)


def start_processes() -> None:
  """Several processes (dgr2_jax.multihost.launch_kwargs): `jax.distributed.initialize` before any
  other JAX call, and prints/logs from process 0 only. A single process: nothing."""
  from dgr2_jax import multihost
  try:
    multihost.initialize()
  except ValueError as e:  # inconsistent launch variables: one line
    sys.exit(f"dgr2_jax.main: {e}")
  multihost.quiet_other_processes()


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  start_processes()
  from absl import flags
  quiet_logs(flags.FLAGS.verbosity if flags.FLAGS["verbosity"].present else -1)
  config = _CONFIG.value
  if config is None:
    sys.exit("dgr2_jax.main: --config is required (e.g. --config=configs/demo.py)")
  try:  # a bad config is one line, not a traceback
    validate(config, _WORKDIR.value)
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f"dgr2_jax.main: {e}")
  run(config, _WORKDIR.value)


class _QuietLibraries:
  """Drops the libraries' routine notices a user cannot act on (kept at --verbosity=0)."""
  NOISE = ("ArrayMetadata persistence is disabled",)

  def filter(self, record) -> bool:
    return not any(n in record.getMessage() for n in self.NOISE)


def quiet_logs(verbosity: int) -> None:
  """Library logs (Orbax, TFDS, JAX) at WARNING unless `--verbosity` >= 0 asks for INFO; our own
  messages are prints and progress bars, so a newcomer sees those."""
  import logging as py_logging
  from absl import logging
  if verbosity < 0:
    logging.set_verbosity(logging.WARNING)
    logging.get_absl_logger().addFilter(_QuietLibraries())
    try:
      import tensorflow_datasets as tfds
      tfds.disable_progress_bar()
    except ImportError:
      pass
    py_logging.getLogger("jax").setLevel(py_logging.WARNING)


if __name__ == "__main__":
  from absl import app, flags
  from ml_collections import config_flags

  _CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py[:arg]).")
  _WORKDIR = flags.DEFINE_string("workdir", None, "Work directory: every stage's outputs.")
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

  def parse(argv):
    try:
      return flags.FLAGS(argv)
    except flags.Error as e:  # bad value, undefined flag
      sys.exit(f"dgr2_jax.main: {e}")
    except (AttributeError, KeyError) as e:  # ml_collections: unknown field reported as "'name'"
      key = str(e).strip("\"'")
      bad = [a.split("=")[0] for a in argv[1:]
             if a.startswith("--config.") and key in a.split("=")[0].split(".")]
      sys.exit(f"dgr2_jax.main: {bad[0] if bad else 'a --config override'}: no such config "
               f"field ({key!r})")

  app.run(main, flags_parser=parse)
