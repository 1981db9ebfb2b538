"""Evaluation runs: k sampled trajectories per problem through the agent loop.

Sampling is explicit (temperature is a required argument and is printed in every
report): the release's eval script sampled greedily by default (SPEC.md section 6).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from typing import Sequence

from rstar_jax.data import math_data
from rstar_jax.eval import metrics
from rstar_jax.rl import rewards
from rstar_jax.rollout import agent_loop, chat


def records_from(trajs: Sequence[agent_loop.Trajectory]) -> list[metrics.SampleRecord]:
  out = []
  for t in trajs:
    uid, _, idx = t.uid.rpartition("#")
    out.append(metrics.SampleRecord(
        problem_uid=uid, sample_index=int(idx), reward=float(t.reward or 0.0),
        response_tokens=t.model_tokens, num_tool_calls=t.num_tool_calls,
        num_tool_errors=t.num_tool_errors, num_turns=t.num_turns, truncated=t.truncated))
  return out


def sample_trajectories(engine, tools, proto: chat.ChatProtocol, tokenizer,
                        problems: Sequence[math_data.MathProblem], *, k: int,
                        agent_cfg: agent_loop.AgentConfig, seed: int,
                        progress: bool = True, desc: str = "eval"
                        ) -> list[agent_loop.Trajectory]:
  """k trajectories per problem (uids '<problem uid>#<j>'), rewards filled in."""
  items = [(f"{p.uid}#{j}", p.problem) for p in problems for j in range(k)]
  answers = [p.answer for p in problems for _ in range(k)]
  seeds = [(seed * 7_919 + i) % (2 ** 31 - 1) for i in range(len(items))]
  bar = None
  if progress:
    from tqdm import tqdm
    bar = tqdm(total=len(items), desc=desc, unit="traj")
  try:
    trajs = asyncio.run(agent_loop.run_many(
        engine, tools, proto, items, agent_cfg, seeds=seeds,
        progress=(lambda _: bar.update(1)) if bar is not None else None))
  finally:
    if bar is not None:
      bar.close()
  for t, ans in zip(trajs, answers):
    t.reward = rewards.compute_reward(t.model_text(tokenizer), ans, truncated=t.truncated)
  return trajs


def evaluate(engine, tools, proto, tokenizer, problems, *, k: int,
             agent_cfg: agent_loop.AgentConfig, seed: int = 1234, dataset: str = "",
             progress: bool = True) -> tuple[metrics.EvalReport, list[agent_loop.Trajectory]]:
  trajs = sample_trajectories(engine, tools, proto, tokenizer, problems, k=k,
                              agent_cfg=agent_cfg, seed=seed, progress=progress, desc=dataset)
  ks = sorted({1, k} | {x for x in (2, 4, 8, 16) if x < k})
  report = metrics.compute_report(records_from(trajs), temperature=agent_cfg.temperature,
                                  top_p=agent_cfg.top_p, ks=ks, dataset=dataset)
  return report, trajs


def write_samples(path: str, trajs: Sequence[agent_loop.Trajectory],
                  problems: Sequence[math_data.MathProblem], tokenizer) -> str:
  """One JSON line per trajectory: problem, reference answer, the whole response text
  (tool outputs included), reward and tool counts; for reading what the model did."""
  by_uid = {p.uid: p for p in problems}
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    for t in trajs:
      uid = t.uid.rpartition("#")[0]
      p = by_uid.get(uid)
      f.write(json.dumps({
          "uid": t.uid, "problem": p.problem if p else None, "answer": p.answer if p else None,
          "meta": p.meta if p else {}, "reward": t.reward, "finish_reason": t.finish_reason,
          "num_tool_calls": t.num_tool_calls, "num_tool_errors": t.num_tool_errors,
          "response": tokenizer.decode(t.response_ids)}) + "\n")
  os.replace(tmp, path)
  return path
