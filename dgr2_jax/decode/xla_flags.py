"""XLA's GPU flags for decoding: command buffers (CUDA graphs) over the whole decode loop.

A decoding step at batch 1 is a few hundred small kernels; launched one by one from the host, the
launches are a visible share of the step (docs/decoding_accelerator.md). XLA's GPU runtime can
record a computation's kernels into a CUDA graph ("command buffer") and replay it with one launch.
Its defaults graph fusions, GEMMs, custom calls and conditionals, but not `while` loops, so the
decoder's loop (decode/sampler.py: a `while_loop` of fixed-count `fori_loop`s) is launched kernel by
kernel. `configure_gpu_flags` adds WHILE to the graphed command types (a loop becomes a CUDA graph
conditional node: the loop runs on the device without a launch per kernel) and graphs every
sequence however short (`--xla_gpu_graph_min_graph_size=1`; XLA's default is 5).

The decode entry points (`python -m dgr2_jax.main`, `python -m dgr2_jax.serve`, the decode
benchmarks) call it before JAX starts its backend: XLA reads `XLA_FLAGS` once, when the first
backend starts. It does nothing when:
  * `XLA_FLAGS` already names a flag it would set (the user's setting wins, flag by flag);
  * `DGR2_COMMAND_BUFFERS=0`: XLA's defaults (everything but loops graphed), or `none`: no command
    buffers at all (`--xla_gpu_enable_command_buffer=`), for A/B timing;
  * `JAX_PLATFORMS` names no GPU platform (a CPU-only run keeps its flags untouched);
  * a backend has already started (the flags would be read too late; it warns).
XLA parses these flags on every platform (a CPU-only jaxlib too), and aborts on a flag it does not
know; every flag here exists in jaxlib 0.10.2 and later. Under the profiler XLA runs a command
buffer's commands one by one (`--xla_enable_command_buffers_during_profiling` is off by default),
so a profile shows each kernel either way.

This module imports nothing from JAX, so it can run before anything else. From a shell,
`python -m dgr2_jax.decode.xla_flags [MODE]` prints the XLA_FLAGS the mode gives (for a script
that starts other programs: `export XLA_FLAGS="$(python -m dgr2_jax.decode.xla_flags)"`).
"""

from __future__ import annotations

import os
import warnings

ENV = "DGR2_COMMAND_BUFFERS"
MODES = {"1": "loops", "on": "loops", "": "loops", "0": "default", "off": "default", "none": "none"}
# Added to XLA's default command types (the +/- form keeps the rest of XLA's defaults).
LOOP_FLAGS = ("--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL", "--xla_gpu_graph_min_graph_size=1")
NONE_FLAGS = ("--xla_gpu_enable_command_buffer=",)
GPU_PLATFORMS = ("cuda", "gpu", "rocm")


def flag_name(flag: str) -> str:
  """'--xla_foo=1' -> 'xla_foo'."""
  return flag.lstrip("-").split("=", 1)[0]


def mode_from_env(env=None) -> str:
  """'loops' (the default), 'default' (XLA's own command buffers) or 'none', from `DGR2_COMMAND_BUFFERS`."""
  env = os.environ if env is None else env
  value = env.get(ENV, "").strip().lower()
  if value not in MODES:
    raise ValueError(f"{ENV}={env.get(ENV)!r}: expected 1 (graph the decode loop, the default), 0 (XLA's "
                     f"defaults) or none (no command buffers)")
  return MODES[value]


def flags_for(mode: str) -> tuple:
  """The flags a command-buffer mode adds ('loops', 'default' or 'none')."""
  return {"loops": LOOP_FLAGS, "default": (), "none": NONE_FLAGS}[mode]


def compose(existing: str, flags) -> tuple:
  """(XLA_FLAGS with each of `flags` appended unless `existing` already sets that flag, the flags
  added). Flags are compared by name, so the user's value is kept whatever it is."""
  have = {flag_name(f) for f in existing.split() if f.startswith("-")}
  added = tuple(f for f in flags if flag_name(f) not in have)
  return " ".join([existing.strip(), *added]).strip(), added


def command_buffers(xla_flags: str) -> str:
  """What `xla_flags` asks of XLA's command buffers (CUDA graphs): 'loops' (the decode loop graphed
  too), 'none' or 'xla default' (a benchmark row's `command_buffers`)."""
  values = [f.split("=", 1)[1] if "=" in f else "" for f in xla_flags.split()
            if flag_name(f) == "xla_gpu_enable_command_buffer"]
  if not values:
    return "xla default"
  if not values[-1]:
    return "none"
  types = [t.strip().upper() for t in values[-1].split(",")]
  return "loops" if ("WHILE" in types or "+WHILE" in types) else values[-1]


def gpu_possible(env=None) -> bool:
  """False when `JAX_PLATFORMS` is set and names no GPU platform."""
  env = os.environ if env is None else env
  platforms = [p.strip().lower() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
  return not platforms or any(p in GPU_PLATFORMS for p in platforms)


def _backend_started() -> bool:
  import sys
  if "jax" not in sys.modules:
    return False
  try:
    from jax._src import xla_bridge
    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError):
    return False


def configure_gpu_flags(command_buffers: bool | str | None = None, env=None) -> tuple:
  """Adds the command-buffer flags of `command_buffers` (True = 'loops', False = 'default', or a
  mode name; None = from `DGR2_COMMAND_BUFFERS`) to `env['XLA_FLAGS']` (default os.environ).
  Returns the flags added (empty when there was nothing to do). See the module docstring."""
  env = os.environ if env is None else env
  if command_buffers is None:
    mode = mode_from_env(env)
  elif isinstance(command_buffers, bool):
    mode = "loops" if command_buffers else "default"
  else:
    mode = command_buffers
  flags = flags_for(mode)
  if not flags or not gpu_possible(env):
    return ()
  value, added = compose(env.get("XLA_FLAGS", ""), flags)
  if added and env is os.environ and _backend_started():
    warnings.warn(f"configure_gpu_flags: JAX's backend has started, so {' '.join(added)} would not be read; "
                  "call it before the first JAX computation")
    return ()
  if added:
    env["XLA_FLAGS"] = value
  return added


if __name__ == "__main__":
  import sys
  os.environ.pop("JAX_PLATFORMS", None)   # print what a GPU run would get
  if len(sys.argv) > 1:
    os.environ[ENV] = sys.argv[1]
  try:
    configure_gpu_flags()
  except ValueError as e:
    sys.exit(f"dgr2_jax.decode.xla_flags: {e}")
  print(os.environ.get("XLA_FLAGS", ""))
