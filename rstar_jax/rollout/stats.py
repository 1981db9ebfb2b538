"""Tool-use statistics of a set of sampled trajectories: the one definition that RL
metrics and evaluation reports share.

A sample is anything with `num_tool_calls`, `num_tool_errors` and `reward` (an agent
loop `Trajectory`, an eval `SampleRecord`); it is correct when reward >= threshold
(rewards are 0/1 in rStar2). Tool errors are counted from the sandbox's status.

A ratio over nothing (the tool-error rate of a step without a tool call, or inside
correct trajectories when none is correct) is missing, never 0: "no call to count"
must not read as "no tool error". The one rule, everywhere: None in Python (`ratio`);
left out of a metrics row (`present`: the JSONL row has no such key, TensorBoard no
point, a plot a gap; a row is strict JSON, which has no NaN, and NaN would also trip
the trainers' finiteness checks); null in a report's JSON (`EvalReport`, whose fields
are fixed); "n/a" in tables, and means over seeds skip it and say over how many.
"""
from __future__ import annotations

from typing import Any, Sequence


def ratio(numerator: float, denominator: float) -> float | None:
  """numerator / denominator, or None (missing) when there was nothing to count."""
  return numerator / denominator if denominator else None


def present(metrics: dict[str, Any]) -> dict[str, Any]:
  """`metrics` without its missing (None) values: what a metrics row logs."""
  return {k: v for k, v in metrics.items() if v is not None}


def tool_stats(samples: Sequence[Any], *, threshold: float = 1.0) -> dict[str, float | None]:
  """tool_calls_per_traj, tool_error_rate (errors / calls), tool_error_rate_correct (the
  same inside correct samples: what RoC lowers) and no_tool_share. Each is None
  (missing) when there was nothing to count: no sample, no call, no correct sample."""
  n = len(samples)
  correct = [s for s in samples if (s.reward or 0.0) >= threshold]
  calls = sum(s.num_tool_calls for s in samples)
  return {
      "tool_calls_per_traj": ratio(calls, n),
      "tool_error_rate": ratio(sum(s.num_tool_errors for s in samples), calls),
      "tool_error_rate_correct": ratio(sum(s.num_tool_errors for s in correct),
                                       sum(s.num_tool_calls for s in correct)),
      "no_tool_share": ratio(sum(s.num_tool_calls == 0 for s in samples), n),
  }
