"""The SGLang client's transport: the HTTP exchanges with one server and the I/O loop.

`Connection` is one server as the transport sees it: its URL, the client config, the
group's I/O loop and the counters to bump; it knows nothing of engines or groups.
`exchange` is one HTTP exchange; `admin` retries connection errors (admin calls are
idempotent); a timeout is never retried (the call may still be running there).
Which replies allow a /generate to be sent again, and failover to another server, are
the engine's (`sglang.engine`), which decides them from what these raise:
`ServerUnreachable` (no reply received) and `RequestTimedOut` (no reply in time).

Threads: all HTTP runs on one background asyncio loop per group (`IOLoop`), so the
engines work from any caller loop (the rollout collector starts a fresh
`asyncio.run` per batch) and `free_kv_tokens()` stays synchronous.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import threading
from typing import Any, Callable, Mapping, Sequence

import aiohttp

from rstar_jax.rollout.engine import RequestFailed
from rstar_jax.rollout.sglang.wire import UPDATE_PAUSE_MODES, SGLangError, ServerRequestError


# ---- Errors of the transport (the API's own are in sglang.wire) ----------------------
class ServerUnreachable(Exception):
  """Connection-level failure (no reply received): retry / fail over."""


class RequestTimedOut(SGLangError, RequestFailed):
  """No reply within the exchange's time limit (the server may still be working on it)."""


# ---- Configuration ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class ClientConfig:
  """Attributes:
    connect_timeout_s: TCP connect limit per attempt.
    request_timeout_s: total limit of one /generate call (None: none; generations
      are long). Past it the request is aborted on the server and fails.
    admin_timeout_s: limit of admin calls (a weight update loads a checkpoint).
    retries: extra attempts on the same server after a connection error.
    backoff_s, backoff_max_s: first retry delay, doubled each time, capped.
    startup_timeout_s: how long construction waits for /health.
    probe_interval_s: how often a dead server is probed.
    load_poll_s: how often /v1/loads is read (0: never; local accounting only).
    poll_timeout_s: limit of one /v1/loads read; a server that does not answer in time
      leaves rotation until /health answers again.
    flush_retries: /flush_cache attempts while it answers 400.
    no_server_wait_s: how long a request waits for a server back in rotation when every
      server is out (a restart takes seconds) before the batch fails (NoServerAvailable).
    pause_mode: SGLang's pause mode for weight updates ("abort" or "retract"). Not
      "in_place": SGLang then updates the weights but refuses the cache flush while the
      paused requests hold it, answers 400 and keeps reporting the old version.
    require_deterministic: reproducible rollouts (the HTTP counterpart of the JaxEngine's
      `batch_invariant`): every server must run SGLang's deterministic inference
      (launched with `--enable-deterministic-inference`: batch-invariant kernels, so a
      request's tokens and log-probs do not depend on its batch; each request carries
      its `sampling_seed` as always). A server whose /server_info does not report
      `enable_deterministic_inference: true` is refused at connection
      (`ServerMismatchError`), and a server that comes back without it stays out of
      rotation. A server can only be launched in that mode, not switched by a client.
  """
  connect_timeout_s: float = 10.0
  request_timeout_s: float | None = None
  admin_timeout_s: float = 600.0
  retries: int = 3
  backoff_s: float = 0.2
  backoff_max_s: float = 5.0
  startup_timeout_s: float = 120.0
  probe_interval_s: float = 2.0
  load_poll_s: float = 1.0
  poll_timeout_s: float = 10.0
  flush_retries: int = 30
  no_server_wait_s: float = 60.0
  pause_mode: str = "retract"
  require_deterministic: bool = False

  def __post_init__(self):
    if self.pause_mode not in UPDATE_PAUSE_MODES:
      raise ValueError(f"ClientConfig.pause_mode: {self.pause_mode!r}, choose from "
                       f"{UPDATE_PAUSE_MODES} (in_place cannot be followed by a weight update "
                       f"with a cache flush on SGLang)")
    for name, low in (("retries", 0), ("flush_retries", 1)):
      if getattr(self, name) < low:
        raise ValueError(f"ClientConfig.{name} must be >= {low}, got {getattr(self, name)!r}")


# ---- The shared I/O loop -----------------------------------------------------------
class IOLoop:
  """One asyncio loop on a daemon thread with one aiohttp session."""

  def __init__(self, name: str):
    self.loop = asyncio.new_event_loop()
    self._ready = threading.Event()
    self.thread = threading.Thread(target=self._run, name=name, daemon=True)
    self.thread.start()
    self._ready.wait()
    self.session: aiohttp.ClientSession = self.call(self._make_session(), 30)

  def _run(self):
    asyncio.set_event_loop(self.loop)
    self.loop.call_soon(self._ready.set)
    self.loop.run_forever()

  async def _make_session(self):
    # No total timeout at session level: each call sets its own.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

  def submit(self, coro) -> concurrent.futures.Future:
    return asyncio.run_coroutine_threadsafe(coro, self.loop)

  def call(self, coro, timeout: float | None):
    return self.submit(coro).result(timeout)

  def close(self):
    if self.loop.is_closed():
      return
    async def shutdown():
      tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
      for t in tasks:
        t.cancel()
      await asyncio.gather(*tasks, return_exceptions=True)
      await self.session.close()
    try:
      self.call(shutdown(), 30)
    finally:
      self.loop.call_soon_threadsafe(self.loop.stop)
      self.thread.join(30)
      self.loop.close()


@dataclasses.dataclass
class Connection:
  """One server's HTTP side.

  Attributes:
    url: where the server answers (changes when it moves: `SGLangEngine.move_to`).
    config: timeouts, retries and backoff.
    io: the group's I/O loop, whose session carries every exchange.
    metrics: counters of the engine; admin retries bump "retries".
    on_exchange: optional callback `(route, request_json, status, reply_json)` after every
      exchange (tests check bodies against SGLang's schema; recorders).
  """
  url: str
  config: ClientConfig
  io: IOLoop
  metrics: dict[str, int]
  on_exchange: Callable[[str, Any, int, Any], None] | None = None

  async def exchange(self, method: str, route: str, body: Any = None, *,
                     timeout: float | None, params: Mapping[str, str] | None = None
                     ) -> tuple[int, Any, str]:
    """One exchange. Returns (status, parsed JSON or None, raw text).

    Raises ServerUnreachable when no reply was received, RequestTimedOut when none came in
    `timeout` seconds.
    """
    to = aiohttp.ClientTimeout(total=timeout, sock_connect=self.config.connect_timeout_s)
    try:
      async with self.io.session.request(method, self.url + route, json=body,
                                         timeout=to, params=params) as resp:
        raw = (await resp.read()).decode("utf-8", errors="replace")
        status = resp.status
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError) as e:
      raise ServerUnreachable(f"{type(e).__name__}: {e}") from e
    except asyncio.TimeoutError:   # aiohttp's total limit: not a ClientConnectionError
      raise RequestTimedOut(f"{self.url}{route}: no reply within {timeout} s") from None
    try:
      parsed = json.loads(raw) if raw else None
    except (ValueError, RecursionError):   # also > 4300-digit numbers, deep nesting
      parsed = None
    if self.on_exchange is not None:
      self.on_exchange(route, body, status, parsed if parsed is not None else raw)
    return status, parsed, raw

  async def admin(self, method: str, route: str, body: Any = None, *,
                  ok: Sequence[int] = (200,), params=None, timeout: float | None = None
                  ) -> tuple[int, Any, str]:
    """An admin exchange with connection retries (admin calls are idempotent)."""
    delay = self.config.backoff_s
    for attempt in range(self.config.retries + 1):
      try:
        status, parsed, raw = await self.exchange(
            method, route, body, params=params,
            timeout=timeout or self.config.admin_timeout_s)
      except ServerUnreachable as e:   # a timeout is not retried: the call may still be running
        if attempt == self.config.retries:
          raise SGLangError(f"{self.url}{route}: unreachable after {attempt + 1} attempts "
                            f"({e})") from None
        self.metrics["retries"] += 1
        await asyncio.sleep(delay)
        delay = min(delay * 2, self.config.backoff_max_s)
        continue
      if status not in ok:
        raise ServerRequestError(f"{self.url}{route}: HTTP {status}: {raw[:500]}", status)
      return status, parsed, raw
    raise AssertionError("unreachable")
