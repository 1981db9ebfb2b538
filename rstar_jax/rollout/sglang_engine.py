"""SGLangEngine: an engine of the pool that generates on an SGLang server over HTTP.

Pinned to SGLang 0.5.23's native API (no torch here, no SGLang import: only aiohttp).
Our own rollout server (`python -m rstar_jax.rollout.server`) speaks the same subset,
so the same client drives real SGLang servers on GPU hosts and JAX servers anywhere.

Requests (`POST /generate`), token-in / token-out:
  {"rid": ..., "input_ids": [...], "return_logprob": true, "logprob_start_len": -1,
   "stream": false, "sampling_params": {"max_new_tokens", "temperature", "top_p",
   "top_k" (-1 = off: SGLang rejects 0), "stop_token_ids", "no_stop_trim": true,
   "skip_special_tokens": false, "spaces_between_special_tokens": false,
   "sampling_seed"}}
Replies: the sampled ids and their log-probs from `meta_info.output_token_logprobs`
([logprob, token_id, text] per generated token, the stop token included), checked
against `output_ids` when present; the finish reason from `meta_info.finish_reason`
({"type": "stop" | "length" | "abort", ...}); the weight version from
`meta_info.weight_version`.

Admin calls: `/abort_request`, `/flush_cache` (retried while it answers 400: requests
still running), `/pause_generation`, `/continue_generation`,
`/update_weights_from_disk` (with `weight_version`), `/model_info` (confirms it),
`/health`, `/server_info` (`max_req_input_len`: the length limit; KV capacity;
`enable_deterministic_inference` where the config requires it) and `/v1/loads` (the server's
used / total KV tokens, polled in the background for the scheduler's `free_kv_tokens`).

Failure handling:
  * connection errors (refused, reset, server gone mid-request) and 502/503/504 are
    retried on the same server with exponential backoff (a 503 that is SGLang's own
    abort reply proves the server released the request; after any other 5xx, or a
    dropped connection, the attempt is aborted on the server before it is re-sent); when they persist the server
    leaves rotation (`alive=False`, `free_kv_tokens()` very negative) and the request
    goes to another server of the same group (the engines built together). A dead
    server is probed (`/health`, then the model check) in the background and rejoins.
  * a request is re-sent only when no reply was received. Once a reply arrived (even
    a malformed one, or an error status) it is never sent again: a malformed reply
    raises `MalformedReplyError` naming the server and the field, a 4xx raises
    `ServerRequestError` with the server's message.
  * on start-up (and after each weight update) the server's model is checked against
    the trainer's: model type and, when the server's `model_path/config.json` is
    readable here (shared storage), vocabulary size and shapes; every returned token
    id must be inside the vocabulary. A mismatch raises `ServerMismatchError`.
  * a cancelled `generate` (the caller gave up) sends `/abort_request` for its rid.
  * a server whose `--preferred-sampling-params` (its /model_info) would fill a
    sampling key the client leaves out with a non-default value is refused at connect
    (`ServerMismatchError`): it would change the sampling distribution silently.

Threads: all HTTP runs on one background asyncio loop per group (`_IOLoop`), so the
engines work from any caller loop (the rollout collector starts a fresh
`asyncio.run` per batch) and `free_kv_tokens()` stays synchronous.

In-memory `update_weights(params)` is not possible over HTTP: weights reach servers as
a HF checkpoint on shared disk + `update_weights_from_disk` (see that function).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import json
import math
import os
import threading
import time
import uuid
from typing import Any, Mapping, Sequence

import aiohttp
from absl import logging

from rstar_jax.rollout.engine import GenerationRequest, GenerationResult, RequestFailed

SGLANG_VERSION = "0.5.23"
_DEAD_FREE_KV = -(1 << 40)   # what a server out of rotation reports to the scheduler
_MODEL_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "tie_word_embeddings")
PAUSE_MODES = ("abort", "retract", "in_place")   # what /pause_generation accepts
# SGLang's server arg (--enable-deterministic-inference), which /server_info reports at the
# top level with every other resolved server arg (`ServerArgs.resolved_dict`).
DETERMINISTIC_KEY = "enable_deterministic_inference"
UPDATE_PAUSE_MODES = ("abort", "retract")        # what a weight update may pause with


# ---- Errors ------------------------------------------------------------------------
class SGLangError(RuntimeError):
  """Base of the errors of the SGLang client."""


class MalformedReplyError(SGLangError, RequestFailed):
  """A server reply that does not have the shape of SGLang 0.5.23's API."""


class ServerRequestError(SGLangError, RequestFailed):
  """The server refused a request (HTTP 4xx/5xx other than the transient ones)."""

  def __init__(self, message: str, status: int):
    super().__init__(message)
    self.status = status


class ServerMismatchError(SGLangError):
  """The server's model or vocabulary is not the trainer's."""


class GenerationAborted(SGLangError, RequestFailed):
  """The server aborted the request (`/abort_request`, a pause in abort mode)."""

  def __init__(self, message: str, partial: GenerationResult | None = None):
    super().__init__(message)
    self.partial = partial


class NoServerAvailable(SGLangError):
  """Every server of the group is out of rotation."""


class _Unreachable(Exception):
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


# ---- Request bodies (pure: the contract tests validate exactly these) -------------
def generate_body(request: GenerationRequest, rid: str) -> dict[str, Any]:
  """The /generate JSON of one request (SGLang 0.5.23 field names)."""
  return {
      "rid": rid,
      "input_ids": [int(t) for t in request.input_ids],
      "return_logprob": True,
      "logprob_start_len": -1,
      "stream": False,
      "sampling_params": {
          "max_new_tokens": int(request.max_new_tokens),
          "temperature": float(request.temperature),
          "top_p": float(request.top_p),
          "top_k": int(request.top_k) if request.top_k > 0 else -1,
          "stop_token_ids": [int(t) for t in request.stop_token_ids],
          "no_stop_trim": True,
          "skip_special_tokens": False,
          "spaces_between_special_tokens": False,
          "sampling_seed": int(request.seed),
      },
  }


def abort_body(rid: str) -> dict[str, Any]:
  return {"rid": rid}


def pause_body(mode: str) -> dict[str, Any]:
  if mode not in PAUSE_MODES:
    raise ValueError(f"pause mode {mode!r}: choose from {PAUSE_MODES}")
  return {"mode": mode}


def continue_body() -> dict[str, Any]:
  return {}


def update_weights_body(model_path: str, weight_version: str, *,
                        abort_all_requests: bool = False,
                        flush_cache: bool = True) -> dict[str, Any]:
  return {"model_path": model_path, "weight_version": str(weight_version),
          "abort_all_requests": bool(abort_all_requests), "flush_cache": bool(flush_cache)}


# ---- What a server may change or repeat ------------------------------------------
# SGLang 0.5.23's SamplingParams defaults (sglang/srt/sampling/sampling_params.py) for the
# keys generate_body leaves out. A server started with --preferred-sampling-params fills
# every key a request leaves out from them (`{**preferred, **request}` in its tokenizer
# manager), so a preferred value other than these changes what is sampled; the keys
# generate_body sends always win. tests/rollout/test_sglang_faults.py checks this table
# and the rule against SGLang's own class.
SGLANG_SAMPLING_DEFAULTS: dict[str, Any] = {
    "stop": None, "stop_regex": None, "min_p": 0.0, "frequency_penalty": 0.0,
    "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1,
    "beam_width": None, "json_schema": None, "regex": None, "ebnf": None,
    "structural_tag": None, "ignore_eos": False, "stream_interval": None, "logit_bias": None,
    "custom_params": None, "watermark": None}
_MISSING = object()


def preferred_sampling_changes(preferred: Any) -> dict[str, Any]:
  """The entries of a server's `preferred_sampling_params` (its /model_info) that would
  change a request of generate_body: keys it leaves out, at a value other than SGLang's
  default (a key unknown here counts as a change). {} when none would."""
  if preferred is None:
    return {}
  if isinstance(preferred, str):       # the launch flag's JSON, where not parsed yet
    try:
      preferred = json.loads(preferred)
    except ValueError:
      return {"<unparsable>": preferred}
  if not isinstance(preferred, dict):
    return {"<not a mapping>": preferred}
  sent = generate_body(GenerationRequest(input_ids=[0], max_new_tokens=1), "")["sampling_params"]
  return {k: v for k, v in preferred.items()
          if k not in sent and SGLANG_SAMPLING_DEFAULTS.get(k, _MISSING) != v}


def check_preferred_sampling(url: str, info: Mapping[str, Any]) -> None:
  """Refuses (ServerMismatchError) a server whose --preferred-sampling-params would
  silently change the sampling distribution the trainer asked for."""
  changes = preferred_sampling_changes(info.get("preferred_sampling_params"))
  if changes:
    raise ServerMismatchError(
        f"{url} runs with --preferred-sampling-params that change every request's sampling "
        f"(keys the client leaves to the server): {changes}; start it without them (the "
        f"trainer's rollout config sets temperature, top_p, top_k)")


def reply_proves_not_running(status: int, parsed: Any) -> bool:
  """Whether a 5xx reply to /generate proves the server holds nothing of the request, so
  that sending it again is its only run. SGLang 0.5.23 answers /generate with 503 only for
  a request its scheduler aborted and released (retracted under memory pressure without
  a KV backup, a waiting or running time limit, preempted by a higher priority): FastAPI's
  {"detail": message} from tokenizer_manager._handle_abort_finish_reason. A 502/504 (a
  proxy) or another 503 proves nothing: the request may still run there."""
  return status == 503 and isinstance(parsed, dict) and isinstance(parsed.get("detail"), str)


# ---- Reply parsing ---------------------------------------------------------------
@dataclasses.dataclass
class ServedResult(GenerationResult):
  """A GenerationResult plus where and with which weights it was generated."""
  server: str = ""
  rid: str = ""


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def parse_generate_reply(reply: Any, request: GenerationRequest, *, rid: str, url: str,
                         vocab_size: int | None = None, queue_wait_s: float = 0.0
                         ) -> ServedResult:
  """Checks a /generate reply (non-streaming, return_logprob=true) and converts it.

  Raises MalformedReplyError naming the field; GenerationAborted for an abort.
  """
  def bad(what: str) -> MalformedReplyError:
    snippet = json.dumps(reply)[:300] if _jsonable(reply) else repr(reply)[:300]
    return MalformedReplyError(
        f"{url}/generate (rid {rid}): malformed reply: {what}; reply starts {snippet}")

  if not isinstance(reply, dict):
    raise bad(f"expected a JSON object, got {type(reply).__name__}")
  meta = reply.get("meta_info")
  if not isinstance(meta, dict):
    raise bad("no meta_info object")
  fr = meta.get("finish_reason")
  if not isinstance(fr, dict) or fr.get("type") not in ("stop", "length", "abort"):
    raise bad(f"meta_info.finish_reason must be an object with type stop/length/abort, "
              f"got {fr!r:.100}")
  entries = meta.get("output_token_logprobs")
  if not isinstance(entries, list):
    raise bad("meta_info.output_token_logprobs missing or not a list (return_logprob was "
              "requested)")
  ids, logps = [], []
  for k, e in enumerate(entries):
    if (not isinstance(e, list) or len(e) < 2 or not _is_num(e[0]) or not _is_int(e[1])):
      raise bad(f"meta_info.output_token_logprobs[{k}] must be [logprob, token_id, text], "
                f"got {e!r:.80}")
    lp = float(e[0])
    # -inf too: a sampled token has positive probability, and an infinite log-prob
    # would poison the step's importance ratios.
    if not math.isfinite(lp) or lp > 1e-4:
      raise bad(f"meta_info.output_token_logprobs[{k}]: log-prob {lp} is not finite and <= 0")
    ids.append(e[1])
    logps.append(lp)
  out_ids = reply.get("output_ids")
  if out_ids is not None and not isinstance(out_ids, list):
    raise bad(f"output_ids must be a list of token ids, got {out_ids!r:.80}")
  if out_ids is not None and out_ids != ids:
    raise bad(f"output_ids ({len(out_ids)} ids) differ from the ids of "
              f"meta_info.output_token_logprobs ({len(ids)})")
  if vocab_size is not None:
    outside = [t for t in ids if not 0 <= t < vocab_size]
    if outside:
      raise bad(f"token ids {outside[:5]} outside the vocabulary of {vocab_size} (is the "
                f"server running another model?)")
  wv = meta.get("weight_version")
  if wv is not None and not isinstance(wv, str):
    raise bad(f"meta_info.weight_version must be a string, got {wv!r:.50}")
  spans = meta.get("weight_versions")
  if spans is not None:
    # SGLang's per-token spans: a request paused across a weight update (retract /
    # in_place) has tokens of both, and weight_version names only the last.
    if not isinstance(spans, list) or not all(
        isinstance(sp, dict) and isinstance(sp.get("version"), str) for sp in spans):
      raise bad(f"meta_info.weight_versions must be a list of {{version, start, end}}, "
                f"got {spans!r:.100}")
    versions = list(dict.fromkeys(sp["version"] for sp in spans))
    if len(versions) > 1:
      wv = " -> ".join(versions)   # never equal to one version: an off-policy turn is seen
  cached = meta.get("cached_tokens", 0)
  if not _is_int(cached):
    raise bad(f"meta_info.cached_tokens must be an integer, got {cached!r:.50}")
  ptoks = meta.get("prompt_tokens", len(request.input_ids))
  if not _is_int(ptoks):
    raise bad(f"meta_info.prompt_tokens must be an integer, got {ptoks!r:.50}")
  if ptoks != len(request.input_ids):
    # SGLang with --allow-auto-truncate keeps the prompt's head only; a continuation
    # of that would be spliced onto the whole context.
    raise bad(f"meta_info.prompt_tokens={ptoks} but {len(request.input_ids)} input ids were "
              f"sent (the server truncated the prompt?)")
  kind = fr["type"]
  if kind == "stop":
    if not ids:
      raise bad("finish_reason stop with no generated token")
    reason = "stop"
  elif kind == "length":
    reason = "length"
  else:
    reason = "abort"
  result = ServedResult(
      request_id=request.request_id, output_ids=ids, logprobs=logps, finish_reason=reason,
      prompt_tokens=ptoks, reused_prefix_tokens=cached, queue_wait_s=queue_wait_s,
      server=url, weight_version=wv, rid=rid)
  if reason == "abort":
    raise GenerationAborted(f"{url}: request {request.request_id} (rid {rid}) was aborted by "
                            f"the server: {fr.get('message')}", partial=result)
  if kind == "length" and len(ids) > request.max_new_tokens:
    raise bad(f"{len(ids)} tokens generated for max_new_tokens={request.max_new_tokens}")
  return result


def _jsonable(x) -> bool:
  try:
    json.dumps(x)
    return True
  except (TypeError, ValueError):
    return False


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


# ---- The engine ----------------------------------------------------------------------
class SGLangEngine:
  """One SGLang (or compatible) server as an Engine of the pool.

  Build several with `connect(urls, ...)` so that they fail over to each other.
  """

  def __init__(self, url: str, *, group: ServerGroup | None = None,
               config: ClientConfig | None = None, name: str | None = None,
               expected_model: Mapping[str, Any] | None = None, on_exchange=None):
    """Args:
      expected_model: the trainer's HF config.json fields (`hf_io.config_to_hf_dict`);
        the server's model must agree on `_MODEL_KEYS` that both state.
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
        f"rstar_jax.rollout.sglang_engine.update_weights_from_disk(engines, dir, version) "
        f"(pause -> /update_weights_from_disk -> continue -> /model_info confirms).")

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

  # ---- HTTP ----------------------------------------------------------------------
  async def _http(self, method: str, route: str, body: Any = None, *,
                  timeout: float | None, params: Mapping[str, str] | None = None
                  ) -> tuple[int, Any, str]:
    """One exchange. Returns (status, parsed JSON or None, raw text).

    Raises _Unreachable when no reply was received, RequestTimedOut when none came in
    `timeout` seconds.
    """
    to = aiohttp.ClientTimeout(total=timeout, sock_connect=self.config.connect_timeout_s)
    try:
      async with self.group.io.session.request(method, self.url + route, json=body,
                                               timeout=to, params=params) as resp:
        raw = (await resp.read()).decode("utf-8", errors="replace")
        status = resp.status
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError) as e:
      raise _Unreachable(f"{type(e).__name__}: {e}") from e
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
      except _Unreachable as e:   # a timeout is not retried: the call may still be running
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
      except _Unreachable as e:
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
    """Generation on this server; connection errors retried, then _Unreachable."""
    delay = self.config.backoff_s
    reserve = min(self.max_len, len(request.input_ids) + request.max_new_tokens)
    last: _Unreachable | None = None
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
            raise _Unreachable(f"left rotation while request {request.request_id} ran "
                               f"({self.dead_reason})") from None
          call.cancel()
          raise
      except _Unreachable as e:
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
        last = _Unreachable(f"HTTP {status}")
        self.metrics["retries"] += 1
        await asyncio.sleep(delay)
        delay = min(delay * 2, self.config.backoff_max_s)
        continue
      if status != 200:
        msg = raw[:500]
        if isinstance(parsed, dict) and "error" in parsed:
          err = parsed["error"]
          msg = err.get("message", msg) if isinstance(err, dict) else str(err)
        raise ServerRequestError(f"{self.url}/generate refused request {request.request_id} "
                                 f"(HTTP {status}): {msg}", status)
      if parsed is None:
        raise MalformedReplyError(f"{self.url}/generate (rid {rid}): reply is not JSON: "
                                  f"{raw[:300]!r}")
      return parse_generate_reply(parsed, request, rid=rid, url=self.url,
                                  vocab_size=self.vocab_size)
    raise last or _Unreachable("server out of rotation")

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
        except (_Unreachable, SGLangError) as e:
          if isinstance(e, ServerMismatchError):
            self.dead_reason = str(e)
          continue
        try:
          # It missed weight updates while away; the trainer may publish again while it
          # catches up (it skips servers out of rotation), so until it holds the latest.
          while (target := self.group.target) is not None and self.weight_version != target[1]:
            await self._sync_from_disk(*target)
        except (_Unreachable, SGLangError) as e:
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
      except (_Unreachable, RequestTimedOut) as e:
        why = str(e)
      if not wait:
        raise _Unreachable(f"/health: {why}")
      if time.monotonic() > deadline:
        raise SGLangError(f"{self.url}: no healthy answer from /health within "
                          f"{self.config.startup_timeout_s} s (last: {why})")
      await asyncio.sleep(delay)
      delay = min(delay * 2, self.config.backoff_max_s)
    status, info, raw = await self._http("GET", "/server_info", timeout=30)
    if status != 200 or not isinstance(info, dict):
      raise MalformedReplyError(f"{self.url}/server_info: HTTP {status}: {raw[:300]}")
    # SGLang's Python server states no context length of its own (its `context_length`
    # is the launch flag, often null) but the scheduler's `max_req_input_len`: inputs of
    # that many tokens or more are refused, and a request's output is capped a few
    # tokens above it, so it bounds input + output here. Our server states both.
    limits = {k: info.get(k) for k in ("max_req_input_len", "max_context_length")
              if info.get(k) is not None}
    if not limits or not all(_is_int(v) and v > 1 for v in limits.values()):
      raise MalformedReplyError(
          f"{self.url}/server_info: needs max_req_input_len (SGLang) or max_context_length "
          f"as an integer > 1, got {limits or 'neither'}")
    ctx, total = min(limits.values()), info.get("max_total_num_tokens")
    if total is not None and not _is_int(total):
      raise MalformedReplyError(f"{self.url}/server_info: max_total_num_tokens must be an "
                                f"integer, got {total!r:.50}")
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
    if status != 200 or not isinstance(info, dict):
      raise MalformedReplyError(f"{self.url}/model_info: HTTP {status}: {raw[:300]}")
    path, wv = info.get("model_path"), info.get("weight_version")
    if not isinstance(path, str) or (wv is not None and not isinstance(wv, str)):
      raise MalformedReplyError(f"{self.url}/model_info: model_path must be a string and "
                                f"weight_version a string or null: {raw[:300]}")
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
        served.update({k: cfg[k] for k in _MODEL_KEYS if k in cfg})
      except (OSError, json.JSONDecodeError) as e:
        logging.warning("sglang: cannot read %s (%s); model not verified", cfg_file, e)
    elif self.expected_model:
      logging.warning("sglang: %s serves %s, which is not readable here: vocabulary and "
                      "shapes not verified (token ids are still range-checked)", self.url, path)
    diff = {k: (served[k], self.expected_model[k]) for k in _MODEL_KEYS
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
      except (_Unreachable, RequestTimedOut) as e:
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
        used = sum(int(l["num_total_tokens"]) for l in body["loads"])
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

  async def _abort_quietly(self, rid: str, again: bool = True):
    if again and self._paused:
      self._abort_after_pause.add(rid)
    try:
      await self._http("POST", "/abort_request", abort_body(rid), timeout=10)
    except Exception:   # best effort: the server may be gone
      pass

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
      if status != 200 or not isinstance(reply, dict) or reply.get("success") is not True:
        msg = reply.get("message") if isinstance(reply, dict) else raw[:300]
        raise ServerRequestError(f"{self.url}/update_weights_from_disk {model_path}: {msg}",
                                 status)
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
    except (_Unreachable, RequestTimedOut):
      return False


# ---- Groups and weight sync ----------------------------------------------------------
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
