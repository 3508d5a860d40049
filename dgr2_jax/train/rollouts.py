"""On-policy rollouts for OPD and RL, and the training loop that makes them from the live params.

Rollouts (`sample`): the eval decoder in sampling mode. Each prompt is repeated `group_size`
times (rows g*G .. g*G+G-1 are the group of prompt g) and the whole batch is decoded by ONE call
of `sampler.compiled_decoder` (the same jitted function `sampler.generate` and eval use, same
static shapes) with one PRNG key; the decoder splits that key per row, so the copies of a prompt
get different samples. `replay_inputs` then builds the replay segments host-side
(`replay.build_segments`), which `replay.replay_logits` scores under the current params.

Sharding: pass `batch_sharding` (e.g. `NamedSharding(mesh, P(('data', 'fsdp')))`, what
`mesh.batch_sharding` returns) and the prompt arrays are placed with it before the jitted decoder
runs; jit partitions the whole decode over the data axis (every op is per row except the
all-rows-done test of the while loop, which becomes an all-reduce). The params keep the train
state's shardings. On CPU a single device is used and this is a no-op.

On-policy loop (`train_on_policy`): `loop.train` pulls batches from an iterator that cannot see
the params, so on-policy stages use this twin of it built from the same pieces
(`loop.make_train_step`, `loop.state_shardings`, `loop.init_state`, `train.checkpoint`,
`train.metrics`): per step it draws a batch of prompts from `prompt_iter` (a checkpointable grain
iterator), calls `make_batch(params, prompts, step_key)` with the CURRENT params (rollouts, reward
or teacher scoring, replay inputs; host-side), then runs the jitted train step on the result.
Resume, the data-iterator state, the NaN guard and the metric sinks behave as in `loop.train`;
`make_batch`'s host metrics (reward, NFE, rollout time, ...) are logged with the step's metrics.
The rollout key of step s is `fold_in(PRNGKey(seed + 1), s)`, so a resumed run replays exactly.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from dgr2_jax import multihost
from dgr2_jax.decode import sampler
from dgr2_jax.train import checkpoint as ckpt_lib
from dgr2_jax.train import loop
from dgr2_jax.train import mesh as mesh_lib
from dgr2_jax.train import metrics as metrics_lib
from dgr2_jax.train import optim
from dgr2_jax.train import replay

SEGMENT_KEYS = ("clean", "seg_tokens", "pred_seg")


def sample(model_config, params, prompt_ids, prompt_len, decode_config: sampler.DecodeConfig, rng,
           group_size: int = 1, batch_sharding=None, rows_per_call: int = 0) -> dict:
  """Decodes `group_size` rollouts of each prompt (left-padded `prompt_ids [n,P]`, `prompt_len [n]`).

  `rows_per_call` > 0 decodes the n*G rows in calls of that many rows (it must divide n*G; call i
  uses `fold_in(rng, i)`), so the decode's memory is that of one call; 0 = one call.
  Several processes: `prompt_ids`/`prompt_len` are this process's rows; each call decodes one
  global batch (every process's rows, in process order, over the parameters' data x fsdp devices),
  so each row's key comes from its global row index, the all-done test is global, and this
  process gets its own rows back. `rows_per_call` then counts this process's rows.
  Returns numpy arrays over n*G rows: prompt_ids, prompt_len, tokens, commit_step, logprob
  (decode-time, under the decoding distribution), nfe, eos_pos, finished (an EOS was committed
  within max_new_tokens), loss_mask (committed and at or before the first EOS), and output_ids.
  """
  dc = decode_config
  # The decoder pins its loop state to the training mesh: rows over (data, fsdp), the KV cache over
  # tensor, as the params' train shardings split the heads, MLP and vocabulary (decode/mesh.py).
  _, fn = sampler.decoder_for(model_config, dc, None if batch_sharding is None else batch_sharding.mesh)
  prompt_ids = np.repeat(np.asarray(prompt_ids, np.int32), group_size, axis=0)
  prompt_len = np.repeat(np.asarray(prompt_len, np.int32), group_size, axis=0)
  rows = len(prompt_ids)
  per = int(rows_per_call) or rows
  if rows % per:
    raise ValueError(f"rollout_batch_size ({per}) must divide the {rows} rollout rows of a step")
  parts = []
  rows_sh = global_rows_sharding(params) if jax.process_count() > 1 else None
  for i in range(rows // per):
    toks, lens = prompt_ids[i * per:(i + 1) * per], prompt_len[i * per:(i + 1) * per]
    if rows_sh is not None:  # this process's rows of one global batch (rows in process order)
      toks, lens = to_global(toks, rows_sh), to_global(lens, rows_sh)
    elif batch_sharding is not None:
      toks, lens = jax.device_put(toks, batch_sharding), jax.device_put(lens, batch_sharding)
    key = rng if per == rows else jax.random.fold_in(rng, i)
    out = sampler.run_decoder(fn, params, toks, lens, dc, key)
    parts.append({k: np.asarray(v) if rows_sh is None else to_local(v, per) for k, v in out.items()})
  out = {k: np.concatenate([pt[k] for pt in parts]) if parts[0][k].ndim else np.asarray([pt[k] for pt in parts])
         for k in parts[0]}
  r = out["tokens"].shape[1]
  eos_pos = out["eos_pos"]
  out.update(prompt_ids=prompt_ids, prompt_len=prompt_len, finished=eos_pos < r,
             loss_mask=(out["commit_step"] >= 0) & (np.arange(r)[None] <= eos_pos[:, None]))
  out["output_ids"] = [row[:min(int(e) + 1, r)].tolist() for row, e in zip(out["tokens"], eos_pos)]
  return out


def global_rows_sharding(params) -> NamedSharding:
  """Rows over the ("data", "fsdp") axes of the parameters' mesh (one mesh per program), the rest
  replicated. Parameters on another kind of sharding: rows over every device in order."""
  leaf = jax.tree_util.tree_leaves(params)[0]
  sh = getattr(leaf, "sharding", None)
  if isinstance(sh, NamedSharding):
    axes = tuple(a for a in ("data", "fsdp") if a in sh.mesh.shape and sh.mesh.shape[a] > 1)
    return NamedSharding(sh.mesh, P(axes or None))
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("rows",))
  return NamedSharding(mesh, P("rows"))


def to_global(local: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """This process's rows -> the global array (rows of process 0 first, then 1, ...)."""
  gshape = (local.shape[0] * jax.process_count(),) + local.shape[1:]
  return jax.make_array_from_process_local_data(sharding, local, gshape)


def to_local(x: jax.Array, local_rows: int) -> np.ndarray:
  """A global decode output -> this process's rows (outputs that are not per row: the whole)."""
  from jax.experimental import multihost_utils
  if x.ndim == 0:
    return np.asarray(x.addressable_data(0))  # replicated
  full = np.asarray(multihost_utils.process_allgather(x, tiled=True))
  if full.shape[0] != local_rows * jax.process_count():
    return full
  i = jax.process_index()
  return full[i * local_rows:(i + 1) * local_rows]


def replay_inputs(rollouts: dict, block_size: int, mask_id: int, commit_step=None,
                  max_segments_per_block: int = 0) -> dict:
  """Replay arrays (clean, seg_tokens, pred_seg) + `exact` [b] from rollouts (host NumPy).

  `commit_step` overrides the rollout's (the self-teacher's serialised order, see
  `serialize_commit_steps`). `max_segments_per_block` 0 = exact replay (one segment per denoising
  step: cap = block size); > 0 = that cap (neighbouring steps merged when a block used more).
  """
  cs = rollouts["commit_step"] if commit_step is None else commit_step
  seg = replay.build_segments(rollouts["tokens"], cs, block_size, max_segments_per_block or block_size,
                              mask_id)
  return {k: seg[k] for k in SEGMENT_KEYS + ("exact",)}


def serialize_commit_steps(commit_step: np.ndarray, block_size: int) -> np.ndarray:
  """The tau=1 version of a trajectory: one commit per step, in the rollout's commit order.

  Inside each block, committed positions are ordered by (commit_step, position) - tokens the
  rollout committed together in one step are serialised left to right - and numbered with
  consecutive global steps; -1 (never committed) stays -1.
  """
  b, r = commit_step.shape
  out = np.full_like(commit_step, -1)
  for row in range(b):
    step = 0
    for j in range(r // block_size):
      cs = commit_step[row, j * block_size:(j + 1) * block_size]
      idx = [i for i in np.lexsort((np.arange(block_size), cs)) if cs[i] >= 0]
      for i in idx:
        out[row, j * block_size + i] = step
        step += 1
  return out


def left_to_right_commit_steps(commit_step: np.ndarray) -> np.ndarray:
  """Every committed token on its own step, in position order (-1 stays -1).

  Replayed with these steps, token r is scored on the canvas where exactly the tokens left of r in
  its block are visible and the rest are masked: the block-diffusion model's next-token
  distribution given P, o_<r, the conditioning of the paper's OPD formula (train/opd.py).
  """
  r = commit_step.shape[1]
  return np.where(commit_step >= 0, np.arange(r)[None], -1).astype(commit_step.dtype)


def train_on_policy(config, workdir: str, *, params, loss_fn: loop.LossFn,
                    make_batch: Callable[[dict, dict, jax.Array], tuple[dict, dict]],
                    prompt_iter, mesh=None, desc: str = "on-policy", frozen=None,
                    validate: Callable[[dict], dict] | None = None, validate_every: int = 0,
                    keep_best: bool = False) -> dict:
  """`loop.train` for on-policy stages (see the module docstring). `config.train.batch_size` is
  the number of ROWS `make_batch` returns (prompts per step * rollouts per prompt). `frozen` (e.g.
  the teacher's params) is placed once with its parameter shardings and passed to every step as
  `loss_fn(params, batch, rng, frozen)`; it is neither trained nor checkpointed.

  `validate(params) -> {"valid_recall@1": x, ...}` runs before the first step and every
  `validate_every` steps (and at the last): its numbers join that step's metrics and the returned
  state's `valid_curve`. `keep_best` returns the params of the curve's best point: the highest
  `valid_recall@1`, ties broken by the higher `valid_valid_rate` (an invalid answer falls back to
  the retriever's order, so of two equal rankers the one that answers validly more often is
  kept), then by the earliest step. So the number of steps is chosen on validation; it holds one
  more copy of the params on the devices, and a resumed run's curve starts at the resumed step."""
  tc = config.train
  total, gb, k = int(tc.total_steps), int(tc.batch_size), int(tc.grad_accum_steps)
  if total <= 0:
    raise ValueError(f"train.total_steps must be positive, got {total}")
  if k <= 0 or gb % k:
    raise ValueError(f"train.batch_size ({gb}) must be divisible by train.grad_accum_steps ({k})")
  master_dtype = loop._DTYPES[tc.param_dtype]  # pylint: disable=protected-access
  mesh = mesh if mesh is not None else mesh_lib.make_mesh(tc.mesh)
  rules = tuple(tc.logical_axis_rules)
  optimizer, schedule = optim.make_optimizer(tc.optimizer, total)
  param_shapes = jax.eval_shape(lambda p: loop.cast_floats(p, master_dtype), params)
  shapes, shardings = loop.state_shardings(param_shapes, optimizer, mesh, rules)
  b_sh = mesh_lib.batch_sharding(mesh, rules, gb)
  mb_sh = mesh_lib.batch_sharding(mesh, rules, gb // k) if k > 1 else None

  manager = ckpt_lib.make_manager(workdir, tc.keep_checkpoints, tc.async_checkpointing)
  start = manager.latest_step()
  if start is not None:
    state, data_state = ckpt_lib.restore(manager, start, ckpt_lib.abstract_like(shapes, shardings))
    if data_state and hasattr(prompt_iter, "set_state"):
      prompt_iter.set_state(data_state)
    logging.info("%s: resumed from step %d in %s", desc, start, workdir)
  else:
    start = 0
    state = loop.init_state(params, optimizer, shardings, config.seed, master_dtype)

  rep = NamedSharding(mesh, P())
  step = loop.make_train_step(loss_fn, optimizer, schedule, k, mb_sh, with_frozen=frozen is not None)
  if frozen is None:
    step_fn = jax.jit(step, in_shardings=(shardings, b_sh), out_shardings=(shardings, rep),
                      donate_argnums=(0,))
  else:
    f_sh = mesh_lib.param_shardings(jax.eval_shape(lambda x: x, frozen), mesh, rules)
    frozen = jax.device_put(frozen, f_sh)
    jitted = jax.jit(step, in_shardings=(shardings, b_sh, f_sh), out_shardings=(shardings, rep),
                     donate_argnums=(0,))
    step_fn = lambda st, b: jitted(st, b, frozen)
  writer = metrics_lib.MetricsWriter(workdir, total, start, bool(tc.tensorboard),
                                     jax.process_index() == 0, desc)
  rollout_root = jax.random.PRNGKey(int(config.seed) + 1)
  ckpt_every = max(int(tc.checkpoint_every), 1)
  last_saved = start if start else None
  curve, best = [], None   # best: ((recall, valid rate), step, params copy)

  def run_validation(s: int) -> dict:
    nonlocal best
    vm = {n: float(v) for n, v in validate(state["params"]).items()}
    curve.append({"step": s, **vm})
    key = (vm["valid_recall@1"], vm.get("valid_valid_rate", 0.0))
    if keep_best and (best is None or key > best[0]):
      best = (key, s, jax.tree_util.tree_map(jnp.copy, state["params"]))
    return vm

  validating = validate is not None and validate_every > 0
  try:
    if validating:
      logging.info("%s: step %d validation %s", desc, start, run_validation(start))
    for s in range(start + 1, total + 1):
      t0 = time.perf_counter()
      prompts = next(prompt_iter)
      batch, host_m = make_batch(state["params"], prompts, jax.random.fold_in(rollout_root, s))
      t1 = time.perf_counter()
      state, m = step_fn(state, mesh_lib.shard_batch(batch, b_sh, gb))
      m = {n: float(v) for n, v in jax.device_get(m).items()}
      # Host metrics (rewards, valid rate, ...) of this process's rows: averaged over processes.
      host_m = {n: float(np.mean(v)) for n, v in zip(host_m, zip(*multihost.allgather(
          "rollout_metrics", [float(x) for x in host_m.values()])))} if host_m else host_m
      m.update(host_m)
      m.update(rollout_time_s=t1 - t0, update_time_s=time.perf_counter() - t1)
      if validating and (s % validate_every == 0 or s == total):
        m.update(run_validation(s))
      loop.stop_if_not_finite(m, s, total, desc, writer, manager, last_saved)
      writer.write(s, m)
      writer.bar(s, m)
      if s % ckpt_every == 0 or s == total:
        ckpt_lib.save(manager, s, state, ckpt_lib.gather_data_state(loop.iter_state(prompt_iter)))
        last_saved = s
    manager.wait_until_finished()
  finally:
    writer.close()
    manager.close()
  if best is not None:
    state = dict(state, params=best[2])
  return dict(state, valid_curve=curve, best_step=None if best is None else best[1])
