"""Speculative decoding: greedy output = the verifier's AR greedy decoding (ours and transformers'),
the jitted loop = the plain-Python reference (tokens, per-round accepts), and sampled output follows
the verifier's distribution (chi-square over every outcome of a tiny vocabulary; the same test
rejects a deliberately wrong acceptance rule)."""

import jax
import numpy as np
import pytest
import scipy.stats

from dgr2_jax.decode import reference, sampler, speculative
from dgr2_jax.model import qwen3
from dgr2_jax.model.config import Qwen3Config

PROMPTS = [[7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20], [21, 22, 23]]
R = 16
KEYS = ("tokens", "round_accepts", "rounds", "drafter_passes", "accepted", "eos_pos", "commit_round")


def _peaked(cfg, seed, scale=8.0):
  params = qwen3.init_params(cfg, jax.random.PRNGKey(seed))
  return jax.tree_util.tree_map(lambda x: x * scale if x.ndim == 2 else x, params)


@pytest.fixture(scope="module")
def models(tiny_lm):
  """(config, random drafter, verifier, verifier without the mask token, its config)."""
  cfg, drafter = tiny_lm
  verifier = _peaked(cfg, 2)
  # The verifier's vocabulary may lack the mask token (the drafter's last id): drop its row.
  vcfg = cfg.replace(vocab_size=63, mask_token_id=None)
  no_mask = jax.tree_util.tree_map(lambda x: x, verifier)
  no_mask["embed_tokens"] = {"embedding": verifier["embed_tokens"]["embedding"][:63]}
  no_mask["lm_head"] = {"kernel": verifier["lm_head"]["kernel"][:, :63]}
  return cfg, drafter, verifier, vcfg, no_mask


def _dc(bs, tau, r=R, **kw):
  kw.setdefault("eos_ids", (5,))
  kw.setdefault("steps_per_block", 0)   # no step budget
  return sampler.DecodeConfig(block_size=bs, threshold=tau, max_new_tokens=r, mask_token_id=63, pad_id=0, **kw)


def _eos_of(cfg, params, bs):
  """An EOS the verifier emits mid-way for some rows, so rows stop at different places."""
  free = sampler.generate(cfg, params, PROMPTS, _dc(1, 1.0, eos_ids=()))
  return int(free["tokens"][1, 5])


@pytest.mark.parametrize("bs", [4, 8, 32])
def test_greedy_output_is_the_verifiers_ar_decoding(models, bs):
  cfg, drafter, verifier, vcfg, no_mask = models
  r = max(R, 2 * bs)
  eos = _eos_of(cfg, verifier, bs)
  ar = sampler.generate(cfg, verifier, PROMPTS, _dc(1, 1.0, r, eos_ids=(eos,)))
  assert len({len(o) for o in ar["output_ids"]}) > 1
  accepted = 0
  # A random drafter, and a "trained" one (the verifier's own weights as block diffusion, which
  # agrees with it far more often); the verifier with and without the mask token.
  for name, dparams in (("random", drafter), ("verifier weights", verifier)):
    for tau in (1.0, 0.3, 0.05):
      for vc, vp in ((cfg, verifier), (vcfg, no_mask)):
        out = speculative.generate(cfg, dparams, vc, vp, PROMPTS, _dc(bs, tau, r, eos_ids=(eos,)))
        assert out["output_ids"] == ar["output_ids"], (name, tau)
        got = out["commit_round"] >= 0
        np.testing.assert_array_equal(got, ar["commit_step"] >= 0)
        np.testing.assert_allclose(out["logprob"][got], ar["logprob"][got], atol=1e-5)
        assert (out["rounds"] <= [len(o) for o in out["output_ids"]]).all()   # >= 1 token a round
        if name != "random":
          accepted += int(out["accepted"].sum())
  assert accepted > 0, "the verifier-weights drafter should have drafts accepted"


def test_greedy_equals_transformers_generate(tmp_path, tiny_lm):
  torch = pytest.importorskip("torch")
  from transformers import Qwen3Config as HFConfig, Qwen3ForCausalLM
  from dgr2_jax.model import checkpoint
  cfg, drafter = tiny_lm
  torch.manual_seed(0)
  hf = Qwen3ForCausalLM(HFConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                                 tie_word_embeddings=False, eos_token_id=5, pad_token_id=0, bos_token_id=None)).eval()
  with torch.no_grad():
    for prm in hf.parameters():
      prm.mul_(6.0)
  hf.save_pretrained(tmp_path / "hf")
  vcfg, vparams = checkpoint.load_model_dir(str(tmp_path / "hf"))
  eos = int(sampler.generate(vcfg, vparams, PROMPTS, _dc(1, 1.0, eos_ids=()))["tokens"][1, 4])
  out = speculative.generate(cfg, drafter, vcfg, vparams, PROMPTS, _dc(8, 0.3, eos_ids=(eos,)))
  for i, prm in enumerate(PROMPTS):
    with torch.no_grad():
      # The drafter's mask token (63) is never a valid output, so HF suppresses it too.
      ids = hf.generate(torch.tensor([prm]), do_sample=False, max_new_tokens=R, eos_token_id=eos, pad_token_id=0,
                        attention_mask=torch.ones(1, len(prm), dtype=torch.long), suppress_tokens=[63])
    assert out["output_ids"][i] == ids[0, len(prm):].tolist(), f"row {i}"


@pytest.mark.parametrize("bs,kv_write", [(4, "separate"), (8, "fused")])
def test_jitted_loop_equals_python_reference(models, bs, kv_write):
  cfg, drafter, verifier, vcfg, no_mask = models
  eos = _eos_of(cfg, verifier, bs)
  for dparams in (drafter, verifier):
    for tau, temp in ((0.1, 0.0), (0.3, 1.0)) if kv_write == "fused" else ((1.0, 0.0), (0.1, 0.0), (0.05, 0.8)):
      dc = _dc(bs, tau, eos_ids=(eos,), temperature=temp, top_k=20 if temp else 0, kv_write=kv_write,
               steps_per_block=3 if tau < 0.2 else 0)
      key = jax.random.PRNGKey(int(tau * 100))
      out = speculative.generate(cfg, dparams, cfg, verifier, PROMPTS, dc, rng=key)
      ref = reference.reference_speculative(cfg, dparams, cfg, verifier, PROMPTS, dc, rng=key)
      for k in KEYS:
        np.testing.assert_array_equal(out[k], ref[k], err_msg=f"{k} tau={tau} T={temp}")
      np.testing.assert_allclose(out["logprob"], ref["logprob"], atol=1e-5)
      assert out["output_ids"] == ref["output_ids"]
  # Thresholds are traced: one compilation per static setting (the sampling route is one: the
  # sampled runs above used top-k, the greedy ones ran at every tau).
  fn = speculative.decoder_for(cfg, cfg, _dc(bs, 0.5, eos_ids=(eos,), temperature=1.0, top_k=20, kv_write=kv_write))
  assert fn._cache_size() == 1
  assert speculative.decoder_for(cfg, cfg, _dc(bs, 0.5, eos_ids=(eos,), kv_write=kv_write))._cache_size() == 1


def _enumerated(cfg, verifier, prompt, temperature):
  """Exact distribution of the verifier over all two-token outputs (mask token excluded)."""
  from dgr2_jax.decode import sampling
  from dgr2_jax.model import masks
  v = cfg.vocab_size

  def next_logp(seq):
    t = np.asarray([seq], np.int32)
    n = len(seq)
    lg = qwen3.forward(cfg, verifier, t, np.arange(n)[None], masks.sequence_mask(n, n, 1, np.ones((1, n), bool)))[0]
    return np.asarray(sampling.decoding_logprobs(lg[0, -1], temperature, 0, 1.0, v - 1), np.float64)
  p0 = np.exp(next_logp(prompt))
  probs = {}
  for a in range(v - 1):
    p1 = np.exp(next_logp(prompt + [a]))
    for c in range(v - 1):
      probs[(a, c)] = p0[a] * p1[c]
  return probs


def _chi2_pvalue(samples, probs):
  keys = sorted(probs)
  counts = np.asarray([samples.get(k, 0) for k in keys], np.float64)
  expected = np.asarray([probs[k] for k in keys]) * counts.sum()
  big = expected >= 5  # merge the sparse cells into one
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  if exp[-1] == 0:
    obs, exp = obs[:-1], exp[:-1]
  return scipy.stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def test_sampled_outputs_follow_the_verifiers_distribution():
  cfg = Qwen3Config(vocab_size=6, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=8, mask_token_id=5, pad_token_id=0)
  drafter, verifier = _peaked(cfg, 11, 3.0), _peaked(cfg, 12, 3.0)
  prompt, temp, n = [1, 2, 3], 1.0, 4096
  probs = _enumerated(cfg, verifier, prompt, temp)
  pvalues = {}
  # tau 1: one commit per step (the order rule matters); tau 0.01: both drafts in one step.
  for tau, accept_all in ((1.0, False), (0.01, False), (1.0, True)):
    dc = sampler.DecodeConfig(block_size=2, threshold=tau, temperature=temp, max_new_tokens=2, eos_ids=(),
                              mask_token_id=5, pad_id=0)
    fn = speculative.decoder_for(cfg, cfg, dc, accept_all=accept_all)
    out = speculative.generate_with(fn, (drafter, verifier), [prompt] * n, dc, rng=jax.random.PRNGKey(0))
    counts = {}
    for row in out["tokens"]:
      counts[tuple(int(t) for t in row)] = counts.get(tuple(int(t) for t in row), 0) + 1
    assert set(counts) <= set(probs), "an output outside the enumerated support"
    pvalues[(tau, accept_all)] = _chi2_pvalue(counts, probs)
    if not accept_all:
      assert 0 < int(out["accepted"].sum()) < 2 * n, "some drafts accepted, some rejected"
  assert pvalues[(1.0, False)] > 1e-3 and pvalues[(0.01, False)] > 1e-3, pvalues
  assert pvalues[(1.0, True)] < 1e-6, pvalues   # keeping every draft samples the drafter: detected
