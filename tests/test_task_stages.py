"""Traces and eval stages on synthetic data (data API replaced), eval with a fake generate."""

import json
import os
import re

import ml_collections
import numpy as np
import pytest

from dgr2_jax.decode import runtime
from dgr2_jax.stages import eval as eval_stage
from dgr2_jax.stages import traces as traces_stage
from dgr2_jax.task import answer, config, metrics, synthetic, traces
from dgr2_jax.task import tokenizer as tok_lib

DATA = synthetic.make(n_items=80, n_users=40, seed=1)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  mp = pytest.MonkeyPatch()
  mp.setattr(traces_stage, "load_task_data", lambda workdir: DATA)
  mp.setattr(traces_stage, "load_items_sids", lambda workdir: (DATA["items"], DATA["sids"]))
  yield str(tmp_path_factory.mktemp("work"))
  mp.undo()


def full_config():
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = config.task_config()
  c.task.update(demo_vocab_size=1024, prompt_len=640, response_len=256,
                insert_target="random_position")
  c.eval = config.eval_config()
  c.decode = ml_collections.ConfigDict(dict(block_size=4, threshold=0.9, temperature=0.0,
                                            top_k=0, top_p=1.0, max_new_tokens=256))
  return c


@pytest.fixture(scope="module")
def traced(workdir):
  cfg = full_config()
  out = traces_stage.run(cfg, workdir)
  return cfg, out


def test_traces_stage_outputs(traced, workdir):
  cfg, out = traced
  assert out == os.path.join(workdir, "traces")
  assert os.path.exists(os.path.join(out, "DONE.json"))
  tok = tok_lib.load_tokenizer(traces_stage.tokenizer_dir(cfg, workdir))
  stats = json.load(open(os.path.join(out, "stats.json")))
  for split in ("train", "valid"):
    recs = traces.read_jsonl(os.path.join(out, f"{split}.jsonl"))
    assert len(recs) == stats["splits"][split]["traces"] > 0
    for r in recs:
      assert r["split"] == split
      p = answer.parse_response(r["response"], [DATA["sids"][i] for i in r["candidates"]])
      assert p.valid and p.positions[0] == r["target_pos"]
      assert r["prompt_text"].endswith("<|im_start|>assistant\n")
  assert len(traces.read_jsonl(os.path.join(out, "train.jsonl"))) == 40  # insertion keeps all
  s = stats["splits"]["train"]
  assert 100 < s["mean_reasoning_tokens"] < 160
  assert s["prompt_tokens"]["mean"] > 100 and s["static_shapes"]["kept"] == 40
  floor = stats["prerank_floor"]["test"]
  exs, _ = traces.build_examples(DATA["sequences"], DATA["candidates"]["test"], "test")
  assert floor["n"] == len(exs) == floor["target_in_candidates"]
  assert floor["recall@1"] == pytest.approx(np.mean([e["target_pos"] == 0 for e in exs]))
  # Fresh: a second run returns without rewriting.
  mtime = os.path.getmtime(os.path.join(out, "DONE.json"))
  traces_stage.run(cfg, workdir)
  assert os.path.getmtime(os.path.join(out, "DONE.json")) == mtime
  arr, counts = traces_stage.load_split_arrays(cfg, workdir, "train", tokenizer=tok)
  assert arr["response_ids"].shape == (40, 256) and counts["kept"] == 40


def fake_generate_factory(tok, batch_sizes):
  """Valid reversed ranking when the first candidate's SID ends in <d_0>; otherwise the
  reasoning never closes (unparseable). Depends only on the prompt text."""
  tids = tok_lib.token_ids(tok)

  def generate(model_config, params, prompts, dcfg, rng, max_prompt_len=None):
    assert model_config is None and params is None
    batch_sizes.append(len(prompts))
    outs = []
    for p in prompts:
      assert len(p) <= max_prompt_len
      text = tok.decode(p)
      cand = re.findall(r"^\d+\. ((?:<[a-d]_\d+>){4})", text.split("Candidates:")[1], re.M)
      assert len(cand) == 10
      if cand[0].endswith("<d_0>"):
        resp = answer.format_response("fake reasoning", cand[::-1])
      else:
        resp = "<think>fake reasoning that never ends"
      outs.append(tok.encode(resp, add_special_tokens=False) + [tids.eos_id])
    R = dcfg["max_new_tokens"] if isinstance(dcfg, dict) else dcfg.max_new_tokens
    b = len(prompts)
    tokens = np.full([b, R], tids.pad_id, np.int32)
    commit = np.full([b, R], -1, np.int32)
    for i, o in enumerate(outs):
      tokens[i, :len(o)] = o
      commit[i, :len(o)] = np.arange(len(o)) // 2
    return dict(tokens=tokens, commit_step=commit, logprob=np.zeros([b, R], np.float32),
                nfe=np.array([len(o) // 2 for o in outs]), output_ids=outs)

  return generate


def test_eval_stage_with_fake_generate(traced, workdir):
  cfg, _ = traced
  cfg.eval.update(split="test", batch_size=3, name="fake")
  tok = tok_lib.load_tokenizer(traces_stage.tokenizer_dir(cfg, workdir))
  sizes = []
  out = eval_stage.run(cfg, workdir, generate_fn=fake_generate_factory(tok, sizes))
  assert out == os.path.join(workdir, "eval", "fake")
  m = json.load(open(os.path.join(out, "metrics.json")))
  preds = traces.read_jsonl(os.path.join(out, "predictions.jsonl"))
  exs, _ = traces.build_examples(DATA["sequences"], DATA["candidates"]["test"], "test")
  assert set(sizes) == {3} and len(sizes) == -(-len(exs) // 3)  # static, last batch padded
  assert len(preds) == m["n"] == len(exs)
  # Independent expectation from the examples alone.
  ranks, valid = [], []
  for e in exs:
    ok = DATA["sids"][e["candidates"][0]].endswith("<d_0>")
    valid.append(ok)
    ranks.append(10 - e["target_pos"] if ok else e["target_pos"] + 1)
  ranks = np.array(ranks)
  assert 0 < sum(valid) < len(exs)
  assert m["recall@1"] == pytest.approx(np.mean(ranks == 1))
  assert m["recall@3"] == pytest.approx(np.mean(ranks <= 3))
  assert m["ndcg@3"] == pytest.approx(np.mean(np.where(ranks <= 3, 1 / np.log2(ranks + 1), 0)))
  assert m["valid_rate"] == pytest.approx(np.mean(valid))
  assert m["unparseable_rate"] == pytest.approx(1 - np.mean(valid))
  assert m["fallback_rate"] == pytest.approx(1 - np.mean(valid))
  for k in ("duplicate_rate", "omission_rate", "out_of_set_rate"):
    assert m[k] == 0.0
  for k in metrics.METRIC_KEYS:
    assert k in m
  assert m["mean_reasoning_tokens"] > 0 and m["mean_nfe"] > 0
  for p, e, ok in zip(preds, exs, valid):
    assert p["example_id"] == e["example_id"] and p["verdict"] == ("valid" if ok else "unparseable")
    assert len(p["commit_steps"]) == len(tok.encode(p["output"], add_special_tokens=False))
    if ok:
      assert p["ranking_items"] == e["candidates"][::-1]
  assert m["prerank_floor"]["recall@1"] == pytest.approx(np.mean([e["target_pos"] == 0
                                                                  for e in exs]))


def test_eval_requires_model_dir(traced, workdir):
  cfg, _ = traced
  cfg.eval.model_dir = ""
  with pytest.raises(ValueError, match="model_dir"):
    eval_stage.run(cfg, workdir)


def test_bench_rows_share_one_loaded_copy_of_each_model(traced, workdir, tmp_path, monkeypatch):
  """Bench keeps every row's decode calls until it times the rows side by side, so the rows
  (threshold rows of the final model; speculative rows, whose verifier is the AR row's model)
  must hold one loaded copy of each model directory, not one per row: at Qwen3-8B a copy is
  16 GB."""
  import jax
  from dgr2_jax.model import checkpoint, qwen3
  from dgr2_jax.model.config import Qwen3Config
  from dgr2_jax.stages import bench as bench_stage
  cfg, _ = traced
  cfg = cfg.copy_and_resolve_references()
  cfg.eval.update(split="test", batch_size=4, name="bench")
  cfg.bench = ml_collections.ConfigDict(dict(split="test", max_examples=4, batch_size=4))
  tok = tok_lib.load_tokenizer(traces_stage.tokenizer_dir(cfg, workdir))
  tiny = Qwen3Config(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=4, mask_token_id=15)
  loads = []

  def load(path, *a, **k):
    loads.append(path)
    return tiny, qwen3.init_params(tiny, jax.random.PRNGKey(len(loads)))
  monkeypatch.setattr(checkpoint, "load_model_dir", load)
  seen = []
  base = fake_generate_factory(tok, [])

  def fake(model_config, params, prompts, dcfg, rng, max_prompt_len=None, return_device=False):
    seen.append(id(params))
    out = base(None, None, prompts, dcfg, rng, max_prompt_len)
    out.pop("output_ids")   # TimedGenerate cuts the canvas after EOS itself
    return dict(out, eos_pos=np.argmax(out["tokens"] == tok_lib.token_ids(tok).eos_id, axis=1),
                forward_passes=np.int32(out["nfe"].max()))
  final, ar = str(tmp_path / "final"), str(tmp_path / "ar")
  models = {}
  for tau in (0.9, 0.5):
    bench_stage.measure(cfg, workdir, bench_stage.Row(final, 4, tau), str(tmp_path / f"t{tau}"),
                        generate_fn=bench_stage.TimedGenerate(fake), models=models)
  bench_stage.measure(cfg, workdir, bench_stage.Row(ar, 1, 1.0), str(tmp_path / "ar_row"),
                      generate_fn=bench_stage.TimedGenerate(fake), models=models)
  runtime.speculative_generate(ar, None, models)
  assert loads == [final, ar]
  assert len(set(seen)) == 2 and seen[0] == seen[1]
