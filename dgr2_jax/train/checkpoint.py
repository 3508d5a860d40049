"""Training checkpoints (Orbax): train state + data-iterator state, periodic async saves, keep-N.

Layout: `<workdir>/checkpoints/<step>/{state,data}`. `state` is the train-state dict
{"params", "opt_state", "step", "rng"} (StandardSave, restored straight into the target shardings),
plus "best" (keep_best's kept params) when the loop validates with keep_best; `data` is
{"process_count": n, "states": [each process's batch-iterator `get_state()` dict], "loop": the
loop's JSON state (the validation curve)} as JSON (grain iterators provide `get_state()`; so does
any iterator with `get_state()/set_state(dict)`); a run resumes only under the process count that
wrote it. Every process calls `save`/`restore` on the same directory with its shards of the global
arrays (Orbax writes each shard once, process 0 the metadata). Orbax writes into a temporary
directory and renames it on commit, so a run killed mid-save (a second SIGTERM is not a kill: see
`preemption`) leaves the previous checkpoint as the latest one.

This is the resumable *training* state; the model directory a stage hands to later stages is
written by `dgr2_jax.model.checkpoint.save_model_dir`.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp

from dgr2_jax import multihost


def make_manager(workdir: str, keep: int, async_save: bool = True) -> ocp.CheckpointManager:
  directory = os.path.join(os.path.abspath(workdir), "checkpoints")
  options = ocp.CheckpointManagerOptions(max_to_keep=int(keep), create=True,
                                         enable_async_checkpointing=bool(async_save))
  # Handlers named up front (not inferred at the first save), so `item_metadata` can read a
  # checkpoint's tree before restoring it.
  return ocp.CheckpointManager(directory, options=options, item_handlers={
      "state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler()})


def save(manager: ocp.CheckpointManager, step: int, state, data_state: dict | None, extra: dict | None = None) -> None:
  """Starts an (async) save of `state` and the iterator state at `step`; returns once the arrays
  are copied off the device, so the caller may donate/overwrite them. `extra`: JSON-able loop state
  (the validation curve), returned by `restore`."""
  data = dict(data_state or {}, **({"loop": extra} if extra else {}))
  manager.save(int(step), args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data)), force=True)


def latest_step(manager: ocp.CheckpointManager) -> int | None:
  return manager.latest_step()


def restore(manager: ocp.CheckpointManager, step: int, abstract_state=None):
  """-> (state placed with the shardings of `abstract_state` (None: as saved), this process's
  data-iterator state ({} when none was saved), the `extra` saved with it ({} when none)).
  ValueError (one line naming both counts) when the checkpoint was written by another number of
  processes."""
  out = manager.restore(int(step), args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
  where = os.path.join(str(manager.directory), str(int(step)))
  saved = dict(out["data"] or {})
  extra = saved.pop("loop", None) or {}
  return out["state"], process_data_state(saved, where) or {}, extra


def abstract_like(tree, shardings):
  """ShapeDtypeStructs (with shardings) describing `tree` (arrays or ShapeDtypeStructs)."""
  return jax.tree_util.tree_map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def gather_data_state(local_state: dict | None) -> dict | None:
  """Every process's iterator state (collective: all processes call it) with the process count."""
  states = multihost.allgather("data_state", local_state)
  if all(st is None for st in states):
    return None
  return {"process_count": len(states), "states": states}


def process_data_state(saved: dict, where: str) -> dict | None:
  """This process's iterator state from a saved `data` item; ValueError (one line naming both
  counts) when it was written by another number of processes."""
  if not saved:
    return None
  if "states" not in saved:  # written before per-process states: one process's state
    saved = {"process_count": 1, "states": [saved]}
  n, here = int(saved["process_count"]), multihost.process_count()
  if n != here:
    raise ValueError(f"{where} was written by {n} process(es); this run has {here}: resume it with "
                     f"{n} processes, or start a new workdir")
  return saved["states"][multihost.process_index()]
