"""The decode loop's GPU flags (dgr2_jax/decode/xla_flags.py): how XLA_FLAGS is composed, that a
user's own setting wins flag by flag, the A/B switch, and that this jaxlib knows every flag (XLA
aborts the process on an unknown one, on a CPU as on a GPU)."""

import os
import subprocess
import sys

import pytest

from dgr2_jax.decode import xla_flags

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CB = "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
MIN = "--xla_gpu_graph_min_graph_size=1"


def test_default_adds_the_loop_flags_to_what_is_there():
  env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
  assert xla_flags.configure_gpu_flags(env=env) == (CB, MIN)
  assert env["XLA_FLAGS"] == f"--xla_dump_to=/tmp/x {CB} {MIN}"
  env = {}
  xla_flags.configure_gpu_flags(env=env)
  assert env["XLA_FLAGS"] == f"{CB} {MIN}"


def test_a_flag_the_user_set_is_kept_and_the_others_added():
  env = {"XLA_FLAGS": "--xla_gpu_graph_min_graph_size=7"}
  assert xla_flags.configure_gpu_flags(env=env) == (CB,)
  assert env["XLA_FLAGS"] == f"--xla_gpu_graph_min_graph_size=7 {CB}"
  env = {"XLA_FLAGS": "--xla_gpu_enable_command_buffer= --xla_gpu_graph_min_graph_size=2"}
  assert xla_flags.configure_gpu_flags(env=env) == ()
  assert env["XLA_FLAGS"] == "--xla_gpu_enable_command_buffer= --xla_gpu_graph_min_graph_size=2"


def test_calling_twice_adds_nothing_the_second_time():
  env = {}
  xla_flags.configure_gpu_flags(env=env)
  first = env["XLA_FLAGS"]
  assert xla_flags.configure_gpu_flags(env=env) == ()
  assert env["XLA_FLAGS"] == first


@pytest.mark.parametrize("value,flags", [("1", (CB, MIN)), ("on", (CB, MIN)), ("0", ()), ("off", ()),
                                         ("none", ("--xla_gpu_enable_command_buffer=",)),
                                         ("NONE", ("--xla_gpu_enable_command_buffer=",))])
def test_the_environment_switch(value, flags):
  env = {xla_flags.ENV: value}
  assert xla_flags.configure_gpu_flags(env=env) == flags
  assert env.get("XLA_FLAGS", "") == " ".join(flags)


def test_argument_overrides_the_environment():
  env = {xla_flags.ENV: "0"}
  assert xla_flags.configure_gpu_flags(True, env=env) == (CB, MIN)
  env = {}
  assert xla_flags.configure_gpu_flags(False, env=env) == () and "XLA_FLAGS" not in env
  assert xla_flags.configure_gpu_flags("none", env=env) == ("--xla_gpu_enable_command_buffer=",)


def test_a_bad_switch_value_names_the_variable():
  with pytest.raises(ValueError, match="DGR2_COMMAND_BUFFERS='yes please'"):
    xla_flags.configure_gpu_flags(env={xla_flags.ENV: "yes please"})


@pytest.mark.parametrize("platforms,added", [("cpu", False), ("cpu,tpu", False), ("cuda", True), ("cuda,cpu", True),
                                             ("gpu", True), ("", True)])
def test_cpu_only_runs_are_left_alone(platforms, added):
  env = {"JAX_PLATFORMS": platforms}
  assert bool(xla_flags.configure_gpu_flags(env=env)) == added
  assert ("XLA_FLAGS" in env) == added


def test_flag_names():
  assert xla_flags.flag_name("--xla_gpu_enable_command_buffer=") == "xla_gpu_enable_command_buffer"
  assert xla_flags.flag_name("--xla_gpu_graph_min_graph_size=1") == "xla_gpu_graph_min_graph_size"
  assert xla_flags.flag_name("--xla_dump_to") == "xla_dump_to"


@pytest.mark.parametrize("mode", ["loops", "none"])
def test_this_jaxlib_knows_every_flag(mode):
  """XLA parses XLA_FLAGS on any backend and aborts on an unknown flag or command type."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(xla_flags.flags_for(mode)))
  code = "import jax, jax.numpy as jnp; print(jax.jit(lambda x: x + 1)(jnp.ones(2)).sum())"
  r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0 and r.stdout.strip() == "4.0", r.stderr[-2000:]


def test_an_unknown_flag_would_abort():
  """The check above can fail: a misspelt flag aborts the process."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_gpu_enable_command_bufer=+WHILE")
  code = "import jax, jax.numpy as jnp; print(jax.jit(lambda x: x + 1)(jnp.ones(2)).sum())"
  r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
  assert r.returncode != 0


def test_the_module_prints_the_flags_for_a_shell():
  r = subprocess.run([sys.executable, "-m", "dgr2_jax.decode.xla_flags"], cwd=REPO_ROOT, capture_output=True,
                     text=True, timeout=60, env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
  assert r.returncode == 0 and r.stdout.split() == [CB, MIN], r.stderr
  r = subprocess.run([sys.executable, "-m", "dgr2_jax.decode.xla_flags", "0"], cwd=REPO_ROOT, capture_output=True,
                     text=True, timeout=60, env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
  assert r.returncode == 0 and r.stdout.strip() == ""


def test_main_rejects_a_bad_switch_in_one_line():
  env = dict(os.environ, JAX_PLATFORMS="cpu", DGR2_COMMAND_BUFFERS="maybe")
  r = subprocess.run([sys.executable, "-m", "dgr2_jax.main", "--config=configs/demo.py", "--config.dry_run=True"],
                     cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
  lines = [line for line in r.stderr.splitlines() if line.strip()]
  assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
  assert lines[0].startswith("dgr2_jax.main: DGR2_COMMAND_BUFFERS='maybe'"), lines
