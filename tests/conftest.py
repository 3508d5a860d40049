"""Shared fixtures. Tests run on CPU; tiny models keep compile times small."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_BEAUTY = os.path.join(REPO_ROOT, "..", "shared", "data", "amazon_beauty")


@pytest.fixture(scope="session")
def tiny_lm():
  """(config, params) of a tiny random Qwen3 with peaked distributions (weights scaled up), so
  decoding commits several tokens per step and argmax ties are impossible in practice."""
  from dgr2_jax.model import qwen3
  from dgr2_jax.model.config import Qwen3Config
  cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                    mask_token_id=63, eos_token_id=5, pad_token_id=0)
  params = qwen3.init_params(cfg, jax.random.PRNGKey(1))
  params = jax.tree_util.tree_map(lambda x: x * 8 if x.ndim == 2 else x, params)
  return cfg, params
