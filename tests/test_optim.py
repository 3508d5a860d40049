"""`train.optim`: the optimiser chain against a plain NumPy AdamW."""

import jax
import ml_collections
import numpy as np
import pytest

from dgr2_jax.train import optim
from dgr2_jax.train.config import train_config


def _opt_cfg(clip_norm: float) -> ml_collections.ConfigDict:
  o = train_config().optimizer
  o.peak_lr, o.warmup_steps, o.weight_decay, o.clip_norm = 1e-2, 2, 0.1, clip_norm
  return o


def _plain_adamw(o, params: dict, grads: list, total: int) -> dict:
  """AdamW as Loshchilov & Hutter write it (global-norm clipping, bias-corrected moments, decoupled
  decay on matrices only) in float64 NumPy, at the schedule's lr of each step."""
  sched = optim.make_schedule(o, total)
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v2 = {k: np.zeros_like(v) for k, v in p.items()}
  for t, g in enumerate(grads):
    lr = float(sched(t))
    norm = np.sqrt(sum(float((np.asarray(v, np.float64) ** 2).sum()) for v in g.values()))
    clip = min(1.0, o.clip_norm / norm) if o.clip_norm > 0 else 1.0
    for k in p:
      gk = np.asarray(g[k], np.float64) * clip
      m[k] = o.b1 * m[k] + (1 - o.b1) * gk
      v2[k] = o.b2 * v2[k] + (1 - o.b2) * gk * gk
      step = (m[k] / (1 - o.b1 ** (t + 1))) / (np.sqrt(v2[k] / (1 - o.b2 ** (t + 1))) + o.eps)
      if p[k].ndim >= 2:
        step = step + o.weight_decay * p[k]
      p[k] = p[k] - lr * step
  return p


@pytest.mark.parametrize("clip_norm", [0.0, 1.0])
def test_optimizer_matches_plain_adamw(clip_norm):
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(3, 4)).astype(np.float32), "scale": rng.normal(size=(4,)).astype(np.float32)}
  grads = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()} for _ in range(6)]
  o = _opt_cfg(clip_norm)
  opt, _ = optim.make_optimizer(o, 6)
  p = jax.tree.map(np.asarray, params)
  state = opt.init(p)
  for g in grads:
    updates, state = opt.update(g, state, p)
    p = jax.tree.map(lambda a, u: a + u, p, updates)
  want = _plain_adamw(o, params, grads, 6)
  for k in params:
    np.testing.assert_allclose(np.asarray(p[k]), want[k], rtol=1e-5, atol=1e-6, err_msg=k)
