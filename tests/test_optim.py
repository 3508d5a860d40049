"""`train.optim`: the optimiser chain against a plain NumPy AdamW, with and without the pull toward
the starting weights (`anchor_decay`, `cft.anchor_decay`)."""

import jax
import ml_collections
import numpy as np
import pytest

from dgr2_jax.train import optim
from dgr2_jax.train.config import train_config


def _opt_cfg(anchor_decay=None) -> ml_collections.ConfigDict:
  o = train_config().optimizer
  o.peak_lr, o.warmup_steps, o.weight_decay, o.clip_norm = 1e-2, 2, 0.1, 0.0
  if anchor_decay is not None:
    with o.unlocked():
      o.anchor_decay = anchor_decay
  return o


def _plain_adamw(o, params: dict, grads: list, total: int, anchor: float) -> dict:
  """AdamW as the paper writes it (bias-corrected moments, decoupled decay on matrices), plus
  lr * anchor * (p - p_start) in the step, in float64 NumPy."""
  sched = optim.make_schedule(o, total)
  start = {k: np.asarray(v, np.float64) for k, v in params.items()}
  p = dict(start)
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v2 = {k: np.zeros_like(v) for k, v in p.items()}
  for t, g in enumerate(grads):
    lr = float(sched(t))
    for k in p:
      gk = np.asarray(g[k], np.float64)
      m[k] = o.b1 * m[k] + (1 - o.b1) * gk
      v2[k] = o.b2 * v2[k] + (1 - o.b2) * gk * gk
      step = (m[k] / (1 - o.b1 ** (t + 1))) / (np.sqrt(v2[k] / (1 - o.b2 ** (t + 1))) + o.eps)
      if p[k].ndim >= 2:
        step = step + o.weight_decay * p[k]
      p[k] = p[k] - lr * (step + anchor * (p[k] - start[k]))
  return p


@pytest.mark.parametrize("anchor", [None, 0.0, 5.0])
def test_optimizer_matches_plain_adamw_with_the_pull_toward_start(anchor):
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(3, 4)).astype(np.float32), "scale": rng.normal(size=(4,)).astype(np.float32)}
  grads = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()} for _ in range(6)]
  o = _opt_cfg(anchor)
  opt, _ = optim.make_optimizer(o, 6)
  p = jax.tree.map(np.asarray, params)
  state = opt.init(p)
  for g in grads:
    updates, state = opt.update(g, state, p)
    p = jax.tree.map(lambda a, u: a + u, p, updates)
  want = _plain_adamw(o, params, grads, 6, anchor or 0.0)
  for k in params:
    np.testing.assert_allclose(np.asarray(p[k]), want[k], rtol=1e-5, atol=1e-6, err_msg=k)
  if anchor:   # the pull really acted: without it the weights end elsewhere
    free = _plain_adamw(o, params, grads, 6, 0.0)
    assert np.abs(free["w"] - want["w"]).max() > 1e-4


def test_no_pull_keeps_adamws_state_so_old_checkpoints_resume():
  params = {"w": np.ones((2, 2), np.float32)}
  plain, _ = optim.make_optimizer(_opt_cfg(), 4)
  off, _ = optim.make_optimizer(_opt_cfg(0.0), 4)
  on, _ = optim.make_optimizer(_opt_cfg(1.0), 4)
  structure = lambda opt: jax.tree_util.tree_structure(opt.init(params))
  assert structure(off) == structure(plain)
  assert structure(on) != structure(plain)
