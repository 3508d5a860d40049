"""benchmarks/decision_probe.py: the jitted first-pick probe against a plain forward of the whole
sequence, one row at a time (the single-stream mask of decode/reference.py): causal for the AR
model, the first block's left-to-right canvas for the block-diffusion one."""

import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from dgr2_jax.decode import sampler
from dgr2_jax.model import masks, qwen3

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import decision_probe  # noqa: E402

B, R, HASH = 4, 8, 9


def _plain_pick(cfg, params, prompt, response, index, block_size):
  """argmax (mask excluded) at response index `index`: the full forward of [prompt | canvas], the
  canvas being the response up to `index` and masks after it (the whole response for AR: the causal
  mask hides the rest); slot P + index - 1 predicts index."""
  p, length = len(prompt), len(prompt) + len(response)
  canvas = np.array(response)
  if block_size > 1:
    canvas[index:] = cfg.mask_token_id
  seq = jnp.asarray(np.concatenate([prompt, canvas])[None], jnp.int32)
  plen = jnp.asarray([p])
  mask = masks.sequence_mask(p, length, block_size, masks.left_pad_valid(plen, p, length))
  logits = np.asarray(qwen3.forward(cfg, params, seq, masks.left_pad_positions(plen, p, length), mask)[0])[0]
  row = logits[p + index - 1].astype(np.float64)
  row[cfg.mask_token_id] = -np.inf
  return int(row.argmax())


@pytest.mark.parametrize("block_size", [1, B])
def test_picks_equal_a_plain_forward_per_row(tiny_lm, block_size):
  cfg, params = tiny_lm
  if block_size > 1:
    cfg = cfg.as_block_diffusion(block_size, cfg.mask_token_id)
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(6, 60, size=k)) for k in (5, 3, 7, 4, 6)]
  response = rng.integers(6, 60, size=(len(prompts), R))
  index = np.array([1, 2, 3, 1, 2])
  toks, lens = sampler.left_pad(prompts, 7, 0)
  got = decision_probe.picks(cfg, params, np.asarray(toks), np.asarray(lens), response, index, batch=3)
  want = [_plain_pick(cfg, params, np.asarray(pr), response[i], index[i], block_size) for i, pr in enumerate(prompts)]
  assert got.tolist() == want
  assert len(set(want)) > 1   # not one token everywhere: the rows are really read


def test_the_canvas_hides_the_rest_of_the_block(tiny_lm):
  """Neither model's pick depends on what follows the index: masked for the diffusion model, unseen
  by the causal one."""
  cfg, params = tiny_lm
  dcfg = cfg.as_block_diffusion(B, cfg.mask_token_id)
  toks, lens = sampler.left_pad([[7, 8, 9, 10]] * 2, 4, 0)
  a = np.array([[11, 12, 13, 14, 15, 16, 17, 18], [11, 12, 40, 41, 42, 43, 44, 45]])
  for c in (cfg, dcfg):
    same = decision_probe.picks(c, params, np.asarray(toks), np.asarray(lens), a, np.array([2, 2]))
    assert same[0] == same[1]


def test_first_choice_index_reads_the_first_block_only():
  rows = np.array([[1, HASH, 3, HASH, 5, 6, 7, 8],    # first ' #' at 1 -> the number at 2
                   [1, 2, 3, 4, HASH, 6, 7, 8],        # ' #' only in the second block
                   [1, 2, HASH, 4, 5, 6, 7, 8],
                   [1, 2, 3, HASH, 5, 6, 7, 8]])       # ' #' last in the block: its number is in the next
  assert decision_probe.first_choice_index(rows, HASH, B).tolist() == [2, -1, 3, -1]


def test_render_names_every_model_and_split():
  rec = {"splits": ["train", "valid"], "models": {"teacher": "t", "cft": "WORKDIR/cft/model"},
         "probe": {s: {"teacher": {"agree": 0.99, "n": 10, "se": 0.01}, "cft": {"agree": 0.9, "n": 10, "se": 0.03}}
                   for s in ("train", "valid")}}
  text = decision_probe.render(rec)
  assert "| cft | 0.9000 (SE 0.0300) | 0.9000 (SE 0.0300) |" in text and "train users" in text
