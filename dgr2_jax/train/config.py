"""The config section the training core owns, `config.train` (loop, optimiser, mesh, checkpoints,
logging) with one sub-section per stage that trains (`train.sft`, ...): its defaults and its checks.

configs/base.py composes it into the config tree; `loop.train` reads only `config.train` and
`config.seed`.
"""

import ml_collections

# Logical axis name -> mesh axes (MaxText style). A parameter/batch dimension tagged with a logical
# name is sharded over these mesh axes when its size is divisible by their product, else
# replicated (see `mesh.logical_to_spec`). 'length' and None are never sharded.
DEFAULT_RULES = (
    ("batch", ("data", "fsdp")),
    ("embed", ("fsdp",)),
    ("heads", ("tensor",)),
    ("mlp", ("tensor",)),
    ("vocab", ("tensor",)),
    ("length", ()),
)


def train_config() -> ml_collections.ConfigDict:
  """Defaults for `config.train`."""
  c = ml_collections.ConfigDict()
  c.total_steps = 100  # optimiser steps (each sees `batch_size` examples)
  c.batch_size = 8  # global batch (all hosts, all micro-batches); divisible by mesh data*fsdp
  c.grad_accum_steps = 1  # micro-batches per step; batch_size must be divisible by it
  # Master weights are kept in this dtype; the compute dtype is the model config's `dtype`
  # (e.g. model.dtype='bfloat16' with train.param_dtype='float32' = mixed precision).
  c.param_dtype = "float32"

  o = ml_collections.ConfigDict()
  o.peak_lr = 1e-4  # AdamW peak learning rate
  o.warmup_steps = 10  # linear warm-up from 0
  o.schedule = "cosine"  # 'cosine' (to end_lr_frac * peak_lr at total_steps) | 'constant'
  o.end_lr_frac = 0.1  # cosine schedule's final learning rate / peak_lr
  o.b1 = 0.9  # Adam beta1
  o.b2 = 0.95  # Adam beta2
  o.eps = 1e-8  # Adam epsilon
  o.weight_decay = 0.0  # decoupled (AdamW); applied to matrices only, not norms/biases
  o.clip_norm = 1.0  # global-norm gradient clipping; 0 disables
  c.optimizer = o

  m = ml_collections.ConfigDict()
  m.data = -1  # -1: all devices not used by the other axes
  m.fsdp = 1  # devices the parameters, gradients and optimiser state are sharded over
  m.tensor = 1  # devices each matrix is split over (heads, MLP, vocabulary)
  c.mesh = m
  c.logical_axis_rules = DEFAULT_RULES  # logical axis -> mesh axes (see DEFAULT_RULES above)

  c.checkpoint_every = 50  # steps; the final step is always saved
  c.checkpoint_every_minutes = 0.0  # also save once this many minutes passed since the last save; 0 = off
  c.keep_checkpoints = 2  # most recent checkpoints kept
  c.async_checkpointing = True  # write checkpoints in the background
  c.log_every = 1  # steps between metric records (JSONL/TensorBoard); the progress bar is per step
  c.tensorboard = True  # also write TensorBoard event files

  s = ml_collections.ConfigDict()
  s.reasoning_weight = 1.0  # loss weight of tokens in <think>...</think>
  s.answer_weight = 1.0  # loss weight of the answer tokens (JSON ranking + EOS)
  s.epochs = 0  # > 0: train.total_steps = epochs * train examples // batch_size
  c.sft = s
  return c


# `config.train` fields that do not change what a stage trains: left out of the config hashes of the
# stages that hash the train section, so changing them neither wipes a partial run nor a built stage.
UNHASHED = ("checkpoint_every_minutes",)


def without(section, keys) -> ml_collections.ConfigDict:
  """A resolved copy of config `section` without `keys` (absent ones ignored), for a stage's config
  hash: it leaves out fields that do not change what the stage trains (metrics-only ones, and new
  ones at the value that trains as before they existed), so built stages stay fresh."""
  c = section.copy_and_resolve_references()
  with c.unlocked():
    for k in keys:
      if k in c:
        del c[k]
  return c


def hashed(train) -> ml_collections.ConfigDict:
  """`train` (a `config.train`) without the `UNHASHED` fields, for a stage's config hash."""
  return without(train, UNHASHED)


def section(config, name: str, defaults):
  """`config.<name>` over its defaults (`defaults()`), so a config missing newer fields still runs."""
  c = defaults()
  with c.unlocked():
    for k, v in (config.get(name) or {}).items():
      c[k] = v
  return c


DTYPES = ("float32", "bfloat16", "float16")
SCHEDULES = ("cosine", "constant")


def validate(config, runs: set) -> None:
  """Checks `train` (batch, accumulation, dtype, schedule, mesh axes)."""
  del runs  # no paths
  from dgr2_jax import checks
  c = config
  if "train" not in c:
    return
  tr = c.train
  checks.positive_int(c, "train", "total_steps")
  checks.positive_int(c, "train", "batch_size")
  checks.positive_int(c, "train", "grad_accum_steps")
  if tr.batch_size % tr.grad_accum_steps:
    checks.fail("train.batch_size", f"({tr.batch_size}) must be divisible by train.grad_accum_steps "
                f"({tr.grad_accum_steps})")
  checks.one_of(c, "train", "param_dtype", DTYPES)
  minutes = tr.get("checkpoint_every_minutes", 0.0)
  if not isinstance(minutes, (int, float)) or isinstance(minutes, bool) or minutes < 0:
    checks.fail("train.checkpoint_every_minutes", f"must be a number >= 0 (0 = off), got {minutes!r}")
  if tr.optimizer.schedule not in SCHEDULES:
    checks.fail("train.optimizer.schedule", f"must be one of {list(SCHEDULES)}, got "
                f"{tr.optimizer.schedule!r}")
  dims = [tr.mesh[a] for a in ("data", "fsdp", "tensor")]
  if sum(d == -1 for d in dims) > 1 or any(d == 0 or d < -1 for d in dims):
    checks.fail("train.mesh", f"each axis must be >= 1 and at most one -1, got {tr.mesh.to_dict()}")
