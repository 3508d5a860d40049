"""Scanned layers: the same function as the unrolled stack (values and gradients), every remat
policy, the stacked <-> per-layer layouts round-trip through a model directory and an HF one, and
decoding with stacked params equals decoding with per-layer ones."""

import os

import jax
import numpy as np
import pytest

from dgr2_jax.decode import sampler
from dgr2_jax.model import checkpoint, qwen3
from dgr2_jax.model.config import REMAT_POLICIES
from dgr2_jax.train import losses, synthetic


@pytest.fixture(scope="module")
def model(tiny_lm):
  cfg, params = tiny_lm
  return cfg.replace(num_hidden_layers=2), params


def _loss(cfg, batch):
  return lambda p: losses.sft_loss(cfg, p, batch)


@pytest.mark.parametrize("attention", ["xla", "blockwise"])
def test_scan_equals_unrolled_values_and_gradients(model, attention):
  cfg, params = model
  cfg = cfg.replace(attention_impl=attention)
  batch = synthetic.SyntheticSFTIterator(3, 7, 9, cfg.vocab_size, seed=1).batch(0)
  stacked = qwen3.stack_layers(params)
  assert qwen3.is_stacked(stacked) and jax.tree_util.tree_leaves(stacked["layers"])[0].shape[0] == 2
  (l0, _), g0 = jax.jit(jax.value_and_grad(_loss(cfg, batch), has_aux=True))(params)
  for policy in REMAT_POLICIES[:3]:  # offload_dots needs a device with pinned host memory
    scfg = cfg.replace(scan_layers=True, remat=True, remat_policy=policy)
    (l1, _), g1 = jax.jit(jax.value_and_grad(_loss(scfg, batch), has_aux=True))(stacked)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(qwen3.unstack_layers(g1)), jax.tree_util.tree_leaves(g0)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, err_msg=policy)


def test_layouts_round_trip_and_decode(model, tmp_path):
  cfg, params = model
  stacked = qwen3.stack_layers(params)
  back = qwen3.unstack_layers(stacked)
  assert set(back) == set(params)
  for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # A fresh scanned init is stacked; its logical axes lead with the (unsharded) layer axis.
  scfg = cfg.replace(scan_layers=True)
  init = qwen3.init_params(scfg, jax.random.PRNGKey(0))
  assert qwen3.is_stacked(init)
  axes = qwen3.param_logical_axes(init)
  assert axes["layers"]["layer"]["self_attn"]["q_proj"]["kernel"] == (None, "embed", "heads")
  # Model dirs are always per layer: saving stacked params writes the checkpoint layout.
  checkpoint.save_model_dir(str(tmp_path / "ours"), scfg, stacked)
  c2, p2 = checkpoint.load_model_dir(str(tmp_path / "ours"))
  assert not qwen3.is_stacked(p2) and not c2.scan_layers
  checkpoint.save_hf_dir(str(tmp_path / "hf"), scfg, stacked)
  assert os.path.exists(tmp_path / "hf" / "model.safetensors")
  # The decoder unstacks once per call: same outputs as per-layer params.
  dc = sampler.DecodeConfig(block_size=4, threshold=0.3, max_new_tokens=8, eos_ids=(5,), mask_token_id=63, pad_id=0)
  prompts = [[7, 8, 9], [10, 11, 12, 13]]
  a = sampler.generate(scfg, stacked, prompts, dc)
  b = sampler.generate(cfg, params, prompts, dc)
  assert a["output_ids"] == b["output_ids"]
  np.testing.assert_allclose(a["logprob"], b["logprob"], atol=1e-5)


def test_scanned_compile_from_shapes_is_shallow(model):
  """The scanned step's HLO holds one layer body whatever the depth (why compile time drops)."""
  cfg, _ = model
  deep = cfg.replace(num_hidden_layers=8)
  batch = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                 synthetic.SyntheticSFTIterator(2, 5, 7, cfg.vocab_size, seed=0).batch(0))
  sizes = {}
  for scan in (False, True):
    c = deep.replace(scan_layers=scan, remat=True)
    shapes = qwen3.param_shapes(c)
    text = jax.jit(jax.grad(lambda p, b: losses.sft_loss(c, p, b)[0])).lower(shapes, batch).as_text()
    sizes[scan] = len(text)
  assert sizes[True] * 3 < sizes[False], sizes
