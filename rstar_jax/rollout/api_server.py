"""Our rollout server: a JaxEngine behind a subset of SGLang 0.5.23's native HTTP API.

  python -m rstar_jax.rollout.api_server --hf_dir DIR --port PORT \
      [--host 127.0.0.1] [--num_slots 8] [--max_len 1024] [--min_prefill_bucket 16] \
      [--weight_version default] [--compile_cache DIR] [--enable-deterministic-inference]

`--enable-deterministic-inference` (SGLang's flag): batch-invariant generation
(EngineConfig.batch_invariant), reported in /server_info as SGLang reports it.

So JAX rollouts run as separate processes or hosts behind the same client
(`sglang.engine.SGLangEngine`) as real SGLang servers. Routes and JSON follow SGLang
0.5.23 (field names, status codes, error bodies); what we do not implement is refused
with a 400 naming it, never silently ignored:

  POST /generate            one request: input_ids (no text, no batches), stream false;
                            sampling_params keys outside SGLang's schema are refused
                            with SGLang's own error text; supported: max_new_tokens,
                            temperature, top_p, top_k (-1 = off), stop_token_ids,
                            sampling_seed, and the text-only flags (no_stop_trim,
                            skip_special_tokens, spaces_between_special_tokens, stop
                            strings are not supported). Reply: output_ids, text (decoded
                            when the directory has a tokenizer.json), meta_info with id,
                            finish_reason ({"type": "stop", "matched": id} | {"type":
                            "length", "length": n} | {"type": "abort", ...}),
                            prompt_tokens, completion_tokens, cached_tokens (reused
                            prefix), weight_version, e2e_latency and, with
                            return_logprob, output_token_logprobs [[logprob, id, null]].
  POST /abort_request       {"rid"} or {"abort_all": true}: the request returns at once
                            with finish_reason abort and what it generated so far.
  GET|POST /flush_cache     drops the prefix cache; 400 while requests run or wait.
  POST /pause_generation    {"mode": "abort" | "retract" | "in_place"}: new requests
                            wait; abort ends running ones, the other two freeze them
                            in place (our engine never recomputes their KV: "retract"
                            behaves as "in_place").
  POST /continue_generation
  POST /update_weights_from_disk  {"model_path", "weight_version", "abort_all_requests",
                            ...}: loads a HF dir of the same architecture onto the
                            running engine. Not paused: waits for running requests and
                            holds new ones (as SGLang's model-update lock); paused: at
                            once. The weight version is reported by /model_info and in
                            every reply's meta_info.
  GET /model_info, /server_info (max_req_input_len = max_context_length = --max_len: inputs
  must be shorter, as on SGLang; KV capacity = slots x
  max_len), /v1/loads (per-rank load snapshot), /health, /health_generate, /ready.

Differences from SGLang worth knowing: the engine stops only on stop_token_ids (SGLang
also stops on the model's EOS unless ignore_eos); log-probs are log_softmax(logits / T)
over the full vocabulary (top-p/top-k restrict only the draw), as the trainer computes.
SGLang 0.5.23 also differs here (read from its source; the client copes with each): it
honours sampling_seed only with --enable-deterministic-inference; it drops an abort for
a request held at its pause gate (the client aborts again after continue_generation);
after an "in_place" pause it loads new weights but refuses the cache flush and answers
400 (the client never pauses in place for an update).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import threading
import time
import uuid
from typing import Any, Iterator

from aiohttp import web

from rstar_jax import compile_cache
from rstar_jax.rollout.engine import GenerationRequest, GenerationResult
from rstar_jax.rollout.jax_engine import EngineConfig, JaxEngine, settle_future
from rstar_jax.rollout.sglang.wire import SGLANG_VERSION as SGLANG_API_VERSION  # the one pin
log = logging.getLogger("rstar_jax.rollout.api_server")

# SGLang 0.5.23's SamplingParams schema (sglang/api/v1/api_types.py, "unknown keys
# rejected"); the contract test checks this tuple against the wheel's.
SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params", "beam_width", "watermark", "choice")
# Fields we accept whatever their value; every other field must be absent or neutral.
_SAMPLING_USED = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids",
                  "sampling_seed", "no_stop_trim", "skip_special_tokens",
                  "spaces_between_special_tokens", "stream_interval", "n"}
_NEUTRAL_SAMPLING = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                     "repetition_penalty": 1.0, "min_new_tokens": 0, "ignore_eos": False}
_TOP_USED = {"rid", "input_ids", "return_logprob", "logprob_start_len", "stream",
             "sampling_params", "return_text_in_logprobs", "top_logprobs_num", "log_metrics"}


class RequestError(ValueError):
  """A request we refuse with HTTP 400."""


def _unknown_field(key: str, fields) -> str:
  """serde's unknown-field text, as SGLang's contract gate answers it."""
  listed = ", ".join(f"`{f}`" for f in fields)
  return f"unknown field `{key}`, expected one of {listed}"


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
  """A finite number (json.loads accepts NaN and Infinity)."""
  if isinstance(x, bool) or not isinstance(x, (int, float)):
    return False
  try:
    return math.isfinite(float(x))
  except OverflowError:   # an int past float's range
    return False


# ---- The engine with abort and pause -------------------------------------------------
class ServedEngine(JaxEngine):
  """JaxEngine + abort of one request and pausing of the engine loop.

  Uses JaxEngine's internals (queue, slots, _lock): both live in this package. Every
  change to a slot happens under `_step_lock`, which a running step holds, so an abort
  never races a decode step.
  """

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self._step_lock = threading.Lock()
    self._running = threading.Event()
    self._running.set()

  def step(self) -> None:
    if not self._running.wait(timeout=0.05):
      return
    with self._step_lock:
      if self._running.is_set():
        super().step()

  def pause(self) -> None:
    """Running requests stay in their slots; no step runs until `resume`."""
    self._running.clear()
    with self._step_lock:   # waits for the step in flight
      pass

  def resume(self) -> None:
    self._running.set()
    with self._lock:
      self._lock.notify()

  def abort(self, rid: str) -> bool:
    """Ends request `rid` (queued or running) with finish_reason "abort"."""
    with self._step_lock:
      with self._lock:
        for k, (req, fut, _) in enumerate(self.queue):
          if req.request_id == rid:
            del self.queue[k]
            settle_future(fut, GenerationResult(
                request_id=rid, output_ids=[], logprobs=[], finish_reason="abort",
                prompt_tokens=len(req.input_ids), reused_prefix_tokens=0, queue_wait_s=0.0))
            return True
        for s in self.slots:
          if s.request is not None and s.request.request_id == rid:
            result = GenerationResult(
                request_id=rid, output_ids=list(s.out_ids), logprobs=list(s.out_logps),
                finish_reason="abort", prompt_tokens=len(s.request.input_ids),
                reused_prefix_tokens=s.reused, queue_wait_s=s.wait_s)
            settle_future(self._release(s), result)
            return True
    return False

  def running_ids(self) -> list[str]:
    with self._lock:
      return ([s.request.request_id for s in self.slots if s.request is not None]
              + [r.request_id for r, _, _ in self.queue])

  def load(self) -> dict[str, int]:
    with self._lock:
      used = sum(len(s.cached) + 1 for s in self.slots if s.request is not None)
      queued = sum(len(r.input_ids) for r, _, _ in self.queue)
      return {"running": sum(s.request is not None for s in self.slots),
              "waiting": len(self.queue), "used": used, "total": used + queued}

  def flush(self) -> bool:
    with self._step_lock, self._lock:
      if self.queue or any(s.request is not None for s in self.slots):
        return False
      for s in self.slots:
        s.cached = []
      return True


# ---- The HTTP server -------------------------------------------------------------------
@dataclasses.dataclass
class _Req:
  aborted: bool = False
  submitted: bool = False


class RolloutServer:
  def __init__(self, hf_dir: str, engine_cfg: EngineConfig, *, weight_version: str = "default",
               host: str = "127.0.0.1", port: int = 0):
    from rstar_jax.model import hf_io
    self.hf_io = hf_io
    self.model_path = os.path.abspath(hf_dir)
    model = hf_io.load_hf(self.model_path)
    self.model_cfg = model.cfg
    self.engine_cfg = engine_cfg
    self.engine = ServedEngine(model, engine_cfg, name="served")
    self.weight_version = self.engine.weight_version = str(weight_version)
    self.host, self.port = host, port
    self.tokenizer = self._load_tokenizer(self.model_path)
    self.requests: dict[str, _Req] = {}
    self.paused = False
    self._active = 0
    self._updating = False
    self._cond: asyncio.Condition | None = None
    self.started = time.time()

  @staticmethod
  def _load_tokenizer(path):
    f = os.path.join(path, "tokenizer.json")
    if not os.path.exists(f):
      return None
    try:
      from tokenizers import Tokenizer
      return Tokenizer.from_file(f)
    except Exception as e:   # text is a convenience; ids are the interface
      log.warning("no text in replies: cannot load %s (%s)", f, e)
      return None

  def warmup(self) -> None:
    """Compiles the first prefill and decode shapes before the port opens (the others
    compile when first met; `JaxEngine.warm_up()` would compile them all)."""
    self.engine.generate_sync([GenerationRequest(input_ids=[0], max_new_tokens=2,
                                                 request_id="warmup")])

  def app(self) -> web.Application:
    app = web.Application(client_max_size=1 << 30)
    r = app.router
    r.add_route("POST", "/generate", self.generate)
    r.add_route("PUT", "/generate", self.generate)
    r.add_post("/abort_request", self.abort_request)
    r.add_route("GET", "/flush_cache", self.flush_cache)
    r.add_route("POST", "/flush_cache", self.flush_cache)
    r.add_post("/pause_generation", self.pause_generation)
    r.add_post("/continue_generation", self.continue_generation)
    r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
    for path in ("/model_info", "/get_model_info"):
      r.add_get(path, self.model_info)
    for path in ("/server_info", "/get_server_info"):
      r.add_get(path, self.server_info)
    r.add_get("/v1/loads", self.loads)
    for path in ("/health", "/health_generate", "/ready"):
      r.add_get(path, self.health)
    app.on_startup.append(self._on_startup)
    app.on_cleanup.append(self._on_cleanup)
    return app

  async def _on_startup(self, app):
    self._cond = asyncio.Condition()
    self.engine.start()

  async def _on_cleanup(self, app):
    await asyncio.get_running_loop().run_in_executor(None, self.engine.stop)

  # ---- helpers ---------------------------------------------------------------
  @staticmethod
  def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)

  @staticmethod
  async def _json(request: web.Request, allow_empty: bool = False) -> Any:
    raw = await request.read()
    if not raw:
      if allow_empty:
        return {}
      raise RequestError("empty request body (expected a JSON object)")
    try:
      body = json.loads(raw)
    except (ValueError, RecursionError) as e:   # also > 4300-digit numbers, deep nesting
      raise RequestError(f"request body is not JSON: {type(e).__name__}: {str(e)[:200]}"
                         ) from None
    if not isinstance(body, dict):
      raise RequestError(f"invalid type: expected a JSON object, got {type(body).__name__}")
    return body

  async def _in_thread(self, fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

  # ---- /generate -------------------------------------------------------------
  def _parse_generate(self, body: dict) -> tuple[GenerationRequest, bool]:
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
      raise RequestError("sampling_params must be one JSON object (batches are not supported "
                         "by this server)")
    for key in sp:
      if key not in SAMPLING_FIELDS:
        raise _ContractError(_unknown_field(key, SAMPLING_FIELDS))
    for key, value in sp.items():
      if key in _SAMPLING_USED or value is None:
        continue
      if key in _NEUTRAL_SAMPLING and value == _NEUTRAL_SAMPLING[key]:
        continue
      if value in ([], {}, "") or (key == "n" and value == 1):
        continue
      raise RequestError(f"sampling_params.{key}={value!r:.60} is not supported by this server")
    for key, value in body.items():
      if key in _TOP_USED or value in (None, False, [], {}, ""):
        continue
      raise RequestError(f"{key} is not supported by this server (token ids in, one request "
                         f"per call)")
    if body.get("stream"):
      raise RequestError("stream=true is not supported by this server")
    if body.get("logprob_start_len") not in (None, -1):
      raise RequestError("logprob_start_len other than -1 (input log-probs) is not supported")
    if body.get("top_logprobs_num") not in (None, 0):
      raise RequestError("top_logprobs_num is not supported by this server")
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids or not all(_is_int(t) for t in ids):
      raise RequestError("input_ids must be a non-empty list of token ids (text prompts and "
                         "batches are not supported by this server)")
    vocab = self.model_cfg.vocab_size
    if not all(0 <= t < vocab for t in ids):
      raise RequestError(f"input_ids outside the vocabulary [0, {vocab})")
    if sp.get("n", 1) not in (1, None):
      raise RequestError("n > 1 is not supported by this server")
    max_new = sp.get("max_new_tokens", 128)
    if max_new is None:
      max_new = self.engine_cfg.max_len - len(ids)
    temp, top_p, top_k = sp.get("temperature", 1.0), sp.get("top_p", 1.0), sp.get("top_k", -1)
    if temp is None:
      temp = 1.0
    if top_p is None:
      top_p = 1.0
    if top_k is None:
      top_k = -1
    if not _is_int(max_new) or max_new <= 0:
      raise RequestError(f"max_new_tokens must be a positive integer, got {max_new!r}")
    if not _is_num(temp) or temp < 0:
      raise RequestError(f"temperature must be a number >= 0, got {temp!r}")
    if not _is_num(top_p) or not 0 < top_p <= 1:
      raise RequestError(f"top_p must be in (0, 1], got {top_p!r}")
    if not _is_int(top_k) or not (top_k == -1 or top_k >= 1):
      raise RequestError(f"top_k must be -1 (disable), or at least 1, got {top_k!r}")
    stops = sp.get("stop_token_ids") or []
    if not isinstance(stops, list) or not all(_is_int(t) for t in stops):
      raise RequestError("stop_token_ids must be a list of token ids")
    seed = sp.get("sampling_seed")
    if seed is None:
      seed = random.randrange(2 ** 31 - 1)
    if not _is_int(seed) or not 0 <= seed < 2 ** 31:
      raise RequestError(f"sampling_seed must be an integer in [0, 2**31), got {seed!r}")
    rid = body.get("rid") or uuid.uuid4().hex
    if not isinstance(rid, str):
      raise RequestError("rid must be a string (batches are not supported by this server)")
    req = GenerationRequest(
        input_ids=ids, max_new_tokens=max_new, stop_token_ids=tuple(stops),
        temperature=float(temp), top_p=float(top_p), top_k=0 if top_k == -1 else top_k,
        seed=seed, request_id=rid)
    req.validate(self.engine_cfg.max_len)
    return req, bool(body.get("return_logprob"))

  async def generate(self, request: web.Request) -> web.Response:
    t0 = time.perf_counter()
    try:
      body = await self._json(request)
      req, want_logprobs = self._parse_generate(body)
    except _ContractError as e:
      return web.json_response({"error": str(e)}, status=400)
    except (RequestError, ValueError) as e:
      return self._error(str(e))
    rid = req.request_id
    if rid in self.requests:
      return self._error(f"Duplicate request ID detected: {rid}")
    state = self.requests[rid] = _Req()
    try:
      async with self._cond:   # paused / a weight update holds new requests here
        await self._cond.wait_for(
            lambda: state.aborted or (not self.paused and not self._updating))
        self._active += 1
      try:
        if state.aborted:
          result = GenerationResult(request_id=rid, output_ids=[], logprobs=[],
                                    finish_reason="abort", prompt_tokens=len(req.input_ids),
                                    reused_prefix_tokens=0, queue_wait_s=0.0)
        else:
          fut = self.engine.submit(req)
          state.submitted = True
          try:
            result = await asyncio.wrap_future(fut)
          except asyncio.CancelledError:   # the client went away
            await self._in_thread(self.engine.abort, rid)
            raise
      finally:
        async with self._cond:
          self._active -= 1
          self._cond.notify_all()
    finally:
      self.requests.pop(rid, None)
    return web.json_response(self._reply(req, result, want_logprobs, time.perf_counter() - t0))

  def _reply(self, req, result: GenerationResult, want_logprobs: bool, secs: float) -> dict:
    ids = list(result.output_ids)
    if result.finish_reason == "stop":
      finish = {"type": "stop", "matched": ids[-1]}
    elif result.finish_reason == "length":
      finish = {"type": "length", "length": len(ids)}
    else:
      finish = {"type": "abort", "message": "Abort in waiting queue" if not ids else
                "Abort request", "status_code": None, "err_type": None}
    meta = {"id": req.request_id, "finish_reason": finish,
            "prompt_tokens": len(req.input_ids), "completion_tokens": len(ids),
            "cached_tokens": result.reused_prefix_tokens,
            "weight_version": result.weight_version or self.weight_version,
            "e2e_latency": secs}
    if want_logprobs:
      meta["output_token_logprobs"] = [[float(lp), int(t), None]
                                       for lp, t in zip(result.logprobs, ids)]
    text = self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer else ""
    return {"text": text, "output_ids": ids, "meta_info": meta}

  # ---- admin -------------------------------------------------------------------
  async def abort_request(self, request: web.Request) -> web.Response:
    try:
      body = await self._json(request)
    except RequestError as e:
      return self._error(str(e))
    rid, abort_all = body.get("rid") or "", body.get("abort_all", False)
    if not isinstance(rid, str):
      return self._error("rid must be a string")
    if not isinstance(abort_all, bool):   # "false" would abort every request
      return self._error(f"abort_all must be true or false, got {abort_all!r}")
    await self._abort(None if abort_all else rid)
    return web.Response(status=200)

  async def _abort(self, rid: str | None) -> None:
    rids = list(self.requests) if rid is None else [rid] if rid in self.requests else []
    for r in rids:
      self.requests[r].aborted = True
      await self._in_thread(self.engine.abort, r)
    if rids:   # wake the requests held by a pause, so the aborted ones return
      async with self._cond:
        self._cond.notify_all()

  async def flush_cache(self, request: web.Request) -> web.Response:
    if await self._in_thread(self.engine.flush):
      return web.Response(text="Cache flushed.\nPlease check backend logs for more details. "
                          "(When there are running or waiting requests, the operation will not "
                          "be performed.)\n", status=200)
    return web.Response(text="Flush cache failed: requests are running or waiting.\n", status=400)

  async def pause_generation(self, request: web.Request) -> web.Response:
    try:
      body = await self._json(request, allow_empty=True)
    except RequestError as e:
      return self._error(str(e))
    mode = body.get("mode", "abort")
    if mode not in ("abort", "retract", "in_place"):
      return self._error(f"mode must be one of 'abort', 'retract', 'in_place', got {mode!r}")
    async with self._cond:
      self.paused = True
    if mode == "abort":
      await self._abort(None)
    else:
      await self._in_thread(self.engine.pause)
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

  async def continue_generation(self, request: web.Request) -> web.Response:
    self.engine.resume()
    async with self._cond:
      self.paused = False
      self._cond.notify_all()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

  async def update_weights_from_disk(self, request: web.Request) -> web.Response:
    try:
      body = await self._json(request)
    except RequestError as e:
      return self._error(str(e))
    path = body.get("model_path")
    version = body.get("weight_version")
    fail = lambda msg: web.json_response(
        {"success": False, "message": msg, "num_paused_requests": 0}, status=400)
    if not isinstance(path, str) or not path:
      return fail("model_path (a HF directory) is required")
    if version is not None and not isinstance(version, str):
      return fail("weight_version must be a string")
    if body.get("load_format") not in (None, "auto", "safetensors"):
      return fail(f"load_format {body['load_format']!r} is not supported by this server")
    abort_all = body.get("abort_all_requests", False)
    if not isinstance(abort_all, bool):
      return fail(f"abort_all_requests must be true or false, got {abort_all!r}")
    if abort_all:
      await self._abort(None)
    paused = self.paused
    if not paused:   # SGLang's model-update writer lock: running requests finish first
      async with self._cond:
        await self._cond.wait_for(lambda: not self._updating)
        self._updating = True
        await self._cond.wait_for(lambda: self._active == 0)
    try:
      t0 = time.perf_counter()
      try:
        model = await self._in_thread(self._load_same_architecture, os.path.abspath(path))
      except (ValueError, OSError) as e:
        return fail(f"Failed to update weights: {e}")
      from flax import nnx
      _, state = nnx.split(model)
      # The engine labels a request that ran across this update with both versions.
      await self._in_thread(self.engine.update_weights, state, version)
      self.model_path = os.path.abspath(path)
      message = "Succeeded to update model weights."
      if version is not None:
        self.weight_version = version
        message += f" Weight version updated to {version}."
      log.info("weights from %s (version %s) in %.2f s", self.model_path, self.weight_version,
               time.perf_counter() - t0)
      return web.json_response({"success": True, "message": message, "num_paused_requests": 0})
    finally:
      if not paused:
        async with self._cond:
          self._updating = False
          self._cond.notify_all()

  def _load_same_architecture(self, path: str):
    cfg = self.hf_io.load_config(path)
    mine = self.model_cfg
    arch = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")
    diff = [f"{k}={getattr(cfg, k)} (serving {getattr(mine, k)})" for k in arch
            if getattr(cfg, k) != getattr(mine, k)]
    if diff:
      raise ValueError(f"{path} is another architecture: " + ", ".join(diff))
    return self.hf_io.load_hf(path, param_dtype=mine.param_dtype, dtype=mine.dtype)

  async def model_info(self, request: web.Request) -> web.Response:
    return web.json_response({
        "model_path": self.model_path, "served_model_name": self.model_path,
        "tokenizer_path": self.model_path, "is_generation": True,
        "preferred_sampling_params": None, "weight_version": self.weight_version,
        "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None,
        "disaggregation_mode": "null", "has_image_understanding": False,
        "has_audio_understanding": False, "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"]})

  async def server_info(self, request: web.Request) -> web.Response:
    cfg = self.engine_cfg
    return web.json_response({
        "model_path": self.model_path, "served_model_name": self.model_path,
        "tokenizer_path": self.model_path, "max_context_length": cfg.max_len,
        # SGLang's limit: inputs must be shorter (our engine's rule for max_len too).
        "max_req_input_len": cfg.max_len, "status": "ready",
        "max_total_num_tokens": cfg.num_slots * cfg.max_len,
        "max_running_requests": cfg.num_slots,
        "version": f"rstar_jax rollout server (SGLang {SGLANG_API_VERSION} API subset)",
        "internal_states": [{}], "host": self.host, "port": self.port,
        "disaggregation_mode": "null", "startup_time": self.started,
        # SGLang's server arg of that name (every resolved arg is a top-level key there).
        "enable_deterministic_inference": cfg.batch_invariant})

  async def loads(self, request: web.Request) -> web.Response:
    load = self.engine.load()
    waiting = load["waiting"] + sum(not r.submitted for r in self.requests.values())
    cap = self.engine_cfg.num_slots * self.engine_cfg.max_len
    snapshot = {
        "timestamp": time.time(), "dp_rank": 0, "num_running_reqs": load["running"],
        "num_waiting_reqs": waiting, "num_used_tokens": load["used"],
        "num_total_tokens": load["total"], "max_total_num_tokens": cap,
        "max_running_requests": self.engine_cfg.num_slots,
        "token_usage": round(load["used"] / cap, 4)}
    return web.json_response({
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
        "version": f"rstar_jax ({SGLANG_API_VERSION} API)", "accelerator": None,
        "num_accelerators": 1, "loads": [snapshot]})

  async def health(self, request: web.Request) -> web.Response:
    return web.Response(status=200)


class _ContractError(RequestError):
  """Refused by SGLang's JSON contract gate: answered as {"error": "<text>"}."""


@contextlib.contextmanager
def running_servers(hf_dir: str, count: int, cfg: EngineConfig, *, log_dir: str,
                    startup_timeout_s: float = 600.0) -> Iterator[list[str]]:
  """`count` servers of `hf_dir` on 127.0.0.1 (`python -m rstar_jax.rollout.api_server`, one
  process each, logs `<log_dir>/rollout_server<i>.log`); yields their URLs once every one
  answers /health, kills them at exit. For benchmarks on one machine; a cluster's
  servers are started by `recipe/cluster.py`."""
  import socket
  import subprocess
  import sys
  import urllib.request
  os.makedirs(log_dir, exist_ok=True)
  procs, urls, logs = [], [], []
  try:
    for i in range(count):
      with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
      logs.append(os.path.join(log_dir, f"rollout_server{i}.log"))
      with open(logs[-1], "w") as log:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "rstar_jax.rollout.api_server", "--hf_dir", hf_dir,
             "--port", str(port), "--num_slots", str(cfg.num_slots), "--max_len",
             str(cfg.max_len), "--min_prefill_bucket", str(cfg.min_prefill_bucket),
             *(["--enable-deterministic-inference"] if cfg.batch_invariant else [])],
            stdout=log, stderr=subprocess.STDOUT))
      urls.append(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + startup_timeout_s
    for proc, url, log_path in zip(procs, urls, logs):
      while True:
        if proc.poll() is not None:
          with open(log_path) as f:
            raise RuntimeError(f"rollout server {url} exited {proc.returncode}: "
                               f"{f.read()[-2000:]}")
        try:
          with urllib.request.urlopen(url + "/health", timeout=5) as r:
            if r.status == 200:
              break
        except OSError:
          pass
        if time.monotonic() > deadline:
          raise RuntimeError(f"rollout server {url}: no /health within {startup_timeout_s} s "
                             f"(log: {log_path})")
        time.sleep(0.3)
    yield urls
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait(30)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--hf_dir", required=True, help="HF Qwen3 directory to serve")
  p.add_argument("--port", type=int, required=True)
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--num_slots", type=int, default=EngineConfig.num_slots)
  p.add_argument("--max_len", type=int, default=EngineConfig.max_len)
  p.add_argument("--min_prefill_bucket", type=int, default=EngineConfig.min_prefill_bucket)
  p.add_argument("--decode_steps", type=int, default=EngineConfig.decode_steps,
                 help="tokens each row samples per decode call (EngineConfig.decode_steps)")
  p.add_argument("--prefill_batch_tokens", type=int, default=EngineConfig.prefill_batch_tokens,
                 help="padded tokens one prefill call may carry (0: one request per call)")
  p.add_argument("--enable-deterministic-inference", dest="deterministic", action="store_true",
                 help="batch-invariant generation (EngineConfig.batch_invariant), reported in "
                      "/server_info as SGLang's flag of that name is")
  p.add_argument("--weight_version", default="default")
  p.add_argument("--compile_cache", default=os.environ.get("RSTAR_COMPILE_CACHE"),
                 help="JAX persistent compilation cache directory")
  p.add_argument("--no_warmup", action="store_true")
  args = p.parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
  if args.compile_cache:
    compile_cache.enable(args.compile_cache, min_compile_time_secs=0.0)
  try:
    cfg = EngineConfig(num_slots=args.num_slots, max_len=args.max_len,
                       min_prefill_bucket=args.min_prefill_bucket,
                       prefill_batch_tokens=args.prefill_batch_tokens,
                       decode_steps=args.decode_steps, batch_invariant=args.deterministic)
    server = RolloutServer(args.hf_dir, cfg, weight_version=args.weight_version,
                           host=args.host, port=args.port)
  except ValueError as e:   # CheckpointError and bad engine sizes
    raise SystemExit(f"rollout server: {e}")
  if not args.no_warmup:
    server.warmup()
  log.info("serving %s on http://%s:%d (%d slots x %d tokens)", server.model_path, args.host,
           args.port, cfg.num_slots, cfg.max_len)
  web.run_app(server.app(), host=args.host, port=args.port, print=None,
              handle_signals=True)


if __name__ == "__main__":
  main()
