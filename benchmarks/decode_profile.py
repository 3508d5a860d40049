"""Where a decoding step's time goes: XLA's op timeline of one decode call, grouped, before and after.

  python benchmarks/decode_profile.py --workdir=/tmp/dgr2_demo [--before=4096371]

Decodes the demo's test prompts with the AR teacher (block size 1) and the final diffusion model
(block 32, tau 0.9) at batch 1 and 32, under `jax.profiler` (a Perfetto trace of the XLA CPU/GPU
thunks), and sums the device time of each op by what it belongs to (from its HLO `op_name`):
attention (scores, masking, softmax, P.V of every layer), mlp, projections (q/k/v/o and norms),
lm_head (the vocabulary projection), choose (token, confidence, commit rule, sampling) and the rest
(cache writes, gathers, loop bookkeeping). Per loop iteration, in microseconds.

Then what bounds the wall-clock ratio. Five calls per batch size, timed in turn `--rounds` times
(medians; a noisy machine's slow spells fall on all five alike): each decode without the profiler;
the pure forward each of its iterations runs (a 1-slot window for AR, a 32-slot one with its 32
positions projected to the vocabulary for diffusion: programs.window_loop); and the
call's fixed part, the prompts' prefill and the call itself, the same for both decoders (a jitted
prefill). With a call = fixed part + iterations x per-iteration cost, the speedup is given:
measured; if neither loop cost anything beyond its forwards (the bound that making both loops
lean approaches); if the diffusion loop cost nothing beyond its forwards while AR kept its
measured loop; and the ceiling, a diffusion loop that cost nothing at all (the fixed part alone).
`--before=REV` also profiles the decoder as it was at git revision REV (its decode/sampler.py and
the 5-d einsum attention it used), loaded side by side in this process: the same model, prompts
and machine, so the two columns compare.

Without a workdir, at a model shape with random weights (no demo needed; the GPU run's mode):

  python benchmarks/decode_profile.py --preset=qwen3_8b --batch=1 --prompt_len=2200 --json_out=prof.json
  python benchmarks/decode_profile.py --preset=tiny --prompt_len=64          # a CPU check

profiles `--new_tokens` AR steps (block size 1, EOS off) of one decode call and writes, per loop
iteration in microseconds: each group's device time (attention, projections, mlp, norms, rope,
lm_head, choose, kv_cache writes, rest) and their sum; the launch gaps (the time between one loop
op's end and the next one's start, summed: on a GPU the device idling between kernels); the
step's wall time (the untraced call's, less the prefill's device time, per step); the prefill's
device time; and the 40 costliest ops with their HLO names, so a grouping that misses can be
read off. Ops are grouped by the `op_name` of the compiled HLO (the JAX name stack: module scopes
such as `self_attn/` and `mlp/`); a fusion counts to the group of its own name, or of the root
inside it; an op without a name (XLA's CPU backend drops it from its dots) by its shapes
(vocabulary-wide: LM head or choice; a dot over the KV cache's slots: attention). Under the
profiler XLA runs command buffers op by op, so the launch gaps are those of launching each
kernel: what CUDA graphs (dgr2_jax/decode/xla_flags.py) remove.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
if any(arg.startswith("--preset") for arg in sys.argv[1:]):   # the device's run: its GPU, the decoders' flags
  from dgr2_jax.decode import xla_flags
  xla_flags.configure_gpu_flags()
else:   # the workdir mode compares with the CPU figures of docs/decoding.md
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dgr2_jax import results as results_lib  # noqa: E402
from dgr2_jax.aot import hlo as hlo_lib  # noqa: E402
from dgr2_jax.aot import programs  # noqa: E402
from dgr2_jax.decode import sampler  # noqa: E402
from dgr2_jax.model import attention, masks, qwen3  # noqa: E402

# (group, pattern on the HLO op_name): the first that matches wins.
# (group, pattern on the HLO op_name): the first that matches wins. In the loop, the ops outside the
# model (`closed_call/x`, not `closed_call/Qwen3/...`) are the step's own: its one matmul is the LM
# head, its exponentials and reductions the choice over the vocabulary.
GROUPS = (("lm_head", r"e,ev->|e,ve->|ve->|/lm_head/|head_weight|closed_call/dot_general$"),
          ("choose", r"branch_\d_fun/(reduce|select|eq|exp|log|argmax|min)|sort|categorical|fold_in|threefry|"
                     r"cumsum|top_k|argmax|_choice|logsumexp|"
                     r"closed_call/(exp|log|log1p|reduce_max|reduce_sum|reduce_min|argmax|argmin|sub|div|max)$"),
          ("norms", r"layernorm|/norm/|q_norm|k_norm|rsqrt"),
          ("rope", r"rope|/(cos|sin)$|/(cos|sin)/|self_attn/(neg|concatenate)$"),
          ("kv_cache", r"self_attn/.*(scatter|dynamic_update_slice)|_write_cache"),
          ("projections", r"self_attn/(q_proj|k_proj|v_proj|o_proj|qkv_proj)|self_attn/dot_general$|"
                          r"self_attn/(convert_element_type|mul)$"),
          ("mlp", r"/mlp/"),
          ("attention", r"self_attn/|attention|pallas|split_key|splitkey|cudnn|dot_product"))
GROUP_NAMES = tuple(g for g, _ in GROUPS) + ("rest",)
CONTAINERS = ("while", "conditional", "call", "tuple", "get-tuple-element", "parameter", "constant", "bitcast")


def _op_name(attrs: str) -> str:
  m = re.search(r'op_name="([^"]*)"', attrs)
  return m.group(1) if m else ""


class Program:
  """A compiled program's HLO, for naming and grouping the ops of its trace."""

  def __init__(self, hlo: str, vocab: int = 0, slots: int = 0):
    comps, _ = hlo_lib.parse(hlo)
    # {instruction: dict(comp, opcode, op_name, shape, operands, calls)}; `calls`: the computations
    # it runs (a fusion's, a loop's body and condition, a conditional's branches).
    self.insts = {i.name: dict(comp=c, opcode=i.opcode, op_name=_op_name(i.attrs), shape=i.shape,
                               operands=i.operands, calls=hlo_lib.called(i))
                  for c, insts in comps.items() for i in insts}
    self.loops = hlo_lib.in_loops((comps, None))   # every computation a while loop runs
    self.by_comp = {c: [self.insts[i.name] for i in insts] for c, insts in comps.items()}
    self.kernels = {re.sub(r"[.\-]", "_", k): k for k in self.insts}   # a GPU kernel is named after its op
    self.vocab, self.slots = vocab, slots

  def resolve(self, op: str) -> str | None:
    """The instruction a trace event names (its own name, or its kernel's), None if not this program's."""
    return op if op in self.insts else self.kernels.get(op)

  def op_name(self, name: str) -> str:
    """The instruction's op_name, else the root's (printed last) inside the computations it calls."""
    inst = self.insts[name]
    if inst["op_name"]:
      return inst["op_name"]
    for c in inst["calls"]:
      named = [i["op_name"] for i in self.by_comp.get(c, ()) if i["op_name"]]
      if named:
        return named[-1]
    return ""

  def where(self, op: str) -> str:
    """'loop', 'prefill' (outside any loop), 'container' (a loop or call: its ops count themselves)
    or 'unmatched' (another program's)."""
    name = self.resolve(op)
    if name is None:
      return "unmatched"
    if self.insts[name]["opcode"] in CONTAINERS:
      return "container"
    return "loop" if self.insts[name]["comp"] in self.loops else "prefill"

  def has_dot(self, name: str) -> bool:
    inst = self.insts[name]
    return inst["opcode"] in ("dot", "custom-call") or any(
        i["opcode"] in ("dot", "custom-call") for c in inst["calls"] for i in self.by_comp.get(c, ()))

  def shapes(self, name: str) -> str:
    """The shapes an instruction touches: its own, its operands' and its computations' parameters'."""
    inst = self.insts[name]
    params = [i["shape"] for c in inst["calls"] for i in self.by_comp.get(c, ()) if i["opcode"] == "parameter"]
    return " ".join([inst["shape"]] + [self.insts[o]["shape"] for o in inst["operands"] if o in self.insts] + params)

  def group_of(self, op: str) -> str:
    """The op's group by its op_name; an op without one (a CPU dot loses it) by its shapes: a
    vocabulary-wide one is the LM head (a matmul) or the choice, a dot over the KV cache's slots
    is attention."""
    name = self.resolve(op)
    g = classify(self.op_name(name))
    if g != "rest" or self.op_name(name):
      return g
    shapes = self.shapes(name)
    if self.vocab and re.search(rf"[\[,]{self.vocab}[\],]", shapes):
      return "lm_head" if self.has_dot(name) else "choose"
    if self.slots and self.has_dot(name) and re.search(rf"[\[,]{self.slots}[\],]", shapes):
      return "attention"
    return g


def classify(op_name: str) -> str:
  for g, pat in GROUPS:
    if re.search(pat, op_name):
      return g
  return "rest"


def _einsum_dense(q, k, v, mask):
  """The 5-d einsum attention the decoder used before (for --before)."""
  d = q.shape[-1]
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k.astype(q.dtype), preferred_element_type=jnp.float32) * d ** -0.5
  scores = jnp.where(mask[:, None, None, :, :], scores, -1e30)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum("bkgts,bskd->btkgd", probs, v)


def load_before(rev: str):
  src = subprocess.run(["git", "show", f"{rev}:dgr2_jax/decode/sampler.py"], cwd=REPO, capture_output=True,
                       text=True, check=True).stdout
  path = os.path.join(tempfile.mkdtemp(), "sampler_before.py")
  with open(path, "w") as f:
    f.write(src)
  spec = importlib.util.spec_from_file_location("sampler_before", path)
  mod = importlib.util.module_from_spec(spec)
  sys.modules["sampler_before"] = mod   # dataclasses look their module up while it executes
  spec.loader.exec_module(mod)
  return mod


def trace_events(call, n: int = 3) -> tuple:
  """Runs `call` n times under jax.profiler (after one untraced call) -> (the XLA op events: dicts of
  op (the HLO instruction), ts, dur (microseconds), lane (pid, tid); the last output)."""
  jax.block_until_ready(call())
  d = tempfile.mkdtemp()
  with jax.profiler.trace(d, create_perfetto_trace=True):
    for _ in range(n):
      out = jax.block_until_ready(call())
  f = glob.glob(f"{d}/**/*.json.gz", recursive=True)[0]
  tr = json.load(gzip.open(f))
  ev = tr["traceEvents"] if isinstance(tr, dict) else tr
  return op_events(ev), out


def op_events(ev: list) -> list:
  """A trace's XLA op events, each naming its HLO instruction (`hlo_op`; a device event without one
  names its kernel, which `group` matches to the instruction it was emitted for). On a GPU the
  device's lanes only (the host's lanes hold the same ops' launches), and of those the derived
  "XLA Ops" lane when the trace has one (one event per op, where the stream lanes have its kernels)."""
  procs, threads = {}, {}
  for e in ev:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      procs[e.get("pid")] = e.get("args", {}).get("name", "")
    if e.get("ph") == "M" and e.get("name") == "thread_name":
      threads[(e.get("pid"), e.get("tid"))] = e.get("args", {}).get("name", "")
  ops = []
  for e in ev:
    if e.get("ph") != "X" or "dur" not in e or e["name"].startswith(("end: ", "$")):
      continue
    args, lane = e.get("args") or {}, (e.get("pid"), e.get("tid"))
    device = procs.get(e.get("pid"), "").startswith("/device:")
    op = args.get("hlo_op") or (e["name"] if device else "")
    if op:
      ops.append(dict(op=op, ts=float(e["ts"]), dur=float(e["dur"]), lane=lane, device=device,
                      lane_name=threads.get(lane, "")))
  on_device = [e for e in ops if e["device"]]
  xla_ops = [e for e in on_device if e["lane_name"] == "XLA Ops"]
  return xla_ops or on_device or ops


def lanes_summary(ops: list) -> list:
  """[(lane name, events)] of the events used: which part of the trace the figures come from."""
  return [[str(k), v] for k, v in collections.Counter(e["lane_name"] or str(e["lane"]) for e in ops).most_common(8)]


def profile(call, n: int = 3):
  """({op: microseconds per call}, the last output)."""
  ops, out = trace_events(call, n)
  dur = collections.Counter()
  for e in ops:
    dur[e["op"]] += e["dur"] / n
  return dur, out


def prefill_call(cfg, params, toks, lens, slots: int):
  """A compiled call that prefills the prompts into an empty KV cache (the fixed part of a decode
  call, the same for AR and diffusion)."""
  b, p = toks.shape
  pos = masks.left_pad_positions(jnp.asarray(lens), p, slots)
  fn = jax.jit(lambda prm, t, n: sampler.window_forward(cfg, prm, t, 0, qwen3.init_cache(cfg, b, slots), n, p, pos,
                                                        return_hidden=True)[0][:, -1])
  call = lambda: fn(params, toks, lens)
  jax.block_until_ready(call())
  return call


def interleaved_medians(calls: dict, rounds: int) -> dict:
  """{name: zero-argument call} -> {name: median seconds}, timing one call of each in turn per
  round, so that a noisy machine's slow spells fall on every quantity alike."""
  times = {k: [] for k in calls}
  for _ in range(rounds):
    for k, call in calls.items():
      t0 = time.perf_counter()
      jax.block_until_ready(call())
      times[k].append(time.perf_counter() - t0)
  return {k: float(np.median(v)) for k, v in times.items()}


def group(dur: dict, hlo: str, iterations: int, vocab: int = 0) -> dict:
  """{op: us per call} -> {group: us per loop iteration, 'prefill': us per call outside the loop,
  'unmatched': us per call of ops not in `hlo` (another program's)}."""
  return group_program(Program(hlo, vocab), dur, iterations)


def group_program(prog: Program, dur: dict, iterations: int) -> dict:
  out = collections.Counter()
  for op, us in dur.items():
    where = prog.where(op)
    if where == "loop":
      out[prog.group_of(op)] += us / iterations
    elif where != "container":
      out[where] += us
  return out


def launch_gaps(ops: list, loop_ops: set, calls: int, iterations: int) -> float:
  """Microseconds per loop iteration between one loop op's end and the next loop op's start, on
  the lane (device stream or host thread) that ran most of them: time that lane sat idle inside
  the loop (kernel launches, host syncs)."""
  lanes = collections.Counter(e["lane"] for e in ops if e["op"] in loop_ops)
  if not lanes:
    return 0.0
  lane = lanes.most_common(1)[0][0]
  ev = sorted((e for e in ops if e["lane"] == lane and e["op"] in loop_ops), key=lambda e: e["ts"])
  gaps, end = 0.0, None
  for e in ev:
    if end is not None and e["ts"] > end:
      gap = e["ts"] - end
      if gap < 5e4:    # a gap over 50 ms lies between two profiled calls, not inside a loop
        gaps += gap
    end = e["ts"] + e["dur"] if end is None else max(end, e["ts"] + e["dur"])
  return gaps / calls / iterations


def preset_model(a):
  """(model config, params on the device) of a random-weights `--preset` (decode_throughput's shapes)."""
  from dgr2_jax.model.config import Qwen3Config
  cfg = Qwen3Config(rope_theta=1e6, **programs.SHAPES[a.preset])
  if a.dtype:
    cfg = cfg.replace(dtype=a.dtype, param_dtype=a.dtype)
  if a.attention:
    cfg = cfg.replace(attention_impl=a.attention)
  cfg = cfg.replace(mask_token_id=cfg.vocab_size - 1)
  params = jax.jit(lambda k: qwen3.init_params(cfg, k))(jax.random.PRNGKey(0))
  return cfg, params


def ar_decoder(cfg, a):
  """(DecodeConfig, compiled decoder) of `--new_tokens` AR steps, EOS off, with the weight dtype and
  projection fusion asked for (where this checkout's decoder has them)."""
  dc = sampler.DecodeConfig(block_size=1, threshold=1.0, max_new_tokens=a.new_tokens, eos_ids=(),
                            mask_token_id=cfg.mask_token_id, pad_id=0)
  if a.weight_dtype:
    if "weight_dtype" not in {f.name for f in dataclasses.fields(dc)}:
      raise SystemExit("decode_profile: --weight_dtype: this checkout's DecodeConfig has no weight_dtype")
    dc = dataclasses.replace(dc, weight_dtype=a.weight_dtype)
  kw = {}
  if "fuse_projections" in inspect.signature(sampler.decoder_for).parameters:
    kw["fuse_projections"] = a.fuse_projections == "true"
  elif a.fuse_projections == "false":
    raise SystemExit("decode_profile: --fuse_projections=false: this checkout's decoder has no such choice")
  return dc, sampler.decoder_for(cfg, dc, **kw)[1]


class Recorder:
  """Wraps a compiled decoder, keeping the arguments of its last call (to lower it with the same)."""

  def __init__(self, fn):
    self.fn, self.args = fn, None

  def __call__(self, *args):
    self.args = args
    return self.fn(*args)


def preset_profile(a) -> dict:
  """The random-weights mode (module docstring): one AR decode call of `--new_tokens` steps traced
  `--calls` times -> the JSON's dict."""
  cfg, params = preset_model(a)
  dc, fn = ar_decoder(cfg, a)
  rs = np.random.RandomState(0)
  toks, lens = sampler.left_pad([list(rs.randint(10, cfg.vocab_size - 2, a.prompt_len)) for _ in range(a.batch)],
                                a.prompt_len, 0)
  rec = Recorder(fn)
  call = lambda: sampler.run_decoder(rec, params, toks, lens, dc)
  ops, out = trace_events(call, a.calls)
  prog = Program(rec.fn.lower(*rec.args).compile().as_text(), cfg.vocab_size, a.prompt_len + a.new_tokens)
  it = max(int(out["forward_passes"]), 1)
  wall = interleaved_medians({"call": call}, 3)["call"]
  dur = collections.Counter()
  for e in ops:
    dur[e["op"]] += e["dur"] / a.calls
  groups = group_program(prog, dur, it)
  loop_ops = {op for op in dur if prog.where(op) == "loop"}
  per_iter = {g: groups.get(g, 0.0) for g in GROUP_NAMES}
  top = sorted(((us, op) for op, us in dur.items() if prog.where(op) in ("loop", "prefill")), reverse=True)[:40]
  return dict(
      meta=dict(results_lib.run_meta(), preset=a.preset, dtype=str(cfg.dtype), attention=cfg.attention_impl,
                batch=a.batch, prompt_len=a.prompt_len, new_tokens=a.new_tokens, calls=a.calls,
                weight_dtype=a.weight_dtype, fuse_projections=a.fuse_projections),
      iterations=it, us_per_iteration=per_iter, device_us_per_iteration=sum(per_iter.values()),
      launch_gaps_us_per_iteration=launch_gaps(ops, loop_ops, a.calls, it),
      wall_s=wall, prefill_device_us=groups.get("prefill", 0.0), unmatched_us=groups.get("unmatched", 0.0),
      # the call's wall time less the prefill's device time, per step: what a step costs end to end
      step_wall_us=(wall * 1e6 - groups.get("prefill", 0.0)) / it,
      lanes=lanes_summary(ops),
      top_ops=[dict(op=op, us_per_call=us, where=prog.where(op),
                    group=prog.group_of(op) if prog.resolve(op) else "", op_name=prog.op_name(prog.resolve(op)))
               for us, op in top])


def print_preset(res: dict) -> None:
  m, g = res["meta"], res["us_per_iteration"]
  print(f"# AR decode profile: {m['device']}, jax {m['jax_version']}, commit {m['git_commit']}, command buffers "
        f"{m['command_buffers']}; {m['preset']} ({m['dtype']}, attention {m['attention']}), batch {m['batch']}, "
        f"prompt {m['prompt_len']}, {res['iterations']} steps; trace lanes {res['lanes']}")
  print("\n| us / step | " + " | ".join(GROUP_NAMES) + " | launch gaps | step wall us | wall ms / call | "
        "prefill ms |")
  print("|---" * (len(GROUP_NAMES) + 5) + "|")
  print(f"| {res['device_us_per_iteration']:.0f} | " + " | ".join(f"{g[k]:.0f}" for k in GROUP_NAMES) +
        f" | {res['launch_gaps_us_per_iteration']:.0f} | {res['step_wall_us']:.0f} | {res['wall_s'] * 1e3:.2f} | "
        f"{res['prefill_device_us'] / 1e3:.2f} |")
  print("\ncostliest ops (us per call, where, group, op_name):")
  for t in res["top_ops"][:15]:
    print(f"  {t['us_per_call']:9.1f} {t['where']:8s} {t['group']:12s} {t['op']} {t['op_name'][:100]}")


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--workdir", default="/tmp/dgr2_demo")
  ap.add_argument("--before", default="", help="git revision of the decoder to compare with")
  ap.add_argument("--batch_sizes", default="1,32")
  ap.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds of the bound table")
  ap.add_argument("--preset", default="", choices=["", *programs.SHAPES],
                  help="random weights at this shape instead of the workdir's models (AR only)")
  ap.add_argument("--batch", type=int, default=1, help="--preset: rows")
  ap.add_argument("--prompt_len", type=int, default=2200, help="--preset: prompt tokens")
  ap.add_argument("--new_tokens", type=int, default=16, help="--preset: AR steps traced per call")
  ap.add_argument("--calls", type=int, default=2, help="--preset: decode calls traced")
  ap.add_argument("--dtype", default="", help="--preset: compute/param dtype (bfloat16 on a GPU)")
  ap.add_argument("--attention", default="", help="--preset: model.attention_impl ('' = the model's)")
  ap.add_argument("--weight_dtype", default="", help="--preset: DecodeConfig.weight_dtype ('' = compute dtype)")
  ap.add_argument("--fuse_projections", default="true", choices=["true", "false"],
                  help="--preset: fused q/k/v and gate/up")
  ap.add_argument("--json_out", default="", help="--preset: write the result as JSON here")
  a = ap.parse_args()
  if a.preset:
    res = preset_profile(a)
    print_preset(res)
    if a.json_out:
      with open(a.json_out, "w") as f:
        json.dump(res, f, indent=1)
    return
  workdir_main(a)


def workdir_main(a):
  from configs import demo
  from dgr2_jax.model.checkpoint import load_model_dir
  from dgr2_jax.decode import runtime
  from dgr2_jax.stages import traces as traces_stage
  from dgr2_jax.task import pipeline as pipeline_lib
  from dgr2_jax.task import tokenizer as tok_lib
  from dgr2_jax.task import traces as traces_lib
  config = demo.get_config()
  d = traces_stage.load_task_data(a.workdir)
  ex, _ = traces_lib.build_examples(d["sequences"], d["candidates"]["test"], "test", insert_target="none")
  tok = tok_lib.load_tokenizer(os.path.join(a.workdir, "traces", "tokenizer"))
  tids = tok_lib.token_ids(tok)
  prompts = [pipeline_lib.encode_prompt(tok, e, d["items"], d["sids"], config.task)[0] for e in ex[:32]]
  final = "rl" if os.path.isdir(os.path.join(a.workdir, "rl", "model")) else "cft"
  teacher = "teacher_rl" if os.path.isdir(os.path.join(a.workdir, "teacher_rl", "model")) else "sft"
  before = load_before(a.before) if a.before else None
  results, calls = [], {}
  for label, md, bs, tau in (("AR", teacher, 1, 1.0), ("diffusion tau 0.9", final, 32, 0.9)):
    mc, params = load_model_dir(os.path.join(a.workdir, md, "model"))
    params = jax.device_put(params)
    c = config.copy_and_resolve_references()
    c.decode.block_size, c.decode.threshold = bs, tau
    dc = runtime.decode_config(c, tids, mc)
    for batch in map(int, a.batch_sizes.split(",")):
      toks, lens = sampler.left_pad(prompts[:batch], config.task.prompt_len, dc.pad_id)
      cols = {}
      for name, mod in (("after", sampler), ("before", before)):
        if mod is None:
          continue
        if name == "before":
          fn = mod.compiled_decoder(sampler.model_for_decoding(mc, dc), dc.block_size, dc.max_new_tokens,
                                    tuple(dc.eos_ids), dc.mask_token_id)
          args = (params, jnp.asarray(toks), jnp.asarray(lens), jnp.float32(tau), jnp.float32(0), jnp.int32(0),
                  jnp.float32(1), jax.random.PRNGKey(0), jnp.int32(dc.steps_per_block))
          orig = attention._dense
          attention._dense = _einsum_dense
        else:
          _, fn = sampler.decoder_for(mc, dc)
          args = (params, toks, lens, np.float32(tau), np.float32(0), np.int32(0), np.float32(1),
                  np.zeros(2, np.uint32), np.int32(dc.steps_per_block))
        try:
          dur, out = profile(lambda: fn(*args))
          hlo = fn.lower(*args).compile().as_text()
        finally:
          if name == "before":
            attention._dense = orig
        it = max(int(out["forward_passes"]), 1)
        cols[name] = (group(dur, hlo, it, mc.vocab_size), it)
        if name == "after":
          slots = config.task.prompt_len + dc.max_new_tokens
          mcd = sampler.model_for_decoding(mc, dc)
          tokens = sum(len(x) for x in sampler.output_ids(np.asarray(out["tokens"]), np.asarray(out["eos_pos"])))
          loop, n = programs.window_loop(mcd, params, batch, slots, bs, head=True)
          calls[(label, batch)] = dict(iterations=it, tokens=tokens, n=n, call=lambda fn=fn, args=args: fn(*args),
                                       loop=loop, prefill=prefill_call(mcd, params, toks, lens, slots))
      results.append((label, batch, cols))
      for name, (g, it) in cols.items():
        tot = sum(v for k, v in g.items() if k in GROUP_NAMES)
        parts = ", ".join(f"{k} {g.get(k, 0):.0f}" for k in GROUP_NAMES)
        print(f"{label} batch {batch} [{name}]: {it} iterations, {tot:.0f} us/iteration ({parts}); "
              f"prefill {g.get('prefill', 0) / 1e3:.2f} ms", flush=True)
  print("\n| decoder | batch | version | iterations | us / iteration | " + " | ".join(GROUP_NAMES) + " |")
  print("|---" * (5 + len(GROUP_NAMES)) + "|")
  for label, batch, cols in results:
    for name, (g, it) in cols.items():
      tot = sum(v for k, v in g.items() if k in GROUP_NAMES)
      cells = " | ".join(f"{g.get(k, 0):.0f}" for k in GROUP_NAMES)
      print(f"| {label} | {batch} | {name} | {it} | {tot:.0f} | {cells} |")
  print("\n| batch | prefill + call ms | AR us/iteration | AR 1-slot forward us | diffusion us/iteration | "
        "diffusion 32-slot forward us | iterations AR / diffusion | speedup measured | speedup, both loops free | "
        "speedup, diffusion loop free | ceiling: diffusion loop costs nothing |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for batch in map(int, a.batch_sizes.split(",")):
    ar, df = calls.get(("AR", batch)), calls.get(("diffusion tau 0.9", batch))
    if not (ar and df):
      continue
    t = interleaved_medians({"ar": ar["call"], "df": df["call"], "fixed": df["prefill"], "f1": ar["loop"],
                             "fw": df["loop"]}, a.rounds)
    fixed, f1, fw = t["fixed"], t["f1"] / ar["n"], t["fw"] / df["n"]
    loop_us = lambda w, wall: (wall - fixed) / w["iterations"] * 1e6
    tps = lambda w, secs: w["tokens"] / secs
    lean_ar, lean_df = fixed + ar["iterations"] * f1, fixed + df["iterations"] * fw   # loops of forwards only
    print(f"| {batch} | {fixed * 1e3:.2f} | {loop_us(ar, t['ar']):.0f} | {f1 * 1e6:.0f} | {loop_us(df, t['df']):.0f} | "
          f"{fw * 1e6:.0f} | {ar['iterations']} / {df['iterations']} | {tps(df, t['df']) / tps(ar, t['ar']):.2f}x | "
          f"{tps(df, lean_df) / tps(ar, lean_ar):.2f}x | {tps(df, lean_df) / tps(ar, t['ar']):.2f}x | "
          f"{tps(df, fixed) / tps(ar, t['ar']):.2f}x |", flush=True)


if __name__ == "__main__":
  main()
