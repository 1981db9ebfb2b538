"""A sweep's results: the tables it writes and the curves a notebook plots.

The tables read each point's `eval_final.json` (and the last row of the last RL stage's
metrics) and average the finished points that differ only in `seed`; the curves are the
RL stages' metrics per step.
"""
from __future__ import annotations

import csv
import io
import json
import os
import warnings
from typing import Any, Mapping, Sequence

import numpy as np

from rstar_jax import jsonl
from rstar_jax.recipe import sweep_points

# Columns of the tables, from eval_final.json (rstar_jax.eval.pass_at_k.EvalReport).
EVAL_KEYS = ("pass_at_1", "tool_error_rate_correct", "tool_error_rate", "mean_response_tokens",
             "mean_response_tokens_correct", "tool_calls_per_trajectory", "share_no_tool_call",
             "share_truncated", "mean_turns")
# From the last row of the last RL stage's metrics_rl.jsonl, prefixed "last_rl/".
STAGE_KEYS = ("rollout/reward_mean", "rollout/tool_error_rate_correct",
              "rollout/model_tokens_mean")
STAGE_DIRS = ("stage1", "stage2", "stage3")
NO_SIGNAL_KEY = "no_signal_stages"


# ---- tables ------------------------------------------------------------------------------
def point_metrics(point: sweep_points.Point) -> dict[str, Any]:
  """The point's final metrics: EVAL_KEYS (+ pass@k) from eval_final.json, and the last
  row of the last RL stage's metrics_rl.jsonl as `last_rl/<key>`. {} when neither exists."""
  out: dict[str, Any] = {}
  path = os.path.join(point.workdir, sweep_points.FINAL_REPORT)
  if os.path.exists(path):
    try:
      with open(path) as f:
        report = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
      raise sweep_points.SweepError(f"{path}: unreadable report ({e})") from None
    for k in EVAL_KEYS:
      if k in report:
        out[k] = report[k]
    for k, v in sorted((report.get("pass_at_k") or {}).items(), key=lambda kv: int(kv[0])):
      if str(k) != "1":
        out[f"pass_at_{k}"] = v
  for stage in reversed(STAGE_DIRS):
    path = os.path.join(point.workdir, stage, "metrics_rl.jsonl")
    if os.path.exists(path):
      row = jsonl.last_jsonl_row(path)
      if row:
        out["last_rl/stage"] = stage
        out["last_rl/step"] = row.get("step")
        for k in STAGE_KEYS:
          if k in row:
            out[f"last_rl/{k.split('/', 1)[-1]}"] = row[k]
      break
  # RL stages that trained without a learning signal (every group all-correct or
  # all-wrong: zero advantages), from their DONE.json; "none" when every finished stage
  # had one, absent when no RL stage finished.
  done = {}
  for stage in STAGE_DIRS:
    path = os.path.join(point.workdir, stage, "DONE.json")
    if os.path.exists(path):
      try:
        with open(path) as f:
          done[stage] = json.load(f)
      except (OSError, json.JSONDecodeError) as e:
        raise sweep_points.SweepError(f"{path}: unreadable stage marker ({e})") from None
  if done:
    out[NO_SIGNAL_KEY] = " ".join(s for s, d in done.items()
                                  if d.get("no_learning_signal")) or "none"
  return out


def result_rows(
    points: Sequence[sweep_points.Point],
    outcomes: Sequence[sweep_points.Outcome] | None = None
) -> tuple[list[dict[str, Any]], list[str]]:
  """One row per point (name, status, swept keys, metrics) and the metric columns.

  Status: "finished", "failed" or "interrupted" from `outcomes`; without them (a
  notebook reading a sweep) "finished" when its marker holds (for points from
  `sweep_points.load_points`: with the command sweep.json records), "stale" when it
  finished with another command (its results are of other settings), else "missing"."""
  status = {o.point.name: o.status for o in outcomes or ()}
  keys = sorted({k for p in points for k in p.overrides})
  rows, metric_cols = [], []
  for p in points:
    m = point_metrics(p)
    st = status.get(p.name) or ("finished" if sweep_points.finished(p) else
                                "stale" if sweep_points.marker(p) else "missing")
    if st in ("skipped", "done"):
      st = "finished"
    row = {"point": p.name, "status": st}
    row.update(
        {k: sweep_points.format_value(p.overrides[k]) if k in p.overrides else "" for k in keys})
    row.update(m)
    for k in m:
      if k not in metric_cols:
        metric_cols.append(k)
    rows.append(row)
  order = [k for k in EVAL_KEYS if k in metric_cols]
  order += sorted(k for k in metric_cols if k.startswith("pass_at_") and k not in order)
  order += [k for k in metric_cols if k not in order]
  for row in rows:   # a metric a point lacks (null, no such key) is missing: "n/a"
    for k in order:
      row.setdefault(k, None)
  return rows, ["point", "status", *keys, *order]


def _numeric(v) -> float | None:
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    return None
  return float(v) if np.isfinite(v) else None


def seed_rows(points: Sequence[sweep_points.Point], rows: Sequence[Mapping[str, Any]],
              metric_cols: Sequence[str]) -> tuple[list[dict[str, Any]], list[str]]:
  """Points that differ only in `seed`, grouped: n finished points, the seeds left out
  (with their status), then per metric "mean ± std" over the finished points that have
  a value (a missing one, e.g. a tool-error rate inside correct trajectories of a run
  with none correct, is skipped, never counted as 0; std with ddof=1, as over repeated
  runs; only the mean for one value; "(n=k)" when k values are fewer than the group's
  points; None, "n/a" in the tables, when no point has one). Raw `<metric>_mean` /
  `<metric>_std` go in the dict too (for CSV)."""
  # Which stages lacked a learning signal is text, not a metric: counted per group.
  metric_cols = [c for c in metric_cols if c != NO_SIGNAL_KEY]
  groups: dict[str, list[int]] = {}
  rest_of: dict[str, dict[str, Any]] = {}
  for i, p in enumerate(points):
    rest = {k: v for k, v in p.overrides.items() if k != sweep_points.SEED_KEY}
    g = sweep_points.point_name(rest)
    groups.setdefault(g, []).append(i)
    rest_of[g] = rest
  keys = sorted({k for r in rest_of.values() for k in r})
  out = []
  for g, idx in groups.items():
    row: dict[str, Any] = {"group": g}
    row.update(
        {k: sweep_points.format_value(rest_of[g][k]) if k in rest_of[g] else "" for k in keys})
    seeds = [points[i].overrides.get(sweep_points.SEED_KEY) for i in idx]
    # A sweep without a seed axis: no seeds to list, and a point left out is named.
    label = lambda i: (str(points[i].overrides[sweep_points.SEED_KEY])
                       if sweep_points.SEED_KEY in points[i].overrides else points[i].name)
    row["seeds"] = " ".join(str(s) for s in seeds if s is not None)
    # Only finished points count: an interrupted run's last RL row is from an early step,
    # and a failed or stale point's eval_final.json is from an earlier command.
    done = [i for i in idx if rows[i]["status"] == "finished"]
    row["n"] = len(done)
    row["left out"] = ", ".join(f"{label(i)} ({rows[i]['status']})"
                                for i in idx if i not in done)
    marked = [rows[i].get(NO_SIGNAL_KEY) for i in done if rows[i].get(NO_SIGNAL_KEY)]
    row["no signal"] = (f"{sum(m != 'none' for m in marked)} of {len(marked)}"
                        if marked else None)
    for col in metric_cols:
      vals = [x for x in (_numeric(rows[i].get(col)) for i in done) if x is not None]
      if not vals:
        row[col] = None
        continue
      mean = float(np.mean(vals))
      std = float(np.std(vals, ddof=1)) if len(vals) > 1 else None
      row[f"{col}_mean"], row[f"{col}_std"] = mean, std
      row[col] = _fmt(mean) + (f" ± {_fmt(std)}" if std is not None else "") + \
          (f" (n={len(vals)})" if len(vals) != len(idx) else "")
    out.append(row)
  signal_col = ["no signal"] if any(NO_SIGNAL_KEY in r for r in rows) else []
  return out, ["group", *keys, "seeds", "n", "left out", *signal_col, *metric_cols]


def _fmt(v: Any) -> str:
  if v is None:   # a missing value (rollout/stats.py): never 0, never a blank
    return "n/a"
  if isinstance(v, float):
    return f"{v:.4g}"
  return str(v)


def markdown(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
  esc = lambda s: _fmt(s).replace("|", "\\|")   # None: "n/a"; an absent cell: blank
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(esc(r.get(c, "")) for c in columns) + " |" for r in rows]
  return "\n".join(lines)


def to_csv(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
  buf = io.StringIO()
  w = csv.DictWriter(buf, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
  w.writeheader()
  for r in rows:
    w.writerow({c: "" if r.get(c) is None else r.get(c) for c in columns})
  return buf.getvalue()


def write_tables(sweep_workdir: str, points: Sequence[sweep_points.Point],
                 outcomes: Sequence[sweep_points.Outcome] | None = None) -> str:
  """results.csv (one row per point), results_seeds.csv (mean and std over seeds) and
  results.md (both tables) in the sweep work directory; returns the markdown."""
  rows, cols = result_rows(points, outcomes)
  metric_cols = [c for c in cols if c not in ("point", "status", NO_SIGNAL_KEY) and
                 not any(c in p.overrides for p in points)]
  grouped, gcols = seed_rows(points, rows, metric_cols)
  gcsv_cols = [c for c in gcols if c not in metric_cols]
  for c in metric_cols:
    gcsv_cols += [f"{c}_mean", f"{c}_std"]
  os.makedirs(sweep_workdir, exist_ok=True)
  sweep_points.write_atomic(os.path.join(sweep_workdir, "results.csv"), to_csv(rows, cols))
  sweep_points.write_atomic(os.path.join(sweep_workdir, "results_seeds.csv"),
                            to_csv(grouped, gcsv_cols))
  md = ("## Final metrics per point\n\n" + markdown(rows, cols) +
        "\n\n## Mean ± std over seeds (points that differ only in `seed`; finished points "
        "only, the others are left out; std ddof=1)\n\n" + markdown(grouped, gcols) + "\n")
  sweep_points.write_atomic(os.path.join(sweep_workdir, "results.md"), md)
  return md


# ---- curves (what a notebook plots) -------------------------------------------------------
def point_curves(point: sweep_points.Point, keys: Sequence[str]) -> dict[str, np.ndarray]:
  """Per RL step of a point, stages one after another: "step" (1, 2, ... across stages),
  "stage" (its index in STAGE_DIRS) and each key of `keys` (NaN where a row lacks it).
  Rows that do not parse (a killed run's torn last line) are left out."""
  rows, stages = [], []
  for i, stage in enumerate(STAGE_DIRS):
    path = os.path.join(point.workdir, stage, "metrics_rl.jsonl")
    if not os.path.exists(path):
      continue
    with open(path) as f:
      for line in f:
        try:
          row = json.loads(line)
        except json.JSONDecodeError:
          continue
        if isinstance(row, dict):
          rows.append(row)
          stages.append(i)
  out = {"step": np.arange(1, len(rows) + 1), "stage": np.asarray(stages, dtype=int)}
  for k in keys:
    vals = [_numeric(r.get(k)) for r in rows]
    out[k] = np.asarray([np.nan if v is None else v for v in vals], dtype=float)
  return out


def seed_curves(points: Sequence[sweep_points.Point], key: str) -> dict[str, dict[str, np.ndarray]]:
  """`key` per RL step for every group of points that differ only in `seed`: "step",
  "mean", "std" (ddof=1; NaN with one seed) and "n" (seeds with a value at that step),
  up to the longest run of the group."""
  groups: dict[str, list[np.ndarray]] = {}
  for p in points:
    rest = {k: v for k, v in p.overrides.items() if k != sweep_points.SEED_KEY}
    groups.setdefault(sweep_points.point_name(rest), []).append(point_curves(p, [key])[key])
  out = {}
  for g, curves in groups.items():
    length = max((len(c) for c in curves), default=0)
    table = np.full((len(curves), length), np.nan)
    for i, c in enumerate(curves):
      table[i, :len(c)] = c
    n = np.sum(~np.isnan(table), axis=0)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
      warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: mean is NaN
      mean = np.nanmean(table, axis=0) if length else np.zeros(0)
      std = np.nanstd(table, axis=0, ddof=1) if length else np.zeros(0)
    std = np.where(n > 1, std, np.nan)
    out[g] = {"step": np.arange(1, length + 1), "mean": mean, "std": std, "n": n}
  return out
