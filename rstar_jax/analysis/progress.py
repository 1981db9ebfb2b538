"""The recipe's progress plot: accuracy, tool-error rate inside correct trajectories and
response length over the RL steps of every stage, with the stage boundaries."""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np


def plot_rl_progress(workdir: str, stages: Sequence[str]) -> str | None:
  """PNG of accuracy, tool-error rate inside correct trajectories, response length."""
  from rstar_jax import metrics as metrics_lib
  rows, offset = [], 0
  for stage in stages:
    path = os.path.join(workdir, stage, "metrics_rl.jsonl")
    if not os.path.exists(path):
      continue
    stage_rows = metrics_lib.read_jsonl(path)
    for r in stage_rows:
      rows.append({**r, "global_step": r["step"] + offset, "stage": stage})
    offset += max((r["step"] for r in stage_rows), default=0)
  if not rows:
    return None
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  keys = [("rollout/reward_mean", "accuracy (sampled, all rollouts)"),
          ("rollout/tool_error_rate_correct", "tool-error rate in correct trajectories"),
          ("rollout/model_tokens_mean", "response length (model tokens)")]
  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  x = [r["global_step"] for r in rows]
  # Stage boundaries: stage 3 trains on the hard subset only, so its accuracy drops.
  starts = {}
  for r in rows:
    starts.setdefault(r["stage"], r["global_step"] - 0.5)
  for ax, (k, title) in zip(axes, keys):
    y = [float(r.get(k, np.nan)) for r in rows]
    ax.plot(x, y, marker=".")
    for stage, at in starts.items():
      ax.axvline(at, color="gray", linestyle=":", linewidth=1)
      ax.text(at, 1.0, f" {stage}", transform=ax.get_xaxis_transform(), fontsize=8,
              va="top", color="gray")
    ax.set_title(title)
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
  fig.tight_layout()
  path = os.path.join(workdir, "rl_progress.png")
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path
