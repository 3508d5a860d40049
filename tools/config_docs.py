r"""Writes docs/configuration.md: every config field with its default and meaning.

  python tools/config_docs.py            # (re)writes docs/configuration.md
  python tools/config_docs.py --check    # exit status 1 when the file is stale

The fields and defaults are `configs/base.py`'s `get_config()` (and `configs/generate.py`'s own
fields); a field's meaning is the comment on its line in the function that sets it, or the block of
comment lines right above it (each section is built in its owner's module: dgr2_jax/data/config.py,
dgr2_jax/train/opd.py, ...). A field without a comment is listed as undocumented: the test fails
naming it, and the fix is a comment where the field is set.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import io
import os
import sys
import textwrap
import tokenize

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO_ROOT, "docs", "configuration.md")
UNDOCUMENTED = "(undocumented)"


def load_module(name: str):
  """configs/<name>.py as a module (config files are loaded by path, not imported)."""
  if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)
  spec = importlib.util.spec_from_file_location(f"config_docs_{name}", os.path.join(REPO_ROOT, "configs",
                                                                                    f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# ---- comments of the functions that build a config --------------------------------------------------
def _comments_by_line(source: str) -> tuple[dict[int, str], set[int]]:
  """(line -> trailing comment text, lines that hold only a comment), 1-based in `source`."""
  trailing, full = {}, set()
  code_lines = set()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      line = tok.start[0]
      text = tok.string.lstrip("#").strip()
      if line in code_lines:
        trailing[line] = text
      else:
        full.add(line)
        trailing.setdefault(-line, text)  # full-line comments stored under -line
    elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                          tokenize.ENDMARKER):
      code_lines.update(range(tok.start[0], tok.end[0] + 1))
  return trailing, full


def _resolve(node, scope: dict):
  """The function a call node names (`f()` or `module.f()`), or None."""
  if isinstance(node, ast.Call):
    node = node.func
  if isinstance(node, ast.Name):
    obj = scope.get(node.id)
  elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
    obj = getattr(scope.get(node.value.id), node.attr, None)
  else:
    return None
  return obj if inspect.isfunction(obj) else None


def function_comments(fn) -> dict[str, str]:
  """{field path: meaning} of the ConfigDict `fn` returns, from the comments in its source (and in
  the functions it builds on: `c = other()`, `return other()`, `c.section = other()`)."""
  lines, _ = inspect.getsourcelines(fn)
  source = textwrap.dedent("".join(lines))
  trailing, full = _comments_by_line(source)
  tree = ast.parse(source)
  body = tree.body[0]
  scope = dict(fn.__globals__)
  for st in ast.walk(body):  # imports inside the function (`from dgr2_jax.train import opd`)
    if isinstance(st, ast.ImportFrom) and st.module:
      for a in st.names:
        dotted = f"{st.module}.{a.name}"
        scope[a.asname or a.name] = (importlib.import_module(dotted) if importlib.util.find_spec(dotted)
                                     else getattr(importlib.import_module(st.module), a.name))
  prefixes: dict[str, str] = {}  # variable -> field path prefix ('' = the returned root)
  local: dict[str, dict[str, str]] = {}  # variable -> {path: comment}
  out_var = None
  for st in ast.walk(body):
    if isinstance(st, ast.Return) and st.value is not None:
      if isinstance(st.value, ast.Name):
        out_var = st.value.id
      elif _resolve(st.value, scope):
        return function_comments(_resolve(st.value, scope))

  def comment_for(st) -> str:
    parts = []
    j = st.lineno - 1
    block = []
    while j in full:  # the comment lines right above the assignment
      block.append(trailing[-j])
      j -= 1
    parts.extend(reversed(block))
    for line in range(st.lineno, st.end_lineno + 1):
      if line in trailing:
        parts.append(trailing[line])
    return " ".join(p for p in parts if p)

  for st in body.body:
    if not isinstance(st, ast.Assign) or len(st.targets) != 1:
      continue
    t = st.targets[0]
    if isinstance(t, ast.Name):  # c = ConfigDict() | c = other_config()
      local.setdefault(t.id, {})
      f = _resolve(st.value, scope)
      if f is not None:
        local[t.id].update(function_comments(f))
      continue
    if not (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)):
      continue
    var, field = t.value.id, t.attr
    local.setdefault(var, {})
    text = comment_for(st)
    f = _resolve(st.value, scope) if isinstance(st.value, ast.Call) else None
    if isinstance(st.value, ast.Name) and st.value.id in local:  # c.sub = s
      prefixes[st.value.id] = field
      if text:
        local[var][field] = text
      for k, v in local[st.value.id].items():
        local[var][f"{field}.{k}"] = v
    elif f is not None:  # c.section = section_config()
      for k, v in function_comments(f).items():
        local[var][f"{field}.{k}"] = v
      if text:
        local[var][field] = text
    elif text:
      local[var][field] = text
  return local.get(out_var, {})


# ---- the document ------------------------------------------------------------------------------------
def flatten(c, prefix: str = "") -> list[tuple[str, object]]:
  import ml_collections
  out = []
  for k in getattr(c, "_fields", {}).keys() or c.keys():  # the order the fields were set in
    v = c[k]
    path = f"{prefix}{k}"
    if isinstance(v, ml_collections.ConfigDict):
      out.extend(flatten(v, path + "."))
    else:
      out.append((path, v))
  return out


def show(v) -> str:
  if isinstance(v, str):
    return f"`{v!r}`"
  if isinstance(v, tuple) and v and all(isinstance(x, tuple) for x in v):
    return "`" + ", ".join(f"{a}: {'/'.join(b) or '-'}" for a, b in v) + "`"
  if isinstance(v, (list, tuple)):
    return "`" + repr(tuple(v)) + "`"
  return f"`{v!r}`"


def cell(text: str) -> str:
  return text.replace("|", "\\|")


def section_docs(base) -> dict[str, str]:
  """{section: the docstring's first paragraph of the function that builds it}."""
  out = {}
  src = inspect.getsource(base.get_config)
  for st in ast.parse(textwrap.dedent(src)).body[0].body:
    if (isinstance(st, ast.Assign) and isinstance(st.targets[0], ast.Attribute)
        and isinstance(st.value, ast.Call)):
      f = _resolve(st.value, base.get_config.__globals__)
      if f is not None and f.__doc__:
        out[st.targets[0].attr] = " ".join(f.__doc__.strip().split("\n\n")[0].split())
  return out


def render() -> tuple[str, list[str]]:
  """(the markdown, undocumented field paths)."""
  base = load_module("base")
  gen = load_module("generate")
  config = base.get_config()
  meaning = function_comments(base.get_config)
  docs = section_docs(base)
  undocumented = []
  lines = [
      "# Configuration",
      "",
      "Every field of the config tree (`configs/base.py`), its default and its meaning. Any field can be",
      "overridden on the command line with `--config.<section>.<field>=value`; the presets in `configs/`",
      "start from these defaults. This page is generated from the comments where each field is set:",
      "after changing a field, run `python tools/config_docs.py` (the test suite checks it is fresh).",
      "",
      "## Presets",
      "",
      "| file | what it runs |",
      "|---|---|",
  ]
  for name in sorted(os.listdir(os.path.join(REPO_ROOT, "configs"))):
    if name.endswith(".py") and name not in ("__init__.py", "base.py"):
      doc = (load_module(name[:-3]).__doc__ or "").strip().split("\n")[0]
      lines.append(f"| [`configs/{name}`](../configs/{name}) | {cell(doc)} |")
  lines += ["", "Ablation variants after `:` (comma-separated, e.g. `configs/demo.py:no_cft,block8`): " +
            ", ".join(f"`{k}`" for k in base.VARIANTS if k) + ".", ""]

  rows = flatten(config)
  sections = []
  for path, _ in rows:
    sec = path.split(".")[0] if "." in path else ""
    if sec not in sections:
      sections.append(sec)
  for sec in sections:
    lines += ["", f"## `{sec}`" if sec else "## Top level", ""]
    if sec in docs:
      lines += [docs[sec], ""]
    lines += ["| field | default | meaning |", "|---|---|---|"]
    for path, v in rows:
      if (path.split(".")[0] if "." in path else "") != sec:
        continue
      m = meaning.get(path, "")
      if not m:
        undocumented.append(path)
        m = UNDOCUMENTED
      lines.append(f"| `{path}` | {cell(show(v))} | {cell(m)} |")

  gen_meaning = function_comments(gen.get_config)
  gconf = gen.get_config()
  lines += ["", "## `configs/generate.py`", "",
            "The generate stage's own fields (it reads no workdir); its `decode` section is the one above.",
            "", "| field | default | meaning |", "|---|---|---|"]
  for path, v in flatten(gconf):
    if path.startswith("decode.") or path in ("stage", "seed", "dry_run"):
      continue
    m = gen_meaning.get(path, "")
    if not m:
      undocumented.append(f"generate:{path}")
      m = UNDOCUMENTED
    lines.append(f"| `{path}` | {cell(show(v))} | {cell(m)} |")
  return "\n".join(lines) + "\n", undocumented


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--check", action="store_true", help="exit 1 when docs/configuration.md is stale")
  args = p.parse_args(argv)
  text, undocumented = render()
  if undocumented:
    print(f"config_docs: {len(undocumented)} field(s) without a comment where they are set: "
          + ", ".join(undocumented), file=sys.stderr)
  if args.check:
    current = open(OUT).read() if os.path.exists(OUT) else ""
    if current != text:
      print(f"config_docs: {os.path.relpath(OUT, REPO_ROOT)} is stale: run python tools/config_docs.py",
            file=sys.stderr)
      return 1
    return 0
  os.makedirs(os.path.dirname(OUT), exist_ok=True)
  tmp = OUT + ".tmp"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, OUT)
  print(f"config_docs: wrote {os.path.relpath(OUT, REPO_ROOT)} ({text.count(chr(10))} lines)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
