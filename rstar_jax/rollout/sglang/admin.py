"""The SGLang client's admin calls and server checks, over one server's `Connection`.

Admin calls: `/abort_request`, `/flush_cache` (retried while it answers 400: requests
still running), `/pause_generation`, `/continue_generation`,
`/update_weights_from_disk` (with `weight_version`), `/model_info` (confirms it),
`/health`, `/server_info` (`max_req_input_len`: the length limit; KV capacity;
`enable_deterministic_inference` where the config requires it) and `/v1/loads` (the server's
used KV tokens, which the engine polls for the scheduler's `free_kv_tokens`).

Checks:
  * on start-up (and after each weight update) the server's model is checked against
    the trainer's: model type and, when the server's `model_path/config.json` is
    readable here (shared storage), vocabulary size and shapes; every returned token
    id must be inside the vocabulary. A mismatch raises `ServerMismatchError`.
  * a server whose `--preferred-sampling-params` (its /model_info) would fill a
    sampling key the client leaves out with a non-default value is refused at connect
    (`ServerMismatchError`): it would change the sampling distribution silently.
  * `ClientConfig.require_deterministic`: a server not running SGLang's deterministic
    inference is refused (`ServerMismatchError`).

These functions hold no state: what they learn comes back as `ServerFacts` / `ModelFacts`,
and the engine (`sglang.engine`) keeps it, takes servers out of rotation, probes them back
and orders a weight update's pause, load and continue around its requests in flight.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from typing import Any, Mapping

from absl import logging

from rstar_jax.rollout.sglang.transport import Connection, RequestTimedOut, ServerUnreachable
from rstar_jax.rollout.sglang.wire import (DETERMINISTIC_KEY, SGLangError, ServerMismatchError,
                                           abort_body, check_preferred_sampling,
                                           check_update_weights_reply, continue_body,
                                           loads_used_tokens, parse_model_info, parse_server_info,
                                           pause_body, update_weights_body)

# The HF config.json fields a served model must share with the trainer's (where both state them).
MODEL_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "tie_word_embeddings")


@dataclasses.dataclass(frozen=True)
class ModelFacts:
  """What /model_info (and the served config.json, where readable) says of the model.

  Attributes:
    info: the /model_info reply.
    weight_version: the weights it holds (None: not stated).
    vocab_size: from the served config.json; None where not readable here.
  """
  info: dict[str, Any]
  weight_version: str | None
  vocab_size: int | None


@dataclasses.dataclass(frozen=True)
class ServerFacts:
  """A checked server: its length limit (input + output tokens), KV capacity and model."""
  max_len: int
  capacity: int
  model: ModelFacts


# ---- Checks ----------------------------------------------------------------------
async def wait_until_healthy(conn: Connection, *, wait: bool) -> None:
  """/health answers 200. `wait`: keeps asking up to `startup_timeout_s` (then SGLangError);
  otherwise one failed answer raises ServerUnreachable."""
  deadline = time.monotonic() + conn.config.startup_timeout_s
  delay = conn.config.backoff_s
  while True:
    try:
      status, _, _ = await conn.exchange("GET", "/health", timeout=30)
      if status == 200:
        return
      why = f"HTTP {status}"
    except (ServerUnreachable, RequestTimedOut) as e:
      why = str(e)
    if not wait:
      raise ServerUnreachable(f"/health: {why}")
    if time.monotonic() > deadline:
      raise SGLangError(f"{conn.url}: no healthy answer from /health within "
                        f"{conn.config.startup_timeout_s} s (last: {why})")
    await asyncio.sleep(delay)
    delay = min(delay * 2, conn.config.backoff_max_s)


async def handshake(conn: Connection, *, wait: bool,
                    expected_model: Mapping[str, Any]) -> ServerFacts:
  """/health (waiting up to startup_timeout_s when `wait`), /server_info, /model_info."""
  await wait_until_healthy(conn, wait=wait)
  status, info, raw = await conn.exchange("GET", "/server_info", timeout=30)
  ctx, total = parse_server_info(info, status=status, raw=raw, url=conn.url)
  if conn.config.require_deterministic and info.get(DETERMINISTIC_KEY) is not True:
    raise ServerMismatchError(
        f"{conn.url}: rollout.client.require_deterministic asks for reproducible rollouts, "
        f"but the server's /server_info reports {DETERMINISTIC_KEY}="
        f"{info.get(DETERMINISTIC_KEY, 'absent')!r}: its tokens and log-probs would depend "
        f"on what shares its batches; relaunch it with --enable-deterministic-inference "
        f"(SGLang >= 0.5.3; our rollout server takes the same flag)")
  model = await check_model(conn, expected_model)
  return ServerFacts(max_len=ctx, capacity=total if total is not None else ctx, model=model)


async def check_model(conn: Connection, expected_model: Mapping[str, Any]) -> ModelFacts:
  """/model_info, checked against the trainer's HF config fields (`expected_model`)."""
  status, info, raw = await conn.exchange("GET", "/model_info", timeout=30)
  path, wv = parse_model_info(info, status=status, raw=raw, url=conn.url)
  if info.get("is_generation") is False:
    raise ServerMismatchError(f"{conn.url}: serves a non-generation model ({path})")
  check_preferred_sampling(conn.url, info)
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
  elif expected_model:
    logging.warning("sglang: %s serves %s, which is not readable here: vocabulary and "
                    "shapes not verified (token ids are still range-checked)", conn.url, path)
  diff = {k: (served[k], expected_model[k]) for k in MODEL_KEYS
          if k in served and k in expected_model and served[k] != expected_model[k]}
  if diff:
    raise ServerMismatchError(
        f"{conn.url} serves {path}, which does not match the trainer's model: " + ", ".join(
            f"{k}={a!r} (trainer: {b!r})" for k, (a, b) in diff.items()))
  return ModelFacts(info=info, weight_version=wv, vocab_size=served.get("vocab_size"))


async def read_loads(conn: Connection) -> int | None:
  """The KV tokens the server counts in use (/v1/loads); None when it has no such route.
  Raises ServerUnreachable / RequestTimedOut (no reply), or KeyError, TypeError or
  ValueError for a reply of another shape."""
  status, body, _ = await conn.exchange("GET", "/v1/loads", timeout=conn.config.poll_timeout_s)
  if status == 404:
    return None
  return loads_used_tokens(body)


# ---- Admin calls -----------------------------------------------------------------
async def abort(conn: Connection, rid: str) -> None:
  await conn.admin("POST", "/abort_request", abort_body(rid))


async def abort_quietly(conn: Connection, rid: str) -> None:
  """Best effort, once: the server may be gone."""
  try:
    await conn.exchange("POST", "/abort_request", abort_body(rid), timeout=10)
  except Exception:   # whatever went wrong, no caller waits for the answer
    pass


async def flush_cache(conn: Connection) -> None:
  delay = conn.config.backoff_s
  for _ in range(conn.config.flush_retries):
    status, _, raw = await conn.admin("POST", "/flush_cache", ok=(200, 400))
    if status == 200:
      return
    await asyncio.sleep(delay)
    delay = min(delay * 2, conn.config.backoff_max_s)
  raise SGLangError(f"{conn.url}/flush_cache still refused after "
                    f"{conn.config.flush_retries} attempts: {raw[:200]}")


async def pause_generation(conn: Connection, mode: str) -> None:
  await conn.admin("POST", "/pause_generation", pause_body(mode))


async def continue_generation(conn: Connection) -> None:
  await conn.admin("POST", "/continue_generation", continue_body())


async def load_weights(conn: Connection, model_path: str, weight_version: str) -> None:
  """/update_weights_from_disk; raises ServerRequestError unless the server reports success.
  The caller pauses generation around it and confirms the version with `check_model`."""
  status, reply, raw = await conn.admin(
      "POST", "/update_weights_from_disk", update_weights_body(model_path, weight_version),
      ok=(200, 400))
  check_update_weights_reply(reply, status=status, raw=raw, url=conn.url,
                             model_path=model_path)


async def get_loads(conn: Connection) -> dict[str, Any]:
  return (await conn.admin("GET", "/v1/loads"))[1]


async def healthy(conn: Connection) -> bool:
  try:
    return (await conn.exchange("GET", "/health", timeout=10))[0] == 200
  except (ServerUnreachable, RequestTimedOut):
    return False
