"""Shared-prefix KV reuse (decode/prefix.py): the prefix's K/V computed once and copied into each
left-padded row equal the row's own prefill, and the batch decoder, the speculative decoder and the
serving slots decode with it exactly the tokens they decode with a full prefill."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgr2_jax.decode import prefix, sampler, speculative
from dgr2_jax.model import masks, qwen3
from dgr2_jax.serve import engine as engine_lib
from dgr2_jax.serve import slots as slots_lib
from dgr2_jax.task import prompts as prompts_lib

_RNG = np.random.default_rng(7)
SYSTEM = _RNG.integers(6, 60, size=20).tolist()          # the shared prefix (a "system prompt")
# Mixed lengths: a prompt that is exactly the system prompt, one a token longer, longer ones.
PROMPTS = [SYSTEM + _RNG.integers(6, 60, size=k).tolist() for k in (5, 0, 9, 1, 3)]
SHORT = PROMPTS[:3] + [SYSTEM[:7]]                        # one prompt shorter than the prefix


def _dc(bs, **kw):
  kw.setdefault("threshold", 1.0 if bs == 1 else 0.1)   # the tiny model's confidences are ~0.1
  return sampler.DecodeConfig(block_size=bs, max_new_tokens=16, mask_token_id=63, pad_id=0, eos_ids=(5,),
                              steps_per_block=0, **kw)


def _assert_same(out, ref, keys=("tokens", "commit_step", "nfe", "steps", "eos_pos")):
  """Every token-level output equal; log-probs to float rounding (decode/prefix.py docstring)."""
  for k in keys:
    np.testing.assert_array_equal(out[k], ref[k], err_msg=k)
  assert out["output_ids"] == ref["output_ids"]
  np.testing.assert_allclose(out["logprob"], ref["logprob"], atol=1e-5)


def test_resolve_rules():
  assert prefix.common_prefix_len(PROMPTS) == 20
  assert prefix.common_prefix_len([[1, 2, 3], [1, 2, 4], [1, 9]]) == 1
  assert prefix.resolve(0, PROMPTS) == 0                       # off
  assert prefix.resolve(-1, PROMPTS) == 16                     # min(20, shortest 20 - 1) rounded to 16
  assert prefix.resolve(18, PROMPTS) == 18                     # capped, not rounded
  assert prefix.resolve(100, PROMPTS) == 19                    # every row keeps its last token
  assert prefix.resolve(-1, SHORT) == 0                        # 6 tokens: rounded away
  assert prefix.resolve(5, SHORT) == 5
  assert prefix.resolve(-1, PROMPTS[:1]) == 0                  # one prompt: nothing to share
  assert prefix.resolve(-1, [[1, 2], [3, 4]]) == 0
  with pytest.raises(ValueError, match="decode.shared_prefix"):
    sampler.DecodeConfig(shared_prefix=-2)


def test_copied_prefix_is_each_rows_own_prefill(tiny_lm):
  """The K/V of a batch-1 forward of the prefix, written at each row's pad offset, and the window
  after it, equal the full prefill's cache on every real slot and its last hidden state; copied
  at the wrong offset (positions not relative to the row's first token) they would not."""
  cfg, params = tiny_lm
  params = qwen3.decode_params(cfg, params)
  toks, lens = sampler.left_pad(PROMPTS, 29, 0)
  p, s, n = 29, 29 + 8, 18
  pos = masks.left_pad_positions(lens, p, s)
  run = lambda t, start, cache: sampler.window_forward(cfg, params, t, start, cache, lens, p, pos, return_hidden=True)
  h_full, c_full = jax.jit(lambda: run(jnp.asarray(toks), 0, qwen3.init_cache(cfg, 5, s)))()
  h, c = jax.jit(lambda: prefix.prefill(cfg, params, jnp.asarray(toks), jnp.asarray(lens), qwen3.init_cache(cfg, 5, s),
                                        n, p, run))()
  assert h.shape[1] == p - n
  np.testing.assert_allclose(h[:, -1], h_full[:, -1], atol=1e-5)
  real = np.arange(p)[None, :] >= (p - lens)[:, None]                  # [B,P] real prompt slots
  for layer in range(cfg.num_hidden_layers):
    for kv in ("k", "v"):
      np.testing.assert_allclose(np.asarray(c[layer][kv])[:, :p][real], np.asarray(c_full[layer][kv])[:, :p][real],
                                 atol=1e-5)
  pcache = prefix.prefix_cache(cfg, params, jnp.asarray(SYSTEM[:n]))
  wrong = prefix.copy_prefix(qwen3.init_cache(cfg, 5, s), pcache, jnp.zeros((5,), jnp.int32))
  row = 1                                                              # 9 pad slots
  pad = p - lens[row]
  assert np.abs(np.asarray(wrong[0]["k"])[row, pad:pad + n] - np.asarray(c_full[0]["k"])[row, pad:pad + n]).max() > 0.1


@pytest.mark.parametrize("bs,kv_write,shared", [(1, "fused", -1), (4, "fused", 18), (4, "separate", -1)])
def test_batch_decoder_same_outputs(tiny_lm, bs, kv_write, shared):
  """AR and block diffusion, the detected (16) and a configured prefix, against the full prefill."""
  cfg, params = tiny_lm
  dc = _dc(bs, kv_write=kv_write)
  ref = sampler.generate(cfg, params, PROMPTS, dc)
  _assert_same(sampler.generate(cfg, params, PROMPTS, dataclasses.replace(dc, shared_prefix=shared)), ref)


@pytest.mark.parametrize("bs", [1, 4])
def test_batch_decoder_prompt_shorter_than_prefix(tiny_lm, bs):
  """A prompt shorter than the configured prefix caps it (every row keeps its last token); sampled."""
  cfg, params = tiny_lm
  dc = _dc(bs, temperature=0.8)
  key = jax.random.PRNGKey(3)
  assert prefix.resolve(18, SHORT) == 6
  ref = sampler.generate(cfg, params, SHORT, dc, rng=key, max_prompt_len=30)
  _assert_same(sampler.generate(cfg, params, SHORT, dataclasses.replace(dc, shared_prefix=18), rng=key,
                                max_prompt_len=30), ref)


# Greedy: prefix + 0, + 9, + 1 tokens, L = 19 = P - 10. Sampled: two prompts of one length, L = P - 1,
# so the verifier's prefill (it leaves the last prompt token pending) is the copied prefix alone.
SPEC_CASES = [(0.0, PROMPTS[1:4], 19), (0.8, [PROMPTS[3], SYSTEM + [PROMPTS[3][-1] % 50 + 7]], 20)]


@pytest.mark.parametrize("temperature,prompts,n", SPEC_CASES)
def test_speculative_same_outputs(tiny_lm, temperature, prompts, n):
  """Both models' prefills reuse the prefix: the drafter's and the verifier's."""
  cfg, drafter = tiny_lm
  verifier = qwen3.init_params(cfg, jax.random.PRNGKey(2))
  verifier = jax.tree_util.tree_map(lambda x: x * 8 if x.ndim == 2 else x, verifier)   # peaked, as tiny_lm
  dc = _dc(4, threshold=0.3, temperature=temperature)
  key = jax.random.PRNGKey(5)
  assert prefix.resolve(100, prompts) == n
  ref = speculative.generate(cfg, drafter, cfg, verifier, prompts, dc, rng=key)
  out = speculative.generate(cfg, drafter, cfg, verifier, prompts, dataclasses.replace(dc, shared_prefix=100), rng=key)
  _assert_same(out, ref, ("tokens", "commit_round", "rounds", "accepted", "drafter_passes", "eos_pos"))


def test_serving_slots_same_outputs(tiny_lm):
  """Requests into 3 slots with the prefix set once: those that start with it (and are longer)
  reuse it, the others (another prefix, the prefix itself) prefill in full; every output is the
  batch decoder's with a full prefill."""
  cfg, params = tiny_lm
  dc = sampler.decode_config_for(cfg, block_size=4, threshold=0.7, max_new_tokens=16)
  dec = slots_lib.SlotDecoder(cfg, params, dc, slots=3, prompt_slots=30)
  assert dec.set_prefix(SYSTEM[:18]) == 18
  prompts = PROMPTS + [[9] + SYSTEM[1:] + [11, 12], SYSTEM[:18]]
  eng = engine_lib.Engine("threshold", dec, steps_per_round=3)
  reqs = [engine_lib.Request(p, threshold=0.7) for p in prompts]
  sched = engine_lib.Scheduler({"threshold": eng}).start()
  try:
    for r in reqs:
      sched.submit("threshold", r)
    out = [r.future.result(timeout=300) for r in reqs]
  finally:
    sched.stop()
  ref = sampler.generate(cfg, params, prompts, dc, max_prompt_len=30)
  for i, o in enumerate(out):
    assert o["output_ids"] == ref["output_ids"][i], i
    assert o["nfe"] == ref["nfe"][i], i
  assert dec.prefill_stats == dict(requests=7, slots=7 * 30 - 5 * 18, reused=5)
  with pytest.raises(ValueError, match="shared prefix"):
    dec.set_prefix(list(range(30)))


@pytest.mark.parametrize("variant", ["compact", "full"])
def test_service_prefix_is_the_system_prompt(tmp_path, variant):
  """The server's prefix (serve/service.py): the common start of its probe prompts, which every
  re-rank prompt shares and which holds the system message, rounded down to 16 tokens."""
  from dgr2_jax.serve import service as service_lib
  from dgr2_jax.task import config as task_config
  from dgr2_jax.task import pipeline, synthetic
  from dgr2_jax.task import tokenizer as tok_lib
  data = synthetic.make(n_items=80, n_users=40, seed=0)
  tok = tok_lib.load_tokenizer(tok_lib.build_demo_tokenizer(tok_lib.demo_corpus(data["items"]), data["sid_tokens"],
                                                            str(tmp_path), 1024))
  task = task_config.task_config()
  task.prompt_variant, task.prompt_len = variant, 1024
  kept = []
  engines = {"threshold": types.SimpleNamespace(decoder=types.SimpleNamespace(set_prefix=kept.append))}
  svc = types.SimpleNamespace(items=data["items"], sids=data["sids"], num_candidates=10, tokenizer=tok, task=task,
                              next_table=None, dc=sampler.DecodeConfig(block_size=1, shared_prefix=0))
  svc.example = lambda h, c: service_lib.Service.example(svc, h, c)
  assert service_lib.Service._set_shared_prefix(svc, engines) == 0 and not kept      # off
  svc.dc = sampler.DecodeConfig(block_size=1, shared_prefix=-1)
  n = service_lib.Service._set_shared_prefix(svc, engines)
  assert n >= 32 and n % prefix.AUTO_ROUND == 0 and len(kept) == 1 and len(kept[0]) == n
  system = prompts_lib.SYSTEM_COMPACT if variant == "compact" else prompts_lib.SYSTEM_FULL
  assert tok.decode(kept[0]).find(system[:60]) >= 0
  for u in range(5):                                  # real impressions start with it
    ex = dict(history=data["sequences"][u][:-1], candidates=data["candidates"]["test"][u].tolist())
    ids, _ = pipeline.encode_prompt(tok, ex, data["items"], data["sids"], task)
    assert ids[:n] == kept[0]
