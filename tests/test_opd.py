"""OPD: teacher cache, forward KL on replayed rollouts, top-k cache, updates, and the on-policy loop."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dgr2_jax.decode import sampler
from dgr2_jax.model import masks, qwen3
from dgr2_jax.train import loop, opd, replay, rollouts
from dgr2_jax.train import config as train_config_lib

PROMPTS = [[7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20], [21, 22, 23]]
R, G = 16, 4


def _dc(bs, tau=1.0):
  return sampler.DecodeConfig(block_size=bs, threshold=tau, temperature=1.0, max_new_tokens=R, eos_ids=(5,),
                              mask_token_id=63, pad_id=0)


def _batch(cfg_teacher, tparams, roll, seg, top_k=0):
  cache = opd.ar_teacher_cache(cfg_teacher, tparams, roll["prompt_ids"], roll["prompt_len"], seg["clean"],
                               top_k=top_k, mask_id=63)
  return dict(prompt=roll["prompt_ids"], prompt_len=roll["prompt_len"], loss_mask=roll["loss_mask"],
              **{k: seg[k] for k in rollouts.SEGMENT_KEYS}, **cache)


@pytest.fixture(scope="module")
def setup(tiny_lm):
  cfg, params = tiny_lm
  toks, lens = sampler.left_pad(PROMPTS, 9, 0)
  other = jax.tree_util.tree_map(lambda x: x * 8 if x.ndim == 2 else x, qwen3.init_params(cfg, jax.random.PRNGKey(2)))
  return cfg, params, other, toks, lens


def test_rollouts_are_the_eval_decoder_and_groups_differ(setup):
  cfg, params, _, toks, lens = setup
  roll = rollouts.sample(cfg, params, toks, lens, _dc(4, 0.5), jax.random.PRNGKey(3), G)
  gen = sampler.generate(cfg, params, [p for p in PROMPTS for _ in range(G)], _dc(4, 0.5), jax.random.PRNGKey(3),
                         max_prompt_len=9)
  for k in ("tokens", "commit_step", "logprob", "nfe"):
    np.testing.assert_array_equal(roll[k], gen[k])
  assert roll["output_ids"] == gen["output_ids"]
  assert len({tuple(x) for x in roll["tokens"][:G]}) > 1          # one key, different samples per row
  eos = roll["eos_pos"]
  np.testing.assert_array_equal(roll["finished"], eos < R)
  assert not (roll["loss_mask"] & (np.arange(R)[None] > eos[:, None])).any()
  # Replay inputs are exact (one canvas per denoising step) and include blocks with 2 steps.
  seg = rollouts.replay_inputs(roll, 4, 63)
  assert seg["exact"].all()


def test_kl_zero_for_same_ar_model_positive_otherwise_and_topk(setup):
  cfg, params, other, toks, lens = setup
  roll = rollouts.sample(cfg, params, toks, lens, _dc(1), jax.random.PRNGKey(5), G)
  seg = rollouts.replay_inputs(roll, 1, 63)
  batch = _batch(cfg, params, roll, seg)
  loss_fn = jax.jit(lambda p, b, c: opd.opd_loss(cfg, p, b, None, block_size=1, teacher_cache=c), static_argnums=2)
  same, m = loss_fn(params, batch, "full")
  assert abs(float(same)) < 1e-5 and float(m["top1_agreement"]) == 1.0
  assert float(m["denominator"]) == roll["loss_mask"].sum() > 20
  full = float(loss_fn(other, batch, "full")[0])
  assert full > 0.05
  # Independent NumPy KL on the committed positions.
  lt = np.asarray(batch["teacher_logp"], np.float64)
  ls = np.asarray(opd.log_dist(replay.replay_logits(cfg, other, roll["prompt_ids"], roll["prompt_len"], seg, 1),
                               63), np.float64)
  pt = np.exp(lt)
  kl_np = np.where(pt > 0, pt * (lt - ls), 0).sum(-1)
  np.testing.assert_allclose(full, kl_np[roll["loss_mask"]].mean(), rtol=1e-4)
  # Top-k cache: the KL over k tokens + a rest bucket grows with k (coarser partitions lose
  # information), approximates the full KL, and equals it at k = V.
  vals = []
  m = roll["loss_mask"]
  for k in (2, 8, 32, 64):
    cache = opd.cache_from_logprobs(jnp.asarray(batch["teacher_logp"]), k)
    assert cache["teacher_topk_logp"].shape[-1] == k
    vals.append(float(np.asarray(opd.kl_from_cache(cache, jnp.asarray(ls, jnp.float32)))[m].mean()))
    # NumPy reference of the coarsened KL for this k.
    idx = np.argsort(-lt, -1)[..., :k]
    lk_t, lk_s = np.take_along_axis(lt, idx, -1), np.take_along_axis(ls, idx, -1)
    pk_t = np.exp(lk_t)
    rest_t, rest_s = 1 - pk_t.sum(-1), 1 - np.exp(lk_s).sum(-1)
    ref = np.where(pk_t > 0, pk_t * (lk_t - lk_s), 0).sum(-1) + np.where(
        rest_t > 1e-9, rest_t * (np.log(np.maximum(rest_t, 1e-300)) - np.log(np.maximum(rest_s, 1e-300))), 0)
    np.testing.assert_allclose(vals[-1], ref[m].mean(), rtol=2e-3, atol=1e-5)
    if k == 8:  # and through opd_loss with a top-k batch
      b = {n: v for n, v in batch.items() if n != "teacher_logp"}
      b.update(cache)
      np.testing.assert_allclose(float(opd.opd_loss(cfg, other, b, None, block_size=1, teacher_cache="topk")[0]),
                                 vals[-1], rtol=1e-5)
  assert all(a <= b + 1e-6 for a, b in zip(vals, vals[1:])), vals
  np.testing.assert_allclose(vals[-1], full, rtol=1e-5)
  assert abs(vals[2] - full) < 0.2 * full, (vals, full)


def test_self_tau1_teacher_is_student_on_serial_trajectories(setup):
  cfg, params, _, toks, lens = setup
  bcfg = cfg.as_block_diffusion(4, 63)
  for tau in (1.0, 0.02):
    roll = rollouts.sample(bcfg, params, toks, lens, _dc(4, tau), jax.random.PRNGKey(7), G)
    seg = rollouts.replay_inputs(roll, 4, 63)
    serial = rollouts.serialize_commit_steps(roll["commit_step"], 4)
    if tau == 1.0:  # already one commit per step: the serial trajectory is the rollout itself
      np.testing.assert_array_equal(serial >= 0, roll["commit_step"] >= 0)
      assert all(len(np.unique(c[c >= 0])) == (c >= 0).sum() for c in roll["commit_step"])
    tseg = rollouts.replay_inputs(roll, 4, 63, serial)
    cache = opd.replay_teacher_cache(bcfg, params, roll["prompt_ids"], roll["prompt_len"],
                                     {k: tseg[k] for k in rollouts.SEGMENT_KEYS}, 4, mask_id=63)
    batch = dict(prompt=roll["prompt_ids"], prompt_len=roll["prompt_len"], loss_mask=roll["loss_mask"],
                 **{k: seg[k] for k in rollouts.SEGMENT_KEYS}, **cache)
    kl = float(opd.opd_loss(bcfg, params, batch, None, block_size=4)[0])
    if tau == 1.0:
      assert kl < 1e-5
    else:  # parallel commits: the serial teacher saw more context on some tokens
      assert (serial >= 0).sum() == (roll["commit_step"] >= 0).sum() and kl > 1e-4


def test_prefix_context_is_the_decoder_on_left_to_right_canvases(setup):
  # The paper's student conditional pi(. | P, o_<t): token t scored on the canvas of its block with
  # exactly the tokens left of t visible. Reference: the decoder's own cache path
  # (prefill, clean K/V writes, one window forward per canvas), independent of the replay layout.
  cfg, params, _, toks, lens = setup
  bs = 4
  bcfg = cfg.as_block_diffusion(bs, 63)
  roll = rollouts.sample(bcfg, params, toks, lens, _dc(bs, 0.3), jax.random.PRNGKey(9), 1)
  order = rollouts.left_to_right_commit_steps(roll["commit_step"])
  assert (roll["commit_step"] != order).any()   # the rollout itself committed in parallel
  seg = rollouts.replay_inputs(roll, bs, 63, order)
  assert seg["exact"].all()
  logits = np.asarray(replay.replay_logits(bcfg, params, toks, lens, {k: seg[k] for k in rollouts.SEGMENT_KEYS}, bs))
  p, clean = toks.shape[1], seg["clean"]
  s = p + R
  pos = masks.left_pad_positions(lens, p, s)
  lg, cache = sampler.window_forward(bcfg, params, jnp.asarray(toks), 0, qwen3.init_cache(bcfg, len(toks), s),
                                     lens, p, pos)
  carry = np.asarray(lg[:, -1])
  checked = 0
  for j in range(R // bs):
    for i in range(bs):
      t = j * bs + i
      if i == 0:
        ref = carry
      else:
        canvas = np.array(clean[:, j * bs:(j + 1) * bs])
        canvas[:, i:] = 63
        lg_c, _ = sampler.window_forward(bcfg, params, jnp.asarray(canvas), p + j * bs, cache, lens, p, pos)
        ref = np.asarray(lg_c[:, i - 1])
      m = roll["commit_step"][:, t] >= 0
      np.testing.assert_allclose(logits[m, t], ref[m], atol=1e-5, rtol=1e-5)
      checked += m.sum()
    lg_b, cache = sampler.window_forward(bcfg, params, jnp.asarray(clean[:, j * bs:(j + 1) * bs]), p + j * bs,
                                         cache, lens, p, pos)
    carry = np.asarray(lg_b[:, -1])
  assert checked >= 20


def test_opd_updates_lower_kl_to_teacher(setup):
  cfg, teacher, other, toks, lens = setup
  bcfg = cfg.as_block_diffusion(4, 63)
  grad_fn = jax.jit(jax.value_and_grad(lambda p, b: opd.opd_loss(bcfg, p, b, None, block_size=4), has_aux=True))

  def make(p, key):
    roll = rollouts.sample(bcfg, p, toks, lens, _dc(4, 0.5), key, G)
    return _batch(cfg, teacher, roll, rollouts.replay_inputs(roll, 4, 63))

  held = make(other, jax.random.PRNGKey(100))
  before = float(grad_fn(other, held)[0][0])
  opt = optax.adam(1e-2)
  p, st = other, opt.init(other)
  for s in range(5):
    (loss, _), g = grad_fn(p, make(p, jax.random.PRNGKey(s)))   # on-policy: fresh rollouts each step
    assert np.isfinite(float(loss))
    upd, st = opt.update(g, st, p)
    p = optax.apply_updates(p, upd)
  after = float(grad_fn(p, held)[0][0])
  assert after < 0.8 * before, (before, after)


def _rollout_batch(cfg, teacher, p, pr, key):
  """(OPD batch, rollouts) of G rollouts per prompt of `pr` from params `p` (block 4, tau 0.5)."""
  roll = rollouts.sample(cfg.as_block_diffusion(4, 63), p, pr["prompt_ids"], pr["prompt_len"], _dc(4, 0.5), key, G)
  return _batch(cfg, teacher, roll, rollouts.replay_inputs(roll, 4, 63)), roll


def _loop_config(steps: int):
  """The on-policy loop's config: 3 prompts x G rows, constant lr, no tensorboard/async saves."""
  config = train_config_lib.ml_collections.ConfigDict({"seed": 0, "train": train_config_lib.train_config()})
  tc = config.train
  tc.batch_size, tc.total_steps, tc.tensorboard, tc.async_checkpointing = 3 * G, steps, False, False
  tc.optimizer.peak_lr, tc.optimizer.warmup_steps, tc.optimizer.schedule = 1e-2, 0, "constant"
  return config


def test_on_policy_loop_logs_host_metrics_and_resumes(setup, tmp_path):
  cfg, teacher, other, toks, lens = setup
  bcfg = cfg.as_block_diffusion(4, 63)
  config = _loop_config(steps=1)
  tc = config.train
  prompts = {"prompt_ids": toks, "prompt_len": lens}

  class Prompts:  # a checkpointable iterator (the same 3 prompts: the decoder compiled above is reused)
    def __init__(self):
      self.i = 0
    def __next__(self):
      self.i += 1
      return dict(prompts)
    def get_state(self):
      return {"i": self.i}
    def set_state(self, s):
      self.i = int(s["i"])

  calls = []

  def make_batch(p, pr, key):
    calls.append(np.asarray(jax.tree_util.tree_leaves(p)[0]).copy())
    batch, roll = _rollout_batch(cfg, teacher, p, pr, key)
    return batch, {"mean_nfe": roll["nfe"].mean()}

  loss_fn = lambda p, b, rng: opd.opd_loss(bcfg, p, b, rng, block_size=4)
  kw = dict(params=other, loss_fn=loss_fn, make_batch=make_batch, desc="opd-test")
  it = Prompts()
  rollouts.train_on_policy(config, str(tmp_path), prompt_iter=it, **kw)
  assert len(calls) == 1
  tc.total_steps = 2
  it2 = Prompts()
  state = rollouts.train_on_policy(config, str(tmp_path), prompt_iter=it2, **kw)
  assert len(calls) == 2 and it2.i == 2 and int(state["step"]) == 2   # resumed at step 2, data position kept
  assert not np.allclose(calls[0], calls[1])   # step 2 rolled out with the params restored after step 1
  recs = [json.loads(l) for l in open(os.path.join(tmp_path, "metrics.jsonl"))]
  assert [r["step"] for r in recs] == [1, 2]
  assert all(k in recs[-1] for k in ("loss", "mean_nfe", "rollout_time_s", "update_time_s", "kl_to_teacher"))


def test_on_policy_run_leaves_the_callers_params_intact(setup, tmp_path):
  """The train state owns its arrays: the params a caller starts an on-policy run from are neither
  donated nor changed, and stay usable afterwards."""
  cfg, teacher, _, toks, lens = setup
  bcfg = cfg.as_block_diffusion(4, 63)
  params = qwen3.init_params(cfg, jax.random.PRNGKey(4))   # float32 jax arrays: no cast, so no copy by the cast
  # A device copy: a host copy (device_get) would hold a reference to the buffers on CPU, and JAX
  # does not donate a buffer referenced from outside, which would hide a donated caller's array.
  before = jax.tree_util.tree_map(jnp.copy, params)
  prompts = {"prompt_ids": toks, "prompt_len": lens}

  def make_batch(p, pr, key):
    return _rollout_batch(cfg, teacher, p, pr, key)[0], {}

  loss_fn = lambda p, b, rng: opd.opd_loss(bcfg, p, b, rng, block_size=4)
  state = rollouts.train_on_policy(_loop_config(steps=2), str(tmp_path), params=params, loss_fn=loss_fn,
                                   make_batch=make_batch, prompt_iter=iter(lambda: dict(prompts), None))
  assert int(state["step"]) == 2
  assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(params))
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(params), jax.device_get(before))
  assert not np.allclose(np.asarray(jax.tree_util.tree_leaves(state["params"])[0]),
                         np.asarray(jax.tree_util.tree_leaves(before)[0]))   # the run trained its own copy
  batch, _ = make_batch(params, prompts, jax.random.PRNGKey(0))   # still usable
  assert np.isfinite(float(loss_fn(params, batch, jax.random.PRNGKey(0))[0]))


def test_a_batch_without_loss_tokens_makes_no_update(setup, tmp_path):
  """A step whose batch has no loss token (every GRPO group without reward variance) leaves the
  params and the optimizer state as they were, instead of moving them on Adam's momentum; the
  steps around it train."""
  cfg, teacher, _, toks, lens = setup
  bcfg = cfg.as_block_diffusion(4, 63)
  prompts = {"prompt_ids": toks, "prompt_len": lens}
  seen = []

  def make_batch(p, pr, key):
    seen.append(jax.tree_util.tree_map(np.asarray, p))
    batch, _ = _rollout_batch(cfg, teacher, p, pr, key)
    if len(seen) == 2:   # step 2: nothing to learn from
      batch["loss_mask"] = np.zeros_like(batch["loss_mask"])
    return batch, {}

  loss_fn = lambda p, b, rng: opd.opd_loss(bcfg, p, b, rng, block_size=4)
  params = qwen3.init_params(cfg, jax.random.PRNGKey(5))
  state = rollouts.train_on_policy(_loop_config(steps=3), str(tmp_path), params=params,
                                   loss_fn=loss_fn, make_batch=make_batch,
                                   prompt_iter=iter(lambda: dict(prompts), None))
  first = lambda tree: jax.tree_util.tree_leaves(tree)[0]
  np.testing.assert_array_equal(first(seen[1]), first(seen[2]))   # step 2 made no update
  assert not np.allclose(first(seen[0]), first(seen[1]))          # step 1 did
  assert not np.allclose(first(seen[2]), np.asarray(first(state["params"])))   # and step 3
  recs = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
  assert [r["update_skipped"] for r in recs] == [0.0, 1.0, 0.0] and "loss" not in recs[1]
  assert int(state["step"]) == 2   # the state counts updates: steps 1 and 3


def test_keep_bar_is_two_standard_errors_split_over_the_later_points():
  """One-sided normal quantiles at 0.025 / k (a standard table), never below 2 standard errors."""
  for k, z in ((1, 2.0), (2, 2.2414), (3, 2.3940), (4, 2.4977), (8, 2.7344)):
    assert loop.keep_bar(2.0, k) == pytest.approx(z, abs=1e-4), k
  assert loop.keep_bar(3.0, 2) == 3.0 and loop.keep_bar(2.0, 0) == 2.0


def test_a_stage_without_a_validator_trains_without_a_curve(setup, tmp_path):
  """`Validation(None, ...)` (an on-policy stage whose valid_prompts is 0): no validation runs and
  the state has an empty curve and no best step, keep_best or not."""
  cfg, teacher, other, toks, lens = setup
  bcfg = cfg.as_block_diffusion(4, 63)
  prompts = {"prompt_ids": toks, "prompt_len": lens}

  def make_batch(p, pr, key):
    return _rollout_batch(cfg, teacher, p, pr, key)[0], {}

  loss_fn = lambda p, b, rng: opd.opd_loss(bcfg, p, b, rng, block_size=4)
  state = rollouts.train_on_policy(_loop_config(steps=1), str(tmp_path), params=other, loss_fn=loss_fn,
                                   make_batch=make_batch, prompt_iter=iter(lambda: dict(prompts), None),
                                   validation=loop.Validation(None, 1, keep_best=True))
  assert state["valid_curve"] == [] and state["best_step"] is None and int(state["step"]) == 1


START_HITS = [1] * 4 + [0] * 16                            # 20 validation users, Recall@1 0.2
CLEAR_GAIN = [1] * 10 + [0] * 10                           # +6 users, none lost: +0.3, SE 0.105
NOISE_GAIN = [1, 1, 1, 0] + [1] * 3 + [0] * 13             # +3 users, -1: +0.1, SE 0.1 (< 2 SE)
BORDER_GAIN = [1] * 8 + [0] * 12                           # +4 users, none lost: +0.2, SE 0.092 (2.18 SE)


@pytest.mark.parametrize("later,rates,best", [(CLEAR_GAIN, (1.0, 0.8, 0.8), 2), (CLEAR_GAIN, (1.0, 0.8, 0.9), 3),
                                              (NOISE_GAIN, (1.0, 0.8, 0.9), 0), (BORDER_GAIN, (1.0, 0.8, 0.9), 0)])
def test_on_policy_validation_curve_keeps_the_best_point(setup, tmp_path, later, rates, best):
  """`validate` runs before step 1, every `Validation.every` steps and at the last; `keep_best`
  returns the params of the best point (ties: the higher valid rate, then the earliest) among those
  that beat the first point by the keep bar, else the first point's. Two later points: the bar is
  z at 0.025 / 2 = 2.2414 standard errors (a normal table), so a 2.18 SE gain is not kept."""
  cfg, teacher, _, toks, lens = setup
  # Params of its own (not the fixture's `other`).
  other = jax.tree_util.tree_map(lambda x: x * 8 if x.ndim == 2 else x, qwen3.init_params(cfg, jax.random.PRNGKey(2)))
  bcfg = cfg.as_block_diffusion(4, 63)
  config = _loop_config(steps=3)
  prompts = {"prompt_ids": toks, "prompt_len": lens}

  def make_batch(p, pr, key):
    return _rollout_batch(cfg, teacher, p, pr, key)[0], {}

  seen = []
  scores = iter(zip([START_HITS, later, later], rates))   # steps 0, 2, 3 (every 2 and the last)

  def validate(p):
    seen.append(np.asarray(jax.tree_util.tree_leaves(p)[0]).copy())
    hits, v = next(scores)
    return {"valid_recall@1": float(np.mean(hits)), "valid_valid_rate": v, "valid_hits": hits}

  loss_fn = lambda p, b, rng: opd.opd_loss(bcfg, p, b, rng, block_size=4)
  state = rollouts.train_on_policy(config, str(tmp_path), params=other, loss_fn=loss_fn,
                                   make_batch=make_batch, prompt_iter=iter(lambda: dict(prompts), None),
                                   desc="curve-test", validation=loop.Validation(validate, 2, keep_best=True))
  assert [c["step"] for c in state["valid_curve"]] == [0, 2, 3] and state["best_step"] == best
  assert state["keep_bar_se"] == pytest.approx(2.2414, abs=1e-4)
  assert len(seen) == 3 and not np.allclose(seen[1], seen[2])
  np.testing.assert_array_equal(np.asarray(jax.tree_util.tree_leaves(state["params"])[0]),
                                seen[{0: 0, 2: 1, 3: 2}[best]])
  gain, se = state["valid_curve"][1]["valid_gain_over_start"], state["valid_curve"][1]["valid_gain_se"]
  d = np.asarray(later, float) - np.asarray(START_HITS, float)   # by hand: mean and SE of the pairs
  assert gain == pytest.approx(d.mean()) and se == pytest.approx(d.std(ddof=1) / np.sqrt(20))
  recs = [json.loads(l) for l in open(os.path.join(tmp_path, "metrics.jsonl"))]
  assert [r.get("valid_recall@1") for r in recs] == [None, np.mean(later), np.mean(later)]


def test_reverse_kl_and_choice_weight(setup):
  """The reverse KL and the choice-weighted loss against NumPy on the same log-probs; the teacher's
  log-prob of each rollout token against its full cache."""
  cfg, params, other, toks, lens = setup
  roll = rollouts.sample(cfg, params, toks, lens, _dc(1), jax.random.PRNGKey(5), G)
  seg = rollouts.replay_inputs(roll, 1, 63)
  batch = _batch(cfg, params, roll, seg)
  lt = np.asarray(batch["teacher_logp"], np.float64)
  ls = np.asarray(opd.log_dist(replay.replay_logits(cfg, other, roll["prompt_ids"], roll["prompt_len"], seg, 1),
                               63), np.float64)
  m = roll["loss_mask"].astype(bool)
  fwd = np.where(np.exp(lt) > 0, np.exp(lt) * (lt - ls), 0).sum(-1)
  rev = (np.exp(ls) * (ls - lt)).sum(-1)
  clean = np.asarray(seg["clean"])
  after = int(clean[0, 2])   # a token that occurs in the rollouts: the positions after it are the "choices"
  at = np.concatenate([np.zeros_like(clean[:, :1], bool), clean[:, :-1] == after], 1) & m
  assert 0 < at.sum() < m.sum()
  for w in (1.0, 5.0):
    loss, mt = opd.opd_loss(cfg, other, batch, None, block_size=1, teacher_cache="full", mask_id=63,
                            objective=opd.Objective(choice=opd.Choice(after, w)))
    wt = np.where(at, w, 1.0) * m
    np.testing.assert_allclose(float(loss), (wt * fwd).sum() / wt.sum(), rtol=1e-4)
    np.testing.assert_allclose(float(mt["kl_to_teacher"]), fwd[m].mean(), rtol=1e-4)
    np.testing.assert_allclose(float(mt["reverse_kl"]), rev[m].mean(), rtol=1e-4)
    np.testing.assert_allclose(float(mt["choice_kl"]), fwd[at].mean(), rtol=1e-4)
    assert float(mt["denominator"]) == wt.sum()
    # divergence='reverse': the same weights on the reverse KL.
    rloss, _ = opd.opd_loss(cfg, other, batch, None, block_size=1, teacher_cache="full", mask_id=63,
                            objective=opd.Objective("reverse", opd.Choice(after, w)))
    np.testing.assert_allclose(float(rloss), (wt * rev).sum() / wt.sum(), rtol=1e-4)
  with pytest.raises(ValueError, match="opd.divergence"):
    opd.opd_loss(cfg, other, batch, None, block_size=1, teacher_cache="full", mask_id=63, objective=opd.Objective("js"))
  # The reverse loss's gradient is the loss's own: its norm is the central difference along it.
  rev_loss = lambda p: opd.opd_loss(cfg, p, batch, None, block_size=1, teacher_cache="full", mask_id=63,
                                    objective=opd.Objective("reverse"))[0]
  g = jax.grad(rev_loss)(other)
  gn = optax.tree.norm(g)
  d = jax.tree_util.tree_map(lambda x: x / gn, g)
  eps = 1e-2
  plus = rev_loss(jax.tree_util.tree_map(lambda p, v: p + eps * v, other, d))
  minus = rev_loss(jax.tree_util.tree_map(lambda p, v: p - eps * v, other, d))
  np.testing.assert_allclose(float((plus - minus) / (2 * eps)), float(gn), rtol=0.05)
  # The same reverse KL scored in the step (teacher_cache 'none') as from the cache.
  _, mn = opd.opd_loss(cfg, other, {k: v for k, v in batch.items() if k != "teacher_logp"}, None, params,
                       block_size=1, teacher_cache="none", mask_id=63, teacher_config=cfg)
  np.testing.assert_allclose(float(mn["reverse_kl"]), rev[m].mean(), rtol=1e-4)

