"""Commit schedules (decode/schedule.py): the decoder's forced-schedule input against the plain-Python
reference, a recorded decode replayed step for step, the schedule file the eval stage writes, and
its replay by benchmarks/decode_throughput.py at another model shape."""

import json
import os
import sys

import jax
import numpy as np
import pytest

from dgr2_jax.decode import reference, sampler
from dgr2_jax.decode import schedule as schedule_lib

PROMPTS = [[7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20], [21, 22, 23]]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dc(bs, r, **kw):
  kw.setdefault("eos_ids", ())
  kw.setdefault("threshold", 1.0)
  kw.setdefault("steps_per_block", 0)
  return sampler.DecodeConfig(block_size=bs, max_new_tokens=r, mask_token_id=63, pad_id=0, **kw)


def _random_schedule(rs, bs: int, length: int) -> list[int]:
  """Counts per step that finish each block before the next and sum to `length`."""
  out, filled = [], 0
  while filled < length:
    room = min((filled // bs + 1) * bs, length) - filled
    n = int(rs.randint(1, room + 1))
    out.append(n)
    filled += n
  return out


def _per_step(commit_step) -> list[list[int]]:
  return [np.bincount(row[row >= 0]).tolist() for row in np.asarray(commit_step)]


def _replay(cfg, params, dc, scheds, prompts=PROMPTS):
  toks, lens = sampler.left_pad(prompts, max(len(p) for p in prompts), 0)
  fn = sampler.decoder_for(cfg, dc)[1]
  commits = schedule_lib.forced_commits(scheds, dc.max_new_tokens)   # one shape: one compilation per config
  return jax.device_get(sampler.run_decoder(fn, params, toks, lens, dc, None, commits))


@pytest.mark.parametrize("bs,kv_write", [(1, "fused"), (4, "fused"), (4, "separate"), (8, "separate")])
def test_forced_schedule_matches_reference(tiny_lm, bs, kv_write):
  """Rows ending mid-block, at a block's end and at the last slot: the jitted decoder commits what the
  plain-Python reference commits, each row's steps are its schedule and its NFE `schedule.nfe`."""
  cfg, params = tiny_lm
  r = 16
  rs = np.random.RandomState(bs)
  lengths = [r - bs // 2 - 1 if bs > 1 else 9, 2 * bs if bs > 1 else 5, r]
  scheds = [_random_schedule(rs, bs, n) for n in lengths]
  dc = _dc(bs, r, kv_write=kv_write)
  out = _replay(cfg, params, dc, scheds)
  ref = reference.reference_decode(cfg, params, PROMPTS, dc, commits=scheds)
  for k in ("tokens", "commit_step", "nfe", "steps"):
    np.testing.assert_array_equal(out[k], ref[k], err_msg=k)
  assert _per_step(out["commit_step"]) == scheds
  assert out["steps"].tolist() == [len(c) for c in scheds]
  assert out["nfe"].tolist() == [schedule_lib.nfe(c, bs, kv_write) for c in scheds]
  if bs > 1:
    assert max(max(c) for c in scheds) > 1   # the rows commit several tokens in one step


def test_commit_rule_with_forced_counts_in_plain_python():
  """`sampler.commit_mask` with forced counts against the rule written out in Python: at tau 1,
  exactly the n most confident candidates (ties: lower index first); below tau, those as well as
  every candidate at tau or above. Random confidences with ties, random candidate sets."""
  rs = np.random.RandomState(0)
  b, n = 64, 8
  conf = rs.choice([0.1, 0.3, 0.5, 0.7, 0.95], size=(b, n)).astype(np.float32)   # many ties
  cand = rs.rand(b, n) < 0.7
  cand[:, 0] = True
  forced = np.array([rs.randint(1, c.sum() + 1) for c in cand], np.int32)
  for tau in (1.0, 0.6):
    got = np.asarray(sampler.commit_mask(conf, cand, np.float32(tau), np.full(b, n, np.int32), forced))
    for row in range(b):
      ids = [i for i in range(n) if cand[row, i]]
      top = sorted(ids, key=lambda i: (-conf[row, i], i))[:forced[row]]
      want = {i for i in ids if i in top or (tau < 1.0 and conf[row, i] >= tau)}
      assert set(np.flatnonzero(got[row]).tolist()) == want, (row, tau)
    if tau == 1.0:
      np.testing.assert_array_equal(got.sum(1), forced)


def test_recorded_schedule_replays_its_decode(tiny_lm):
  """A threshold decode's commit counts, replayed through the forced schedule at tau 1, give the
  same decode: token for token without EOS; with an EOS (off in the replay) the same steps, NFE
  and counts per step."""
  cfg, params = tiny_lm
  r = 16
  free = sampler.generate(cfg, params, PROMPTS, _dc(4, r, threshold=0.1, steps_per_block=3))
  scheds = [schedule_lib.commits_per_step(c[c >= 0]) for c in free["commit_step"]]
  assert any(len(set(c)) > 1 for c in scheds)   # counts vary within an answer
  out = _replay(cfg, params, _dc(4, r), scheds)
  for k in ("tokens", "commit_step", "nfe", "steps"):
    np.testing.assert_array_equal(out[k], free[k], err_msg=k)
  eos = int(np.bincount(free["tokens"][:, :r // 2].ravel()).argmax())   # some rows stop early
  orig = sampler.generate(cfg, params, PROMPTS, _dc(4, r, threshold=0.1, steps_per_block=3, eos_ids=(eos,)))
  # Every position the row committed (the EOS and what follows it in its block too, as the eval
  # stage records it): a step may commit only positions the answer cuts off, and it must run too.
  scheds = [schedule_lib.commits_per_step(c[c >= 0]) for c in orig["commit_step"]]
  assert len({sum(c) for c in scheds}) > 1 and all(n >= 1 for c in scheds for n in c)
  assert any(sum(c) > len(o) for c, o in zip(scheds, orig["output_ids"]))   # EOS rows: more than the answer
  out = _replay(cfg, params, _dc(4, r), scheds)
  np.testing.assert_array_equal(out["nfe"], orig["nfe"])
  np.testing.assert_array_equal(out["steps"], orig["steps"])
  assert _per_step(out["commit_step"]) == scheds


def test_schedule_file_checks_and_draws(tmp_path):
  obj = schedule_lib.make([dict(example_id="a", nfe=3, commits=[2, 2, 1]), dict(example_id="b", nfe=1, commits=[4])],
                          model="m", block_size=4, threshold=0.9, max_new_tokens=8, kv_write="separate")
  path = str(tmp_path / schedule_lib.FILENAME)
  schedule_lib.write(path, obj)
  assert schedule_lib.read(path) == obj
  assert schedule_lib.block_walk([2, 2, 1], 4, 8) == [0, 0, 1]
  assert [schedule_lib.nfe(c, 4, kv) for c in ([2, 2, 1], [4]) for kv in ("separate", "fused")] == [4, 3, 1, 1]
  assert schedule_lib.nfe([1] * 5, 1, "separate") == 4   # AR: the prefill predicts the first token
  draws = [a["example_id"] for a in schedule_lib.draw(obj, 2, seed=3)]
  assert sorted(draws) == ["a", "b"] and draws == [a["example_id"] for a in schedule_lib.draw(obj, 2, seed=3)]
  assert len(schedule_lib.draw(obj, 5, seed=0)) == 5   # with replacement past the file's answers
  np.testing.assert_array_equal(schedule_lib.forced_commits([[2, 2, 1], [4]]), [[2, 2, 1, 0], [4, 0, 0, 0]])
  bad = [(dict(obj, format="x"), "format"), (dict(obj, block_size=0), "block_size"),
         (dict(obj, answers=[]), "answers"), (dict(obj, answers=[dict(commits=[0])]), r"answers\[0\].commits"),
         (dict(obj, answers=[dict(commits=[3, 2])]), r"answers\[0\].commits: step 1 commits 2 but block 0 has 1"),
         (dict(obj, answers=[dict(commits=[4, 4, 1])]), "more than max_new_tokens")]
  for o, msg in bad:
    with pytest.raises(ValueError, match=msg):
      schedule_lib.check(o)
  (tmp_path / "junk.json").write_text("{")
  with pytest.raises(ValueError, match="junk.json: cannot read"):
    schedule_lib.read(str(tmp_path / "junk.json"))
  with pytest.raises(ValueError, match="commit_steps"):
    schedule_lib.commits_per_step([0, -1])


def test_replay_at_qwen3_vocab_and_8b_shape():
  """The forced schedule at Qwen3's vocabulary (tiny width): each row's steps and NFE are its
  schedule's; and the 8B shape's decoder with a schedule traced to its output shapes (no weights)."""
  from dgr2_jax.model import qwen3
  from dgr2_jax.model.config import Qwen3Config
  v = 151936
  cfg = Qwen3Config(vocab_size=v, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=8, mask_token_id=v - 1)
  params = qwen3.init_params(cfg, jax.random.PRNGKey(0))
  scheds = [[3, 1, 2], [1, 3, 4]]
  dc = sampler.DecodeConfig(block_size=4, max_new_tokens=8, threshold=1.0, steps_per_block=0, eos_ids=(),
                            mask_token_id=v - 1, pad_id=0)
  out = _replay(cfg, params, dc, scheds, PROMPTS[:2])
  assert _per_step(out["commit_step"]) == scheds
  assert out["nfe"].tolist() == [schedule_lib.nfe(c, 4, sampler.resolve_kv_write("auto", 2)) for c in scheds]
  big = Qwen3Config(vocab_size=v, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                    mask_token_id=v - 1, dtype="bfloat16", param_dtype="bfloat16")
  dc8 = sampler.DecodeConfig(block_size=32, max_new_tokens=64, threshold=1.0, steps_per_block=0, eos_ids=(),
                             mask_token_id=v - 1, pad_id=0)
  fn = sampler.decoder_for(big, dc8)[1]
  toks, lens = sampler.left_pad([[5] * 40], 40, 0)
  shapes = jax.eval_shape(lambda p, c: sampler.run_decoder(fn, p, toks, lens, dc8, None, c),
                          qwen3.param_shapes(big), schedule_lib.forced_commits([[8] * 8]))
  assert shapes["tokens"].shape == (1, 64) and shapes["nfe"].shape == (1,)


# ---- the eval stage records a schedule; the benchmark replays it -----------------------------------
@pytest.fixture(scope="module")
def eval_dirs(tmp_path_factory):
  """The eval stage on synthetic task data with a tiny random model (peaked: several commits per
  step), twice: as it runs, and with the schedule's writer off. -> (output dirs, model config)."""
  import ml_collections
  from dgr2_jax.model import checkpoint, qwen3
  from dgr2_jax.model.config import Qwen3Config
  from dgr2_jax.stages import eval as eval_stage
  from dgr2_jax.stages import traces as traces_stage
  from dgr2_jax.task import config as task_config, synthetic
  from dgr2_jax.task import tokenizer as tok_lib
  mp = pytest.MonkeyPatch()
  data = synthetic.make(n_items=80, n_users=40, seed=1)
  mp.setattr(traces_stage, "load_task_data", lambda workdir: data)
  mp.setattr(traces_stage, "load_items_sids", lambda workdir: (data["items"], data["sids"]))
  work = str(tmp_path_factory.mktemp("sched_work"))
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = task_config.task_config()
  c.task.update(demo_vocab_size=1024, prompt_len=640, response_len=256, insert_target="random_position")
  c.eval = task_config.eval_config()
  c.decode = ml_collections.ConfigDict(dict(block_size=4, threshold=0.3, temperature=0.0, top_k=0, top_p=1.0,
                                            steps_per_block=0, max_new_tokens=16))
  traces_stage.run(c, work)
  tids = tok_lib.token_ids(tok_lib.load_tokenizer(traces_stage.tokenizer_dir(c, work)))
  cfg = Qwen3Config(vocab_size=tids.mask_id + 1, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, mask_token_id=tids.mask_id,
                    eos_token_id=tids.eos_id, pad_token_id=tids.pad_id)
  params = jax.device_get(jax.tree_util.tree_map(lambda x: x * 8 if x.ndim == 2 else x,
                                                 qwen3.init_params(cfg, jax.random.PRNGKey(1))))
  mp.setattr(checkpoint, "load_model_dir", lambda path, *a, **k: (cfg, params))
  model_dir = os.path.join(work, "model")
  os.makedirs(model_dir)
  outs = {}
  for name in ("recorded", "unrecorded"):
    if name == "unrecorded":
      mp.setattr(schedule_lib, "write", lambda path, obj: None)
    c.eval.update(model_dir=model_dir, batch_size=3, max_examples=6, name=name)
    outs[name] = eval_stage.run(c, work)
  mp.undo()
  return outs, cfg


def test_eval_writes_the_schedule_of_its_answers(eval_dirs):
  outs, _ = eval_dirs
  read = lambda name, f: open(os.path.join(outs[name], f)).read()
  # Recording reads the decoder's outputs after decoding: the predictions are the same bytes.
  assert read("recorded", "predictions.jsonl") == read("unrecorded", "predictions.jsonl")
  assert not os.path.exists(os.path.join(outs["unrecorded"], schedule_lib.FILENAME))
  obj = schedule_lib.read(os.path.join(outs["recorded"], schedule_lib.FILENAME))
  preds = [json.loads(line) for line in read("recorded", "predictions.jsonl").splitlines()]
  assert (obj["block_size"], obj["threshold"], obj["max_new_tokens"], obj["kv_write"]) == (4, 0.3, 16, "separate")
  assert obj["model"].endswith("model") and len(obj["answers"]) == len(preds) == 6
  for a, p in zip(obj["answers"], preds):
    assert a["example_id"] == p["example_id"] and a["nfe"] == p["nfe"]
    # The answer's tokens were committed at these steps; the row may have committed more (its EOS).
    answer = np.bincount(p["commit_steps"], minlength=len(a["commits"]))
    assert len(answer) == len(a["commits"]) and (answer <= np.asarray(a["commits"])).all()
    assert a["nfe"] == schedule_lib.nfe(a["commits"], 4, "separate")
  assert any(n > 1 for a in obj["answers"] for n in a["commits"])


def test_benchmark_replays_the_eval_schedule_with_its_nfe(eval_dirs):
  """benchmarks/decode_throughput.py's replay at another model shape (random weights): every row
  runs its drawn answer's recorded steps and NFE (the benchmark checks each row and raises
  otherwise), and its AR row generates the same tokens."""
  sys.path.insert(0, os.path.join(REPO, "benchmarks"))
  import decode_throughput  # pylint: disable=g-import-not-at-top
  if not decode_throughput.FLAGS.is_parsed():   # the flags' defaults (--weight_dtype, ...)
    decode_throughput.FLAGS.mark_as_parsed()
  from dgr2_jax.model import qwen3
  from dgr2_jax.model.config import Qwen3Config
  outs, _ = eval_dirs
  path = os.path.join(outs["recorded"], schedule_lib.FILENAME)
  obj = schedule_lib.read(path)
  cfg = Qwen3Config(vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=8, mask_token_id=511)
  params = qwen3.init_params(cfg, jax.random.PRNGKey(2))
  b = 4
  toks, lens = sampler.left_pad([list(range(10, 30))] * b, 20, 0)
  ar, rep = decode_throughput.replay_rows(cfg, params, obj, toks, lens, 0, "auto", 1, f"{path}, random weights")
  drawn = schedule_lib.draw(obj, b, 0)
  assert rep["answers"] == [a["example_id"] for a in drawn]
  assert rep["nfe_per_seq"] == rep["recorded_nfe_per_seq"] == np.mean([a["nfe"] for a in drawn])
  assert rep["schedule"] == f"replayed schedule from {path}, random weights"
  assert ar["new_tokens"] == rep["new_tokens"] == np.mean([sum(a["commits"]) for a in drawn])
  assert rep["request_wall_s"] == pytest.approx(rep["request_prefill_s"] + rep["request_decode_s"])
  assert rep["request_tokens_per_s"] == pytest.approx(rep["new_tokens"] / rep["request_wall_s"])
  with pytest.raises(RuntimeError, match="replay: rows ran"):
    decode_throughput.check_replay(dict(steps=np.array([1]), nfe=np.array([1]), commit_step=np.array([[0, 0]])),
                                   [[1, 1]], 4, "fused")

