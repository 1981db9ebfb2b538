"""What an engine is: the request / result types and the protocol every backend speaks.

The agent loop, the scheduler and the trainers see engines only through `Engine`:
the in-process JaxEngine today, SGLang or our own rollout servers over HTTP next.
Requests are token-in / token-out: ids in, sampled ids and their log-probs out.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence


@dataclasses.dataclass(kw_only=True)
class GenerationRequest:
  input_ids: Sequence[int]
  max_new_tokens: int
  stop_token_ids: Sequence[int] = ()
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  seed: int = 0
  request_id: str | None = None
  # Tokens after which the caller continues this sequence when the output ends with
  # one (a tool call's end): an in-process engine keeps the slot's cached prefix for
  # the next turn a short while (EngineConfig.prefix_grace_s). Not sent to HTTP servers.
  continue_ids: Sequence[int] = ()

  def validate(self, max_len: int) -> None:
    if len(self.input_ids) == 0:
      raise ValueError(f"request {self.request_id}: empty input_ids")
    if len(self.input_ids) >= max_len:
      raise ValueError(f"request {self.request_id}: {len(self.input_ids)} input tokens do "
                       f"not fit the engine's max_len={max_len}")
    if self.max_new_tokens <= 0:
      raise ValueError(f"request {self.request_id}: max_new_tokens must be >= 1, got "
                       f"{self.max_new_tokens!r}")
    if not self.temperature >= 0:
      raise ValueError(f"request {self.request_id}: bad sampling params: temperature must be >= 0 (0: greedy), "
                       f"got {self.temperature!r}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"request {self.request_id}: bad sampling params: top_p must be in (0, 1], got "
                       f"{self.top_p!r}")
    if not 0 <= self.top_k < 2**31:
      raise ValueError(f"request {self.request_id}: bad sampling params: top_k must be in [0, 2**31) (0: no "
                       f"top-k cut), got {self.top_k!r}")
    # The engines carry seeds as int32: one out of range would fail the whole batch.
    if not -2**31 <= self.seed < 2**31:
      raise ValueError(f"request {self.request_id}: seed={self.seed} is not a 32-bit int")


@dataclasses.dataclass
class GenerationResult:
  request_id: str | None
  output_ids: list[int]
  logprobs: list[float]
  finish_reason: str           # "stop" (a stop token, included in output_ids) | "length"
  prompt_tokens: int
  reused_prefix_tokens: int
  queue_wait_s: float
  weight_version: str | None = None   # the policy weights it was generated with, if known


class RequestFailed(RuntimeError):
  """One request failed (a malformed reply, an abort, a refusal, a timeout) and the
  engine goes on: the agent loop ends that trajectory as failed ("error") instead of
  failing every trajectory of the batch."""


class Engine(Protocol):
  """One generation backend (or a pool of them: `EnginePool` speaks this too)."""
  name: str
  max_len: int   # the longest prompt + response it holds

  async def generate(self, request: GenerationRequest) -> GenerationResult: ...

  def free_kv_tokens(self) -> int: ...

  def num_active(self) -> int: ...

  def update_weights(self, params, version: str | None = None) -> None:
    """Generate with these policy parameters (named `version`) from the next request on."""

  def stop(self) -> None: ...
