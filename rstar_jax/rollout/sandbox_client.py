"""`config.tools` -> the tool executor of the agent loop: the sandbox service over HTTP.

The agent loop only needs `await execute(calls) -> [result mapping]`; results carry
the sandbox's structured `status`, from which tool errors are counted. Executors are
a registry keyed by `tools.backend`; `build_tools(cfg)` is the one place that makes
one (and starts a local sandbox server when no URL is given).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any, ContextManager, Iterator, Mapping, Sequence

from absl import logging

from rstar_jax.registry import Registry
from rstar_jax.rollout import chat


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolsConfig:
  """Attributes:
    backend: a registered tool backend ("sandbox").
    urls: sandbox servers to use (the client rotates over them). Empty: start one
      local server for the run (`python -m sandbox.server`) and stop it at the end.
    local_max_children: concurrent calls of that local server.
    timeout_s: wall-clock limit of one tool call.
    max_concurrency: calls in flight from this process.
    batch_size: calls per HTTP request.
    rerun_lost_calls: a call whose sandbox server died (or restarted) before answering
      runs again on another server. Tool calls of a rollout are stateless and their
      first run left nothing behind, so this only costs time; off, such a call comes
      back as an internal error in the trajectory (the sandbox client's strict
      never-started-twice promise).
    urls_file: a fleet file (`rollout.fleet_file`) that a cluster supervisor rewrites
      when a sandbox server moves to a new URL (its node lost); watched while the tools
      are open, and the client follows the file's "sandbox" URLs from its next call on.
      Empty: the URLs are fixed.
  """
  backend: str = "sandbox"
  urls: tuple[str, ...] = ()
  local_max_children: int = 8
  timeout_s: float = 10.0
  max_concurrency: int = 64
  batch_size: int = 16
  rerun_lost_calls: bool = True
  urls_file: str = ""

  def __post_init__(self):
    TOOL_BACKENDS.lookup(self.backend)
    if not self.timeout_s > 0:
      raise ValueError(f"ToolsConfig.timeout_s must be > 0, got {self.timeout_s}")
    for name in ("local_max_children", "max_concurrency", "batch_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"ToolsConfig.{name} must be >= 1, got {getattr(self, name)}")
    bad = [u for u in self.urls if not u.startswith(("http://", "https://"))]
    if bad:
      raise ValueError(f"ToolsConfig.urls: not http(s) URLs: {bad}")
    if self.urls_file and not self.urls:
      raise ValueError("ToolsConfig.urls_file is set but tools.urls is empty: the file moves "
                       "the servers given in tools.urls (a local server never moves)")


TOOL_BACKENDS: Registry = Registry("tool backend")


def build_tools(cfg: ToolsConfig) -> ContextManager[Any]:
  """`with build_tools(cfg) as tools:` the executor of `cfg.backend`, closed at exit."""
  return TOOL_BACKENDS.lookup(cfg.backend)(cfg)


class SandboxTools:
  """Runs tool calls on sandbox servers (`python -m sandbox.server`).

  aiohttp sessions belong to one event loop; the RL loop runs each step's rollouts in
  a fresh `asyncio.run`, so one client is kept per loop.
  """

  def __init__(self, urls: Sequence[str] | str, *, timeout_s: float = 5.0,
               max_concurrency: int = 64, batch_size: int = 16, rerun_lost: bool = True):
    self.urls = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)]
    if not self.urls:
      raise ValueError("SandboxTools: no sandbox server URL given")
    self.timeout_s = timeout_s
    self._kw = dict(max_concurrency=max_concurrency, batch_size=batch_size,
                    rerun_lost=rerun_lost)
    self._clients: dict[int, Any] = {}

  def _client(self):
    from sandbox.client import SandboxClient
    loop = asyncio.get_running_loop()
    key = id(loop)
    if key not in self._clients:
      self._clients = {key: SandboxClient(self.urls, **self._kw)}  # drop clients of dead loops
    client = self._clients[key]
    if client.urls != self.urls:      # moved meanwhile (set_urls, from another thread)
      client.set_urls(self.urls)
    return client

  def set_urls(self, urls: Sequence[str]) -> None:
    """Server i now answers at `urls[i]` (a moved server). Thread-safe: the loop's client
    takes the new list at its next call; calls in flight to a moved server are lost with
    it and, with `rerun_lost`, run again on another."""
    urls = [u.rstrip("/") for u in urls]
    if len(urls) != len(self.urls):
      raise ValueError(f"SandboxTools.set_urls: {len(urls)} URL(s) for {len(self.urls)} "
                       f"server(s)")
    self.urls = urls

  async def execute(self, calls: Sequence[chat.ParsedToolCall]) -> list[Mapping[str, Any]]:
    from sandbox.schema import Call
    client = self._client()
    results = await client.execute(
        [Call(code=c.code, input=c.input or "", timeout=self.timeout_s) for c in calls])
    return [r.to_dict() for r in results]

  async def release_loop(self) -> None:
    """Closes the running loop's client (its HTTP connections) before the loop ends."""
    client = self._clients.pop(id(asyncio.get_running_loop()), None)
    if client is not None:
      await client.close()

  async def aclose(self) -> None:
    for c in self._clients.values():
      await c.close()
    self._clients = {}


@TOOL_BACKENDS.register("sandbox")
@contextlib.contextmanager
def _sandbox(cfg: ToolsConfig) -> Iterator[SandboxTools]:
  kw = dict(timeout_s=cfg.timeout_s, max_concurrency=cfg.max_concurrency,
            batch_size=cfg.batch_size, rerun_lost=cfg.rerun_lost_calls)
  if cfg.urls:
    tools = SandboxTools(list(cfg.urls), **kw)
    if not cfg.urls_file:
      yield tools
      return
    from rstar_jax.rollout.fleet_file import FleetWatcher
    watcher = FleetWatcher(cfg.urls_file, "sandbox", tools.set_urls, current=tools.urls)
    try:
      yield tools
    finally:
      watcher.stop()
    return
  from sandbox.launcher import running_server
  with running_server(max_children=cfg.local_max_children) as url:
    logging.info("started a local sandbox server at %s", url)
    yield SandboxTools([url], **kw)


def check_local_sandbox(cfg: ToolsConfig) -> None:
  """Raises sandbox.launcher.SandboxUnavailable, naming the fix, when `build_tools(cfg)`
  would start a local sandbox server that cannot run here (no bubblewrap, and weaker
  isolation not accepted): callers check this before the work that ends in rollouts."""
  if cfg.backend != "sandbox" or cfg.urls:
    return
  from sandbox.launcher import check_can_start
  check_can_start()
