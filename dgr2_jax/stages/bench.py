"""Stage `bench`: the speed/accuracy frontier of threshold decoding against AR decoding.

For every block size in `config.bench.block_sizes` and threshold tau in `config.bench.thresholds`
the diffusion model (`bench.model_dir`, default the last model stage of the pipeline) decodes the
eval split through the eval stage (same prompts, parser and metrics), and the AR teacher
(`bench.ar_model_dir`, default `workdir/sft/model`) decodes it with block size 1: the reference
row. All rows run in one process on one machine.

Throughput = generated tokens / decode seconds, where generated tokens are the committed output
tokens up to and including EOS of every row of every decoded batch (the padding rows of the last
batch are real work and count), and decode seconds exclude compilation: each row first decodes
one batch untimed (warm-up), then every batch is timed to `jax.block_until_ready`. Prompt
rendering, parsing and scoring are not timed. speedup = tokens_per_s / AR tokens_per_s;
nfe_speedup = AR nfe_per_seq / nfe_per_seq (NFE = forward passes after prefill, per sequence).

Writes `workdir/bench/` (`eval/<row>/` predictions + metrics per row, `frontier.json`, DONE.json)
and `workdir/results/frontier.{md,json,png}`.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from dgr2_jax.stages import common

STAGE = "bench"


class TimedGenerate:
  """`sampler.generate` with a warm-up call and timed decode calls (see the module docstring)."""

  def __init__(self):
    self.seconds = 0.0
    self.tokens = 0
    self.sequences = 0
    self.forward_passes = 0
    self.batches = 0
    self._warm = False

  def __call__(self, model_config, params, prompts, dcfg, rng, max_prompt_len=None):
    import jax
    from dgr2_jax.decode import sampler
    if not self._warm:  # compile (and first-touch) outside the timed region
      jax.block_until_ready(sampler.generate(model_config, params, prompts, dcfg, rng,
                                             max_prompt_len=max_prompt_len, return_device=True))
      self._warm = True
    t0 = time.perf_counter()
    out = sampler.generate(model_config, params, prompts, dcfg, rng,
                           max_prompt_len=max_prompt_len, return_device=True)
    out = jax.block_until_ready(out)
    self.seconds += time.perf_counter() - t0
    out = jax.tree_util.tree_map(np.asarray, out)
    r = out["tokens"].shape[1]
    out["output_ids"] = [row[:min(int(e) + 1, r)].tolist()
                         for row, e in zip(out["tokens"], out["eos_pos"])]
    self.tokens += sum(len(x) for x in out["output_ids"])
    self.sequences += len(out["output_ids"])
    self.forward_passes += int(out["forward_passes"])
    self.batches += 1
    return out


def measure(config, workdir: str, model_dir: str, block_size: int, threshold: float,
            out_dir: str, generate_fn=None) -> dict:
  """One frontier row: eval metrics of `model_dir` decoded at (block_size, threshold) + timing."""
  from dgr2_jax.stages import eval as eval_stage
  bc = config.bench
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.stage = "eval"
    c.eval.model_dir = model_dir
    c.eval.output_dir = out_dir
    c.eval.name = os.path.basename(out_dir)
    c.eval.split = bc.split or c.eval.split
    c.eval.max_examples = bc.max_examples or c.eval.max_examples
    c.eval.batch_size = bc.batch_size or c.eval.batch_size
    c.decode.block_size = int(block_size)
    c.decode.threshold = float(threshold)
  timed = TimedGenerate() if generate_fn is None else generate_fn
  path = eval_stage.run(c, workdir, generate_fn=timed)
  with open(os.path.join(path, "metrics.json")) as f:
    m = json.load(f)
  tps = timed.tokens / timed.seconds if timed.seconds > 0 else None
  return {"block_size": int(block_size), "threshold": float(threshold),
          "recall@1": m["recall@1"], "recall@3": m.get("recall@3"), "ndcg@3": m.get("ndcg@3"),
          "valid_rate": m["valid_rate"], "tokens_per_s": tps, "nfe_per_seq": m["mean_nfe"],
          "tokens_per_seq": timed.tokens / max(timed.sequences, 1),
          "forward_passes_per_batch": timed.forward_passes / max(timed.batches, 1),
          "decode_seconds": timed.seconds, "batches": timed.batches, "n": m["n"],
          "model_dir": model_dir, "split": c.eval.split}


def add_speedups(rows: list[dict]) -> list[dict]:
  """speedup / nfe_speedup of every row against the AR row (block 1), None without one."""
  ar = next((r for r in rows if r["block_size"] == 1), None)
  for r in rows:
    ok = ar is not None and ar.get("tokens_per_s") and r.get("tokens_per_s")
    r["speedup"] = r["tokens_per_s"] / ar["tokens_per_s"] if ok else None
    ok = ar is not None and r.get("nfe_per_seq")
    r["nfe_speedup"] = ar["nfe_per_seq"] / r["nfe_per_seq"] if ok else None
  return rows


def run(config, workdir: str) -> dict:
  from dgr2_jax import results
  from dgr2_jax.stages import pipeline
  from dgr2_jax.stages import traces as traces_stage
  bc = config.bench
  final = bc.model_dir
  if not final:
    stage = pipeline.final_model_stage(config)
    if stage is None:
      raise ValueError("config.bench.model_dir is empty and the pipeline has no diffusion model "
                       "stage (convert/cft/opd/rl)")
    final = pipeline.model_dir(workdir, stage)
  ar = bc.ar_model_dir or pipeline.model_dir(workdir, "sft")
  need = [final] + ([ar] if bc.include_ar else [])
  for path in need:
    if not os.path.isdir(path):
      raise FileNotFoundError(f"bench: model directory {path} does not exist (run the pipeline "
                              "up to it, or set config.bench.model_dir / ar_model_dir)")
  chash = common.config_hash(bc, config.eval, config.task, config.decode, config.get("seed", 0),
                             traces_stage.upstream_hashes(workdir),
                             [common.model_hash(p) for p in need])
  out = common.stage_dir(workdir, STAGE)
  if common.is_fresh(out, chash):
    with open(os.path.join(out, "frontier.json")) as f:
      return json.load(f)
  with common.atomic_dir(out, chash, {"stage": STAGE}) as tmp:
    rows = []
    if bc.include_ar:
      rows.append(measure(config, workdir, ar, 1, 1.0, os.path.join(tmp, "eval", "ar")))
      print(f"bench: AR {rows[-1]['tokens_per_s']:.1f} tok/s, R@1 {rows[-1]['recall@1']:.3f}",
            flush=True)
    for b in bc.block_sizes:
      for tau in bc.thresholds:
        rows.append(measure(config, workdir, final, int(b), float(tau),
                            os.path.join(tmp, "eval", f"b{b}_t{tau:g}")))
        print(f"bench: B={b} tau={tau:g} {rows[-1]['tokens_per_s']:.1f} tok/s, "
              f"R@1 {rows[-1]['recall@1']:.3f}, NFE {rows[-1]['nfe_per_seq']:.1f}", flush=True)
    add_speedups(rows)
    obj = results.write_frontier(os.path.join(workdir, "results"), rows,
                                 results.meta(chash, bench=common.to_plain(bc)))
    common.write_json_atomic(os.path.join(tmp, "frontier.json"), obj)
  return obj
