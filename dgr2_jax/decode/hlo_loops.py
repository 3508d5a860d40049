"""The loops and conditionals of a compiled XLA program, read from its optimised HLO text.

What a decoder costs in host round trips is a property of the program XLA compiles: on a GPU a
`while` whose trip count XLA cannot prove copies its condition's predicate to the host every
iteration, and so does every `conditional` (lax.cond / lax.switch) on every execution; a `while`
with a known trip count (a `fori_loop` / `scan` of static length, annotated `known_trip_count`)
runs without one. `loops` lists every while with what it contains, so tests and benchmarks can
count the predicates a decode loop sends to the host from the program itself.
"""

from __future__ import annotations

import dataclasses
import re

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLED = re.compile(r"(?:condition|body|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass
class Loop:
  name: str
  computation: str            # the computation holding the while instruction
  trip_count: int | None      # None: data dependent (its predicate goes to the host per iteration)
  condition: str
  body: str
  inner: list = dataclasses.field(default_factory=list)   # names of whiles nested in body/condition
  conditionals: int = 0       # conditional instructions in body/condition, nested calls included
  dots: int = 0               # dot / convolution / custom-call (e.g. GEMM) instructions, ditto


def _computations(hlo: str) -> dict[str, list[str]]:
  comps, name = {}, None
  for line in hlo.splitlines():
    m = _COMPUTATION.match(line)
    if m and "=" not in line.split("{")[0].split("(")[0]:
      name = m.group(1)
      comps[name] = []
    elif line.strip() == "}":
      name = None
    elif name is not None:
      comps[name].append(line)
  return comps


def _called(line: str) -> list[str]:
  out = _CALLED.findall(line)
  for group in _BRANCHES.findall(line):
    out += [x.strip().lstrip("%") for x in group.split(",") if x.strip()]
  return out


def loops(hlo: str) -> list[Loop]:
  """Every `while` of an optimised HLO module (`jit(f).lower(...).compile().as_text()`)."""
  comps = _computations(hlo)
  found = {}
  for comp, lines in comps.items():
    for line in lines:
      if " while(" not in line:
        continue
      name = line.split("=")[0].split()[-1].lstrip("%")
      trip = _TRIP.search(line)
      cond = re.search(r"condition=%?([\w.\-]+)", line).group(1)
      body = re.search(r"body=%?([\w.\-]+)", line).group(1)
      found[name] = Loop(name, comp, int(trip.group(1)) if trip else None, cond, body)

  def reach(roots):
    seen, todo = set(), list(roots)
    while todo:
      c = todo.pop()
      if c in seen or c not in comps:
        continue
      seen.add(c)
      for line in comps[c]:
        todo += _called(line)
    return seen

  for loop in found.values():
    inside = reach([loop.condition, loop.body])
    loop.inner = [l.name for l in found.values() if l.computation in inside]
    lines = [line for c in inside for line in comps[c]]
    loop.conditionals = sum(" conditional(" in line for line in lines)
    loop.dots = sum(bool(re.search(r" (dot|convolution|custom-call)\(", line)) for line in lines)
  return list(found.values())



def host_predicates(hlo: str, loop: Loop) -> int:
  """Predicates one iteration of `loop` sends to the host on a GPU: its own condition when its
  trip count is unknown, plus every conditional executed in its body and condition (a conditional
  inside a nested loop of trip count n counts n times, plus the predicates of its costliest
  branch: an upper bound where branches differ; an unknown-trip nested loop counts its condition
  and body once)."""
  comps = _computations(hlo)
  memo = {}

  def count(comp):
    if comp in memo or comp not in comps:
      return memo.get(comp, 0)
    memo[comp] = 0   # recursion guard
    n = 0
    for line in comps[comp]:
      if " while(" in line:
        trip = _TRIP.search(line)
        cond = re.search(r"condition=%?([\w.\-]+)", line).group(1)
        body = re.search(r"body=%?([\w.\-]+)", line).group(1)
        n += int(trip.group(1)) * (count(cond) + count(body)) if trip else 1 + count(cond) + count(body)
      elif " conditional(" in line:
        n += 1 + max([count(c) for c in _called(line)] or [0])
      else:
        n += sum(count(c) for c in _called(line))
    memo[comp] = n
    return n
  return int(loop.trip_count is None) + count(loop.condition) + count(loop.body)
