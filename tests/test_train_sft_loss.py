"""SFT loss vs a plain NumPy reference: per-row unpadded causal forward, log-softmax by hand."""

import jax
import numpy as np
import pytest

from dgr2_jax.model import masks, qwen3
from dgr2_jax.model.config import Qwen3Config
from dgr2_jax.train import losses, synthetic

CFG = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)
_N = 12  # reference sequences are right-padded to this length (causal: pads never affect real tokens)
_forward = jax.jit(lambda p, t: qwen3.forward(CFG, p, t, np.arange(_N)[None],
                                              masks.causal_mask(_N)[None])[0])
_init = jax.jit(lambda r: qwen3.init_params(CFG, r))
_sft = jax.jit(lambda p, b, rw, aw: losses.sft_loss(CFG, p, b, reasoning_weight=rw, answer_weight=aw))


def _reference(params, batch, rw, aw):
  """Each row run alone without padding (positions 0..n-1, plain causal mask); the logits at
  token i give log p(token i+1). Weighted mean over the batch's response tokens."""
  num = den = 0.0
  per_span = {"reasoning": [], "answer": []}
  for b in range(batch["prompt_ids"].shape[0]):
    plen = int(batch["prompt_len"][b])
    rmask = batch["response_mask"][b].astype(bool)
    prompt = batch["prompt_ids"][b, batch["prompt_ids"].shape[1] - plen:]
    resp = batch["response_ids"][b][rmask]
    seq = np.concatenate([prompt, resp])
    seq = np.pad(seq, (0, _N - len(seq)))[None]
    logits = np.asarray(_forward(params, seq)[0], np.float64)
    m = logits.max(-1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    for r in range(len(resp)):
      nll = -logp[plen + r - 1, resp[r]]
      w = rw * batch["reasoning_mask"][b, r] + aw * batch["answer_mask"][b, r]
      num += w * nll
      den += w
      per_span["reasoning" if batch["reasoning_mask"][b, r] else "answer"].append(nll)
  return num / den, den, {k: float(np.mean(v)) for k, v in per_span.items()}


@pytest.mark.parametrize("rw,aw", [(1.0, 1.0), (0.25, 2.0), (0.0, 1.0)])
def test_sft_loss_matches_numpy(rw, aw):
  params = _init(jax.random.PRNGKey(0))
  batch = synthetic.SyntheticSFTIterator(3, 5, 7, CFG.vocab_size, seed=3).batch(0)
  assert batch["prompt_len"].min() < 5 and batch["response_mask"].sum(1).min() < 7  # padding exercised
  loss, metrics = _sft(params, batch, rw, aw)
  ref, den, spans = _reference(params, batch, rw, aw)
  np.testing.assert_allclose(float(loss), ref, rtol=1e-5)
  np.testing.assert_allclose(float(metrics["denominator"]), den, rtol=1e-6)
  np.testing.assert_allclose(float(metrics["nll_reasoning"]), spans["reasoning"], rtol=1e-5)
  np.testing.assert_allclose(float(metrics["nll_answer"]), spans["answer"], rtol=1e-5)
  assert metrics["response_tokens"] == batch["response_mask"].sum()


def test_sft_loss_ignores_padding_content():
  """Changing pad-slot token ids (prompt left pads, response right pads) must not change the loss."""
  params = _init(jax.random.PRNGKey(1))
  batch = synthetic.SyntheticSFTIterator(3, 5, 7, CFG.vocab_size, seed=4).batch(0)
  other = dict(batch)
  p = batch["prompt_ids"].shape[1]
  other["prompt_ids"] = np.where(np.arange(p)[None] < (p - batch["prompt_len"])[:, None], 7, batch["prompt_ids"])
  other["response_ids"] = np.where(batch["response_mask"] > 0, batch["response_ids"], 9)
  a, _ = _sft(params, batch, 0.5, 1.5)
  b, _ = _sft(params, other, 0.5, 1.5)
  np.testing.assert_allclose(float(a), float(b), rtol=1e-6)
