"""A ratio over nothing is missing, never 0 (rollout/stats.py): absent from the metrics
row (JSONL and TensorBoard), null in the report, a gap in the plot, "n/a" in tables.

The reference is counted by hand here: which steps have a correct trajectory, which
a tool call."""
import json
import math
import os

import numpy as np
import pytest

from rstar_jax import metrics_writer as metrics_lib
from rstar_jax import jsonl
from rstar_jax.analysis import progress
from rstar_jax.eval import pass_at_k as eval_metrics
from rstar_jax.rl import roc, rollout_collector
from rstar_jax.rl.roc import DownsampleConfig, RolloutStats
from rstar_jax.rollout import agent_loop, stats


def _traj(reward, calls, errors, tokens=5):
  return agent_loop.Trajectory(uid="u", prompt_ids=[1], response_ids=[2] * tokens,
                               response_mask=[1] * tokens, turns=[(0, tokens)],
                               num_tool_calls=calls, num_tool_errors=errors, reward=reward)


def test_rollout_metrics_leave_out_a_rate_over_nothing():
  # No correct trajectory: the error rate inside correct ones has no call to count.
  wrong = [_traj(0.0, 2, 1), _traj(0.0, 1, 1)]
  m = rollout_collector.metrics(wrong)
  assert "rollout/tool_error_rate_correct" not in m
  assert m["rollout/tool_error_rate"] == pytest.approx(2 / 3)
  assert m["rollout/reward_mean"] == 0.0   # a mean over 2 trajectories: a real 0
  # Correct trajectories without a tool call: still nothing to count.
  m = rollout_collector.metrics([_traj(1.0, 0, 0), _traj(0.0, 1, 0)])
  assert "rollout/tool_error_rate_correct" not in m and m["rollout/tool_error_rate"] == 0.0
  # One that called the tool cleanly: a real 0.
  m = rollout_collector.metrics([_traj(1.0, 3, 0), _traj(0.0, 1, 1)])
  assert m["rollout/tool_error_rate_correct"] == 0.0
  # No trajectory at all (every group dropped): no mean is invented.
  assert rollout_collector.metrics([], prefix="kept/") == {}
  assert stats.tool_stats([]) == {"tool_calls_per_traj": None, "tool_error_rate": None,
                                  "tool_error_rate_correct": None, "no_tool_share": None}


def test_roc_stats_leave_out_rates_of_no_positive():
  neg = lambda calls: RolloutStats(reward=0.0, num_tool_calls=calls, num_tool_errors=0,
                                   num_answer_tags=1, num_turns=1)
  res = roc.downsample([[neg(1), neg(0), neg(2), neg(1)]],
                       DownsampleConfig(group_size=2, drop_equal_reward_groups=False),
                       np.random.default_rng(0))
  s = res.stats
  assert s["roc/all_positives"] == 0 and s["roc/all_tool_error_rate"] == 0.0
  for k in ("roc/kept_pos_tool_error_rate", "roc/all_pos_tool_error_rate",
            "roc/kept_pos_penalty_mean", "roc/all_pos_penalty_mean",
            "roc/all_pos_err_penalty_mean", "roc/kept_pos_format_penalty_mean"):
    assert k not in s, k


def test_eval_report_says_null_and_n_a_for_the_same_quantity():
  recs = [eval_metrics.SampleRecord("p", i, 0.0, 10, 1, 1, 1, False) for i in range(2)]
  report = eval_metrics.compute_report(recs, temperature=1.0)
  assert report.tool_error_rate_correct is None and report.mean_response_tokens_correct is None
  assert json.loads(report.to_json())["tool_error_rate_correct"] is None
  line = next(l for l in report.to_table().splitlines() if "(correct traj.)" in l)
  assert line.split()[-1] == "n/a"


def test_jsonl_rows_lack_the_key_and_the_plot_has_a_gap(tmp_path):
  """Three RL steps; step 2 has no correct trajectory: its row has no
  tool_error_rate_correct (not 0.0), and the progress curve is NaN there."""
  steps = [[_traj(1.0, 2, 1), _traj(0.0, 1, 0)],
           [_traj(0.0, 2, 2), _traj(0.0, 1, 1)],
           [_traj(1.0, 4, 1), _traj(1.0, 0, 0)]]
  workdir = tmp_path / "stage1"
  writer = metrics_lib.MetricsWriter(str(workdir), "rl", tensorboard=False)
  for i, trajs in enumerate(steps, start=1):
    writer.write(i, rollout_collector.metrics(trajs))
  writer.close()
  rows = jsonl.read_jsonl(os.path.join(workdir, "metrics_rl.jsonl"))
  key = "rollout/tool_error_rate_correct"
  assert [r.get(key, "absent") for r in rows] == [0.5, "absent", 0.25]
  series = progress.rl_series(str(tmp_path), ["stage1"])
  y = series[key]
  assert y[0] == 0.5 and math.isnan(y[1]) and y[2] == 0.25
  # A null written by another writer, or an old "nan" string: a gap too, never 0.
  with open(os.path.join(workdir, "metrics_rl.jsonl"), "a") as f:
    f.write(json.dumps({"step": 4, key: None, "rollout/reward_mean": "nan"}) + "\n")
  series = progress.rl_series(str(tmp_path), ["stage1"])
  assert math.isnan(series[key][3]) and math.isnan(series["rollout/reward_mean"][3])
  assert progress.plot_rl_progress(str(tmp_path), ["stage1"]).endswith("rl_progress.png")
