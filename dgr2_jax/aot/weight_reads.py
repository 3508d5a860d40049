"""Weight bytes a decoding step reads, counted in a decoder's HLO (benchmarks/decode_bytes.py's
counter; the tests check it on hand-made programs whose answers are known).

`analyse(text, leaves)` walks a module from its entry, following each weight (entry parameters
0..n-1: the decoder's params, `leaves_of` order) through aliases, loop-carried tuples,
conditionals and calls, and counts per decode loop:
  * reads per step and leaf: the decode loop is the innermost `while` whose body reads a layer's
    weights itself (not through a nested loop); every instruction of its body that consumes a
    weight (or a bitcast / loop-carried alias of one) reads it: a fusion reads the whole operand
    unless the fused computation only slices or gathers it (then: the slice's bytes), a nested
    loop's reads count its trip count times, a conditional its most expensive branch. A nested
    loop that reads layer weights itself is a decode loop too, whose iterations are steps of
    their own (a speculative round's drafter steps inside the verifier's cycle). Rows gathered
    (an embedding lookup) count apart (`gathered`);
  * matmuls per layer and step (dots, GEMM custom calls, fusions holding a dot that read a layer);
  * f32 converts of weights in the loop, and weights that enter it as converted copies made
    before it (a hoisted convert: every step reads the copy). In a compiled program a convert
    inside a matmul's fusion (a GPU GEMM computing in f32 from the bf16 operand) is marked
    `FUSED_MATMUL`: the step reads the weight's own bytes;
  * host round trips per decode step (a data-dependent `while` sends its predicate to the host
    each iteration, and so does each `conditional` it runs).
`lowered=True` counts the program as lowered (before XLA's fusion passes), where a float8
kernel's convert to a narrower-than-f32 dtype counts inside the matmul that consumes it (XLA's GPU
GEMM fusions read the float8 operand); `lowered=False` counts an optimised module as it is.
HLO text parsing: dgr2_jax/aot/hlo.py.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

from dgr2_jax.aot import hlo
from dgr2_jax.aot.hlo import ITEM_BYTES, Inst, array_bytes, parse
from dgr2_jax.aot.hlo import attr as _attr
from dgr2_jax.aot.hlo import branches as _branches
from dgr2_jax.aot.hlo import dtype_of as _dtype

HLO_DTYPES = {np.dtype(jnp.bfloat16): "bf16", np.dtype(np.float32): "f32", np.dtype(np.float16): "f16",
              np.dtype(jnp.float8_e4m3fn): "f8e4m3fn"}
SLICING = ("slice", "dynamic-slice", "gather")
FUSED_MATMUL = "inside its matmul's fusion "   # marks a convert a compiled GEMM fusion does in registers


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
class ReadLoop:
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
    self.comps, self.entry = parse(text)
    # `lowered` (the program before XLA's fusion passes): a float8 weight converted in a loop to a
    # narrower-than-f32 dtype is taken as converted inside its consumer's operand (XLA's GPU GEMM
    # fusions read the float8 bytes), so the consumer reads the float8 bytes; the compiled program
    # is counted as it is.
    self.lowered = lowered
    self.leaf_dtypes = leaf_dtypes   # HLO dtype names of the weight leaves, by entry parameter
    self.leaf_sizes = leaf_sizes     # their element counts
    self.loops: list[ReadLoop] = []

  def run(self):
    args = [[i, self.leaf_dtypes[i], False] for i in range(len(self.leaf_dtypes))]
    self._walk(self.entry, None, args, ReadLoop("entry", 1, {}, 0, [], self.loops))
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

  def _walk(self, comp: str, loop: ReadLoop | None, args: list, node: ReadLoop):
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
        child = ReadLoop(ins.name, _trip_count(ins.attrs, self.comps[cond]), {}, 0, [], [])
        # Only loop-invariant elements keep their weight: a dry walk finds what the body returns.
        init = ops[0]
        if isinstance(init, tuple):
          back = self._walk(body, None, [init], ReadLoop("dry", 1, {}, 0, [], []))
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
          tmp = ReadLoop(br, 1, {}, 0, [], [])
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
                       self.leaf_sizes[leaf] * ITEM_BYTES.get(dt, 4))
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
            if dt != "f32" and ins.opcode == "convert" and _dtype(ins.shape) == "f32":
              loop.converts.append((leaf, f"converts to f32 ({ins.name})"))
            elif dt != "f32" and called and self._fused_converts(called, j):
              # Inside a matmul's fusion (a compiled GPU GEMM): the operand converted in registers,
              # the weight's own bytes read (`FUSED_MATMUL`).
              loop.converts.append((leaf, f"converts to f32 {FUSED_MATMUL if matmul else ''}({ins.name})"))
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
  # A matmul counts by the matrices it reads: a float8 kernel's per-column scale, which a compiled
  # GEMM fusion applies in its epilogue, is not a second matmul.
  dots = {k: n for k, n in dots.items() if len(leaves[k][1].shape) >= 2}
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


def _all_converts(lp: ReadLoop):
  out = list(lp.converts)
  for ch in lp.children:
    out += _all_converts(ch)
  return out


def leaves_of(tree) -> list:
  """[(path 'layers_0/mlp/down/kernel', leaf)] in flattening order (entry parameter order)."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [("/".join(str(getattr(k, "key", k)) for k in path), x) for path, x in flat]


def compiled_text(fn, args) -> str:
  """The optimised HLO of a jitted function for the platform in force (re-jitted with keep_unused,
  so that entry parameter i is flattened argument i)."""
  return hlo.lower(jax.jit(fn.__wrapped__, keep_unused=True), *args).compile().as_text()


def lowered_text(fn, args) -> str:
  """The HLO of a jitted function as lowered (before XLA's backend passes), keep_unused."""
  return hlo.lower(jax.jit(fn.__wrapped__, keep_unused=True), *args).as_text(dialect="hlo")

