"""The one training loop every stage uses (SFT, CFT, OPD, RL): a stage is a pure loss + its batches.

Contract for a stage:
  loss_fn(params, batch, rng) -> (scalar loss, dict of scalar metrics)
    pure and jittable; `batch` is a dict of global jax arrays (dim 0 = batch); `rng` is a fresh key
    per step (and per micro-batch). If the loss is a weighted mean, put its denominator (e.g. the
    weighted token count) in metrics["denominator"]: gradient accumulation then combines
    micro-batches exactly as one big batch would (sum_i d_i * loss_i / sum_i d_i). Without it the
    micro-batches are averaged with equal weight. A batch with a `loss_mask` field whose loss has a
    denominator: the denominator must be 0 where the micro-batch's loss_mask is all 0 (the masked
    token count): such micro-batches are skipped, no forward or backward (dynamic sampling's draws
    not made).
  batch_iter: any iterator (or iterable) of dicts of numpy arrays with `train.batch_size` rows
    (per process: batch_size / process_count rows). If it has `get_state() -> dict` and
    `set_state(dict)` (grain iterators do) its position is checkpointed and restored, so a resumed
    run sees exactly the batches an uninterrupted run would.
  or step_batches (`StepBatches`): `make(params, step) -> (batch, host metrics)` builds each
    step's batch from the CURRENT params (on-policy rollouts, `rollouts.on_policy_batches`); its
    `data` iterator's position is checkpointed as above.

Train state: the plain dict {"params", "opt_state", "step" (int32), "rng" (uint32[2] base key)};
the per-step key is `fold_in(rng, step)`, so it needs no updating and resumes exactly.
`train_step(state, batch) -> (state, metrics)` is jitted with explicit in/out shardings and the
state donated; the state owns its arrays, so the caller's `params` are never donated. Resuming is
automatic: `train` restores the latest checkpoint under `<workdir>/checkpoints` if there is one
and continues to `train.total_steps`. With several processes each process's iterator state is
saved (`checkpoint.gather_data_state`) and a resume under another process count is refused.
Validation's curve and keep_best's point are saved too, so a resumed run ends as an uninterrupted
one. A preemption notice (SIGTERM) saves the step in flight on every process and ends the process
with status 75 (`preemption`). A non-finite loss stops the run with FloatingPointError naming the
step; nothing is saved for that step, so the last good checkpoint stays the latest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import statistics
import time
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from dgr2_jax import platform
from dgr2_jax import multihost
from dgr2_jax.train import checkpoint as ckpt_lib
from dgr2_jax.train import mesh as mesh_lib
from dgr2_jax.train import metrics as metrics_lib
from dgr2_jax.train import optim
from dgr2_jax.train import preemption

LossFn = Callable[[Any, dict, jax.Array], tuple[jax.Array, dict]]
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Validation:
  """Validation during `train`: `fn(params) -> {"valid_recall@1": x, ...}` runs before the first
  step, every `every` steps and at the last (never when `every` <= 0).

  `keep_best` returns the params of the best point that beats the run's first point (its starting
  params) by more than `keep_bar(margin_se, k)` standard errors of the paired per-user difference,
  k the run's later points, and the starting params when no point does: a curve measured on a few
  hundred users moves by noise, and the strict maximum of a noisy curve picks a trained step even
  when every step is worse. `fn` then also returns `valid_hits`, each validation user's Recall@1
  hit (0/1) in a fixed order (the same users at every point), which pairs the points.
  """
  fn: Callable[[Any], dict] | None   # None: no validation (a stage whose valid_prompts is 0)
  every: int = 0
  keep_best: bool = False
  margin_se: float = 2.0


def keep_bar(margin_se: float, later_points: int) -> float:
  """The paired standard errors a later point must beat the start by: `margin_se`, raised to the
  one-sided 2.5% normal quantile split over the `later_points` tested (Bonferroni: 1.96 for one,
  2.24 for two, 2.39 for three, 2.50 for four), so that a longer curve does not give a run of
  noise steps more chances to win than one point has."""
  k = max(int(later_points), 1)
  return max(float(margin_se), statistics.NormalDist().inv_cdf(1.0 - 0.025 / k))


def paired_gain(hits, start_hits) -> tuple[float, float]:
  """(mean paired difference, its standard error) of per-user 0/1 hits against the same users'
  `start_hits`."""
  d = np.asarray(hits, np.float64) - np.asarray(start_hits, np.float64)
  if d.ndim != 1 or len(d) != len(start_hits) or len(d) == 0:
    raise ValueError(f"validation hits of {len(hits)} users do not pair with the first point's "
                     f"{len(start_hits)}")
  se = float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else 0.0
  return float(d.mean()), se


def cast_floats(tree, dtype):
  """Floating leaves -> dtype (the master-weight dtype); other leaves untouched."""
  def f(x):
    return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
  return jax.tree_util.tree_map(f, tree)


def _split_micro(x, k):
  """[b, ...] -> [k, b/k, ...] taking rows i, i+k, i+2k, ... for micro-batch i, so every
  micro-batch stays spread over all batch shards (a contiguous split would idle devices)."""
  return jnp.swapaxes(x.reshape((x.shape[0] // k, k) + x.shape[1:]), 0, 1)


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, grad_accum_steps: int = 1,
                    micro_batch_sharding: NamedSharding | None = None, with_frozen: bool = False,
                    grad_sharding=None):
  """-> train_step(state, batch) -> (new state, metrics dict of f32 scalars).

  `with_frozen`: train_step(state, batch, frozen) passes a pytree that is not trained (e.g. a
  teacher's params) to `loss_fn(params, batch, rng, frozen)`; it gets no gradient.
  `grad_sharding` (the params' NamedShardings): each micro-batch's gradients are pinned to it."""
  k = int(grad_accum_steps)
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  # Inside the cond that skips a micro-batch XLA does not carry the params' shardings over to the
  # gradients: a scanned stack's backward then holds every layer's gradient whole (FSDP: the
  # model's f32 gradients on every device, compiled programs), unless they are pinned.
  pin = (lambda g: g) if grad_sharding is None else (lambda g: jax.lax.with_sharding_constraint(g, grad_sharding))

  def loss_and_grads(params, batch, rng, frozen):
    extra = (frozen,) if with_frozen else ()
    if k == 1:
      (loss, aux), grads = grad_fn(params, batch, rng, *extra)
      aux = dict(aux)
      aux.pop("denominator", None)
      return loss, aux, grads
    micro = jax.tree_util.tree_map(lambda x: _split_micro(x, k), batch)

    aux_shape = jax.eval_shape(lambda: grad_fn(params, jax.tree_util.tree_map(lambda x: x[0], micro),
                                               rng, *extra)[0][1])
    # A micro-batch without a loss token (dynamic sampling's draws not made, rollouts/_pad_draws)
    # adds d = 0 times its gradient: skip its forward and backward. Only for losses that weigh by a
    # denominator (the masked token count), where skipping is exact.
    skippable = "denominator" in aux_shape and isinstance(batch, dict) and "loss_mask" in batch

    def micro_grads(mb, i):
      (loss, aux), grads = grad_fn(params, mb, jax.random.fold_in(rng, i), *extra)
      aux = dict(aux)
      d = jnp.asarray(aux.pop("denominator", 1.0), jnp.float32)
      return loss.astype(jnp.float32), {n: jnp.asarray(v, jnp.float32) for n, v in aux.items()}, pin(grads), d

    def no_grads(mb, i):
      del mb, i
      return (jnp.zeros((), jnp.float32), {n: jnp.zeros((), jnp.float32) for n in aux_shape if n != "denominator"},
              pin(jax.tree_util.tree_map(jnp.zeros_like, params)), jnp.zeros((), jnp.float32))

    def body(carry, xs):
      i, mb = xs
      if micro_batch_sharding is not None:
        mb = jax.lax.with_sharding_constraint(mb, micro_batch_sharding)
      if skippable:
        loss, aux, grads, d = jax.lax.cond(jnp.any(mb["loss_mask"] != 0), micro_grads, no_grads, mb, i)
      else:
        loss, aux, grads, d = micro_grads(mb, i)
      g_sum, l_sum, a_sum, d_sum = carry
      g_sum = jax.tree_util.tree_map(lambda a, g: a + d * g.astype(a.dtype), g_sum, grads)
      a_sum = {n: a_sum[n] + d * jnp.asarray(v, jnp.float32) for n, v in aux.items()}
      return (g_sum, l_sum + d * loss.astype(jnp.float32), a_sum, d_sum + d), None

    zeros_aux = {n: jnp.zeros((), jnp.float32) for n in aux_shape if n != "denominator"}
    init = (jax.tree_util.tree_map(jnp.zeros_like, params), jnp.zeros((), jnp.float32), zeros_aux,
            jnp.zeros((), jnp.float32))
    (g_sum, l_sum, a_sum, d_sum), _ = jax.lax.scan(body, init, (jnp.arange(k), micro))
    d_sum = jnp.maximum(d_sum, 1e-12)
    grads = jax.tree_util.tree_map(lambda g: g / d_sum, g_sum)
    return l_sum / d_sum, {n: v / d_sum for n, v in a_sum.items()}, grads

  def train_step(state, batch, frozen=None):
    rng = jax.random.fold_in(state["rng"], state["step"])
    params = state["params"]
    loss, aux, grads = loss_and_grads(params, batch, rng, frozen)
    updates, opt_state = optimizer.update(grads, state["opt_state"], params)
    new_params = optax.apply_updates(params, updates)
    metrics = {"loss": loss.astype(jnp.float32), "grad_norm": optax.tree.norm(grads),
               "lr": jnp.asarray(schedule(state["step"]), jnp.float32)}
    metrics.update({n: jnp.asarray(v, jnp.float32) for n, v in aux.items()})
    new_state = {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1,
                 "rng": state["rng"]}
    return new_state, metrics

  return train_step


def state_shardings(param_shapes, optimizer, mesh, rules):
  """(abstract state of ShapeDtypeStructs, NamedSharding pytree) for the train-state dict."""
  p_sh = mesh_lib.param_shardings(param_shapes, mesh, rules)
  opt_shapes = jax.eval_shape(optimizer.init, param_shapes)
  o_sh = mesh_lib.opt_state_shardings(opt_shapes, param_shapes, p_sh, mesh)
  rep = NamedSharding(mesh, P())
  shapes = {"params": param_shapes, "opt_state": opt_shapes,
            "step": jax.ShapeDtypeStruct((), jnp.int32), "rng": jax.ShapeDtypeStruct((2,), jnp.uint32)}
  return shapes, {"params": p_sh, "opt_state": o_sh, "step": rep, "rng": rep}


def model_shardings(config):
  """-> `fn(model_config)`: the shardings of a model directory's parameters (per-layer layout) on
  `config.train`'s mesh, for `checkpoint.load_model_dir(shardings=...)`; None in a single process
  (where the host copy is placed by `init_state`)."""
  if jax.process_count() == 1:
    return None
  from dgr2_jax.model import checkpoint as model_ckpt

  def fn(model_config):
    shapes = model_ckpt.unflatten({p: jax.ShapeDtypeStruct(s, jnp.float32) for p, s in
                                   model_ckpt.expected_shapes(model_config.replace(scan_layers=False)).items()})
    return mesh_lib.param_shardings(shapes, mesh_lib.make_mesh(config.train.mesh),
                                    tuple(config.train.logical_axis_rules))
  return fn


def init_state(params_or_fn, optimizer, shardings, seed: int, master_dtype):
  """Builds the sharded train state; a callable `params_or_fn(rng)` is run under jit straight
  into its shardings (no full host copy of a big model). The state owns its arrays: a caller's
  jax array that needs no cast is copied, not aliased, since the train step donates the state and
  would otherwise delete the caller's array."""
  root = jax.random.PRNGKey(int(seed))
  p_sh = shardings["params"]
  if callable(params_or_fn):
    fn = lambda r: cast_floats(params_or_fn(r), master_dtype)
    params = jax.jit(fn, out_shardings=p_sh)(jax.random.fold_in(root, 0))
  else:
    def place(x, sh):
      y = cast_floats(x, master_dtype)
      return jax.device_put(y, sh, may_alias=False if y is x else None)
    params = jax.tree_util.tree_map(place, params_or_fn, p_sh)
  opt_state = jax.jit(optimizer.init, out_shardings=shardings["opt_state"])(params)
  rep = shardings["step"]
  return {"params": params, "opt_state": opt_state,
          "step": jax.device_put(jnp.zeros((), jnp.int32), rep),
          "rng": jax.device_put(jax.random.fold_in(root, 1), rep)}


def iter_state(it):
  return it.get_state() if hasattr(it, "get_state") else None


def stop_if_not_finite(m: dict, step: int, total: int, desc: str, writer, manager, last_saved) -> None:
  """NaN/Inf guard shared by the training loops: records the bad step's metrics, lets pending
  checkpoint writes finish, and stops without saving, so the last good checkpoint stays latest."""
  if math.isfinite(m.get("loss", 0.0)):   # a skipped update has no loss
    return
  writer.write(step, m)
  manager.wait_until_finished()
  where = (f"step {last_saved} in {manager.directory}" if last_saved is not None
           else "none (no checkpoint was written yet)")
  raise FloatingPointError(f"{desc}: loss is {m['loss']} at step {step} (of {total}); stopped "
                           f"without saving. Last good checkpoint: {where}")


@dataclasses.dataclass(frozen=True)
class StepBatches:
  """Where `train` gets its batches: `make(params, step) -> (batch, host_metrics)` builds step
  `step`'s batch, possibly from the CURRENT `params` (on-policy rollouts); `host_metrics` (floats,
  the same on every process) are logged with the step. A batch of None (on every process alike)
  skips the step's update: the params and optimizer state stay as they are. `data` is the iterator
  behind it, whose position is checkpointed and restored when it has `get_state` / `set_state`;
  None: no position."""
  make: Callable[[Any, int], tuple[dict, dict]]
  data: Any = None


def iterator_batches(batch_iter: Iterable[dict]) -> StepBatches:
  """The batches of a plain iterator (or iterable), which does not look at the params."""
  it = batch_iter if hasattr(batch_iter, "__next__") else iter(batch_iter)
  return StepBatches(lambda params, step: (next(it), {}), it)


@dataclasses.dataclass(frozen=True)
class _Setup:
  """What `train` derives from `config.train` before the first step."""
  total: int
  batch_size: int
  grad_accum: int
  master_dtype: Any
  mesh: Any
  optimizer: optax.GradientTransformation
  schedule: optax.Schedule
  shapes: dict
  shardings: dict
  batch_sharding: NamedSharding


def _setup(config, params, mesh) -> _Setup:
  """Checks `config.train`, builds the mesh, optimiser and the train state's shapes/shardings."""
  tc = config.train
  total = int(tc.total_steps)
  gb, k = int(tc.batch_size), int(tc.grad_accum_steps)
  if total <= 0:
    raise ValueError(f"train.total_steps must be positive, got {total}")
  if k <= 0 or gb % k:
    raise ValueError(f"train.batch_size ({gb}) must be divisible by train.grad_accum_steps ({k})")
  if tc.param_dtype not in _DTYPES:
    raise ValueError(f"train.param_dtype must be one of {sorted(_DTYPES)}, got {tc.param_dtype!r}")
  master_dtype = _DTYPES[tc.param_dtype]
  if mesh is None:
    mesh_lib.check_batch_size(gb, tc.mesh, len(platform.devices()), platform.process_count(), grad_accum_steps=k)
  mesh = mesh if mesh is not None else mesh_lib.make_mesh(tc.mesh)
  rules = tuple(tc.logical_axis_rules)
  optimizer, schedule = optim.make_optimizer(tc.optimizer, total)
  if callable(params):
    root = jax.random.PRNGKey(int(config.seed))
    param_shapes = jax.eval_shape(lambda r: cast_floats(params(r), master_dtype), root)
  else:
    param_shapes = jax.eval_shape(lambda p: cast_floats(p, master_dtype), params)
  shapes, shardings = state_shardings(param_shapes, optimizer, mesh, rules)
  return _Setup(total, gb, k, master_dtype, mesh, optimizer, schedule, shapes, shardings,
                mesh_lib.batch_sharding(mesh, rules, gb))


def _jit_step(su: _Setup, loss_fn: LossFn, rules, frozen):
  """-> (step(state, batch[, frozen]) jitted with the state's shardings and the state donated, the
  shardings of `frozen` (its parameter shardings; None without one)). `frozen`: arrays or shapes."""
  mb_sh = mesh_lib.batch_sharding(su.mesh, rules, su.batch_size // su.grad_accum) if su.grad_accum > 1 else None
  step = make_train_step(loss_fn, su.optimizer, su.schedule, su.grad_accum, mb_sh, with_frozen=frozen is not None,
                         grad_sharding=su.shardings["params"])
  out_sh = (su.shardings, NamedSharding(su.mesh, P()))
  if frozen is None:
    return jax.jit(step, in_shardings=(su.shardings, su.batch_sharding), out_shardings=out_sh,
                   donate_argnums=(0,)), None
  f_sh = mesh_lib.param_shardings(jax.eval_shape(lambda x: x, frozen), su.mesh, rules)
  return jax.jit(step, in_shardings=(su.shardings, su.batch_sharding, f_sh), out_shardings=out_sh,
                 donate_argnums=(0,)), f_sh


def _compile_step(su: _Setup, loss_fn: LossFn, rules, frozen):
  """-> step_fn(state, batch) jitted with the state's shardings and the state donated. `frozen`
  (not None) is placed once with its parameter shardings and passed to every step."""
  jitted, f_sh = _jit_step(su, loss_fn, rules, frozen)
  if frozen is None:
    return jitted
  frozen = jax.device_put(frozen, f_sh)
  return lambda st, b: jitted(st, b, frozen)


@dataclasses.dataclass(frozen=True)
class AbstractStep:
  """The step `train` runs, as shapes (`abstract_step`): compiled ahead of time by dgr2_jax/aot."""
  fn: Any                        # jitted step(state, batch[, frozen]), as `train` jits it
  state: dict                    # the train state's ShapeDtypeStructs, each with its sharding
  batch_sharding: NamedSharding  # every batch field's (rows over the 'batch' rule's axes)
  frozen: Any = None             # the frozen pytree's ShapeDtypeStructs with their shardings, or None


def abstract_step(config, params, loss_fn: LossFn, frozen=None) -> AbstractStep:
  """What `train(config, ..., params=params, loss_fn=loss_fn, frozen=frozen)` jits, from shapes:
  `params` and `frozen` may be ShapeDtypeStructs, nothing is placed or allocated. The mesh is
  `config.train.mesh` over the platform's devices (a compile-only target's inside
  `aot.targets.compile_for`)."""
  su = _setup(config, params, None)
  fn, f_sh = _jit_step(su, loss_fn, tuple(config.train.logical_axis_rules), frozen)
  placed = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  state = jax.tree_util.tree_map(placed, su.shapes, su.shardings)
  frozen = None if frozen is None else jax.tree_util.tree_map(placed, jax.eval_shape(lambda x: x, frozen), f_sh)
  return AbstractStep(fn, state, su.batch_sharding, frozen)


def _resume_data(data, data_state: dict, start: int, workdir: str) -> None:
  """Puts the data iterator at the position saved with checkpoint `start`.

  A saved position the iterator cannot take is an error: carrying on would feed the resumed run
  other batches (other prompts, on-policy) than an uninterrupted run sees, silently breaking exact
  resumption. A checkpoint without a position for an iterator that has one (written by a run whose
  iterator had none) only warns: the data restarts and nothing that was saved is thrown away."""
  if data_state:
    if not hasattr(data, "set_state"):
      raise ValueError(f"checkpoint step {start} in {workdir} holds a data-iterator state but the "
                       "batch iterator has no set_state(); cannot resume the data position")
    data.set_state(data_state)
  elif hasattr(data, "get_state"):
    logging.warning("checkpoint step %d has no data-iterator state; the data restarts", start)


class _Validator:
  """Runs a `Validation`, keeps its curve and (keep_best) a device copy of the kept params: the
  first point's, replaced by a later point's when it beats the first by the margin."""

  def __init__(self, validation: Validation):
    self.v = validation
    self.curve, self.best = [], None   # best: ((recall, valid rate) or None at the start, step, params copy)
    self.start_hits = None
    self.bar = float(validation.margin_se)   # `keep_bar` of the run's later points (`plan`)

  def plan(self, start: int, total: int) -> None:
    """Sets the keep bar from the points this run will test after its first (at `start`)."""
    self.bar = keep_bar(self.v.margin_se, sum(1 for s in range(start + 1, total + 1) if self.due(s, total)))

  @property
  def active(self) -> bool:
    """A stage without a validator (valid_prompts 0) passes `Validation(None, ...)`: no curve."""
    return self.v.fn is not None and self.v.every > 0

  def due(self, step: int, total: int) -> bool:
    return self.active and (step % self.v.every == 0 or step == total)

  def run(self, params, step: int) -> dict:
    out = dict(self.v.fn(params))
    hits = out.pop("valid_hits", None)
    vm = {n: float(v) for n, v in out.items()}
    if self.v.keep_best:
      if hits is None:
        raise ValueError("Validation.keep_best needs fn to return valid_hits (per-user 0/1 hits)")
      if self.start_hits is None:   # the first point: the starting params, kept unless beaten
        self.start_hits = list(hits)
        self.best = (None, step, jax.tree_util.tree_map(jnp.copy, params))
      else:
        gain, se = paired_gain(hits, self.start_hits)
        vm.update(valid_gain_over_start=gain, valid_gain_se=se)
        key = (vm["valid_recall@1"], vm.get("valid_valid_rate", 0.0))
        if gain > self.bar * se and gain > 0 and (self.best[0] is None or key > self.best[0]):
          self.best = (key, step, jax.tree_util.tree_map(jnp.copy, params))
    self.curve.append({"step": step, **vm})
    return vm

  def saved(self) -> dict:
    """The curve, the first point's hits, the keep bar and the best point's key and step, for the
    checkpoint (`train` saves the best point's params beside the train state)."""
    best = None if self.best is None else {"key": None if self.best[0] is None else list(self.best[0]),
                                          "step": self.best[1]}
    return {"curve": self.curve, "start_hits": self.start_hits, "bar": self.bar, "best": best}

  def restore(self, saved: dict, best_params) -> None:
    """Continues the curve of a checkpoint's `saved()`: the same first point, bar and best point,
    so a resumed run keeps what an uninterrupted run keeps."""
    self.curve, self.start_hits, self.bar = list(saved["curve"]), saved["start_hits"], float(saved["bar"])
    b = saved["best"]
    if b is not None:
      self.best = (None if b["key"] is None else tuple(b["key"]), int(b["step"]), best_params)

  def finish(self, state: dict) -> dict:
    if self.best is not None:
      state = dict(state, params=self.best[2])
    return dict(state, valid_curve=self.curve, best_step=None if self.best is None else self.best[1],
                keep_bar_se=self.bar if self.v.keep_best else None)


def train(config, workdir: str, *, params, loss_fn: LossFn, batch_iter: Iterable[dict] | None = None,
          step_batches: StepBatches | None = None, mesh=None, desc: str = "train", frozen=None,
          validation: Validation | None = None) -> dict:
  """Trains `params` (pytree, or `fn(rng) -> pytree`) with `loss_fn` on `batch_iter` (an iterator
  of batches) or `step_batches` (batches made per step from the current params; exactly one).
  The caller's `params` stay intact (the state holds its own copy).

  Reads `config.seed` and `config.train`. Writes `<workdir>/checkpoints`, `<workdir>/metrics.jsonl`
  and `<workdir>/tensorboard`. Resumes from the latest checkpoint in `workdir` when present.
  `frozen` (e.g. a teacher's params) is passed to every step as `loss_fn(params, batch, rng,
  frozen)`; it is neither trained nor checkpointed.
  `validation` runs `validation.fn(params) -> {"valid_recall@1": x, ...}` before the first step,
  every `validation.every` steps and at the last: its numbers join that step's metrics and the
  returned state's `valid_curve`. `keep_best` returns the params of the best point among those
  that beat the curve's first point by `keep_bar` paired standard errors (the highest
  `valid_recall@1`, ties broken by the higher `valid_valid_rate`, then the earliest step), else
  the first point's (`Validation`); it holds one more copy of the params on the devices (saved in
  every checkpoint with the curve, so a resumed run keeps the same point). With `validation` the
  state also has `best_step` and `keep_bar_se` (None unless keep_best).
  Saves every `train.checkpoint_every` steps, at least every `train.checkpoint_every_minutes`
  (0 = off) and at the last step. On a preemption notice (SIGTERM; `preemption`) every process
  saves the same step and `preemption.Preempted` is raised: uncaught, the process exits with
  status `preemption.EXIT_STATUS` (75), and the same call again resumes from that step.
  Returns the final train-state dict (sharded jax arrays).
  """
  if (batch_iter is None) == (step_batches is None):
    raise ValueError("train: pass exactly one of batch_iter and step_batches")
  source = iterator_batches(batch_iter) if step_batches is None else step_batches
  tc = config.train
  su = _setup(config, params, mesh)
  total, gb = su.total, su.batch_size
  val = _Validator(validation) if validation is not None else None
  manager = ckpt_lib.make_manager(workdir, tc.keep_checkpoints, tc.async_checkpointing)
  # From here until the last write has committed, SIGTERM is a preemption notice (preemption.py).
  with preemption.Watch(manager) as watch, contextlib.closing(manager):
    start = manager.latest_step()
    if start is not None:
      abstract = ckpt_lib.abstract_like(su.shapes, su.shardings)
      if "best" in manager.item_metadata(start)["state"]:   # keep_best's point (`_Validator.saved`)
        abstract["best"] = abstract["params"]
      state, data_state, extra = ckpt_lib.restore(manager, start, abstract)
      best = state.pop("best", None)
      _resume_data(source.data, data_state, start, workdir)
      if val is not None and extra.get("validation"):
        val.restore(extra["validation"], best)
      logging.info("%s: resumed from step %d in %s", desc, start, workdir)
    else:
      start = 0
      state = init_state(params, su.optimizer, su.shardings, config.seed, su.master_dtype)
    if watch.outside_steps(start):   # a notice before the first step: nothing new to save
      _stop(manager, start, desc)

    step_fn = _compile_step(su, loss_fn, tuple(tc.logical_axis_rules), frozen)
    writer = metrics_lib.MetricsWriter(workdir, total, start, bool(tc.tensorboard),
                                       jax.process_index() == 0, desc)
    if val is not None and not val.curve:
      val.plan(start, total)
    log_every, ckpt_every = max(int(tc.log_every), 1), max(int(tc.checkpoint_every), 1)
    clock = preemption.Clock(float(tc.get("checkpoint_every_minutes", 0.0)))
    last_saved = start if start else None
    t0, t_steps = time.perf_counter(), 0
    try:
      if val is not None and val.active and not val.curve:   # the first point: the starting params
        logging.info("%s: step %d validation %s", desc, start, val.run(state["params"], start))
      for s in range(start + 1, total + 1):
        try:
          batch, host_m = source.make(state["params"], s)
        except StopIteration:
          raise ValueError(f"the batch iterator ended before step {s} of train.total_steps={total}") from None
        t1 = time.perf_counter()
        m = {}
        if batch is not None:
          state, m = step_fn(state, mesh_lib.shard_batch(batch, su.batch_sharding, gb))
          m = {n: float(v) for n, v in jax.device_get(m).items()}
        m.update(host_m)
        m["update_time_s"] = time.perf_counter() - t1
        t_steps += 1
        stop_if_not_finite(m, s, total, desc, writer, manager, last_saved)
        validate = val is not None and val.due(s, total)
        if validate or s % log_every == 0 or s == total:
          m["steps_per_sec"] = t_steps / max(time.perf_counter() - t0, 1e-9)
          if validate:
            m.update(val.run(state["params"], s))
          writer.write(s, m)
          t0, t_steps = time.perf_counter(), 0
        writer.bar(s, m)
        # Every process asks both at every step (collectives); either saves this step.
        preempted, timed = watch.reached(s), clock.due()
        if s % ckpt_every == 0 or s == total or preempted or timed:
          _save(manager, s, state, source, val)
          last_saved = s
          clock.saved()
        if preempted:
          _stop(manager, s, desc)
      manager.wait_until_finished()
      if watch.outside_steps(total):   # a notice during the last step: every step is saved
        _stop(manager, total, desc)
    finally:
      writer.close()
  return state if val is None else val.finish(state)


def _save(manager, step: int, state: dict, source: StepBatches, val: _Validator | None) -> None:
  """Starts the save of `step`: the train state, every process's data position and (validation)
  the curve and keep_best's point, so that a resumed run continues exactly."""
  extra = None
  if val is not None and val.curve:
    extra = {"validation": val.saved()}
    if val.best is not None:
      state = dict(state, best=val.best[2])
  ckpt_lib.save(manager, step, state, ckpt_lib.gather_data_state(iter_state(source.data)), extra)


def _stop(manager, step: int, desc: str):
  """The preemption exit: waits for the pending writes to commit, then raises `Preempted` (exit
  status `preemption.EXIT_STATUS` when uncaught)."""
  manager.wait_until_finished()
  # No process exits before every one has committed (a launcher may kill the rest at the first exit).
  multihost.barrier("preemption.saved")
  if jax.process_index() == 0:
    saved = f"step {step} is saved in {manager.directory}" if manager.latest_step() == step else "no step yet"
    print(f"{desc}: preempted; {saved}; exiting with status {preemption.EXIT_STATUS} (run the same "
          "command again to resume)", flush=True)
  raise preemption.Preempted(step, str(manager.directory))
