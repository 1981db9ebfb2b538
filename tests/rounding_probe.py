"""Prints a hash of a small Qwen3's loss gradient: the bits this host's XLA:CPU rounding
gives. `RSTAR_TEST_XLA_FLAGS` (docs/testing.md) must change it, or a run under those
flags tests nothing that the plain run did not (tests/conftest.py checks at start).

  XLA_FLAGS=... python -m tests.rounding_probe
"""
import hashlib

import numpy as np


def gradient_hash() -> str:
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from tests import toy_fixtures
  cfg = toy_fixtures.CFG.replace(vocab_size=1000, hidden_size=128, intermediate_size=384,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=32)
  graphdef, state = nnx.split(toy_fixtures.random_model(cfg))
  ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 97)))

  def loss(state):
    model = nnx.merge(graphdef, state)
    hidden, _ = model(ids)
    return jax.nn.logsumexp(model.logits(hidden), -1).mean()
  value, grad = jax.jit(jax.value_and_grad(loss))(state)
  h = hashlib.sha256(np.asarray(value).tobytes())
  for leaf in jax.tree.leaves(grad):
    h.update(np.asarray(leaf).tobytes())
  return h.hexdigest()


if __name__ == "__main__":
  print(gradient_hash())
