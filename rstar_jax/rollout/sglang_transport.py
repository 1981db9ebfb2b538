"""The SGLang client's transport: the HTTP session, retries, the re-send rules, failover.

Failure handling:
  * connection errors (refused, reset, server gone mid-request) and 502/503/504 are
    retried on the same server with exponential backoff (a 503 that is SGLang's own
    abort reply proves the server released the request; after any other 5xx, or a
    dropped connection, the attempt is aborted on the server before it is re-sent); when they persist the server
    leaves rotation (`alive=False`, `free_kv_tokens()` very negative) and the request
    goes to another server of the same group (the engines built together). A dead
    server is probed (`sglang_admin`) in the background and rejoins.
  * a request is re-sent only when no reply was received. Once a reply arrived (even
    a malformed one, or an error status) it is never sent again: a malformed reply
    raises `MalformedReplyError` naming the server and the field, a 4xx raises
    `ServerRequestError` with the server's message.

Threads: all HTTP runs on one background asyncio loop per group (`_IOLoop`), so the
engines work from any caller loop (the rollout collector starts a fresh
`asyncio.run` per batch) and `free_kv_tokens()` stays synchronous.

`SGLangTransport` is a part of `sglang_engine.SGLangEngine`: its methods use the engine's
state (`url`, `config`, `group`, `metrics`, the in-flight tables), set in its constructor.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import aiohttp
from absl import logging

from rstar_jax.rollout.engine import GenerationRequest, RequestFailed
from rstar_jax.rollout.sglang_wire import (UPDATE_PAUSE_MODES, MalformedReplyError, SGLangError,
                                          ServedResult, ServerRequestError, abort_body,
                                          error_message, generate_body, parse_generate_reply,
                                          reply_proves_not_running)

if TYPE_CHECKING:
  from rstar_jax.rollout.sglang_engine import SGLangEngine


# ---- Errors of the transport (the API's own are in sglang_wire) ----------------------
class NoServerAvailable(SGLangError):
  """Every server of the group is out of rotation."""


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
class _IOLoop:
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


class ServerGroup:
  """Servers that take over each other's requests; owns the I/O loop."""

  def __init__(self, config: ClientConfig):
    self.config = config
    self.engines: list[SGLangEngine] = []
    self.io = _IOLoop("sglang-client")
    self._open = 0
    self._lock = threading.Lock()
    self.target: tuple[str, str] | None = None   # (model_path, weight_version) last synced

  def pick(self, exclude: Sequence["SGLangEngine"] = ()) -> "SGLangEngine | None":
    alive = [e for e in self.engines if e.alive and e not in exclude]
    if not alive:
      return None
    return max(alive, key=lambda e: (e.free_kv_tokens(), -e.num_active()))

  def _opened(self):
    with self._lock:
      self._open += 1

  def _closed(self):
    with self._lock:
      self._open -= 1
      last = self._open == 0
    if last:
      self.io.close()



class SGLangTransport:
  """The HTTP exchanges of one server and the generation with retries and failover."""

  # ---- HTTP ----------------------------------------------------------------------
  async def _http(self, method: str, route: str, body: Any = None, *,
                  timeout: float | None, params: Mapping[str, str] | None = None
                  ) -> tuple[int, Any, str]:
    """One exchange. Returns (status, parsed JSON or None, raw text).

    Raises ServerUnreachable when no reply was received, RequestTimedOut when none came in
    `timeout` seconds.
    """
    to = aiohttp.ClientTimeout(total=timeout, sock_connect=self.config.connect_timeout_s)
    try:
      async with self.group.io.session.request(method, self.url + route, json=body,
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

  async def _admin(self, method: str, route: str, body: Any = None, *,
                   ok: Sequence[int] = (200,), params=None, timeout: float | None = None
                   ) -> tuple[int, Any, str]:
    """An admin exchange with connection retries (admin calls are idempotent)."""
    delay = self.config.backoff_s
    for attempt in range(self.config.retries + 1):
      try:
        status, parsed, raw = await self._http(
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

  # ---- Generation ------------------------------------------------------------------
  async def _generate(self, request: GenerationRequest, registered=None) -> ServedResult:
    request.validate(self.max_len)
    tried: list[SGLangEngine] = []
    engine: SGLangEngine | None = self
    reasons = []
    wait_until = None
    while True:
      if engine is None or not engine.alive:
        engine = self.group.pick(exclude=tried)
        if engine is None:
          if wait_until is None:
            wait_until = time.monotonic() + self.config.no_server_wait_s
          engine = await self._wait_for_a_server(wait_until)
        if engine is None:
          raise NoServerAvailable(
              f"no server left for request {request.request_id}: " + "; ".join(reasons or [
                  f"{e.name}: {e.dead_reason}" for e in self.group.engines]))
        if tried:
          self.metrics["failovers"] += 1
          logging.warning("sglang: request %s goes to %s", request.request_id, engine.url)
      try:
        return await engine._generate_here(request, registered)
      except ServerUnreachable as e:
        engine._mark_dead(str(e))
        reasons.append(f"{engine.url}: {e}")
        tried.append(engine)
        engine = None

  async def _wait_for_a_server(self, until: float) -> "SGLangEngine | None":
    """A server back in rotation (probes run meanwhile), or None at `until`."""
    while time.monotonic() < until:
      for e in self.group.engines:
        e._maybe_probe()
      await asyncio.sleep(min(self.config.probe_interval_s, max(0.0, until - time.monotonic())))
      engine = self.group.pick()
      if engine is not None:
        return engine
    return None

  async def _generate_here(self, request: GenerationRequest, registered=None
                           ) -> ServedResult:
    """Generation on this server; connection errors retried, then ServerUnreachable."""
    delay = self.config.backoff_s
    reserve = min(self.max_len, len(request.input_ids) + request.max_new_tokens)
    last: ServerUnreachable | None = None
    for attempt in range(self.config.retries + 1):
      if not self.alive:
        break
      rid = f"{request.request_id or 'req'}-{uuid.uuid4().hex[:12]}"
      body = generate_body(request, rid)
      with self._lock:
        self._inflight[rid] = reserve
        if request.request_id is not None:
          self._by_request[request.request_id] = rid
      if registered is not None:   # the picked engine's provisional reservation ends
        registered()
        registered = None
      self.metrics["requests"] += 1
      call = asyncio.ensure_future(self._http("POST", "/generate", body,
                                              timeout=self.config.request_timeout_s))
      self._calls[rid] = call
      try:
        try:
          status, parsed, raw = await call
        except asyncio.CancelledError:
          if rid in self._dropped and not asyncio.current_task().cancelling():
            # _mark_dead's, not the caller's: no reply came, so it may run elsewhere.
            raise ServerUnreachable(f"left rotation while request {request.request_id} ran "
                               f"({self.dead_reason})") from None
          call.cancel()
          raise
      except ServerUnreachable as e:
        last = e
        self.metrics["retries"] += 1
        # The server may still hold the request (a dropped connection): abort it there.
        asyncio.ensure_future(self._abort_quietly(rid))
        await asyncio.sleep(delay)
        delay = min(delay * 2, self.config.backoff_max_s)
        continue
      except RequestTimedOut:
        asyncio.ensure_future(self._abort_quietly(rid))
        raise RequestTimedOut(f"{self.url}/generate: request {request.request_id} took longer "
                              f"than request_timeout_s={self.config.request_timeout_s}; "
                              "aborted") from None
      except asyncio.CancelledError:
        asyncio.ensure_future(self._abort_quietly(rid))
        raise
      finally:
        self._calls.pop(rid, None)
        self._dropped.discard(rid)
        with self._lock:
          self._inflight.pop(rid, None)
          if self._by_request.get(request.request_id) == rid:
            del self._by_request[request.request_id]
      if status in (502, 503, 504):
        if not reply_proves_not_running(status, parsed):
          # It may still run there: stopped first, so that the re-sent one is its only run.
          await self._abort_quietly(rid)
        last = ServerUnreachable(f"HTTP {status}")
        self.metrics["retries"] += 1
        await asyncio.sleep(delay)
        delay = min(delay * 2, self.config.backoff_max_s)
        continue
      if status != 200:
        raise ServerRequestError(f"{self.url}/generate refused request {request.request_id} "
                                 f"(HTTP {status}): {error_message(parsed, raw)}", status)
      if parsed is None:
        raise MalformedReplyError(f"{self.url}/generate (rid {rid}): reply is not JSON: "
                                  f"{raw[:300]!r}")
      return parse_generate_reply(parsed, request, rid=rid, url=self.url,
                                  vocab_size=self.vocab_size)
    raise last or ServerUnreachable("server out of rotation")

  async def _abort_quietly(self, rid: str, again: bool = True):
    if again and self._paused:
      self._abort_after_pause.add(rid)
    try:
      await self._http("POST", "/abort_request", abort_body(rid), timeout=10)
    except Exception:   # best effort: the server may be gone
      pass

