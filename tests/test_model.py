"""Qwen3 forward vs transformers' Qwen3ForCausalLM (torch CPU), the KV cache, and parameter counts.

Levanter style: tiny random HF model -> torch logits -> save_pretrained -> `load_model_dir` ->
our logits -> compare on real tokens. Norm weights and biases are randomised (HF initialises them
to 1/0), so a wrong mapping of any tensor fails the comparison.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from dgr2_jax.model import checkpoint, masks, qwen3
from dgr2_jax.model.config import Qwen3Config

BASE = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
            max_position_embeddings=64, rms_norm_eps=1e-6)
# Tied/untied, GQA ratio 1/2/4, head_dim != hidden/heads, attention bias, linear and yarn rope.
CASES = {
    "gqa1_untied_bias_hd16": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                  tie_word_embeddings=False, attention_bias=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "gqa2_tied_linear": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                             tie_word_embeddings=True,
                             rope_parameters={"rope_type": "linear", "factor": 2.0,
                                              "rope_theta": 10000.0}),
    "gqa4_untied_yarn_hd8": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                                 tie_word_embeddings=False,
                                 rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 16,
                                                  "rope_theta": 1000.0}),
}


# One jitted forward shared by every test (config is static; shapes differ only a few times).
forward = jax.jit(qwen3.forward, static_argnums=0)


def randomise(model: torch.nn.Module, seed: int) -> None:
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
      elif name.endswith("bias"):
        p.copy_(0.1 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
  """(HF model, our config, our params) for one tiny config, loaded through an HF directory."""
  torch.manual_seed(0)
  hf_cfg = transformers.Qwen3Config(**BASE, **CASES[request.param])
  model = transformers.Qwen3ForCausalLM(hf_cfg).eval()
  model.config._attn_implementation = "eager"
  randomise(model, seed=len(request.param))
  d = str(tmp_path_factory.mktemp(request.param))
  model.save_pretrained(d)
  config, params = checkpoint.load_model_dir(d)
  assert config.tie_word_embeddings == hf_cfg.tie_word_embeddings
  assert ("lm_head" in params) != hf_cfg.tie_word_embeddings
  return model, config, params


def test_logits_match_transformers_left_padded(case):
  model, config, params = case
  lens = np.array([11, 7, 3])
  b, t = len(lens), int(lens.max())
  rng = np.random.RandomState(1)
  tokens = rng.randint(0, config.vocab_size, (b, t))
  valid = np.asarray(masks.left_pad_valid(lens, t, t))
  positions = np.asarray(masks.left_pad_positions(lens, t, t))
  tokens = np.where(valid, tokens, 0)
  with torch.no_grad():
    ref = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(valid.astype(np.int64)),
                position_ids=torch.tensor(positions)).logits.numpy()
  mask = masks.sequence_mask(t, t, 1, jnp.asarray(valid))
  ours, cache = forward(config, params, tokens, positions, mask)
  assert cache is None
  ours = np.asarray(ours)
  assert ours.dtype == np.float32 and ours.shape == ref.shape
  scale = np.abs(ref[valid]).max()
  np.testing.assert_allclose(ours[valid], ref[valid], rtol=1e-4, atol=1e-4 * scale)
  # The left padding matters: an unpadded forward of the short row gives the same logits.
  short = tokens[2:3, t - 3:]
  with torch.no_grad():
    ref_short = model(input_ids=torch.tensor(short)).logits.numpy()
  np.testing.assert_allclose(ours[2, t - 3:], ref_short[0], rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize("block_size", [1, 3])
def test_cached_incremental_equals_full_forward(case, block_size):
  _, config, params = case
  lens = np.array([6, 4])
  p, r = 6, 6
  s = p + r
  rng = np.random.RandomState(2)
  tokens = rng.randint(0, config.vocab_size, (2, s))
  valid = masks.left_pad_valid(lens, p, s)
  positions = masks.left_pad_positions(lens, p, s)
  full, _ = forward(config, params, tokens, positions,
                          masks.sequence_mask(p, s, block_size, valid))
  ids = masks.slot_block_ids(p, s, block_size)
  cache = qwen3.init_cache(config, 2, s)
  # Prefill the prompt, then feed one block at a time (one token at a time when block_size is 1).
  steps = [(0, p)] + [(i, min(i + block_size, s)) for i in range(p, s, block_size)]
  outs = []
  for lo, hi in steps:
    mask = masks.block_causal_mask(ids[lo:hi], ids, valid)
    logits, cache = forward(config, params, tokens[:, lo:hi], positions[:, lo:hi], mask,
                                  cache, lo)
    outs.append(np.asarray(logits))
  inc = np.concatenate(outs, axis=1)
  v = np.asarray(valid)
  full = np.asarray(full)
  np.testing.assert_allclose(inc[v], full[v], rtol=1e-5, atol=1e-5 * np.abs(full[v]).max())
  assert len(cache) == config.num_hidden_layers and cache[0]["k"].shape[1] == s


def test_embed_rows_is_take():
  """The embedding lookup (`qwen3.embed_rows`) at any index shape, one row (taken as two) included,
  and of a 1-D table (a per-row scale)."""
  table = jnp.arange(40.0).reshape(10, 4)
  for ids in (jnp.array(3), jnp.array([3]), jnp.array([[7]]), jnp.array([[1, 9], [0, 3]])):
    got = qwen3.embed_rows(table, ids)
    assert got.shape == ids.shape + (4,)
    np.testing.assert_array_equal(got, jnp.take(table, ids, axis=0))
  np.testing.assert_array_equal(qwen3.embed_rows(table[:, 1], jnp.array([[5]])), [[21.0]])


REAL = {
    "Qwen3-0.6B": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, tie_word_embeddings=True, rope_theta=1_000_000.0,
                       max_position_embeddings=40960, rms_norm_eps=1e-6, model_type="qwen3"),
    "Qwen3-8B": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, tie_word_embeddings=False, rope_theta=1_000_000.0,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, model_type="qwen3"),
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_param_count_matches_transformers_without_allocating(name):
  d = REAL[name]
  config = Qwen3Config.from_hf_dict(d, param_dtype="bfloat16")
  shapes = qwen3.param_shapes(config)
  ours = qwen3.count_params(shapes)
  hf_cfg = transformers.Qwen3Config(**{k: v for k, v in d.items() if k != "model_type"})
  with torch.device("meta"):
    model = transformers.Qwen3ForCausalLM(hf_cfg)
  # `parameters()` de-duplicates the tied head, as our tree (no lm_head) does.
  want = sum(p.numel() for p in model.parameters())
  assert ours == want, (name, ours, want)
  assert {"0.6B": 596_049_920, "8B": 8_190_735_360}[name.split("-")[1]] == want
  # Every leaf is a ShapeDtypeStruct (nothing allocated) mapped 1:1 to an HF tensor of that shape.
  hf_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
  for path, leaf in checkpoint.flatten(shapes).items():
    assert not hasattr(leaf, "addressable_data")
    hf_name, hook = checkpoint.ours_to_hf(path)
    assert hf_shapes[hf_name] == (tuple(leaf.shape)[::-1] if hook else tuple(leaf.shape)), path
