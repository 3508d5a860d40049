"""The sampled draw (decode/sampling.py: an inverse CDF over chunked cumulative sums) against NumPy's
searchsorted and against the distribution it samples (chi-square, which fails for a wrong one),
and the decoder's one-pass sampled choice against the general path the reference decoder runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from dgr2_jax.decode import sampler, sampling


def _check_draws(p, u, idx):
  """Each index lies in its interval of the float64 CDF (up to f32 rounding) and has p > 0."""
  p = np.asarray(p, np.float64)
  c = np.cumsum(p, -1)
  t = np.asarray(u, np.float64) * c[..., -1]
  lo = np.take_along_axis(np.concatenate([np.zeros_like(c[..., :1]), c], -1), idx[..., None], -1)[..., 0]
  hi = np.take_along_axis(c, idx[..., None], -1)[..., 0]
  eps = 1e-5 * c[..., -1]
  assert (np.take_along_axis(p, idx[..., None], -1)[..., 0] > 0).all()
  assert ((lo - eps <= t) & (t <= hi + eps)).all()
  # and it is searchsorted's answer wherever the target is not within rounding of a boundary
  ref = np.stack([np.searchsorted(ci, ti, side="right") for ci, ti in zip(c.reshape(-1, c.shape[-1]), t.ravel())])
  clear = (t - lo > eps) & (hi - t > eps)
  np.testing.assert_array_equal(idx.ravel()[clear.ravel()], ref[clear.ravel()])


@pytest.mark.parametrize("chunk", [1, 3, 4, 512])
def test_inverse_cdf_matches_searchsorted(chunk):
  rs = np.random.RandomState(chunk)
  p = rs.exponential(size=(64, 37)).astype(np.float32)
  p[rs.rand(*p.shape) < 0.3] = 0.0          # empty intervals, whole empty chunks among them
  p[:, 8:16] = 0.0
  p[:, -1] = 0.0                             # a last entry of probability 0 (the mask token's place)
  p[:, 0] += 1e-3                            # every row has mass
  u = rs.rand(64).astype(np.float32)
  idx = np.asarray(sampling.inverse_cdf(jnp.asarray(p), jnp.asarray(u), chunk=chunk))
  _check_draws(p, u, idx)


def test_inverse_cdf_edges():
  p = jnp.asarray([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0, 0.0]], jnp.float32)
  at = lambda u, chunk: int(sampling.inverse_cdf(p, jnp.asarray([u], jnp.float32), chunk=chunk)[0])
  for chunk in (2, 3, 7):
    assert at(0.0, chunk) == 1                            # the first nonempty interval, not index 0
    assert at(0.25, chunk) == 3                           # a boundary belongs to the interval it opens
    assert at(0.7499, chunk) == 3 and at(0.75, chunk) == 4
    assert at(np.nextafter(np.float32(1), np.float32(0)), chunk) == 4   # never the empty tail
    assert at(1.0, chunk) == 4                            # even past the end (rounding): the last nonempty


def _chi2_pvalue(draws, probs):
  obs = np.bincount(draws, minlength=len(probs)).astype(float)
  keep = probs > 0
  assert obs[~keep].sum() == 0, "drew an entry of probability 0"
  return scipy.stats.chisquare(obs[keep], probs[keep] * obs.sum() / probs[keep].sum()).pvalue


def test_categorical_follows_its_distribution():
  logits = jnp.asarray([0.0, 1.0, -jnp.inf, 2.0, -1.0, -jnp.inf, 0.5, -3.0, 1.5], jnp.float32)
  probs = np.asarray(jax.nn.softmax(logits), np.float64)
  keys = jax.random.split(jax.random.PRNGKey(3), 40_000)
  for chunk in (2, 512):   # two levels over several chunks, and one chunk
    draw = jax.jit(jax.vmap(lambda k: sampling.inverse_cdf(
        jnp.exp(logits - logits.max()), jax.random.uniform(k, (), jnp.float32), chunk=chunk)))
    draws = np.asarray(draw(keys))
    assert _chi2_pvalue(draws, probs) > 1e-3
  draws = np.asarray(jax.jit(jax.vmap(lambda k: sampling.categorical(k, logits)))(keys))
  assert _chi2_pvalue(draws, probs) > 1e-3
  # the same test rejects a distribution that is a little off
  wrong = probs.copy()
  wrong[[1, 3]] = wrong[[1, 3]] * [1.1, 0.95]
  assert _chi2_pvalue(draws, wrong / wrong.sum()) < 1e-6


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_one_pass_choice_equals_the_general_path(temperature):
  """sampler.choose's unfiltered routes (the decoder) against decoding_logprobs + choose_tokens
  (the reference decoder's path), same keys: tokens equal, log-probs to 1e-5."""
  v, mask_id = 300, 7
  logits = jax.random.normal(jax.random.PRNGKey(0), (4, 32, v)) * 3.0
  keys = jax.random.split(jax.random.PRNGKey(1), 4)
  if temperature == 0.0:
    fast = sampler._greedy_choice(logits, mask_id)
  else:
    fast = jax.vmap(lambda k, lg: sampler._sampled_choice(k, lg, temperature, mask_id))(keys, logits)
  lp = sampling.decoding_logprobs(logits, temperature, 0, 1.0, mask_id)
  tok = jax.vmap(lambda k, l: sampling.choose_tokens(k, l, temperature))(keys, lp)
  np.testing.assert_array_equal(np.asarray(fast[0]), np.asarray(tok))
  np.testing.assert_allclose(np.asarray(fast[1]), np.asarray(jnp.take_along_axis(lp, tok[..., None], -1)[..., 0]),
                             atol=1e-5)
  assert (np.asarray(fast[0]) != mask_id).all()
