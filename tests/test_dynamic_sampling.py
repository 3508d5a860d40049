"""DAPO's dynamic sampling in the RL stages (train/rollouts.py `DynamicSampling`): one draw is the
plain step, a draw without reward variance is followed by another whose groups are trained on, the
stop rule, exact resumption, the config checks, and 2 processes computing what 1 computes.

The toy run (tests/rl_toy.py): a random tiny block-diffusion model, 16 prompts, 2 per draw, G = 4;
prompts named `dead` get a constant reward (no variance), the others one that always varies.
"""

import json
import os
import sys

import jax
import ml_collections
import numpy as np
import pytest

import multiprocess_harness as mph
import rl_toy
from dgr2_jax.train import grpo, loop, rollouts


def _records(workdir) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def _leaves(state):
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.device_get(state["params"]))]


def _plain_step_batches(make_batch, prompt_iter, seed):
  """The on-policy step source as it was before dynamic sampling (one draw per step): the
  reference one draw must equal exactly."""
  root = jax.random.PRNGKey(int(seed) + 1)

  def make(params, step):
    batch, host_m = make_batch(params, next(prompt_iter), jax.random.fold_in(root, step))
    skip = not np.asarray(batch["loss_mask"]).any()
    return None if skip else batch, dict(host_m, update_skipped=float(skip))

  return loop.StepBatches(make, prompt_iter)


def test_one_draw_is_the_plain_step(tmp_path):
  dead = rl_toy.first_batches(2)[1]   # step 2 has no variance: a skipped update is compared too
  state = rl_toy.train(str(tmp_path / "one"), steps=3, draws=1, target=rl_toy.PPS, dead=dead)
  cfg, params = rl_toy.model()
  ref = loop.train(rl_toy.loop_config(3, rl_toy.PPS * rl_toy.G), str(tmp_path / "ref"), params=params,
                   loss_fn=rl_toy.loss_fn(cfg), desc="ref",
                   step_batches=_plain_step_batches(rl_toy.make_batch_fn(cfg, dead), rl_toy.prompt_iter(), 0))
  for a, b in zip(_leaves(state), _leaves(ref)):
    np.testing.assert_array_equal(a, b)
  got, want = _records(tmp_path / "one"), _records(tmp_path / "ref")
  assert [r["update_skipped"] for r in got] == [0.0, 1.0, 0.0]
  for g, w in zip(got, want):
    for k in set(w) - {"time", "update_time_s", "steps_per_sec"}:
      assert g[k] == w[k], (k, g[k], w[k])
  assert "draws" not in got[0]   # one draw: the plain step's metrics


def test_a_draw_without_variance_draws_again(tmp_path):
  """Draw 1's groups have no variance, draw 2's all do: the step stops after draw 2 and its batch is
  draw 2's groups (draw 1 and the undrawn draw 3 masked); the loss and gradient are draw 2's alone."""
  first, second, _ = rl_toy.first_batches(3)
  cfg, params = rl_toy.model()
  seen = []
  make_batch = rl_toy.make_batch_fn(cfg, dead=first, seen=seen)
  it = rl_toy.prompt_iter()
  src = rollouts.on_policy_batches(make_batch, it, 0, rollouts.DynamicSampling(3, rl_toy.PPS, rl_toy.G))
  batch, m = src.make(params, 1)
  assert seen == [first, second]
  assert (m["draws"], m["informative_groups"], m["informative_fraction"], m["update_skipped"]) == (2, 2, 0.5, 0)
  np.testing.assert_allclose(m["groups_dropped"], 0.5)
  rows = rl_toy.PPS * rl_toy.G
  assert batch["loss_mask"].shape[0] == 3 * rows
  drawn = lambda k, d: rollouts.draw_rows(batch[k], d, 3)   # the batch's rows are interleaved by draw
  assert not drawn("loss_mask", 0).any() and not drawn("loss_mask", 2).any()
  # Draw 2 made on its own: the same prompts and key (fold_in(step key, 1)) give the same rows.
  key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(1), 1), 1)
  alone, _ = make_batch(params, _rows(second), key)
  for k, v in alone.items():
    np.testing.assert_array_equal(drawn(k, 1), v, err_msg=k)
  assert alone["loss_mask"].any()
  # The iterator's position covers both draws: the next batch it gives is the third.
  assert [int(i) for i in next(it)["example_id"]] == rl_toy.first_batches(3)[2]
  grad = jax.jit(jax.value_and_grad(rl_toy.loss_fn(cfg), has_aux=True))
  (l_all, m_all), g_all = grad(params, batch, None)
  (l_one, m_one), g_one = grad(params, alone, None)
  np.testing.assert_allclose(float(l_all), float(l_one), rtol=1e-6, atol=1e-7)
  assert float(m_all["denominator"]) == float(m_one["denominator"]) == alone["loss_mask"].sum()
  for a, b in zip(jax.tree_util.tree_leaves(g_all), jax.tree_util.tree_leaves(g_one)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def _rows(ids) -> dict:
  p = rl_toy.prompts()
  return {k: v[np.asarray(ids)] for k, v in p.items()}


@pytest.mark.parametrize("draws,target,dead_of,want", [
    (4, 2, (0, 1), 3),        # informative groups per draw 0, 0, 2: the target is reached at draw 3
    (4, 3, (0,), 3),          # 0, 2, 2: 2 < 3 after draw 2, 4 >= 3 after draw 3
    (4, 1, (), 1),            # the first draw suffices
    (3, 6, (), 3),            # 2, 2, 2: reached at the last draw
    (2, 4, (1,), 2),          # 2, 0: never reached, the cap stops the step (and it trains on 2 groups)
    (2, 2, (0, 1), 2),        # no draw has variance: every draw made, and no update
])
def test_stop_rule(draws, target, dead_of, want):
  batches = rl_toy.first_batches(draws)
  dead = [i for b in dead_of if b < draws for i in batches[b]]
  cfg, params = rl_toy.model()
  src = rollouts.on_policy_batches(rl_toy.make_batch_fn(cfg, dead), rl_toy.prompt_iter(), 0,
                                   rollouts.DynamicSampling(draws, target, rl_toy.G))
  batch, m = src.make(params, 1)
  informative = sum(rl_toy.PPS for d in range(int(m["draws"])) if d not in dead_of)
  assert m["draws"] == want and m["informative_groups"] == informative
  np.testing.assert_allclose(m["informative_fraction"], informative / (want * rl_toy.PPS))
  assert (batch is None) == (informative == 0) == bool(m["update_skipped"])
  if batch is not None:
    per_draw = [rollouts.draw_rows(batch["loss_mask"], d, draws) for d in range(draws)]
    assert sum(rollouts.informative_groups(x, rl_toy.G) for x in per_draw) == informative


def test_resume_replays_the_same_draws(tmp_path):
  """Killed after step 1 (which drew twice) and resumed: step 2 draws the prompts an uninterrupted
  run draws, and the run ends with the same params."""
  dead = rl_toy.first_batches(1)[0]
  full_seen, seen = [], []
  full = rl_toy.train(str(tmp_path / "full"), steps=2, draws=3, target=rl_toy.PPS, dead=dead, seen=full_seen)
  rl_toy.train(str(tmp_path / "part"), steps=1, draws=3, target=rl_toy.PPS, dead=dead, seen=seen)
  assert seen == full_seen[:2]   # step 1: two draws
  resumed = rl_toy.train(str(tmp_path / "part"), steps=2, draws=3, target=rl_toy.PPS, dead=dead, seen=seen)
  assert seen == full_seen and len(seen) == 3
  for a, b in zip(_leaves(resumed), _leaves(full)):
    np.testing.assert_array_equal(a, b)
  recs = _records(tmp_path / "full")
  assert [r["draws"] for r in recs] == [2, 1] and all(r["update_skipped"] == 0 for r in recs)


def test_config_checks():
  def cfg(**kw):
    c = ml_collections.ConfigDict({"rl": grpo.rl_config()})
    c.rl.init_from = "/x"
    c.rl.update(kw)
    return c
  grpo._validate_sampling(cfg(dynamic_sampling=4, min_informative_groups=64), "rl")   # 4 x 16
  assert grpo.sampling_settings(cfg().rl) == (1, 16)
  assert grpo.sampling_settings(cfg(dynamic_sampling=4, min_informative_groups=5).rl) == (4, 5)
  with pytest.raises(ValueError, match=r"^config.rl.dynamic_sampling: must be an int >= 1"):
    grpo._validate_sampling(cfg(dynamic_sampling=0), "rl")
  with pytest.raises(ValueError, match=r"^config.rl.min_informative_groups: must be an int in \[0, "
                                       r"dynamic_sampling x prompts_per_step = 32\]"):
    grpo._validate_sampling(cfg(dynamic_sampling=2, min_informative_groups=33), "rl")


def test_two_processes_equal_one(tmp_path):
  """A 2-step run whose first step draws twice (its first draw has no variance): 2 processes x 1
  device give the draws, metrics and params of 1 process x 2 devices (mesh data 2)."""
  out = {}
  for n, k in ((1, 2), (2, 1)):
    name = f"{n}x{k}"
    mph.check(mph.launch(n, k, [sys.executable, "tests/mp_rl_worker.py", f"--workdir={tmp_path / name}",
                                f"--out={tmp_path / name}.npz"], timeout=600))
    out[name] = np.load(f"{tmp_path / name}.npz")
  one, two = out["1x2"], out["2x1"]
  assert int(one["processes"]) == 1 and int(two["processes"]) == 2
  np.testing.assert_array_equal(one["draws"], [2, 1])
  np.testing.assert_array_equal(two["draws"], one["draws"])
  np.testing.assert_array_equal(two["informative_groups"], one["informative_groups"])
  np.testing.assert_allclose(two["loss"], one["loss"], atol=1e-5, rtol=0)
  np.testing.assert_allclose(two["reward_mean"], one["reward_mean"], atol=1e-6, rtol=0)
  keys = [f for f in one.files if f.startswith("param/")]
  assert keys and sorted(keys) == sorted(f for f in two.files if f.startswith("param/"))
  worst = max(float(np.max(np.abs(one[f] - two[f]))) for f in keys)
  assert worst <= 1e-5, worst


@pytest.mark.parametrize("micro_per_draw", [1, 2])
def test_padded_draws_fill_whole_micro_batches(micro_per_draw):
  """Each micro-batch of the update (loop._split_micro over draws x micro_per_draw) holds one draw's
  rows, exactly the rows that micro-batch would hold with one draw; draw_rows undoes the order."""
  rows, draws = 8, 3
  made = [{"x": np.arange(rows) + 100 * d, "loss_mask": np.ones((rows, 2))} for d in range(2)]
  batch = rollouts._pad_draws(made, draws, micro_per_draw)
  k = draws * micro_per_draw
  micro = np.swapaxes(batch["x"].reshape(-1, k), 0, 1)          # loop._split_micro
  alone = np.swapaxes(made[1]["x"].reshape(-1, micro_per_draw), 0, 1)
  for i in range(k):
    d, m = divmod(i, micro_per_draw)
    assert set(micro[i] // 100) == {0 if d == 2 else d}
    if d == 1:
      np.testing.assert_array_equal(micro[i], alone[m])
  np.testing.assert_array_equal(rollouts.draw_rows(batch["x"], 1, draws, micro_per_draw), made[1]["x"])
  assert not rollouts.draw_rows(batch["loss_mask"], 2, draws, micro_per_draw).any()


def test_draws_with_different_replay_caps_stack():
  """A draw whose blocks took more steps replays with more segments per block: the step's draws
  are widened to the largest cap (same predictions, tests/test_cft_replay.py) before stacking; a
  field whose shapes differ otherwise is one clear error."""
  r, bs, rows = 16, 8, 4
  def draw(cap, fill):
    return {"clean": np.zeros((rows, r), np.int32), "seg_tokens": np.full((rows, 2 * cap, bs), fill, np.int32),
            "pred_seg": np.tile(np.repeat(np.arange(2) * cap, bs), (rows, 1)).astype(np.int32),
            "loss_mask": np.ones((rows, r))}
  batch = rollouts._pad_draws([draw(2, 1), draw(4, 2)], 3)
  assert batch["seg_tokens"].shape == (3 * rows, 8, bs)
  first = rollouts.draw_rows(batch["pred_seg"], 0, 3)
  np.testing.assert_array_equal(first, np.tile(np.repeat([0, 4], bs), (rows, 1)))
  np.testing.assert_array_equal(rollouts.draw_rows(batch["seg_tokens"], 0, 3)[:, [0, 4]], 1)
  bad = [draw(2, 1), dict(draw(2, 1), loss_mask=np.ones((rows, r + 1)))]
  with pytest.raises(ValueError, match="'loss_mask' has shapes"):
    rollouts._pad_draws(bad, 2)
