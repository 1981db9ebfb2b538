"""The multi-turn agent loop, token-in / token-out.

Per trajectory we keep the prompt ids and, after it, every response id with a loss
mask (1 = sampled by the model, with the sampler's log-prob; 0 = tool output and
template tokens we inserted). Earlier turns are never re-tokenized from text: the
next request's input is exactly prompt + all response ids so far (re-tokenizing decoded
text does not give back the sampled ids, and drops the separators between turns).

Stops:
  * the model ends a turn without a tool call ("stop"),
  * `max_turns` assistant turns were used and it still wants a tool ("max_turns"),
  * the response budget (model + tool tokens) runs out ("length"). A tool turn that
    would not fit is dropped, so the last turn is always the model's.
"max_turns" and "length" trajectories are marked truncated (reward 0, kept: the
rStar2-Agent report, GRPO-RoC).
A request the engine could not serve (`RequestFailed`: a malformed reply, an abort, a
timeout) ends its trajectory as "error" (`failed`, `error` says why); the others go on.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from typing import Any, Mapping, Protocol, Sequence

from rstar_jax.rollout import chat
from rstar_jax.rollout.engine import Engine, GenerationRequest, RequestFailed


class ToolExecutor(Protocol):
  async def execute(self, calls: Sequence[chat.ParsedToolCall]) -> list[Mapping[str, Any]]:
    """One sandbox result mapping (status, stdout, stderr, ...) per call, in order."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentConfig:
  max_turns: int = 10
  max_response_tokens: int = 8192
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0

  def __post_init__(self):
    for name in ("max_turns", "max_response_tokens"):
      if getattr(self, name) <= 0:
        raise ValueError(f"AgentConfig.{name} must be >= 1, got {getattr(self, name)!r}")
    if not self.temperature >= 0:   # NaN too
      raise ValueError(f"AgentConfig.temperature must be >= 0 (0: greedy), got "
                       f"{self.temperature!r}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"AgentConfig.top_p must be in (0, 1], got {self.top_p!r}")
    if self.top_k < 0:
      raise ValueError(f"AgentConfig.top_k must be >= 0 (0: no top-k cut), got {self.top_k!r}")


@dataclasses.dataclass
class Trajectory:
  uid: str
  prompt_ids: list[int]
  response_ids: list[int] = dataclasses.field(default_factory=list)
  response_mask: list[int] = dataclasses.field(default_factory=list)
  response_logprobs: list[float] = dataclasses.field(default_factory=list)
  turns: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # model spans
  num_tool_calls: int = 0
  num_tool_errors: int = 0
  tool_statuses: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  finish_reason: str = ""
  generate_s: float = 0.0
  tool_s: float = 0.0
  answer_tags: int = 0
  reward: float | None = None
  # Distinct policy weight versions its turns were generated with (in order); more
  # than one means the weights changed mid-trajectory.
  weight_versions: list[str] = dataclasses.field(default_factory=list)
  # The version each turn was generated with (one per `turns` entry, None where the
  # engine names none): the tokens of turn i (span turns[i]) come from turn_versions[i].
  turn_versions: list[str | None] = dataclasses.field(default_factory=list)
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)
  error: str = ""   # why a failed trajectory failed

  @property
  def truncated(self) -> bool:
    return self.finish_reason in ("length", "max_turns")

  @property
  def failed(self) -> bool:
    """The engine could not serve one of its requests: not a sample of the policy."""
    return self.finish_reason == "error"

  @property
  def num_turns(self) -> int:
    return len(self.turns)

  @property
  def model_tokens(self) -> int:
    return int(sum(self.response_mask))

  def model_text(self, tokenizer) -> str:
    """What the model wrote, turn by turn (tool outputs excluded): rewards read this."""
    return "\n".join(tokenizer.decode(self.response_ids[a:b]) for a, b in self.turns)


def _turn_seed(seed: int, turn: int) -> int:
  return (seed * 1_000_003 + turn * 7_919) % (2 ** 31 - 1)


async def run_trajectory(engine: Engine, tools: ToolExecutor, proto: chat.ChatProtocol,
                         problem: str, cfg: AgentConfig, *, seed: int, uid: str = "",
                         prompt_ids: Sequence[int] | None = None) -> Trajectory:
  traj = Trajectory(uid=uid, prompt_ids=list(prompt_ids if prompt_ids is not None
                                             else proto.prompt_ids(problem)))
  room = getattr(engine, "max_len", 0) or 0   # the engine's KV length (prompt + response)
  while True:
    budget = cfg.max_response_tokens - len(traj.response_ids)
    if room:
      # A context that fills the engine's sequence length ends the trajectory as
      # truncated; it never becomes a request the engine has to refuse.
      budget = min(budget, room - len(traj.prompt_ids) - len(traj.response_ids))
    if budget <= 0:
      traj.finish_reason = "length"
      break
    req = GenerationRequest(
        input_ids=traj.prompt_ids + traj.response_ids, max_new_tokens=budget,
        stop_token_ids=proto.stop_ids, temperature=cfg.temperature, top_p=cfg.top_p,
        top_k=cfg.top_k, seed=_turn_seed(seed, traj.num_turns),
        request_id=f"{uid}/turn{traj.num_turns}", continue_ids=proto.continue_ids)
    t0 = time.perf_counter()
    try:
      out = await engine.generate(req)
    except RequestFailed as e:
      traj.generate_s += time.perf_counter() - t0
      traj.finish_reason, traj.error = "error", f"{type(e).__name__}: {e}"
      break
    traj.generate_s += time.perf_counter() - t0
    start = len(traj.response_ids)
    traj.response_ids += out.output_ids
    traj.response_mask += [1] * len(out.output_ids)
    traj.response_logprobs += list(out.logprobs)
    version = getattr(out, "weight_version", None)
    if version is not None and version not in traj.weight_versions:
      traj.weight_versions.append(version)
    traj.turns.append((start, len(traj.response_ids)))
    traj.turn_versions.append(version)
    turn = proto.parse_turn(out.output_ids)
    traj.answer_tags += turn.answer_tags
    if out.finish_reason == "length" and not turn.wants_tool:
      traj.finish_reason = "length"
      break
    if not turn.wants_tool:
      traj.finish_reason = "stop"
      break
    if traj.num_turns >= cfg.max_turns:
      traj.finish_reason = "max_turns"
      break
    t0 = time.perf_counter()
    runnable = [c for c in turn.calls if c.ok]
    results = await tools.execute(runnable) if runnable else []
    traj.tool_s += time.perf_counter() - t0
    by_call = iter(results)
    responses = []
    for call in turn.calls:
      result = next(by_call) if call.ok else None
      traj.num_tool_calls += 1
      if proto.is_tool_error(call, result):
        traj.num_tool_errors += 1
      traj.tool_statuses["parse_error" if result is None else result.get("status", "?")] += 1
      responses.append(proto.tool_response_text(call, result))
    tool_ids = proto.tool_turn_ids(out.output_ids, responses)
    length = len(traj.response_ids) + len(tool_ids)
    if length >= cfg.max_response_tokens or (room and len(traj.prompt_ids) + length >= room):
      # No room for the tool turn and another model turn (in the response budget or the
      # engine's context): the last turn stays the model's.
      traj.finish_reason = "length"
      break
    traj.response_ids += tool_ids
    traj.response_mask += [0] * len(tool_ids)
    traj.response_logprobs += [0.0] * len(tool_ids)
  return traj


async def run_many(engine: Engine, tools: ToolExecutor, proto: chat.ChatProtocol,
                   problems: Sequence[tuple[str, str]], cfg: AgentConfig, *,
                   seeds: Sequence[int], progress=None,
                   prompt_ids: Sequence[Sequence[int]] | None = None) -> list[Trajectory]:
  """All trajectories concurrently; `problems` are (uid, problem text), `prompt_ids`
  their prompts when the caller has them already (else each is rendered here).

  Each trajectory is its own task: when one waits on the sandbox, the others keep
  the engine busy.
  """
  async def one(i):
    uid, problem = problems[i]
    t = await run_trajectory(engine, tools, proto, problem, cfg, seed=seeds[i], uid=uid,
                             prompt_ids=None if prompt_ids is None else prompt_ids[i])
    if progress is not None:
      progress(t)
    return t
  try:
    return list(await asyncio.gather(*(one(i) for i in range(len(problems)))))
  finally:
    # Callers run this in a fresh asyncio.run per batch: connections must close
    # with their loop rather than leak (aiohttp's "Unclosed client session").
    release = getattr(tools, "release_loop", None)
    if release is not None:
      await release()
