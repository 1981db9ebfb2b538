"""Evaluation runs: k sampled trajectories per problem (the RL rollout collector), scored.

Sampling is explicit (temperature is a required argument and is printed in every
report): the release's eval script sampled greedily by default (microsoft/rStar's evaluation
scripts).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

from rstar_jax.data import math_problems
from rstar_jax.eval import pass_at_k
from rstar_jax.rl import rollout_collector
from rstar_jax.rollout import agent_loop


def records_from(trajs: Sequence[agent_loop.Trajectory]) -> list[pass_at_k.SampleRecord]:
  out = []
  for t in trajs:
    uid, _, idx = t.uid.rpartition("#")
    out.append(pass_at_k.SampleRecord(
        problem_uid=uid, sample_index=int(idx), reward=float(t.reward or 0.0),
        # Tool outputs included, as the length budget counts them (the report's response
        # length); the RL metrics' model_tokens_mean counts the model's own tokens.
        response_tokens=len(t.response_ids), num_tool_calls=t.num_tool_calls,
        num_tool_errors=t.num_tool_errors, num_turns=t.num_turns, truncated=t.truncated))
  return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
  """Attributes:
    k: samples per problem (pass@1 is their mean; pass@k unbiased, up to k).
    agent: turn / token budget and sampling (temperature is stated in every report).
  """
  k: int = 4
  agent: agent_loop.AgentConfig = dataclasses.field(default_factory=agent_loop.AgentConfig)

  def __post_init__(self):
    if self.k < 1:
      raise ValueError(f"EvalConfig.k must be >= 1, got {self.k}")


def evaluate(engine, tools, proto, tokenizer, problems, cfg: EvalConfig, *,
             stream: Sequence[int], dataset: str = "", model_source: str = "",
             seed: int | None = None, progress: bool = True, journal: str | None = None,
             journal_key: Any = None
             ) -> tuple[pass_at_k.EvalReport, list[agent_loop.Trajectory]]:
  """k trajectories per problem through `rl.rollout_collector.collect`, and their report
  (`journal`, `journal_key`: resumable, see `collect`)."""
  groups = rollout_collector.collect(engine, tools, proto, tokenizer, problems, k=cfg.k,
                                     agent=cfg.agent, stream=stream, progress=progress,
                                     desc=dataset or "eval", journal=journal, journal_key=journal_key)
  trajs = [t for g in groups for t in g]
  rollout_collector.raise_if_failed(trajs, f"evaluation {dataset}".strip())
  ks = sorted({1, cfg.k} | {x for x in (2, 4, 8, 16) if x < cfg.k})
  report = pass_at_k.compute_report(records_from(trajs), temperature=cfg.agent.temperature,
                                    top_p=cfg.agent.top_p, ks=ks, dataset=dataset,
                                    model_source=model_source, seed=seed,
                                    source_of={p.uid: p.source for p in problems})
  return report, trajs


def _json_default(value):
  """Problem meta from Parquet can hold dates, Decimals and bytes (an image column): json
  refused them after the whole evaluation had run. Written as text instead."""
  if isinstance(value, (bytes, bytearray)):
    try:
      return value.decode("utf-8")
    except UnicodeDecodeError:
      return repr(bytes(value))
  if hasattr(value, "isoformat"):   # datetime, date, time
    return value.isoformat()
  return str(value)   # Decimal, and anything else


def write_samples(path: str, trajs: Sequence[agent_loop.Trajectory],
                  problems: Sequence[math_problems.MathProblem], tokenizer) -> str:
  """One JSON line per trajectory: problem, reference answer, the whole response text
  (tool outputs included), reward and tool counts; for reading what the model did.
  The token ids (prompt, response) and the response's loss mask (1 = model-written,
  0 = tool side) are stored too, for analyses that rescore them (analysis/entropy.py)."""
  by_uid = {p.uid: p for p in problems}
  tmp = path + ".tmp"
  try:
    with open(tmp, "w") as f:
      for t in trajs:
        uid = t.uid.rpartition("#")[0]
        p = by_uid.get(uid)
        f.write(json.dumps({
            "uid": t.uid, "problem": p.problem if p else None, "answer": p.answer if p else None,
            "meta": p.meta if p else {}, "reward": t.reward, "finish_reason": t.finish_reason,
            "num_tool_calls": t.num_tool_calls, "num_tool_errors": t.num_tool_errors,
            "response": tokenizer.decode(t.response_ids),
            "prompt_ids": list(t.prompt_ids), "response_ids": list(t.response_ids),
            "response_mask": list(t.response_mask)}, default=_json_default) + "\n")
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)   # no half-written .tmp beside the reports
    raise
  os.replace(tmp, path)
  return path
