"""The platform a program is built for: the one place route choices read it.

Every choice that depends on the hardware (the attention route 'auto' takes, whether a Pallas
kernel runs compiled or in interpret mode, the decode KV write, the SM count the split-key kernel
sizes its grid by, the devices and processes a mesh is laid over) asks this module, never
`jax.default_backend()` or `jax.devices()` directly. By default the answer is the host's: the
backend JAX runs on and its devices. Inside `target(...)` it is a compile-only target's (an H100
mesh, a TPU slice: see `dgr2_jax.aot`), so a CPU machine traces exactly the program that target
would run.

  with platform.target("gpu", devices=topology_devices, sms=132):
    jax.jit(step).lower(...).compile()   # cuDNN / Triton kernels, GPU meshes, 'fused' KV writes

The choices are made while JAX traces, so the target is also part of JAX's jit cache key (a JAX
user context): a function traced for the host is traced again inside `target(...)`, never served
from the host's cache, and the other way round.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator, Sequence

import jax

BACKENDS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class Target:
  backend: str                       # 'cpu' | 'gpu' | 'tpu'
  devices: tuple | None = None       # the target's (compile-only) devices, every host's; None: jax.devices()
  sms: int = 0                       # GPU streaming multiprocessors per device (0: unknown)
  name: str = ""                     # e.g. 'h100x8', 'v5e-32'


_TARGET: contextvars.ContextVar[Target | None] = contextvars.ContextVar("dgr2_target", default=None)
# Part of every jit cache key (tracing, lowering, compiling): (backend, name, devices, sms) or None.
_JIT_KEY = jax.make_user_context(None)


@contextlib.contextmanager
def target(backend: str, devices: Sequence | None = None, sms: int = 0, name: str = "") -> Iterator[Target]:
  """Route choices and meshes follow `backend` / `devices` inside the block (compile-only targets)."""
  if backend not in BACKENDS:
    raise ValueError(f"platform.target: backend must be one of {BACKENDS}, got {backend!r}")
  t = Target(backend, tuple(devices) if devices is not None else None, int(sms), name)
  token = _TARGET.set(t)
  try:
    with _JIT_KEY((backend, name, None if t.devices is None else len(t.devices), t.sms)):
      yield t
  finally:
    _TARGET.reset(token)


def current() -> Target | None:
  """The compile-only target in force, or None (the host's backend)."""
  return _TARGET.get()


def backend() -> str:
  """'cpu', 'gpu' or 'tpu': the target's backend, else the host's (`jax.default_backend()`)."""
  t = _TARGET.get()
  return t.backend if t is not None else jax.default_backend()


def devices() -> list:
  """The devices a mesh is laid over (every process's): the target's, else `jax.devices()`."""
  t = _TARGET.get()
  return list(t.devices) if t is not None and t.devices is not None else jax.devices()


def process_count() -> int:
  """Processes (hosts) the devices belong to: the target's (its devices' process indices), else
  `jax.process_count()`."""
  t = _TARGET.get()
  if t is None or t.devices is None:
    return jax.process_count()
  return len({d.process_index for d in t.devices})


def num_sms(default: int) -> int:
  """Streaming multiprocessors per GPU: the target's, else the first device's `core_count`;
  `default` off the GPU or when neither says."""
  t = _TARGET.get()
  if t is not None:
    return t.sms or default
  dev = jax.devices()[0]
  return int(getattr(dev, "core_count", 0) or default) if dev.platform == "gpu" else default


def interpret_pallas(kernel_backend: str) -> bool:
  """Whether a Pallas kernel written for `kernel_backend` ('gpu' Triton, 'tpu' Mosaic) must run in
  interpret mode: off its own backend, where no compiler for it exists."""
  return backend() != kernel_backend
