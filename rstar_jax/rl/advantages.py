"""Group-relative advantage estimators (rStar2-Agent report, GRPO-RoC), after down-sampling.

Each estimator maps the rewards of ONE prompt group (the kept G rollouts) to one advantage
per rollout; the loss broadcasts it over the rollout's tokens.

  grpo:    A_i = (r_i - mean(r)) / (std(r) + eps)
  dr_grpo: A_i = r_i - mean(r)          (Dr. GRPO: no std normalisation)

`std_ddof=1` (the sample std, torch.std's default, which verl and so the release use) by
default; `std_ddof=0` gives the population std. A group of one rollout gets advantage 0 (no
relative signal; ddof=1 would be undefined). Host-side numpy: groups differ in size once
groups are dropped, and this runs once per step on a few thousand floats.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

from rstar_jax.registry import Registry

__all__ = [
    "AdvantageConfig",
    "ESTIMATORS",
    "register",
    "get",
    "group_advantages",
    "compute_advantages",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdvantageConfig:
  """Attributes:
    estimator: a registered estimator ("grpo", "dr_grpo"; "dr-grpo" is accepted too).
    eps: added to the std in "grpo" (an all-equal group gives 0, not NaN).
    std_ddof: delta degrees of freedom of the std (1: sample std, as verl).
  """
  estimator: str = "grpo"
  eps: float = 1e-6
  std_ddof: int = 1

  def __post_init__(self):
    get(self.estimator)  # Raises with the known names.
    if not (self.eps > 0 and math.isfinite(self.eps)):   # 0: an all-equal group is 0/0
      raise ValueError(f"AdvantageConfig.eps must be finite and > 0, got {self.eps}")
    if self.std_ddof not in (0, 1):
      raise ValueError(f"AdvantageConfig.std_ddof must be 0 or 1, got {self.std_ddof}")


Estimator = Callable[[np.ndarray, AdvantageConfig], np.ndarray]
ESTIMATORS: Registry = Registry("advantage estimator", aliases={"dr-grpo": "dr_grpo"})
register = ESTIMATORS.register
get = ESTIMATORS.lookup


@register("grpo")
def _grpo(rewards: np.ndarray, config: AdvantageConfig) -> np.ndarray:
  if rewards.size <= config.std_ddof:
    return np.zeros_like(rewards)
  std = rewards.std(ddof=config.std_ddof)
  return (rewards - rewards.mean()) / (std + config.eps)


@register("dr_grpo")
def _dr_grpo(rewards: np.ndarray, config: AdvantageConfig) -> np.ndarray:
  del config
  return rewards - rewards.mean()


def group_advantages(rewards: Sequence[float] | np.ndarray,
                     config: AdvantageConfig = AdvantageConfig()) -> np.ndarray:
  """Advantages (float32, same length) of one group's rewards."""
  r = np.asarray(rewards, dtype=np.float64)
  if r.ndim != 1:
    raise ValueError(f"rewards of a group must be 1-D, got shape {r.shape}")
  if not np.all(np.isfinite(r)):
    raise ValueError(f"rewards must be finite, got {r}")
  if r.size == 0:
    return np.zeros(0, dtype=np.float32)
  return get(config.estimator)(r, config).astype(np.float32)


def compute_advantages(groups: Sequence[Sequence[float] | np.ndarray],
                       config: AdvantageConfig = AdvantageConfig()) -> list[np.ndarray]:
  """Per group, the advantages of its (kept) rollouts; empty groups give empty arrays."""
  out = []
  for g, rewards in enumerate(groups):
    try:
      out.append(group_advantages(rewards, config))
    except ValueError as e:
      raise ValueError(f"group {g}: {e}") from None
  return out
