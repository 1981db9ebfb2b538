"""The logged learning rate is the optimizer's: its own count, carried across stages."""
import jax.numpy as jnp

from rstar_jax import optim


def test_applied_learning_rate_follows_the_optimizers_count():
  cfg = optim.OptimizerConfig(learning_rate=3e-4, warmup_steps=4)
  tx = optim.make_optimizer(cfg)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  rates = []
  for _ in range(6):
    _, state = tx.update({"w": jnp.ones(3)}, state, params)
    rates.append(optim.applied_learning_rate(cfg, optim.schedule_count(state)))
  assert rates == [float(optim.make_schedule(cfg)(i)) for i in range(6)]
  assert rates[0] < rates[3] == rates[5]
  # A carried-over state (stage 2 starts at step 0 of its own) goes on from its count:
  # the rate of its first update is the post-warm-up rate, not the warm-up's first.
  _, state = tx.update({"w": jnp.ones(3)}, state, params)
  assert optim.applied_learning_rate(cfg, optim.schedule_count(state)) == rates[5]
