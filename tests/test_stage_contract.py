"""Adding a stage is one new module plus one line in the registry (stages/registry.py).

Two toy stages are written as modules in a temporary folder, registered as the registry's line
would (`registry.derive` with the module added), and run through `main` and the pipeline without
any other file changing: the contract gives them their config hash (with the hash of the stage
they read), freshness (a rerun builds nothing; a changed setting rebuilds the stage and the one
reading it), the prerequisites of a stage asked for alone, the wall-clock record, and with two
processes the host-only wrapping (process 0 alone builds the host-only stage; both build the
collective one).
"""

import importlib.util
import json
import os
import sys

import ml_collections
import pytest

import multiprocess_harness as mph
from dgr2_jax import main as main_lib
from dgr2_jax.stages import common
from dgr2_jax.stages import pipeline
from dgr2_jax.stages import registry
from dgr2_jax.train.config import without

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOYS = ("dgr2_toy_a", "dgr2_toy_b")

# Every build appends the process index to `<toy.log_dir>/<stage>.log`, so a test counts builds.
TOY_A = '''"""Toy stage a: writes config.toy.size (host-only: with several processes, process 0 builds it)."""
import json
import os

import jax

from dgr2_jax.stages import common
from dgr2_jax.stages import contract


def log_build(config, name):
  with open(os.path.join(config.toy.log_dir, name + ".log"), "a") as f:
    f.write(f"{jax.process_index()}\\n")


def _hash(config, workdir, upstream):
  return common.config_hash(config.toy.size, workdir=workdir)


def _build(config, workdir, build):
  log_build(config, "dgr2_toy_a")
  with build.publish({"stage": "dgr2_toy_a"}) as tmp:
    common.write_json_atomic(os.path.join(tmp, "value.json"), {"size": int(config.toy.size)})
  return {"size": int(config.toy.size)}


def _fresh(config, workdir, out):
  with open(os.path.join(out, "value.json")) as f:
    return json.load(f)


STAGE = contract.Stage(name="dgr2_toy_a", hashed=_hash, build=_build, fresh=_fresh, host_only=True)
'''

TOY_B = '''"""Toy stage b: reads toy stage a's value and doubles it (every process takes part)."""
import json
import os

from dgr2_jax.stages import common
from dgr2_jax.stages import contract
from dgr2_toy_a import log_build


def _hash(config, workdir, upstream):
  return common.config_hash(upstream["dgr2_toy_a"], workdir=workdir)


def _build(config, workdir, build):
  log_build(config, "dgr2_toy_b")
  with open(os.path.join(workdir, "dgr2_toy_a", "value.json")) as f:
    double = 2 * json.load(f)["size"]
  with build.publish({"stage": "dgr2_toy_b"}) as tmp:
    if common.is_writer():  # several processes: one writes, all publish together
      common.write_json_atomic(os.path.join(tmp, "double.json"), {"double": double})
  return {"double": double}


def _fresh(config, workdir, out):
  with open(os.path.join(out, "double.json")) as f:
    return json.load(f)


STAGE = contract.Stage(name="dgr2_toy_b", reads=("dgr2_toy_a",), hashed=_hash, build=_build, fresh=_fresh)
'''

# One process of the two-process run: registers the toys as the test does, runs the pipeline,
# and writes what it returned to `<log_dir>/result-<process>.json`.
WORKER = '''import json
import os
import sys

sys.path.insert(0, sys.argv[1])
from dgr2_jax import multihost
multihost.initialize()  # before any other JAX call
import importlib.util
import jax
from dgr2_jax.stages import pipeline, registry

order, _, stages = registry.derive(registry.PIPELINE + ("dgr2_toy_a", "dgr2_toy_b"), registry.TOOLS)
registry.ORDER = order
registry.STAGES.update(stages)
spec = importlib.util.spec_from_file_location("cfg_demo", os.path.join("configs", "demo.py"))
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)
config = demo.get_config()
with config.unlocked():
  config.pipeline.stages = ("dgr2_toy_a", "dgr2_toy_b")
  config.toy = {"size": 3, "log_dir": sys.argv[1]}
out = pipeline.run(config, sys.argv[2])
with open(os.path.join(sys.argv[1], f"result-{jax.process_index()}.json"), "w") as f:
  json.dump(out, f)
'''


def _write_toys(folder) -> None:
  (folder / "dgr2_toy_a.py").write_text(TOY_A)
  (folder / "dgr2_toy_b.py").write_text(TOY_B)


@pytest.fixture
def toys(tmp_path, monkeypatch):
  """The toy modules on sys.path and in the registry (its line, as `derive` reads it); -> folder."""
  folder = tmp_path / "toys"
  folder.mkdir()
  _write_toys(folder)
  monkeypatch.syspath_prepend(str(folder))
  order, _, stages = registry.derive(registry.PIPELINE + TOYS, registry.TOOLS)
  monkeypatch.setattr(registry, "ORDER", order)
  for name, module in stages.items():
    monkeypatch.setitem(registry.STAGES, name, module)
  yield folder
  for name in TOYS:
    sys.modules.pop(name, None)


def load_demo():
  path = os.path.join(REPO_ROOT, "configs", "demo.py")
  spec = importlib.util.spec_from_file_location("cfg_demo_contract", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def builds(folder, name) -> list[str]:
  path = folder / f"{name}.log"
  return path.read_text().split() if path.exists() else []


def toy_config(folder, size: int = 3):
  c = load_demo()
  with c.unlocked():
    c.pipeline.stages = TOYS
    c.toy = {"size": size, "log_dir": str(folder)}
  return c


def test_toy_stages_run_through_the_pipeline(toys, tmp_path):
  wd = str(tmp_path / "wd")
  c = toy_config(toys)
  out = main_lib.run(c, wd)
  assert out == {"dgr2_toy_a": {"size": 3}, "dgr2_toy_b": {"double": 6}}
  assert builds(toys, "dgr2_toy_a") == ["0"] and builds(toys, "dgr2_toy_b") == ["0"]
  done = {s: json.load(open(os.path.join(wd, s, "DONE.json"))) for s in TOYS}
  assert done["dgr2_toy_a"]["stage"] == "dgr2_toy_a"
  with open(os.path.join(wd, "results", "stage_built_times.json")) as f:
    built = json.load(f)
  assert {s: built[s]["config_hash"] for s in TOYS} == {s: done[s]["config_hash"] for s in TOYS}

  # A rerun finds both fresh: nothing is built, the results are read back.
  assert main_lib.run(toy_config(toys), wd) == out
  assert builds(toys, "dgr2_toy_a") == ["0"] and builds(toys, "dgr2_toy_b") == ["0"]

  # A changed setting of a rebuilds a, and b, whose hash holds a's.
  out = main_lib.run(toy_config(toys, size=5), wd)
  assert out == {"dgr2_toy_a": {"size": 5}, "dgr2_toy_b": {"double": 10}}
  assert len(builds(toys, "dgr2_toy_a")) == 2 and len(builds(toys, "dgr2_toy_b")) == 2
  assert json.load(open(os.path.join(wd, "dgr2_toy_a", "DONE.json")))["config_hash"] != done["dgr2_toy_a"][
      "config_hash"]


def test_toy_stage_alone_builds_what_it_reads(toys, tmp_path):
  wd = str(tmp_path / "fresh")
  c = toy_config(toys)
  assert pipeline.missing_prerequisites(c, wd, "dgr2_toy_b") == ["dgr2_toy_a"]
  assert registry.host_stages()[-1] == "dgr2_toy_a"
  with c.unlocked():
    c.stage = "dgr2_toy_b"
  assert main_lib.run(c, wd) == {"double": 6}
  assert builds(toys, "dgr2_toy_a") == ["0"] and builds(toys, "dgr2_toy_b") == ["0"]
  assert pipeline.missing_prerequisites(c, wd, "dgr2_toy_b") == []


def test_toy_stages_with_two_processes(tmp_path):
  """Process 0 alone builds the host-only stage a, both processes build b together; a second run
  builds nothing; both processes return the same results."""
  folder = tmp_path / "toys"
  folder.mkdir()
  _write_toys(folder)
  (folder / "worker.py").write_text(WORKER)
  wd = tmp_path / "wd"
  argv = [sys.executable, str(folder / "worker.py"), str(folder), str(wd)]
  for _ in range(2):
    mph.check(mph.launch(2, 1, argv, timeout=300))
    assert sorted(builds(folder, "dgr2_toy_a")) == ["0"]
    assert sorted(builds(folder, "dgr2_toy_b")) == ["0", "1"]
    results = [json.load(open(folder / f"result-{i}.json")) for i in (0, 1)]
    assert results[0] == results[1] == {"dgr2_toy_a": {"size": 3}, "dgr2_toy_b": {"double": 6}}
  assert not [n for n in os.listdir(wd) if ".tmp" in n]


def test_without_drops_the_named_fields_from_a_copy():
  """A stage's hash leaves out fields at their old defaults (`train.config.without`): the copy lacks them,
  hashes as a section that never had them, and the caller's section is unchanged."""
  section = ml_collections.ConfigDict({"lr": 1e-4, "divergence": "forward", "inner": {"k": 3}})
  out = without(section, ["divergence", "absent"])
  assert "divergence" not in out and out.lr == 1e-4 and out.inner.k == 3
  assert section.divergence == "forward"
  assert common.config_hash(out) == common.config_hash(ml_collections.ConfigDict({"lr": 1e-4, "inner": {"k": 3}}))
  assert common.config_hash(out) != common.config_hash(section)
