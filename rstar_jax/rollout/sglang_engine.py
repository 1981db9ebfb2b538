"""SGLangEngine: an engine of the pool that generates on an SGLang server over HTTP.

Pinned to SGLang 0.5.23's native API (no torch here, no SGLang import: only aiohttp).
Our own rollout server (`python -m rstar_jax.rollout.server`) speaks the same subset,
so the same client drives real SGLang servers on GPU hosts and JAX servers anywhere.

It is built of three modules, one job each:
  * `sglang_wire`: the wire format (request bodies, the sampling-params mapping, reply
    parsing and validation, the errors), the SGLang pin;
  * `sglang_transport`: `ClientConfig`, the HTTP session, retries, the 503 / re-send
    rules and failover within a group of servers;
  * `sglang_admin`: server and model checks, health, probing, weight updates
    (`update_weights_from_disk`).
This module holds the engine itself (the Engine protocol of the pool: `generate`,
`free_kv_tokens`, `stop`) and `connect`, which builds a failover group.

A cancelled `generate` (the caller gave up) sends `/abort_request` for its rid.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import Any, Mapping, Sequence

from rstar_jax.rollout.engine import GenerationRequest
from rstar_jax.rollout.sglang_admin import SGLangAdmin
from rstar_jax.rollout.sglang_wire import SGLangError, ServedResult
from rstar_jax.rollout.sglang_transport import ClientConfig, ServerGroup, SGLangTransport

_DEAD_FREE_KV = -(1 << 40)   # what a server out of rotation reports to the scheduler


class SGLangEngine(SGLangTransport, SGLangAdmin):
  """One SGLang (or compatible) server as an Engine of the pool.

  Build several with `connect(urls, ...)` so that they fail over to each other.
  """

  def __init__(self, url: str, *, group: ServerGroup | None = None,
               config: ClientConfig | None = None, name: str | None = None,
               expected_model: Mapping[str, Any] | None = None, on_exchange=None):
    """Args:
      expected_model: the trainer's HF config.json fields (`hf_io.config_to_hf_dict`);
        the server's model must agree on `sglang_admin.MODEL_KEYS` that both state.
      on_exchange: optional callback `(route, request_json, status, reply_json)` after
        every HTTP exchange (tests check bodies against SGLang's schema; recorders).
    """
    if not url.startswith(("http://", "https://")):
      raise ValueError(f"SGLangEngine: not an http(s) URL: {url!r}")
    self.url = url.rstrip("/")
    self.config = config or (group.config if group else ClientConfig())
    self.group = group or ServerGroup(self.config)
    self.group.engines.append(self)
    self.group._opened()
    self.name = name or f"sglang@{self.url.split('://', 1)[1]}"
    self.expected_model = dict(expected_model or {})
    self.on_exchange = on_exchange
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
    self.metrics = {"retries": 0, "failovers": 0, "requests": 0, "probes": 0}
    try:
      self.group.io.call(self._handshake(wait=True), self.config.startup_timeout_s + 60)
    except BaseException:
      self.stop()
      raise
    self._poller = (self.group.io.submit(self._poll_loads()) if self.config.load_poll_s > 0
                    else None)

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
        f"rstar_jax.rollout.sglang_admin.update_weights_from_disk(engines, dir, version) "
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
    old, self.url = self.url, url
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


# ---- Failover groups -----------------------------------------------------------------
def connect(urls: Sequence[str], *, config: ClientConfig | None = None,
            expected_model: Mapping[str, Any] | None = None, on_exchange=None
            ) -> list[SGLangEngine]:
  """One SGLangEngine per URL, in one failover group. Stop each (or the pool)."""
  if not urls:
    raise ValueError("sglang_engine.connect: no server URLs")
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

