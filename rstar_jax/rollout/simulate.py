"""Discrete-event simulation of multi-turn rollouts over several engines.

Deterministic stand-in for a rollout cluster, driving the SAME policy objects as
`scheduler.EnginePool`: each engine holds `kv_capacity` tokens of KV cache, runs
every admitted request one token per decode step, and a step takes
`step_s + per_seq_s * running` seconds (batched decoding). A trajectory is a list of
turns (tokens to generate) separated by tool calls of given latency; each turn is a
new request, dispatched by the policy at the moment it is issued.

Used to compare policies' makespan (tests/rollout/test_scheduler.py) and to spread the
14B estimate's rollouts (experiments/benchmarks/async_throughput.py) where a real cluster
is not at hand.
"""
from __future__ import annotations

import dataclasses
import heapq
from typing import Sequence

import numpy as np

from rstar_jax.rollout import scheduler


@dataclasses.dataclass
class SimTrajectory:
  prompt_tokens: int
  turn_tokens: list[int]        # tokens generated per turn
  tool_latency_s: list[float]   # after each turn but the last


@dataclasses.dataclass
class _Req:
  traj: int
  turn: int
  context: int       # tokens already in context (prompt + earlier turns + tool output)
  remaining: int


class SimEngine:
  def __init__(self, name: str, kv_capacity: int, step_s: float, per_seq_s: float):
    self.name, self.kv_capacity = name, kv_capacity
    self.step_s, self.per_seq_s = step_s, per_seq_s
    self.running: list[_Req] = []
    self.queue: list[_Req] = []
    self.busy_until: float | None = None
    self.busy_time = 0.0

  def used(self) -> int:
    return sum(r.context for r in self.running)

  def free_kv_tokens(self) -> int:
    # As JaxEngine: capacity minus what running and queued requests claim.
    return self.kv_capacity - self.used() - sum(r.context + r.remaining for r in self.queue)

  def num_active(self) -> int:
    return len(self.running) + len(self.queue)

  def admit(self):
    while self.queue and self.used() + self.queue[0].context + 1 <= self.kv_capacity:
      self.running.append(self.queue.pop(0))


def simulate(trajs: Sequence[SimTrajectory], *, num_engines: int, policy: str,
             kv_capacity: int, step_s: float = 0.02, per_seq_s: float = 0.0005,
             tool_token_overhead: int = 50) -> dict[str, float]:
  pick = scheduler.get_policy(policy)
  engines = [SimEngine(f"sim{i}", kv_capacity, step_s, per_seq_s) for i in range(num_engines)]
  events: list[tuple[float, int, str, int, object]] = []   # (time, seq, kind, engine, payload)
  seq = 0
  finished_at = [0.0] * len(trajs)

  def push(t, kind, eng, payload):
    nonlocal seq
    heapq.heappush(events, (t, seq, kind, eng, payload))
    seq += 1

  def kick(e_idx, now):
    e = engines[e_idx]
    e.admit()
    if e.busy_until is None and e.running:
      dur = e.step_s + e.per_seq_s * len(e.running)
      e.busy_until = now + dur
      e.busy_time += dur
      push(e.busy_until, "step", e_idx, None)

  def submit(req, now):
    class _R:  # minimal request view for policies
      input_ids = [0] * req.context
      max_new_tokens = req.remaining
    e_idx = pick(engines, _R)
    engines[e_idx].queue.append(req)
    kick(e_idx, now)

  for i, t in enumerate(trajs):
    push(0.0, "submit", -1, _Req(i, 0, t.prompt_tokens, t.turn_tokens[0]))
  while events:
    now, _, kind, e_idx, payload = heapq.heappop(events)
    if kind == "submit":
      submit(payload, now)
      continue
    e = engines[e_idx]
    e.busy_until = None
    still = []
    for r in e.running:
      r.remaining -= 1
      r.context += 1
      if r.remaining > 0:
        still.append(r)
        continue
      t = trajs[r.traj]
      if r.turn + 1 < len(t.turn_tokens):
        nxt = _Req(r.traj, r.turn + 1, r.context + tool_token_overhead,
                   t.turn_tokens[r.turn + 1])
        push(now + t.tool_latency_s[r.turn], "submit", -1, nxt)
      else:
        finished_at[r.traj] = now
    e.running = still
    kick(e_idx, now)
  makespan = max(finished_at)
  return {"makespan_s": makespan,
          "mean_utilisation": float(np.mean([e.busy_time / makespan for e in engines]))}


def unequal_workload(n: int, seed: int = 0, long_share: float = 0.15) -> list[SimTrajectory]:
  """Mostly short trajectories with a heavy tail of long ones (as in RL rollouts)."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    turns = int(rng.integers(1, 6))
    long = rng.random() < long_share
    toks = rng.integers(400, 1500, size=turns) if long else rng.integers(20, 120, size=turns)
    out.append(SimTrajectory(prompt_tokens=int(rng.integers(50, 200)),
                             turn_tokens=[int(x) for x in toks],
                             tool_latency_s=[float(x) for x in rng.uniform(0.01, 0.3, turns)]))
  return out
