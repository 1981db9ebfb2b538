"""The logged learning rate is the optimizer's: its own count, carried across stages."""
import jax.numpy as jnp
import pytest

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


def test_warmup_ratio_is_a_share_of_total_steps():
  cfg = optim.OptimizerConfig(learning_rate=1.0, warmup_ratio=0.04, total_steps=500,
                              schedule="warmup_cosine")
  assert cfg.warmup == 20
  lr = optim.make_schedule(cfg)
  assert float(lr(19)) == 1.0 and float(lr(9)) == 0.5 and float(lr(499)) < 1e-3
  with pytest.raises(ValueError, match="warmup_ratio needs total_steps"):
    optim.make_schedule(optim.OptimizerConfig(warmup_ratio=0.04))
  with pytest.raises(ValueError, match="warmup_ratio must be in"):
    optim.OptimizerConfig(warmup_ratio=1.5)
