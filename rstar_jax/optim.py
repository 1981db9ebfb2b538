"""Optimizers: AdamW with gradient clipping and a warm-up schedule (optax)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

SCHEDULES = ("warmup_constant", "warmup_cosine")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
  """Defaults are the rStar2-Agent report's RL settings (arXiv 2508.20722, training details)."""
  learning_rate: float = 1e-6
  warmup_steps: int = 20
  # Warm-up as a share of total_steps instead (the report's SFT: 4%); the SFT trainer
  # sets total_steps from its data when it is None.
  warmup_ratio: float | None = None
  schedule: str = "warmup_constant"
  total_steps: int | None = None   # required by warmup_cosine
  min_lr_ratio: float = 0.0        # cosine floor, as a fraction of learning_rate
  weight_decay: float = 0.01
  grad_clip_norm: float | None = 1.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8

  def __post_init__(self):
    if not self.learning_rate > 0:
      raise ValueError(f"OptimizerConfig.learning_rate must be > 0, got {self.learning_rate}")
    if self.warmup_steps < 0:
      raise ValueError(f"OptimizerConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
    if self.warmup_ratio is not None and not 0 <= self.warmup_ratio < 1:
      raise ValueError(f"OptimizerConfig.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
    if self.schedule not in SCHEDULES:
      raise ValueError(f"OptimizerConfig.schedule={self.schedule!r}; choose from {SCHEDULES}")
    if (self.schedule == "warmup_cosine" and self.total_steps is not None and
        self.total_steps <= self.warmup):
      raise ValueError("OptimizerConfig.total_steps must exceed the warm-up for "
                       f"warmup_cosine (got {self.total_steps}, warm-up {self.warmup})")
    if self.grad_clip_norm is not None and self.grad_clip_norm <= 0:
      raise ValueError(f"OptimizerConfig.grad_clip_norm must be > 0 or None, got "
                       f"{self.grad_clip_norm!r}")
    if not 0 <= self.min_lr_ratio <= 1:
      raise ValueError(f"OptimizerConfig.min_lr_ratio must be in [0, 1], got "
                       f"{self.min_lr_ratio!r}")

  @property
  def warmup(self) -> int:
    """Warm-up steps: warmup_steps, or warmup_ratio of total_steps when that is set."""
    if self.warmup_ratio is None:
      return self.warmup_steps
    if self.total_steps is None:
      raise ValueError("OptimizerConfig.warmup_ratio needs total_steps (set it, or let the "
                       "SFT trainer set it from its data)")
    return round(self.warmup_ratio * self.total_steps)


def make_schedule(cfg: OptimizerConfig) -> optax.Schedule:
  if cfg.schedule == "warmup_cosine" and cfg.total_steps is None:
    raise ValueError("OptimizerConfig.total_steps must be set for warmup_cosine")
  # Linear warm-up from 0 (step 0 gets lr/warmup, not 0, so no step is wasted).
  warm = cfg.warmup
  if cfg.schedule == "warmup_constant":
    if warm == 0:
      return optax.constant_schedule(cfg.learning_rate)
    return lambda step: cfg.learning_rate * jnp.minimum((step + 1) / warm, 1.0)
  cosine = optax.cosine_decay_schedule(cfg.learning_rate, cfg.total_steps - warm,
                                       alpha=cfg.min_lr_ratio)
  if warm == 0:
    return cosine
  return optax.join_schedules([lambda s: cfg.learning_rate * (s + 1) / warm, cosine], [warm])


def schedule_count(opt_state) -> jax.Array:
  """The optimizer's own update count (carried over from an earlier stage, not advanced
  by skipped steps): the learning-rate schedule is evaluated at it, not at the
  trainer's step."""
  found = [s for s in jax.tree.leaves(
      opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
           if isinstance(s, optax.ScaleByScheduleState)]
  if not found:
    raise ValueError("schedule_count: no schedule state in the optimizer state")
  return found[0].count


def applied_learning_rate(cfg: OptimizerConfig, count_after: int) -> float:
  """The rate of the update that brought the count to `count_after`."""
  return float(make_schedule(cfg)(max(int(count_after) - 1, 0)))


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
  parts = []
  if cfg.grad_clip_norm is not None:
    parts.append(optax.clip_by_global_norm(cfg.grad_clip_norm))
  parts.append(optax.adamw(make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                           weight_decay=cfg.weight_decay))
  return optax.chain(*parts)
