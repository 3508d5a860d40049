"""The serving engine against the batch decoders, and the HTTP server as a subprocess."""

import concurrent.futures
import time

import numpy as np
import pytest

from dgr2_jax.decode import sampler
from dgr2_jax.serve import engine as engine_lib
from dgr2_jax.serve import slots as slots_lib


def _prompts(n, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(6, 60, size=int(k)).tolist() for k in rng.integers(3, 12, size=n)]


def _serve_all(eng, reqs, timeout=300):
  sched = engine_lib.Scheduler({eng.mode: eng}).start()
  try:
    for r in reqs:
      sched.submit(eng.mode, r)
    return [r.future.result(timeout=timeout) for r in reqs]
  finally:
    sched.stop()


@pytest.fixture(scope="module")
def block_decoder(tiny_lm):
  """A 3-slot decoder of blocks of 4, 16 new tokens (shared: one compile)."""
  cfg, params = tiny_lm
  dc = sampler.decode_config_for(cfg, block_size=4, threshold=0.7, max_new_tokens=16)
  return slots_lib.SlotDecoder(cfg, params, dc, slots=3, prompt_slots=12)


def test_engine_threshold_equals_batch_decoder(tiny_lm, block_decoder):
  """Requests admitted mid-block into 3 slots (3 steps per round), each with its own tau and
  length limit, decode exactly as the batch decoder decodes them."""
  cfg, params = tiny_lm
  prompts = _prompts(7)
  taus = [0.7 if i % 2 else 1.0 for i in range(7)]
  limits = [16] * 6 + [8]
  eng = engine_lib.Engine("threshold", block_decoder, steps_per_round=3)
  reqs = [engine_lib.Request(p, threshold=t, max_new_tokens=m) for p, t, m in zip(prompts, taus, limits)]
  out = _serve_all(eng, reqs)
  for tau in (0.7, 1.0):
    ref = sampler.generate(cfg, params, prompts, sampler.decode_config_for(
        cfg, block_size=4, threshold=tau, max_new_tokens=16), max_prompt_len=12)
    for i in range(6):
      if taus[i] == tau:
        assert out[i]["output_ids"] == ref["output_ids"][i], (tau, i)
        assert out[i]["nfe"] == ref["nfe"][i], (tau, i)
  ref8 = sampler.generate(cfg, params, prompts[6:], sampler.decode_config_for(
      cfg, block_size=4, threshold=1.0, max_new_tokens=8), max_prompt_len=12)
  assert out[6]["output_ids"] == ref8["output_ids"][0]
  assert {len(o["output_ids"]) for o in out} != {16}       # some rows stop at EOS: slots get reused
  st = eng.stats
  assert st.finished == 7 and eng.occupancy() == 0 and st.rounds > 3
  assert 0 < st.busy_row_iterations <= st.row_iterations


def test_engine_ar_policies_equal_batch_decoder(tiny_lm):
  """AR decoding (block size 1) under each admission policy."""
  cfg, params = tiny_lm
  prompts = _prompts(5, seed=1)
  dc = sampler.decode_config_for(cfg, block_size=1, threshold=1.0, max_new_tokens=8)
  dec = slots_lib.SlotDecoder(cfg, params, dc, slots=2, prompt_slots=12)
  ref = sampler.generate(cfg, params, prompts, dc, max_prompt_len=12)
  for policy in engine_lib.POLICIES:
    eng = engine_lib.Engine("ar", dec, steps_per_round=3, policy=policy)
    out = _serve_all(eng, [engine_lib.Request(p) for p in prompts])
    assert [o["output_ids"] for o in out] == ref["output_ids"], policy


def test_engine_deadline_and_cancel_free_slots(tiny_lm, block_decoder):
  cfg, params = tiny_lm
  eng = engine_lib.Engine("threshold", block_decoder, steps_per_round=1, max_queue=3)
  p = _prompts(7)
  expired = engine_lib.Request(p[0], deadline=time.monotonic() - 1)
  gone = engine_lib.Request(p[1])
  gone.cancel()
  ok = engine_lib.Request(p[2])
  eng.submit(expired), eng.submit(gone), eng.submit(ok)
  with pytest.raises(engine_lib.QueueFull):
    eng.submit(engine_lib.Request(p[3]))
  while eng.run_round():
    pass
  with pytest.raises(engine_lib.DeadlineExceeded):
    expired.future.result(0)
  with pytest.raises(engine_lib.Cancelled):
    gone.future.result(0)
  ref = sampler.generate(cfg, params, p, sampler.decode_config_for(   # the first test's shapes
      cfg, block_size=4, threshold=1.0, max_new_tokens=16), max_prompt_len=12)
  assert ok.future.result(0)["output_ids"] == ref["output_ids"][2]
  # A request cancelled while it holds a slot frees it at the next round.
  running = eng.submit(engine_lib.Request(p[3]))
  eng.run_round()
  assert eng.occupancy() == 1
  running.cancel()
  eng.run_round()
  assert eng.occupancy() == 0 and eng.stats.cancelled == 2 and eng.stats.expired == 1
