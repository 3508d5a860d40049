"""What a command (a stage, the pipeline, the server) prints besides its own progress and results:
the libraries' warnings and errors, and their INFO lines only when absl's `--verbosity` asks.

`quiet(verbosity)` runs before the command's first JAX call, because JAX reports the backends it
fails to start as it starts them. Importing this module imports JAX, and `start_backends` starts
its backends, with the CUDA plugin's native notices dropped (`NATIVE_NOISE`). The data builders'
download lines are quieted where tfds prints them (dgr2_jax/data/tfds_builders.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile

# Native lines JAX's CUDA compiler plugin (the aot extra) writes to stderr on a machine without a
# GPU driver: once per library it loads as JAX is imported, once more as JAX's backends start.
# Nothing to act on, and they would bury a command's one-line error.
NATIVE_NOISE = ("Could not find cuda drivers on your machine", "All log messages before absl::InitializeLog()")


class _QuietLibraries(logging.Filter):
  """Drops the libraries' routine notices a user cannot act on (kept at --verbosity=0)."""
  NOISE = ("ArrayMetadata persistence is disabled",)

  def filter(self, record) -> bool:
    return not any(n in record.getMessage() for n in self.NOISE)


def quiet(verbosity: int) -> None:
  """Library logs (Orbax, TFDS, JAX) at WARNING and TFDS's progress bars off, unless `verbosity`
  (absl's `--verbosity`; -1 when not given) is >= 0; our own messages are prints and progress bars,
  so a newcomer sees those. JAX probes no accelerator the machine does not have (`cpu_only`)."""
  from absl import logging as absl_logging
  cpu_only()
  absl_logging.use_absl_handler()   # absl.app installs it; the server parses its flags without absl.app
  if verbosity >= 0:
    return
  absl_logging.set_verbosity(absl_logging.WARNING)
  absl_logging.get_absl_logger().addFilter(_QuietLibraries())
  logging.getLogger("jax").setLevel(logging.WARNING)
  try:
    import tensorflow_datasets as tfds
    tfds.disable_progress_bar()
  except ImportError:
    pass


def cpu_only() -> None:
  """On a machine with neither a TPU chip nor a GPU, JAX starts its CPU backend only (unless
  JAX_PLATFORMS names the backends). Left to itself, JAX tries each backend it has a library for;
  where the hardware is missing, each try costs seconds and writes to the console: an INFO line
  per backend, and libtpu's native lines that no logger level reaches. The hardware checks are
  JAX's own (device files under /dev and /sys; jax is pinned in setup.py)."""
  if os.environ.get("JAX_PLATFORMS"):
    return
  import jax
  from jax._src import hardware_utils
  if (hardware_utils.num_available_tpu_chips_and_device_id()[0] or hardware_utils.has_visible_nvidia_gpu()
      or hardware_utils.num_available_amd_gpus(stop_at=1)):
    return
  jax.config.update("jax_platforms", "cpu")


@contextlib.contextmanager
def native_noise_dropped():
  """Inside the block, what anything writes to file descriptor 2 (native libraries included) is
  held back and written out after it, without the lines of `NATIVE_NOISE`."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      held.seek(0)
      kept = [line for line in held.read().decode(errors="replace").splitlines(keepends=True)
              if not any(n in line for n in NATIVE_NOISE)]
      sys.stderr.write("".join(kept))
      sys.stderr.flush()


def start_backends() -> None:
  """Starts JAX's backends (after `jax.distributed.initialize`), the CUDA plugin's notices dropped."""
  import jax
  with native_noise_dropped():
    jax.devices()


with native_noise_dropped():   # the first import of JAX in a command (main imports this module first)
  import jax  # noqa: E402,F401
