"""Rollouts a random model can do: scripted tool calls, static batching, timed tools.

A random Qwen3 almost never writes a tool call, so multi-turn benchmarks and device
checks (`bench_rollout` (b), `device_check`'s rollouts section) wrap the engine in
`ToolCallingEngine`, which makes each trajectory's first turns end in a scripted call
of its problem's code. No flags here: several absl scripts import it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import time


class ToolCallingEngine:
  """Makes a random model call tools: turn k < calls_per_traj samples `think_tokens`
  tokens (no stop ids) from the real engine, then appends a scripted call of the
  trajectory's code (tool-side log-prob 0). Later turns go to the engine unchanged."""

  def __init__(self, engine, call_ids_by_uid, calls_per_traj: int, think_tokens: int,
               vocab_size: int, unequal: bool = False):
    self.engine = engine
    self.call_ids = call_ids_by_uid
    self.calls_per_traj = calls_per_traj
    self.think_tokens = think_tokens
    self.vocab_size = vocab_size
    # unequal: each trajectory thinks 1/4x-4x `think_tokens` per turn and caps its last
    # turn at 8-256 tokens (log-uniform, seeded by its uid): very unequal lengths.
    self.unequal = unequal
    # Prefix reuse: tokens cached for a trajectory when its previous turn ended (what
    # its next turn could reuse) against what the engine reused.
    self.cached: dict[str, int] = {}
    self.reusable = self.reused = 0
    self.decoded: dict[str, dict[int, int]] = {}   # uid -> turn -> tokens the engine sampled

  def _account(self, uid: str, turn: int, request, out) -> None:
    self.decoded.setdefault(uid, {})[turn] = len(out.output_ids)
    if turn > 0:
      self.reusable += self.cached.get(uid, 0)
      self.reused += out.reused_prefix_tokens
    self.cached[uid] = len(request.input_ids) + len(out.output_ids) - 1

  async def generate(self, request):
    from rstar_jax.rollout.jax_engine import GenerationResult
    uid, _, turn = (request.request_id or "").rpartition("/turn")
    if not uid or not turn.isdigit():
      raise ValueError(f"request_id {request.request_id!r} is not '<uid>/turn<k>'")
    call = self.call_ids[uid]
    think, last = self.think_tokens, request.max_new_tokens
    if self.unequal:
      rng = random.Random(uid)
      think = rng.randint(max(1, think // 4), think * 4)
      last = min(last, int(round(8 * 32 ** rng.random())))
    think = min(think, request.max_new_tokens - len(call))
    if int(turn) >= self.calls_per_traj or think < 1:
      out = await self.engine.generate(dataclasses.replace(request, max_new_tokens=last))
      self._account(uid, int(turn), request, out)
      return out
    # Every thinking turn ends in a tool call: the engine may hold its slot for the next.
    out = await self.engine.generate(dataclasses.replace(
        request, max_new_tokens=think, stop_token_ids=(),
        continue_ids=range(self.vocab_size)))
    self._account(uid, int(turn), request, out)
    return GenerationResult(
        request_id=request.request_id, output_ids=out.output_ids + call,
        logprobs=out.logprobs + [0.0] * len(call), finish_reason="stop",
        prompt_tokens=out.prompt_tokens, reused_prefix_tokens=out.reused_prefix_tokens,
        queue_wait_s=out.queue_wait_s)


class TurnBatches:
  """Static batching over an engine, the baseline for continuous batching: the
  requests of one turn wait until every live trajectory has sent its own (or ended),
  start together, and all return when the last of them is done."""

  def __init__(self, inner, trajectories: int):
    self.inner = inner
    self.live = trajectories
    self.waiting: list = []

  async def generate(self, request):
    fut = asyncio.get_running_loop().create_future()
    self.waiting.append((request, fut))
    self._release()
    return await fut

  def finished(self, _trajectory=None) -> None:
    self.live -= 1
    self._release()

  def _release(self) -> None:
    if self.waiting and len(self.waiting) >= self.live:
      batch, self.waiting = self.waiting, []
      asyncio.ensure_future(self._run(batch))

  async def _run(self, batch) -> None:
    outs = await asyncio.gather(*(self.inner.generate(r) for r, _ in batch),
                                return_exceptions=True)
    for (_, fut), out in zip(batch, outs):
      if isinstance(out, BaseException):
        fut.set_exception(out)
      else:
        fut.set_result(out)


class TimedTools:
  """Times every `execute` (one per tool turn) of the wrapped executor and keeps each
  (call, result) pair, so that a report can say which calls failed and why."""

  def __init__(self, inner):
    self.inner = inner
    self.latencies: list[float] = []
    self.calls = 0
    self.records: list[tuple] = []

  async def execute(self, calls):
    t = time.perf_counter()
    out = await self.inner.execute(calls)
    self.latencies.append(time.perf_counter() - t)
    self.calls += len(calls)
    self.records.extend(zip(calls, out))
    return out
