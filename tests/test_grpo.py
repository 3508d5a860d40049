"""GRPO/DAPO: rewards, group advantages, the clipped token-level objective, and a toy update."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dgr2_jax.decode import sampler
from dgr2_jax.model import qwen3
from dgr2_jax.task import answer
from dgr2_jax.train import grpo, rollouts

CANDS = [f"<a_{i}><b_{i}><c_0><d_0>" for i in range(10)]


def _parse(order, dup=False):
  ranking = [CANDS[i] for i in order]
  if dup:
    ranking[-1] = ranking[0]
  return answer.parse_response(answer.format_response("why", ranking) + "<|im_end|>", CANDS)


def _move(target_pos, new_rank):
  """A permutation of 10 candidates putting candidate `target_pos` at 1-based `new_rank`."""
  rest = [i for i in range(10) if i != target_pos]
  return rest[:new_rank - 1] + [target_pos] + rest[new_rank - 1:]


def test_informative_valid_drops_groups_whose_only_variance_is_an_invalid_rollout():
  g = 4
  rew = np.asarray([0.2, 0.2, 0.2, -1.0,     # same valid answer, one invalid: format-only variance
                    0.4, 0.0, 0.0, -1.0,     # valid rollouts differ: kept, the invalid one included
                    -1.0, -1.0, -1.0, 0.3,   # one valid rollout: nothing to compare it with
                    0.1, 0.1, 0.1, 0.1])     # no variance at all
  valid = rew > -1.0
  adv_any, keep_any = grpo.group_advantages(rew, g)
  adv, keep = grpo.group_advantages(rew, g, valid=valid)
  # Reference: a group trains iff >= 2 valid rollouts whose rewards are not all equal.
  ref_keep = [len(set(rew[k * g:(k + 1) * g][valid[k * g:(k + 1) * g]])) > 1 for k in range(4)]
  assert ref_keep == [False, True, False, False]
  np.testing.assert_array_equal(keep, np.repeat(ref_keep, g))
  np.testing.assert_array_equal(keep_any, np.repeat([True, True, True, False], g))
  np.testing.assert_allclose(adv[4:8], adv_any[4:8])   # a kept group's advantages are unchanged
  assert adv[7] < 0 and not adv[:4].any() and not adv[8:].any()


def test_rewards_and_group_advantages_match_numpy_reference():
  n, alpha, g = 10, 0.2, 4
  # Group 0: target at rank 3 in D; outputs put it at 1, 3, 5 and one invalid (duplicate).
  # Group 1: identical valid outputs -> zero variance -> dropped.
  # Group 2: target at rank 1 in D; kept at 1 (format reward), demoted to 2, overlong, rank 4.
  parsed = [_parse(_move(2, 1)), _parse(_move(2, 3)), _parse(_move(2, 5)), _parse(_move(2, 1), dup=True),
            _parse(_move(5, 2)), _parse(_move(5, 2)), _parse(_move(5, 2)), _parse(_move(5, 2)),
            _parse(_move(0, 1)), _parse(_move(0, 2)), None, _parse(_move(0, 4))]
  r_d = [3] * 4 + [6] * 4 + [1] * 4
  got = grpo.rewards(parsed, r_d, n, alpha)
  # Independent reference: (r_D - r_o)/N + alpha*[r_o < r_D or r_D == r_o == 1]; invalid/overlong -1.
  ranks_out = [1, 3, 5, None, 2, 2, 2, 2, 1, 2, None, 4]
  ref = []
  for rd, ro in zip(r_d, ranks_out):
    ref.append(-1.0 if ro is None else (rd - ro) / n + alpha * float(ro < rd or rd == ro == 1))
  ref = np.asarray(ref)
  np.testing.assert_allclose(got, ref, atol=1e-6)
  np.testing.assert_allclose(got[:4], [0.4, 0.0, -0.2, -1.0], atol=1e-6)   # hand-computed
  np.testing.assert_allclose(got[8:], [0.2, -0.1, -1.0, -0.3], atol=1e-6)
  assert parsed[3].verdict == answer.DUPLICATE

  adv, keep = grpo.group_advantages(got, g)
  ref_adv = np.zeros(12)
  for k in range(3):
    x = ref[k * g:(k + 1) * g]
    if x.std() > 1e-6:
      ref_adv[k * g:(k + 1) * g] = (x - x.mean()) / x.std()
  np.testing.assert_allclose(adv, ref_adv, atol=1e-5)
  np.testing.assert_array_equal(keep, [True] * 4 + [False] * 4 + [True] * 4)
  assert adv[3] < 0 and adv[10] < 0            # the -1 rollouts stay in their groups
  with pytest.raises(ValueError, match="target_rank_in_D"):
    grpo.reward(parsed[0], 0, n, alpha)


@pytest.mark.parametrize("clip_high,kl_coef", [(0.2, 0.0), (0.28, 0.1)])
def test_clipped_objective_matches_numpy_reference(clip_high, kl_coef):
  rs = np.random.RandomState(0)
  b, r, lo = 6, 7, 0.2
  old = -rs.uniform(0.1, 3.0, (b, r))
  logp = old + rs.normal(0, 0.3, (b, r))
  ref_lp = old + rs.normal(0, 0.2, (b, r))
  adv = rs.normal(0, 1, b)
  mask = rs.rand(b, r) < 0.7
  mask[2, :] = False
  logp[~mask] = -1e30                      # an uncommitted position scored as the mask token
  loss, m = grpo.ppo_terms(jnp.asarray(logp, jnp.float32), jnp.asarray(old, jnp.float32), jnp.asarray(adv),
                           jnp.asarray(mask), clip_low=lo, clip_high=clip_high, kl_coef=kl_coef,
                           ref_logp=jnp.asarray(ref_lp, jnp.float32))
  tot, clip_n, rsum, klsum, cnt = 0.0, 0, 0.0, 0.0, 0
  for i in range(b):
    for t in range(r):
      if not mask[i, t]:
        continue
      rho = np.exp(logp[i, t] - old[i, t])
      a = adv[i]
      unclipped, clipped = rho * a, min(max(rho, 1 - lo), 1 + clip_high) * a
      tot += min(unclipped, clipped)
      clip_n += int(clipped < unclipped)   # the min picked the (constant) clipped term
      rsum += rho
      d = ref_lp[i, t] - logp[i, t]
      klsum += np.exp(d) - d - 1
      cnt += 1
  ref_loss = -tot / cnt + kl_coef * klsum / cnt
  np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
  np.testing.assert_allclose(float(m["clip_fraction"]), clip_n / cnt, rtol=1e-6)
  np.testing.assert_allclose(float(m["ratio_mean"]), rsum / cnt, rtol=1e-5)
  np.testing.assert_allclose(float(m["kl_ref"]), klsum / cnt, rtol=1e-4)
  assert float(m["denominator"]) == cnt and 0 < clip_n < cnt


# ---- a toy on-policy update: reward = fraction of a chosen token --------------------------------
TOKEN, G, BS, R = 7, 8, 4, 8


@pytest.fixture(scope="module")
def toy():
  from dgr2_jax.model.config import Qwen3Config
  cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                    mask_token_id=63, eos_token_id=5, pad_token_id=0).as_block_diffusion(BS, 63)
  params = qwen3.init_params(cfg, jax.random.PRNGKey(4))
  params = jax.tree_util.tree_map(lambda x: x * 3 if x.ndim == 2 else x, params)
  dc = sampler.DecodeConfig(block_size=BS, threshold=0.5, temperature=1.0, max_new_tokens=R, eos_ids=(5,),
                            mask_token_id=63, pad_id=0)
  prompts, lens = sampler.left_pad([[9, 10, 11], [12, 13, 14, 15], [16, 17], [18, 19, 20, 21, 22]], 5, 0)
  return cfg, params, dc, prompts, lens


def _toy_reward(roll):
  m = roll["loss_mask"]
  return ((roll["tokens"] == TOKEN) & m).sum(1) / np.maximum(m.sum(1), 1)


def test_grpo_update_raises_toy_reward(toy):
  cfg, params, dc, prompts, lens = toy
  loss_fn = lambda p, batch: grpo.grpo_loss(cfg, p, batch, None, block_size=BS,
                                            objective=grpo.Objective(clip_low=0.2, clip_high=0.28),
                                            temperature=1.0, mask_id=63)
  grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
  opt = optax.adam(3e-2)
  opt_state = opt.init(params)
  # Same batch shape as training (one decoder compilation); two fixed keys = 64 rollouts.
  eval_reward = lambda p: np.mean([_toy_reward(rollouts.sample(cfg, p, prompts, lens, dc, jax.random.PRNGKey(k),
                                                               G)).mean() for k in (98, 99)])
  before = eval_reward(params)
  p = params
  for step in range(6):
    roll = rollouts.sample(cfg, p, prompts, lens, dc, jax.random.PRNGKey(step), G)
    seg = rollouts.replay_inputs(roll, BS, 63)
    adv, keep = grpo.group_advantages(_toy_reward(roll), G)
    batch = dict(prompt=roll["prompt_ids"], prompt_len=roll["prompt_len"], old_logp=roll["logprob"],
                 advantages=adv, loss_mask=roll["loss_mask"] & keep[:, None],
                 **{k: seg[k] for k in rollouts.SEGMENT_KEYS})
    (loss, m), grads = grad_fn(p, batch)
    assert keep.any() and np.isfinite(float(loss))
    # Replay under the rollout's own params: every importance ratio is 1, nothing is clipped.
    np.testing.assert_allclose(float(m["ratio_mean"]), 1.0, atol=1e-4)
    assert float(m["clip_fraction"]) == 0.0
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(grads))
    updates, opt_state = opt.update(grads, opt_state, p)
    p = optax.apply_updates(p, updates)
  after = eval_reward(p)
  print('toy reward', before, after)
  assert after > before + 0.05, (before, after)


def test_kl_to_the_start_is_logged_without_changing_the_update_and_trained_on_with_kl_coef(toy):
  """grpo_loss's ref_params (the RL stages' frozen starting model): at kl_coef 0 the loss and its
  gradient are those without it and kl_ref is the k3 KL of the replayed log-probs; at kl_coef > 0
  it equals ppo_terms given the start's log-probs; under the start's own params the KL is 0."""
  cfg, start, dc, prompts, lens = toy
  # A policy one step away from the start, and rollouts sampled from it.
  moved = jax.tree_util.tree_map(lambda x: x + 0.05 * jnp.sign(jnp.sin(jnp.arange(x.size).reshape(x.shape))), start)
  roll = rollouts.sample(cfg, moved, prompts, lens, dc, jax.random.PRNGKey(7), G)
  seg = rollouts.replay_inputs(roll, BS, 63)
  adv, keep = grpo.group_advantages(_toy_reward(roll), G)
  assert keep.any()
  batch = dict(prompt=roll["prompt_ids"], prompt_len=roll["prompt_len"], old_logp=roll["logprob"],
               advantages=adv, loss_mask=roll["loss_mask"] & keep[:, None],
               **{k: seg[k] for k in rollouts.SEGMENT_KEYS})

  def run(kl_coef, ref=None):
    f = lambda p: grpo.grpo_loss(cfg, p, batch, None, ref, block_size=BS, objective=grpo.Objective(kl_coef=kl_coef),
                                 temperature=1.0, mask_id=63)
    (loss, m), grads = jax.value_and_grad(f, has_aux=True)(moved)
    return float(loss), {k: float(v) for k, v in m.items()}, grads

  flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(g)])
  loss0, m0, g0 = run(0.0)
  assert "kl_ref" not in m0
  loss1, m1, g1 = run(0.0, start)
  assert loss1 == loss0
  np.testing.assert_array_equal(flat(g1), flat(g0))
  # The k3 estimator over the loss tokens, from the two policies' replayed log-probs (numpy).
  lp = lambda p: np.asarray(replay_lp(cfg, p, batch))
  on = np.asarray(batch["loss_mask"], bool)
  d = (lp(start) - lp(moved))[on]
  np.testing.assert_allclose(m1["kl_ref"], np.mean(np.exp(d) - d - 1.0), rtol=1e-4)
  assert m1["kl_ref"] > 1e-4
  assert run(0.0, moved)[1]["kl_ref"] < 1e-6
  # Trained on: the same loss and gradient as ppo_terms given the start's log-probs, and a
  # different gradient.
  loss2, m2, g2 = run(0.1, start)
  explicit = lambda p: grpo.ppo_terms(replay_lp(cfg, p, batch), batch["old_logp"], batch["advantages"],
                                      batch["loss_mask"], kl_coef=0.1, ref_logp=lp(start))
  (loss3, _), g3 = jax.value_and_grad(explicit, has_aux=True)(moved)
  np.testing.assert_allclose(loss2, loss0 + 0.1 * m1["kl_ref"], rtol=1e-5)
  np.testing.assert_allclose(loss3, loss2, rtol=1e-5)
  np.testing.assert_allclose(flat(g3), flat(g2), rtol=1e-4, atol=1e-7)
  assert np.abs(flat(g2) - flat(g0)).max() > 1e-6
  with pytest.raises(ValueError, match="kl_coef > 0 needs the reference policy"):
    run(0.1)


def replay_lp(cfg, params, batch):
  from dgr2_jax.train import replay
  return replay.replay_logprobs(cfg, params, batch["prompt"], batch["prompt_len"],
                                {k: batch[k] for k in ("clean", "seg_tokens", "pred_seg")}, BS,
                                temperature=1.0, mask_id=63)
