"""Host round trips of the decoders, read from the compiled program, and `decode.steps_per_sync`
changing nothing but how often the host looks."""

import jax
import numpy as np
import pytest

from dgr2_jax.decode import hlo_loops, reference, sampler, speculative

PROMPTS = [[7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20], [21, 22, 23]]  # mixed lengths
R = 16
OUT_KEYS = ("tokens", "commit_step", "nfe", "steps", "eos_pos", "forward_passes")


def _dc(bs, tau, **kw):
  return sampler.DecodeConfig(block_size=bs, threshold=tau, max_new_tokens=R, mask_token_id=63, pad_id=0, **kw)


def _args(params, dc):
  toks, lens = sampler.left_pad(PROMPTS, max(map(len, PROMPTS)), dc.pad_id)
  return (params, toks, lens, np.float32(dc.threshold), np.float32(dc.temperature), np.int32(dc.top_k),
          np.float32(dc.top_p), np.zeros((2,), np.uint32), np.int32(dc.steps_per_block))


def _decode_loop(fn, args):
  """(the loop whose predicate reaches the host, every loop) of a compiled decoder."""
  loops = hlo_loops.loops(fn.lower(*args).compile().as_text())
  unknown = [l for l in loops if l.trip_count is None]
  assert len(unknown) == 1, [(l.name, l.trip_count) for l in loops]
  return unknown[0], {l.name: l for l in loops}


@pytest.mark.parametrize("bs,kv_write,temp", [(1, "fused", 0.0), (4, "fused", 0.8), (4, "separate", 0.0)])
def test_one_host_predicate_per_k_steps_in_the_compiled_decoder(tiny_lm, bs, kv_write, temp):
  """The optimised HLO holds one while loop of data-dependent trip count (the only predicate the
  host reads), no conditional inside it, and the forward inside a loop of static trip count k."""
  cfg, params = tiny_lm
  k = 8
  dc = _dc(bs, 0.5, eos_ids=(5,), kv_write=kv_write, temperature=temp, steps_per_sync=k)
  _, fn = sampler.decoder_for(cfg, dc)
  outer, loops = _decode_loop(fn, _args(params, dc))
  assert outer.conditionals == 0, "a cond/switch inside the decode loop is a host round trip per step"
  assert outer.dots > 0
  assert all(loops[n].trip_count is not None for n in outer.inner)
  steps = [loops[n] for n in outer.inner if loops[n].trip_count == k and loops[n].dots > 0]
  assert len(steps) == 1 and steps[0].dots == outer.dots, "the forward runs in the k-step inner loop"
  if temp > 0:  # the same reading finds the per-step switch of a decoder whose route is left to the device
    legacy = sampler.compiled_decoder(sampler.model_for_decoding(cfg, dc), bs, R, (5,), 63, kv_write, None, k)
    assert _decode_loop(legacy, _args(params, dc))[0].conditionals > 0


def test_speculative_loop_keeps_only_the_verification_cond(tiny_lm):
  cfg, params = tiny_lm
  k = 4
  dc = _dc(4, 0.3, eos_ids=(5,), kv_write="fused", steps_per_sync=k)
  fn = speculative.decoder_for(cfg, cfg, dc)
  toks, lens = sampler.left_pad(PROMPTS, 9, 0)
  args = (params, params, toks, lens, np.float32(0.3), np.float32(0), np.int32(0), np.float32(1),
          np.zeros((2,), np.uint32), np.int32(0))
  outer, loops = _decode_loop(fn, args)
  assert outer.conditionals == 1, "the drafter runs unconditionally; the verifier under one cond"
  steps = [loops[n] for n in outer.inner if loops[n].trip_count == k]
  assert len(steps) == 1 and steps[0].conditionals == 1 and steps[0].dots == outer.dots


@pytest.mark.parametrize("bs,kv_write,temp", [(1, "fused", 0.0), (4, "separate", 0.8)])
def test_steps_per_sync_changes_no_result(tiny_lm, bs, kv_write, temp):
  """k in {1, 3, 8}: the same tokens, commit steps, NFE and forward passes, equal to the
  reference; the masked tail is below k and completes the last group of k steps."""
  cfg, params = tiny_lm
  free = sampler.generate(cfg, params, PROMPTS, _dc(bs, 0.3, eos_ids=(), kv_write=kv_write))
  eos = int(free["tokens"][1, 5])   # some rows stop early, at different steps
  key = jax.random.PRNGKey(3)
  outs = {}
  for k in (1, 3, 8):
    dc = _dc(bs, 0.3, eos_ids=(eos,), kv_write=kv_write, temperature=temp, steps_per_sync=k)
    outs[k] = out = sampler.generate(cfg, params, PROMPTS, dc, rng=key)
    loop_steps = int(out["forward_passes"]) + int(out["masked_steps"])
    assert 0 <= int(out["masked_steps"]) < k and loop_steps % k == 0, (k, loop_steps)
  assert len({len(o) for o in outs[1]["output_ids"]}) > 1, "rows should stop at different places"
  assert int(outs[1]["masked_steps"]) == 0
  assert int(outs[8]["masked_steps"]) > 0, "8 should not divide this run's steps: a masked tail"
  for k in (3, 8):
    for name in OUT_KEYS:
      np.testing.assert_array_equal(outs[k][name], outs[1][name], err_msg=f"{name} k={k}")
    np.testing.assert_allclose(outs[k]["logprob"], outs[1]["logprob"], atol=1e-6)
  ref = reference.reference_decode(cfg, params, PROMPTS, _dc(bs, 0.3, eos_ids=(eos,), kv_write=kv_write,
                                                              temperature=temp), rng=key)
  for name in ("tokens", "commit_step", "nfe", "steps"):
    np.testing.assert_array_equal(outs[3][name], ref[name], err_msg=name)
  np.testing.assert_allclose(outs[3]["logprob"], ref["logprob"], atol=1e-5)


def test_steps_per_sync_is_validated():
  with pytest.raises(ValueError, match="steps_per_sync"):
    _dc(4, 0.5, steps_per_sync=0)


def test_speculative_steps_per_sync_changes_no_result(tiny_lm):
  cfg, params = tiny_lm
  verifier = jax.tree_util.tree_map(lambda x: x * 1.5, params)
  outs = {}
  for k in (1, 3):
    dc = _dc(4, 0.2, eos_ids=(5,), kv_write="separate", steps_per_block=3, steps_per_sync=k)
    outs[k] = speculative.generate(cfg, params, cfg, verifier, PROMPTS, dc, rng=jax.random.PRNGKey(1))
    assert 0 <= int(outs[k]["masked_steps"]) < k
    assert (int(outs[k]["forward_passes"]) + int(outs[k]["masked_steps"])) % k == 0
  for name in ("tokens", "commit_round", "round_accepts", "rounds", "drafter_passes", "accepted", "eos_pos",
               "forward_passes", "verifier_calls"):
    np.testing.assert_array_equal(outs[3][name], outs[1][name], err_msg=name)
  np.testing.assert_allclose(outs[3]["logprob"], outs[1]["logprob"], atol=1e-6)
