"""Host round trips of the decoders, read from the compiled program, and `decode.steps_per_sync`
changing nothing but how often the host looks."""

import jax
import numpy as np
import pytest

from dgr2_jax.aot import hlo as hlo_lib
from dgr2_jax.decode import reference, sampler, speculative

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
  loops = hlo_lib.loops(fn.lower(*args).compile().as_text())
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


def _speculative_args(params):
  toks, lens = sampler.left_pad(PROMPTS, 9, 0)
  return (params, params, toks, lens, np.float32(0.3), np.float32(0), np.int32(0), np.float32(1),
          np.zeros((2,), np.uint32), np.int32(0))


def test_speculative_loop_keeps_only_the_verification_cond(tiny_lm):
  """verify_every = 0: the verifier's pass is decided on the device, one cond per drafter step."""
  cfg, params = tiny_lm
  k = 4
  dc = _dc(4, 0.3, eos_ids=(5,), kv_write="fused", steps_per_sync=k, verify_every=0)
  fn = speculative.decoder_for(cfg, cfg, dc)
  outer, loops = _decode_loop(fn, _speculative_args(params))
  assert outer.conditionals == 1, "the drafter runs unconditionally; the verifier under one cond"
  steps = [loops[n] for n in outer.inner if loops[n].trip_count == k]
  assert len(steps) == 1 and steps[0].conditionals == 1 and steps[0].dots == outer.dots


@pytest.mark.parametrize("k,m,temp", [(8, 2, 0.0), (8, 4, 0.8)])
def test_speculative_group_makes_one_host_round_trip(tiny_lm, k, m, temp):
  """verify_every = m > 0: per iteration of the outer loop, k / m cycles of m drafter steps and one
  verifier pass, in loops of static trip count: the outer predicate is the only one the host reads
  (1 per k drafter steps)."""
  cfg, params = tiny_lm
  dc = _dc(4, 0.3, eos_ids=(5,), kv_write="separate", steps_per_sync=k, verify_every=m, temperature=temp)
  fn = speculative.decoder_for(cfg, cfg, dc)
  args = _speculative_args(params)
  hlo = fn.lower(*args).compile().as_text()
  outer, loops = _decode_loop(fn, args)
  assert outer.conditionals == 0, "no cond inside the speculative loop"
  assert hlo_lib.host_predicates(hlo, outer) == 1
  assert all(loops[n].trip_count is not None for n in outer.inner)
  # The cycles: a loop of k / m iterations holding every forward (drafter and verifier), and in it
  # the drafter's steps (a loop of m iterations; XLA inlines a loop of one).
  cycles = [loops[n] for n in outer.inner if loops[n].trip_count == k // m and loops[n].dots == outer.dots]
  assert len(cycles) == 1
  drafter = [loops[n] for n in cycles[0].inner if loops[n].trip_count == m and loops[n].dots > 0]
  assert len(drafter) == (1 if m > 1 else 0)
  if m > 1:
    assert 0 < drafter[0].dots < cycles[0].dots, "the verifier's forward runs once per cycle, outside"


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


def test_speculative_schedule_changes_no_result(tiny_lm):
  """The verification schedule (verify_every m, 0 = decided on the device) and k change no row's
  outputs; the batch's counters depend on m only, and a static schedule runs one verifier forward
  per m drafter steps."""
  cfg, params = tiny_lm
  verifier = jax.tree_util.tree_map(lambda x: x * 1.5, params)
  outs = {}
  for m, k in ((0, 1), (0, 3), (1, 3), (2, 2), (2, 8)):
    dc = _dc(4, 0.2, eos_ids=(5,), kv_write="separate", steps_per_block=3, steps_per_sync=k, verify_every=m)
    outs[m, k] = out = speculative.generate(cfg, params, cfg, verifier, PROMPTS, dc, rng=jax.random.PRNGKey(1))
    loop_steps = int(out["forward_passes"]) + int(out["masked_steps"])
    assert 0 <= int(out["masked_steps"]) < k and loop_steps % k == 0, (m, k, loop_steps)
    assert 0 < int(out["verifier_calls"]) <= int(out["verifier_forwards"])
    if m:
      assert int(out["verifier_forwards"]) * m == loop_steps
    else:
      assert int(out["verifier_forwards"]) == int(out["verifier_calls"])
  assert len({len(o) for o in outs[0, 1]["output_ids"]}) > 1, "rows should stop at different places"
  assert int(outs[2, 8]["masked_steps"]) > 0 and int(outs[2, 2]["forward_passes"]) > int(outs[0, 1]["forward_passes"])
  for key, out in outs.items():
    for name in ("tokens", "commit_round", "round_accepts", "rounds", "drafter_passes", "accepted", "eos_pos", "nfe"):
      np.testing.assert_array_equal(out[name], outs[0, 1][name], err_msg=f"{name} (m, k)={key}")
    np.testing.assert_allclose(out["logprob"], outs[0, 1]["logprob"], atol=1e-6)
  for same in (((0, 3), (0, 1)), ((2, 8), (2, 2))):
    for name in ("forward_passes", "verifier_calls"):
      np.testing.assert_array_equal(outs[same[0]][name], outs[same[1]][name], err_msg=f"{name} {same}")


def test_speculative_schedule_is_validated(tiny_lm):
  cfg, _ = tiny_lm
  with pytest.raises(ValueError, match="verify_every"):
    _dc(4, 0.5, verify_every=-1)
  with pytest.raises(ValueError, match=r"verify_every \(3\) must be 0 or divide decode.steps_per_sync \(8\)"):
    speculative.decoder_for(cfg, cfg, _dc(4, 0.5, verify_every=3))
