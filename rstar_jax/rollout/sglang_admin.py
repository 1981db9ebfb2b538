"""The SGLang client's admin side: server checks, health and probing, weight updates.

Admin calls: `/abort_request`, `/flush_cache` (retried while it answers 400: requests
still running), `/pause_generation`, `/continue_generation`,
`/update_weights_from_disk` (with `weight_version`), `/model_info` (confirms it),
`/health`, `/server_info` (`max_req_input_len`: the length limit; KV capacity;
`enable_deterministic_inference` where the config requires it) and `/v1/loads` (the server's
used / total KV tokens, polled in the background for the scheduler's `free_kv_tokens`).

Checks:
  * on start-up (and after each weight update) the server's model is checked against
    the trainer's: model type and, when the server's `model_path/config.json` is
    readable here (shared storage), vocabulary size and shapes; every returned token
    id must be inside the vocabulary. A mismatch raises `ServerMismatchError`.
  * a server whose `--preferred-sampling-params` (its /model_info) would fill a
    sampling key the client leaves out with a non-default value is refused at connect
    (`ServerMismatchError`): it would change the sampling distribution silently.
  * `ClientConfig.require_deterministic`: a server not running SGLang's deterministic
    inference is refused at connect and stays out of rotation when it comes back.
  * a server out of rotation is probed (`/health`, then these checks) in the background,
    catches up to the latest weights and rejoins.

In-memory `update_weights(params)` is not possible over HTTP: weights reach servers as
a HF checkpoint on shared disk + `update_weights_from_disk` (see that function).

`SGLangAdmin` is a part of `sglang_engine.SGLangEngine`: its methods use the engine's state
(`url`, `config`, `group`, `metrics`, `_http` / `_admin` of `SGLangTransport`).
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any, Sequence

from absl import logging

from rstar_jax.rollout.sglang_wire import (DETERMINISTIC_KEY, SGLangError,
                                          ServerMismatchError, abort_body,
                                          check_preferred_sampling, check_update_weights_reply,
                                          continue_body, loads_used_tokens, pause_body,
                                          parse_model_info, parse_server_info, update_weights_body)
from rstar_jax.rollout.sglang_transport import RequestTimedOut, ServerUnreachable

# The HF config.json fields a served model must share with the trainer's (where both state them).
MODEL_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "tie_word_embeddings")


class SGLangAdmin:
  """Health, probing, the server and model checks, and the admin calls of one server."""

  # ---- Health, model check, probing ------------------------------------------------
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
    """/health (waiting up to startup_timeout_s when `wait`), /server_info, /model_info."""
    deadline = time.monotonic() + self.config.startup_timeout_s
    delay = self.config.backoff_s
    while True:
      try:
        status, _, _ = await self._http("GET", "/health", timeout=30)
        if status == 200:
          break
        why = f"HTTP {status}"
      except (ServerUnreachable, RequestTimedOut) as e:
        why = str(e)
      if not wait:
        raise ServerUnreachable(f"/health: {why}")
      if time.monotonic() > deadline:
        raise SGLangError(f"{self.url}: no healthy answer from /health within "
                          f"{self.config.startup_timeout_s} s (last: {why})")
      await asyncio.sleep(delay)
      delay = min(delay * 2, self.config.backoff_max_s)
    status, info, raw = await self._http("GET", "/server_info", timeout=30)
    ctx, total = parse_server_info(info, status=status, raw=raw, url=self.url)
    if self.config.require_deterministic and info.get(DETERMINISTIC_KEY) is not True:
      raise ServerMismatchError(
          f"{self.url}: rollout.client.require_deterministic asks for reproducible rollouts, "
          f"but the server's /server_info reports {DETERMINISTIC_KEY}="
          f"{info.get(DETERMINISTIC_KEY, 'absent')!r}: its tokens and log-probs would depend "
          f"on what shares its batches; relaunch it with --enable-deterministic-inference "
          f"(SGLang >= 0.5.3; our rollout server takes the same flag)")
    await self._check_model()
    self.max_len = ctx
    self.capacity = total if total is not None else ctx

  async def _check_model(self) -> dict[str, Any]:
    status, info, raw = await self._http("GET", "/model_info", timeout=30)
    path, wv = parse_model_info(info, status=status, raw=raw, url=self.url)
    if info.get("is_generation") is False:
      raise ServerMismatchError(f"{self.url}: serves a non-generation model ({path})")
    check_preferred_sampling(self.url, info)
    served = {}
    if info.get("model_type") is not None:
      served["model_type"] = info["model_type"]
    cfg_file = os.path.join(path, "config.json")
    if os.path.isfile(cfg_file):
      try:
        with open(cfg_file) as f:
          cfg = json.load(f)
        served.update({k: cfg[k] for k in MODEL_KEYS if k in cfg})
      except (OSError, json.JSONDecodeError) as e:
        logging.warning("sglang: cannot read %s (%s); model not verified", cfg_file, e)
    elif self.expected_model:
      logging.warning("sglang: %s serves %s, which is not readable here: vocabulary and "
                      "shapes not verified (token ids are still range-checked)", self.url, path)
    diff = {k: (served[k], self.expected_model[k]) for k in MODEL_KEYS
            if k in served and k in self.expected_model and served[k] != self.expected_model[k]}
    if diff:
      raise ServerMismatchError(
          f"{self.url} serves {path}, which does not match the trainer's model: " + ", ".join(
              f"{k}={a!r} (trainer: {b!r})" for k, (a, b) in diff.items()))
    if "vocab_size" in served:
      self.vocab_size = served["vocab_size"]
    self.model_info = info
    self.weight_version = wv
    return info

  async def _poll_loads(self):
    while not self._stopped:
      await asyncio.sleep(self.config.load_poll_s)
      if not self.alive or self._syncing:   # a server loading weights may answer slowly
        continue
      try:
        status, body, _ = await self._http("GET", "/v1/loads",
                                           timeout=self.config.poll_timeout_s)
      except (ServerUnreachable, RequestTimedOut) as e:
        # A host that vanished without a reset only times out; /health brings it back.
        self._mark_dead(f"/v1/loads: {e}", silent=isinstance(e, RequestTimedOut))
        continue
      except Exception as e:   # the poller must outlive any one bad exchange
        logging.warning("sglang: %s/v1/loads: %s: %s", self.url, type(e).__name__, e)
        continue
      if status == 404:
        logging.warning("sglang: %s has no /v1/loads; free KV from local accounting", self.url)
        return
      try:
        used = loads_used_tokens(body)
      except (KeyError, TypeError, ValueError):
        logging.warning("sglang: %s/v1/loads: unexpected reply %.200s", self.url, body)
        continue
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
        await asyncio.wrap_future(self.group.io.submit(
            engine._admin("POST", "/abort_request", abort_body(rid))))
        return True
    return False

  async def _flush_cache(self) -> None:
    delay = self.config.backoff_s
    for attempt in range(self.config.flush_retries):
      status, _, raw = await self._admin("POST", "/flush_cache", ok=(200, 400))
      if status == 200:
        return
      await asyncio.sleep(delay)
      delay = min(delay * 2, self.config.backoff_max_s)
    raise SGLangError(f"{self.url}/flush_cache still refused after "
                      f"{self.config.flush_retries} attempts: {raw[:200]}")

  async def _sync_from_disk(self, model_path: str, weight_version: str) -> float:
    self._syncing += 1
    try:
      return await self._sync_from_disk_once(model_path, weight_version)
    finally:
      self._syncing -= 1

  async def _sync_from_disk_once(self, model_path: str, weight_version: str) -> float:
    t0 = time.perf_counter()
    await self._admin("POST", "/pause_generation", pause_body(self.config.pause_mode))
    self._paused += 1
    try:
      status, reply, raw = await self._admin(
          "POST", "/update_weights_from_disk", update_weights_body(model_path, weight_version),
          ok=(200, 400))
      check_update_weights_reply(reply, status=status, raw=raw, url=self.url,
                                 model_path=model_path)
    finally:
      try:
        await self._admin("POST", "/continue_generation", continue_body())
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
    self._run(self._flush_cache())

  def pause_generation(self, mode: str | None = None) -> None:
    self._run(self._admin("POST", "/pause_generation", pause_body(mode or self.config.pause_mode)))

  def continue_generation(self) -> None:
    self._run(self._admin("POST", "/continue_generation", continue_body()))

  def get_model_info(self) -> dict[str, Any]:
    return self._run(self._check_model())

  def get_loads(self) -> dict[str, Any]:
    return self._run(self._admin("GET", "/v1/loads"))[1]

  def health(self) -> bool:
    try:
      return self._run(self._http("GET", "/health", timeout=10), 20)[0] == 200
    except (ServerUnreachable, RequestTimedOut):
      return False


# ---- Weight updates of a group -------------------------------------------------------
def update_weights_from_disk(engines: Sequence[Any], model_path: str,
                             weight_version: str) -> dict[str, float]:
  """Every server: pause -> /update_weights_from_disk -> continue, version confirmed.

  `engines`: SGLangEngines or a pool holding them (`.engines`). Servers are updated
  concurrently; returns seconds per server. Raises if any server fails or reports
  another version (the others keep the new weights).
  """
  engines = list(getattr(engines, "engines", engines))
  bad = [type(e).__name__ for e in engines if not isinstance(e, SGLangAdmin)]
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
