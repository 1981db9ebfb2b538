"""Tool executors for the agent loop: the sandbox service over HTTP.

The agent loop only needs `await execute(calls) -> [result mapping]`; results carry
the sandbox's structured `status`, from which tool errors are counted.
"""
from __future__ import annotations

import asyncio
from typing import Any, Mapping, Sequence

from rstar_jax.rollout import chat


class SandboxTools:
  """Runs tool calls on sandbox servers (`python -m sandbox.server`).

  aiohttp sessions belong to one event loop; the RL loop runs each step's rollouts in
  a fresh `asyncio.run`, so one client is kept per loop.
  """

  def __init__(self, urls: Sequence[str] | str, *, timeout_s: float = 5.0,
               max_concurrency: int = 64, batch_size: int = 16):
    self.urls = [urls] if isinstance(urls, str) else list(urls)
    if not self.urls:
      raise ValueError("SandboxTools: no sandbox server URL given")
    self.timeout_s = timeout_s
    self._kw = dict(max_concurrency=max_concurrency, batch_size=batch_size)
    self._clients: dict[int, Any] = {}

  def _client(self):
    from sandbox.client import SandboxClient
    loop = asyncio.get_running_loop()
    key = id(loop)
    if key not in self._clients:
      self._clients = {key: SandboxClient(self.urls, **self._kw)}  # drop clients of dead loops
    return self._clients[key]

  async def execute(self, calls: Sequence[chat.ToolCall]) -> list[Mapping[str, Any]]:
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
