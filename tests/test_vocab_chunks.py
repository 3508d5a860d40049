"""Vocabulary-sized terms in chunks of positions equal the unchunked ones, the OPD teacher scored in
the step equals its cache, and gradient accumulation of OPD and RL equals the one-batch step.

Unchunked = every position in one chunk (the tiny vocabulary fits); chunked = `logits_chunk=5`,
several chunks and a padded last one. At Qwen3's vocabulary the compiled memory plan of a loss
stays far below one [tokens, V] f32 array (checked from shapes, nothing allocated).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dgr2_jax.decode import sampler
from dgr2_jax.model import qwen3
from dgr2_jax.model.config import Qwen3Config
from dgr2_jax.train import cft, grpo, loop, losses, opd, replay, rollouts

PROMPTS = [[7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20], [21, 22, 23]]
R, G, BS = 16, 2, 4


def _close(a, b, what):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5, rtol=1e-5, err_msg=what)


def _value_and_grad(fn, params):
  return jax.jit(jax.value_and_grad(fn, has_aux=True))(params)


@pytest.fixture(scope="module")
def data(tiny_lm):
  cfg, params = tiny_lm
  bcfg = cfg.as_block_diffusion(BS, 63)
  toks, lens = sampler.left_pad(PROMPTS, 9, 0)
  dc = sampler.DecodeConfig(block_size=BS, threshold=0.5, temperature=1.0, max_new_tokens=R, eos_ids=(5,),
                            mask_token_id=63, pad_id=0)
  roll = rollouts.sample(bcfg, params, toks, lens, dc, jax.random.PRNGKey(3), G)
  seg = rollouts.replay_inputs(roll, BS, 63)
  teacher = jax.tree_util.tree_map(lambda x: x * 0.7, params)
  base = dict(prompt=roll["prompt_ids"], prompt_len=roll["prompt_len"], loss_mask=roll["loss_mask"],
              **{k: seg[k] for k in rollouts.SEGMENT_KEYS})
  sft_batch = {"prompt_ids": roll["prompt_ids"], "prompt_len": roll["prompt_len"],
               "response_ids": seg["clean"], "response_mask": roll["loss_mask"],
               "reasoning_mask": np.arange(R)[None] < 6 + 0 * roll["loss_mask"],
               "answer_mask": np.arange(R)[None] >= 6 + 0 * roll["loss_mask"]}
  return cfg, bcfg, params, teacher, roll, base, sft_batch


def test_chunked_losses_equal_unchunked(data):
  cfg, bcfg, params, teacher, roll, base, sft_batch = data
  chunked = lambda c: c.replace(logits_chunk=5)
  n = sft_batch["response_ids"].size
  assert n % 5 and n > 5 * 4  # several chunks and a padded last one
  cases = {
      "sft": lambda c: lambda p: losses.sft_loss(c, p, sft_batch, reasoning_weight=0.5),
      "cft": lambda c: lambda p: cft.cft_loss(c.as_block_diffusion(BS, 63), p, sft_batch, jax.random.PRNGKey(1),
                                              block_size=BS, mask_id=63),
      "replay_logprobs (RL)": lambda c: lambda p: (
          jnp.sum(replay.replay_logprobs(c.as_block_diffusion(BS, 63), p, base["prompt"], base["prompt_len"],
                                         {k: base[k] for k in rollouts.SEGMENT_KEYS}, BS, temperature=0.7,
                                         top_k=20, top_p=0.9, mask_id=63) * base["loss_mask"]), {}),
  }
  for mode, k in (("full", 0), ("topk", 8)):
    cache = opd.ar_teacher_cache(cfg, teacher, base["prompt"], base["prompt_len"], base["clean"], top_k=k, mask_id=63)
    chunked_cache = opd.ar_teacher_cache(chunked(cfg), teacher, base["prompt"], base["prompt_len"], base["clean"],
                                         top_k=k, mask_id=63)
    _close(chunked_cache, cache, f"teacher cache {mode}")
    b = dict(base, **{n_: np.asarray(v) for n_, v in cache.items()})
    cases[f"opd {mode}"] = (lambda b_, m_: lambda c: lambda p: opd.opd_loss(
        c.as_block_diffusion(BS, 63), p, b_, block_size=BS, teacher_cache=m_))(b, mode)
  cases["opd none"] = lambda c: lambda p: opd.opd_loss(c.as_block_diffusion(BS, 63), p, base, None, teacher,
                                                      block_size=BS, teacher_cache="none", teacher_config=c)
  for name, make in cases.items():
    (v0, m0), g0 = _value_and_grad(make(cfg), params)
    (v1, m1), g1 = _value_and_grad(make(chunked(cfg)), params)
    assert np.isfinite(float(v0)) and abs(float(v0)) > 1e-6, name
    _close((v1, m1), (v0, m0), name)
    _close(g1, g0, name + " (gradient)")


def test_teacher_scored_in_the_step_equals_its_full_cache(data):
  cfg, bcfg, params, teacher, roll, base, _ = data
  cache = opd.ar_teacher_cache(cfg, teacher, base["prompt"], base["prompt_len"], base["clean"], mask_id=63)
  full = lambda p: opd.opd_loss(bcfg, p, dict(base, **cache), block_size=BS, teacher_cache="full")
  online = lambda p: opd.opd_loss(bcfg, p, base, None, teacher, block_size=BS, teacher_cache="none",
                                  teacher_config=cfg)
  (v0, m0), g0 = _value_and_grad(full, params)
  (v1, m1), g1 = _value_and_grad(online, params)
  assert float(v0) > 1e-3
  _close((v1, m1), (v0, m0), "online teacher")
  _close(g1, g0, "online teacher (gradient)")
  with pytest.raises(ValueError, match="teacher_cache"):
    opd.opd_loss(bcfg, params, base, block_size=BS, teacher_cache="nope")


def _one_step(loss_fn, params, batch, k, frozen=None):
  # Plain SGD with lr 1, so the parameter change is the gradient itself (Adam would amplify the
  # last-bit differences of near-zero gradients).
  opt, sched = optax.sgd(1.0), optax.constant_schedule(1.0)
  state = {"params": params, "opt_state": opt.init(params), "step": jnp.int32(0), "rng": jax.random.PRNGKey(0)}
  step = loop.make_train_step(loss_fn, opt, sched, k, with_frozen=frozen is not None)
  fn = jax.jit(step) if frozen is None else jax.jit(lambda s, b: step(s, b, frozen))
  state, m = fn(state, batch)
  return jax.device_get(state["params"]), jax.device_get(m)


@pytest.mark.parametrize("name", ["opd", "rl", "rl with the KL to its start"])
def test_grad_accumulation_over_rollout_micro_batches_equals_one_batch(data, name):
  """prompts x rollouts is a global batch: 3 micro-batches of 2 rollouts == one batch of 6 (the
  loss normaliser is the global token count); also with RL's frozen start scored in the step."""
  cfg, bcfg, params, teacher, roll, base, _ = data
  if name == "opd":
    loss_fn = lambda p, b, rng, t: opd.opd_loss(bcfg, p, b, rng, t, block_size=BS, teacher_cache="none",
                                                teacher_config=cfg)
    batch, frozen = base, teacher
  else:
    adv, keep = grpo.group_advantages(np.asarray([0.1, 0.5, -1.0, 0.3, 0.2, 0.9], np.float32), G)
    batch = dict(base, old_logp=roll["logprob"], advantages=adv, loss_mask=base["loss_mask"] & keep[:, None])
    if name == "rl":
      loss_fn = lambda p, b, rng: grpo.grpo_loss(bcfg, p, b, rng, block_size=BS, temperature=1.0, mask_id=63)
      frozen = None
    else:  # the start: other weights than the trained ones, so the KL term is not zero
      loss_fn = lambda p, b, rng, ref: grpo.grpo_loss(bcfg, p, b, rng, ref, block_size=BS, temperature=1.0,
                                                      mask_id=63, objective=grpo.Objective(kl_coef=0.5))
      frozen = jax.tree_util.tree_map(lambda x: x * 1.1, params)
  # Rows of unequal token counts, so an unweighted mean of micro-batch losses would differ (cut
  # here rather than left to where the sampled rollouts happen to stop).
  counted = np.arange(R)[None] < np.asarray([R, 9, 12, 5, R, 7])[:, None]
  batch = dict(batch, loss_mask=np.asarray(batch["loss_mask"]) & counted)
  assert len(set(np.asarray(batch["loss_mask"]).sum(1).tolist())) > 2
  p1, m1 = _one_step(loss_fn, params, batch, 1, frozen)
  p3, m3 = _one_step(loss_fn, params, batch, 3, frozen)
  np.testing.assert_allclose(m3["loss"], m1["loss"], rtol=1e-5, atol=1e-7)
  _close(p3, p1, name)
  moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
              for a, b in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(params)))
  assert moved > 1e-4


def test_loss_memory_at_qwen3_vocabulary_is_a_few_chunks():
  """Compiled (not run) value-and-grad of the SFT, CFT, OPD and RL losses at V = 152,961 with a tiny
  width: XLA's temporary memory is a few chunks of logits, not the [tokens, V] arrays the same
  loss in one chunk plans for."""
  v, b, p, r, chunk = 152_961, 2, 64, 512, 64
  cfg = Qwen3Config(vocab_size=v, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, tie_word_embeddings=True, mask_token_id=v - 1,
                    eos_token_id=5, pad_token_id=0)
  shapes = qwen3.param_shapes(cfg)
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  sft_b = {"prompt_ids": i32(b, p), "prompt_len": i32(b), "response_ids": i32(b, r), "response_mask": f32(b, r),
           "reasoning_mask": f32(b, r), "answer_mask": f32(b, r)}
  opd_b = {"prompt": i32(b, p), "prompt_len": i32(b), "clean": i32(b, r), "seg_tokens": i32(b, r // 32, 32),
           "pred_seg": i32(b, r), "loss_mask": f32(b, r)}

  def fns(c):
    bc = c.as_block_diffusion(32, v - 1)
    return {"sft": (lambda prm, bt: losses.sft_loss(c, prm, bt), sft_b),
            "cft": (lambda prm, bt: cft.cft_loss(bc, prm, bt, jax.random.PRNGKey(0), block_size=32, mask_id=v - 1),
                    sft_b),
            "opd (teacher in the step)": (lambda prm, bt: opd.opd_loss(bc, prm, bt, None, prm, block_size=32,
                                                                       teacher_cache="none", teacher_config=c), opd_b),
            "rl (its start in the step)": (lambda prm, bt: grpo.grpo_loss(bc, prm, bt, None, prm, block_size=32,
                                                                          objective=grpo.Objective(kl_coef=0.1)),
                                           dict(opd_b, old_logp=f32(b, r), advantages=f32(b)))}

  def temp(fn, batch):
    return jax.jit(jax.value_and_grad(fn, has_aux=True)).lower(shapes, batch).compile().memory_analysis(
        ).temp_size_in_bytes

  chunk_array = chunk * v * 4
  for (name, (fn, batch)), (_, (fn1, _)) in zip(fns(cfg.replace(logits_chunk=chunk)).items(),
                                                fns(cfg.replace(logits_chunk=b * r)).items()):
    chunked, whole = temp(fn, batch), temp(fn1, batch)
    assert chunked < 12 * chunk_array, (name, chunked / 2**20)
    assert whole > 4 * chunked, (name, whole / 2**20, chunked / 2**20)
