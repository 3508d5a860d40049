"""The jitted block-diffusion decoder against a plain-Python reference and against transformers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgr2_jax.decode import reference, sampler
from dgr2_jax.model import masks

PROMPTS = [[7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20], [21, 22, 23]]  # mixed lengths
R = 16


def _dc(bs, tau, r=R, **kw):
  kw.setdefault("eos_ids", (5,))
  kw.setdefault("steps_per_block", 0)   # no step budget unless a test sets one
  return sampler.DecodeConfig(block_size=bs, threshold=tau, max_new_tokens=r, mask_token_id=63, pad_id=0, **kw)


def _assert_same(out, ref):
  np.testing.assert_array_equal(out["tokens"], ref["tokens"])
  np.testing.assert_array_equal(out["commit_step"], ref["commit_step"])
  np.testing.assert_allclose(out["logprob"], ref["logprob"], atol=1e-5)
  np.testing.assert_array_equal(out["nfe"], ref["nfe"])
  assert out["output_ids"] == ref["output_ids"]
  np.testing.assert_array_equal(out["steps"], ref["steps"])


def _block_steps(out, bs):
  """[rows, blocks] denoising steps each row spent on each block."""
  cs = out["commit_step"]
  return np.asarray([[len(np.unique(c[c >= 0])) for c in row.reshape(-1, bs)] for row in cs])


@pytest.mark.parametrize("bs,kv_write", [(1, "fused"), (2, "fused"), (2, "separate"), (4, "fused"),
                                         (4, "separate"), (8, "separate"), (32, "fused"), (32, "separate")])
def test_while_loop_matches_python_reference(tiny_lm, bs, kv_write):
  """Greedy and sampled, mixed prompt lengths, an EOS the rows reach at different places; one
  compilation for every tau; rows progress independently (iterations = the slowest row's forwards,
  fewer than blocks in lockstep would take)."""
  cfg, params = tiny_lm
  r = max(R, 2 * bs)
  dc = lambda tau, **kw: _dc(bs, tau, r, kv_write=kv_write, **kw)
  free = sampler.generate(cfg, params, PROMPTS, dc(0.6, eos_ids=()))
  eos = int(np.bincount(free["tokens"][:, :r // 2].ravel()).argmax())   # emitted early by some rows
  fn = sampler.decoder_for(cfg, dc(1.0, eos_ids=(eos,)))[1]
  multi_commit, varied = False, False
  for tau in (1.0, 0.1, 0.05):  # the tiny model's confidences are ~0.1: these commit in parallel
    for temp in (0.0, 0.8):
      kw = dict(eos_ids=(eos,), temperature=temp, top_k=20 if temp else 0)
      key = jax.random.PRNGKey(int(tau * 100) + int(temp * 10))
      out = sampler.generate(cfg, params, PROMPTS, dc(tau, **kw), rng=key)
      _assert_same(out, reference.reference_decode(cfg, params, PROMPTS, dc(tau, **kw), rng=key))
      committed = out["commit_step"][out["commit_step"] >= 0]
      multi_commit |= len(np.unique(committed)) < len(committed)
      varied |= len({len(o) for o in out["output_ids"]}) > 1
      if bs > 1:
        steps = _block_steps(out, bs)
        writes = (steps[:, 1:] > 0).sum(1) if sampler.resolve_kv_write(kv_write) == "separate" else 0
        assert int(out["forward_passes"]) == int((steps.sum(1) + writes).max())
  if bs > 1:  # without EOS every row decodes every block: lockstep would take max-per-block steps
    steps = _block_steps(sampler.generate(cfg, params, PROMPTS, dc(0.1, eos_ids=())), bs)
    staggered = int(steps.max(0).sum()) > int(steps.sum(1).max())
  assert varied, "rows should stop at different places"
  # tau only changes traced values: one compilation served every threshold.
  assert fn._cache_size() == 1
  if bs > 1:
    assert multi_commit, "the low thresholds should commit several tokens in one step"
  if bs in (4, 8):
    assert staggered, "rows should finish blocks at different steps"


@pytest.mark.parametrize("tau", [1.0, 0.9])
def test_step_budget_matches_reference_and_bounds_steps(tiny_lm, tau):
  """`steps_per_block` S: at step t of a block, >= ceil(m / (S - t)) commits; never > S steps."""
  cfg, params = tiny_lm
  free = sampler.generate(cfg, params, PROMPTS, _dc(8, tau, eos_ids=()))
  per_block = lambda out: [len(np.unique(out["commit_step"][row, k:k + 8]))
                           for row in range(len(PROMPTS)) for k in (0, 8)]
  assert max(per_block(free)) > 3, "the unbudgeted run must need more than 3 steps somewhere"
  for s in (1, 3):
    dc = _dc(8, tau, eos_ids=(), steps_per_block=s)
    out = sampler.generate(cfg, params, PROMPTS, dc)
    _assert_same(out, reference.reference_decode(cfg, params, PROMPTS, dc))
    writes = int(sampler.resolve_kv_write(dc.kv_write) == "separate")  # block 1's K/V write pass
    assert max(per_block(out)) <= s and int(out["forward_passes"]) <= 2 * s + writes
    assert (out["commit_step"] >= 0).all()
  # S >= the block size never binds: the same trajectory as no budget.
  _assert_same(sampler.generate(cfg, params, PROMPTS, _dc(8, tau, eos_ids=(), steps_per_block=8)),
               free)
  with pytest.raises(ValueError, match="steps_per_block"):
    _dc(8, tau, steps_per_block=-1)


def test_sampling_matches_reference(tiny_lm):
  cfg, params = tiny_lm
  dc = _dc(4, 0.3, temperature=0.8, top_k=20, top_p=0.9)
  key = jax.random.PRNGKey(7)
  out = sampler.generate(cfg, params, PROMPTS, dc, rng=key)
  _assert_same(out, reference.reference_decode(cfg, params, PROMPTS, dc, rng=key))
  other = sampler.generate(cfg, params, PROMPTS, dc, rng=jax.random.PRNGKey(8))
  assert not np.array_equal(out["tokens"], other["tokens"]), "a new key must change the samples"


def test_tau_one_commits_one_token_per_step_and_counts_nfe(tiny_lm):
  cfg, params = tiny_lm
  for bs, kv_write in ((1, "fused"), (4, "fused"), (4, "separate")):
    out = sampler.generate(cfg, params, PROMPTS, _dc(bs, 1.0, eos_ids=(), kv_write=kv_write))
    cs = out["commit_step"]
    for row in cs:
      assert sorted(row.tolist()) == list(range(R)), "one commit per step, every step"
    # B = 1: the prefill predicts token 0, then one forward per further token (as AR / HF).
    # B > 1, fused: one forward per step (block j's first step also writes block j-1's K/V);
    # separate: one more forward per block after the first (its K/V write).
    expected = R - 1 if bs == 1 else R + (R // bs - 1 if kv_write == "separate" else 0)
    np.testing.assert_array_equal(out["nfe"], [expected] * len(PROMPTS))
    assert int(out["forward_passes"]) == expected


def test_auto_kv_write_follows_the_rows_per_device(tiny_lm, monkeypatch):
  """'auto': 'separate' on CPU; on an accelerator 'fused' up to FUSED_MAX_ROWS rows per device and
  'separate' beyond, decided per compiled batch: seen as the write passes in NFE, equal to the
  reference's, with the same tokens either way."""
  most = sampler.FUSED_MAX_ROWS
  assert sampler.resolve_kv_write("auto", 1, "cpu") == "separate"
  assert sampler.resolve_kv_write("auto", most, "gpu") == "fused"
  assert sampler.resolve_kv_write("auto", most + 1, "gpu") == "separate"
  assert sampler.resolve_kv_write("auto", None, "tpu") == "fused"
  assert sampler.resolve_kv_write("fused", 64, "cpu") == "fused"
  cfg, params = tiny_lm
  dc = _dc(4, 1.0, r=12, eos_ids=(), kv_write="auto")     # a shape no other test compiles
  monkeypatch.setattr(sampler, "_backend", lambda: "gpu")
  sampler.compiled_decoder.cache_clear()
  try:
    prompts = (PROMPTS * most)[:most + 1]
    few = sampler.generate(cfg, params, prompts[:most], dc)
    many = sampler.generate(cfg, params, prompts, dc)
    _assert_same(many, reference.reference_decode(cfg, params, prompts, dc))
  finally:
    sampler.compiled_decoder.cache_clear()   # no trace made for a GPU stays cached
  np.testing.assert_array_equal(many["tokens"][:most], few["tokens"])
  np.testing.assert_array_equal(few["nfe"], 12)                          # tau 1: a step per token
  np.testing.assert_array_equal(many["nfe"], 12 + 12 // 4 - 1)          # + a write per later block


def test_rows_stop_at_their_own_eos(tiny_lm):
  cfg, params = tiny_lm
  free = sampler.generate(cfg, params, PROMPTS, _dc(4, 0.6, eos_ids=()))
  eos = int(free["tokens"][0, 6])  # a token row 0 emits mid-way
  out = sampler.generate(cfg, params, PROMPTS, _dc(4, 0.6, eos_ids=(eos,)))
  first = int(np.argmax(free["tokens"][0] == eos))
  assert out["output_ids"][0][-1] == eos and len(out["output_ids"][0]) <= first + 1 + 4
  block_end = (int(out["eos_pos"][0]) // 4 + 1) * 4
  assert (out["commit_step"][0, block_end:] == -1).all(), "a finished row commits nothing more"
  _assert_same(out, reference.reference_decode(cfg, params, PROMPTS, _dc(4, 0.6, eos_ids=(eos,))))


def test_b1_greedy_equals_transformers_generate(tmp_path):
  torch = pytest.importorskip("torch")
  from transformers import Qwen3Config as HFConfig, Qwen3ForCausalLM
  from dgr2_jax.model import checkpoint
  torch.manual_seed(0)
  hf_cfg = HFConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                    tie_word_embeddings=False, eos_token_id=3, pad_token_id=0, bos_token_id=None)
  model = Qwen3ForCausalLM(hf_cfg).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.mul_(6.0)  # peaked distributions: no near-ties between torch and XLA argmax
  model.save_pretrained(tmp_path / "hf")
  cfg, params = checkpoint.load_model_dir(str(tmp_path / "hf"))
  prompts = [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23], [31, 32, 33, 34, 35]]
  # Choose an EOS the model actually emits, so rows stop at different places.
  free = sampler.generate(cfg, params, prompts, sampler.DecodeConfig(
      block_size=1, threshold=1.0, max_new_tokens=24, eos_ids=(), pad_id=0))
  eos = int(free["tokens"][1, 5])
  dc = sampler.DecodeConfig(block_size=1, threshold=1.0, max_new_tokens=24, eos_ids=(eos,), pad_id=0)
  ours = sampler.generate(cfg, params, prompts, dc)
  for i, prm in enumerate(prompts):
    with torch.no_grad():
      ids = model.generate(torch.tensor([prm]), do_sample=False, max_new_tokens=24, eos_token_id=eos,
                           pad_token_id=0, attention_mask=torch.ones(1, len(prm), dtype=torch.long))
    theirs = ids[0, len(prm):].tolist()
    assert ours["output_ids"][i] == theirs, f"row {i}"
  assert any(len(o) < 24 for o in ours["output_ids"]), "EOS should stop some row early"


def test_masks_edge_cases():
  # B = 1 block-causal == causal & padding.
  valid = masks.left_pad_valid(jnp.array([3, 5]), 5, 9)
  m1 = masks.sequence_mask(5, 9, 1, valid)
  causal = np.tril(np.ones((9, 9), bool))
  np.testing.assert_array_equal(np.asarray(m1), causal[None] & np.asarray(valid)[:, None, :])
  # prompt of 5 slots (not a multiple of B = 2), response of 4: blocks {5,6}, {7,8}.
  m = np.asarray(masks.sequence_mask(5, 9, 2, valid))
  assert m[1, 5, 6] and m[1, 6, 5] and not m[1, 6, 7] and m[1, 7, 6] and m[1, 7, 8]
  assert not m[1, 4, 5], "the prompt never sees the response"
  assert not m[0, 5, 1] and m[0, 5, 2], "left padding is invisible; the real prompt is visible"
  np.testing.assert_array_equal(np.asarray(masks.left_pad_positions(jnp.array([3]), 5, 8))[0],
                                [0, 0, 0, 1, 2, 3, 4, 5])
