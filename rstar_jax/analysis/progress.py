"""The recipe's progress plot: accuracy, tool-error rate inside correct trajectories and
response length over the RL steps of every stage, with the stage boundaries.

A step whose row lacks a metric (a rate over nothing, e.g. the tool-error rate inside
correct trajectories at a step with no correct trajectory: rollout/stats.py) is a gap
in its curve, never a 0."""
from __future__ import annotations

import math
import os
from typing import Any, Sequence

import numpy as np

KEYS = (("rollout/reward_mean", "accuracy (sampled, all rollouts)"),
        ("rollout/tool_error_rate_correct", "tool-error rate in correct trajectories"),
        ("rollout/model_tokens_mean", "response length (model tokens)"))
# Shares in [0, 1]: their axis is that range, whatever the values (a flat curve at 0.05
# on a 0.04-0.06 axis reads as a swing).
RATES = ("rollout/reward_mean", "rollout/tool_error_rate_correct")
# Why a panel can have no value at all: printed in it instead of an empty frame.
NO_VALUE = {"rollout/tool_error_rate_correct":
            "no step had a correct trajectory that called the tool"}


def _value(row: dict[str, Any], key: str) -> float:
  """The row's number for `key`; NaN (a gap) when missing: no key, null, a non-number."""
  v = row.get(key)
  if isinstance(v, bool) or not isinstance(v, (int, float, str)):
    return math.nan
  try:
    return float(v)   # "nan" / "inf": how the writer keeps non-finite values in JSON
  except ValueError:
    return math.nan


def rl_series(workdir: str, stages: Sequence[str], keys: Sequence[str] = tuple(k for k, _ in KEYS)
              ) -> dict[str, Any]:
  """The RL steps of `stages` one after another: "step" (global), "stage" (its name per
  step), "starts" ({stage: first global step - 0.5}) and each key (NaN where missing).
  Empty ("step" of length 0) when no stage has logged a step."""
  from rstar_jax import jsonl
  rows, offset = [], 0
  for stage in stages:
    path = os.path.join(workdir, stage, "metrics_rl.jsonl")
    if not os.path.exists(path):
      continue
    stage_rows = jsonl.read_jsonl(path)
    for r in stage_rows:
      rows.append({**r, "global_step": r["step"] + offset, "stage": stage})
    offset += max((r["step"] for r in stage_rows), default=0)
  out: dict[str, Any] = {"step": np.asarray([r["global_step"] for r in rows], dtype=float),
                         "stage": [r["stage"] for r in rows], "starts": {}}
  for r in rows:
    out["starts"].setdefault(r["stage"], r["global_step"] - 0.5)
  for k in keys:
    out[k] = np.asarray([_value(r, k) for r in rows], dtype=float)
  return out


def plot_rl_progress(workdir: str, stages: Sequence[str]) -> str | None:
  """PNG of accuracy, tool-error rate inside correct trajectories, response length."""
  series = rl_series(workdir, stages)
  if not len(series["step"]):
    return None
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker
  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  x = series["step"]
  for ax, (k, title) in zip(axes, KEYS):
    # NaN breaks the line: a step without a value is a gap; markers keep a lone value visible.
    ax.plot(x, series[k], marker=".")
    # Stage boundaries: stage 3 trains on the hard subset only, so its accuracy drops.
    for stage, at in series["starts"].items():
      ax.axvline(at, color="gray", linestyle=":", linewidth=1)
      ax.text(at, 1.0, f" {stage}", transform=ax.get_xaxis_transform(), fontsize=8,
              va="top", color="gray")
    missing = int(np.isnan(series[k]).sum())
    if missing == len(x):   # an empty frame with a made-up axis says nothing: say why
      ax.text(0.5, 0.5, NO_VALUE.get(k, "no value at any step"), transform=ax.transAxes,
              ha="center", va="center", wrap=True, color="gray")
      title += "\n(no value at any step)"
    elif missing:
      title += f"\n({missing} step(s) without a value: gaps)"
    ax.set_title(title)
    if k in RATES:
      ax.set_ylim(-0.03, 1.03)
    elif not np.isnan(series[k]).all():
      ax.set_ylim(0, max(1.0, float(np.nanmax(series[k]))) * 1.05)   # lengths from 0
    ax.set_xlim(x.min() - 0.5, x.max() + 0.5)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
  fig.tight_layout()
  path = os.path.join(workdir, "rl_progress.png")
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path
