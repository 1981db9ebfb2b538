r"""The report's evaluation table: several benchmarks, the report's protocol, intervals.

`run_suite` runs k sampled trajectories per problem of every benchmark given (the RL
collector, `rl.rollout_collector.collect`: same chat protocol, tool loop, sandbox and seeds), grades
them by the benchmark's answer type (`eval.benchmarks.grade`), and writes per benchmark
its report (`<name>.json`: pass@1 averaged over the k samples with a 95% bootstrap
interval over problems, pass@k, mean response tokens over all and over correct samples,
tool calls per trajectory and tool-error rates) and its samples, then one table
(`suite.md`, `suite.json`) with the report's figure beside each result and whether it lies
inside the interval.

Resumable: each benchmark's trajectories are journaled as they finish
(`<name>.journal.jsonl`); a rerun with the same model, settings and file runs only the
missing ones (each keeps its seed: the result equals an uninterrupted run), and a finished
benchmark (`<name>.made_with.json` matching) is read back, not run again.

The report's protocol (`PROTOCOLS["report"]`, arXiv 2508.20722 section 5.1, "Evaluation
Benchmarks"): "For math benchmarks and GPQA-Diamond, we allow up to 30K tokens per response
with a temperature of 0.6, applying the prompt template in Fig. 3 with a maximum of T = 30
turns. Each question is sampled 16 times, and we report average pass@1 accuracy and
response length in tokens." 30K is taken as 30,720 tokens, the release's
`data.max_response_length=30720` in examples/aime_eval.sh and math500_eval.sh (which also
sample `val_kwargs.n=16`). top-p is not stated in the report; 1.0 (no nucleus cut, the
training setting) is our choice, and top-k is off.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
import zlib
from typing import Any, Callable, Sequence

from absl import logging
import numpy as np

from rstar_jax.data import math_problems
from rstar_jax.eval import benchmarks as bench_lib
from rstar_jax.eval import eval_runs as eval_lib
from rstar_jax.eval import pass_at_k
from rstar_jax.rl import rollout_collector
from rstar_jax.rollout import agent_loop

SUITE_SALT = 40   # the suite's seed stream: (seed, EVAL, SUITE_SALT, crc32(benchmark name))
CI_LEVEL = 0.95
CI_RESAMPLES = 10_000

PROTOCOLS: dict[str, tuple[int, dict[str, Any]]] = {
    # name -> (samples per problem, AgentConfig fields); see the module docstring.
    "report": (16, dict(max_turns=30, max_response_tokens=30_720, temperature=0.6, top_p=1.0,
                        top_k=0)),
}
PROTOCOL_NAMES = ("report", "config", "greedy")


def protocol(name: str, configured: eval_lib.EvalConfig) -> eval_lib.EvalConfig:
  """The evaluation settings of a protocol.

  "report": the report's (16 samples, temperature 0.6, top-p 1.0, 30,720 tokens, 30 turns).
  "config": `configured` (config.eval) as it is; greedy decoding (temperature 0) refused:
    a pass@1 "averaged over k samples" of greedy decoding is one sample k times, and the
    release's own evaluation fell into it by default. Ask for it by name instead:
  "greedy": temperature 0, one sample per problem, the configured budgets.
  """
  if name == "report":
    k, agent = PROTOCOLS["report"]
    return dataclasses.replace(configured, k=k, agent=agent_loop.AgentConfig(**agent))
  if name == "greedy":
    return dataclasses.replace(configured, k=1,
                               agent=dataclasses.replace(configured.agent, temperature=0.0))
  if name == "config":
    if configured.agent.temperature == 0:
      raise ValueError("protocol 'config': config.eval.agent.temperature is 0 (greedy decoding);"
                       " the suite samples. Use --protocol=greedy to ask for greedy decoding "
                       "by name, or set a temperature (the report's: --protocol=report)")
    return configured
  raise ValueError(f"protocol {name!r}: choose from {PROTOCOL_NAMES}")


def bootstrap_interval(scores: Sequence[float], *, level: float = CI_LEVEL,
                       resamples: int = CI_RESAMPLES, seed: int = 0) -> tuple[float, float]:
  """Percentile bootstrap interval of the mean of per-problem scores (each problem's
  mean reward over its k samples), resampling problems with replacement; seeded."""
  x = np.asarray(scores, dtype=np.float64)
  if x.ndim != 1 or x.size == 0:
    raise ValueError(f"bootstrap_interval needs a non-empty 1-D list of scores, got shape "
                     f"{x.shape}")
  if not 0 < level < 1 or resamples < 1:
    raise ValueError(f"bootstrap_interval: level in (0, 1) and resamples >= 1 required, got "
                     f"{level}, {resamples}")
  rng = np.random.default_rng(seed)
  means = np.empty(resamples)
  chunk = max(1, 2_000_000 // x.size)   # bounded memory for MATH-500 x 10,000
  for start in range(0, resamples, chunk):
    n = min(chunk, resamples - start)
    means[start:start + n] = x[rng.integers(0, x.size, size=(n, x.size))].mean(axis=1)
  alpha = (1 - level) / 2
  lo, hi = np.quantile(means, [alpha, 1 - alpha])
  return float(lo), float(hi)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchmarkResult:
  """One row of the table (fractions in [0, 1]; report figures in percent as printed)."""
  name: str
  title: str
  answer_type: str
  file: str
  num_problems: int
  expected_problems: int | None
  samples_per_problem: int
  pass_at_1: float
  ci_low: float
  ci_high: float
  ci_level: float
  pass_at_k: dict[str, float]
  mean_response_tokens: float
  mean_response_tokens_correct: float | None
  tool_calls_per_trajectory: float
  tool_error_rate: float | None
  tool_error_rate_correct: float | None
  share_truncated: float
  report_pass_at_1: float | None
  report_response_tokens: float | None
  report_source: str

  @property
  def report_inside(self) -> bool | None:
    """Whether the report's pass@1 lies inside the interval (None: no report figure)."""
    if self.report_pass_at_1 is None:
      return None
    return self.ci_low <= self.report_pass_at_1 / 100 <= self.ci_high

  def to_dict(self) -> dict[str, Any]:
    return {**dataclasses.asdict(self), "report_inside": self.report_inside}


def result_from(bench: bench_lib.Benchmark, path: str, report: pass_at_k.EvalReport, *,
                ci_seed: int) -> BenchmarkResult:
  lo, hi = bootstrap_interval([p.mean_reward for p in report.per_problem], seed=ci_seed)
  k = report.samples_per_problem
  return BenchmarkResult(
      name=bench.name, title=bench.title, answer_type=bench.answer_type, file=path,
      num_problems=report.num_problems, expected_problems=bench.num_problems,
      samples_per_problem=k, pass_at_1=report.pass_at_1, ci_low=lo, ci_high=hi,
      ci_level=CI_LEVEL, pass_at_k={str(kk): v for kk, v in sorted(report.pass_at_k.items())},
      mean_response_tokens=report.mean_response_tokens,
      mean_response_tokens_correct=report.mean_response_tokens_correct,
      tool_calls_per_trajectory=report.tool_calls_per_trajectory,
      tool_error_rate=report.tool_error_rate,
      tool_error_rate_correct=report.tool_error_rate_correct,
      share_truncated=report.share_truncated, report_pass_at_1=bench.report_pass_at_1,
      report_response_tokens=bench.report_response_tokens, report_source=bench.report_source)


def _pct(x: float | None, unit: str = "") -> str:
  return "n/a" if x is None else f"{100 * x:.1f}{unit}"


def _num(x: float | None) -> str:
  return "n/a" if x is None else f"{x:,.0f}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SuiteResult:
  """The table: one row per benchmark run, and the report's benchmarks not run."""
  results: tuple[BenchmarkResult, ...]
  not_run: tuple[str, ...]
  protocol: str
  temperature: float
  top_p: float
  samples_per_problem: int
  max_response_tokens: int
  max_turns: int
  model_source: str
  seed: int

  def to_dict(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out["results"] = [r.to_dict() for r in self.results]
    out["not_run"] = list(self.not_run)
    out["greedy"] = self.temperature == 0
    return out

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2)

  def markdown(self) -> str:
    mode = "GREEDY decoding" if self.temperature == 0 else "sampled"
    lines = [f"Model: {self.model_source or '?'}; protocol {self.protocol}: {mode}, temperature "
             f"{self.temperature}, top-p {self.top_p}, {self.samples_per_problem} samples per "
             f"problem, up to {self.max_response_tokens} response tokens and {self.max_turns} "
             f"turns; seed {self.seed}. pass@1 is the mean over samples and problems, in %, "
             f"with a {int(100 * CI_LEVEL)}% bootstrap interval over problems.", ""]
    ks = sorted({int(k) for r in self.results for k in r.pass_at_k if k != "1"})
    head = (["benchmark", "problems", "pass@1 [95% CI]", "report", "inside"]
            + [f"pass@{k}" for k in ks]
            + ["tokens (all / correct)", "report tokens", "tool calls / traj",
               "tool errors (all / correct)", "truncated"])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in self.results:
      size = f"{r.num_problems}" + (f" (of {r.expected_problems})"
                                    if r.expected_problems not in (None, r.num_problems) else "")
      inside = {None: "n/a", True: "yes", False: "NO"}[r.report_inside]
      row = [r.title, size, f"{_pct(r.pass_at_1)} [{_pct(r.ci_low)}, {_pct(r.ci_high)}]",
             "n/a" if r.report_pass_at_1 is None else f"{r.report_pass_at_1:.1f}", inside]
      row += [_pct(r.pass_at_k.get(str(k))) for k in ks]
      row += [f"{_num(r.mean_response_tokens)} / {_num(r.mean_response_tokens_correct)}",
              "n/a" if r.report_response_tokens is None else f"{r.report_response_tokens:,.1f}",
              f"{r.tool_calls_per_trajectory:.2f}",
              f"{_pct(r.tool_error_rate, '%')} / {_pct(r.tool_error_rate_correct, '%')}",
              _pct(r.share_truncated, "%")]
      lines.append("| " + " | ".join(row) + " |")
    if self.not_run:
      lines += ["", "Not run (no file given): " + ", ".join(self.not_run)]
    return "\n".join(lines)


def _stamp(path: str) -> list:
  st = os.stat(path)
  return [os.path.abspath(path), st.st_size, st.st_mtime_ns]


def _write_json(path: str, obj: Any) -> None:
  with open(path + ".tmp", "w") as f:
    f.write(obj if isinstance(obj, str) else json.dumps(obj, indent=2, default=str))
  os.replace(path + ".tmp", path)


def _read_json(path: str) -> Any:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


_OUTPUTS = (".json", ".made_with.json", ".result.json", "_samples.jsonl")


def _journal_key(path: str) -> Any:
  try:
    with open(path) as f:
      return json.loads(f.readline()).get("key")
  except (OSError, ValueError, AttributeError):
    return None


def _journaled(path: str, made_with: Any) -> int:
  """Trajectories a journal of these settings holds (what a resumed run does not generate)."""
  if _journal_key(path) != made_with:
    return 0
  with open(path) as f:
    return max(0, sum(1 for line in f if line.endswith("\n")) - 1)


def _keep_previous(stem: str, made_with: Any) -> None:
  """Results (and a journal) that another model, file or setting made are moved to
  <name>_<n>.*, not overwritten: a rerun with another protocol loses nothing."""
  moved = [suffix for suffix in _OUTPUTS if os.path.exists(stem + suffix)]
  journal = stem + ".journal.jsonl"
  if os.path.exists(journal) and _journal_key(journal) != made_with:
    moved.append(".journal.jsonl")
  if not moved:
    return
  n = 1
  while any(os.path.exists(f"{stem}_{n}{suffix}") for suffix in (*_OUTPUTS, ".journal.jsonl")):
    n += 1
  for suffix in moved:
    os.replace(stem + suffix, f"{stem}_{n}{suffix}")
  logging.warning("%s: earlier results made with other settings moved to %s_%d.*", stem, stem, n)


def stream_of(seed: int, name: str) -> tuple[int, ...]:
  """A benchmark's seed stream: its own, whichever other benchmarks run beside it."""
  return (seed, rollout_collector.EVAL, SUITE_SALT, zlib.crc32(name.encode("utf-8")))


def run_benchmark(engine, tools, proto, tokenizer, bench: bench_lib.Benchmark,
                  problems: Sequence[math_problems.MathProblem], cfg: eval_lib.EvalConfig, *,
                  stream: Sequence[int], journal: str | None = None, journal_key: Any = None,
                  progress: bool = True, desc: str = "", model_source: str = "",
                  seed: int | None = None
                  ) -> tuple[pass_at_k.EvalReport, list[agent_loop.Trajectory]]:
  """k graded trajectories per problem of one benchmark, and their report."""
  groups = rollout_collector.collect(engine, tools, proto, tokenizer, problems, k=cfg.k,
                                     agent=cfg.agent, stream=stream, progress=progress,
                                     desc=desc or bench.name, journal=journal,
                                     journal_key=journal_key)
  trajs = [t for g in groups for t in g]
  rollout_collector.raise_if_failed(trajs, f"benchmark {bench.name}")
  if bench.answer_type == "choice":   # collect graded them as math; the letter decides
    for p, group in zip(problems, groups, strict=True):
      for t in group:
        t.reward = bench_lib.grade(bench, t.model_text(tokenizer), p.answer,
                                   truncated=t.truncated)
  ks = sorted({1, cfg.k} | {x for x in (2, 4, 8, 16) if x < cfg.k})
  report = pass_at_k.compute_report(eval_lib.records_from(trajs), temperature=cfg.agent.temperature,
                                    top_p=cfg.agent.top_p, ks=ks, dataset=bench.name,
                                    model_source=model_source, seed=seed)
  return report, trajs


def run_suite(engine: Callable[[], Any], tools, proto, tokenizer,
              given: Sequence[tuple[bench_lib.Benchmark, str]], cfg: eval_lib.EvalConfig, *,
              out_dir: str, seed: int, protocol_name: str, key: Any = None,
              model_source: str = "", not_run: Sequence[str] = (), progress: bool = True,
              shuffle_seed: int = 0) -> SuiteResult:
  """Every benchmark in `given` (loaded first: a missing or broken file is said before any
  generation), one after the other, then the table in `out_dir` (suite.md, suite.json).

  `engine`: called once, when the first benchmark needs generating (a suite whose
  benchmarks are all finished loads no model). `key`: what else decides the results (the
  model, the tool settings); a journal or a finished benchmark made with another key is
  not reused."""
  os.makedirs(out_dir, exist_ok=True)
  engines = []

  def generator():
    if not engines:
      engines.append(engine())
    return engines[0]

  loaded = [(b, path, bench_lib.load(b, path, seed=shuffle_seed)) for b, path in given]
  total = sum(len(ps) for _, _, ps in loaded) * cfg.k
  results, done_trajs, started = [], 0, time.monotonic()
  ran, ran_s = 0, 0.0   # trajectories generated here, and the time it took (for the ETA)
  for i, (b, path, problems) in enumerate(loaded):
    made_with = json.loads(json.dumps({
        "benchmark": b.name, "file": _stamp(path), "seed": seed, "shuffle_seed": shuffle_seed,
        "eval": dataclasses.asdict(cfg), "key": key}, default=str))
    stem = os.path.join(out_dir, b.name)
    report_path = stem + ".json"
    n_trajs = len(problems) * cfg.k
    prior = _read_json(stem + ".made_with.json")
    if prior != made_with:
      _keep_previous(stem, made_with)
    if prior == made_with and os.path.exists(report_path):
      with open(report_path) as f:
        report = pass_at_k.EvalReport.from_json(f.read())
      print(f"[{i + 1}/{len(loaded)}] {b.name}: already evaluated with these settings "
            f"({report_path})")
    else:
      print(f"[{i + 1}/{len(loaded)}] {b.name}: {len(problems)} problems x {cfg.k} samples "
            f"from {path}")
      resumed, t0 = _journaled(stem + ".journal.jsonl", made_with), time.monotonic()
      report, trajs = run_benchmark(
          generator(), tools, proto, tokenizer, b, problems, cfg, stream=stream_of(seed, b.name),
          journal=stem + ".journal.jsonl", journal_key=made_with, progress=progress,
          desc=f"{b.name} [{i + 1}/{len(loaded)}]", model_source=model_source, seed=seed)
      eval_lib.write_samples(stem + "_samples.jsonl", trajs, problems, tokenizer)
      _write_json(report_path, report.to_json())
      _write_json(stem + ".made_with.json", made_with)
      os.remove(stem + ".journal.jsonl")   # the samples hold what it held
      ran += n_trajs - resumed
      ran_s += time.monotonic() - t0
    result = result_from(b, path, report, ci_seed=seed)
    _write_json(stem + ".result.json", result.to_dict())
    results.append(result)
    done_trajs += n_trajs
    left = total - done_trajs
    if left and ran:
      eta = ran_s / ran * left
      print(f"suite: {done_trajs}/{total} trajectories done; about {eta / 60:.0f} min left "
            f"at this pace")
  suite = SuiteResult(results=tuple(results), not_run=tuple(not_run), protocol=protocol_name,
                      temperature=cfg.agent.temperature, top_p=cfg.agent.top_p,
                      samples_per_problem=cfg.k, max_response_tokens=cfg.agent.max_response_tokens,
                      max_turns=cfg.agent.max_turns, model_source=model_source, seed=seed)
  _write_json(os.path.join(out_dir, "suite.json"), suite.to_json())
  with open(os.path.join(out_dir, "suite.md.tmp"), "w") as f:
    f.write(suite.markdown() + "\n")
  os.replace(os.path.join(out_dir, "suite.md.tmp"), os.path.join(out_dir, "suite.md"))
  logging.info("suite: %d benchmarks in %.0f s", len(results), time.monotonic() - started)
  return suite
