"""Resample-on-Correct and the baseline down-samplers."""
import itertools

import numpy as np
import pytest

from rstar_jax import answers
from rstar_jax.rl import roc
from rstar_jax.rl.roc import DownsampleConfig, RolloutStats


def _pos(calls=2, errors=0, tags=1, turns=2):
  return RolloutStats(reward=1.0, num_tool_calls=calls, num_tool_errors=errors,
                      num_answer_tags=tags, num_turns=turns)


def _neg(calls=2, errors=1, tags=1, turns=2):
  return RolloutStats(reward=0.0, num_tool_calls=calls, num_tool_errors=errors,
                      num_answer_tags=tags, num_turns=turns)


def _group(n_pos, n_neg, rng=None):
  """Positives and negatives interleaved in a random (seeded) rollout order."""
  rng = rng or np.random.default_rng(123)
  items = [_pos(calls=int(c), errors=int(e)) for c, e in
           zip(rng.integers(1, 6, n_pos), rng.integers(0, 2, n_pos))]
  items += [_neg() for _ in range(n_neg)]
  order = rng.permutation(len(items))
  return [items[i] for i in order]


def _exact_inclusion(weights, k):
  """P(item in sample) for k sequential draws without replacement, prop. to weights."""
  w = np.asarray(weights, float)
  probs = np.zeros(w.size)
  for seq in itertools.permutations(range(w.size), k):
    p, remaining = 1.0, w.sum()
    for j in seq:
      p *= w[j] / remaining
      remaining -= w[j]
    probs[list(seq)] += p
  return probs


# --- penalties ------------------------------------------------------------------------------

@pytest.mark.parametrize("stats,p_err,p_format", [
    (_pos(calls=0, errors=0, tags=1), 0.5, 0.0),        # no tool call: p_err 0.5
    (_pos(calls=4, errors=1, tags=1), 0.25, 0.0),
    (_pos(calls=3, errors=3, tags=0), 1.0, 1.0),        # no answer tag: p_format 1
    (_pos(calls=2, errors=0, tags=2, turns=4), 0.0, 0.25),
    (_pos(calls=2, errors=0, tags=3, turns=2), 0.0, 1.0),
    (_pos(calls=2, errors=0, tags=9, turns=2), 0.0, 1.0),  # capped at 1
])
def test_penalties(stats, p_err, p_format):
  assert roc.error_penalty(stats) == pytest.approx(p_err)
  assert roc.format_penalty(stats) == pytest.approx(p_format)
  assert roc.total_penalty(stats) == pytest.approx(p_err + p_format)
  assert roc.total_penalty(stats, use_error=False) == pytest.approx(p_format)
  assert roc.total_penalty(stats, use_format=False) == pytest.approx(p_err)


def test_count_answer_tags():
  assert answers.count_answer_tags("no tags") == 0
  assert answers.count_answer_tags("<answer>1</answer>") == 1
  assert answers.count_answer_tags("<answer>1</answer> x <answer>2</answer>") == 2
  assert answers.count_answer_tags("<answer>1</answer> <answer>unclosed") == 1
  assert answers.count_answer_tags("</answer><answer>") == 0
  # One complete block, however many opening tags it repeats: the count goes on after
  # the block's close, not inside it.
  assert answers.count_answer_tags("<answer><answer>1</answer>") == 1
  assert answers.count_answer_tags("<answer>a <answer>b</answer> <answer>c</answer>") == 2


def test_a_draw_of_exactly_zero_never_takes_a_drawn_item():
  """Generator.random() is in [0, 1): it can return 0.0. A drawn item has weight 0, so
  the cumulative sum starts flat at 0 there; the draw must land on an item of positive
  width (side="right"), never on one drawn before."""
  class Zero:
    def random(self):
      return 0.0
  assert roc.sample_without_replacement([1.0, 1.0, 1.0], 3, Zero()).tolist() == [0, 1, 2]


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_tool_errors=3, num_tool_calls=2), "exceeds"),
    (dict(num_turns=0), "num_turns"),
    (dict(num_answer_tags=-1), "num_answer_tags"),
    (dict(num_tool_calls=1.5), "num_tool_calls"),
    (dict(reward=float("nan")), "reward"),
])
def test_rollout_stats_validation(kwargs, match):
  base = dict(reward=1.0, num_tool_calls=2, num_tool_errors=0, num_answer_tags=1, num_turns=1)
  base.update(kwargs)
  with pytest.raises(ValueError, match=match):
    RolloutStats(**base)


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="nope"), "known"),
    (dict(group_size=0), "group_size"),
    (dict(positive_selection="best"), "positive_selection"),
    (dict(penalty_floor=0.0), "penalty_floor"),
    (dict(topk_negative_order="random"), "topk_negative_order"),
])
def test_config_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    DownsampleConfig(**kwargs)


def test_registry():
  assert {"roc", "uniform", "none"} <= set(roc.DOWNSAMPLERS)
  with pytest.raises(ValueError, match="known"):
    roc.get("missing")


# --- counts ---------------------------------------------------------------------------------

@pytest.mark.parametrize("counts,n_pos,n_neg,keep,want_pos,want_neg", [
    # the report's rule: half of each pile
    ("half_of_each", 16, 16, 16, 8, 8),
    ("half_of_each", 22, 10, 16, 11, 5),   # the split of the 2G draws is kept
    ("half_of_each", 21, 11, 16, 11, 5),   # odd pile: negatives rounded down
    ("half_of_each", 5, 27, 16, 3, 13),    # half of each: 2.5 -> 3 positives, 13 negatives
    ("half_of_each", 28, 4, 16, 14, 2),
    ("half_of_each", 0, 32, 16, 0, 16),    # all wrong
    ("half_of_each", 32, 0, 16, 16, 0),    # all correct
    ("half_of_each", 1, 31, 16, 1, 15),
    ("half_of_each", 6, 4, 5, 3, 2),       # N != 2G: floor(4 * 5 / 10) negatives
    # the earlier rule: G // 2 slots for negatives
    ("half_slots", 16, 16, 16, 8, 8),
    ("half_slots", 22, 10, 16, 8, 8),
    ("half_slots", 5, 27, 16, 5, 11),
    ("half_slots", 28, 4, 16, 12, 4),      # fewer negatives than their slots: positives fill
    ("half_slots", 6, 4, 5, 3, 2),         # odd G: negatives get G // 2
])
def test_roc_sample_counts(counts, n_pos, n_neg, keep, want_pos, want_neg):
  group = _group(n_pos, n_neg)
  config = DownsampleConfig(group_size=keep, sample_counts=counts)
  for seed in range(5):
    kept = roc.select_group(group, config, np.random.default_rng(seed))
    assert kept.size == keep == np.unique(kept).size
    assert np.all(np.diff(kept) > 0)
    assert sum(group[i].is_positive for i in kept) == want_pos
    assert sum(not group[i].is_positive for i in kept) == want_neg


@pytest.mark.parametrize("G", [8, 16])
def test_half_of_each_for_every_split_of_2g(G):
  # From 2G: floor(n_neg / 2) negatives, G - floor(n_neg / 2) positives; a short pile is
  # topped up from the other. Written out per case, independently of the implementation.
  for n_neg in range(2 * G + 1):
    n_pos = 2 * G - n_neg
    want_neg = n_neg // 2
    want_pos = G - want_neg
    if want_pos > n_pos:           # too few positives: negatives fill
      want_pos, want_neg = n_pos, G - n_pos
    group = _group(n_pos, n_neg)
    kept = roc.select_group(group, DownsampleConfig(group_size=G), np.random.default_rng(n_neg))
    got_pos = sum(group[i].is_positive for i in kept)
    assert (got_pos, kept.size - got_pos) == (want_pos, want_neg), (n_pos, n_neg)
    # the kept reward mean stays within a rounding step of the 2G draws' mean
    assert abs(got_pos / G - n_pos / (2 * G)) <= 1 / G + 1e-12


def test_sample_counts_rule_is_validated():
  with pytest.raises(ValueError, match="sample_counts.*half_of_each"):
    DownsampleConfig(sample_counts="half")


def test_small_groups_are_kept_whole():
  group = _group(3, 4)
  kept = roc.select_group(group, DownsampleConfig(group_size=16), np.random.default_rng(0))
  np.testing.assert_array_equal(kept, np.arange(7))


# --- selection probabilities -----------------------------------------------------------------

def test_roc_inclusion_probabilities_match_exact_sequential_sampling():
  floor = 0.2
  positives = [
      _pos(calls=0, errors=0),                 # p = 0.5           -> w = 2
      _pos(calls=4, errors=1),                 # p = 0.25          -> w = 4
      _pos(calls=2, errors=0),                 # p = 0 -> floor    -> w = 5
      _pos(calls=2, errors=1, tags=0),         # p = 0.5 + 1       -> w = 2/3
      _pos(calls=1, errors=0, tags=2, turns=2),  # p = 0.5         -> w = 2
  ]
  negatives = [_neg(errors=e) for e in (0, 1, 2, 0, 1)]
  group = [None] * 10
  pos_at = [0, 3, 4, 7, 9]
  neg_at = [1, 2, 5, 6, 8]
  for i, s in zip(pos_at, positives):
    group[i] = s
  for i, s in zip(neg_at, negatives):
    group[i] = s
  weights = [1.0 / max(roc.total_penalty(s), floor) for s in positives]
  np.testing.assert_allclose(weights, [2, 4, 5, 2 / 3, 2])
  config = DownsampleConfig(group_size=6, penalty_floor=floor)  # 3 positives, 3 negatives
  exact_pos = _exact_inclusion(weights, 3)
  assert exact_pos.sum() == pytest.approx(3.0)

  trials = 20000
  rng = np.random.default_rng(2024)
  counts = np.zeros(10)
  for _ in range(trials):
    counts[roc.select_group(group, config, rng)] += 1
  freq = counts / trials
  for want, idx in ((exact_pos, pos_at), (np.full(5, 0.6), neg_at)):
    sigma = np.sqrt(want * (1 - want) / trials)
    np.testing.assert_array_less(np.abs(freq[idx] - want), 5 * sigma + 1e-9)
  # Single-draw probabilities are NOT the inclusion probabilities (the sampling is
  # without replacement): guard against a with-replacement or top-k implementation.
  single = np.asarray(weights) / np.sum(weights)
  assert np.abs(exact_pos - 3 * single).max() > 0.1


def test_all_wrong_group_is_uniform():
  group = [_neg(errors=e % 3) for e in range(8)]
  config = DownsampleConfig(group_size=4)
  trials = 8000
  rng = np.random.default_rng(7)
  counts = np.zeros(8)
  for _ in range(trials):
    counts[roc.select_group(group, config, rng)] += 1
  sigma = np.sqrt(0.25 / trials)
  np.testing.assert_array_less(np.abs(counts / trials - 0.5), 5 * sigma)


def test_all_correct_group_prefers_clean_trajectories():
  clean = [_pos(calls=3, errors=0) for _ in range(4)]           # p = 0 (floor 0.01)
  messy = [_pos(calls=3, errors=3, tags=0) for _ in range(4)]   # p = 2
  group = [x for pair in zip(clean, messy) for x in pair]
  config = DownsampleConfig(group_size=4)
  rng = np.random.default_rng(1)
  kept_clean = [sum(roc.error_penalty(group[i]) == 0 for i in
                    roc.select_group(group, config, rng)) for _ in range(200)]
  # w_clean / w_messy = 200: the four clean ones are almost always the ones kept.
  assert np.mean(kept_clean) > 3.9


def test_sample_without_replacement_validates():
  rng = np.random.default_rng(0)
  with pytest.raises(ValueError, match="positive"):
    roc.sample_without_replacement([1.0, 0.0], 1, rng)
  with pytest.raises(ValueError, match="cannot draw"):
    roc.sample_without_replacement([1.0, 1.0], 3, rng)
  out = roc.sample_without_replacement([1.0, 2.0, 3.0], 3, rng)
  assert sorted(out.tolist()) == [0, 1, 2]


# --- top-k (release) --------------------------------------------------------------------------

@pytest.mark.parametrize("n_pos,want_pos", [
    (20, 10),   # round(20 * 16 / 32) = 10
    (16, 8),
    (3, 2),     # round(1.5) = 2 (half to even)
    (5, 2),     # round(2.5) = 2 (half to even)
    (1, 1),     # round(0.5) = 0 -> at least min(2, 1) = 1
    (31, 15),   # round(15.5) = 16 -> at least 1 negative (only one exists)
    (30, 14),   # round(15) = 15 -> at least 2 negatives
    (0, 0),
    (32, 16),
])
def test_topk_counts(n_pos, want_pos):
  group = _group(n_pos, 32 - n_pos)
  config = DownsampleConfig(group_size=16, positive_selection="topk")
  kept = roc.select_group(group, config, np.random.default_rng(0))
  assert kept.size == 16
  assert sum(group[i].is_positive for i in kept) == want_pos


def test_topk_picks_lowest_penalty_positives_and_first_negatives():
  penalties_calls = [(4, 4), (4, 0), (4, 2), (0, 0), (4, 1), (4, 3)]  # p_err 1, 0, .5, .5, .25, .75
  group = []
  for c, e in penalties_calls:
    group.append(_pos(calls=c, errors=e))
    group.append(_neg(errors=min(2, len(group) % 3)))
  # 12 rollouts, 6 pos / 6 neg, keep 6: 3 positives (p 0, .25, then the first of the .5 tie)
  config = DownsampleConfig(group_size=6, positive_selection="topk")
  kept = roc.select_group(group, config, np.random.default_rng(0))
  kept_pos = [i for i in kept if group[i].is_positive]
  kept_neg = [i for i in kept if not group[i].is_positive]
  assert kept_pos == [2, 4, 8]       # indices of p_err 0 (2), .5 (4, first of the tie), .25 (8)
  assert kept_neg == [1, 3, 5]       # the first three negatives in rollout order
  for seed in range(3):              # deterministic: no randomness at all
    np.testing.assert_array_equal(
        roc.select_group(group, config, np.random.default_rng(seed)), kept)
  by_penalty = DownsampleConfig(group_size=6, positive_selection="topk",
                                topk_negative_order="penalty")
  kept = roc.select_group(group, by_penalty, np.random.default_rng(0))
  neg_pen = [roc.total_penalty(group[i]) for i in kept if not group[i].is_positive]
  all_neg_pen = sorted(roc.total_penalty(s) for s in group if not s.is_positive)
  assert sorted(neg_pen) == all_neg_pen[:3]


# --- options, baselines, determinism, stats ----------------------------------------------------

@pytest.mark.parametrize("method", ["roc", "uniform", "none"])
def test_drop_equal_reward_groups(method):
  groups = [_group(0, 32), _group(32, 0), _group(10, 22)]
  rng = np.random.default_rng(0)
  dropped = roc.downsample(groups, DownsampleConfig(method=method,
                                                    drop_equal_reward_groups=True), rng)
  assert [k.size for k in dropped.kept][:2] == [0, 0]
  assert dropped.kept[2].size == (16 if method != "none" else 32)
  assert dropped.stats["roc/groups_dropped"] == 2
  kept = roc.downsample(groups, DownsampleConfig(method=method), rng)
  assert all(k.size == (16 if method != "none" else 32) for k in kept.kept)
  assert kept.stats["roc/groups_dropped"] == 0


def test_uniform_baseline_ignores_rewards_and_penalties():
  group = _group(4, 28)
  config = DownsampleConfig(method="uniform", group_size=16)
  rng = np.random.default_rng(5)
  counts = np.zeros(32)
  trials = 4000
  for _ in range(trials):
    kept = roc.select_group(group, config, rng)
    assert kept.size == 16
    counts[kept] += 1
  sigma = np.sqrt(0.25 / trials)
  np.testing.assert_array_less(np.abs(counts / trials - 0.5), 5 * sigma)


@pytest.mark.parametrize("method,selection", [("roc", "sample"), ("roc", "topk"),
                                              ("uniform", "sample")])
def test_deterministic_for_a_seed(method, selection):
  groups = [_group(n, 32 - n, np.random.default_rng(n)) for n in (3, 10, 16, 25, 30)]
  config = DownsampleConfig(method=method, positive_selection=selection)
  a = roc.downsample(groups, config, np.random.default_rng(11))
  b = roc.downsample(groups, config, np.random.default_rng(11))
  for x, y in zip(a.kept, b.kept):
    np.testing.assert_array_equal(x, y)
  assert a.stats == b.stats
  if selection == "sample":
    c = roc.downsample(groups, config, np.random.default_rng(12))
    assert any(not np.array_equal(x, y) for x, y in zip(a.kept, c.kept))


def test_stats_hand_computed():
  g1 = [_pos(calls=2, errors=0), _pos(calls=2, errors=2), _neg(calls=1, errors=1),
        _neg(calls=0, errors=0)]                     # 4 rollouts, keep 2: 1 pos + 1 neg
  g2 = [_neg(calls=1, errors=0)] * 3                 # all wrong, dropped
  config = DownsampleConfig(group_size=2, drop_equal_reward_groups=True)
  rng = np.random.default_rng(0)
  # Force the clean positive: its weight is 100 vs 1 (p 0 -> floor 0.01; p 1).
  res = None
  for seed in range(20):
    res = roc.downsample([g1, g2], config, np.random.default_rng(seed))
    if 0 in res.kept[0]:
      break
  assert 0 in res.kept[0]
  s = res.stats
  assert s["roc/groups"] == 2 and s["roc/groups_dropped"] == 1
  assert s["roc/kept"] == 2 and s["roc/kept_positives"] == 1 and s["roc/kept_negatives"] == 1
  assert s["roc/all_positives"] == 2 and s["roc/all_negatives"] == 5
  assert s["roc/kept_pos_tool_error_rate"] == 0.0
  assert s["roc/all_pos_tool_error_rate"] == pytest.approx(2 / 4)
  assert s["roc/all_tool_error_rate"] == pytest.approx((0 + 2 + 1 + 0 + 0) / (2 + 2 + 1 + 3))
  assert s["roc/kept_pos_penalty_mean"] == 0.0
  assert s["roc/all_pos_penalty_mean"] == pytest.approx(0.5)
  assert s["roc/all_pos_err_penalty_mean"] == pytest.approx(0.5)
  assert s["roc/kept_pos_format_penalty_mean"] == 0.0
  del rng


def test_roc_lowers_tool_error_rate_of_kept_positives():
  rng = np.random.default_rng(3)
  groups = [_group(int(n), 32 - int(n), rng) for n in rng.integers(10, 30, 20)]
  res = roc.downsample(groups, DownsampleConfig(), np.random.default_rng(0))
  assert (res.stats["roc/kept_pos_tool_error_rate"]
          < res.stats["roc/all_pos_tool_error_rate"])
  uni = roc.downsample(groups, DownsampleConfig(method="uniform"), np.random.default_rng(0))
  assert (res.stats["roc/kept_pos_tool_error_rate"]
          < uni.stats["roc/kept_pos_tool_error_rate"])


def test_downsample_rejects_bad_input():
  with pytest.raises(ValueError, match="group 1"):
    roc.downsample([_group(2, 2), []], DownsampleConfig(), np.random.default_rng(0))
  with pytest.raises(TypeError, match=r"group\[1\]"):
    roc.downsample([[_pos(), {"reward": 1}]], DownsampleConfig(), np.random.default_rng(0))
  with pytest.raises(TypeError, match="Generator"):
    roc.downsample([_group(2, 2)], DownsampleConfig(), 0)


def test_topk_keeps_at_most_g_whatever_its_minimum_per_side():
  """A minimum above G // 2 a side made the release's counts negative (7 of 8 kept for
  G = 3 with a minimum of 4)."""
  group = [_pos(calls=1, errors=0) for _ in range(4)] + [_neg() for _ in range(4)]
  for minimum in (0, 1, 2, 4, 9):
    config = DownsampleConfig(group_size=3, positive_selection="topk", topk_min_per_side=minimum)
    kept = roc.select_group(group, config, np.random.default_rng(0))
    assert len(kept) == 3 and len(set(kept)) == 3, (minimum, kept)
