"""Device mesh, logical-axis rules -> shardings and batch assembly (multi-process initialisation is
`dgr2_jax.multihost.initialize`, called first by `main`).

Mesh axes are ("data", "fsdp", "tensor"). Every parameter carries logical axis names
(`qwen3.PARAM_LOGICAL_AXES`); the rules table (`config.train.logical_axis_rules`) maps each name to
mesh axes. Sharding rule, applied per dimension in order: take the mesh axes of the dimension's
logical name, drop axes of size 1 and axes already used by an earlier dimension of the same array,
then keep the longest prefix whose size product divides the dimension; if nothing divides, the
dimension is replicated. So a tiny model (hidden 32) on 8 devices simply replicates what does not
split evenly, and the result is always a valid NamedSharding.

Optimizer-state leaves that mirror a parameter (Adam's mu/nu) get that parameter's sharding; other
leaves (counters) are replicated. Batches are sharded on dim 0 over the 'batch' rule.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dgr2_jax import platform
# The logical-axis rules -> shardings live below training and decoding, which both use them.
from dgr2_jax.model.sharding import _rules_dict, logical_to_spec, param_shardings  # noqa: F401

AXES = ("data", "fsdp", "tensor")


def mesh_shape(mesh_cfg, num_devices: int) -> tuple[int, int, int]:
  """Resolves the -1 entry of {data, fsdp, tensor} and checks the product equals num_devices."""
  dims = [int(mesh_cfg[a]) for a in AXES]
  if sum(d == -1 for d in dims) > 1:
    raise ValueError(f"train.mesh: at most one axis may be -1, got {dict(zip(AXES, dims))}")
  known = int(np.prod([d for d in dims if d != -1]))
  if -1 in dims:
    if known <= 0 or num_devices % known:
      raise ValueError(f"train.mesh: {dict(zip(AXES, dims))} does not divide {num_devices} devices")
    dims[dims.index(-1)] = num_devices // known
  if int(np.prod(dims)) != num_devices or min(dims) < 1:
    raise ValueError(f"train.mesh: {dict(zip(AXES, dims))} needs {int(np.prod(dims))} devices, "
                     f"{num_devices} available")
  return tuple(dims)


def check_batch_size(batch_size: int, mesh_cfg, num_devices: int, num_processes: int,
                     field: str = "train.batch_size", grad_accum_steps: int = 1) -> None:
  """ValueError naming `field` unless the global batch splits evenly over the processes (each
  feeds its own rows) and each micro-batch over the mesh's data x fsdp devices."""
  if batch_size % num_processes:
    raise ValueError(f"{field} ({batch_size}) must be divisible by the process count ({num_processes})")
  dims = dict(zip(AXES, mesh_shape(mesh_cfg, num_devices)))
  split = dims["data"] * dims["fsdp"]
  micro = batch_size // max(int(grad_accum_steps), 1)
  if micro % split:
    what = f"{field} / train.grad_accum_steps ({micro})" if grad_accum_steps > 1 else f"{field} ({batch_size})"
    raise ValueError(f"{what} must be divisible by train.mesh data x fsdp ({dims['data']} x {dims['fsdp']} = "
                     f"{split} on {num_devices} devices)")


def make_mesh(mesh_cfg, devices: Sequence[Any] | None = None) -> Mesh:
  """A ("data", "fsdp", "tensor") mesh over `devices` (default: all global devices of the platform
  built for, `platform.devices()`: a compile-only target's inside `platform.target`)."""
  devices = list(platform.devices() if devices is None else devices)
  shape = mesh_shape(mesh_cfg, len(devices))
  try:
    from jax.experimental import mesh_utils  # topology-aware order on accelerators
    arr = mesh_utils.create_device_mesh(shape, devices=devices)
  except Exception:  # pylint: disable=broad-except  (e.g. odd CPU device counts)
    arr = np.asarray(devices, dtype=object).reshape(shape)
  return Mesh(arr, AXES)


def _dict_suffix(path) -> tuple:
  keys = []
  for p in reversed(path):
    if not isinstance(p, jax.tree_util.DictKey):
      break
    keys.append(p.key)
  return tuple(reversed(keys))


def opt_state_shardings(opt_state_shapes, params_shapes, p_shardings, mesh: Mesh):
  """Leaves whose trailing dict path and shape match a parameter get its sharding; else replicated."""
  by_path = {}
  for (path, x), s in zip(jax.tree_util.tree_flatten_with_path(params_shapes)[0],
                          jax.tree_util.tree_leaves(p_shardings)):
    by_path[_dict_suffix(path)] = (tuple(x.shape), s)
  replicated = NamedSharding(mesh, P())

  def pick(path, x):
    hit = by_path.get(_dict_suffix(path))
    if hit is not None and hit[0] == tuple(x.shape):
      return hit[1]
    return replicated
  return jax.tree_util.tree_map_with_path(pick, opt_state_shapes)


def batch_sharding(mesh: Mesh, rules, global_batch: int) -> NamedSharding:
  """Dim 0 over the 'batch' rule's mesh axes (divisibility checked), other dims replicated."""
  spec = logical_to_spec(("batch",), (global_batch,), mesh, rules)
  want = int(np.prod([mesh.shape[a] for a in _rules_dict(rules).get("batch", ()) if a in mesh.shape]))
  got = 1 if spec[0] is None else int(np.prod([mesh.shape[a] for a in np.atleast_1d(spec[0])]))
  if got != want:
    logging.warning("batch %d not divisible by the batch mesh axes (%d devices); batch sharded over %d",
                    global_batch, want, got)
  return NamedSharding(mesh, spec)


def shard_batch(batch: dict, sharding: NamedSharding, global_batch: int) -> dict:
  """Host numpy batch -> global jax arrays.

  Single process: `batch` is the global batch. Multi-process: each process passes its local rows
  (global_batch / process_count of them, in process order) and the global array is assembled with
  `jax.make_array_from_process_local_data`.
  """
  out = {}
  for k, v in batch.items():
    v = np.asarray(v)
    if v.ndim == 0:
      raise ValueError(f"batch field '{k}' is a scalar; every batch field needs a leading batch dim")
    gshape = (global_batch,) + v.shape[1:]
    if jax.process_count() == 1 and v.shape[0] != global_batch:
      raise ValueError(f"batch field '{k}' has {v.shape[0]} rows, train.batch_size is {global_batch}")
    out[k] = jax.make_array_from_process_local_data(sharding, v, gshape)
  return out
