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


def sample(logits: jax.Array, seeds: jax.Array, indices: jax.Array, temperature: jax.Array,
           top_p: jax.Array, top_k: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Draws one token per row. Temperature 0 means greedy (argmax).

  Returns (tokens [B] int32, log-probs [B] float32 under softmax(logits / T)).
  """
  logits = logits.astype(jnp.float32)
  greedy = temperature <= 0
  scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
  logp_all = jax.nn.log_softmax(scaled, axis=-1)
  # Sorting the vocabulary is most of a decode step's sampling cost: skip it when no
  # row asks for top-p / top-k.
  filtered = jax.lax.cond(jnp.any(top_p < 1.0) | jnp.any(top_k > 0),
                          lambda z: filter_logits(z, top_p, top_k), lambda z: z, scaled)
  keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(seeds, indices)
  drawn = jax.vmap(jax.random.categorical)(keys, filtered)
  tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
  logp = jnp.take_along_axis(logp_all, tokens[:, None], axis=-1)[:, 0]
  return tokens, logp
