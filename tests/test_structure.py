"""The package's shape, read from its source with `ast`: function size, the import graph, and where
its docs live. Nothing is imported or run."""

import ast
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = REPO_ROOT / "dgr2_jax"
MAX_LINES, MAX_PARAMS = 120, 10
# Lower layers first: a module may import its own layer and the ones before it, never a later one.
# `platform` (what a program is built for) sits at the bottom, `results` over decode (a benchmark row
# names the decode flags it ran with), `aot` (compiling every program of a run for a target) beside
# main, over everything: nothing below imports it.
LAYERS = (("chain", "checks", "multihost", "console", "platform"), ("fileio",), ("model", "task", "data"),
          ("decode", "results"), ("train", "serve"), ("stages",), ("main", "aot"))


def _modules() -> dict:
  out = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    out[name] = path
  return out


def _params(fn) -> list[str]:
  a = fn.args
  names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
  names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
  return names


def _imports(name: str, path: pathlib.Path, mods: dict) -> set:
  """Every dgr2_jax module `name` imports, at module level or inside functions."""
  pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      mod = node.module or ""
      if node.level:
        base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
        mod = ".".join(base + ([mod] if mod else []))
      out |= {f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names}
  return {m for m in out if m in mods and m != name}


def _layer(module: str) -> int:
  top = module.split(".")[1] if "." in module else ""
  for i, names in enumerate(LAYERS):
    if top in names:
      return i
  raise AssertionError(f"{module}: not in any layer of LAYERS; add it")


def test_no_function_over_the_size_limits():
  too_big = []
  for name, path in _modules().items():
    for fn in ast.walk(ast.parse(path.read_text())):
      if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        continue
      # A Pallas kernel takes one ref per operand: its refs are the kernel's operands, not options.
      params = [p for p in _params(fn) if not p.endswith("_ref")]
      lines = fn.end_lineno - fn.lineno + 1
      if lines > MAX_LINES or len(params) > MAX_PARAMS:
        too_big.append(f"{path.relative_to(REPO_ROOT)}:{fn.lineno} {fn.name}: {lines} lines, "
                       f"{len(params)} parameters")
  assert not too_big, "\n".join(too_big)


def test_import_graph_has_no_cycle_and_no_upward_import():
  mods = _modules()
  graph = {m: _imports(m, p, mods) for m, p in mods.items()}
  upward = [f"{m} -> {d}" for m, deps in graph.items() for d in deps
            if m != "dgr2_jax" and d != "dgr2_jax" and _layer(d) > _layer(m)]
  assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(sorted(upward))
  # Depth-first search for a cycle.
  state, stack = {}, []

  def visit(m):
    state[m] = "open"
    stack.append(m)
    for d in sorted(graph[m]):
      if state.get(d) == "open":
        raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
      if d not in state:
        visit(d)
    stack.pop()
    state[m] = "done"

  for m in sorted(graph):
    if m not in state:
      visit(m)


def test_cycle_detection_sees_function_level_imports(tmp_path):
  pkg = tmp_path / "dgr2_jax"
  pkg.mkdir()
  (pkg / "a.py").write_text("def f():\n  from dgr2_jax import b\n")
  (pkg / "b.py").write_text("from dgr2_jax import a\n")
  mods = {"dgr2_jax.a": pkg / "a.py", "dgr2_jax.b": pkg / "b.py"}
  assert _imports("dgr2_jax.a", pkg / "a.py", mods) == {"dgr2_jax.b"}
  assert _imports("dgr2_jax.b", pkg / "b.py", mods) == {"dgr2_jax.a"}


def test_no_stage_imports_the_pipeline():
  for name, path in _modules().items():
    if name.startswith("dgr2_jax.stages.") and name != "dgr2_jax.stages.pipeline":
      deps = _imports(name, path, _modules())
      assert "dgr2_jax.stages.pipeline" not in deps, f"{name} imports stages.pipeline"


def test_code_cites_the_design_in_the_repository():
  """The package and tests point readers to docs/design.md, which ships with the repository."""
  assert (REPO_ROOT / "docs" / "design.md").is_file()
  outside = "shared" + "/"   # the checkout's sibling folder, which a clone does not have
  r = subprocess.run(["grep", "-rn", outside, "dgr2_jax", "tests"], cwd=REPO_ROOT, capture_output=True, text=True)
  assert not r.stdout, r.stdout


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                    reason="ruff is not installed (the test extra pins it; .ci/run runs it too)")
def test_ruff_passes():
  # The project's files: what git tracks or would add (a virtualenv made inside the clone, as
  # `python3 -m venv v` does, holds third-party code git is not told about), else the whole tree.
  ls = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=REPO_ROOT,
                      capture_output=True, text=True)
  venv = lambda f: os.path.exists(os.path.join(REPO_ROOT, f.split("/", 1)[0], "pyvenv.cfg"))
  files = [f for f in ls.stdout.split() if not venv(f)] if ls.returncode == 0 else []
  files = [f for f in files if os.path.exists(os.path.join(REPO_ROOT, f))] or ["."]
  r = subprocess.run([sys.executable, "-m", "ruff", "check", "--quiet", *files], cwd=REPO_ROOT, capture_output=True,
                     text=True, env={**os.environ, "NO_COLOR": "1"})
  assert r.returncode == 0, r.stdout[-3000:]
