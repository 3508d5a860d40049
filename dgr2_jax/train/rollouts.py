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

On-policy training (`train_on_policy`): `loop.train` with a step-batch source
(`on_policy_batches`): per step it draws a batch of prompts from `prompt_iter` (a checkpointable
grain iterator), calls `make_batch(params, prompts, step_key)` with the CURRENT params (rollouts,
reward or teacher scoring, replay inputs; host-side), then `loop.train` runs the jitted train step
on the result. Set-up, checks, resume, the data-iterator state, the NaN guard, validation and the
metric sinks are `loop.train`'s; `make_batch`'s host metrics (reward, NFE, ...) and the rollout
time are logged with the step's metrics. The rollout key of step s is `fold_in(PRNGKey(seed + 1),
s)`, so a resumed run replays exactly.

Dynamic sampling (DAPO; `DynamicSampling`, the RL stages' `dynamic_sampling` and
`min_informative_groups`): a step may draw up to `max_draws` prompt batches, one after another
from the same `prompt_iter` (its checkpointed position then covers every draw, so a resumed run
replays the same draws). Draw d > 0 rolls out with `fold_in(step key, d)`. After each draw the
groups with a loss token (a group without reward variance has its loss mask zeroed) are counted
over all processes, so every process takes the same decision; the step stops once the count
reaches `min_informative` or after `max_draws` draws. The train batch always has the static
shape of `max_draws` draws (`train.batch_size` = max_draws x rows per draw, the micro-batch count
scaled alike so a micro-batch keeps its size): the draws made, then copies of the first draw with
loss mask 0 in place of the draws not made, the rows ordered so that every micro-batch holds one
draw (`_pad_draws`). The token-level loss is normalised over the loss tokens, so it is the mean
over the kept groups of every draw made, and `loop.make_train_step` skips the micro-batches
without a loss token: the padding costs neither loss nor time. No loss token in any draw: no
update, as with one draw. Each process's rows are its share of every draw, in that order: the
global row order then depends on the process count, the loss (a sum over tokens) does not.
`max_draws` 1 is the plain step.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from dgr2_jax import multihost
from dgr2_jax import platform
from dgr2_jax.decode import sampler
from dgr2_jax.train import loop
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
  mesh = jax.sharding.Mesh(np.asarray(platform.devices()), ("rows",))
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
  Several processes: every process widens its rows' layout to the largest cap of any process (the
  global batch has one shape; `replay.widen_segments` keeps every prediction).
  """
  cs = rollouts["commit_step"] if commit_step is None else commit_step
  seg = replay.build_segments(rollouts["tokens"], cs, block_size, max_segments_per_block or block_size,
                              mask_id)
  if multihost.is_multi():  # one layout for the global batch: each process's rows widened to the largest cap
    r = cs.shape[1]
    cap = max(int(c) for c in multihost.allgather("replay_cap", replay.segments_per_block(seg["seg_tokens"], r)))
    seg["seg_tokens"], seg["pred_seg"] = replay.widen_segments(seg["seg_tokens"], seg["pred_seg"], r, cap)
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


@dataclasses.dataclass(frozen=True)
class DynamicSampling:
  """DAPO's dynamic sampling (module docstring): up to `max_draws` prompt batches per step, until
  `min_informative` groups of `group_size` rollouts (over all processes) have a loss token."""
  max_draws: int = 1
  min_informative: int = 1
  group_size: int = 1
  micro_per_draw: int = 1   # the update's micro-batches per draw (the stage's grad_accum_steps)


def informative_groups(loss_mask: np.ndarray, group_size: int) -> int:
  """The groups of `group_size` consecutive rows with at least one loss token."""
  m = np.asarray(loss_mask).reshape(-1, group_size * int(np.prod(np.shape(loss_mask)[1:], dtype=int)))
  return int(m.any(-1).sum())


def _pad_draws(draws: list[dict], max_draws: int, micro_per_draw: int = 1) -> dict:
  """The draws' batches, then copies of the first with loss mask 0 (and zero advantages) up to
  `max_draws` (real inputs, so the padding's replay stays finite), with rows ordered so that
  each of the update's `max_draws * micro_per_draw` micro-batches (`loop._split_micro` takes rows
  i, i + k, i + 2k, ...) holds rows of one draw only: micro-batch d * micro_per_draw + m gets the
  rows of draw d that micro-batch m would get with one draw. A micro-batch of a draw not made then
  has no loss token and `loop.make_train_step` skips its forward and backward. `draw_rows` undoes
  the order."""
  draws = _same_segments(draws)
  pad = {k: (np.zeros_like(v) if k in ("loss_mask", "advantages") else v) for k, v in draws[0].items()}
  parts = list(draws) + [pad] * (max_draws - len(draws))
  for k in draws[0]:
    if len({np.shape(pt[k]) for pt in parts}) > 1:
      raise ValueError(f"dynamic sampling: field {k!r} has shapes {[np.shape(pt[k]) for pt in parts]} "
                       "across the step's draws")
  return {k: _interleave(np.stack([np.asarray(pt[k]) for pt in parts]), micro_per_draw) for k in draws[0]}


def _same_segments(draws: list[dict]) -> list[dict]:
  """Draws whose replays hold different numbers of segments per block (each batch's cap is its own
  most steps in a block, replay.build_segments) widened to the largest: the same predictions."""
  if "seg_tokens" not in draws[0] or len({np.shape(d["seg_tokens"]) for d in draws}) == 1:
    return draws
  r = np.shape(draws[0]["clean"])[1]
  cap = max(replay.segments_per_block(d["seg_tokens"], r) for d in draws)
  out = []
  for d in draws:
    seg, pred = replay.widen_segments(d["seg_tokens"], d["pred_seg"], r, cap)
    out.append(dict(d, seg_tokens=seg, pred_seg=pred))
  return out


def _interleave(x: np.ndarray, g: int) -> np.ndarray:
  """[D, r, ...] -> [D * r, ...] with row j * D * g + d * g + m = draw d's row j * g + m (r % g == 0;
  otherwise the draws one after another, every micro-batch then mixing draws)."""
  d, r = x.shape[:2]
  if r % g:
    return x.reshape((d * r,) + x.shape[2:])
  return np.swapaxes(x.reshape((d, r // g, g) + x.shape[2:]), 0, 1).reshape((d * r,) + x.shape[2:])


def draw_rows(batch_field: np.ndarray, draw: int, max_draws: int, micro_per_draw: int = 1) -> np.ndarray:
  """Draw `draw`'s rows of one field of a `_pad_draws` batch, in the draw's own order."""
  x = np.asarray(batch_field)
  r = x.shape[0] // max_draws
  g = micro_per_draw if r % micro_per_draw == 0 else r
  return np.swapaxes(x.reshape((r // g, max_draws, g) + x.shape[1:]), 0, 1)[draw].reshape((r,) + x.shape[1:])


def _sample_dynamically(make_batch, prompt_iter, params, key, ds: DynamicSampling) -> tuple[dict | None, dict]:
  """One step's draws (module docstring) -> (padded batch or None, host metrics): the draws'
  metrics averaged over the draws made and the processes, plus `draws`, `informative_groups`
  (global, in the update) and `informative_fraction` (of every group drawn)."""
  draws, metrics, found, groups = [], [], 0, 0
  for d in range(int(ds.max_draws)):
    batch, host_m = make_batch(params, next(prompt_iter), key if d == 0 else jax.random.fold_in(key, d))
    local = [informative_groups(batch["loss_mask"], ds.group_size), len(batch["loss_mask"]) // ds.group_size]
    values = multihost.allgather("dynamic_sampling", [float(x) for x in host_m.values()] + local)
    metrics.append({n: float(np.mean(v)) for n, v in zip(host_m, zip(*values))})
    found += sum(int(v[-2]) for v in values)
    groups += sum(int(v[-1]) for v in values)
    draws.append(batch)
    if found >= ds.min_informative:
      break
  host_m = {n: float(np.mean([m[n] for m in metrics])) for n in metrics[0]}
  host_m.update(draws=float(len(draws)), informative_groups=float(found),
                informative_fraction=found / max(groups, 1), update_skipped=float(found == 0))
  return (None if found == 0 else _pad_draws(draws, int(ds.max_draws), int(ds.micro_per_draw))), host_m


def on_policy_batches(make_batch: Callable[[dict, dict, jax.Array], tuple[dict, dict]], prompt_iter,
                      seed: int, sampling: DynamicSampling | None = None) -> loop.StepBatches:
  """`loop.train`'s step-batch source for on-policy stages: step s draws the next prompts from
  `prompt_iter` and calls `make_batch(params, prompts, fold_in(PRNGKey(seed + 1), s))` with the
  current params. Its host metrics (this process's rows) are averaged over the processes and
  logged with `rollout_time_s`, the seconds the batch took to make.

  A batch with no loss token on any process (`loss_mask` all 0: every GRPO group without reward
  variance) makes no update (`update_skipped` 1): its gradient is zero, and Adam would still move
  the params on its momentum. `sampling` with `max_draws` > 1: dynamic sampling (module docstring)."""
  rollout_root = jax.random.PRNGKey(int(seed) + 1)
  dynamic = sampling is not None and int(sampling.max_draws) > 1

  def make(params, step: int):
    t0 = time.perf_counter()
    key = jax.random.fold_in(rollout_root, step)
    if dynamic:
      batch, host_m = _sample_dynamically(make_batch, prompt_iter, params, key, sampling)
      return batch, dict(host_m, rollout_time_s=time.perf_counter() - t0)
    batch, host_m = make_batch(params, next(prompt_iter), key)
    rows = int(np.asarray(batch["loss_mask"]).any(-1).sum()) if "loss_mask" in batch else 1
    values = multihost.allgather("rollout_metrics", [float(x) for x in host_m.values()] + [rows])
    host_m = {n: float(np.mean(v)) for n, v in zip(host_m, zip(*values))}
    skip = sum(v[-1] for v in values) == 0
    return None if skip else batch, dict(host_m, update_skipped=float(skip),
                                         rollout_time_s=time.perf_counter() - t0)

  return loop.StepBatches(make, prompt_iter)


def train_on_policy(config, workdir: str, *, params, loss_fn: loop.LossFn,
                    make_batch: Callable[[dict, dict, jax.Array], tuple[dict, dict]],
                    prompt_iter, mesh=None, desc: str = "on-policy", frozen=None,
                    validation: loop.Validation | None = None) -> dict:
  """`loop.train` on `on_policy_batches(make_batch, prompt_iter, config.seed)` (see the module
  docstring). `config.train.batch_size` is the number of ROWS `make_batch` returns (prompts per
  step * rollouts per prompt). `frozen` and `validation` are `loop.train`'s; the caller's `params`
  stay intact. Dynamic sampling: `loop.train` on `on_policy_batches(..., sampling)` directly, with
  `sampling.max_draws` x those rows."""
  return loop.train(config, workdir, params=params, loss_fn=loss_fn,
                    step_batches=on_policy_batches(make_batch, prompt_iter, config.seed), mesh=mesh,
                    desc=desc, frozen=frozen, validation=validation)
