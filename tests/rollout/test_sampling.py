"""The sampler's inverse-CDF draw against a float64 numpy reference, and its frequencies."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar_jax.rollout import sampling


def _weights(v, rng):
  """Mass spread over 12 orders of magnitude, with zero runs at both ends and inside."""
  w = rng.rand(v) * 10.0 ** rng.randint(-12, 1, v)
  w[:5] = 0.0
  w[v // 2: v // 2 + 40] = 0.0
  w[-7:] = 0.0
  return w.astype(np.float32)


@pytest.mark.parametrize("v", [37, 300, 2048, 4099])
def test_draw_inverts_the_cumulative_mass(v):
  """Every draw lands in the interval of the token the float64 CDF picks, up to a
  rounding slack far below any probability that matters, and never on zero weight."""
  rng = np.random.RandomState(v)
  w = _weights(v, rng)
  u = np.concatenate([[0.0, np.nextafter(np.float32(1), np.float32(0))],
                      rng.rand(4000)]).astype(np.float32)
  tok = np.asarray(sampling.draw(jnp.asarray(np.tile(w, (len(u), 1))), jnp.asarray(u)))
  assert tok.shape == (len(u),) and tok.dtype == np.int32
  assert np.all(w[tok] > 0), "a zero-weight token was drawn"
  c = np.cumsum(w.astype(np.float64))
  lo, hi = c[tok] - w[tok], c[tok]
  target = u.astype(np.float64) * c[-1]
  slack = 1e-5 * c[-1]
  assert np.all((target >= lo - slack) & (target <= hi + slack))
  ref = np.minimum(np.searchsorted(c, target, side="right"), np.flatnonzero(w)[-1])
  assert np.mean(tok == ref) > 0.999
  assert tok[0] == np.flatnonzero(w)[0]   # u = 0: the first positive token, not a zero


def test_draw_never_picks_zero_weight_where_the_cumulative_sum_is_inexact():
  """At Qwen3's vocabulary (297 blocks of 512) XLA's cumsum can rise across a zero
  block; targets placed exactly in such steps must still land on positive weight."""
  v, rows = 151936, 64
  rng = np.random.RandomState(7)
  blk = sampling._block_size(v)
  w = (rng.rand(rows, v) * 10.0 ** rng.randint(-6, 1, (rows, v))).astype(np.float32)
  nb = -(-v // blk)
  zero_blocks = rng.rand(rows, nb) < 0.4
  w = np.where(np.repeat(zero_blocks, blk, axis=1)[:, :v], 0.0, w).astype(np.float32)
  # The block level as `draw` computes it, to find where its running sum moves on a
  # zero block (or within one: the last positive entry before it, rounding).
  padded = np.pad(w, ((0, 0), (0, nb * blk - v))).reshape(rows, nb, blk)
  mass = np.asarray(jnp.asarray(padded).sum(-1))
  cum = np.asarray(jnp.cumsum(jnp.asarray(mass), axis=-1))
  u = rng.rand(rows).astype(np.float32)
  for r in range(rows):
    steps = np.flatnonzero((mass[r, 1:] == 0) & (cum[r, 1:] != cum[r, :-1])) + 1
    if len(steps):
      k = steps[0]
      u[r] = np.float32(0.5 * (cum[r, k - 1] + cum[r, k]) / cum[r, -1])
  tok = np.asarray(sampling.draw(jnp.asarray(w), jnp.asarray(u)))
  assert np.all(w[np.arange(rows), tok] > 0), "a zero-weight token was drawn"
  c = np.cumsum(w.astype(np.float64), axis=1)
  target = u.astype(np.float64) * c[:, -1]
  lo = c[np.arange(rows), tok] - w[np.arange(rows), tok]
  hi = c[np.arange(rows), tok]
  slack = 1e-4 * c[:, -1]
  assert np.all((target >= lo - slack) & (target <= hi + slack))


def test_sample_frequencies_follow_softmax_and_respect_the_filters():
  v, n = 50, 40000
  rng = np.random.RandomState(0)
  logits = jnp.asarray(rng.randn(v).astype(np.float32) * 2)
  def draws(temperature, top_p, top_k):
    row = lambda x: jnp.full((n,), x)
    return np.asarray(sampling.sample(jnp.tile(logits, (n, 1)), row(3), jnp.arange(n),
                                      row(temperature), row(top_p), row(top_k))[0])
  t = 0.7
  p = np.asarray(jax.nn.softmax(logits / t))
  freq = np.bincount(draws(t, 1.0, 0), minlength=v) / n
  sigma = np.sqrt(p * (1 - p) / n)
  assert np.all(np.abs(freq - p) <= 5 * sigma + 1e-9)
  # top-k 5: only the 5 most likely, renormalised.
  top5 = np.argsort(-p)[:5]
  freq = np.bincount(draws(t, 1.0, 5), minlength=v) / n
  assert set(np.flatnonzero(freq)) <= set(top5)
  q = p[top5] / p[top5].sum()
  assert np.all(np.abs(freq[top5] - q) <= 5 * np.sqrt(q * (1 - q) / n))
  # top-p 0.5: the smallest prefix of the sorted probabilities reaching 0.5.
  order = np.argsort(-p)
  keep = order[:np.searchsorted(np.cumsum(p[order]), 0.5) + 1]
  assert set(np.flatnonzero(np.bincount(draws(t, 0.5, 0), minlength=v))) <= set(keep)


def test_sample_log_probs_are_the_full_vocabulary_log_softmax():
  rng = np.random.RandomState(1)
  logits = jnp.asarray(rng.randn(6, 80).astype(np.float32) * 3)
  temps = jnp.asarray([1.0, 0.5, 0.0, 1.3, 1.0, 0.8])
  tok, lp = sampling.sample(logits, jnp.arange(6), jnp.zeros(6, jnp.int32), temps,
                            jnp.asarray([1.0, 0.9, 1.0, 1.0, 0.3, 1.0]),
                            jnp.asarray([0, 0, 0, 4, 0, 2]))
  scale = np.where(np.asarray(temps) > 0, np.asarray(temps), 1.0)[:, None]
  ref = np.asarray(jax.nn.log_softmax(logits / scale))[np.arange(6), np.asarray(tok)]
  np.testing.assert_allclose(np.asarray(lp), ref, atol=1e-5)
  assert int(tok[2]) == int(jnp.argmax(logits[2]))
