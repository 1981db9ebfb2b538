"""SGLangEngine: an engine of the pool that generates on an SGLang server over HTTP.

Pinned to SGLang 0.5.23's native API (no torch here, no SGLang import: only aiohttp).
Our own rollout server (`python -m rstar_jax.rollout.api_server`) speaks the same subset,
so the same client drives real SGLang servers on GPU hosts and JAX servers anywhere.

The client is four modules, each importing only those before it:
  * `sglang.wire`: the wire format (request bodies, the sampling-params mapping, reply
    parsing and validation, the errors), the SGLang pin;
  * `sglang.transport`: `ClientConfig`, the I/O loop and HTTP session, one server's
    `Connection` (exchanges, retried admin calls);
  * `sglang.admin`: the admin calls and the server and model checks, without state;
  * this module: the engine (the Engine protocol of the pool: `generate`,
    `free_kv_tokens`, `stop`), what it keeps of its server (requests in flight, rotation,
    the probe that brings it back, the load poller), the re-send rules and failover
    within a group of servers (`connect`), and weight updates of a group
    (`update_weights_from_disk`).

Failure handling:
  * connection errors (refused, reset, server gone mid-request) and 502/503/504 are
    retried on the same server with exponential backoff (a 503 that is SGLang's own
    abort reply proves the server released the request; after any other 5xx, or a
    dropped connection, the attempt is aborted on the server before it is re-sent); when
    they persist the server leaves rotation (`alive=False`, `free_kv_tokens()` very
    negative) and the request goes to another server of the same group (the engines built
    together). A server out of rotation is probed (/health, then the checks of
    `sglang.admin`) in the background, catches up to the latest weights and rejoins.
  * a request is re-sent only when no reply was received. Once a reply arrived (even
    a malformed one, or an error status) it is never sent again: a malformed reply
    raises `MalformedReplyError` naming the server and the field, a 4xx raises
    `ServerRequestError` with the server's message.

A cancelled `generate` (the caller gave up) sends `/abort_request` for its rid.
In-memory `update_weights(params)` is not possible over HTTP: weights reach servers as
a HF checkpoint on shared disk + `update_weights_from_disk`.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from typing import Any, Mapping, Sequence

from absl import logging

from rstar_jax.rollout.engine import GenerationRequest
from rstar_jax.rollout.sglang import admin
from rstar_jax.rollout.sglang.transport import (ClientConfig, Connection, IOLoop,
                                                RequestTimedOut, ServerUnreachable)
from rstar_jax.rollout.sglang.wire import (MalformedReplyError, SGLangError, ServedResult,
                                           ServerMismatchError, ServerRequestError,
                                           error_message, generate_body, parse_generate_reply,
                                           reply_proves_not_running)

_DEAD_FREE_KV = -(1 << 40)   # what a server out of rotation reports to the scheduler


class NoServerAvailable(SGLangError):
  """Every server of the group is out of rotation."""


class ServerGroup:
  """Servers that take over each other's requests; owns the I/O loop."""

  def __init__(self, config: ClientConfig):
    self.config = config
    self.engines: list[SGLangEngine] = []
    self.io = IOLoop("sglang-client")
    self._open = 0
    self._lock = threading.Lock()
    self.target: tuple[str, str] | None = None   # (model_path, weight_version) last synced

  def pick(self, exclude: Sequence[SGLangEngine] = ()) -> SGLangEngine | None:
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


class SGLangEngine:
  """One SGLang (or compatible) server as an Engine of the pool.

  Build several with `connect(urls, ...)` so that they fail over to each other.
  """

  def __init__(self, url: str, *, group: ServerGroup | None = None,
               config: ClientConfig | None = None, name: str | None = None,
               expected_model: Mapping[str, Any] | None = None, on_exchange=None):
    """Args:
      expected_model: the trainer's HF config.json fields (`hf_io.config_to_hf_dict`);
        the server's model must agree on `sglang.admin.MODEL_KEYS` that both state.
      on_exchange: optional callback `(route, request_json, status, reply_json)` after
        every HTTP exchange (tests check bodies against SGLang's schema; recorders).
    """
    if not url.startswith(("http://", "https://")):
      raise ValueError(f"SGLangEngine: not an http(s) URL: {url!r}")
    self.config = config or (group.config if group else ClientConfig())
    self.group = group or ServerGroup(self.config)
    self.group.engines.append(self)
    self.group._opened()
    self.metrics = {"retries": 0, "failovers": 0, "requests": 0, "probes": 0}
    self.conn = Connection(url=url.rstrip("/"), config=self.config, io=self.group.io,
                           metrics=self.metrics, on_exchange=on_exchange)
    self.name = name or f"sglang@{self.url.split('://', 1)[1]}"
    self.expected_model = dict(expected_model or {})
    self.alive = True
    self.dead_reason = ""
    self.max_len = 0
    self.capacity = 0
    self.vocab_size: int | None = self.expected_model.get("vocab_size")
    self.model_info: dict[str, Any] = {}
    self.weight_version: str | None = None
    self._inflight: dict[str, int] = {}     # rid -> reserved KV tokens
    self._syncing = 0   # weight loads in progress: /v1/loads is not polled meanwhile
    # Requests picked for this engine but not yet registered by the I/O thread: the pool
    # picks a burst of requests synchronously, and without these every one of them
    # would see the same free KV and go to the same engine.
    self._pending: dict[int, int] = {}
    self._pending_ids = itertools.count()
    self._by_request: dict[str, str] = {}   # request_id -> rid in flight
    # /generate exchanges in flight (rid -> task): a server that leaves rotation hands
    # them to another server, or a silent server would hold them forever.
    self._calls: dict[str, asyncio.Task] = {}
    self._dropped: set[str] = set()
    self._abort_after_pause: set[str] = set()   # aborted during a weight update's pause
    self._paused = 0    # our pauses in force (between pause_generation and continue)
    # KV tokens the server's last /v1/loads counted beyond our own requests in flight
    # (other clients'); our own come from local accounting, which is never stale.
    self._others_used = 0
    self._lock = threading.Lock()
    self._probing = False
    self._stopped = False
    try:
      self.group.io.call(self._handshake(wait=True), self.config.startup_timeout_s + 60)
    except BaseException:
      self.stop()
      raise
    self._poller = (self.group.io.submit(self._poll_loads()) if self.config.load_poll_s > 0
                    else None)

  @property
  def url(self) -> str:
    return self.conn.url

  # ---- Engine protocol ---------------------------------------------------------
  async def generate(self, request: GenerationRequest) -> ServedResult:
    if self._stopped:
      raise SGLangError(f"{self.name}: engine stopped")
    key = next(self._pending_ids)
    with self._lock:
      self._pending[key] = min(self.max_len or 1 << 30,
                               len(request.input_ids) + request.max_new_tokens)

    def registered():
      with self._lock:
        self._pending.pop(key, None)
    try:
      return await asyncio.wrap_future(self.group.io.submit(self._generate(request,
                                                                           registered)))
    finally:
      registered()

  def free_kv_tokens(self) -> int:
    if not self.alive:
      self._maybe_probe()
      return _DEAD_FREE_KV
    with self._lock:
      return (self.capacity - sum(self._inflight.values()) - sum(self._pending.values())
              - self._others_used)

  def num_active(self) -> int:
    with self._lock:
      return len(self._inflight) + len(self._pending)

  def update_weights(self, params, version: str | None = None) -> None:
    raise NotImplementedError(
        f"{self.name}: an HTTP engine cannot take in-memory parameters. Build the pool with "
        f"rollout.backends.build_engine_pool(cfg, model, workdir=...) (its DiskWeightSync "
        f"writes a HF checkpoint under rollout.weight_sync.dir, or <workdir>/weight_sync, "
        f"that the servers read), or call "
        f"rstar_jax.rollout.sglang.engine.update_weights_from_disk(engines, dir, version) "
        f"(pause -> /update_weights_from_disk -> continue -> /model_info confirms).")

  def move_to(self, url: str) -> None:
    """The server behind this engine now answers at `url` (its node was lost and it was
    re-created elsewhere: `rollout.fleet_file`). Thread-safe. The engine leaves rotation at
    once, its requests in flight go to the other servers (the old process is gone with
    its node: none of them can still answer), and the probe finds the server at the new
    URL, checks it as at connect, catches it up to the latest weights and returns it to
    rotation. The engine keeps its name (the pool's metrics are keyed by it)."""
    if not url.startswith(("http://", "https://")):
      raise ValueError(f"{self.name}: not an http(s) URL: {url!r}")
    url = url.rstrip("/")
    if url != self.url and not self._stopped:
      self.group.io.call(self._move(url), timeout=60)

  async def _move(self, url: str) -> None:
    old, self.conn.url = self.url, url
    self.weight_version = None    # a new process: it holds its start-up checkpoint
    self._others_used = 0
    self.alive = True             # so that leaving rotation is logged with the reason
    self._mark_dead(f"moved from {old} to {url}", silent=True)
    self._next_probe = time.monotonic()   # look for it now, not a probe interval later

  def stop(self) -> None:
    if self._stopped:
      return
    self._stopped = True
    poller = getattr(self, "_poller", None)
    if poller is not None:
      poller.cancel()
    self.group._closed()

  def stats(self) -> dict[str, float]:
    return dict(self.metrics)

  # ---- Generation: re-send rules and failover -----------------------------------------
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

  async def _wait_for_a_server(self, until: float) -> SGLangEngine | None:
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
    for _ in range(self.config.retries + 1):
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
      call = asyncio.ensure_future(self.conn.exchange("POST", "/generate", body,
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
    await admin.abort_quietly(self.conn, rid)

  # ---- Rotation: leaving, probing back, the load poller --------------------------------
  def _mark_dead(self, reason: str, silent: bool = False) -> None:
    """Out of rotation (on the I/O loop). `silent`: the server stopped answering at all
    (its /v1/loads timed out), so its requests in flight, which no reply will end, go to
    other servers. One request's failures leave the others where they run: a server
    that truly died fails them itself, and their work (minutes at 14B) is kept."""
    if self.alive:
      logging.warning("sglang: %s leaves rotation: %s", self.url, reason)
    self.alive = False
    self.dead_reason = reason
    if silent:
      for rid, call in list(self._calls.items()):
        self._dropped.add(rid)
        call.cancel()
    self._next_probe = time.monotonic() + self.config.probe_interval_s
    self._maybe_probe()

  def _maybe_probe(self) -> None:
    if self._stopped or self.alive or self._probing:
      return
    self._probing = True
    try:
      self.group.io.submit(self._probe())
    except RuntimeError:   # loop closed
      self._probing = False

  async def _probe(self):
    try:
      while not self._stopped and not self.alive:
        await asyncio.sleep(max(0.0, self._next_probe - time.monotonic()))
        self._next_probe = time.monotonic() + self.config.probe_interval_s
        self.metrics["probes"] += 1
        try:
          await self._handshake(wait=False)
        except (ServerUnreachable, SGLangError) as e:
          if isinstance(e, ServerMismatchError):
            self.dead_reason = str(e)
          continue
        try:
          # It missed weight updates while away; the trainer may publish again while it
          # catches up (it skips servers out of rotation), so until it holds the latest.
          while (target := self.group.target) is not None and self.weight_version != target[1]:
            await self._sync_from_disk(*target)
        except (ServerUnreachable, SGLangError) as e:
          self.dead_reason = f"catching up to weight version {target[1]}: {e}"
          continue
        self.alive = True
        self.dead_reason = ""
        logging.warning("sglang: %s is back in rotation", self.url)
    finally:
      self._probing = False

  async def _handshake(self, wait: bool) -> None:
    facts = await admin.handshake(self.conn, wait=wait, expected_model=self.expected_model)
    self._take_model(facts.model)
    self.max_len = facts.max_len
    self.capacity = facts.capacity

  def _take_model(self, facts: admin.ModelFacts) -> None:
    if facts.vocab_size is not None:
      self.vocab_size = facts.vocab_size
    self.model_info = facts.info
    self.weight_version = facts.weight_version

  async def _check_model(self) -> dict[str, Any]:
    facts = await admin.check_model(self.conn, self.expected_model)
    self._take_model(facts)
    return facts.info

  async def _poll_loads(self):
    while not self._stopped:
      await asyncio.sleep(self.config.load_poll_s)
      if not self.alive or self._syncing:   # a server loading weights may answer slowly
        continue
      try:
        used = await admin.read_loads(self.conn)
      except (ServerUnreachable, RequestTimedOut) as e:
        # A host that vanished without a reset only times out; /health brings it back.
        self._mark_dead(f"/v1/loads: {e}", silent=isinstance(e, RequestTimedOut))
        continue
      except (KeyError, TypeError, ValueError) as e:
        logging.warning("sglang: %s/v1/loads: unexpected reply (%s: %s)", self.url,
                        type(e).__name__, e)
        continue
      except Exception as e:   # the poller must outlive any one bad exchange
        logging.warning("sglang: %s/v1/loads: %s: %s", self.url, type(e).__name__, e)
        continue
      if used is None:
        logging.warning("sglang: %s has no /v1/loads; free KV from local accounting", self.url)
        return
      # A free-token figure taken from the reply would go stale between polls and, used
      # as a bound, steer every new request away from a server that has since drained
      # (one server got 2/3 of the requests). The server counts only tokens already
      # held, never more than we reserved for our own requests, so what it counts
      # beyond our reservations is other clients' load.
      with self._lock:
        self._others_used = max(0, used - sum(self._inflight.values()))

  # ---- Admin -------------------------------------------------------------------
  def _run(self, coro, timeout: float | None = None):
    """Runs an admin coroutine on the I/O loop from synchronous code."""
    return self.group.io.call(coro, timeout or self.config.admin_timeout_s + 60)

  async def abort(self, request_id: str) -> bool:
    """Aborts the request in flight with this id (False when none is)."""
    for engine in self.group.engines:   # the request may have failed over
      with engine._lock:
        rid = engine._by_request.get(request_id)
      if rid is not None:
        if engine._paused:
          engine._abort_after_pause.add(rid)
        await asyncio.wrap_future(self.group.io.submit(admin.abort(engine.conn, rid)))
        return True
    return False

  async def _sync_from_disk(self, model_path: str, weight_version: str) -> float:
    self._syncing += 1
    try:
      return await self._sync_from_disk_once(model_path, weight_version)
    finally:
      self._syncing -= 1

  async def _sync_from_disk_once(self, model_path: str, weight_version: str) -> float:
    t0 = time.perf_counter()
    await admin.pause_generation(self.conn, self.config.pause_mode)
    self._paused += 1
    try:
      await admin.load_weights(self.conn, model_path, weight_version)
    finally:
      try:
        await admin.continue_generation(self.conn)
      finally:
        self._paused -= 1
      # SGLang drops an abort for a request held at its pause gate (its scheduler does
      # not have it yet), and the request then runs to the end once generation goes on.
      if not self._paused:
        again, self._abort_after_pause = self._abort_after_pause, set()
        for rid in again:
          asyncio.ensure_future(self._abort_quietly(rid, again=False))
    info = await self._check_model()
    if info.get("weight_version") != str(weight_version):
      raise SGLangError(f"{self.url}: /model_info reports weight_version "
                        f"{info.get('weight_version')!r} after updating to {weight_version!r}")
    return time.perf_counter() - t0

  def flush_cache(self) -> None:
    self._run(admin.flush_cache(self.conn))

  def pause_generation(self, mode: str | None = None) -> None:
    self._run(admin.pause_generation(self.conn, mode or self.config.pause_mode))

  def continue_generation(self) -> None:
    self._run(admin.continue_generation(self.conn))

  def get_model_info(self) -> dict[str, Any]:
    return self._run(self._check_model())

  def get_loads(self) -> dict[str, Any]:
    return self._run(admin.get_loads(self.conn))

  def health(self) -> bool:
    return self._run(admin.healthy(self.conn), 20)


# ---- Failover groups -----------------------------------------------------------------
def connect(urls: Sequence[str], *, config: ClientConfig | None = None,
            expected_model: Mapping[str, Any] | None = None, on_exchange=None
            ) -> list[SGLangEngine]:
  """One SGLangEngine per URL, in one failover group. Stop each (or the pool)."""
  if not urls:
    raise ValueError("sglang.engine.connect: no server URLs")
  group = ServerGroup(config or ClientConfig())
  engines = []
  try:
    for url in urls:
      engines.append(SGLangEngine(url, group=group, expected_model=expected_model,
                                  on_exchange=on_exchange))
  except BaseException:
    for e in engines:
      e.stop()
    raise
  return engines


# ---- Weight updates of a group -------------------------------------------------------
def update_weights_from_disk(engines: Sequence[Any], model_path: str,
                             weight_version: str) -> dict[str, float]:
  """Every server: pause -> /update_weights_from_disk -> continue, version confirmed.

  `engines`: SGLangEngines or a pool holding them (`.engines`). Servers are updated
  concurrently; returns seconds per server. Raises if any server fails or reports
  another version (the others keep the new weights).
  """
  engines = list(getattr(engines, "engines", engines))
  bad = [type(e).__name__ for e in engines if not isinstance(e, SGLangEngine)]
  if bad:
    raise TypeError(f"update_weights_from_disk: not HTTP engines: {bad}")
  if not engines:
    return {}

  async def all_():
    # On the I/O loop, as the probes that bring servers back: a server is either
    # updated here or sees the new target before it rejoins, never neither.
    alive = [e for e in engines if e.alive]
    if len(alive) < len(engines):
      logging.warning("sglang: %d server(s) out of rotation are not updated now; they "
                      "catch up before they rejoin", len(engines) - len(alive))
    for e in engines:
      e.group.target = (model_path, str(weight_version))
    return alive, await asyncio.gather(*(e._sync_from_disk(model_path, weight_version)
                                         for e in alive))
  alive, secs = engines[0]._run(all_())
  return {e.url: s for e, s in zip(alive, secs)}
