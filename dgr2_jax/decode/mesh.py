"""The decode mesh: every decoder (eval, generate, bench, rollouts, the server) over ("data", "tensor").

  data    the rows of a batch: each device of a `data` group decodes its own rows (the batch is padded
          to a multiple of the data size with copies of its last row; their outputs are dropped);
  tensor  the model: attention heads (q/k/v column-split, o_proj row-split), the MLP (gate/up
          column-split, down row-split), the LM head and the embedding over the vocabulary, and
          the KV cache over its kv heads. An 8B model's batch-1 decode then reads 1/tensor of the
          weights per device and step.

Parameters are placed by the training code's logical-axis machinery (`model.sharding.logical_to_spec`
with `qwen3.PARAM_LOGICAL_AXES`) under the decode rules `RULES`; a dimension that does not divide
is replicated (a tiny model with 2 kv heads on tensor=8 replicates its k/v projections and cache).
Inside the jitted decoders `constrain_state` pins the loop state (rows over data, the caches over
kv heads) so XLA partitions the loop per row and per head instead of gathering the cache or the
window's hidden states. Every reduction over the vocabulary (max, first argmax, logsumexp, the
inverse-CDF draw) is a reduction over a sharded dimension that XLA completes across the shards, so
the chosen token is the one device's (tests/test_decode_mesh.py checks token equality).

Rows' random keys depend only on their global row index (the decoders split the call's key per
row, and `jax.random.split(key, n)[i]` does not depend on n), so the data size changes no output.
Multi-process: every process holds the whole host batch; `put_rows` builds the global arrays from
each process's devices' slices and `take_rows` gathers what a process cannot address.

The mesh for a run comes from `config.decode.mesh` ({data, tensor}; 0 or -1 = all remaining
devices), built by `from_config`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import jax
from jax.sharding import Mesh, NamedSharding

from dgr2_jax import platform
from dgr2_jax.model import sharding as sharding_lib   # the logical-axis rules -> specs, as training's

AXES = ("data", "tensor")
# Logical axis -> mesh axes for decoding (model.sharding.logical_to_spec applies them). 'batch' over
# ('data', 'fsdp') so a training mesh (rollouts) shards rows over both of its row axes.
RULES = (("batch", ("data", "fsdp")), ("vocab", "tensor"), ("heads", "tensor"), ("kv_heads", "tensor"),
         ("mlp", "tensor"), ("embed", None), ("length", None))


def mesh_shape(section, num_devices: int) -> tuple[int, int]:
  """(data, tensor) of a `decode.mesh` section on `num_devices`; 0/-1 = all remaining devices
  (at most one axis), the product may use fewer devices than there are (the first ones)."""
  section = section or {}
  dims = {}
  for a, default in (("data", -1), ("tensor", 1)):
    v = section.get(a, default)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < -1:
      raise ValueError(f"config.decode.mesh.{a} must be an int >= -1 (0 or -1 = all remaining devices), got {v!r}")
    dims[a] = -1 if int(v) in (0, -1) else int(v)
  free = [a for a in AXES if dims[a] == -1]
  if len(free) > 1:
    raise ValueError("config.decode.mesh: at most one of data, tensor may be 0/-1 (all remaining devices), got "
                     f"data={dims['data']} tensor={dims['tensor']}")
  if free:
    known = dims[AXES[1 - AXES.index(free[0])]]
    if num_devices % known:
      other = AXES[1 - AXES.index(free[0])]
      raise ValueError(f"config.decode.mesh.{other}={known} does not divide the {num_devices} devices")
    dims[free[0]] = num_devices // known
  if dims["data"] * dims["tensor"] > num_devices:
    raise ValueError(f"config.decode.mesh: data={dims['data']} x tensor={dims['tensor']} needs "
                     f"{dims['data'] * dims['tensor']} devices, {num_devices} available")
  return dims["data"], dims["tensor"]


def make_mesh(data: int = -1, tensor: int = 1, devices=None) -> Mesh:
  """A ("data", "tensor") mesh over the first data * tensor of `devices` (default all global
  devices of the platform built for: `platform.devices()`), tensor the faster-varying axis (a
  host's neighbouring devices share a model)."""
  devices = list(platform.devices() if devices is None else devices)
  d, t = mesh_shape({"data": data, "tensor": tensor}, len(devices))
  return Mesh(np.asarray(devices[:d * t], dtype=object).reshape(d, t), AXES)


def from_config(config) -> Mesh | None:
  """The decode mesh of a run (`config.decode.mesh`, default every device on the data axis);
  None on a single device (the decoders' plain single-device path)."""
  dec = config.get("decode", None) if hasattr(config, "get") else None
  section = dec.get("mesh", None) if dec is not None else None
  section = dict(section) if section is not None else {}
  d, t = mesh_shape(section, len(platform.devices()))
  return make_mesh(d, t) if d * t > 1 else None


def describe(mesh: Mesh | None) -> str:
  """'8 x gpu (data 4, tensor 2)': what a benchmark row was timed on."""
  if mesh is None:
    return f"1 x {platform.backend()} (data 1, tensor 1)"
  kind = mesh.devices.flat[0].platform
  return f"{mesh.size} x {kind} (" + ", ".join(f"{a} {mesh.shape[a]}" for a in mesh.axis_names) + ")"


def _rules(mesh: Mesh):
  """RULES restricted to the axes `mesh` has (a decode mesh has no 'fsdp', a training mesh has)."""
  out = []
  for name, axes in RULES:
    axes = () if axes is None else ((axes,) if isinstance(axes, str) else axes)
    out.append((name, tuple(a for a in axes if a in mesh.axis_names)))
  return tuple(out)


def sharding(mesh: Mesh, logical, shape) -> NamedSharding:
  """NamedSharding of an array with logical axes `logical` (None = replicated dimension)."""
  return NamedSharding(mesh, sharding_lib.logical_to_spec(tuple(logical), tuple(shape), mesh, _rules(mesh)))


def param_shardings(mesh: Mesh, params):
  """NamedSharding pytree of a parameter pytree (arrays or ShapeDtypeStructs) under RULES."""
  return sharding_lib.param_shardings(params, mesh, _rules(mesh))


def _put(x, sh: NamedSharding):
  """One array into `sh`: each device receives only its slice (host arrays, any process count)."""
  if isinstance(x, jax.Array):
    return jax.device_put(x, sh)
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])


def put_params(mesh: Mesh, params):
  """Parameters (host or device arrays) placed in the mesh's shardings, slice by slice."""
  return jax.tree_util.tree_map(_put, params, param_shardings(mesh, params))


def data_size(mesh: Mesh | None) -> int:
  if mesh is None:
    return 1
  return int(np.prod([mesh.shape[a] for a in ("data", "fsdp") if a in mesh.axis_names]))


def put_rows(mesh: Mesh, *arrays):
  """Host arrays [n, ...] -> global arrays [n_pad, ...] with rows over the data axis, n_pad the
  next multiple of the data size (pad rows: copies of the last row). Every process passes the
  whole host batch and keeps its devices' slices. -> (arrays, n)."""
  n = len(arrays[0])
  n_pad = -(-n // data_size(mesh)) * data_size(mesh)
  out = []
  for x in arrays:
    x = np.asarray(x)
    if n_pad > n:
      x = np.concatenate([x, np.repeat(x[-1:], n_pad - n, axis=0)])
    out.append(_put(x, sharding(mesh, ("batch",) + (None,) * (x.ndim - 1), x.shape)))
  return tuple(out), n


def to_host(x):
  """NumPy of a decoder output, gathered from every process when not fully addressable."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(x)


def take_rows(out: dict, n: int, n_pad: int, host: bool):
  """A decoder's outputs [n_pad, ...] without the pad rows -> [n, ...]: device arrays (`host`
  False, sliced on device) or NumPy (`host` True; gathered from every process when not fully
  addressable). Batch-wide scalars pass through."""
  def one(x):
    rows = x.ndim > 0 and x.shape[0] == n_pad
    if host:
      x = to_host(x)
    return x[:n] if rows and n != n_pad else x
  return {k: one(v) for k, v in out.items()}


def _pin(mesh: Mesh, x, logical):
  return jax.lax.with_sharding_constraint(x, sharding(mesh, logical, x.shape))


def constrain_cache(mesh: Mesh | None, cache):
  """KV cache [B,S,K,D] per layer: rows over data, kv heads over tensor (replicated where K does
  not divide), inside jit."""
  if mesh is None or mesh.size == 1:
    return cache
  return jax.tree_util.tree_map(lambda x: _pin(mesh, x, ("batch", "length", "kv_heads", None)), cache)


def constrain_state(mesh: Mesh | None, state, rows: int):
  """A decoder's loop state inside jit (a dict or a `flax.struct` dataclass, nested ones alike):
  entries named '*cache' as caches, every other array with `rows` leading rows over the data axis
  (its other dimensions replicated: the carried hidden states stay whole on every tensor device, as
  the layers' inputs are), scalars as they are."""
  if mesh is None or mesh.size == 1:
    return state
  if dataclasses.is_dataclass(state):
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    return state.replace(**constrain_state(mesh, fields, rows))
  out = {}
  for k, v in state.items():
    if k.endswith("cache"):
      out[k] = constrain_cache(mesh, v)
    elif dataclasses.is_dataclass(v):
      out[k] = constrain_state(mesh, v, rows)
    elif getattr(v, "ndim", 0) and v.shape[0] == rows:
      out[k] = _pin(mesh, v, ("batch",) + (None,) * (v.ndim - 1))
    else:
      out[k] = v
  return out
