"""The logged learning rate is the optimizer's: its own count, carried across stages."""
import math

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
  # Linear warm-up from lr / 4 (update 1) to lr (update 4), then constant.
  assert rates == pytest.approx([0.75e-4, 1.5e-4, 2.25e-4, 3e-4, 3e-4, 3e-4], rel=1e-6)
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


def test_schedules_by_hand():
  """Values written out from the definitions: warm-up (s + 1) / warmup * lr; then cosine
  from lr down to min_lr_ratio * lr over total_steps - warmup steps:
  lr * (a + (1 - a) * (1 + cos(pi * k / K)) / 2), k steps after the warm-up."""
  const = optim.make_schedule(optim.OptimizerConfig(learning_rate=2.0, warmup_steps=0))
  assert [float(const(s)) for s in (0, 1, 1000)] == [2.0, 2.0, 2.0]
  cfg = optim.OptimizerConfig(learning_rate=1.0, warmup_steps=2, schedule="warmup_cosine",
                              total_steps=6, min_lr_ratio=0.1)
  lr = optim.make_schedule(cfg)
  c = math.cos(math.pi / 4)
  expected = [0.5, 1.0,                       # warm-up
              1.0, 0.1 + 0.9 * (1 + c) / 2, 0.55, 0.1 + 0.9 * (1 - c) / 2,
              0.1, 0.1, 0.1]                  # the floor from step 6 on
  assert [float(lr(s)) for s in range(9)] == pytest.approx(expected, rel=1e-6)
  no_warm = optim.make_schedule(optim.OptimizerConfig(
      learning_rate=3.0, warmup_steps=0, schedule="warmup_cosine", total_steps=2))
  assert [float(no_warm(s)) for s in range(3)] == pytest.approx([3.0, 1.5, 0.0], abs=1e-6)
