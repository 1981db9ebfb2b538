"""Metrics to TensorBoard (tensorboardX), a JSONL file and the console.

The JSONL file (one object per step) is what notebooks and plots read; TensorBoard
is for watching a run live. In a multi-process job only process 0 writes.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

from absl import logging
import numpy as np

from rstar_jax import distributed


def _scalar(v: Any) -> float | None:
  try:
    f = float(np.asarray(v))
  except (TypeError, ValueError):
    return None
  return f


class MetricsWriter:
  def __init__(self, workdir: str, name: str = "train", tensorboard: bool = True):
    self.path = os.path.join(workdir, f"metrics_{name}.jsonl")
    self._tb = None
    self.enabled = distributed.is_main()
    if not self.enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(workdir, "tb", name))

  def write(self, step: int, metrics: Mapping[str, Any], console_keys=()) -> dict[str, float]:
    flat = {k: s for k, v in metrics.items() if (s := _scalar(v)) is not None}
    if not self.enabled:
      return flat
    with open(self.path, "a") as f:
      f.write(json.dumps({"step": step, **{k: (v if math.isfinite(v) else str(v))
                                           for k, v in flat.items()}}) + "\n")
    if self._tb is not None:
      for k, v in flat.items():
        if math.isfinite(v):
          self._tb.add_scalar(k, v, step)
      self._tb.flush()
    if console_keys:
      logging.info("step %d | %s", step, " | ".join(
          f"{k} {flat[k]:.4g}" for k in console_keys if k in flat))
    return flat

  def truncate_after(self, step: int) -> None:
    """Drops lines past `step` (a resumed run rewrites them), and a line a kill cut off
    part-way. Written whole or not at all (a kill here keeps the old file)."""
    if not self.enabled or not os.path.exists(self.path):
      return
    kept = []
    with open(self.path) as f:
      for line in f:
        try:
          if json.loads(line)["step"] <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
        except (ValueError, KeyError, TypeError):   # a torn last line
          continue
    with open(self.path + ".tmp", "w") as f:
      f.writelines(kept)
    os.replace(self.path + ".tmp", self.path)

  def close(self):
    if self._tb is not None:
      self._tb.close()
