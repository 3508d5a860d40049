"""Stage `bench`: the speed/accuracy frontier of threshold and speculative decoding against AR.

For each batch size in `config.bench.batch_sizes` (1 = the paper's latency regime; 0 = the eval
batch, the throughput regime) the rows are, all in one process on one machine:
  * `ar`: the AR teacher (`bench.ar_model_dir`, default the pipeline's teacher: `teacher_rl`, else
    `sft`) decoding with block size 1, the reference of its batch size;
  * `threshold`: the diffusion model (`bench.model_dir`, default the last model stage of the
    pipeline) at every block size in `bench.block_sizes` and tau in `bench.thresholds`;
  * `speculative` (`bench.speculative`): that diffusion model drafting at each tau, the AR teacher
    verifying (decode/speculative.py): its metrics equal the AR row's, its speed is the question.
Each row decodes the eval split through the eval stage (same prompts, parser and metrics), on the
decode mesh (`config.decode.mesh`: rows over data, the model over tensor); every row and the
results' header name the devices it ran on (`devices`, e.g. '8 x gpu (data 1, tensor 8)').

Throughput = generated tokens / decode seconds, where generated tokens are the committed output
tokens up to and including EOS of every row of every decoded batch (the padding rows of the last
batch are real work and count). Metrics come from one pass over the split per row (which also
compiles each decoder). Decode seconds come afterwards, side by side: the rows of one batch size
decode their batches again in turn, row after row, `bench.timing_rounds` rounds, each batch timed
to `jax.block_until_ready`, and a row's seconds are its median round (its first
`bench.timing_batches` batches only, when set; tokens/s then counts those batches' tokens). A
machine whose speed drifts (these do, by 2x between minutes) thus slows every row of a round alike
instead of whichever row it happened to be running. Prompt rendering, parsing and scoring are not
timed. speedup = tokens_per_s / the AR row's of the same batch size; nfe_speedup = its nfe_per_seq
/ nfe_per_seq (NFE = forward passes after prefill per sequence; speculative: drafter + verifier
passes). Speculative rows add drafter_passes_per_seq, verifier_passes_per_seq and
accepted_per_pass (drafts accepted per verifier pass).

Writes `workdir/bench/` (`eval/<row>/` predictions + metrics per row, `frontier.json`, DONE.json)
and `workdir/results/frontier.{md,json,png}`.
The `bench` config section is this module's: its defaults (`bench_config`) and checks (`validate`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import ml_collections
import numpy as np

from dgr2_jax import chain
from dgr2_jax import checks
from dgr2_jax import results
from dgr2_jax.decode import mesh as dmesh
from dgr2_jax.decode import runtime
from dgr2_jax.decode import sampler
from dgr2_jax.stages import common
from dgr2_jax.stages import contract
from dgr2_jax.stages import eval as eval_stage
from dgr2_jax.stages import traces as traces_stage


class TimedGenerate:
  """A generate function (`sampler.generate` by default) that counts what it decodes and keeps
  each call so `time_interleaved` can decode the same batches again, timed (module docstring)."""

  def __init__(self, generate_fn=None):
    self.generate_fn = generate_fn
    self.seconds = 0.0
    self.tokens = 0
    self.sequences = 0
    self.forward_passes = 0
    self.batches = 0
    self.stats = {}
    self.calls = []         # per decoded batch: a call that decodes it again
    self.call_tokens = []   # ... and the tokens it generated
    self.timed_tokens = self.timed_batches = 0   # what `time_interleaved` timed

  def __call__(self, model_config, params, prompts, dcfg, rng, max_prompt_len=None):
    fn = self.generate_fn or sampler.generate
    call = lambda: fn(model_config, params, prompts, dcfg, rng, max_prompt_len=max_prompt_len, return_device=True)
    out = jax.tree_util.tree_map(dmesh.to_host, call())   # rows of every process (a decode mesh)
    self.calls.append(call)
    out["output_ids"] = sampler.output_ids(out["tokens"], out["eos_pos"])
    self.call_tokens.append(sum(len(x) for x in out["output_ids"]))
    self.tokens += self.call_tokens[-1]
    self.sequences += len(out["output_ids"])
    self.forward_passes += int(out["forward_passes"])
    self.batches += 1
    for k in ("drafter_passes", "rounds", "accepted"):
      if k in out:
        self.stats[k] = self.stats.get(k, 0) + int(out[k].sum())
    return out


def time_interleaved(timers: list, rounds: int, max_batches: int = 0) -> None:
  """Sets each timer's `seconds` to the median over `rounds` rounds of the time its batches (the
  first `max_batches`, 0 = all) take to decode again, the timers taking turns within a round, and
  its `timed_tokens` to those batches' tokens (module docstring)."""
  per = [[] for _ in timers]
  k = max_batches or None
  for t in timers:
    t.timed_tokens, t.timed_batches = sum(t.call_tokens[:k]), len(t.calls[:k])
  for _ in range(rounds):
    for t, acc in zip(timers, per):
      total = 0.0
      for call in t.calls[:k]:
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        total += time.perf_counter() - t0
      acc.append(total)
  for t, acc in zip(timers, per):
    t.seconds = float(np.median(acc))


@dataclasses.dataclass(frozen=True)
class Row:
  """What one frontier row decodes: `model_dir` with `decoder` ('threshold', or 'speculative' with
  `verifier_dir` verifying) at block size, tau and batch size (0 = bench/eval batch size)."""
  model_dir: str
  block_size: int
  threshold: float
  batch_size: int = 0
  decoder: str = "threshold"
  verifier_dir: str = ""


def measure(config, workdir: str, row: Row, out_dir: str, generate_fn=None, models: dict | None = None):
  """One frontier row: eval metrics of `row` decoded into `out_dir` -> (row without its timing, the
  TimedGenerate that decoded it; `timing` fills the row in once its timer's `seconds` are known).
  `models`: one dict for all rows of a run, so their kept decode calls share one loaded copy of
  each model (`decode.runtime.load_on_device`)."""
  model_dir, block_size, threshold = row.model_dir, row.block_size, row.threshold
  decoder, verifier_dir = row.decoder, row.verifier_dir
  bc = config.bench
  mesh = dmesh.from_config(config)   # the eval stage decodes on the same mesh
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.stage = "eval"
    c.eval.model_dir = model_dir
    c.eval.output_dir = out_dir
    c.eval.name = os.path.basename(out_dir)
    c.eval.split = bc.split or c.eval.split
    c.eval.max_examples = bc.max_examples or c.eval.max_examples
    c.eval.batch_size = row.batch_size or bc.batch_size or c.eval.batch_size
    c.decode.block_size = int(block_size)
    c.decode.threshold = float(threshold)
    c.decode.mode = decoder
    c.decode.verifier_dir = verifier_dir
  if generate_fn is None:
    generate_fn = TimedGenerate(runtime.speculative_generate(verifier_dir, config.get("model"), models, mesh)
                                if decoder == "speculative" else runtime.threshold_generate(mesh))
  timed = generate_fn
  path = eval_stage.run(c, workdir, generate_fn=timed, models=models)
  with open(os.path.join(path, "metrics.json")) as f:
    m = json.load(f)
  seqs = max(timed.sequences, 1)
  label = "ar" if decoder == "threshold" and int(block_size) == 1 else decoder
  out = {"decoder": label, "batch_size": int(c.eval.batch_size), "block_size": int(block_size),
         "threshold": float(threshold), "recall@1": m["recall@1"], "recall@3": m.get("recall@3"),
         "ndcg@3": m.get("ndcg@3"), "valid_rate": m["valid_rate"], "nfe_per_seq": m["mean_nfe"],
         "tokens_per_seq": timed.tokens / seqs,
         "forward_passes_per_batch": timed.forward_passes / max(timed.batches, 1),
         "batches": timed.batches, "n": m["n"], "model_dir": model_dir, "split": c.eval.split,
         "devices": dmesh.describe(mesh)}
  st = getattr(timed, "stats", {})
  if "rounds" in st:
    out.update(drafter_passes_per_seq=st["drafter_passes"] / seqs, verifier_passes_per_seq=st["rounds"] / seqs,
               accepted_per_pass=st["accepted"] / max(st["rounds"], 1), verifier_dir=verifier_dir)
  return out, timed


def timing(row: dict, timed, rounds: int) -> dict:
  """The row with its decode seconds and tokens/s (after `time_interleaved`)."""
  tps = timed.timed_tokens / timed.seconds if timed.seconds > 0 else None
  return dict(row, tokens_per_s=tps, decode_seconds=timed.seconds, timing_rounds=int(rounds),
              timed_batches=timed.timed_batches)


def add_speedups(rows: list[dict]) -> list[dict]:
  """speedup / nfe_speedup of every row against the AR row (block 1) of its batch size, None
  without one."""
  ar = {}
  for r in rows:
    if r["block_size"] == 1 and r.get("decoder", "ar") == "ar":
      ar.setdefault(r.get("batch_size"), r)
  for r in rows:
    a = ar.get(r.get("batch_size"))
    ok = a is not None and a.get("tokens_per_s") and r.get("tokens_per_s")
    r["speedup"] = r["tokens_per_s"] / a["tokens_per_s"] if ok else None
    ok = a is not None and r.get("nfe_per_seq")
    r["nfe_speedup"] = a["nfe_per_seq"] / r["nfe_per_seq"] if ok else None
  return rows


def _models(config, workdir: str) -> tuple[str, str, list]:
  """(the diffusion model, the AR teacher, the model dirs the bench decodes); FileNotFoundError
  naming a missing one."""
  bc = config.bench
  final = bc.model_dir
  if not final:
    stage = chain.final_model_stage(config)
    if stage is None:
      raise ValueError("config.bench.model_dir is empty and the pipeline has no diffusion model "
                       "stage (convert/cft/opd/rl)")
    final = chain.model_dir(workdir, stage)
  ar = bc.ar_model_dir or chain.teacher_model_dir(config, workdir)
  need = [final] + ([ar] if bc.include_ar or bool(bc.get("speculative", False)) else [])
  for path in need:
    if not os.path.isdir(path):
      raise FileNotFoundError(f"bench: model directory {path} does not exist (run the pipeline "
                              "up to it, or set config.bench.model_dir / ar_model_dir)")
  return final, ar, need


def _hash(config, workdir: str, upstream: dict) -> str:
  need = _models(config, workdir)[2]
  return common.config_hash(config.bench, config.eval, config.task, config.decode, config.get("seed", 0),
                            traces_stage.upstream_hashes(upstream),
                            [common.model_hash(p) for p in need],
                            dmesh.describe(dmesh.from_config(config)),   # timings are the devices'
                            workdir=workdir)


def _build(config, workdir: str, build: contract.Build) -> dict:
  bc = config.bench
  final, ar, _ = _models(config, workdir)
  spec = bool(bc.get("speculative", False))
  batch_sizes = [int(b) or int(bc.batch_size or config.eval.batch_size) for b in bc.get("batch_sizes", (0,))]
  with build.publish({"stage": "bench"}) as tmp:
    rows, rounds, models = [], int(bc.get("timing_rounds", 5)), {}
    timing_batches = int(bc.get("timing_batches", 0))

    def add(pending, tag, **kw):
      row, timed = measure(config, workdir, Row(**kw), os.path.join(tmp, "eval", tag), models=models)
      pending.append((row, timed))
      extra = f", {row['accepted_per_pass']:.1f} accepted per pass" if "accepted_per_pass" in row else ""
      print(f"bench: {row['decoder']} batch {row['batch_size']} B={row['block_size']} tau={row['threshold']:g}: "
            f"R@1 {row['recall@1']:.3f}, NFE {row['nfe_per_seq']:.1f}{extra}", flush=True)

    for batch in batch_sizes:
      pending = []
      if bc.include_ar:
        add(pending, f"bs{batch}_ar", model_dir=ar, block_size=1, threshold=1.0, batch_size=batch)
      for b in bc.block_sizes:
        for tau in bc.thresholds:
          add(pending, f"bs{batch}_b{b}_t{tau:g}", model_dir=final, block_size=int(b), threshold=float(tau),
              batch_size=batch)
          if spec and int(b) > 1:
            add(pending, f"bs{batch}_spec_b{b}_t{tau:g}", model_dir=final, block_size=int(b), threshold=float(tau),
                batch_size=batch, decoder="speculative", verifier_dir=ar)
      print(f"bench: timing the {len(pending)} rows of batch {batch} side by side, {rounds} rounds"
            + (f", {timing_batches} batches each" if timing_batches else ""), flush=True)
      time_interleaved([t for _, t in pending], rounds, timing_batches)
      rows += [timing(r, t, rounds) for r, t in pending]
      for r in rows[-len(pending):]:
        print(f"bench: {r['decoder']} batch {r['batch_size']} B={r['block_size']} tau={r['threshold']:g}: "
              f"{r['tokens_per_s']:.1f} tok/s", flush=True)
    add_speedups(rows)
    obj = results.write_frontier(os.path.join(workdir, "results"), rows,
                                 results.meta(build.chash, bench=common.to_plain(bc),
                                              devices=dmesh.describe(dmesh.from_config(config))))
    common.write_json_atomic(os.path.join(tmp, "frontier.json"), obj)
  return obj


# Reads the traces and the stages they are built from (its models: bench.*model_dir or the chain's).
STAGE = contract.Stage(name="bench", reads=traces_stage.UPSTREAM + ("traces",), hashed=_hash, build=_build,
                       fresh=contract.result_json("frontier.json"))


def run(config, workdir: str) -> dict:
  """Measures (or reuses) the frontier in `workdir/bench`; returns the frontier object."""
  return contract.run(STAGE, config, workdir)


def bench_config() -> ml_collections.ConfigDict:
  """Speed/accuracy frontier (dgr2_jax.stages.bench)."""
  c = ml_collections.ConfigDict()
  c.thresholds = (1.0, 0.9, 0.6, 0.4)  # tau of each diffusion row of the frontier
  c.block_sizes = (32,)  # block sizes benchmarked (each divides decode.max_new_tokens)
  c.include_ar = True        # the AR row (block 1, the SFT model): the speedup reference
  c.model_dir = ""           # '' => the last model stage of pipeline.stages (rl/opd/cft/convert)
  c.ar_model_dir = ""        # '' => workdir/sft/model
  c.split = ""               # '' => eval.split
  c.max_examples = 0         # 0 => eval.max_examples
  c.batch_size = 0           # 0 => eval.batch_size
  # Every row at each of these batch sizes: 1 (the paper's latency regime) and 0 => the eval batch
  # (throughput); speedups are against the AR row of the same batch size.
  c.batch_sizes = (1, 0)
  c.speculative = True       # rows of speculative decoding (the diffusion model drafts, AR verifies)
  # Speed: after every row of a batch size has decoded once (metrics, compilation), the rows decode
  # their batches again in turn, this many rounds; a row's seconds are its median round.
  c.timing_rounds = 5
  # ... and only the first this many batches of each row (0 = all): on a whole split at 512 new
  # tokens, timing every batch five times more would take hours per row at Qwen3-8B.
  c.timing_batches = 0
  return c


def validate(config, runs: set) -> None:
  """Checks the `bench` config section (model directories only when the bench stage runs)."""
  c = config
  if "bench" not in c:
    return
  b = c.bench
  if not b.thresholds:
    checks.fail("bench.thresholds", "must not be empty")
  for tau in b.thresholds:
    if not 0.0 < float(tau) <= 1.0:
      checks.fail("bench.thresholds", f"every threshold must be in (0, 1], got {tau}")
  defaults = bench_config()  # a field the section leaves out has its default
  for bsz in b.get("batch_sizes", defaults.batch_sizes):
    if not checks.is_int(bsz, 0):
      checks.fail("bench.batch_sizes", f"every batch size must be an int >= 0 (0 = eval.batch_size), got {bsz!r}")
  if not checks.is_int(b.get("timing_rounds", defaults.timing_rounds), 1):
    checks.fail("bench.timing_rounds", f"must be an int >= 1, got {b.timing_rounds!r}")
  if not checks.is_int(b.get("timing_batches", defaults.timing_batches), 0):
    checks.fail("bench.timing_batches", f"must be an int >= 0 (0 = every batch), got {b.timing_batches!r}")
  for bs in b.block_sizes:
    if not checks.is_int(bs, 1):
      checks.fail("bench.block_sizes", f"every block size must be an int >= 1, got {bs!r}")
    if "decode" in c and c.decode.max_new_tokens % bs:
      checks.fail("bench.block_sizes", f"block size {bs} does not divide decode.max_new_tokens "
                  f"({c.decode.max_new_tokens})")
  if b.split:
    checks.one_of(c, "bench", "split", ("train", "valid", "test"))
  if "bench" in runs:
    for f in ("model_dir", "ar_model_dir"):
      if b[f]:
        checks.model_dir(f"bench.{f}", b[f])
