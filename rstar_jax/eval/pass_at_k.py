"""Evaluation metrics over sampled trajectories, and the report that states how they were sampled.

Input: one `SampleRecord` per sampled trajectory (k per problem). Output: an
`EvalReport` holding

* pass@1 averaged over the k samples (the mean over problems of the per-problem
  mean reward: the number the rStar2-Agent report quotes, over 16 samples);
* pass@k for several k with the unbiased estimator of Chen et al. 2021
  ("Evaluating Large Language Models Trained on Code"), `1 - C(n-c, k) / C(n, k)`,
  computed as a product so that it never forms huge binomials;
* mean response length (tokens), tool calls per trajectory, tool error rate
  (errors / calls) over all trajectories and inside correct ones (the statistic
  GRPO-RoC is meant to drive down, the report's Fig. 4), share of truncated
  trajectories, and a per-problem breakdown.

The report's sampling temperature is a required field and is printed in the table
header: the public release's evaluation silently sampled greedily by default,
and a pass@1 "averaged over k samples" of greedy decoding is just one sample k times.

`unsolved_problems` gives the recipe's stage-3 subset: the problems the current
policy does not solve k out of k.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Iterable, Mapping, Sequence

from rstar_jax.rollout import stats


@dataclasses.dataclass(frozen=True)
class SampleRecord:
  """What evaluation needs to know about one sampled trajectory.

  Attributes:
    problem_uid: the problem it answers.
    sample_index: 0..k-1 among that problem's samples.
    reward: outcome reward in [0, 1] (1 = correct).
    response_tokens: tokens of the response, tool-output tokens included (they count
      toward the length budget).
    num_tool_calls: tool calls made, unparseable ones included.
    num_tool_errors: calls that failed (error, timeout, parse failure).
    num_turns: assistant turns.
    truncated: the trajectory hit the length or turn budget.
  """
  problem_uid: str
  sample_index: int
  reward: float
  response_tokens: int
  num_tool_calls: int
  num_tool_errors: int
  num_turns: int
  truncated: bool

  def __post_init__(self):
    if not isinstance(self.problem_uid, str) or not self.problem_uid:
      raise ValueError(f"SampleRecord.problem_uid must be a non-empty string, "
                       f"got {self.problem_uid!r}")
    where = f"SampleRecord({self.problem_uid!r}, sample {self.sample_index})"
    for name in ("sample_index", "response_tokens", "num_tool_calls", "num_tool_errors",
                 "num_turns"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: {name} must be a non-negative int, got {value!r}")
    if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)):
      raise ValueError(f"{where}: reward must be a float, got {self.reward!r}")
    if not 0.0 <= self.reward <= 1.0:  # Also rejects NaN.
      raise ValueError(f"{where}: reward must be in [0, 1], got {self.reward!r}")
    if self.num_tool_errors > self.num_tool_calls:
      raise ValueError(f"{where}: num_tool_errors ({self.num_tool_errors}) > "
                       f"num_tool_calls ({self.num_tool_calls})")
    if not isinstance(self.truncated, bool):
      raise ValueError(f"{where}: truncated must be a bool, got {self.truncated!r}")


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021).

  `1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k / i)`: the chance that k
  samples drawn without replacement from the n contain at least one correct one.
  """
  if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
    raise TypeError(f"pass_at_k takes ints, got n={n!r}, c={c!r}, k={k!r}")
  if not 0 <= c <= n:
    raise ValueError(f"pass_at_k: need 0 <= c <= n, got c={c}, n={n}")
  if not 1 <= k <= n:
    raise ValueError(f"pass_at_k: need 1 <= k <= n, got k={k}, n={n}")
  if n - c < k:  # Every k-subset holds a correct sample.
    return 1.0
  product = 1.0
  for i in range(n - c + 1, n + 1):
    product *= 1.0 - k / i
  return 1.0 - product


@dataclasses.dataclass(frozen=True)
class ProblemStats:
  """One problem's row of the breakdown."""
  uid: str
  num_samples: int
  num_correct: int
  mean_reward: float
  mean_response_tokens: float
  tool_calls: int
  tool_errors: int
  truncated: int


# None (JSON null, "n/a" in the table) rather than 0 or NaN: "no tool calls at all"
# must not read as "no tool errors" (the rule: rollout/stats.py).
_ratio = stats.ratio


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalReport:
  """Aggregate evaluation numbers plus the sampling settings that produced them."""
  temperature: float  # Required: a report never hides greedy decoding.
  top_p: float = 1.0
  dataset: str = ""
  samples_per_problem: int
  num_problems: int
  num_samples: int
  pass_at_1: float
  pass_at_k: dict[int, float] = dataclasses.field(default_factory=dict)
  mean_response_tokens: float
  mean_response_tokens_correct: float | None
  mean_turns: float
  tool_calls_per_trajectory: float
  tool_error_rate: float | None
  tool_error_rate_correct: float | None
  share_no_tool_call: float
  share_truncated: float
  per_problem: tuple[ProblemStats, ...] = ()
  # Provenance: what was scored (an export directory, a stage) and the run's seed.
  model_source: str = ""
  seed: int | None = None
  # Per benchmark, when the problems come from several (AIME next to MATH-500: one pooled
  # number is mostly the larger set's): source -> {num_problems, pass_at_1, pass_at_k}.
  by_source: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if (isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float))
        or not math.isfinite(self.temperature) or self.temperature < 0):
      raise ValueError(f"EvalReport.temperature must be a finite float >= 0, "
                       f"got {self.temperature!r}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"EvalReport.top_p must be in (0, 1], got {self.top_p!r}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  def sampling_line(self) -> str:
    mode = "GREEDY decoding" if self.greedy else "sampled"
    return (f"{mode}: temperature {float(self.temperature)}, top_p {float(self.top_p)}, "
            f"k = {self.samples_per_problem} samples per problem")

  def to_dict(self, *, per_problem: bool = True) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out["pass_at_k"] = {str(k): v for k, v in sorted(self.pass_at_k.items())}
    out["greedy"] = self.greedy
    if not per_problem:
      del out["per_problem"]
    else:
      out["per_problem"] = [dataclasses.asdict(p) for p in self.per_problem]
    return out

  def to_json(self, *, indent: int | None = 2, per_problem: bool = True) -> str:
    return json.dumps(self.to_dict(per_problem=per_problem), indent=indent)

  @classmethod
  def from_json(cls, text: str) -> EvalReport:
    data = json.loads(text)
    data.pop("greedy", None)
    data["pass_at_k"] = {int(k): v for k, v in data.get("pass_at_k", {}).items()}
    data["per_problem"] = tuple(ProblemStats(**p) for p in data.get("per_problem", ()))
    return cls(**data)

  def to_table(self, *, per_problem: bool = False, max_problems: int = 50) -> str:
    """A fixed-width text table; the header always states temperature and k."""
    def pct(x: float | None) -> str:
      return "n/a" if x is None else f"{100 * x:.1f}%"

    def num(x: float | None) -> str:
      return "n/a" if x is None else f"{x:.1f}"

    k = self.samples_per_problem
    rows = [(f"pass@1 (mean over {k} samples)", pct(self.pass_at_1))]
    rows += [(f"pass@{kk}", pct(v)) for kk, v in sorted(self.pass_at_k.items()) if kk != 1]
    rows += [
        ("mean response tokens", num(self.mean_response_tokens)),
        ("mean response tokens (correct)", num(self.mean_response_tokens_correct)),
        ("mean assistant turns", f"{self.mean_turns:.2f}"),
        ("tool calls per trajectory", f"{self.tool_calls_per_trajectory:.2f}"),
        ("tool error rate", pct(self.tool_error_rate)),
        ("tool error rate (correct traj.)", pct(self.tool_error_rate_correct)),
        ("share without tool call", pct(self.share_no_tool_call)),
        ("share truncated", pct(self.share_truncated)),
    ]
    title = f"Evaluation{': ' + self.dataset if self.dataset else ''} " \
            f"({self.num_problems} problems, {self.num_samples} samples)"
    width = max(len(name) for name, _ in rows)
    value_width = max(8, max(len(v) for _, v in rows))
    rule = "-" * (width + 2 + value_width)
    lines = [title, self.sampling_line(), rule]
    lines += [f"{name:<{width}}  {value:>{value_width}}" for name, value in rows]
    lines.append(rule)
    if self.by_source:
      ks = sorted(int(kk) for kk in next(iter(self.by_source.values()))["pass_at_k"])
      src_width = max(6, max(len(src) for src in self.by_source))
      header = f"{'source':<{src_width}}  {'problems':>8}  " + "  ".join(
          f"{f'pass@{kk}':>7}" for kk in ks)
      lines += [header, "-" * len(header)]
      for src, d in self.by_source.items():
        lines.append(f"{src:<{src_width}}  {d['num_problems']:>8}  " + "  ".join(
            f"{pct(d['pass_at_k'][str(kk)]):>7}" for kk in ks))
      lines.append("-" * len(header))
    if per_problem and self.per_problem:
      uid_width = min(40, max(3, max(len(p.uid) for p in self.per_problem)))
      header = (f"{'uid':<{uid_width}}  {'correct':>9}  {'reward':>7}  {'tokens':>8}  "
                f"{'calls':>6}  {'errors':>6}  {'trunc':>5}")
      lines += [header, "-" * len(header)]
      for p in self.per_problem[:max_problems]:
        uid = p.uid if len(p.uid) <= uid_width else p.uid[:uid_width - 1] + "~"
        lines.append(f"{uid:<{uid_width}}  {f'{p.num_correct}/{p.num_samples}':>9}  "
                     f"{p.mean_reward:>7.3f}  {p.mean_response_tokens:>8.1f}  "
                     f"{p.tool_calls:>6}  {p.tool_errors:>6}  {p.truncated:>5}")
      if len(self.per_problem) > max_problems:
        lines.append(f"... {len(self.per_problem) - max_problems} more problems")
    return "\n".join(lines)


def group_by_problem(records: Iterable[SampleRecord]) -> dict[str, list[SampleRecord]]:
  """Records per problem, in order of first appearance, each sorted by sample index.

  Raises on a repeated (problem_uid, sample_index): a double-counted sample would
  inflate every metric.
  """
  groups: dict[str, list[SampleRecord]] = {}
  seen: set[tuple[str, int]] = set()
  for record in records:
    if not isinstance(record, SampleRecord):
      raise TypeError(f"expected SampleRecord, got {type(record).__name__}")
    key = (record.problem_uid, record.sample_index)
    if key in seen:
      raise ValueError(f"sample {record.sample_index} of problem {record.problem_uid!r} "
                       "appears twice")
    seen.add(key)
    groups.setdefault(record.problem_uid, []).append(record)
  for group in groups.values():
    group.sort(key=lambda r: r.sample_index)
  return groups


def _samples_per_problem(groups: dict[str, list[SampleRecord]]) -> int:
  counts: dict[int, list[str]] = {}
  for uid, group in groups.items():
    counts.setdefault(len(group), []).append(uid)
  if len(counts) > 1:
    detail = "; ".join(f"{len(uids)} problem(s) with {n} (e.g. {uids[0]!r})"
                       for n, uids in sorted(counts.items()))
    raise ValueError(f"problems have different numbers of samples: {detail}. pass@1 averaged "
                     "over k samples needs the same k for every problem")
  return next(iter(counts))


def _is_correct(record: SampleRecord, threshold: float) -> bool:
  return record.reward >= threshold


def compute_report(records: Iterable[SampleRecord], *, temperature: float, top_p: float = 1.0,
                   ks: Sequence[int] | None = None, dataset: str = "",
                   success_threshold: float = 1.0, model_source: str = "",
                   seed: int | None = None, source_of: Mapping[str, str] | None = None
                   ) -> EvalReport:
  """Aggregates per-sample records into an `EvalReport`.

  Args:
    records: one per sampled trajectory; every problem must have the same number
      of samples k, with distinct sample indices.
    temperature, top_p: the sampling settings used (stated in the report).
    ks: the k values for pass@k, each <= k; default 1, 2, 4, ... up to k and k.
    dataset: a name for the report's title.
    success_threshold: a sample counts as correct for pass@k, the correct-trajectory
      statistics and `num_correct` when its reward is >= this (rewards are 0/1 in
      rStar2, so 1.0 is exact). pass@1 is the mean reward itself.
    source_of: problem uid -> its benchmark (`MathProblem.source`); with more than one,
      `by_source` holds pass@1 and pass@k per benchmark.
  """
  groups = group_by_problem(records)
  if not groups:
    raise ValueError("compute_report: no records")
  k = _samples_per_problem(groups)
  if ks is None:
    ks = sorted({2 ** i for i in range(k.bit_length()) if 2 ** i <= k} | {k})
  for kk in ks:
    if isinstance(kk, bool) or not isinstance(kk, int) or not 1 <= kk <= k:
      raise ValueError(f"pass@k needs 1 <= k <= {k} (the samples per problem), got {kk!r}")

  all_records = [r for group in groups.values() for r in group]
  correct = [r for r in all_records if _is_correct(r, success_threshold)]
  per_problem = []
  for uid, group in groups.items():
    per_problem.append(ProblemStats(
        uid=uid, num_samples=len(group),
        num_correct=sum(_is_correct(r, success_threshold) for r in group),
        mean_reward=sum(r.reward for r in group) / len(group),
        mean_response_tokens=sum(r.response_tokens for r in group) / len(group),
        tool_calls=sum(r.num_tool_calls for r in group),
        tool_errors=sum(r.num_tool_errors for r in group),
        truncated=sum(r.truncated for r in group)))

  n_problems, n_samples = len(per_problem), len(all_records)
  tool = stats.tool_stats(all_records, threshold=success_threshold)
  by_source: dict[str, dict[str, Any]] = {}
  if source_of is not None and len({source_of.get(p.uid, "") for p in per_problem}) > 1:
    for p in per_problem:
      by_source.setdefault(source_of.get(p.uid, ""), []).append(p)
    by_source = {src: {"num_problems": len(ps),
                       "pass_at_1": sum(p.mean_reward for p in ps) / len(ps),
                       "pass_at_k": {str(kk): sum(pass_at_k(p.num_samples, p.num_correct, kk)
                                                  for p in ps) / len(ps) for kk in ks}}
                 for src, ps in sorted(by_source.items())}
  return EvalReport(
      temperature=float(temperature), top_p=float(top_p), dataset=dataset,
      samples_per_problem=k, num_problems=n_problems, num_samples=n_samples,
      pass_at_1=sum(p.mean_reward for p in per_problem) / n_problems,
      pass_at_k={kk: sum(pass_at_k(p.num_samples, p.num_correct, kk) for p in per_problem)
                 / n_problems for kk in ks},
      mean_response_tokens=sum(r.response_tokens for r in all_records) / n_samples,
      mean_response_tokens_correct=_ratio(sum(r.response_tokens for r in correct), len(correct)),
      mean_turns=sum(r.num_turns for r in all_records) / n_samples,
      tool_calls_per_trajectory=tool["tool_calls_per_traj"],
      tool_error_rate=tool["tool_error_rate"],
      tool_error_rate_correct=tool["tool_error_rate_correct"],
      share_no_tool_call=tool["no_tool_share"],
      share_truncated=sum(r.truncated for r in all_records) / n_samples,
      per_problem=tuple(per_problem), model_source=model_source, seed=seed,
      by_source=by_source)


def unsolved_problems(records: Iterable[SampleRecord], k: int, *,
                      success_threshold: float = 1.0) -> list[str]:
  """Uids of the problems not solved k out of k (the recipe's stage-3 subset).

  Every problem in `records` must have exactly k samples: with fewer, "solved k out
  of k" is undefined, and silently judging on fewer would let problems slip out of
  (or into) the hard subset. Order: first appearance in `records`.
  """
  if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
    raise ValueError(f"k must be a positive int, got {k!r}")
  groups = group_by_problem(records)
  wrong = [(uid, len(g)) for uid, g in groups.items() if len(g) != k]
  if wrong:
    raise ValueError(f"unsolved_problems(k={k}): {len(wrong)} problem(s) do not have exactly "
                     f"{k} samples, e.g. {wrong[:3]}")
  return [uid for uid, group in groups.items()
          if not all(_is_correct(r, success_threshold) for r in group)]
