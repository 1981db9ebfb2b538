"""Down-samplers from 2G rollouts per prompt to G: Resample-on-Correct and baselines.

rStar2-Agent report, GRPO-RoC. Per prompt group, rollouts split into positives (reward > 0)
and negatives. RoC keeps about half of the G slots for negatives, drawn uniformly (variety
of failure modes), and fills the rest with positives drawn WITHOUT replacement, each draw
proportional to 1 / p_total among the positives not yet drawn, where

  p_total  = p_err + p_format
  p_err    = errored tool calls / tool calls, 0.5 when the rollout made no tool call
  p_format = 1 if the rollout has no `<answer>` tag, else min(1, (answer_tags - 1) / turns)

so clean positives (few tool errors, exactly one answer) are preferred. A positive with
p_total = 0 would get an infinite weight; `penalty_floor` (default 0.01) bounds it: the weight
is 1 / max(p_total, penalty_floor), so a spotless positive is 10x as likely per draw as one
with a 10% tool-error rate and 50x as likely as one that never called the tool.

Counts (`sample_counts`): the report's rule, "half_of_each" (default), samples the same
share of each pile: from N rollouts (N = 2G in the recipe) keep floor(n_neg * G / N)
negatives, i.e. half of them, and fill the other G - floor(n_neg / 2) slots with positives,
topping up from the other pile only when one runs short. So the kept group keeps the
split of the 2G draws (22 positives / 10 negatives -> 11 / 5), and with it the group's
reward mean that every advantage is measured against. "half_slots" (this codebase's rule
before) gives negatives G // 2 slots whatever the split (22 / 10 -> 8 / 8); kept as a named
option for comparison.

`positive_selection="topk"` is the public release instead: counts in proportion to the
pos/neg split (round-half-even of n_pos * G / N for positives, the rest negatives), at least
`topk_min_per_side` (2) of each side when available, the lowest-penalty positives first
(ties in rollout order), negatives in rollout order (one reading; the release's code actually
sorts negatives by penalty too: `topk_negative_order="penalty"`).

Baselines for ablations: "uniform" (plain GRPO with oversampling: G uniformly at random) and
"none" (keep every rollout). `drop_equal_reward_groups` (all methods) drops groups whose
rewards are all equal (no gradient under group-normalised advantages), as the release does.

Tool errors must come from the sandbox's structured status (error, timeout, parse failure),
counted by the caller; nothing here looks at output text. `num_turns` is the number of
assistant turns, the first included (the release's count misses it).

Everything is deterministic for a given `np.random.Generator` state; derive one per step,
e.g. `np.random.default_rng((seed, step))`, so a resumed run draws the same subsets.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

from rstar_jax.registry import Registry
from rstar_jax.rollout import stats as stats_lib

__all__ = [
    "RolloutStats",
    "DownsampleConfig",
    "DownsampleResult",
    "error_penalty",
    "format_penalty",
    "total_penalty",
    "sample_without_replacement",
    "register",
    "get",
    "DOWNSAMPLERS",
    "select_group",
    "downsample",
]


@dataclasses.dataclass(frozen=True)
class RolloutStats:
  """What the down-sampler needs to know about one rollout.

  Attributes:
    reward: the outcome reward (positive iff > 0).
    num_tool_calls: tool calls made (parse failures included).
    num_tool_errors: calls whose structured sandbox status was an error, a timeout, or a
      tool-call parse failure.
    num_answer_tags: complete `<answer>...</answer>` blocks in the model-written text
      (see `rstar_jax.answers.count_answer_tags`).
    num_turns: assistant turns, the first one included (>= 1).
  """
  reward: float
  num_tool_calls: int
  num_tool_errors: int
  num_answer_tags: int
  num_turns: int

  def __post_init__(self):
    if not math.isfinite(float(self.reward)):
      raise ValueError(f"RolloutStats.reward must be finite, got {self.reward!r}")
    for name in ("num_tool_calls", "num_tool_errors", "num_answer_tags", "num_turns"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise ValueError(f"RolloutStats.{name} must be a non-negative int, got {v!r}")
    if self.num_tool_errors > self.num_tool_calls:
      raise ValueError(f"RolloutStats.num_tool_errors ({self.num_tool_errors}) exceeds "
                       f"num_tool_calls ({self.num_tool_calls})")
    if self.num_turns < 1:
      raise ValueError(f"RolloutStats.num_turns must be >= 1 (the first assistant turn "
                       f"counts), got {self.num_turns}")

  @property
  def is_positive(self) -> bool:
    return self.reward > 0


def error_penalty(s: RolloutStats) -> float:
  """p_err: fraction of tool calls that errored; 0.5 without any tool call (the report's rule)."""
  if s.num_tool_calls == 0:
    return 0.5
  return s.num_tool_errors / s.num_tool_calls


def format_penalty(s: RolloutStats) -> float:
  """p_format: 1 without an `<answer>` tag, else min(1, (answer_tags - 1) / turns)."""
  if s.num_answer_tags == 0:
    return 1.0
  return min(1.0, (s.num_answer_tags - 1) / s.num_turns)


def total_penalty(s: RolloutStats, *, use_error: bool = True, use_format: bool = True) -> float:
  return (error_penalty(s) if use_error else 0.0) + (format_penalty(s) if use_format else 0.0)


def sample_without_replacement(weights: Sequence[float], k: int,
                               rng: np.random.Generator) -> np.ndarray:
  """Sequential draws without replacement, each proportional to the remaining weights.

  Returns the k drawn indices in draw order.
  """
  w = np.asarray(weights, dtype=np.float64)
  if w.ndim != 1 or not np.all(np.isfinite(w)) or np.any(w <= 0):
    raise ValueError(f"weights must be a 1-D array of finite positive values, got {w}")
  if not 0 <= k <= w.size:
    raise ValueError(f"cannot draw {k} of {w.size} items without replacement")
  w = w.copy()
  out = np.empty(k, dtype=np.int64)
  for j in range(k):
    cdf = np.cumsum(w)
    # side="right" lands on an item of positive width: drawn items have weight 0.
    pick = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    pick = min(pick, int(np.flatnonzero(w)[-1]))  # u * total may round up to total
    out[j] = pick
    w[pick] = 0.0
  return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class DownsampleConfig:
  """How to go from the rollouts of one prompt to the kept group.

  Attributes:
    method: a registered down-sampler: "roc", "uniform", "none".
    group_size: G, rollouts kept per prompt (groups of <= G rollouts are kept whole).
    positive_selection: "sample" (report: weighted sampling) or "topk" (release).
    sample_counts: "sample" only: "half_of_each" (report: floor(n_neg * G / N) negatives,
      the rest positives) or "half_slots" (G // 2 slots for negatives whatever the split).
    penalty_floor: lower bound on p_total before taking 1 / p_total ("sample" only).
    use_error_penalty: include p_err in p_total (ablation switch).
    use_format_penalty: include p_format in p_total (ablation switch).
    drop_equal_reward_groups: keep nothing from a group whose rewards are all equal.
    topk_min_per_side: "topk": at least this many positives and negatives when available.
    topk_negative_order: "topk": negatives in "rollout" order (one reading) or lowest "penalty"
      first (what the release's code does).
  """
  method: str = "roc"
  group_size: int = 16
  positive_selection: str = "sample"
  sample_counts: str = "half_of_each"
  penalty_floor: float = 1e-2
  use_error_penalty: bool = True
  use_format_penalty: bool = True
  drop_equal_reward_groups: bool = False
  topk_min_per_side: int = 2
  topk_negative_order: str = "rollout"

  def __post_init__(self):
    if self.method not in DOWNSAMPLERS:
      raise ValueError(f"DownsampleConfig.method: unknown down-sampler {self.method!r}; "
                       f"known: {sorted(DOWNSAMPLERS)}")
    if self.group_size < 1:
      raise ValueError(f"DownsampleConfig.group_size must be >= 1, got {self.group_size}")
    if self.positive_selection not in ("sample", "topk"):
      raise ValueError("DownsampleConfig.positive_selection must be 'sample' or 'topk', "
                       f"got {self.positive_selection!r}")
    try:
      SAMPLE_COUNTS.lookup(self.sample_counts)
    except (KeyError, ValueError) as e:
      raise ValueError(f"DownsampleConfig.sample_counts: {e}") from None
    if not (self.penalty_floor > 0 and math.isfinite(self.penalty_floor)):
      raise ValueError(f"DownsampleConfig.penalty_floor must be > 0, got {self.penalty_floor}")
    if self.topk_min_per_side < 0:
      raise ValueError("DownsampleConfig.topk_min_per_side must be >= 0, got "
                       f"{self.topk_min_per_side}")
    if self.topk_negative_order not in ("rollout", "penalty"):
      raise ValueError("DownsampleConfig.topk_negative_order must be 'rollout' or 'penalty', "
                       f"got {self.topk_negative_order!r}")


# A down-sampler maps one group's rollouts (more than G of them) to the kept indices.
Downsampler = Callable[[Sequence[RolloutStats], DownsampleConfig, np.random.Generator],
                       np.ndarray]
DOWNSAMPLERS: Registry = Registry("down-sampler")
register = DOWNSAMPLERS.register
get = DOWNSAMPLERS.lookup


def _split(group: Sequence[RolloutStats]) -> tuple[np.ndarray, np.ndarray]:
  pos = np.array([i for i, s in enumerate(group) if s.is_positive], dtype=np.int64)
  neg = np.array([i for i, s in enumerate(group) if not s.is_positive], dtype=np.int64)
  return pos, neg


def _penalties(group: Sequence[RolloutStats], idx: np.ndarray,
               config: DownsampleConfig) -> np.ndarray:
  return np.array([total_penalty(group[i], use_error=config.use_error_penalty,
                                 use_format=config.use_format_penalty) for i in idx],
                  dtype=np.float64)


def _fill(n_pos: int, n_neg: int, keep: int, neg_slots: int) -> tuple[int, int]:
  """(positives, negatives) for `neg_slots` negative slots; a short pile is topped up."""
  pos_slots = keep - neg_slots
  if n_pos < pos_slots:
    return n_pos, keep - n_pos
  if n_neg < neg_slots:
    return keep - n_neg, n_neg
  return pos_slots, neg_slots


SAMPLE_COUNTS: Registry = Registry("RoC sample-count rule")


@SAMPLE_COUNTS.register("half_of_each")
def _half_of_each_counts(n_pos: int, n_neg: int, keep: int) -> tuple[int, int]:
  """The report's counts: the same share keep / N of each pile, negatives rounded down."""
  return _fill(n_pos, n_neg, keep, (n_neg * keep) // (n_pos + n_neg))


@SAMPLE_COUNTS.register("half_slots")
def _half_slots_counts(n_pos: int, n_neg: int, keep: int) -> tuple[int, int]:
  """Negatives get keep // 2 slots whatever the split, positives the rest."""
  return _fill(n_pos, n_neg, keep, keep // 2)


def _proportional_counts(n_pos: int, n_neg: int, keep: int, min_per_side: int
                         ) -> tuple[int, int]:
  """The release's counts: proportional to the split, at least `min_per_side` each."""
  n = n_pos + n_neg
  k_pos = round(n_pos * keep / n)  # Python's round: half to even, like the release.
  k_neg = keep - k_pos
  if k_neg < min(min_per_side, n_neg):
    k_neg = min(min_per_side, n_neg)
    k_pos = keep - k_neg
  if k_pos < min(min_per_side, n_pos):
    k_pos = min(min_per_side, n_pos)
    k_neg = keep - k_pos
  # Availability wins over the minimums: the other side fills.
  if k_pos > n_pos:
    k_pos, k_neg = n_pos, keep - n_pos
  if k_neg > n_neg:
    k_pos, k_neg = keep - n_neg, n_neg
  return k_pos, k_neg


@register("roc")
def _roc(group: Sequence[RolloutStats], config: DownsampleConfig,
         rng: np.random.Generator) -> np.ndarray:
  keep = config.group_size
  pos, neg = _split(group)
  if config.positive_selection == "topk":
    # More than keep // 2 a side cannot hold for both (it kept more than G rollouts).
    k_pos, k_neg = _proportional_counts(pos.size, neg.size, keep,
                                        min(config.topk_min_per_side, keep // 2))
    pos_pen = _penalties(group, pos, config)
    kept_pos = pos[np.argsort(pos_pen, kind="stable")[:k_pos]]
    if config.topk_negative_order == "penalty":
      kept_neg = neg[np.argsort(_penalties(group, neg, config), kind="stable")[:k_neg]]
    else:
      kept_neg = neg[:k_neg]
  else:
    k_pos, k_neg = SAMPLE_COUNTS.lookup(config.sample_counts)(pos.size, neg.size, keep)
    kept_neg = rng.choice(neg, size=k_neg, replace=False) if k_neg else neg[:0]
    if k_pos:
      weights = 1.0 / np.maximum(_penalties(group, pos, config), config.penalty_floor)
      kept_pos = pos[sample_without_replacement(weights, k_pos, rng)]
    else:
      kept_pos = pos[:0]
  return np.sort(np.concatenate([kept_pos, kept_neg]))


@register("uniform")
def _uniform(group: Sequence[RolloutStats], config: DownsampleConfig,
             rng: np.random.Generator) -> np.ndarray:
  return np.sort(rng.choice(len(group), size=config.group_size, replace=False))


@register("none")
def _none(group: Sequence[RolloutStats], config: DownsampleConfig,
          rng: np.random.Generator) -> np.ndarray:
  del config, rng
  return np.arange(len(group), dtype=np.int64)


def select_group(group: Sequence[RolloutStats], config: DownsampleConfig,
                 rng: np.random.Generator) -> np.ndarray:
  """Sorted indices into `group` of the rollouts to keep (empty when the group is dropped)."""
  if not all(isinstance(s, RolloutStats) for s in group):
    bad = next(i for i, s in enumerate(group) if not isinstance(s, RolloutStats))
    raise TypeError(f"group[{bad}] is a {type(group[bad]).__name__}, expected RolloutStats")
  if config.drop_equal_reward_groups and len({float(s.reward) for s in group}) <= 1:
    return np.zeros(0, dtype=np.int64)
  if len(group) <= config.group_size:
    return np.arange(len(group), dtype=np.int64)
  return np.asarray(get(config.method)(group, config, rng), dtype=np.int64)


@dataclasses.dataclass(frozen=True)
class DownsampleResult:
  """Per group, the sorted indices of the kept rollouts (empty: group dropped); step stats."""
  kept: tuple[np.ndarray, ...]
  stats: dict[str, float]   # a rate over nothing is left out (see `downsample`)

  @property
  def num_kept(self) -> int:
    return int(sum(k.size for k in self.kept))


def _error_rate(rollouts: list[RolloutStats]) -> float | None:
  # None (left out of the step's metrics) when nothing called the tool: "no call to
  # count" is not "no tool error" (rollout/stats.py).
  return stats_lib.ratio(sum(s.num_tool_errors for s in rollouts),
                         sum(s.num_tool_calls for s in rollouts))


def _mean(xs: list[float]) -> float | None:
  return float(np.mean(xs)) if xs else None


def downsample(groups: Sequence[Sequence[RolloutStats]], config: DownsampleConfig,
               rng: np.random.Generator) -> DownsampleResult:
  """Applies `config` to every prompt group of a step.

  Stats ("all_*" are over every generated rollout, dropped groups included; "kept_*" over
  the kept ones; error rates are errored calls / calls; a rate or mean over nothing, e.g.
  no positive kept or no tool call, is left out of the stats: missing, not 0):
    roc/groups, roc/groups_dropped, roc/kept, roc/kept_positives, roc/kept_negatives,
    roc/all_positives, roc/all_negatives, roc/kept_pos_penalty_mean,
    roc/all_pos_penalty_mean, roc/kept_pos_err_penalty_mean, roc/kept_pos_format_penalty_mean,
    roc/all_pos_err_penalty_mean, roc/all_pos_format_penalty_mean,
    roc/kept_pos_tool_error_rate, roc/all_pos_tool_error_rate, roc/all_tool_error_rate.
  """
  if not isinstance(config, DownsampleConfig):
    raise TypeError(f"config must be a DownsampleConfig, got {type(config).__name__}")
  if not isinstance(rng, np.random.Generator):
    raise TypeError(f"rng must be a numpy Generator, got {type(rng).__name__}")
  kept: list[np.ndarray] = []
  all_pos: list[RolloutStats] = []
  kept_pos: list[RolloutStats] = []
  all_rollouts: list[RolloutStats] = []
  n_kept_neg = n_all_neg = n_dropped = 0
  for g, group in enumerate(groups):
    if len(group) == 0:
      raise ValueError(f"group {g} has no rollout")
    idx = select_group(group, config, rng)
    kept.append(idx)
    n_dropped += int(idx.size == 0)
    all_rollouts.extend(group)
    all_pos.extend(s for s in group if s.is_positive)
    n_all_neg += sum(not s.is_positive for s in group)
    kept_pos.extend(group[i] for i in idx if group[i].is_positive)
    n_kept_neg += sum(not group[i].is_positive for i in idx)

  def pen(rs, fn):
    return _mean([fn(s) for s in rs])

  def tot(s):
    return total_penalty(s, use_error=config.use_error_penalty,
                         use_format=config.use_format_penalty)

  stats = {
      "roc/groups": float(len(kept)),
      "roc/groups_dropped": float(n_dropped),
      "roc/kept": float(sum(k.size for k in kept)),
      "roc/kept_positives": float(len(kept_pos)),
      "roc/kept_negatives": float(n_kept_neg),
      "roc/all_positives": float(len(all_pos)),
      "roc/all_negatives": float(n_all_neg),
      "roc/kept_pos_penalty_mean": pen(kept_pos, tot),
      "roc/all_pos_penalty_mean": pen(all_pos, tot),
      "roc/kept_pos_err_penalty_mean": pen(kept_pos, error_penalty),
      "roc/kept_pos_format_penalty_mean": pen(kept_pos, format_penalty),
      "roc/all_pos_err_penalty_mean": pen(all_pos, error_penalty),
      "roc/all_pos_format_penalty_mean": pen(all_pos, format_penalty),
      "roc/kept_pos_tool_error_rate": _error_rate(kept_pos),
      "roc/all_pos_tool_error_rate": _error_rate(all_pos),
      "roc/all_tool_error_rate": _error_rate(all_rollouts),
  }
  return DownsampleResult(kept=tuple(kept), stats=stats_lib.present(stats))
