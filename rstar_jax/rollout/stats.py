"""Tool-use statistics of a set of sampled trajectories: the one definition that RL
metrics and evaluation reports share.

A sample is anything with `num_tool_calls`, `num_tool_errors` and `reward` (an agent
loop `Trajectory`, an eval `SampleRecord`); it is correct when reward >= threshold
(rewards are 0/1 in rStar2). Tool errors are counted from the sandbox's status.
"""
from __future__ import annotations

from typing import Any, Sequence


def ratio(numerator: float, denominator: float) -> float | None:
  return numerator / denominator if denominator else None


def tool_stats(samples: Sequence[Any], *, threshold: float = 1.0) -> dict[str, float | None]:
  """tool_calls_per_traj, tool_error_rate (errors / calls), tool_error_rate_correct (the
  same inside correct samples: what RoC lowers) and no_tool_share. Rates are None
  when there was no call to count."""
  n = len(samples)
  correct = [s for s in samples if (s.reward or 0.0) >= threshold]
  calls = sum(s.num_tool_calls for s in samples)
  return {
      "tool_calls_per_traj": calls / n if n else 0.0,
      "tool_error_rate": ratio(sum(s.num_tool_errors for s in samples), calls),
      "tool_error_rate_correct": ratio(sum(s.num_tool_errors for s in correct),
                                       sum(s.num_tool_calls for s in correct)),
      "no_tool_share": sum(s.num_tool_calls == 0 for s in samples) / n if n else 0.0,
  }
