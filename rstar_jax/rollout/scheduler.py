"""Dispatch of generation requests over several engines, by free KV capacity.

rStar2-Agent's rollout scheduler sends each request (each turn of a trajectory) to
the engine with the most free KV-cache capacity, instead of splitting the batch
evenly up front: trajectory lengths differ by orders of magnitude, so a static split
leaves some engines idle while others queue. Tool calls are dispatched by the agent
loop the moment a turn ends (each trajectory is its own asyncio task), so engines
keep decoding the other trajectories meanwhile. The default policy, `sticky`, sends a
trajectory's later turns back to the engine holding its KV prefix (JaxEngine's slot
cache, SGLang's radix cache) unless that engine is full, and places the rest by free
KV capacity.

Engines are anything with `async generate(request)`, `free_kv_tokens()`,
`num_active()` and a `name`: JaxEngines in this process, SGLang or our own rollout
servers over HTTP. Policies are a registry picked by config string.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
from typing import Any, Callable, Sequence

from rstar_jax.registry import Registry
from rstar_jax.rollout.engine import Engine, GenerationRequest, GenerationResult


Policy = Callable[[Sequence[Any], GenerationRequest], int]
POLICIES: Registry = Registry("scheduling policy")   # name -> factory of a Policy
register = POLICIES.register


def get_policy(name: str) -> Policy:
  return POLICIES.lookup(name)()


@register("kv_capacity")
def _kv_capacity() -> Policy:
  def pick(engines, request):
    # Most free KV tokens; ties go to the engine with fewer running requests.
    return max(range(len(engines)),
               key=lambda i: (engines[i].free_kv_tokens(), -engines[i].num_active()))
  return pick


def _need(engine, request: GenerationRequest) -> int:
  """KV tokens the request may take on `engine` (prompt + budget, at most a slot)."""
  need = len(request.input_ids) + request.max_new_tokens
  cap = getattr(engine, "max_len", 0)
  return min(need, cap) if cap else need


def trajectory_of(request: GenerationRequest) -> tuple[str, int] | None:
  """(trajectory uid, turn) of an agent-loop request id '<uid>/turn<k>', else None."""
  uid, sep, turn = (request.request_id or "").rpartition("/turn")
  return (uid, int(turn)) if sep and uid and turn.isdigit() else None


@register("sticky")
def _sticky() -> Policy:
  """Prefix-aware: a trajectory's later turns go back to the engine that served its
  previous turn (its KV prefix is cached there, so only the new tokens are prefilled),
  unless that engine cannot take the request now; first turns, requests of no
  trajectory and displaced turns take the kv_capacity choice."""
  by_uid: dict[str, int] = {}
  free_kv = _kv_capacity()

  def pick(engines, request):
    key = trajectory_of(request)
    if key is not None and key[1] > 0:
      i = by_uid.get(key[0])
      if i is not None and i < len(engines) and \
          engines[i].free_kv_tokens() >= _need(engines[i], request):
        return i
    i = free_kv(engines, request)
    if key is not None:
      by_uid[key[0]] = i
    return i
  return pick


@register("round_robin")
def _round_robin() -> Policy:
  counter = itertools.count()
  return lambda engines, request: next(counter) % len(engines)


@register("least_active")
def _least_active() -> Policy:
  return lambda engines, request: min(range(len(engines)),
                                      key=lambda i: engines[i].num_active())


class EnginePool:
  """An Engine (for the agent loop) that spreads requests over `engines`."""

  name = "pool"

  def __init__(self, engines: Sequence[Engine], policy: str = "kv_capacity", *,
               weight_sync=None, watcher=None):
    """`weight_sync`: for engines that read weights from disk (HTTP servers), an object
    whose `publish(params, version)` moves them onto new parameters
    (`rollout.weight_sync.DiskWeightSync`); None: `engine.update_weights` each.
    `watcher`: what moves the engines to new server URLs (`fleet_file.FleetWatcher`),
    stopped with the pool."""
    if not engines:
      raise ValueError("EnginePool needs at least one engine")
    self.engines = list(engines)
    self.weight_sync = weight_sync
    self.watcher = watcher
    # The gate of `update_weights_between_requests`: generation calls in flight, and
    # updates waiting for them to end (new calls wait meanwhile).
    self._gate = threading.Condition()
    self._in_flight = 0
    self._gate_shut = 0
    self.policy_name = policy
    self._pick = get_policy(policy)
    self.metrics: dict[str, collections.Counter] = {
        e.name: collections.Counter() for e in self.engines}
    self._t0 = time.perf_counter()

  async def generate(self, request: GenerationRequest) -> GenerationResult:
    while True:    # an update waiting between requests holds new calls back
      with self._gate:
        if not self._gate_shut:
          self._in_flight += 1
          break
      await asyncio.sleep(0.002)
    try:
      return await self._generate(request)
    finally:
      with self._gate:
        self._in_flight -= 1
        self._gate.notify_all()

  async def _generate(self, request: GenerationRequest) -> GenerationResult:
    i = self._pick(self.engines, request)
    engine = self.engines[i]
    m = self.metrics[engine.name]
    m["requests"] += 1
    t = time.perf_counter()
    out = await engine.generate(request)
    m["request_s"] += time.perf_counter() - t
    m["queue_wait_s"] += out.queue_wait_s
    m["generated_tokens"] += len(out.output_ids)
    m["prefill_tokens"] += out.prompt_tokens - out.reused_prefix_tokens
    return out

  def free_kv_tokens(self) -> int:
    return sum(e.free_kv_tokens() for e in self.engines)

  def num_active(self) -> int:
    return sum(e.num_active() for e in self.engines)

  @property
  def max_len(self) -> int:
    """The longest sequence (prompt + response) every engine of the pool can hold."""
    return min(e.max_len for e in self.engines)

  def update_weights(self, params, version: str | None = None) -> None:
    """New policy parameters for every engine (in process: a reference, no copy;
    HTTP servers: through `weight_sync`, a versioned checkpoint on disk)."""
    if self.weight_sync is not None:
      self.weight_sync.publish(params, version)
      return
    for e in self.engines:
      e.update_weights(params, version)

  def update_weights_between_requests(self, params, version: str | None = None) -> None:
    """`update_weights`, never inside a generation call: new calls wait, the calls in
    flight end, the engines move, the calls go on. Called from another thread than the
    one generating (in-flight updates: rl.async_rollouts.weight_updates)."""
    with self._gate:
      self._gate_shut += 1
      self._gate.wait_for(lambda: self._in_flight == 0)
    try:
      self.update_weights(params, version)
    finally:
      with self._gate:
        self._gate_shut -= 1
        self._gate.notify_all()

  def sync_metrics(self) -> dict[str, float]:
    """Seconds and GB of the latest weight sync through disk ({} in process)."""
    return dict(self.weight_sync.last) if self.weight_sync is not None else {}

  def stop(self) -> None:
    if self.watcher is not None:
      self.watcher.stop()
    for e in self.engines:
      e.stop()

  def stats(self) -> dict[str, float]:
    elapsed = time.perf_counter() - self._t0
    out: dict[str, float] = {"elapsed_s": elapsed}
    total = 0
    for e in self.engines:
      m = self.metrics[e.name]
      total += m["generated_tokens"]
      out[f"{e.name}/requests"] = m["requests"]
      out[f"{e.name}/generated_tokens"] = m["generated_tokens"]
      if m["requests"]:   # a mean over no request is missing, not 0 (rollout/stats.py)
        out[f"{e.name}/mean_queue_wait_s"] = m["queue_wait_s"] / m["requests"]
      if hasattr(e, "stats"):
        es = e.stats()
        for k in ("slot_utilisation", "busy_fraction"):
          if k in es:
            out[f"{e.name}/{k}"] = es[k]
    out["generated_tokens_per_s"] = total / max(elapsed, 1e-9)
    return out
