"""Evaluation stage: decode a split with a model directory, parse, score, write results.

`--config.stage=eval --config.eval.model_dir=DIR --config.eval.split=test` renders the split's
prompts (only users whose target is among the candidates: the paper's test set), decodes them in
static batches of `config.eval.batch_size` (the last batch padded with copies of its last prompt,
whose outputs are discarded) with `dgr2_jax.decode.sampler.generate` and `config.decode.*`,
parses every output (invalid => the retriever's order, counted as a fallback) and writes to
`config.eval.output_dir` or `workdir/eval/<name>`:
- `predictions.jsonl`: example_id, user, history and candidates (item ids), prompt_len, output
  (decoded text), ranking (parsed SIDs), ranking_items (item indices, valid outputs only), verdict,
  flags, target, target_pos, rank (1-based rank used for scoring), fallback, nfe, commit_steps, reasoning_tokens;
- `metrics.json`: recall@1, recall@3, ndcg@3, valid_rate, duplicate_rate, omission_rate,
  out_of_set_rate, unparseable_rate, fallback_rate, mean_nfe, mean_reasoning_tokens, n, plus
  the pre-rank floor of the same examples and the settings used;
- `schedule.json` (threshold decoding by the stage's own decoder, not a `generate_fn` passed in):
  each answer's tokens committed per denoising step, with the model, block size, tau and the rest
  of the decode settings (decode/schedule.py's format), read back from `commit_steps` after
  decoding: `benchmarks/decode_throughput.py --schedule` replays it.
The batches decode on the decode mesh (`config.decode.mesh`, decode/mesh.py): each batch's rows
split over its data axis, the model over its tensor axis; the outputs are one device's.
The tokenizer is the model directory's when it has one, else the traces stage's.
`decode.mode='speculative'`: the model drafts and `decode.verifier_dir` (default the workdir's AR
teacher) verifies (decode/speculative.py); per example also `rounds` and `accepted`, and the
metrics gain mean_rounds, accepted_per_round and tokens_per_round.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import tqdm

from dgr2_jax import chain
from dgr2_jax.decode import mesh as dmesh
from dgr2_jax.decode import runtime
from dgr2_jax.decode import sampler
from dgr2_jax.decode import schedule as schedule_lib
from dgr2_jax.stages import common
from dgr2_jax.stages import contract
from dgr2_jax.stages import traces as traces_stage
from dgr2_jax.task import metrics as metrics_lib
from dgr2_jax.task import pipeline as pipeline_lib
from dgr2_jax.task import tokenizer as tok_lib
from dgr2_jax.task import traces as traces_lib


def _tokenizer_path(config, workdir: str) -> str:
  md = config.eval.model_dir
  if md and os.path.exists(os.path.join(md, "tokenizer_config.json")):
    return md
  return traces_stage.tokenizer_dir(config, workdir)






def verifier_dir(config, workdir: str) -> str | None:
  """The verifier of `decode.mode='speculative'`: `decode.verifier_dir`, else the workdir's AR
  teacher (`chain.teacher_model_dir`); None for threshold decoding."""
  dec = config.get("decode", {})
  if dec.get("mode", "threshold") != "speculative":
    return None
  path = dec.get("verifier_dir", "") or chain.teacher_model_dir(config, workdir)
  if not os.path.isdir(path):
    raise FileNotFoundError(f"config.decode.verifier_dir: verifier model {path!r} does not exist (the AR "
                            "teacher of the workdir by default: run the sft stage, or set it)")
  return path






def commit_schedule(config, dcfg, records: list[dict], row_steps: list, mesh) -> dict:
  """decode/schedule.py's object of threshold-decoded `records`: each answer's commits per step
  and the decode settings. The counts come from `row_steps`, the commit step of every position
  the row committed (its decoder output's `commit_step` >= 0), not from the answer's tokens alone:
  a step may commit only the EOS or positions after it, which the answer cuts off, and the replay
  must run that step too. Recording changes nothing the decoder runs."""
  ec = config.eval
  answers = [dict(example_id=r["example_id"], prompt_len=r["prompt_len"], nfe=r["nfe"],
                  commits=schedule_lib.commits_per_step(st)) for r, st in zip(records, row_steps)]
  rows_per_device = -(-ec.batch_size // dmesh.data_size(mesh))   # what resolved kv_write 'auto'
  return schedule_lib.make(
      answers, model=ec.model_dir, split=ec.split, block_size=dcfg.block_size, threshold=float(dcfg.threshold),
      steps_per_block=dcfg.steps_per_block, temperature=float(dcfg.temperature), max_new_tokens=dcfg.max_new_tokens,
      kv_write=sampler.resolve_kv_write(dcfg.kv_write, rows_per_device))


def _hash(config, workdir: str, upstream: dict) -> str:
  ec = config.eval
  if ec.batch_size < 1:
    raise ValueError(f"config.eval.batch_size must be >= 1, got {ec.batch_size}")
  model_done = common.model_hash(ec.model_dir) if ec.model_dir else None
  verifier = verifier_dir(config, workdir)
  return common.config_hash(ec, config.task, config.get("decode", {}), config.get("seed", 0),
                            traces_stage.upstream_hashes(upstream), model_done,
                            [verifier, common.model_hash(verifier)] if verifier else None, workdir=workdir)


def output_dir(config, workdir: str, chash: str, name: str) -> str:
  """`eval.output_dir`, else `workdir/eval/<eval.name>` (default `<split>-<hash>`)."""
  del name
  ec = config.eval
  return ec.output_dir or os.path.join(workdir, "eval", ec.name or f"{ec.split}-{chash[:8]}")


def _build(config, workdir: str, build: contract.Build, generate_fn=None, models: dict | None = None,
           same_as: str | None = None) -> str:
  """Decodes and scores `config.eval.split` -> the output directory. `models`: see `load_on_device`;
  `same_as`: see `run`."""
  if same_as:
    return _copy_twin(config, build, same_as)
  ec, tc = config.eval, config.task
  if not ec.model_dir and generate_fn is None:
    raise ValueError("config.eval.model_dir is required for --config.stage=eval")
  verifier = verifier_dir(config, workdir)
  d = traces_stage.load_task_data(workdir)
  sids = d["sids"]
  examples, counts = traces_lib.build_examples(d["sequences"], d["candidates"][ec.split],
                                               ec.split, insert_target="none",
                                               bought_next=bool(tc.get("mark_copurchase", False)))
  if ec.max_examples:
    examples = examples[:ec.max_examples]
  if not examples:
    raise ValueError(f"split {ec.split!r} has no user whose target is among the candidates")
  tokenizer = tok_lib.load_tokenizer(_tokenizer_path(config, workdir))
  tids = tok_lib.token_ids(tokenizer)
  prompts = [pipeline_lib.encode_prompt(tokenizer, ex, d["items"], sids, tc)[0]
             for ex in examples]
  model_config = params = None
  mesh = dmesh.from_config(config)   # rows over data, the model over tensor (None: one device)
  wd = runtime.weight_dtype(config)   # every model of this eval prepared alike (load_on_device)
  if ec.model_dir:
    model_config, params = runtime.load_on_device(ec.model_dir, config.get("model"), models, mesh, wd)
  record = generate_fn is None and not verifier   # the schedule of this stage's own threshold decoder
  if generate_fn is None:
    if verifier:
      generate_fn = runtime.speculative_generate(verifier, config.get("model"), models, mesh, wd)
    else:
      generate_fn = runtime.threshold_generate(mesh)
  dcfg = runtime.decode_config(config, tids, model_config)
  rng = jax.random.PRNGKey(int(config.get("seed", 0)))
  records, row_steps, bs = [], [], ec.batch_size
  for s in tqdm.tqdm(range(0, len(prompts), bs), desc=f"eval {ec.split}"):
    chunk = prompts[s:s + bs]
    n_real = len(chunk)
    chunk = chunk + [chunk[-1]] * (bs - n_real)  # static batch shape
    rng, sub = jax.random.split(rng)
    res = generate_fn(model_config, params, chunk, dcfg, sub, max_prompt_len=tc.prompt_len)
    for i in range(n_real):
      ex, out_ids = examples[s + i], list(res["output_ids"][i])
      rec = metrics_lib.score_output(out_ids, tokenizer, tids, ex, sids)
      rec.update(history=ex["history"], candidates=ex["candidates"])   # item ids: replayable against the server
      steps = np.asarray(res["commit_step"])[i]
      rec.update(prompt_len=len(chunk[i]), nfe=int(np.asarray(res["nfe"])[i]),
                 commit_steps=steps[:len(out_ids)].tolist())
      row_steps.append(steps[steps >= 0].tolist())   # every position the row committed (EOS and after it too)
      for k in ("rounds", "accepted"):   # speculative decoding
        if k in res:
          rec[k] = int(np.asarray(res[k])[i])
      records.append(rec)
  metrics = metrics_lib.aggregate(records)
  if records and "rounds" in records[0]:
    rounds = sum(r["rounds"] for r in records)
    metrics.update(mean_rounds=rounds / len(records),
                   accepted_per_round=sum(r["accepted"] for r in records) / max(rounds, 1),
                   tokens_per_round=sum(len(r["commit_steps"]) for r in records) / max(rounds, 1))
  metrics.update(split=ec.split, model_dir=ec.model_dir, examples=counts,
                 prerank_floor=metrics_lib.prerank_floor([e["target_pos"] for e in examples]),
                 decode=common.to_plain(config.get("decode", {})))
  with build.publish() as tmp:
    if common.is_writer():  # several processes: process 0 writes
      with open(os.path.join(tmp, "predictions.jsonl"), "w") as f:
        for r in records:
          f.write(json.dumps(r, ensure_ascii=False) + "\n")
    common.write_json_atomic(os.path.join(tmp, "metrics.json"), metrics)
    if record and records:   # one process writes (fileio's writers)
      schedule_lib.write(os.path.join(tmp, schedule_lib.FILENAME),
                         commit_schedule(config, dcfg, records, row_steps, mesh))
  return build.out


def _copy_twin(config, build: contract.Build, twin: str) -> str:
  """Publishes `twin`'s outputs (an eval of the same weights with the same settings) as this one's:
  what decoding would write, since the decoder is deterministic given the weights, the settings
  and the seed. metrics.json names this eval's model and the twin (`same_weights_as`)."""
  metrics = _read_metrics(twin)
  metrics.update(model_dir=config.eval.model_dir, same_weights_as=twin)
  with build.publish() as tmp:
    if common.is_writer():
      for name in ("predictions.jsonl", schedule_lib.FILENAME):
        if os.path.exists(os.path.join(twin, name)):
          shutil.copyfile(os.path.join(twin, name), os.path.join(tmp, name))
    common.write_json_atomic(os.path.join(tmp, "metrics.json"), metrics)
  return build.out


def _read_metrics(out: str) -> dict:
  with open(os.path.join(out, "metrics.json")) as f:
    return json.load(f)


# Reads the traces and the stages they are built from (the model is named by eval.model_dir).
STAGE = contract.Stage(name="eval", reads=traces_stage.UPSTREAM + ("traces",), hashed=_hash, build=_build,
                       output=output_dir)


def run(config, workdir: str, generate_fn=None, models: dict | None = None, same_as: str | None = None) -> str:
  """Decodes and scores `config.eval.split` (unless fresh) -> the output directory. `models`: see
  `load_on_device`; `generate_fn` replaces the decoder (the bench stage's timed one, tests);
  `same_as`: the output directory of an eval of the same weights with the same split, task and
  decode settings (the ladder's rows of a stage that kept its starting model), whose outputs are
  this one's: copied, not decoded again."""
  if not config.eval.model_dir and generate_fn is None:   # before a fresh output is returned
    raise ValueError("config.eval.model_dir is required for --config.stage=eval")
  return contract.run(STAGE, config, workdir, generate_fn=generate_fn, models=models, same_as=same_as)
