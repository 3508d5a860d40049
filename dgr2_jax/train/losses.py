"""Pure training losses of the AR stages. `sft_loss` = next-token loss on the assistant message.

Batch layout (the task pipeline's; see the brief): `prompt_ids [b,P]` LEFT-padded, `prompt_len [b]`,
`response_ids [b,R]` RIGHT-padded, `response_mask`, `reasoning_mask`, `answer_mask` [b,R].
The model reads the single stream `[prompt_ids | response_ids]` (S = P + R slots) with a causal
mask over real tokens and positions counted from each row's first real prompt token
(`masks.left_pad_positions`). The logits at slot p predict slot p + 1, so response token r (slot
P + r) is predicted by the hidden state at slot P + r - 1: the last prompt token for r = 0. Only
those R hidden states are projected to the vocabulary (`qwen3.lm_head`), never the prompt's, and
in chunks of positions (`model/logits.py`), so no `[b, R, V]` array is ever held.

Weights: w[r] = response_mask[r] * (reasoning_weight * reasoning_mask[r] + answer_weight *
answer_mask[r]) (a token in neither span has weight 0). loss = sum(w * nll) / sum(w): normalised
by the weighted token count of the whole batch (not per row), which is also returned as
metrics["denominator"] so gradient accumulation reproduces the big-batch loss exactly.
AR SFT always uses the causal mask, whatever the model config's block size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dgr2_jax.model import logits as logits_lib
from dgr2_jax.model import masks
from dgr2_jax.model import qwen3


def ar_inputs(batch: dict):
  """-> tokens [b,S], positions [b,S], causal key ranges (`attention.Ranges`) of `[prompt | response]`."""
  prompt, response = batch["prompt_ids"], batch["response_ids"]
  p, r = prompt.shape[1], response.shape[1]
  tokens = jnp.concatenate([prompt, response], axis=1).astype(jnp.int32)
  positions = masks.left_pad_positions(batch["prompt_len"], p, p + r)
  return tokens, positions, masks.sequence_ranges(batch["prompt_len"], p, p + r, 1)


def response_hidden(model_config, params, batch: dict) -> jax.Array:
  """Final hidden states [b,R,E]; row r predicts response token r (the AR shift)."""
  tokens, positions, mask = ar_inputs(batch)
  p, r = batch["prompt_ids"].shape[1], batch["response_ids"].shape[1]
  hidden, _ = qwen3.forward(model_config, params, tokens, positions, mask, return_hidden=True)
  return hidden[:, p - 1:p + r - 1]


def response_logits(model_config, params, batch: dict) -> jax.Array:
  """f32 logits [b,R,V] (small vocabularies and tests; losses use `response_hidden` + chunks)."""
  return qwen3.lm_head(model_config, params, response_hidden(model_config, params, batch))


def token_nll(model_config, params, hidden, targets):
  """(-log p(target) [..], argmax == target [..]) from hidden [.., E], in vocabulary chunks."""
  def one(lg, t):
    logz = jax.nn.logsumexp(lg, axis=-1)
    return logz - jnp.take_along_axis(lg, t[:, None], axis=-1)[:, 0], jnp.argmax(lg, axis=-1) == t
  return logits_lib.per_position(model_config, params, one, hidden, targets.astype(jnp.int32))


def sft_loss(model_config, params, batch: dict, *, reasoning_weight: float = 1.0,
             answer_weight: float = 1.0) -> tuple[jax.Array, dict]:
  """Weighted next-token cross-entropy on the response -> (loss, metrics); see module docstring."""
  targets = batch["response_ids"].astype(jnp.int32)
  nll, hit = token_nll(model_config, params, response_hidden(model_config, params, batch), targets)  # [b,R]
  resp = batch["response_mask"].astype(jnp.float32)
  reas = batch["reasoning_mask"].astype(jnp.float32) * resp
  ans = batch["answer_mask"].astype(jnp.float32) * resp
  w = reasoning_weight * reas + answer_weight * ans
  denom = jnp.sum(w)
  loss = jnp.sum(w * nll) / jnp.maximum(denom, 1e-9)
  correct = hit.astype(jnp.float32)

  def mean_on(m, x):
    return jnp.sum(m * x) / jnp.maximum(jnp.sum(m), 1.0)
  metrics = {
      "nll_reasoning": mean_on(reas, nll),
      "nll_answer": mean_on(ans, nll),
      "token_accuracy": mean_on(resp, correct),
      "answer_accuracy": mean_on(ans, correct),
      "response_tokens": jnp.sum(resp),
      "denominator": denom,
  }
  return loss, metrics


def choice_positions(tokens, choice_after_id: int):
  """[b,R] bool: the positions right after a `choice_after_id` token (' #': the candidate numbers the
  reasoning names, where the first pick is decided)."""
  prev = jnp.concatenate([jnp.full_like(tokens[:, :1], -1), tokens[:, :-1]], 1)
  return prev == choice_after_id
