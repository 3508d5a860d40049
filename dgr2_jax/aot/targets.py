"""Compile-only targets: the accelerators a program is built for, named as users name them.

  h100, h100x8, h200x8      one host of N GPUs (`h100` = 1); H100 80GB / H200 141GB SXM
  h100x8x2, h200x8x4        H hosts of N GPUs each (processes = H)
  v5e-4, v5e-32, v6e-8      TPU slices by chip count (v5e / v6e: the number counts chips)
  v5p-8, v5p-16, v4-32      ... by TensorCore count (v4 / v5p: 2 cores a chip, so v5p-16 = 8 chips)
  v5p:2x2x2, v5e:4x8        ... by libtpu topology (chips per dimension)

`resolve(name)` gives a `Target`: backend, devices (every host's), processes, per-device memory,
peak dense bf16 FLOP/s and HBM bandwidth (for reports), SM count (GPU) and the topology JAX's
compilers are given. `devices(target)` gives compile-only devices of that topology
(`jax.experimental.topologies.get_topology_desc`: libtpu for TPUs, the CUDA PJRT plugin with a
GpuTargetConfigProto from `gpu_specs/` for GPUs); they compile but never run. `compile_for(name)`
is the context in which every route choice and mesh of the project follows the target
(dgr2_jax/platform.py), so `jax.jit(f).lower(...).compile()` inside it builds the program that
target runs, on any machine with the compilers (`pip install -e ".[aot]"`).

Slices and hosts: a TPU v5e / v6e slice of up to 8 chips is one host, larger ones have 4 chips a
host (2x2), as do v4 / v5p; a GPU host is one NVLink domain (XLA's GPU topology "H x 1 x N": H
slices of one host of N devices). A multi-host target's devices are every host's, each with its
`process_index`, so meshes and per-process batch shapes come out as on the cluster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import re
from typing import Iterator

from dgr2_jax import platform

AOT_EXTRA = 'pip install -e ".[aot]"'   # setup.py's extra: libtpu and the CUDA compiler plugin
_SPECS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_specs")


@dataclasses.dataclass(frozen=True)
class Chip:
  backend: str             # 'gpu' | 'tpu'
  memory_bytes: int        # HBM per device
  peak_bf16_flops: float   # dense, per device (vendor datasheets, no sparsity)
  hbm_bytes_per_s: float
  sms: int = 0             # GPU streaming multiprocessors
  spec: str = ""           # GPU: gpu_specs/ file (device figures above are read from it)
  dims: int = 0            # TPU: torus dimensions (2: v5e / v6e, 3: v4 / v5p)
  cores_per_chip: int = 1  # TPU: what the slice name counts per chip (v4 / v5p: 2 TensorCores)
  chip_config: str = ""    # TPU: libtpu's chip_config_name ('megacore': a chip's 2 cores as one device)


# Per chip (one JAX device each: v4 / v5p run their two cores as one 'megacore' device). A TPU's
# memory is the HBM XLA:TPU gives a program, as its compiler states it when one exceeds it
# ("exceeds available HBM (31.25G)" on v6e): a little under the chip's nominal 32 / 16 / 96 GiB.
CHIPS = {
    "h100": Chip("gpu", 0, 989e12, 0.0, spec="h100_sxm.txtpb"),
    "h200": Chip("gpu", 0, 989e12, 0.0, spec="h200_sxm.txtpb"),
    "v4": Chip("tpu", int(30.75 * 2**30), 275e12, 1.228e12, dims=3, cores_per_chip=2, chip_config="megacore"),
    "v5e": Chip("tpu", int(15.75 * 2**30), 197e12, 0.819e12, dims=2, chip_config="default"),
    "v5p": Chip("tpu", int(95.74 * 2**30), 459e12, 2.765e12, dims=3, cores_per_chip=2, chip_config="megacore"),
    "v6e": Chip("tpu", int(31.25 * 2**30), 918e12, 1.64e12, dims=2, chip_config="default"),
}
# The targets docs, tests and CI name (any name of the module docstring's forms resolves).
NAMED = ("h100", "h100x2", "h100x8", "h200", "h200x8", "h100x8x2", "h200x8x2",
         "v5e-4", "v5e-8", "v5e-32", "v5p-8", "v5p-16", "v5p-64", "v6e-8", "v6e-32")


class TargetError(ValueError):
  """An unknown target or a missing compiler: the message is one line naming the fix."""


class DoesNotFit(RuntimeError):
  """A program compiled for a target needs more memory per device than the target has (one line)."""


@dataclasses.dataclass(frozen=True)
class Target:
  name: str                  # as resolved, e.g. 'h100x8x2', 'v5p-16'
  chip: str                  # a key of CHIPS
  backend: str               # 'gpu' | 'tpu'
  num_devices: int           # every host's
  processes: int             # hosts
  topology: str              # TPU: libtpu's 'v5p:2x2x2'; GPU: XLA's 'slices x hosts x devices', '2x1x8'
  memory_bytes: int          # per device
  peak_bf16_flops: float     # per device
  hbm_bytes_per_s: float     # per device
  sms: int = 0               # GPU
  host_bounds: tuple = ()    # TPU: chips per host along each dimension

  @property
  def devices_per_process(self) -> int:
    return self.num_devices // self.processes


def known() -> str:
  return ", ".join(NAMED) + " (or hNNNxN[xH], vXX-N, vXX:AxB[xC])"


def _unknown(name: str, why: str = "") -> TargetError:
  return TargetError(f"unknown compile target {name!r}{': ' + why if why else ''}; known targets: {known()}")


@functools.lru_cache(maxsize=None)
def gpu_spec(chip: str) -> str:
  """The GpuTargetConfigProto text of a GPU chip (package data)."""
  with open(os.path.join(_SPECS, CHIPS[chip].spec)) as f:
    return f.read()


def _spec_number(text: str, field: str) -> float:
  return float(re.search(rf"\b{field}:\s*([\d.]+)", text).group(1))


def resolve(name: str) -> Target:
  """The target `name` names (module docstring); TargetError (one line) when it names none."""
  key = str(name).strip().lower()
  m = re.fullmatch(r"(h100|h200)(?:x(\d+))?(?:x(\d+))?", key)
  if m:
    per_host, hosts = int(m.group(2) or 1), int(m.group(3) or 1)
    if not 1 <= per_host <= 8 or hosts < 1:
      raise _unknown(name, "a GPU host holds 1 to 8 GPUs")
    return _gpu(key, m.group(1), per_host, hosts)
  m = re.fullmatch(r"(v4|v5e|v5p|v6e)-(\d+)", key)
  if m:
    chip = CHIPS[m.group(1)]
    n = int(m.group(2))
    if n % chip.cores_per_chip:
      raise _unknown(name, f"{m.group(1)}-N counts {chip.cores_per_chip} cores a chip")
    return _tpu(key, m.group(1), _default_shape(name, n // chip.cores_per_chip, chip.dims))
  m = re.fullmatch(r"(v4|v5e|v5p|v6e):(\d+(?:x\d+)+)", key)
  if m:
    shape = tuple(int(x) for x in m.group(2).split("x"))
    if len(shape) != CHIPS[m.group(1)].dims:
      raise _unknown(name, f"{m.group(1)} topologies have {CHIPS[m.group(1)].dims} dimensions")
    return _tpu(key, m.group(1), shape)
  raise _unknown(name)


def _gpu(name: str, chip: str, per_host: int, hosts: int) -> Target:
  spec = gpu_spec(chip)
  return Target(name, chip, "gpu", per_host * hosts, hosts, f"{hosts}x1x{per_host}",
                int(_spec_number(spec, "device_memory_size")), CHIPS[chip].peak_bf16_flops,
                _spec_number(spec, "memory_bandwidth"), sms=int(_spec_number(spec, "core_count")))


def _default_shape(name: str, chips: int, dims: int) -> tuple:
  """The slice shape a chip count is sold as: 2-D 1x1, 1x2, 2x2, 2x4, 4x4, 4x8, ...; 3-D 2x2x1,
  2x2x2, 2x2x4, 2x4x4, 4x4x4, 4x4x8, ... (the smaller dimensions first)."""
  if chips < 1 or chips & (chips - 1):
    raise _unknown(name, "name a power-of-two chip count, or the topology (e.g. v5p:2x2x3)")
  if dims == 2:
    a, b = 1, 1
    while a * b < chips:
      a, b = (a, 2 * b) if b <= a else (2 * a, b)
    return a, b
  if chips < 4:
    raise _unknown(name, "3-D slices start at 4 chips (2x2x1)")
  x, y, z = 2, 2, 1
  while x * y * z < chips:
    x, y, z = (2 * x, y, z) if x < y else (x, 2 * y, z) if y < z else (x, y, 2 * z)
  return x, y, z


def _tpu(name: str, chip: str, shape: tuple) -> Target:
  c = CHIPS[chip]
  chips = math.prod(shape)
  if c.dims == 2 and chips <= 8:   # v5e / v6e: up to 8 chips on one host
    bounds = shape + (1,)
  else:
    bounds = (2, 2, 1)
  full = shape + (1,) * (3 - len(shape))
  if any(s % b for s, b in zip(full, bounds)):
    raise _unknown(name, f"{'x'.join(map(str, shape))} does not split into hosts of {'x'.join(map(str, bounds))} chips")
  hosts = chips // math.prod(bounds)
  return Target(name, chip, "tpu", chips, hosts, f"{chip}:{'x'.join(map(str, shape))}", c.memory_bytes,
                c.peak_bf16_flops, c.hbm_bytes_per_s, host_bounds=bounds)


@functools.lru_cache(maxsize=None)
def _topology_devices(t: Target) -> tuple:
  from jax.experimental import topologies
  # libtpu takes a machine-wide lock (/tmp/libtpu_lockfile) when it loads, as if it drove the TPU:
  # a second process compiling for a TPU (another compile, a parallel test worker: tests/conftest.py
  # sets it before JAX starts) would fail. A compile-only client drives no chip, so any number may
  # load it. Set here, not at import: `main` imports this module, and a run on a real TPU keeps the lock.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    if t.backend == "tpu":
      topo = topologies.get_topology_desc(topology_name=t.topology, platform="tpu", num_slices=1,
                                          chip_config_name=CHIPS[t.chip].chip_config,
                                          chips_per_host_bounds=t.host_bounds)
    else:
      topo = topologies.get_topology_desc(t.chip, platform="cuda", target_config=gpu_spec(t.chip),
                                          topology=t.topology)
  except (RuntimeError, NotImplementedError) as e:
    # jax without libtpu: RuntimeError('JAX TPU support not installed ...'); without the CUDA plugin:
    # NotImplementedError('topology not implemented for cuda').
    missing = "TPU support not installed" in str(e) or "not implemented for cuda" in str(e)
    if not missing:
      raise
    what = "JAX's TPU compiler (libtpu)" if t.backend == "tpu" else "JAX's CUDA compiler plugin"
    raise TargetError(f"compiling for {t.name} needs {what}: {AOT_EXTRA}") from None
  devs = tuple(topo.devices)
  if len(devs) != t.num_devices or len({d.process_index for d in devs}) != t.processes:
    raise RuntimeError(f"{t.name}: the topology has {len(devs)} devices on "
                       f"{len({d.process_index for d in devs})} hosts, expected {t.num_devices} on {t.processes}")
  return devs


def devices(target: str | Target) -> list:
  """Compile-only devices of `target` (every host's, in the topology's order); TargetError (one
  line naming the fix) for an unknown target or a missing compiler."""
  return list(_topology_devices(resolve(target) if isinstance(target, str) else target))


def available(backend: str) -> bool:
  """Whether this machine can compile for `backend` ('gpu' / 'tpu'): the aot extra is installed."""
  try:
    devices("h100" if backend == "gpu" else "v5e-1")
    return True
  except TargetError:
    return False


@contextlib.contextmanager
def compile_for(target: str | Target) -> Iterator[Target]:
  """Inside the block, route choices and meshes follow `target` (dgr2_jax/platform.py): a program
  traced there with its arguments on the target's devices (a mesh from `platform.devices()`, or
  `hlo.compile_program`, which puts unsharded arguments on the target's first device) is the
  program that target runs. Eager operations still run on the host (compile-only devices run
  nothing)."""
  t = resolve(target) if isinstance(target, str) else target
  with platform.target(t.backend, devices(t), t.sms, t.name):
    yield t
