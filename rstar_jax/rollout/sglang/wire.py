"""The SGLang API's wire format: request bodies, the sampling-params mapping, reply parsing.

Pinned to SGLang 0.5.23's native API: the routes' bodies and the reading of their replies
live here (pure functions, no I/O), so that a new SGLang version's changes to them are
changes to this file. Our own rollout server (`python -m rstar_jax.rollout.api_server`) speaks
the same subset. The client that sends these is `sglang.engine.SGLangEngine`
(`sglang.transport`: HTTP; `sglang.admin`: admin calls and server checks).

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
`meta_info.weight_version`. A malformed reply raises `MalformedReplyError` naming the
server and the field.

Admin bodies and replies: `/abort_request`, `/pause_generation` (`PAUSE_MODES`),
`/continue_generation`, `/update_weights_from_disk` (with `weight_version`; its reply's
`success`), `/server_info` (`max_req_input_len`: the length limit; KV capacity;
`DETERMINISTIC_KEY`), `/model_info` (`model_path`, `weight_version`,
`preferred_sampling_params`), `/v1/loads` (KV tokens in use) and error replies.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping

from rstar_jax.rollout.engine import GenerationRequest, GenerationResult, RequestFailed

SGLANG_VERSION = "0.5.23"
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
def parse_server_info(info: Any, *, status: int, raw: str, url: str
                      ) -> tuple[int, int | None]:
  """The length limit (input + output tokens) and the KV capacity (None: not stated) of
  a /server_info reply. Raises MalformedReplyError."""
  if status != 200 or not isinstance(info, dict):
    raise MalformedReplyError(f"{url}/server_info: HTTP {status}: {raw[:300]}")
  # SGLang's Python server states no context length of its own (its `context_length`
  # is the launch flag, often null) but the scheduler's `max_req_input_len`: inputs of
  # that many tokens or more are refused, and a request's output is capped a few
  # tokens above it, so it bounds input + output here. Our server states both.
  limits = {k: info.get(k) for k in ("max_req_input_len", "max_context_length")
            if info.get(k) is not None}
  if not limits or not all(_is_int(v) and v > 1 for v in limits.values()):
    raise MalformedReplyError(
        f"{url}/server_info: needs max_req_input_len (SGLang) or max_context_length "
        f"as an integer > 1, got {limits or 'neither'}")
  ctx, total = min(limits.values()), info.get("max_total_num_tokens")
  if total is not None and not _is_int(total):
    raise MalformedReplyError(f"{url}/server_info: max_total_num_tokens must be an "
                              f"integer, got {total!r:.50}")
  return ctx, total


def parse_model_info(info: Any, *, status: int, raw: str, url: str) -> tuple[str, str | None]:
  """The model path and weight version of a /model_info reply. Raises MalformedReplyError."""
  if status != 200 or not isinstance(info, dict):
    raise MalformedReplyError(f"{url}/model_info: HTTP {status}: {raw[:300]}")
  path, wv = info.get("model_path"), info.get("weight_version")
  if not isinstance(path, str) or (wv is not None and not isinstance(wv, str)):
    raise MalformedReplyError(f"{url}/model_info: model_path must be a string and "
                              f"weight_version a string or null: {raw[:300]}")
  return path, wv


def check_update_weights_reply(reply: Any, *, status: int, raw: str, url: str,
                               model_path: str) -> None:
  """Raises ServerRequestError (the server's message) unless an /update_weights_from_disk
  reply (200, or 400 with SGLang's reason) reports success."""
  if status != 200 or not isinstance(reply, dict) or reply.get("success") is not True:
    msg = reply.get("message") if isinstance(reply, dict) else raw[:300]
    raise ServerRequestError(f"{url}/update_weights_from_disk {model_path}: {msg}", status)


def loads_used_tokens(reply: Any) -> int:
  """The KV tokens a /v1/loads reply counts in use (summed over its `loads` entries).
  Raises KeyError, TypeError or ValueError for a reply of another shape."""
  return sum(int(l["num_total_tokens"]) for l in reply["loads"])


def error_message(parsed: Any, raw: str) -> str:
  """The server's message of an error reply (`{"error": {"message": ...}}` or
  `{"error": ...}`), else the reply's first 500 characters."""
  msg = raw[:500]
  if isinstance(parsed, dict) and "error" in parsed:
    err = parsed["error"]
    msg = err.get("message", msg) if isinstance(err, dict) else str(err)
  return msg


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

