"""Compiled programs, read: the one place the project compiles a program to measure it and parses
XLA's output.

  with targets.compile_for("h100x8"):            # or compile_program(..., target="h100x8")
    prog = hlo.compile_program(jax.jit(step), *abstract_args, name="sft")
  prog.memory.peak, prog.flops, prog.collectives, prog.custom_calls, prog.compile_s, prog.row()

`compile_program` lowers and compiles a jitted function for the platform in force (the host, or a
compile-only target: dgr2_jax/aot/targets.py) and reads:
  * memory per device: `compiled.memory_analysis()` (arguments, outputs, temporaries, aliased,
    generated code; `peak` = arguments + outputs + temporaries - aliased, XLA's plan);
  * FLOPs and bytes accessed: the backend's `cost_analysis()` where it has one (CPU, TPU); XLA's
    GPU compiler has none (it returns None), so there the optimised module goes through XLA's
    generic HLO cost analysis (`hlo_module_cost_analysis` with the CPU client: per-instruction
    FLOPs and operand/result bytes of the GPU program; custom calls, e.g. cuDNN attention and
    Triton kernels, count no FLOPs there). `cost_source` says which;
  * from the optimised HLO text: while loops (their known trip counts, what they contain), the
    predicates a loop sends to the host per iteration, collectives (all-gather, all-reduce,
    reduce-scatter, all-to-all, collective-permute: result shape and bytes, replica groups, and
    whether a loop body runs them), custom calls by target (`__cudnn$fmha...`, the Triton kernels
    of Pallas `__gpu$xla.gpu.triton`, Mosaic `tpu_custom_call`, `__cublas$gemm`) and custom fusions
    by kind (XLA's Triton GEMMs `__triton_gemm`, ...);
  * lowering and compile times.

The text readers (`parse`, `loops`, `host_predicates`, `collectives`, `custom_calls`) take the
optimised module (`compiled.as_text()`); `parse` also reads a module as lowered
(`lowered.as_text(dialect="hlo")`), which dgr2_jax/aot/weight_reads.py counts weight reads in.

Host round trips: on a GPU a `while` whose trip count XLA cannot prove copies its condition's
predicate to the host every iteration, and so does every `conditional` (lax.cond / lax.switch) on
every execution; a `while` with a known trip count (a `fori_loop` / `scan` of static length,
annotated `known_trip_count`) runs without one.

What compile-only cannot show: no autotuning runs without a device (XLA keeps its default GEMM /
fusion configs, so temporaries can differ from an on-device compile) and nothing is timed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time

import jax

from dgr2_jax import platform
from dgr2_jax.aot import targets

# ---- the HLO text, parsed just enough -------------------------------------------------------------
ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2,
         "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_ARRAY = re.compile(r"\b(pred|bf16|f8e4m3fn|f8e5m2|[suf]\d+)\[([\d,]*)\]")
_TOKEN = re.compile(r"%?([A-Za-z_][\w.\-]*)")
_CALL_KEYS = ("calls", "to_apply", "body", "condition", "true_computation", "false_computation")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def array_bytes(shape: str) -> int:
  """Bytes of every array in an HLO shape string (a tuple: their sum)."""
  total = 0
  for dt, dims in _ARRAY.findall(shape):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * ITEM_BYTES.get(dt, 4)
  return total


def dtype_of(shape: str) -> str:
  """The HLO dtype of a shape string's first array ('' for none)."""
  m = _ARRAY.search(shape)
  return m.group(1) if m else ""


def plain_shape(shape: str) -> str:
  """'bf16[151936,4096]{1,0:T(8,128)}' -> 'bf16[151936,4096]' (arrays only, layouts dropped)."""
  return ", ".join(f"{dt}[{dims}]" for dt, dims in _ARRAY.findall(shape))


@dataclasses.dataclass
class Inst:
  name: str
  shape: str
  opcode: str
  operands: list
  attrs: str
  inner: str = ""      # the text between the opcode's parentheses (a parameter's number)
  root: bool = False


def _split_paren(s: str, i: int) -> int:
  """Index just past the parenthesis group opening at s[i]."""
  depth = 0
  for j in range(i, len(s)):
    depth += {"(": 1, ")": -1}.get(s[j], 0)
    if depth == 0:
      return j + 1
  raise ValueError(f"unbalanced HLO line: {s[:80]}")


def parse(text: str):
  """-> ({computation name: [Inst]}, entry name) of an HLO module's text (as lowered, or as
  optimised: both print formats). Names lose their '%'; an instruction's operands are the names
  of earlier instructions of its computation that its parentheses mention."""
  comps, entry, cur, known = {}, None, None, set()
  for line in text.splitlines():
    s = line.strip()
    if s.endswith("{") and " = " not in s and not s.startswith("HloModule"):
      is_entry = s.startswith("ENTRY ")
      name = s.split()[1 if is_entry else 0].split("(")[0].lstrip("%")
      cur, known = comps.setdefault(name, []), set()
      entry = name if is_entry else entry
      continue
    if s == "}":
      cur = None
      continue
    if cur is None or " = " not in s:
      continue
    lhs, rhs = s.split(" = ", 1)
    name = lhs.replace("ROOT ", "").strip().lstrip("%")
    end = _split_paren(rhs, 0) if rhs.startswith("(") else rhs.index(" ")
    shape, rest = rhs[:end], rhs[end:].strip()
    op_end = rest.index("(")
    close = _split_paren(rest, op_end)
    inner = rest[op_end + 1:close - 1]
    operands = [t for t in _TOKEN.findall(inner) if t in known]
    cur.append(Inst(name, shape, rest[:op_end], operands, rest[close:], inner, lhs.startswith("ROOT ")))
    known.add(name)
  return comps, entry


def attr(attrs: str, key: str):
  """The computation (or name) an attribute names: attr(attrs, 'body') -> 'region_1.2'."""
  m = re.search(r"\b" + key + r"=%?([\w.\-]+)", attrs)
  return m.group(1) if m else None


def branches(attrs: str) -> list:
  """A conditional's branch computations, in branch order."""
  m = re.search(r"branch_computations=\{([^}]*)\}", attrs)
  if m:
    return [t.strip().lstrip("%") for t in m.group(1).split(",")]
  return [b for b in (attr(attrs, "true_computation"), attr(attrs, "false_computation")) if b]


def called(ins: Inst) -> list:
  """Every computation `ins` calls (fusion, call, map/reduce, while, conditional, async wrappers)."""
  return [c for c in (attr(ins.attrs, k) for k in _CALL_KEYS) if c] + branches(ins.attrs)


def reachable(comps: dict, roots) -> set:
  """The computations `roots` run, transitively."""
  seen, todo = set(), list(roots)
  while todo:
    c = todo.pop()
    if c in seen or c not in comps:
      continue
    seen.add(c)
    for ins in comps[c]:
      todo += called(ins)
  return seen


def known_trip_count(ins: Inst) -> int | None:
  """A while's trip count as XLA annotated it (backend_config known_trip_count), else None."""
  m = _TRIP.search(ins.attrs)
  return int(m.group(1)) if m else None


def _module(hlo) -> tuple:
  return parse(hlo) if isinstance(hlo, str) else hlo


# ---- loops and host round trips ---------------------------------------------------------------------
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


def loops(hlo) -> list[Loop]:
  """Every `while` of an optimised HLO module (its text, or `parse`'s result)."""
  comps, _ = _module(hlo)
  found = {}
  for comp, insts in comps.items():
    for ins in insts:
      if ins.opcode == "while":
        found[ins.name] = Loop(ins.name, comp, known_trip_count(ins), attr(ins.attrs, "condition"),
                               attr(ins.attrs, "body"))
  for loop in found.values():
    inside = reachable(comps, [loop.condition, loop.body])
    loop.inner = [l.name for l in found.values() if l.computation in inside]
    body = [ins for c in inside for ins in comps[c]]
    loop.conditionals = sum(ins.opcode == "conditional" for ins in body)
    loop.dots = sum(ins.opcode in ("dot", "convolution", "custom-call") for ins in body)
  return list(found.values())


def host_predicates(hlo, loop: Loop) -> int:
  """Predicates one iteration of `loop` sends to the host on a GPU: its own condition when its
  trip count is unknown, plus every conditional executed in its body and condition (a conditional
  inside a nested loop of trip count n counts n times, plus the predicates of its costliest
  branch: an upper bound where branches differ; an unknown-trip nested loop counts its condition
  and body once)."""
  comps, _ = _module(hlo)
  memo = {}

  def count(comp):
    if comp in memo or comp not in comps:
      return memo.get(comp, 0)
    memo[comp] = 0   # recursion guard
    n = 0
    for ins in comps[comp]:
      if ins.opcode == "while":
        trip = known_trip_count(ins)
        inner = count(attr(ins.attrs, "condition")) + count(attr(ins.attrs, "body"))
        n += trip * inner if trip is not None else 1 + inner
      elif ins.opcode == "conditional":
        n += 1 + max([count(c) for c in branches(ins.attrs)] or [0])
      else:
        n += sum(count(c) for c in called(ins))
    memo[comp] = n
    return n
  return int(loop.trip_count is None) + count(loop.condition) + count(loop.body)


def in_loops(hlo) -> set:
  """The computations some while loop runs (bodies and conditions, transitively)."""
  comps, _ = _module(hlo)
  roots = [attr(ins.attrs, k) for insts in comps.values() for ins in insts if ins.opcode == "while"
           for k in ("body", "condition")]
  return reachable(comps, roots)


# ---- collectives, custom calls --------------------------------------------------------------------
@dataclasses.dataclass
class Collective:
  op: str              # 'all-gather' | 'all-reduce' | 'reduce-scatter' | 'all-to-all' | 'collective-permute'
  shape: str           # its result, e.g. 'bf16[151936,4096]'
  bytes: int           # of the result, per device
  groups: str          # replica_groups as printed (which devices take part)
  in_loop: bool        # a while body (or condition) runs it: every iteration
  name: str = ""
  computation: str = ""


def collectives(hlo) -> list[Collective]:
  """Every collective of an optimised module; an asynchronous pair (X-start / X-done) counts once,
  with the result its -done gives."""
  comps, _ = _module(hlo)
  looped = in_loops((comps, None))
  out = []
  for comp, insts in comps.items():
    done = {ins.operands[0]: ins for ins in insts if ins.opcode.endswith("-done") and ins.operands}
    for ins in insts:
      op = ins.opcode[:-len("-start")] if ins.opcode.endswith("-start") else ins.opcode
      if op not in COLLECTIVES:
        continue
      shape = done[ins.name].shape if ins.opcode.endswith("-start") and ins.name in done else ins.shape
      m = re.search(r"replica_groups=(\{[{}\d, ]*\}|mesh\[[^\]]*\] \{[^}]*\}|\[[\d,]*\]<=\[[\d,]*\](?:T\([\d,]*\))?)",
                    ins.attrs)
      out.append(Collective(op, plain_shape(shape), array_bytes(shape), m.group(1) if m else "", comp in looped,
                            ins.name, comp))
  return out


def custom_calls(hlo) -> dict:
  """{custom-call target: count} of a module: cuDNN attention ('__cudnn$fmhaSoftmax', ...), Pallas
  kernels ('__gpu$xla.gpu.triton', 'tpu_custom_call'), cuBLAS ('__cublas$gemm'), ..."""
  comps, _ = _module(hlo)
  out = {}
  for insts in comps.values():
    for ins in insts:
      if ins.opcode == "custom-call":
        m = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
        key = m.group(1) if m else "?"
        out[key] = out.get(key, 0) + 1
  return out


def custom_fusions(hlo) -> dict:
  """{kind: count} of the custom fusions of an optimised module (kind=kCustom): XLA's GPU GEMMs
  emitted as Triton ('__triton_gemm', '__triton_nested_gemm_fusion'), cuDNN fusions, ..."""
  comps, _ = _module(hlo)
  out = {}
  for insts in comps.values():
    for ins in insts:
      if ins.opcode == "fusion" and "kind=kCustom" in ins.attrs:
        m = re.search(r'"kind":"([^"]+)"', ins.attrs)   # else (TPU) the fused computation's name
        key = m.group(1) if m else re.sub(r"\.\d+$", "", attr(ins.attrs, "calls") or "?")
        out[key] = out.get(key, 0) + 1
  return out


def dot_operand_dtypes(stablehlo: str) -> dict:
  """{operand dtypes: count} over the dot_general ops of a lowered StableHLO module (`lowered.as_text()`):
  what a program's matmuls compute in ('bf16', 'f32', 'bf16xf32' for a mixed pair)."""
  out: dict = {}
  for m in re.finditer(r"stablehlo\.dot_general[^\n]*?:\s*\(tensor<([^>]*)>,\s*tensor<([^>]*)>\)", stablehlo):
    key = "x".join(sorted({t.split("x")[-1] for t in m.groups()}))
    out[key] = out.get(key, 0) + 1
  return out


# ---- compile and measure --------------------------------------------------------------------------
@dataclasses.dataclass
class Memory:
  """Per device, bytes (`compiled.memory_analysis()`)."""
  arguments: int
  outputs: int
  temporaries: int
  aliased: int          # outputs that reuse a donated argument's buffer
  generated_code: int

  @property
  def peak(self) -> int:
    """What the program holds at once, as XLA plans it: arguments + outputs + temporaries - aliased."""
    return self.arguments + self.outputs + self.temporaries - self.aliased


def memory(compiled) -> Memory | None:
  """XLA's memory plan of a compiled program, per device; None where the backend gives none."""
  ma = compiled.memory_analysis()
  if ma is None:
    return None
  return Memory(int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes), int(ma.temp_size_in_bytes),
                int(ma.alias_size_in_bytes), int(ma.generated_code_size_in_bytes))


def cost(compiled) -> tuple[float, float, str]:
  """(FLOPs, bytes accessed, source) of a compiled program, per device (module docstring): the
  backend's cost analysis, else XLA's HLO cost analysis of the optimised module."""
  try:
    ca = compiled.cost_analysis()
  except NotImplementedError:
    ca = None
  ca = ca[0] if isinstance(ca, (list, tuple)) and ca else ca
  if ca:
    return float(ca.get("flops", 0.0)), float(ca.get("bytes accessed", 0.0)), "backend"
  from jax._src import xla_bridge
  from jax._src.lib import _jax
  module = compiled.runtime_executable().hlo_modules()[0]
  ca = _jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), module)
  return float(ca.get("flops", 0.0)), float(ca.get("bytes accessed", 0.0)), "hlo cost analysis"


@dataclasses.dataclass
class Program:
  """One compiled program, read (module docstring)."""
  name: str
  platform: str          # the backend it was compiled for ('gpu', 'tpu', 'cpu')
  target: str            # the compile-only target's name ('' for the host)
  devices: int           # devices the program spans
  lower_s: float
  compile_s: float
  memory: Memory | None
  flops: float
  bytes_accessed: float
  cost_source: str
  collectives: list
  custom_calls: dict
  custom_fusions: dict
  text: str = dataclasses.field(repr=False, default="")
  compiled: object = dataclasses.field(repr=False, default=None)

  def loops(self) -> list[Loop]:
    return loops(self.text)

  def row(self) -> dict:
    """A JSON-ready summary (no HLO): memory parts and peak, cost, collectives by op (count, bytes,
    how many in a loop body), custom calls and fusions, times."""
    by_op = {}
    for c in self.collectives:
      d = by_op.setdefault(c.op, {"count": 0, "bytes": 0, "in_loop": 0, "largest": ""})
      if c.bytes > array_bytes(d["largest"]):
        d["largest"] = c.shape
      d["count"] += 1
      d["bytes"] += c.bytes
      d["in_loop"] += c.in_loop
    mem = dataclasses.asdict(self.memory) if self.memory else None
    if mem:
      mem["peak"] = self.memory.peak
    return dict(name=self.name, platform=self.platform, target=self.target, devices=self.devices,
                lower_s=round(self.lower_s, 2), compile_s=round(self.compile_s, 2), memory=mem, flops=self.flops,
                bytes_accessed=self.bytes_accessed, cost_source=self.cost_source, collectives=by_op,
                custom_calls=self.custom_calls, custom_fusions=self.custom_fusions)


def lower(fn, *args, **kwargs):
  """`fn.lower(*args)` for the platform in force: under a compile-only target, arguments that name
  no device go to the target's first (jit's default device, only while lowering: eager work
  around it still runs on the host)."""
  current = platform.current()
  first = jax.default_device(current.devices[0]) if current and current.devices else contextlib.nullcontext()
  with first:
    return fn.lower(*args, **kwargs)


def compile_program(fn, *args, target=None, name: str = "", **kwargs) -> Program:
  """Lowers and compiles jitted `fn` at `args` (ShapeDtypeStructs, with shardings over the
  target's devices where the program spans several; unsharded ones go to its first device) for
  the platform in force, or inside `targets.compile_for(target)` when a target (name or
  `targets.Target`) is given, and reads the result (module docstring)."""
  ctx = targets.compile_for(target) if target is not None else contextlib.nullcontext()
  with ctx:
    current = platform.current()
    t0 = time.perf_counter()
    lowered = lower(fn, *args, **kwargs)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
  shardings = jax.tree_util.tree_leaves((compiled.input_shardings, compiled.output_shardings))
  kinds = {d.platform for s in shardings for d in s.device_set}
  if current is not None and kinds - {current.backend}:
    raise ValueError(f"compile_program: {name or 'the program'} was built for {sorted(kinds)} devices, not "
                     f"{current.name or current.backend}'s: its arguments' shardings name other devices (build "
                     "meshes from platform.devices() inside the target's block)")
  text = compiled.as_text()
  flops, nbytes, source = cost(compiled)
  n_dev = max([len(s.device_set) for s in shardings] or [1])
  return Program(name or getattr(fn, "__name__", "program"), current.backend if current else jax.default_backend(),
                 current.name if current else "", n_dev, t1 - t0, t2 - t1, memory(compiled), flops, nbytes, source,
                 collectives(text), custom_calls(text), custom_fusions(text), text, compiled)
