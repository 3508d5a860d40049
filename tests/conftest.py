"""Shared fixtures. Tests run on CPU; tiny models keep compile times small."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compile-only TPU tests in two workers at once: libtpu's machine-wide lock would fail the second
# (dgr2_jax/aot/targets.py says why a compile-only client may ignore it).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One persistent XLA compilation cache for the session and every process it starts (they inherit
# the environment): dozens of `python -m dgr2_jax.main` subprocesses compile the same small
# programs, and compiling, not running, is what they spend their time on. The cache is keyed on the
# program, its compile options, the devices, XLA_FLAGS and the JAX/XLA versions, so a hit runs the
# very executable a compile would produce. .ci/run points it at a directory the fresh-virtualenv run filled;
# otherwise a temporary one, removed at exit.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import atexit
  import shutil
  import tempfile
  _cache = tempfile.mkdtemp(prefix="dgr2_jax_test_cache_")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

# `python -m pytest -n 2 --dist loadgroup tests` (the README's command) spreads the suite over two
# worker processes (pytest-xdist): compiling is single-threaded, so two workers keep both cores of
# a small machine busy. A module's tests share module-scoped fixtures (whole multi-process pipeline
# runs), so a module is one unit of work; the tests on the session's smoke pipeline
# (`smoke_workdir`) are one more, so it is built once. Units start heaviest first (the slowest
# modules of a --durations run on two cores), so that no long unit starts last; the rest keep
# their collection order. Without -n the same order runs in one process.
_HEAVY_FIRST = ("test_multiprocess_pipeline.py", "smoke", "test_compile_targets.py", "test_decode.py",
                "test_speculative.py", "test_decode_mesh.py", "test_vocab_chunks.py", "test_retriever.py",
                "test_multiprocess.py", "test_dynamic_sampling.py", "test_flash_pallas.py")


def _work_unit(item):
  return "smoke" if "smoke_workdir" in item.fixturenames else item.path.name


@pytest.hookimpl(tryfirst=True)   # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
  for item in items:
    item.add_marker(pytest.mark.xdist_group(_work_unit(item)))
  rank = {u: i for i, u in enumerate(_HEAVY_FIRST)}
  items.sort(key=lambda item: rank.get(_work_unit(item), len(rank)))


def pytest_xdist_make_scheduler(config, log):
  """--dist loadgroup hands the units out in collection order (xdist's default: most tests first)."""
  if config.getvalue("dist") != "loadgroup":
    return None
  from xdist.scheduler import LoadGroupScheduling
  config.option.loadscopereorder = False
  return LoadGroupScheduling(config, log)


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_BEAUTY = os.path.join(REPO_ROOT, "..", "shared", "data", "amazon_beauty")


@pytest.fixture(scope="session")
def tiny_lm():
  """(config, params) of a tiny random Qwen3 with peaked distributions (weights scaled up), so
  decoding commits several tokens per step and argmax ties are impossible in practice."""
  from dgr2_jax.model import qwen3
  from dgr2_jax.model.config import Qwen3Config
  cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                    mask_token_id=63, eos_token_id=5, pad_token_id=0)
  params = qwen3.init_params(cfg, jax.random.PRNGKey(1))
  params = jax.tree_util.tree_map(lambda x: x * 8 if x.ndim == 2 else x, params)
  return cfg, params


SMOKE_CONFIG = "--config=configs/demo.py:smoke"  # every stage at toy size (configs/demo.py `smoke`)


def run_main(workdir, timeout, config=SMOKE_CONFIG):
  """`python -m dgr2_jax.main CONFIG --workdir=WORKDIR` as a subprocess -> its wall-clock seconds."""
  import subprocess
  import sys
  import time
  env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
  cmd = [sys.executable, "-m", "dgr2_jax.main", config, f"--workdir={workdir}"]
  t0 = time.time()
  proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return time.time() - t0


@pytest.fixture(scope="session")
def smoke_workdir(tmp_path_factory):
  """A whole toy pipeline run (configs/demo.py:smoke), built once per session: the end-to-end
  test checks it, the server test serves it. DGR2_SMOKE_WORKDIR names a directory to use instead
  of a temporary one: built here when it holds no finished run, else taken as it is (.ci/run
  passes the workdir its fresh-virtualenv run of the same command just built). Either way the
  end-to-end test reruns the command on it and fails unless every stage is fresh."""
  workdir = os.environ.get("DGR2_SMOKE_WORKDIR") or str(tmp_path_factory.mktemp("smoke") / "wd")
  if not os.path.exists(os.path.join(workdir, "results", "stage_times.json")):
    run_main(workdir, timeout=1500)
  return workdir


@pytest.fixture
def foreign_path(tmp_path):
  """A PATH whose first folder holds a `python`, `python3`, `pip` and `pip3` that exit 1 at once, as
  an interpreter without this project would fail (issue 54: a venv's tests run with no venv
  activated): a command that passes under it started every interpreter as sys.executable."""
  fake = tmp_path / "foreign_bin"
  fake.mkdir()
  for name in ("python", "python3", "pip", "pip3"):
    (fake / name).write_text(f'#!/bin/sh\necho "{name} from PATH ($0): not the interpreter running the tests" >&2\n'
                             "exit 1\n")
    (fake / name).chmod(0o755)
  return f"{fake}{os.pathsep}{os.environ.get('PATH', '')}"
