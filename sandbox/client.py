"""Async client for one or many sandbox servers, plus a small sync wrapper.

    async with SandboxClient(["http://127.0.0.1:8321"]) as client:
      results = await client.execute([{"code": "print(1+1)"}, Call(code="1/0")])

* Calls are sent in batches (one POST per `batch_size` calls); results come back
  in the order of the calls.
* At most `max_concurrency` calls are in flight from this client at once.
* Exactly once: every call carries an id (the client makes one up when the call
  has none). A batch is retried elsewhere, with exponential backoff and jitter,
  only when the server could not be reached or answered 503 (it answers 503 only
  when it ran nothing); another 5xx (a crashed handler, a proxy's 502/504) is treated
  as a lost answer. When a request was sent and its answer lost (connection
  reset mid-request), the same payload goes again to the same server only, which
  answers the ids it has seen from memory; if that server is gone (or restarted),
  the calls come back as internal_error ("may have run"), never run twice. A call
  that came back with a result is never re-run, and a request timeout is not
  retried either: it comes back as status internal_error.
* Load goes to the reachable server with the fewest calls in flight. A server
  that fails is taken out of rotation and probed on /health every
  `health_interval_s`; it comes back when healthy.
* Calls with a `session_id` all go to one server (chosen by a stable hash of the
  id) and run in order; if that server is down the session restarts elsewhere
  (its results then say session_new=True).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import json
import logging
import random
import re
import threading
import time
import uuid
import zlib
from typing import Any, Iterable, Mapping, Sequence

import aiohttp

from sandbox.schema import Call, Result

log = logging.getLogger("sandbox.client")

CallLike = Call | Mapping[str, Any] | str


class _NotSent(Exception):
  """The server did not take the request: it could not be reached, or answered 5xx."""

  def __init__(self, message: str, refused: bool = False):
    super().__init__(message)
    self.refused = refused


class _Uncertain(Exception):
  """The request was (or may have been) sent and the answer was lost."""


class _Conflict(Exception):
  """409: a restarted server, or an id reused for another call."""

  def __init__(self, message: str, restarted: bool = False):
    super().__init__(message)
    self.restarted = restarted


class _Rejected(Exception):
  """A 4xx other than 409: the server ran none of the request's calls."""

  def __init__(self, status: int, error: str):
    super().__init__(f"HTTP {status}: {error[:500]}")
    m = re.match(r"calls\[(\d+)\]", error)   # a 400 names the call it refuses
    self.call_index = int(m.group(1)) if m and status == 400 else None


def _check_url(url) -> None:
  if not isinstance(url, str) or not url.startswith(("http://", "https://")):
    raise ValueError(f"SandboxClient: server URL must start with http:// or https://, got {url!r}")


class _Server:
  __slots__ = ("url", "up", "retry_at", "inflight", "probe", "failures", "instance")

  def __init__(self, url: str):
    self.url = url.rstrip("/")
    self.instance: str | None = None  # the server process's id, from its answers
    self.up = True
    self.retry_at = 0.0
    self.inflight = 0
    self.probe: asyncio.Task | None = None
    self.failures = 0


class _Budget:
  """A counting semaphore that takes several units at once (calls of a batch)."""

  def __init__(self, total: int):
    self.total = total
    self.used = 0
    self.cond = asyncio.Condition()

  async def acquire(self, n: int) -> int:
    n = min(n, self.total)
    async with self.cond:
      await self.cond.wait_for(lambda: self.used + n <= self.total)
      self.used += n
    return n

  async def release(self, n: int) -> None:
    async with self.cond:
      self.used -= n
      self.cond.notify_all()


class SandboxClient:
  """Talks to sandbox servers at `urls` (e.g. ["http://127.0.0.1:8321"]).

  Create and use it inside one running event loop.
  """

  def __init__(self, urls: Sequence[str] | str, *, max_concurrency: int = 64, batch_size: int = 16,
               max_retries: int = 5, backoff_s: float = 0.2, max_backoff_s: float = 5.0,
               request_timeout_s: float | None = None, connect_timeout_s: float = 5.0,
               health_interval_s: float = 2.0, rerun_lost: bool = False):
    """rerun_lost: calls sent to a server that then died (or restarted) without answering
    are run again on another server, instead of being reported as "may have run". Their
    first run left nothing behind (it lived in the dead server's sandbox), so for
    stateless calls this loses nothing but time; the default keeps the strict promise
    that a call is never started twice. Calls of a session are never re-run (their
    state died with the server)."""
    if isinstance(urls, str):
      urls = [urls]
    if not urls:
      raise ValueError("SandboxClient needs at least one server URL")
    for u in urls:
      _check_url(u)
    for name, value in (("max_concurrency", max_concurrency), ("batch_size", batch_size)):
      if value < 1:
        raise ValueError(f"SandboxClient.{name} must be >= 1, got {value}")
    if max_retries < 0 or backoff_s < 0 or max_backoff_s < 0:
      raise ValueError("SandboxClient: max_retries, backoff_s and max_backoff_s must be >= 0")
    self._servers = [_Server(u) for u in urls]
    self.rerun_lost = rerun_lost
    self.max_concurrency = max_concurrency
    self.batch_size = batch_size
    self.max_retries = max_retries
    self.backoff_s = backoff_s
    self.max_backoff_s = max_backoff_s
    self.health_interval_s = health_interval_s
    self._timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=connect_timeout_s)
    self._http: aiohttp.ClientSession | None = None
    self._budget = _Budget(max_concurrency)
    self._rr = 0
    # Call ids: unique per client (a random prefix) so servers can tell retries apart.
    self._prefix = f"{uuid.uuid4().hex[:16]}-"
    self._ids = itertools.count(1)

  @property
  def urls(self) -> list[str]:
    return [s.url for s in self._servers]

  def set_urls(self, urls: Sequence[str]) -> None:
    """Server i now answers at `urls[i]` (it moved: a lost node's server re-created
    elsewhere). Call it on the client's loop. A moved server starts afresh (up, no known
    instance, no probe); requests in flight to its old URL fail as for a dead server."""
    if len(urls) != len(self._servers):
      raise ValueError(f"SandboxClient.set_urls: {len(urls)} URL(s) for "
                       f"{len(self._servers)} server(s)")
    for i, url in enumerate(urls):
      _check_url(url)
      if url.rstrip("/") != self._servers[i].url:
        if self._servers[i].probe is not None:
          self._servers[i].probe.cancel()
        self._servers[i] = _Server(url)

  def servers_up(self) -> list[str]:
    return [s.url for s in self._servers if s.up]

  async def __aenter__(self) -> "SandboxClient":
    return self

  async def __aexit__(self, *exc) -> None:
    await self.close()

  async def close(self) -> None:
    for s in self._servers:
      if s.probe is not None:
        s.probe.cancel()
    if self._http is not None:
      await self._http.close()
      self._http = None

  def _session(self) -> aiohttp.ClientSession:
    if self._http is None or self._http.closed:
      # trust_env=False: never route through a proxy from the environment.
      self._http = aiohttp.ClientSession(
          timeout=self._timeout, trust_env=False,
          connector=aiohttp.TCPConnector(limit=0))
    return self._http

  # -- public API -------------------------------------------------------------
  async def execute(self, calls: Iterable[CallLike]) -> list[Result]:
    """Runs `calls` (Call, mapping with Call's fields, or code string); same order back."""
    calls = [Call.from_obj(c, where=f"calls[{i}]") for i, c in enumerate(calls)]
    calls = [c if c.id is not None else dataclasses.replace(c, id=f"{self._prefix}{next(self._ids)}")
             for c in calls]
    self._session()
    results: list[Result | None] = [None] * len(calls)
    chunks: list[list[int]] = []
    by_session: dict[str, list[int]] = collections.OrderedDict()
    plain: list[int] = []
    for i, c in enumerate(calls):
      if c.session_id is None:
        plain.append(i)
      else:
        by_session.setdefault(c.session_id, []).append(i)
    chunks += [plain[k:k + self.batch_size] for k in range(0, len(plain), self.batch_size)]
    chunks += list(by_session.values())  # one request per session keeps its calls in order
    await asyncio.gather(*(self._run_chunk(idx, calls, results) for idx in chunks))
    return results  # type: ignore[return-value]

  async def run(self, code: str, *, input: str = "", timeout: float | None = None,
                session_id: str | None = None) -> Result:
    """One call."""
    return (await self.execute([Call(code=code, input=input, timeout=timeout,
                                     session_id=session_id)]))[0]

  async def close_session(self, session_id: str) -> bool:
    """Frees a session's state on its server; False when it was not open there."""
    server = await self._pick(session_id)
    if server is None:
      return False
    async with self._session().post(f"{server.url}/sessions/close",
                                    json={"session_ids": [session_id]}) as resp:
      data = await resp.json()
    return session_id in data.get("closed", [])

  async def stats(self) -> dict[str, Any]:
    """/stats of every server (or the error that came instead)."""
    out = {}
    for s in self._servers:
      try:
        async with self._session().get(f"{s.url}/stats") as resp:
          out[s.url] = await resp.json()
      except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        out[s.url] = {"error": repr(e)}
    return out

  # -- internals --------------------------------------------------------------
  async def _run_chunk(self, idx: list[int], calls: list[Call], results: list) -> None:
    payload: dict[str, Any] = {"calls": [calls[i].to_dict() for i in idx]}
    sid = calls[idx[0]].session_id
    taken = await self._budget.acquire(len(idx))
    try:
      last_error: str = ""
      # Set once a request may have reached a server and its answer was lost: from then
      # on the same payload (same call ids) goes only to that server, which answers the
      # ids it accepted from memory and runs only the ones it never saw.
      pinned: _Server | None = None
      for attempt in range(self.max_retries + 1):
        if attempt:
          delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
          await asyncio.sleep(delay * (0.5 + random.random() / 2))
        server = pinned or await self._pick(sid)
        if server is None:
          last_error = "no sandbox server is reachable"
          continue
        if pinned is not None and server.instance is not None:
          payload["expect_instance"] = server.instance
        sent = len(idx)
        server.inflight += sent
        try:
          data = await self._post(server, payload)
        except _NotSent as e:  # connection refused, or a 5xx: nothing was run there
          last_error = f"{server.url}: {e}"
          if pinned is not None and e.refused and self._may_rerun(sid):
            log.warning("%s went away after %d call(s) were sent; running them elsewhere",
                        server.url, len(idx))
            self._mark_down(server, str(e))
            pinned = None
            payload.pop("expect_instance", None)
            continue
          if pinned is not None and e.refused:
            # The server that may have run these calls is gone: never run them twice.
            self._fill(results, idx, f"{server.url} went away after the calls were sent "
                                     f"({last_error}); they may have run and are not re-run",
                       calls)
            self._mark_down(server, str(e))
            return
          if pinned is None:
            self._mark_down(server, str(e))
          continue
        except _Uncertain as e:  # sent, answer lost: ask the same server again
          last_error = f"{server.url}: {e}"
          log.warning("lost the answer of %s (%s); asking it again for the same call ids",
                      server.url, e)
          pinned = server
          continue
        except _Conflict as e:
          if e.restarted and pinned is not None and self._may_rerun(sid):
            log.warning("%s restarted after %d call(s) were sent; running them again",
                        server.url, len(idx))
            pinned = None
            payload.pop("expect_instance", None)
            continue
          self._fill(results, idx, f"{server.url}: {e}", calls)
          return
        except asyncio.TimeoutError:
          # The calls may still be running: re-running them is what we promise not to do.
          self._fill(results, idx, f"request to {server.url} timed out", calls)
          return
        except _Rejected as e:
          j = e.call_index
          if j is None or not 0 <= j < len(idx):
            self._fill(results, idx, f"{server.url} refused the request: {e}", calls)
            return
          # One call it cannot take (too large, say): that call fails, the others go again.
          bad = idx.pop(j)
          self._fill(results, [bad], f"{server.url} refused this call: {e}", calls)
          if not idx:
            return
          payload["calls"] = [calls[i].to_dict() for i in idx]
          continue
        finally:
          server.inflight -= sent
        got = data.get("results") if isinstance(data, dict) else None
        if not isinstance(got, list) or len(got) != len(idx):
          self._fill(results, idx, f"malformed answer from {server.url}: {str(data)[:200]}",
                     calls)
          return
        if isinstance(data.get("instance"), str):
          server.instance = data["instance"]
        for i, r in zip(idx, got):
          res = Result.from_dict(r)
          res.server = server.url
          res.call_id = calls[i].id
          results[i] = res
        server.failures = 0
        return
      why = (f"gave up after {self.max_retries + 1} attempts: {last_error}" if pinned is None else
             f"gave up after {self.max_retries + 1} attempts, the last ones to {pinned.url} "
             f"whose answer was lost: {last_error}")
      self._fill(results, idx, why, calls)
    finally:
      await self._budget.release(taken)

  def _may_rerun(self, sid: str | None) -> bool:
    return self.rerun_lost and sid is None

  async def _post(self, server: _Server, payload: dict) -> Any:
    try:
      async with self._session().post(f"{server.url}/execute", json=payload) as resp:
        if resp.status == 503:   # the server's "nothing was run" (worker not ready)
          raise _NotSent(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        if resp.status >= 500:
          # A 500 (a handler that crashed part-way) or a proxy's 502/504: the calls may
          # have run, so only the same server is asked again, for the same call ids.
          raise _Uncertain(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        if resp.status == 409:
          text = (await resp.text())[:500]
          raise _Conflict(f"HTTP 409: {text}", restarted="restarted since" in text)
        if resp.status != 200:
          text = await resp.text()
          try:
            text = str(json.loads(text).get("error", text))
          except (ValueError, AttributeError):
            pass
          raise _Rejected(resp.status, text)
        return await resp.json()
    except aiohttp.ClientConnectorError as e:  # no connection: the request never left
      raise _NotSent(f"{type(e).__name__}: {e}", refused=True) from None
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
      raise _Uncertain(f"{type(e).__name__}: {e}") from None

  @staticmethod
  def _fill(results: list, idx: list[int], message: str, calls: list[Call]) -> None:
    for i in idx:
      results[i] = Result.internal_error(message, call_id=calls[i].id)

  def _mark_down(self, server: _Server, why: str) -> None:
    if server.up:
      log.warning("sandbox server %s out of rotation: %s", server.url, why)
    server.up = False
    server.failures += 1
    server.retry_at = time.monotonic() + self.health_interval_s

  async def _probe(self, server: _Server) -> None:
    try:
      async with self._session().get(f"{server.url}/health",
                                     timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
        healthy = resp.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
      healthy = False
    if healthy:
      if not server.up:
        log.info("sandbox server %s back in rotation", server.url)
      server.up = True
    else:
      server.retry_at = time.monotonic() + self.health_interval_s
    server.probe = None

  async def _pick(self, sid: str | None) -> _Server | None:
    now = time.monotonic()
    for s in self._servers:
      if not s.up and s.probe is None and now >= s.retry_at:
        s.probe = asyncio.ensure_future(self._probe(s))
    up = [s for s in self._servers if s.up]
    if not up:
      probes = [s.probe for s in self._servers if s.probe is not None]
      if probes:
        await asyncio.wait(probes, timeout=3.0)
      up = [s for s in self._servers if s.up]
      if not up:
        return None
    if sid is not None:
      h = zlib.crc32(sid.encode("utf-8", "surrogatepass"))
      home = self._servers[h % len(self._servers)]
      return home if home.up else up[h % len(up)]
    self._rr += 1
    n = len(up)
    return min((up[(self._rr + k) % n] for k in range(n)), key=lambda s: s.inflight)


class SyncSandboxClient:
  """Blocking wrapper for notebooks and scripts: runs a SandboxClient on its own loop thread."""

  def __init__(self, urls: Sequence[str] | str, **kwargs: Any):
    self._loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self._loop.run_forever, name="sandbox-client",
                                    daemon=True)
    self._thread.start()
    self._client = self._call(self._make(urls, kwargs))

  @staticmethod
  async def _make(urls, kwargs) -> SandboxClient:
    return SandboxClient(urls, **kwargs)

  def _call(self, coro):
    return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

  def execute(self, calls: Iterable[CallLike]) -> list[Result]:
    return self._call(self._client.execute(list(calls)))

  def run(self, code: str, **kwargs: Any) -> Result:
    return self._call(self._client.run(code, **kwargs))

  def close_session(self, session_id: str) -> bool:
    return self._call(self._client.close_session(session_id))

  def stats(self) -> dict[str, Any]:
    return self._call(self._client.stats())

  def close(self) -> None:
    if self._loop.is_closed():
      return
    self._call(self._client.close())
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._thread.join()
    self._loop.close()

  def __enter__(self) -> "SyncSandboxClient":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
