"""Tests for rstar_jax.eval.pass_at_k: pass@k, tool statistics, the report, the stage-3 filter."""
import itertools
import json
import math

import pytest

from rstar_jax.eval import pass_at_k as em


def _rec(uid, i, reward, tokens=10, calls=0, errors=0, turns=1, truncated=False):
  return em.SampleRecord(uid, i, float(reward), tokens, calls, errors, turns, truncated)


def _brute_pass_at_k(outcomes, k):
  subsets = list(itertools.combinations(outcomes, k))
  return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_matches_brute_force(n):
  for c in range(n + 1):
    outcomes = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
      assert em.pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(outcomes, k), abs=1e-12)


def test_pass_at_k_large_n_is_stable():
  # C(1000, 500) overflows a float; the product form does not.
  value = em.pass_at_k(1000, 3, 500)
  assert 0.0 < value < 1.0 and math.isfinite(value)
  assert value == pytest.approx(1 - (500 * 499 * 498) / (1000 * 999 * 998))
  with pytest.raises(ValueError, match="k <= n"):
    em.pass_at_k(4, 1, 5)
  with pytest.raises(ValueError, match="c <= n"):
    em.pass_at_k(4, 5, 1)


def _records():
  # Problem a: 3/4 correct; b: 0/4; c: 4/4. Tool use varies.
  rows = []
  for i, r in enumerate([1, 1, 0, 1]):
    rows.append(_rec("a", i, r, tokens=100 + i, calls=2, errors=1 if i == 0 else 0, turns=3))
  for i in range(4):
    rows.append(_rec("b", i, 0, tokens=400, calls=1, errors=1, turns=2, truncated=i < 2))
  for i in range(4):
    rows.append(_rec("c", i, 1, tokens=50, calls=0, turns=1))
  return rows


def test_report_numbers():
  records = _records()
  report = em.compute_report(records, temperature=1.0, ks=[1, 2, 4], dataset="toy")
  assert report.samples_per_problem == 4 and report.num_problems == 3 and report.num_samples == 12
  assert report.pass_at_1 == pytest.approx((0.75 + 0.0 + 1.0) / 3)
  assert report.pass_at_k[1] == pytest.approx(report.pass_at_1)  # pass@1 equals the mean.
  expected_p2 = (_brute_pass_at_k([1, 1, 0, 1], 2) + 0 + 1) / 3
  assert report.pass_at_k[2] == pytest.approx(expected_p2)
  assert report.pass_at_k[4] == pytest.approx(2 / 3)
  assert report.mean_response_tokens == pytest.approx(sum(r.response_tokens for r in records) / 12)
  correct = [r for r in records if r.reward == 1]
  assert report.mean_response_tokens_correct == pytest.approx(
      sum(r.response_tokens for r in correct) / len(correct))
  assert report.tool_calls_per_trajectory == pytest.approx((8 + 4 + 0) / 12)
  assert report.tool_error_rate == pytest.approx((1 + 4) / 12)
  # Correct trajectories: a0 (2 calls, 1 error), a1, a3 (2 calls each), c* (no calls).
  assert report.tool_error_rate_correct == pytest.approx(1 / 6)
  assert report.share_truncated == pytest.approx(2 / 12)
  assert report.share_no_tool_call == pytest.approx(4 / 12)
  assert report.mean_turns == pytest.approx((4 * 3 + 4 * 2 + 4) / 12)
  by_uid = {p.uid: p for p in report.per_problem}
  assert (by_uid["a"].num_correct, by_uid["b"].truncated, by_uid["a"].tool_errors) == (3, 2, 1)
  assert [p.uid for p in report.per_problem] == ["a", "b", "c"]


def test_pass_at_1_is_mean_of_fractional_rewards_and_default_ks():
  records = [_rec("a", i, r) for i, r in enumerate([0.5, 1.0, 0.0])]
  records += [_rec("b", i, 1.0) for i in range(3)]
  report = em.compute_report(records, temperature=0.6)
  assert report.pass_at_1 == pytest.approx((0.5 + 1.0) / 2)
  assert sorted(report.pass_at_k) == [1, 2, 3]


def test_no_tool_calls_gives_none_not_zero():
  report = em.compute_report([_rec("a", 0, 1), _rec("a", 1, 0)], temperature=1.0)
  assert report.tool_error_rate is None and report.tool_error_rate_correct is None
  assert "n/a" in report.to_table()


def test_table_and_json_state_temperature_and_k():
  report = em.compute_report(_records(), temperature=0.7, top_p=0.95, ks=[1, 4], dataset="toy")
  table = report.to_table(per_problem=True)
  assert "temperature 0.7" in table and "top_p 0.95" in table and "k = 4" in table
  assert "pass@1 (mean over 4 samples)" in table and "pass@4" in table
  assert "tool error rate (correct traj.)" in table and "16.7%" in table
  assert "3/4" in table  # per-problem row of problem a.
  lines = table.splitlines()
  metric_lines = [l for l in lines if l.startswith(("pass@", "mean response tokens "))]
  assert len({len(l) for l in metric_lines}) == 1  # Fixed width.
  data = json.loads(report.to_json())
  assert data["temperature"] == 0.7 and data["greedy"] is False
  assert data["pass_at_k"]["4"] == pytest.approx(2 / 3)
  assert em.EvalReport.from_json(report.to_json()) == report
  greedy = em.compute_report(_records(), temperature=0.0)
  assert greedy.greedy and "GREEDY" in greedy.to_table()


def test_temperature_is_required():
  with pytest.raises(TypeError, match="temperature"):
    em.compute_report(_records())  # pylint: disable=missing-kwoa
  with pytest.raises(ValueError, match="temperature"):
    em.compute_report(_records(), temperature=-1.0)


def test_bad_records_are_rejected():
  with pytest.raises(ValueError, match="reward must be in"):
    _rec("a", 0, 2.0)
  with pytest.raises(ValueError, match="reward must be in"):
    _rec("a", 0, float("nan"))
  with pytest.raises(ValueError, match="num_tool_errors"):
    _rec("a", 0, 1, calls=1, errors=2)
  with pytest.raises(ValueError, match="response_tokens"):
    _rec("a", 0, 1, tokens=-1)
  with pytest.raises(ValueError, match="appears twice"):
    em.compute_report([_rec("a", 0, 1), _rec("a", 0, 0)], temperature=1.0)
  with pytest.raises(ValueError, match="different numbers of samples"):
    em.compute_report([_rec("a", 0, 1), _rec("a", 1, 0), _rec("b", 0, 1)], temperature=1.0)
  with pytest.raises(ValueError, match="pass@k needs"):
    em.compute_report(_records(), temperature=1.0, ks=[8])
  with pytest.raises(ValueError, match="no records"):
    em.compute_report([], temperature=1.0)


def test_unsolved_problems_stage3_filter():
  assert em.unsolved_problems(_records(), 4) == ["a", "b"]
  all_solved = [_rec("x", i, 1) for i in range(2)]
  assert em.unsolved_problems(all_solved, 2) == []
  with pytest.raises(ValueError, match="exactly 8"):
    em.unsolved_problems(_records(), 8)


def test_several_benchmarks_are_also_reported_one_by_one():
  """Problems from several sources (AIME next to MATH-500) get pass@1 and pass@k per
  source, each equal to a report of that source's problems alone; one pooled number
  was all a run evaluating two benchmarks reported."""
  records = _records()
  source_of = {"a": "aime24", "b": "math500", "c": "math500"}
  report = em.compute_report(records, temperature=1.0, ks=[1, 2, 4], source_of=source_of)
  assert list(report.by_source) == ["aime24", "math500"]
  for src, d in report.by_source.items():
    alone = em.compute_report([r for r in records if source_of[r.problem_uid] == src],
                              temperature=1.0, ks=[1, 2, 4])
    assert d["num_problems"] == alone.num_problems
    assert d["pass_at_1"] == pytest.approx(alone.pass_at_1)
    assert {int(k): v for k, v in d["pass_at_k"].items()} == pytest.approx(alone.pass_at_k)
  table = report.to_table()
  assert "aime24" in table and "math500" in table and "pass@4" in table
  assert em.EvalReport.from_json(report.to_json()) == report
  one = em.compute_report(records, temperature=1.0, source_of={u: "x" for u in "abc"})
  assert one.by_source == {}          # a single benchmark: nothing to split
