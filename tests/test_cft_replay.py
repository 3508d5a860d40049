"""CFT and trajectory replay compute the decoder's function (docs/design.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgr2_jax.decode import sampler
from dgr2_jax.model import masks, qwen3, streams
from dgr2_jax.train import cft, losses, replay

PROMPTS = [[7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20], [21, 22, 23]]


def _batch(rs, b=3, p=9, r=12, vocab=60):
  lens = np.array([5, 9, 3][:b])
  prompt = np.zeros((b, p), np.int32)
  for i, n in enumerate(lens):
    prompt[i, p - n:] = rs.randint(6, vocab, n)
  resp_len = np.array([12, 7, 10][:b])
  resp = rs.randint(6, vocab, (b, r)).astype(np.int32)
  rmask = (np.arange(r)[None] < resp_len[:, None]).astype(np.int32)
  resp = np.where(rmask > 0, resp, 0)
  reas = (np.arange(r)[None] < (resp_len[:, None] - 3)).astype(np.int32) * rmask
  return dict(prompt_ids=prompt, prompt_len=lens.astype(np.int32), response_ids=resp, response_mask=rmask,
              reasoning_mask=reas, answer_mask=rmask - reas)


def test_cft_logits_equal_decoder_cache_path(tiny_lm):
  cfg, params = tiny_lm
  bs, r = 4, 12
  cfg = cfg.as_block_diffusion(bs, 63)
  batch = _batch(np.random.RandomState(0))
  resp = jnp.asarray(batch["response_ids"])
  noisy, masked, _ = cft.corrupt(jax.random.PRNGKey(0), resp, jnp.asarray(batch["response_mask"]), bs, 63, 0.1)
  nb = r // bs
  logits = streams.response_predictions(cfg, params, batch["prompt_ids"], batch["prompt_len"], resp,
                                        noisy.reshape(3, nb, bs), np.arange(nb),
                                        jnp.broadcast_to(jnp.arange(r) // bs, resp.shape), bs)
  # The decoder's path: prefill, K/V writes of clean blocks, then a forward of the canvas.
  p = batch["prompt_ids"].shape[1]
  s = p + r
  pos = masks.left_pad_positions(batch["prompt_len"], p, s)
  cache = qwen3.init_cache(cfg, 3, s)
  lg, cache = sampler.window_forward(cfg, params, jnp.asarray(batch["prompt_ids"]), 0, cache, batch["prompt_len"], p,
                                     pos)
  carry = lg[:, -1]
  checked = 0
  for j in range(nb):
    canvas = noisy[:, j * bs:(j + 1) * bs]
    lg_canvas, _ = sampler.window_forward(cfg, params, canvas, p + j * bs, cache, batch["prompt_len"], p, pos)
    dec = jnp.concatenate([carry[:, None], lg_canvas[:, :bs - 1]], axis=1)   # [b,B,V]
    m = np.asarray(masked[:, j * bs:(j + 1) * bs])
    np.testing.assert_allclose(np.asarray(logits[:, j * bs:(j + 1) * bs])[m], np.asarray(dec)[m],
                               atol=1e-5, rtol=1e-5)
    checked += m.sum()
    # The fused window the decoder uses at a block's first step gives the same canvas logits.
    if j > 0:
      prev = resp[:, (j - 1) * bs:j * bs]
      lg_f, _ = sampler.window_forward(cfg, params, jnp.concatenate([prev, canvas], 1), p + (j - 1) * bs,
                                       cache, batch["prompt_len"], p, pos)
      np.testing.assert_allclose(np.asarray(lg_f[:, bs:]), np.asarray(lg_canvas), atol=1e-5, rtol=1e-5)
    lg_clean, cache = sampler.window_forward(cfg, params, resp[:, j * bs:(j + 1) * bs], p + j * bs, cache,
                                             batch["prompt_len"], p, pos)
    carry = lg_clean[:, -1]
  assert checked >= 8


def test_cft_b1_full_mask_equals_sft(tiny_lm):
  cfg, params = tiny_lm
  batch = _batch(np.random.RandomState(1))
  kw = dict(reasoning_weight=1.0, answer_weight=3.0)
  sft, _ = losses.sft_loss(cfg, params, batch, **kw)
  for weighting in cft.WEIGHTINGS:
    loss, _ = cft.cft_loss(cfg, params, batch, jax.random.PRNGKey(0), block_size=1, mask_id=63,
                           options=cft.LossOptions(fixed_t=1.0, weighting=weighting, **kw))
    np.testing.assert_allclose(float(loss), float(sft), rtol=1e-5)
  # And with B > 1 the objective is a different function (the test above can fail).
  loss4, _ = cft.cft_loss(cfg.as_block_diffusion(4, 63), params, batch, jax.random.PRNGKey(0), block_size=4,
                          mask_id=63, options=cft.LossOptions(fixed_t=1.0, **kw))
  assert abs(float(loss4) - float(sft)) > 1e-3


def test_cft_choice_weight_equals_weighted_sft(tiny_lm):
  """`choice_weight` multiplies the weight of exactly the reasoning tokens after a ' #' token: at
  B = 1, t = 1 the loss is the SFT token loss weighted by a plain loop's weights."""
  cfg, params = tiny_lm
  batch = _batch(np.random.RandomState(2))
  hash_id = 40
  batch["response_ids"][0, [2, 6]] = hash_id      # row 0: two choices in the reasoning (tokens 3, 7)
  batch["response_ids"][1, 8] = hash_id           # row 1: after the reasoning (an answer token): not one
  batch["response_ids"][2, 10] = hash_id          # row 2: its last token (nothing after it)
  nll, _ = losses.token_nll(cfg, params, losses.response_hidden(cfg, params, batch), jnp.asarray(batch["response_ids"]))
  nll = np.asarray(nll)
  w = np.zeros_like(nll)
  for i in range(3):
    for j in range(batch["response_ids"].shape[1]):
      if not batch["response_mask"][i, j]:
        continue
      chosen = j > 0 and batch["response_ids"][i, j - 1] == hash_id and batch["reasoning_mask"][i, j]
      w[i, j] = 0.5 * 5.0 if chosen else (0.5 if batch["reasoning_mask"][i, j] else 2.0)
  assert (w == 2.5).sum() == 2
  ref = (w * nll).sum() / w.sum()
  kw = dict(fixed_t=1.0, weighting="none", reasoning_weight=0.5, answer_weight=2.0)
  loss_fn = lambda **o: cft.cft_loss(cfg, params, batch, jax.random.PRNGKey(0), block_size=1, mask_id=63,
                                     options=cft.LossOptions(**o, **kw))
  loss, _ = loss_fn(choice_weight=5.0, choice_after_id=hash_id)
  np.testing.assert_allclose(float(loss), ref, rtol=1e-5)
  plain, _ = loss_fn()
  same, _ = loss_fn(choice_weight=1.0, choice_after_id=hash_id)
  np.testing.assert_allclose(float(same), float(plain), rtol=1e-6)
  assert abs(float(loss) - float(plain)) > 1e-4


@pytest.mark.parametrize("bs,taus", [(1, (1.0,)), (4, (1.0, 0.5, 0.2)), (32, (0.9, 0.3))])
def test_replay_logprobs_equal_decode_logprobs(tiny_lm, bs, taus):
  cfg, params = tiny_lm
  r = 32
  mcfg = cfg.as_block_diffusion(bs, 63) if bs > 1 else cfg
  toks, lens = sampler.left_pad(PROMPTS, 9, 0)
  score = jax.jit(lambda prm, seg, t: replay.replay_logprobs(mcfg, prm, toks, lens, seg, bs, temperature=t,
                                                             top_k=0, top_p=1.0, mask_id=63))
  for tau in taus:
    for temp in (0.0, 1.0):
      dc = sampler.DecodeConfig(block_size=bs, threshold=tau, temperature=temp, max_new_tokens=r, eos_ids=(5,),
                                mask_token_id=63, pad_id=0, steps_per_block=0)
      out = sampler.generate(cfg, params, PROMPTS, dc, rng=jax.random.PRNGKey(11))
      seg = replay.build_segments(out["tokens"], out["commit_step"], bs, bs, 63)
      assert seg["exact"].all()
      lp = np.asarray(score(params, {k: seg[k] for k in ("clean", "seg_tokens", "pred_seg")}, temp))
      committed = out["commit_step"] >= 0
      np.testing.assert_allclose(lp[committed], out["logprob"][committed], atol=1e-5)
      # The importance ratio before any update is exactly 1.
      np.testing.assert_allclose(np.exp(lp - out["logprob"])[committed], 1.0, atol=1e-4)


def test_replay_merging_bounds_segments_and_flags_rows(tiny_lm):
  cfg, params = tiny_lm
  dc = sampler.DecodeConfig(block_size=8, threshold=1.0, max_new_tokens=16, eos_ids=(), mask_token_id=63, pad_id=0)
  out = sampler.generate(cfg, params, PROMPTS, dc)
  seg = replay.build_segments(out["tokens"], out["commit_step"], 8, 2, 63)
  assert seg["seg_tokens"].shape == (3, 4, 8) and not seg["exact"].any()
  seg_full = replay.build_segments(out["tokens"], out["commit_step"], 8, 8, 63)
  assert seg_full["exact"].all()


def test_build_segments_handcrafted_schedule():
  # Block 0 committed in 2 steps (0: idx 0,2; 1: idx 1,3); block 1 in 3 steps, idx 3 never (after EOS).
  tokens = np.array([[10, 11, 12, 13, 20, 21, 22, 63]])
  cs = np.array([[0, 1, 0, 1, 2, 4, 3, -1]])
  seg = replay.build_segments(tokens, cs, 4, 4, 63)
  m = 63
  np.testing.assert_array_equal(seg["seg_tokens"][0, 0], [m, m, m, m])        # block 0, step 0
  np.testing.assert_array_equal(seg["seg_tokens"][0, 1], [10, m, 12, m])      # block 0, step 1
  np.testing.assert_array_equal(seg["seg_tokens"][0, 4], [m, m, m, m])        # block 1, step 2
  np.testing.assert_array_equal(seg["seg_tokens"][0, 5], [20, m, m, m])       # block 1, step 3
  np.testing.assert_array_equal(seg["seg_tokens"][0, 6], [20, m, 22, m])      # block 1, step 4
  np.testing.assert_array_equal(seg["pred_seg"][0], [0, 1, 0, 1, 4, 6, 5, 0])
  np.testing.assert_array_equal(seg["clean"][0], [10, 11, 12, 13, 20, 21, 22, m])
  assert seg["exact"].all()
  merged = replay.build_segments(tokens, cs, 4, 2, 63)   # block 1's 3 steps -> 2 groups
  np.testing.assert_array_equal(merged["pred_seg"][0], [0, 1, 0, 1, 2, 3, 2, 0])
  np.testing.assert_array_equal(merged["seg_tokens"][0, 2], [m, m, m, m])    # steps 2+3: canvas of step 2
  np.testing.assert_array_equal(merged["seg_tokens"][0, 3], [20, m, 22, m])  # step 4
  assert not merged["exact"].any()


def test_segment_attention_equals_dense_mask(tiny_lm):
  # qwen3.segment_attention (what every scorer uses) against the plain [N,N]-masked softmax, with
  # left-padded prompts and blocks holding different numbers of canvases.
  cfg, params = tiny_lm
  bs, r = 4, 12
  cfg = cfg.as_block_diffusion(bs, 63)
  batch = _batch(np.random.RandomState(3))
  rs = np.random.RandomState(4)
  seg_block = np.array([0, 0, 0, 1, 2, 2])
  seg_tokens = jnp.asarray(rs.randint(6, 64, (3, len(seg_block), bs)), jnp.int32)
  pred_seg = jnp.asarray(rs.randint(0, len(seg_block), (3, r)), jnp.int32)
  args = (cfg, params, batch["prompt_ids"], batch["prompt_len"], jnp.asarray(batch["response_ids"]), seg_tokens,
          seg_block, pred_seg, bs)
  seg = np.asarray(streams.response_predictions(*args))
  dense = np.asarray(streams.response_predictions(*args, dense_mask=True))
  np.testing.assert_allclose(seg, dense, atol=1e-5, rtol=1e-5)
  assert np.abs(seg).max() > 1.0


def test_widened_segments_replay_the_same_logprobs(tiny_lm):
  """Dynamic sampling stacks draws whose replays hold different caps: a layout widened to a larger
  cap (replay.widen_segments) scores every committed token as the original does, and equals the
  layout build_segments makes at that cap."""
  cfg, params = tiny_lm
  bs, r = 8, 16
  mcfg = cfg.as_block_diffusion(bs, 63)
  toks, lens = sampler.left_pad(PROMPTS, 9, 0)
  dc = sampler.DecodeConfig(block_size=bs, threshold=0.9, temperature=1.0, max_new_tokens=r, eos_ids=(5,),
                            mask_token_id=63, pad_id=0, steps_per_block=2)   # <= 2 steps a block: cap 2
  out = sampler.generate(cfg, params, PROMPTS, dc, rng=jax.random.PRNGKey(3))
  seg = replay.build_segments(out["tokens"], out["commit_step"], bs, bs, 63)
  cap = seg["seg_tokens"].shape[1] // (r // bs)
  assert cap < bs, "the schedule must leave room to widen"
  wide, pred = replay.widen_segments(seg["seg_tokens"], seg["pred_seg"], r, bs)
  assert wide.shape == (3, (r // bs) * bs, bs)
  committed = out["commit_step"] >= 0
  lp = lambda s: np.asarray(replay.replay_logprobs(mcfg, params, toks, lens, s, bs, temperature=1.0, top_k=0,
                                                   top_p=1.0, mask_id=63))
  base = lp({k: seg[k] for k in ("clean", "seg_tokens", "pred_seg")})
  np.testing.assert_allclose(lp({"clean": seg["clean"], "seg_tokens": wide, "pred_seg": pred})[committed],
                             base[committed], atol=1e-6)
  np.testing.assert_allclose(base[committed], out["logprob"][committed], atol=1e-5)
  # The segments that predict: those of build_segments' own layout at the wider cap.
  for b in range(3):
    for i in np.flatnonzero(committed[b]):
      j, m = divmod(int(seg["pred_seg"][b, i]), cap)
      assert pred[b, i] == j * bs + m
      np.testing.assert_array_equal(wide[b, pred[b, i]], seg["seg_tokens"][b, seg["pred_seg"][b, i]])
  with pytest.raises(ValueError, match="cap"):
    replay.widen_segments(wide, pred, r, 1)
