"""Per-row temperature / top-p / top-k sampling with per-request randomness.

Each row draws with `fold_in(PRNGKey(seed), index)`, where `index` is how many tokens
that request has generated so far. A request's tokens therefore do not depend on
which slot it sits in or what else is batched with it: continuous batching gives the
same tokens as generating one request at a time.

The returned log-prob is log softmax(logits / temperature) of the sampled token,
over the FULL vocabulary (top-p / top-k only restrict what can be drawn). That is
the quantity the trainer recomputes (verl's convention), so sampler and trainer
log-probs are comparable.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -1e30


def filter_logits(logits: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
  """Masks logits outside top-k (k <= 0: off) and outside the top-p nucleus (p >= 1: off).

  logits [B, V] (already temperature-scaled), top_p [B] float, top_k [B] int.
  """
  v = logits.shape[-1]
  sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
  kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
  keep = logits >= kth
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
  cum_before = jnp.cumsum(probs, axis=-1) - probs
  n_keep = jnp.maximum(jnp.sum(cum_before < top_p[:, None], axis=-1), 1)
  pth = jnp.take_along_axis(sorted_logits, (n_keep - 1)[:, None], axis=-1)
  keep &= jnp.where(top_p[:, None] < 1.0, logits >= pth, True)
  return jnp.where(keep, logits, _NEG)


def _block_size(vocab: int) -> int:
  """A power of two near sqrt(vocab): the two cumulative sums below stay short."""
  return 1 << max(3, vocab.bit_length() // 2)


def _first(hit: jax.Array, fallback: jax.Array) -> jax.Array:
  """Index of the first True along the last axis, `fallback` where there is none."""
  return jnp.where(hit.any(axis=-1), jnp.argmax(hit, axis=-1), fallback)


def _last_positive(x: jax.Array) -> jax.Array:
  """Index of the last positive entry along the last axis (x >= 0, one positive)."""
  n = x.shape[-1]
  return n - 1 - jnp.argmax(x[..., ::-1] > 0, axis=-1)


def draw(weights: jax.Array, u: jax.Array) -> jax.Array:
  """Inverse-CDF draw: row i picks j with probability weights[i, j] / sum(weights[i]).

  weights [B, V] >= 0 with a positive entry per row, u [B] uniform in [0, 1).
  One uniform per row instead of Gumbel-max's V: on CPU the V random numbers
  (threefry) were most of a decode step's sampling time. The cumulative sum is
  two-level (blocks, then within the chosen block) so that its float32 rounding
  stays near sqrt(V) ulps of the row's mass, not V. XLA's cumsum is not exact (on
  long axes it can step across zero entries and even go down), so a position is the
  first POSITIVE entry whose running sum passes the target, and a zero-weight entry
  is never picked; rounding past the end falls back to the last positive entry.
  """
  b, v = weights.shape
  blk = _block_size(v)
  nb = -(-v // blk)
  w = jnp.pad(weights, ((0, 0), (0, nb * blk - v))).reshape(b, nb, blk)
  block_mass = w.sum(-1)
  cum = jnp.cumsum(block_mass, axis=-1)
  t = u * cum[:, -1]
  i = _first((cum > t[:, None]) & (block_mass > 0), _last_positive(block_mass))
  before = jnp.take_along_axis(cum, i[:, None], -1)[:, 0] - jnp.take_along_axis(
      block_mass, i[:, None], -1)[:, 0]
  inside = jnp.take_along_axis(w, i[:, None, None], 1)[:, 0]
  t_in = jnp.maximum(t - before, 0.0)
  j = _first((jnp.cumsum(inside, axis=-1) > t_in[:, None]) & (inside > 0),
             _last_positive(inside))
  return (i * blk + j).astype(jnp.int32)


def sample(logits: jax.Array, seeds: jax.Array, indices: jax.Array, temperature: jax.Array,
           top_p: jax.Array, top_k: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Draws one token per row. Temperature 0 means greedy (argmax).

  Returns (tokens [B] int32, log-probs [B] float32 under softmax(logits / T)).
  """
  logits = logits.astype(jnp.float32)
  greedy = temperature <= 0
  scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
  top = jnp.max(scaled, axis=-1, keepdims=True)
  weights = jnp.exp(scaled - top)
  log_norm = top[:, 0] + jnp.log(jnp.sum(weights, axis=-1))
  # Sorting the vocabulary is most of the filtering's cost: skip it when no row asks
  # for top-p / top-k. The row's maximum is always kept, so `top` still normalises.
  weights = jax.lax.cond(
      jnp.any(top_p < 1.0) | jnp.any(top_k > 0),
      lambda w: jnp.where(filter_logits(scaled, top_p, top_k) > _NEG / 2, w, 0.0),
      lambda w: w, weights)
  # Greedy rows draw from their maxima: no separate argmax pass over [B, V]. Tied
  # maxima (identical unembedding rows) are picked by the row's uniform, not the
  # lowest index as argmax would.
  weights = jnp.where(greedy[:, None], (scaled >= top).astype(weights.dtype), weights)
  keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(seeds, indices)
  u = jax.vmap(jax.random.uniform)(keys)
  tokens = draw(weights, u)
  logp = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0] - log_norm
  return tokens, logp
