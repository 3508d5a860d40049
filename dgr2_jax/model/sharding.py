"""Logical axis names -> NamedShardings (MaxText style), shared by training (train/mesh.py) and
decoding (decode/mesh.py): each dimension takes the mesh axes its logical name maps to, dropping
axes of size 1 and axes already used by the array, then the longest prefix whose size product
divides the dimension; nothing divides -> replicated."""

from __future__ import annotations

from typing import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dgr2_jax.model import qwen3


def _rules_dict(rules) -> dict:
  out = {}
  for name, axes in rules:
    if axes is None:
      axes = ()
    elif isinstance(axes, str):
      axes = (axes,)
    out[name] = tuple(axes)
  return out


def logical_to_spec(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules) -> P:
  """PartitionSpec for one array (the divisibility rule of the module docstring)."""
  rd = _rules_dict(rules)
  used: set = set()
  spec = []
  for name, size in zip(logical_axes, shape):
    cand = [a for a in (rd.get(name, ()) if name is not None else ())
            if mesh.shape[a] > 1 and a not in used]
    chosen: list = []
    prod = 1
    for a in cand:
      if size % (prod * mesh.shape[a]):
        break
      chosen.append(a)
      prod *= mesh.shape[a]
    used.update(chosen)
    spec.append(None if not chosen else (chosen[0] if len(chosen) == 1 else tuple(chosen)))
  return P(*spec)


def param_shardings(params, mesh: Mesh, rules):
  """NamedSharding pytree for a parameter pytree (arrays or ShapeDtypeStructs)."""
  axes = qwen3.param_logical_axes(params)
  return jax.tree_util.tree_map(
      lambda a, x: NamedSharding(mesh, logical_to_spec(a, x.shape, mesh, rules)),
      axes, params, is_leaf=lambda x: isinstance(x, tuple))
