"""What a decoding step moves, counted in the compiled program: shapes only, nothing allocated.

  python benchmarks/decode_bytes.py                      # 0.6B and 8B shapes, bf16, table
  python benchmarks/decode_bytes.py --check              # exit 1 naming each target missed
  python benchmarks/decode_bytes.py --shapes=qwen3_0p6b --batch_sizes=1 --programs=ar --weight_dtypes=bf16

For each model shape (Qwen3-0.6B, Qwen3-8B; bf16 parameters, compute dtype 'auto'), program (the AR
decoder, the block-diffusion decoder with a 32-slot window and `kv_write` 'separate', the same with
'fused' (a 64-slot window on every step), a speculative round: that drafter verified by the AR
model), batch size and weight dtype (`--weight_dtypes`: bf16, and float8_e4m3fn: DecodeConfig.
weight_dtype), the decoder is lowered from `jax.ShapeDtypeStruct`s of its params as serving
prepares them (`qwen3.decode_params`: projections fused, kernels in the weight dtype) and
compiled by XLA for this machine's backend, and its HLO is read:

  * weight reads per step: the decode loop is the innermost `while` whose body reads a layer's
    weights itself (not through a nested loop); every instruction of its body that consumes a
    weight (or a bitcast / loop-carried alias of one) reads it: a fusion reads the whole operand
    unless the fused computation only slices or gathers it (then: the slice's bytes), a nested
    loop's reads count its known trip count times, a conditional its most expensive branch. A
    nested loop that reads layer weights itself is a decode loop too, whose iterations are steps
    of their own (a speculative round's drafter steps, nested in the cycle that ends with the
    verifier's pass): its reads count per its own step. Per weight leaf: bytes read / the leaf's
    bytes. The untied input embedding is only gathered (a
    few rows a step) and is not a target. Counted in the program as lowered, before XLA's fusion
    passes, where a float8 kernel's convert to bf16 counts inside the matmul that consumes it
    (XLA's GPU GEMM fusions read the float8 operand); target: float8 weight bytes per step <=
    MAX_FLOAT8_VS_BF16 x the bf16 weights a step reads;
  * matmuls per layer and step: the dots (or fusions holding one) that read a layer's weights;
    target 4 (qkv, o, gate_up, down: decode_params' fused layout; 7 unfused);
  * float8 converts hoisted out of the loop (`--hoist_check`, float8 rows): the decoder compiled
    for this backend, each float8 weight that enters the decode loop as a wider copy (loop-
    invariant code motion converting the whole weight once: every step would read the copy);
    target none (`qwen3.in_step` ties the convert to the step's activations);
  * f32 converts of weights in the loop: converts of a weight to f32 inside the loop, and
    weights that enter the loop as f32 copies of bf16 parameters (a convert hoisted out of the
    loop still doubles the bytes every step reads);
  * host round trips per generated token: each iteration of a data-dependent `while` copies its
    predicate to the host, and so does each `conditional` it runs (XLA's GPU runtime; loops of a
    known trip count do not). Per outer iteration: 1 + the conditionals run; divided by the decode
    steps one outer iteration runs (the trip counts of the nested decode loops), at one token per
    step (AR; the diffusion decoder's worst case);
  * XLA's `cost_analysis()` of one step compiled alone (window forward + vocabulary term):
    bytes accessed and FLOPs;
  * the ideal: the weights read once (the gathered rows of an untied input embedding aside) + the
    KV cache read once + the window's K/V written; and the roofline steps/s and tokens/s on an H100
    (3.35 TB/s) and an H200 (4.8 TB/s) that follow (AR: one token per row and step; diffusion and
    speculative: `--commits` tokens per row and step); and the steps/s that XLA's FLOPs per step
    allow at 989 TFLOP/s (dense bf16 on either): a step runs at the lower of the two rates. A
    'fused' window doubles a step's FLOPs and saves each row the step it spends on a block's K/V
    write with 'separate' (decode/sampler.py `resolve_kv_write` picks by rows from these columns).

Depth: every layer is the same program, so the counts are made at `--layers` (default 2) and the
per-layer ones checked equal across those layers; bytes and FLOPs are extrapolated exactly to the
full depth from `--layers` and one layer less (cost(L) = cost(l) + (L - l) * (cost(l) - cost(l-1))).
The counts describe XLA's program for this backend (CPU here); a GPU compile fuses differently,
which `run_gpu_benchmarks.sh` dumps and counts on the device. With `--hlo_dir`, the float8 rows also
say what the compiled step reads of a float8 layer kernel per its bytes: 1 where the backend fuses
the convert into the matmul, 3 or more where it materialises a wider copy each step (XLA's CPU
backend: an f32 copy).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dgr2_jax.decode import sampler, speculative  # noqa: E402
from dgr2_jax.model import qwen3  # noqa: E402
from dgr2_jax.model.config import Qwen3Config  # noqa: E402

# Its own flag registry: tests import this script beside decode_throughput.py, whose flags share names.
FLAGS = flags.FlagValues()


def _flag(define, *args, **kw):
  return define(*args, flag_values=FLAGS, **kw)


_flag(flags.DEFINE_list, "shapes", ["qwen3_0p6b", "qwen3_8b"], "model shapes (SHAPES)")
_flag(flags.DEFINE_list, "programs", ["ar", "diffusion", "diffusion_fused", "speculative"], "decoders")
_flag(flags.DEFINE_list, "batch_sizes", ["1", "8", "64"], "batch sizes")
_flag(flags.DEFINE_integer, "prompt_len", 2200, "prompt tokens")
_flag(flags.DEFINE_integer, "max_new_tokens", 128, "response slots (the KV cache holds prompt + these)")
_flag(flags.DEFINE_integer, "block_size", 32, "the diffusion window")
_flag(flags.DEFINE_integer, "layers", 2, "layers compiled (>= 2); counts extrapolate to the full depth")
_flag(flags.DEFINE_integer, "commits", 4, "tokens per row and step of the diffusion/speculative roofline")
_flag(flags.DEFINE_list, "weight_dtypes", ["bf16", "float8_e4m3fn"],
      "the decoders' weight dtypes (DecodeConfig.weight_dtype; bf16 = the compute dtype)")
_flag(flags.DEFINE_bool, "hoist_check", True,
      "compile each float8 decoder and count the weight converts XLA hoisted out of its decode loop")
_flag(flags.DEFINE_bool, "check", False, "exit 1 naming each target missed")
_flag(flags.DEFINE_bool, "xla_cost", True, "compile each step alone for XLA's cost analysis (most of the run time)")
_flag(flags.DEFINE_string, "json_out", "", "also write the rows as JSON here")
_flag(flags.DEFINE_string, "hlo_dir", "", "also compile each decoder for this backend, write its optimised HLO "
                    "here and count the copies, converts and all-gathers inside its decode loop")

SHAPES = {
    "qwen3_0p6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3_8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}
HBM = {"H100": 3.35e12, "H200": 4.8e12}   # bytes/s
PEAK = {"H100": 989e12, "H200": 989e12}   # dense bf16 FLOP/s (SXM)
MAX_ROUND_TRIPS_PER_TOKEN = 1 / 8
MAX_B64_DIFFUSION_WEIGHT_RATIO = 1.05
PROJECTIONS_PER_LAYER = 4          # qkv, o, gate_up, down (qwen3.decode_params' fused layout)
MAX_FLOAT8_VS_BF16 = 0.55          # float8 weight bytes per step / the bf16 weights a step reads

# ---- the optimised HLO, parsed just enough ---------------------------------------------------------
_ITEM = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2,
         "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_ARRAY = re.compile(r"\b(pred|bf16|f8e4m3fn|f8e5m2|[suf]\d+)\[([\d,]*)\]")
HLO_DTYPES = {np.dtype(jnp.bfloat16): "bf16", np.dtype(np.float32): "f32", np.dtype(np.float16): "f16",
              np.dtype(jnp.float8_e4m3fn): "f8e4m3fn"}
_NAME = re.compile(r"%[\w.\-]+")
SLICING = ("slice", "dynamic-slice", "gather")
ALIASING = ("bitcast", "get-tuple-element", "tuple", "parameter", "reshape")


def array_bytes(shape: str) -> int:
  """Bytes of every array in an HLO shape string (a tuple: their sum)."""
  total = 0
  for dt, dims in _ARRAY.findall(shape):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * _ITEM.get(dt, 4)
  return total


def _dtype(shape: str) -> str:
  m = _ARRAY.search(shape)
  return m.group(1) if m else ""


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


_TOKEN = re.compile(r"%?([A-Za-z_][\w.\-]*)")


def parse_hlo(text: str):
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


def _attr(attrs: str, key: str):
  m = re.search(key + r"=%?([\w.\-]+)", attrs)
  return m.group(1) if m else None


def _branches(attrs: str):
  m = re.search(r"branch_computations=\{([^}]*)\}", attrs)
  if m:
    return [t.strip().lstrip("%") for t in m.group(1).split(",")]
  return [b for b in (_attr(attrs, "true_computation"), _attr(attrs, "false_computation")) if b]


def _trip_count(attrs: str, cond: list):
  """A while loop's trip count: XLA's known_trip_count, or a condition that is only
  `counter < constant` (the loops of lax.scan / fori_loop, counting from 0); else None."""
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"', attrs)
  if m:
    return int(m.group(1))
  root = next((i for i in cond if i.root), None)
  if root is None or root.opcode != "compare" or "direction=LT" not in root.attrs:
    return None
  consts = {i.name: i.inner for i in cond if i.opcode == "constant"}
  if len(root.operands) == 2 and root.operands[1] in consts and consts[root.operands[1]].strip().isdigit():
    return int(consts[root.operands[1]])
  return None


@dataclasses.dataclass
class Loop:
  name: str
  trip: int | None
  own: dict            # leaf -> bytes read per iteration by the body itself (conditionals: max branch);
                       # rows gathered (an embedding lookup) count under key (leaf, "gather")
  conds: int           # conditionals the body runs itself per iteration
  converts: list       # (leaf, what) f32 converts of weights in the body
  children: list       # nested Loops
  dots: dict = dataclasses.field(default_factory=dict)   # leaf -> matmuls reading it per iteration

  def reads(self) -> dict:
    """leaf -> bytes per iteration, nested loops times their trip count (unknown: once)."""
    out = dict(self.own)
    for ch in self.children:
      for k, v in ch.reads().items():
        out[k] = out.get(k, 0) + v * (ch.trip or 1)
    return out


class Counter:
  """Walks an optimised HLO module from its entry, following each weight (entry parameters
  0..n-1) through aliases, loop-carried tuples, conditionals and calls (module docstring)."""

  def __init__(self, text: str, leaf_dtypes: list, leaf_sizes: list, lowered: bool = False):
    self.comps, self.entry = parse_hlo(text)
    # `lowered` (the program before XLA's fusion passes): a float8 weight converted in a loop to a
    # narrower-than-f32 dtype is taken as converted inside its consumer's operand (XLA's GPU GEMM
    # fusions read the float8 bytes), so the consumer reads the float8 bytes; the compiled program
    # is counted as it is.
    self.lowered = lowered
    self.leaf_dtypes = leaf_dtypes   # HLO dtype names of the weight leaves, by entry parameter
    self.leaf_sizes = leaf_sizes     # their element counts
    self.loops: list[Loop] = []

  def run(self):
    args = [[i, self.leaf_dtypes[i], False] for i in range(len(self.leaf_dtypes))]
    self._walk(self.entry, None, args, Loop("entry", 1, {}, 0, [], self.loops))
    return self.loops

  def _users(self, comp: str) -> dict:
    users = {}
    for ins in self.comps[comp]:
      for o in ins.operands:
        users.setdefault(o, []).append(ins)
    return users

  def _param(self, comp: str, index: int) -> Inst:
    return next(i for i in self.comps[comp] if i.opcode == "parameter" and i.inner.strip() == str(index))

  def _fused_read(self, comp: str, index: int, operand_bytes: int) -> int:
    """Bytes a fusion reads of its operand `index`: the slices' bytes when the fused computation
    only slices/gathers that parameter (through bitcasts), else all of it."""
    users, total, todo = self._users(comp), 0, [self._param(comp, index).name]
    while todo:
      name = todo.pop()
      for u in users.get(name, []):
        if u.opcode == "bitcast":
          todo.append(u.name)
        elif u.opcode in SLICING and u.operands[0] == name:
          total += array_bytes(u.shape)
        else:
          return operand_bytes
    return min(total, operand_bytes)

  def _fused_converts(self, comp: str, index: int) -> bool:
    """Whether the fused computation converts its operand `index` (moved, not computed on) to f32."""
    users, todo = self._users(comp), [self._param(comp, index).name]
    while todo:
      for u in users.get(todo.pop(), []):
        if u.opcode == "convert" and _dtype(u.shape) == "f32":
          return True
        if u.opcode in ("bitcast", "broadcast", "reshape", "transpose", "copy") + SLICING:
          todo.append(u.name)
    return False

  def _pure_copy(self, comp: str) -> bool:
    return all(i.opcode in ("parameter", "convert", "bitcast", "copy", "transpose", "reshape")
               for i in self.comps[comp])

  def _walk(self, comp: str, loop: Loop | None, args: list, node: Loop):
    """Provenance of every instruction of `comp` given its parameters' (`args`: per parameter a
    weight (leaf, dtype), a tuple of those/None, or None); reads go to `loop` (None: outside any
    loop, not counted). Nested loops become children of `node`. Returns the root's provenance."""
    prov = {}
    for ins in self.comps[comp]:
      ops = [prov.get(o) for o in ins.operands]
      out = None
      if ins.opcode == "parameter":
        k = int(ins.inner.strip())
        out = args[k] if k < len(args) else None
      elif ins.opcode == "get-tuple-element":
        k = int(re.search(r"index=(\d+)", ins.attrs).group(1))
        out = ops[0][k] if isinstance(ops[0], tuple) and k < len(ops[0]) else None
      elif ins.opcode == "tuple":
        out = tuple(ops)
      elif ins.opcode == "opt-barrier":   # an optimization barrier passes its tuple through (qwen3.in_step)
        out = ops[0]
      elif ins.opcode in ("bitcast", "reshape", "transpose", "broadcast"):   # moved, not read (fused)
        out = ops[0] if isinstance(ops[0], list) else None
      elif ins.opcode == "while":
        body, cond = _attr(ins.attrs, "body"), _attr(ins.attrs, "condition")
        child = Loop(ins.name, _trip_count(ins.attrs, self.comps[cond]), {}, 0, [], [])
        # Only loop-invariant elements keep their weight: a dry walk finds what the body returns.
        init = ops[0]
        if isinstance(init, tuple):
          back = self._walk(body, None, [init], Loop("dry", 1, {}, 0, [], []))
          init = tuple(x if isinstance(back, tuple) and i < len(back) and back[i] == x else None
                       for i, x in enumerate(init))
        node.children.append(child)
        self._walk(body, child, [init], child)
        self._walk(cond, child, [init], child)
        out = init
      elif ins.opcode == "conditional":
        if loop is not None:
          loop.conds += 1
        best = None
        for bi, br in enumerate(_branches(ins.attrs)):
          tmp = Loop(br, 1, {}, 0, [], [])
          self._walk(br, tmp, [ops[bi + 1]], tmp)
          if best is None or sum(tmp.reads().values()) > sum(best.reads().values()):
            best = tmp
        if best is not None:
          node.children.extend(best.children)
        if best is not None and loop is not None:
          for k, v in best.own.items():
            loop.own[k] = loop.own.get(k, 0) + v
          for k, v in best.dots.items():
            loop.dots[k] = loop.dots.get(k, 0) + v
          loop.conds += best.conds
          loop.converts += best.converts
      elif ins.opcode == "call":
        out = self._walk(_attr(ins.attrs, "to_apply"), loop, ops, node)
      else:
        weights = [(j, o) for j, o in enumerate(ops) if isinstance(o, list)]
        called = _attr(ins.attrs, "calls") if ins.opcode == "fusion" else None
        if self._dequant(ins, weights, loop):   # lowered: converted inside its consumer (__init__)
          prov[ins.name] = weights[0][1]
          continue
        matmul = ins.opcode == "dot" or (ins.opcode == "custom-call" and "gemm" in ins.attrs.lower()) or (
            called is not None and self._has_dot(called))
        for j, (leaf, dt, before) in weights:
          # A broadcast weight (a norm scale over [B, T, E]) is read once: at most its own bytes.
          nbytes = min(array_bytes(self._operand_shape(comp, ins.operands[j])),
                       self.leaf_sizes[leaf] * _ITEM.get(dt, 4))
          if loop is not None:
            read = self._fused_read(called, j, nbytes) if called else (
                array_bytes(ins.shape) if ins.opcode in SLICING else nbytes)
            key = (leaf, "gather") if ins.opcode == "gather" else leaf
            loop.own[key] = loop.own.get(key, 0) + read
            if matmul:
              loop.dots[leaf] = loop.dots.get(leaf, 0) + 1
            if before and dt != self.leaf_dtypes[leaf]:   # a hoisted convert: every step reads the copy
              loop.converts.append((leaf, f"reads a {dt} copy made before the loop ({ins.name})"))
            elif dt == "f32" and self.leaf_dtypes[leaf] != "f32":
              loop.converts.append((leaf, f"reads an f32 copy ({ins.name})"))
            if dt != "f32" and ((ins.opcode == "convert" and _dtype(ins.shape) == "f32")
                                or (called and self._fused_converts(called, j))):
              loop.converts.append((leaf, f"converts to f32 ({ins.name})"))
        if len(weights) == 1 and ins.opcode in ("convert", "copy", "transpose") or (
            called and len(weights) == 1 and len(ins.operands) == 1 and self._pure_copy(called)):
          w = weights[0][1]
          out = [w[0], _dtype(ins.shape), w[2] or (loop is None and _dtype(ins.shape) != w[1])]
      prov[ins.name] = out
    root = next((i for i in self.comps[comp] if i.root), None)
    return prov.get(root.name) if root else None

  def _dequant(self, ins: Inst, weights: list, loop) -> bool:
    """Whether `ins` is a float8 weight's convert that the lowered count folds into its consumer."""
    return (self.lowered and loop is not None and ins.opcode == "convert" and len(weights) == 1
            and weights[0][1][1].startswith("f8") and _dtype(ins.shape) not in ("f32", "f64"))

  def _has_dot(self, comp: str) -> bool:
    return any(i.opcode == "dot" or (i.opcode == "fusion" and self._has_dot(_attr(i.attrs, "calls")))
               for i in self.comps.get(comp, []))

  def _operand_shape(self, comp: str, name: str) -> str:
    key = (comp, name)
    if not hasattr(self, "_shapes"):
      self._shapes = {}
    if key not in self._shapes:
      for ins in self.comps[comp]:
        self._shapes[(comp, ins.name)] = ins.shape
    return self._shapes.get(key, "")


def _layer_leaf(path: str) -> bool:
  return "layers_" in path


def step_loops(loops: list, paths: list) -> list:
  """The decode loops: every loop whose body reads some layer weight itself (module docstring)."""
  out = []
  for lp in loops:
    if any(_layer_leaf(paths[k if isinstance(k, int) else k[0]]) for k in lp.own):
      out.append(lp)
    out.extend(step_loops(lp.children, paths))
  return out


def round_trips(loops: list, paths: list):
  """(host round trips, decode steps) per iteration of the outermost data-dependent loop that runs
  decode steps, summed over such loops."""
  def steps(lp):
    own = 1 if any(_layer_leaf(paths[k if isinstance(k, int) else k[0]]) for k in lp.own) else 0
    return own + sum(steps(ch) * (ch.trip or 1) for ch in lp.children)

  def conds(lp):
    return lp.conds + sum(conds(ch) * (ch.trip or 1) + (0 if ch.trip else 1) for ch in lp.children)
  trips, n = 0, 0
  for lp in loops:
    s = steps(lp)
    if not s:
      continue
    if lp.trip is None:
      trips, n = trips + 1 + conds(lp), n + s
    else:
      t, m = round_trips(lp.children, paths)
      trips, n = trips + t * lp.trip, n + m * lp.trip
  return trips, n


def analyse(text: str, leaves: list, lowered: bool = True) -> dict:
  """Counts of a decoder's HLO (module docstring): as lowered (`lowered_text`; a float8 weight's
  convert counts inside its consumer, `Counter`), or as compiled (`compiled_text`: everything as XLA
  left it). leaves: [(path, ShapeDtypeStruct)] of its weight arguments, in argument order (entry
  parameters 0..n-1)."""
  paths = [p for p, _ in leaves]
  counter = Counter(text, [HLO_DTYPES[np.dtype(x.dtype)] for _, x in leaves],
                    [int(np.prod(x.shape)) for _, x in leaves], lowered=lowered)
  loops = counter.run()
  decode = step_loops(loops, paths)
  if not decode:
    raise ValueError("no decode loop found: no while loop reads a layer's weights")
  steps = {id(lp) for lp in decode}

  def per_step(lp, field):
    """`field` (own reads, dots) per iteration of a decode loop; a decode loop nested in it is a
    step of its own (the speculative drafter's steps inside a verification cycle) and counts
    there, not here."""
    out = dict(getattr(lp, field))
    for ch in lp.children:
      if id(ch) not in steps:
        for k, v in per_step(ch, field).items():
          out[k] = out.get(k, 0) + v * (ch.trip or 1)
    return out
  reads, dots = {}, {}
  for lp in decode:   # several decode loops (e.g. a peeled step): the largest reads per leaf
    for field, acc in (("own", reads), ("dots", dots)):
      for k, v in per_step(lp, field).items():
        acc[k] = max(acc.get(k, 0), v)
  sizes = [int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for _, x in leaves]
  ratio = {paths[k]: reads.get(k, 0) / sizes[k] for k in range(len(paths))}   # rows gathered aside
  gathered = {paths[k]: reads.get((k, "gather"), 0) / sizes[k] for k in range(len(paths))}
  converts = sorted({(paths[k], what) for lp in decode for k, what in _all_converts(lp)})
  trips, steps = round_trips(loops, paths)
  return dict(reads=ratio, gathered=gathered, weight_bytes_read=sum(reads.values()), converts=converts,
              round_trips=trips, steps_per_round_trip_unit=steps,
              round_trips_per_token=trips / max(steps, 1), matmuls_per_layer=layer_matmuls(dots, paths))


def layer_matmuls(dots: dict, paths: list) -> dict:
  """{layer ('layers_3', '1/layers_3': a speculative pair's verifier): matmuls per step that read
  its weights} from matmuls per leaf: the projections, 4 with decode_params' fused layout
  (qkv, o, gate_up, down), 7 without."""
  out = {}
  for k, n in dots.items():
    m = re.match(r"(.*?layers_\d+)/", paths[k])
    if m:
      out[m.group(1)] = out.get(m.group(1), 0) + n
  return out


def loop_ops(compiled_text_: str, leaves: list) -> dict:
  """Instructions by kind (copy, convert, all-gather) inside the decode loops of an optimised
  program, fused computations included: what a step moves beyond its matmuls."""
  counter = Counter(compiled_text_, [HLO_DTYPES.get(np.dtype(x.dtype), "f32") for _, x in leaves],
                    [int(np.prod(x.shape)) for _, x in leaves])
  loops = step_loops(counter.run(), [p for p, _ in leaves])
  seen, todo = set(), []
  for lp in loops:
    ins = next(i for c in counter.comps.values() for i in c if i.name == lp.name)
    todo.append(_attr(ins.attrs, "body"))
  while todo:
    comp = todo.pop()
    if comp in seen or comp not in counter.comps:
      continue
    seen.add(comp)
    for ins in counter.comps[comp]:
      for key in ("calls", "to_apply", "body", "condition"):
        if _attr(ins.attrs, key):
          todo.append(_attr(ins.attrs, key))
      todo.extend(_branches(ins.attrs))
  counts = {"copy": 0, "convert": 0, "all-gather": 0}
  for comp in seen:
    for ins in counter.comps[comp]:
      for k in counts:
        counts[k] += ins.opcode.startswith(k) and not ins.opcode.endswith("-done")
  return counts


def _all_converts(lp: Loop):
  out = list(lp.converts)
  for ch in lp.children:
    out += _all_converts(ch)
  return out


def leaves_of(tree) -> list:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [("/".join(str(getattr(k, "key", k)) for k in path), x) for path, x in flat]


# ---- the programs ------------------------------------------------------------------------------
def model_config(shape: str, layers: int) -> Qwen3Config:
  return Qwen3Config(rope_theta=1e6, **dict(SHAPES[shape], num_hidden_layers=layers),
                     param_dtype="bfloat16", dtype="auto", attention_impl="xla",
                     mask_token_id=SHAPES[shape]["vocab_size"] - 1, eos_token_id=0, pad_token_id=0)


def prepared_shapes(cfg: Qwen3Config, weight_dtype: str = "") -> dict:
  """ShapeDtypeStructs of the params a decoder's loop reads (`qwen3.decode_params`: per layer,
  projections fused, kernels in `weight_dtype`), prepared outside the decoder as serving does."""
  # Prepared in the params' own dtype: a decoder computing in another dtype casts them (and is caught).
  auto = cfg.replace(dtype="auto")
  return jax.eval_shape(lambda p: qwen3.decode_params(auto, p, weight_dtype), qwen3.param_shapes(cfg))


def decoder_program(program: str, cfg: Qwen3Config, batch: int, prompt_len: int, new_tokens: int, block: int,
                    weight_dtype: str = ""):
  """(jitted decoder, argument ShapeDtypeStructs, weight leaves) of one program, its params
  prepared (`prepared_shapes`)."""
  pshape = prepared_shapes(cfg, weight_dtype)
  sd = jax.ShapeDtypeStruct
  toks, lens = sd((batch, prompt_len), jnp.int32), sd((batch,), jnp.int32)
  scalars = (sd((), jnp.float32), sd((), jnp.float32), sd((), jnp.int32), sd((), jnp.float32),
             sd((2,), jnp.uint32), sd((), jnp.int32))
  mask = cfg.mask_token_id
  if program == "speculative":
    dc = sampler.DecodeConfig(block_size=block, max_new_tokens=new_tokens, eos_ids=(0,), mask_token_id=mask,
                              kv_write="separate", steps_per_block=0, weight_dtype=weight_dtype)
    fn = speculative.decoder_for(cfg, cfg, dc)
    return fn, (pshape, pshape, toks, lens) + scalars, leaves_of((pshape, pshape))
  bs = 1 if program == "ar" else block
  dc = sampler.DecodeConfig(block_size=bs, max_new_tokens=new_tokens, eos_ids=(0,), mask_token_id=mask,
                            kv_write="fused" if program == "diffusion_fused" else "separate", steps_per_block=0,
                            weight_dtype=weight_dtype)
  fn = sampler.decoder_for(cfg, dc)[1]
  return fn, (pshape, toks, lens) + scalars, leaves_of(pshape)


def step_program(program: str, cfg: Qwen3Config, batch: int, slots: int, block: int, weight_dtype: str = ""):
  """(jitted step, argument ShapeDtypeStructs): one window forward against a `slots` KV cache and
  the vocabulary term of its predicting positions, as one decoding step runs them."""
  pshape = prepared_shapes(cfg, weight_dtype)
  sd = jax.ShapeDtypeStruct
  width = {"ar": 1, "diffusion_fused": 2 * block}.get(program, block)   # fused: [previous block | canvas]
  c = cfg.as_block_diffusion(1) if width == 1 else cfg.as_block_diffusion(min(width, block))
  cache = jax.eval_shape(lambda: qwen3.init_cache(c, batch, slots))

  def step(params, cache, tokens, start, plen, positions, keys):
    h, cache = sampler.window_forward(c, params, tokens, start, cache, plen, slots - 256, positions, return_hidden=True)
    h = h[:, width - min(width, block):]                     # the predicting positions (fused: the canvas's)
    tok, lp = sampler.choose(c, params, h, keys, jnp.float32(0), jnp.int32(0), jnp.float32(1), c.mask_token_id)
    return tok, lp, cache

  args = (pshape, cache, sd((batch, width), jnp.int32), sd((batch,), jnp.int32), sd((batch,), jnp.int32),
          sd((batch, slots), jnp.int32), sd((batch, 2), jnp.uint32))
  return jax.jit(step, donate_argnums=(1,)), args


def cost(fn, args) -> tuple[float, float]:
  ca = fn.lower(*args).compile().cost_analysis()
  ca = ca[0] if isinstance(ca, (list, tuple)) else ca
  return float(ca.get("bytes accessed", 0.0)), float(ca.get("flops", 0.0))


def full_weight_bytes(cfg: Qwen3Config, weight_dtype: str = "") -> tuple[int, int]:
  """(bytes of every weight, bytes a step must read: all but the untied input embedding), prepared
  for `weight_dtype`."""
  leaves = leaves_of(prepared_shapes(cfg, weight_dtype))
  total = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for _, x in leaves)
  emb = [int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for p, x in leaves if p.startswith("embed_tokens")][0]
  return total, total - (0 if cfg.tie_word_embeddings else emb)


def step_costs(shape: str, program: str, batch: int, weight_dtype: str) -> tuple:
  """XLA's (bytes accessed, FLOPs) of one step at full depth, extrapolated from `--layers` and one less."""
  l_hi = max(FLAGS.layers, 2)
  full = SHAPES[shape]["num_hidden_layers"]
  slots = FLAGS.prompt_len + FLAGS.max_new_tokens
  costs = {}
  for layers in (l_hi - 1, l_hi):
    cfg = model_config(shape, layers)
    if not FLAGS.xla_cost:
      costs[layers] = (float("nan"), float("nan"))
    elif program == "speculative":   # a round: the drafter's window step and the verifier's W+1 window
      b1, f1 = cost(*step_program("diffusion", cfg, batch, slots, FLAGS.block_size, weight_dtype))
      b2, f2 = cost(*step_program("diffusion", cfg, batch, slots + FLAGS.block_size, FLAGS.block_size + 1,
                                  weight_dtype))
      costs[layers] = (b1 + b2, f1 + f2)
    else:
      costs[layers] = cost(*step_program(program, cfg, batch, slots, FLAGS.block_size, weight_dtype))
  return tuple(costs[l_hi][i] + (full - l_hi) * (costs[l_hi][i] - costs[l_hi - 1][i]) for i in (0, 1))


def count_program(shape: str, program: str, batch: int, weight_dtype: str) -> dict:
  """`analyse` of the lowered decoder at `--layers` layers; with a float8 weight dtype (or
  `--hlo_dir`) also of the compiled one: the converts XLA hoisted out of the decode loop."""
  fn, args, leaves = decoder_program(program, model_config(shape, max(FLAGS.layers, 2)), batch, FLAGS.prompt_len,
                                     FLAGS.max_new_tokens, FLAGS.block_size, weight_dtype)
  res = analyse(lowered_text(fn, args), leaves)
  res["hoisted"] = None
  if FLAGS.hlo_dir or (weight_dtype and FLAGS.hoist_check):
    text = compiled_text(fn, args)
    # Float8 weights only: XLA's CPU backend hoists its f32 copies of bf16 weights (norm scales, the
    # untied input embedding) out of any loop, a CPU choice the GPU's bf16 matmuls do not need.
    narrow = {p for p, x in leaves if HLO_DTYPES[np.dtype(x.dtype)].startswith("f8")}
    compiled = analyse(text, leaves, lowered=False)
    res["hoisted"] = sorted({p for p, w in compiled["converts"] if "before the loop" in w and p in narrow})
    # What the backend's step reads of its float8 layer kernels, per their bytes: 1 where the
    # convert is fused into the matmul (GPU GEMM fusions), 3 or more where it is materialised.
    res["compiled_f8_reads"] = max((compiled["reads"][p] for p in narrow if "layers_" in p), default=None)
    if FLAGS.hlo_dir:
      os.makedirs(FLAGS.hlo_dir, exist_ok=True)
      name = f"{shape}_{program}_b{batch}_l{max(FLAGS.layers, 2)}{'_' + weight_dtype if weight_dtype else ''}"
      with open(os.path.join(FLAGS.hlo_dir, name + ".hlo.txt"), "w") as f:
        f.write(text)
      res["loop_ops"] = loop_ops(text, leaves)
  return res


def measure(shape: str, program: str, batch: int, weight_dtype: str = "") -> dict:
  """One row of the table."""
  t0 = time.perf_counter()
  res = count_program(shape, program, batch, weight_dtype)
  xla_bytes, xla_flops = step_costs(shape, program, batch, weight_dtype)
  cfg_full = model_config(shape, SHAPES[shape]["num_hidden_layers"])
  models = 2 if program == "speculative" else 1
  weights_all, weights_read = (models * x for x in full_weight_bytes(cfg_full, weight_dtype))
  bf16_read = models * full_weight_bytes(cfg_full)[1]
  layer_ratios = {}
  for path, r in res["reads"].items():
    if "layers_" in path:
      layer_ratios.setdefault(re.sub(r"layers_\d+/", "", path), set()).add(round(r, 6))
  uneven = [k for k, v in layer_ratios.items() if len(v) > 1]
  if uneven:
    raise RuntimeError(f"{shape} {program}: layers read differently ({uneven[:3]}): cannot extrapolate")
  # Weight bytes read per step at full depth: the non-layer leaves as counted, each layer leaf's
  # ratio times its bytes at full depth.
  full_shapes = prepared_shapes(cfg_full, weight_dtype)
  full_leaves = leaves_of(full_shapes if models == 1 else (full_shapes, full_shapes))
  at0 = lambda p: re.sub(r"layers_\d+/", "layers_0/", p)
  ratio_of = lambda p: res["reads"].get(at0(p), 0.0) + res["gathered"].get(at0(p), 0.0)
  read = sum(ratio_of(p) * int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for p, x in full_leaves)
  c = cfg_full
  slots = FLAGS.prompt_len + FLAGS.max_new_tokens
  width = {"ar": 1, "diffusion": FLAGS.block_size, "diffusion_fused": 2 * FLAGS.block_size,
           "speculative": 2 * FLAGS.block_size + 1}[program]
  kv_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2   # bf16 K and V, all layers
  kv_read = batch * slots * kv_token * (2 if program == "speculative" else 1)
  ideal = weights_read + kv_read + batch * width * kv_token
  tokens = batch * (1 if program == "ar" else FLAGS.commits)
  targets = [p for p, r in res["reads"].items()
             if not (p.endswith("embed_tokens/embedding") and not c.tie_word_embeddings)]
  return dict(
      shape=shape, program=program, batch=batch, weight_dtype=weight_dtype or "bf16",
      compile_s=round(time.perf_counter() - t0, 1),
      weight_gb=weights_all / 1e9, weight_read_gb=read / 1e9, weight_read_ratio=read / weights_read,
      vs_bf16=read / bf16_read, matmuls_per_layer=sorted(set(res["matmuls_per_layer"].values())),
      hoisted=res["hoisted"],
      min_read=min(res["reads"][p] for p in targets), max_read=max(res["reads"][p] for p in targets),
      not_once=[p for p in targets if abs(res["reads"][p] - 1.0) > 1e-3],
      f32_converts=len(res["converts"]), convert_list=[f"{p}: {w}" for p, w in res["converts"]][:5],
      round_trips_per_token=res["round_trips_per_token"],
      xla_bytes_gb=xla_bytes / 1e9, xla_tflops=xla_flops / 1e12, ideal_gb=ideal / 1e9,
      roofline_steps_h100=HBM["H100"] / ideal, roofline_steps_h200=HBM["H200"] / ideal,
      roofline_tok_h100=tokens * HBM["H100"] / ideal, roofline_tok_h200=tokens * HBM["H200"] / ideal,
      flop_steps_h100=PEAK["H100"] / xla_flops, flop_steps_h200=PEAK["H200"] / xla_flops,
      loop_ops=res.get("loop_ops"), compiled_f8_reads=res.get("compiled_f8_reads"))


def compiled_text(fn, args) -> str:
  """The optimised HLO of a jitted function (re-jitted with keep_unused, so that entry parameter i
  is flattened argument i)."""
  return jax.jit(fn.__wrapped__, keep_unused=True).lower(*args).compile().as_text()


def lowered_text(fn, args) -> str:
  """The HLO of a jitted function as lowered (before XLA's backend passes), keep_unused."""
  return jax.jit(fn.__wrapped__, keep_unused=True).lower(*args).as_text(dialect="hlo")


def check(rows: list) -> list:
  """The targets each row misses (module docstring of the issue's Done-when)."""
  missed = []
  for r in rows:
    tag = f"{r['shape']} {r['program']} batch {r['batch']} {r['weight_dtype']}"
    if r["not_once"]:
      missed.append(f"{tag}: weights not read exactly once per step: {r['not_once'][:4]} "
                    f"(reads {r['min_read']:.3f}..{r['max_read']:.3f})")
    if r["f32_converts"]:
      missed.append(f"{tag}: {r['f32_converts']} f32 converts of weights in the loop: {r['convert_list']}")
    if r["round_trips_per_token"] > MAX_ROUND_TRIPS_PER_TOKEN + 1e-9:
      missed.append(f"{tag}: {r['round_trips_per_token']:.3f} host round trips per generated token "
                    f"(target <= {MAX_ROUND_TRIPS_PER_TOKEN:.3f})")
    if (r["program"].startswith("diffusion") and r["batch"] == 64
        and r["weight_read_ratio"] > MAX_B64_DIFFUSION_WEIGHT_RATIO):
      missed.append(f"{tag}: weight bytes per step {r['weight_read_ratio']:.3f}x the weights "
                    f"(target <= {MAX_B64_DIFFUSION_WEIGHT_RATIO}x)")
    if r["matmuls_per_layer"] != [PROJECTIONS_PER_LAYER]:
      missed.append(f"{tag}: {r['matmuls_per_layer']} matmuls per layer and step (target: "
                    f"{PROJECTIONS_PER_LAYER}: qkv, o, gate_up, down)")
    if r["weight_dtype"] != "bf16" and r["vs_bf16"] > MAX_FLOAT8_VS_BF16:
      missed.append(f"{tag}: weight bytes per step {r['vs_bf16']:.3f}x bf16's (target <= {MAX_FLOAT8_VS_BF16}x)")
    if r["hoisted"]:
      missed.append(f"{tag}: weights converted before the decode loop (every step reads the copy): "
                    f"{r['hoisted'][:4]}")
  return missed


def table(rows: list) -> str:
  head = ("| shape | program | batch | weights | weights GB | weight GB read / step | x weights | x bf16 weights | "
          "reads per leaf | matmuls / layer | f32 converts in loop | hoisted converts | round trips / token | "
          "XLA GB / step | XLA TFLOP / step | ideal GB / step | roofline steps/s H100 / H200 | "
          "roofline tokens/s H100 / H200 | FLOP-bound steps/s H100 / H200 |")
  out = [head, "|" + "---|" * (head.count("|") - 1)]
  for r in rows:
    hoisted = "-" if r["hoisted"] is None else len(r["hoisted"])
    out.append(f"| {r['shape']} | {r['program']} | {r['batch']} | {r['weight_dtype']} | {r['weight_gb']:.2f} | "
               f"{r['weight_read_gb']:.2f} | {r['weight_read_ratio']:.3f} | {r['vs_bf16']:.3f} | "
               f"{r['min_read']:.3f}-{r['max_read']:.3f} | {'/'.join(map(str, r['matmuls_per_layer']))} | "
               f"{r['f32_converts']} | {hoisted} | "
               f"{r['round_trips_per_token']:.3f} | {r['xla_bytes_gb']:.2f} | {r['xla_tflops']:.3f} | "
               f"{r['ideal_gb']:.2f} | {r['roofline_steps_h100']:.0f} / {r['roofline_steps_h200']:.0f} | "
               f"{r['roofline_tok_h100']:.0f} / {r['roofline_tok_h200']:.0f} | "
               f"{r['flop_steps_h100']:.0f} / {r['flop_steps_h200']:.0f} |")
  return "\n".join(out)


def main(_):
  rows = []
  for shape in FLAGS.shapes:
    for program in FLAGS.programs:
      for b in (int(x) for x in FLAGS.batch_sizes):
        for wd in FLAGS.weight_dtypes:
          rows.append(measure(shape, program, b, "" if wd == "bf16" else wd))
          print(f"# {shape} {program} batch {b} {wd}: {rows[-1]['compile_s']} s", file=sys.stderr, flush=True)
  print(f"Prompt {FLAGS.prompt_len}, {FLAGS.max_new_tokens} response slots, window {FLAGS.block_size}, bf16 compute; "
        f"counted at {FLAGS.layers} layers on {jax.default_backend()}; diffusion/speculative tokens at "
        f"{FLAGS.commits} per row and step.\n")
  print(table(rows))
  if FLAGS.hlo_dir:
    print(f"\nInside the decode loop of the optimised program ({jax.default_backend()}, {FLAGS.layers} layers; "
          f"HLO in {FLAGS.hlo_dir}; float8 reads: the most a step reads of a float8 layer kernel, per its "
          f"bytes):\n\n| shape | program | batch | weights | copies | converts | all-gathers | float8 reads |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in rows:
      o, f8 = r["loop_ops"], r["compiled_f8_reads"]
      print(f"| {r['shape']} | {r['program']} | {r['batch']} | {r['weight_dtype']} | {o['copy']} | {o['convert']} | "
            f"{o['all-gather']} | {'-' if f8 is None else f'{f8:.2f}'} |")
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as f:
      json.dump(rows, f, indent=1)
  if FLAGS.check:
    missed = check(rows)
    for m in missed:
      print("MISSED:", m)
    if missed:
      sys.exit(1)
    print("every target met")


if __name__ == "__main__":
  # absl's own flags (--help, logging) first, then this script's.
  app.run(main, flags_parser=lambda argv: FLAGS(flags.FLAGS(argv, known_only=True)))
