"""The one training loop every stage uses (SFT, CFT, ...): a stage is a pure loss + a batch iterator.

Contract for a stage:
  loss_fn(params, batch, rng) -> (scalar loss, dict of scalar metrics)
    pure and jittable; `batch` is a dict of global jax arrays (dim 0 = batch); `rng` is a fresh key
    per step (and per micro-batch). If the loss is a weighted mean, put its denominator (e.g. the
    weighted token count) in metrics["denominator"]: gradient accumulation then combines
    micro-batches exactly as one big batch would (sum_i d_i * loss_i / sum_i d_i). Without it the
    micro-batches are averaged with equal weight.
  batch_iter: any iterator (or iterable) of dicts of numpy arrays with `train.batch_size` rows
    (per process: batch_size / process_count rows). If it has `get_state() -> dict` and
    `set_state(dict)` (grain iterators do) its position is checkpointed and restored, so a resumed
    run sees exactly the batches an uninterrupted run would.

Train state: the plain dict {"params", "opt_state", "step" (int32), "rng" (uint32[2] base key)};
the per-step key is `fold_in(rng, step)`, so it needs no updating and resumes exactly.
`train_step(state, batch) -> (state, metrics)` is jitted with explicit in/out shardings and the
state donated. Resuming is automatic: `train` restores the latest checkpoint under
`<workdir>/checkpoints` if there is one and continues to `train.total_steps`. With several
processes each process's iterator state is saved (`checkpoint.gather_data_state`) and a resume
under another process count is refused.
A non-finite loss stops the run with FloatingPointError naming the step; nothing is saved for that
step, so the last good checkpoint stays the latest.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from dgr2_jax.train import checkpoint as ckpt_lib
from dgr2_jax.train import mesh as mesh_lib
from dgr2_jax.train import metrics as metrics_lib
from dgr2_jax.train import optim

LossFn = Callable[[Any, dict, jax.Array], tuple[jax.Array, dict]]
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


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
                    micro_batch_sharding: NamedSharding | None = None, with_frozen: bool = False):
  """-> train_step(state, batch) -> (new state, metrics dict of f32 scalars).

  `with_frozen`: train_step(state, batch, frozen) passes a pytree that is not trained (e.g. a
  teacher's params) to `loss_fn(params, batch, rng, frozen)`; it gets no gradient."""
  k = int(grad_accum_steps)
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def loss_and_grads(params, batch, rng, frozen):
    extra = (frozen,) if with_frozen else ()
    if k == 1:
      (loss, aux), grads = grad_fn(params, batch, rng, *extra)
      aux = dict(aux)
      aux.pop("denominator", None)
      return loss, aux, grads
    micro = jax.tree_util.tree_map(lambda x: _split_micro(x, k), batch)

    def body(carry, xs):
      i, mb = xs
      if micro_batch_sharding is not None:
        mb = jax.lax.with_sharding_constraint(mb, micro_batch_sharding)
      (loss, aux), grads = grad_fn(params, mb, jax.random.fold_in(rng, i), *extra)
      aux = dict(aux)
      d = jnp.asarray(aux.pop("denominator", 1.0), jnp.float32)
      g_sum, l_sum, a_sum, d_sum = carry
      g_sum = jax.tree_util.tree_map(lambda a, g: a + d * g.astype(a.dtype), g_sum, grads)
      a_sum = {n: a_sum[n] + d * jnp.asarray(v, jnp.float32) for n, v in aux.items()}
      return (g_sum, l_sum + d * loss.astype(jnp.float32), a_sum, d_sum + d), None

    aux_shape = jax.eval_shape(lambda: grad_fn(params, jax.tree_util.tree_map(lambda x: x[0], micro),
                                               rng, *extra)[0][1])
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
  into its shardings (no full host copy of a big model)."""
  root = jax.random.PRNGKey(int(seed))
  p_sh = shardings["params"]
  if callable(params_or_fn):
    fn = lambda r: cast_floats(params_or_fn(r), master_dtype)
    params = jax.jit(fn, out_shardings=p_sh)(jax.random.fold_in(root, 0))
  else:
    params = jax.device_put(cast_floats(params_or_fn, master_dtype), p_sh)
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
  if math.isfinite(m["loss"]):
    return
  writer.write(step, m)
  manager.wait_until_finished()
  where = (f"step {last_saved} in {manager.directory}" if last_saved is not None
           else "none (no checkpoint was written yet)")
  raise FloatingPointError(f"{desc}: loss is {m['loss']} at step {step} (of {total}); stopped "
                           f"without saving. Last good checkpoint: {where}")


def train(config, workdir: str, *, params, loss_fn: LossFn, batch_iter: Iterable[dict],
          mesh=None, desc: str = "train") -> dict:
  """Trains `params` (pytree, or `fn(rng) -> pytree`) with `loss_fn` on `batch_iter`.

  Reads `config.seed` and `config.train`. Writes `<workdir>/checkpoints`, `<workdir>/metrics.jsonl`
  and `<workdir>/tensorboard`. Resumes from the latest checkpoint in `workdir` when present.
  Returns the final train-state dict (sharded jax arrays).
  """
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
    mesh_lib.check_batch_size(gb, tc.mesh, jax.device_count(), jax.process_count(), grad_accum_steps=k)
  mesh = mesh if mesh is not None else mesh_lib.make_mesh(tc.mesh)
  rules = tuple(tc.logical_axis_rules)
  optimizer, schedule = optim.make_optimizer(tc.optimizer, total)

  root = jax.random.PRNGKey(int(config.seed))
  if callable(params):
    param_shapes = jax.eval_shape(lambda r: cast_floats(params(r), master_dtype), root)
  else:
    param_shapes = jax.eval_shape(lambda p: cast_floats(p, master_dtype), params)
  shapes, shardings = state_shardings(param_shapes, optimizer, mesh, rules)
  b_sh = mesh_lib.batch_sharding(mesh, rules, gb)
  mb_sh = mesh_lib.batch_sharding(mesh, rules, gb // k) if k > 1 else None

  it = batch_iter if hasattr(batch_iter, "__next__") else iter(batch_iter)
  manager = ckpt_lib.make_manager(workdir, tc.keep_checkpoints, tc.async_checkpointing)
  start = manager.latest_step()
  if start is not None:
    state, data_state = ckpt_lib.restore(manager, start, ckpt_lib.abstract_like(shapes, shardings))
    if data_state:
      if not hasattr(it, "set_state"):
        raise ValueError(f"checkpoint step {start} in {workdir} holds a data-iterator state but the "
                         "batch iterator has no set_state(); cannot resume the data position")
      it.set_state(data_state)
    elif hasattr(it, "get_state"):
      logging.warning("checkpoint step %d has no data-iterator state; the data restarts", start)
    logging.info("resumed from step %d in %s", start, workdir)
  else:
    start = 0
    state = init_state(params, optimizer, shardings, config.seed, master_dtype)

  rep = NamedSharding(mesh, P())
  step_fn = jax.jit(make_train_step(loss_fn, optimizer, schedule, k, mb_sh),
                    in_shardings=(shardings, b_sh), out_shardings=(shardings, rep),
                    donate_argnums=(0,))
  writer = metrics_lib.MetricsWriter(workdir, total, start, bool(tc.tensorboard),
                                     jax.process_index() == 0, desc)
  log_every, ckpt_every = max(int(tc.log_every), 1), max(int(tc.checkpoint_every), 1)
  last_saved = start if start else None
  t0, t_steps = time.perf_counter(), 0
  try:
    for s in range(start + 1, total + 1):
      try:
        batch = next(it)
      except StopIteration:
        raise ValueError(f"the batch iterator ended before step {s} of train.total_steps={total}") from None
      state, m = step_fn(state, mesh_lib.shard_batch(batch, b_sh, gb))
      m = {n: float(v) for n, v in jax.device_get(m).items()}
      t_steps += 1
      stop_if_not_finite(m, s, total, desc, writer, manager, last_saved)
      if s % log_every == 0 or s == total:
        m["steps_per_sec"] = t_steps / max(time.perf_counter() - t0, 1e-9)
        writer.write(s, m)
        t0, t_steps = time.perf_counter(), 0
      writer.bar(s, m)
      if s % ckpt_every == 0 or s == total:
        ckpt_lib.save(manager, s, state, ckpt_lib.gather_data_state(iter_state(it)))
        last_saved = s
    manager.wait_until_finished()
  finally:
    writer.close()
    manager.close()
  return state
