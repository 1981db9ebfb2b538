"""Counters and latency percentiles for /stats."""
from __future__ import annotations

import collections
import math
import time

from sandbox.schema import STATUSES, Result


def percentile(sorted_values: list[float], q: float) -> float:
  """Nearest-rank percentile of an already sorted list (0 when empty)."""
  if not sorted_values:
    return 0.0
  k = min(len(sorted_values) - 1, max(0, math.ceil(q / 100.0 * len(sorted_values)) - 1))
  return sorted_values[k]


class Stats:
  """Totals since start; latency percentiles over the last `window` calls."""

  def __init__(self, window: int = 10_000):
    self.started = time.time()
    self.calls = 0
    self.statuses = collections.Counter({s: 0 for s in STATUSES})
    self.wall = collections.deque(maxlen=window)
    self.cpu_total = 0.0

  def record(self, result: Result) -> None:
    self.calls += 1
    self.statuses[result.status] += 1
    self.wall.append(result.wall_time)
    self.cpu_total += result.cpu_time

  def snapshot(self) -> dict:
    w = sorted(self.wall)
    return {
        "uptime_s": round(time.time() - self.started, 3),
        "calls": self.calls,
        "statuses": dict(self.statuses),
        "cpu_seconds_total": round(self.cpu_total, 3),
        "latency_s": {f"p{q}": round(percentile(w, q), 5) for q in (50, 90, 99)}
                     | {"max": round(w[-1], 5) if w else 0.0, "window": len(w)},
    }
