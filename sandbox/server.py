"""HTTP front of one executor: `python -m sandbox.server --host --port --max-children`.

Endpoints (JSON):
  POST /execute         {"calls": [{"code", "input"?, "timeout"?, "session_id"?}, ...]}
                        -> {"results": [Result, ...]} in the same order. 400 names the bad call.
  POST /sessions/close  {"session_ids": [...]} -> {"closed": [...]}
  GET  /health          200 {"status": "ok", ...} or 503 while the worker is (re)starting
  GET  /stats           calls, statuses, latency percentiles, queue depth, sessions
Per-call failures (timeouts, crashes, even a dead worker) are statuses inside a
200 answer; 4xx/5xx mean no call was run (5xx: retry later). A call with an `id`
runs at most once per server: the same id again gets the stored result.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import json
import logging
import os
import signal
import sys
import time
import uuid

from aiohttp import web

from sandbox.config import ExecutorConfig
from sandbox.executor import Executor
from sandbox.schema import Call, Result

log = logging.getLogger("sandbox")

_EXECUTOR = web.AppKey("executor", Executor)
_RECENT = web.AppKey("recent", "RecentResults")
INSTANCE = uuid.uuid4().hex  # this server process; a restarted server has a new one


class RequestError(Exception):
  """A request the server refuses before running anything: HTTP `status` + message."""

  def __init__(self, status: int, message: str):
    super().__init__(message)
    self.status = status


def _error(status: int, message: str) -> web.Response:
  return web.json_response({"error": message, "instance": INSTANCE}, status=status)


def _no_constant(name: str):
  raise ValueError(f"{name} is not valid JSON (use a finite number)")


async def _read_object(request: web.Request, known: dict[str, type]) -> dict:
  """The request's JSON object, or RequestError naming what is wrong with it.

  Content-Type must be application/json (utf-8); the body must arrive within
  client_timeout and fit max_body_mb; keys outside `known` are refused.
  """
  cfg = request.app[_EXECUTOR].config
  ctype = request.headers.get("Content-Type")
  if ctype is None:
    raise RequestError(415, "missing Content-Type; send the body as application/json")
  if request.content_type != "application/json":
    raise RequestError(415, f"Content-Type must be application/json, got {ctype[:100]!r}")
  encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
  if encoding not in ("identity", "gzip", "deflate"):
    raise RequestError(415, f"Content-Encoding must be gzip, deflate or none, got "
                            f"{encoding[:40]!r}")
  charset = request.charset
  if charset is not None and charset.lower().replace("_", "-") not in ("utf-8", "utf8"):
    raise RequestError(415, f"the body must be UTF-8 JSON, got charset={charset[:40]!r}")
  limit = cfg.max_body_mb << 20
  if request.content_length is not None and request.content_length > limit:
    raise RequestError(413, f"request body of {request.content_length} bytes exceeds the "
                            f"server's limit of {limit} bytes (--max-body-mb {cfg.max_body_mb})")
  try:
    raw = await asyncio.wait_for(request.read(), cfg.client_timeout)
  except asyncio.TimeoutError:
    raise RequestError(408, f"the request body did not arrive within {cfg.client_timeout:g} s "
                            "(--client-timeout)") from None
  except web.HTTPRequestEntityTooLarge:
    raise RequestError(413, f"request body exceeds the server's limit of {limit} bytes "
                            f"(--max-body-mb {cfg.max_body_mb})") from None
  except Exception as e:  # e.g. a gzip / deflate stream that does not decompress
    raise RequestError(400, f"cannot read the request body ({type(e).__name__}: "
                            f"{str(e)[:200]})") from None
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise RequestError(400, f"request body is not UTF-8: {e}") from None
  try:
    body = json.loads(text, parse_constant=_no_constant)
  except RecursionError:
    raise RequestError(400, "request body is nested too deeply") from None
  except ValueError as e:  # also: integers past sys.get_int_max_str_digits() digits
    raise RequestError(400, f"request body is not valid JSON: {str(e)[:300]}") from None
  if not isinstance(body, dict):
    raise RequestError(400, f"request body must be a JSON object, got {type(body).__name__}")
  unknown = set(body) - set(known)
  if unknown:
    names = sorted(k if len(k) <= 40 else k[:40] + "..." for k in unknown)
    raise RequestError(400, f"unknown field(s) {names} in the request body; "
                            f"known: {', '.join(sorted(known))}")
  for key, kind in known.items():
    if key in body and not isinstance(body[key], kind):
      raise RequestError(400, f"field {key!r} must be a {kind.__name__}, "
                              f"got {type(body[key]).__name__}")
  return body


class RecentResults:
  """Calls by id, running or done: a retried id is answered from here, never re-run.

  Entries live `ttl` seconds after they finish and are dropped oldest first beyond
  `max_bytes` of stored output. A dropped id that comes again runs again: keep the
  ttl above the client's longest retry window.
  """

  def __init__(self, ttl: float, max_bytes: int):
    self.ttl, self.max_bytes = ttl, max_bytes
    self.running: dict[str, tuple[asyncio.Future, str]] = {}
    # In the order they finished: a long call still running holds no finished one back.
    self.finished: collections.OrderedDict[str, tuple[asyncio.Future, str]] = (
        collections.OrderedDict())
    self.done_at: dict[str, float] = {}
    self.sizes: dict[str, int] = {}
    self.bytes = 0
    self.replayed = 0

  def get(self, call_id: str) -> tuple[asyncio.Future, str] | None:
    self._expire()
    return self.running.get(call_id) or self.finished.get(call_id)

  def add(self, call_id: str, task: asyncio.Future, fingerprint: str) -> None:
    self.running[call_id] = (task, fingerprint)
    task.add_done_callback(lambda t: self._done(call_id, t))

  def _done(self, call_id: str, task: asyncio.Future) -> None:
    entry = self.running.pop(call_id, None)
    if entry is None or task.cancelled():
      return
    r = task.result()
    size = 512 + len(r.stdout) + len(r.stderr) + len(r.error_message or "")
    self.finished[call_id] = entry
    self.sizes[call_id] = size
    self.bytes += size
    self.done_at[call_id] = time.monotonic()
    self._expire()

  def _expire(self) -> None:
    now = time.monotonic()
    while self.finished:
      oldest = next(iter(self.finished))
      if now - self.done_at[oldest] < self.ttl and self.bytes <= self.max_bytes:
        break
      del self.finished[oldest]
      del self.done_at[oldest]
      self.bytes -= self.sizes.pop(oldest)

  def __len__(self) -> int:
    return len(self.running) + len(self.finished)


def _fingerprint(call: Call) -> str:
  d = call.to_dict()
  d.pop("id", None)
  return hashlib.blake2b(json.dumps(d, sort_keys=True).encode("utf-8", "surrogatepass"),
                         digest_size=16).hexdigest()


async def _run_one(ex: Executor, call: Call) -> Result:
  """Runs an accepted call; whatever goes wrong becomes this call's result, never a 500."""
  try:
    result = await ex.run(call)
  except Exception as e:  # noqa: BLE001: a bug here must not fail (and re-run) the batch
    log.exception("call %s failed inside the server", call.id)
    result = Result.internal_error(f"the sandbox server failed on this call: {type(e).__name__}: "
                                   f"{str(e)[:300]}", isolation=ex.isolation)
  result.call_id = call.id
  return result


async def _execute(request: web.Request) -> web.Response:
  ex = request.app[_EXECUTOR]
  recent = request.app[_RECENT]
  try:
    body = await _read_object(request, {"calls": list, "expect_instance": str})
    raw = body.get("calls")
    if raw is None:
      raise RequestError(400, "request body must be an object with a list field 'calls'")
    if len(raw) > ex.config.max_batch:
      raise RequestError(400, f"too many calls in one request: {len(raw)} > {ex.config.max_batch} "
                              "(--max-batch)")
    if body.get("expect_instance", INSTANCE) != INSTANCE:
      # The client retries a request whose answer it lost, but this is a restarted server:
      # what the old one accepted may have run. Nothing runs; the client reports them.
      raise RequestError(409, "this server restarted since the request was first sent "
                              f"(instance {INSTANCE}); its calls may have run and are not re-run")
    calls: list[Call] = []
    seen: set[str] = set()
    for i, obj in enumerate(raw):
      where = f"calls[{i}]"
      if not isinstance(obj, dict):
        raise RequestError(400, f"{where}: expected an object, got {type(obj).__name__}")
      try:
        call = Call.from_obj(obj, where=where)
        ex.validate(call)
      except ValueError as e:
        raise RequestError(400, str(e) if str(e).startswith(where) else f"{where}: {e}") from None
      except (TypeError, ArithmeticError, RecursionError) as e:  # a case the checks missed
        log.exception("validating %s", where)
        raise RequestError(400, f"{where}: invalid call ({type(e).__name__}: {str(e)[:200]})") from None
      if call.id is not None:
        if call.id in seen:
          raise RequestError(400, f"{where}: id {call.id!r} appears twice in this request")
        seen.add(call.id)
        known = recent.get(call.id)
        if known is not None and known[1] != _fingerprint(call):
          raise RequestError(409, f"{where}: id {call.id!r} was already used for a different call")
      calls.append(call)
    fresh = [c for c in calls if c.id is None or recent.get(c.id) is None]
    if fresh and not ex.healthy:
      raise RequestError(503, "sandbox worker is not ready; nothing was run")
  except RequestError as e:
    return _error(e.status, str(e))
  # Accepted: from here every call has a result, and the answer is a 200.
  tasks = []
  for call in calls:
    known = recent.get(call.id) if call.id is not None else None
    if known is not None:
      recent.replayed += 1
      tasks.append(known[0])
      continue
    task = asyncio.ensure_future(_run_one(ex, call))
    if call.id is not None:
      recent.add(call.id, task, _fingerprint(call))
    tasks.append(task)
  # shield: a client that goes away does not stop its calls; their results stay for a retry.
  results = await asyncio.gather(*(asyncio.shield(t) for t in tasks))
  return web.json_response({"results": [r.to_dict() for r in results], "instance": INSTANCE})


async def _close_sessions(request: web.Request) -> web.Response:
  ex = request.app[_EXECUTOR]
  try:
    body = await _read_object(request, {"session_ids": list})
    ids = body.get("session_ids")
    if ids is None or not all(isinstance(s, str) for s in ids):
      raise RequestError(400, "request body must be an object with a list of strings 'session_ids'")
  except RequestError as e:
    return _error(e.status, str(e))
  closed = [sid for sid in ids if await ex.close_session(sid)]
  return web.json_response({"closed": closed})


async def _health(request: web.Request) -> web.Response:
  ex = request.app[_EXECUTOR]
  info = ex.info() | {"pid": os.getpid(), "instance": INSTANCE}
  if ex.healthy:
    return web.json_response({"status": "ok", **info})
  return web.json_response({"status": "unavailable", **info}, status=503)


async def _stats(request: web.Request) -> web.Response:
  recent = request.app[_RECENT]
  return web.json_response(request.app[_EXECUTOR].snapshot()
                           | {"instance": INSTANCE, "replayed": recent.replayed,
                              "remembered_ids": len(recent)})


def make_app(executor: Executor) -> web.Application:
  """The aiohttp application; the executor is started and closed with it."""
  cfg = executor.config
  # The body limit is also checked in _read_object (with a clearer message).
  app = web.Application(client_max_size=cfg.max_body_mb << 20)
  app[_EXECUTOR] = executor
  app[_RECENT] = RecentResults(cfg.result_ttl, cfg.result_cache_mb << 20)

  async def lifespan(app):
    await executor.start()
    yield
    await executor.close()

  app.cleanup_ctx.append(lifespan)
  app.add_routes([web.post("/execute", _execute), web.post("/sessions/close", _close_sessions),
                  web.get("/health", _health), web.get("/stats", _stats)])
  return app


def _exit_with_parent(parent_pid: int) -> None:
  """SIGTERM (a graceful stop) when the launching process dies, even by SIGKILL."""
  import ctypes
  pr_set_pdeathsig = 1
  ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
  if os.getppid() != parent_pid:  # it died before the prctl
    raise SystemExit("sandbox.server: parent process is gone")


def parse_args(argv=None) -> argparse.Namespace:
  d = ExecutorConfig()
  p = argparse.ArgumentParser(prog="python -m sandbox.server", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
  p.add_argument("--port", type=int, default=8321)
  p.add_argument("--max-children", type=int, default=d.max_children,
                 help="calls running at once; more queue")
  p.add_argument("--pool-size", type=int, default=d.pool_size, help="children forked ahead of demand")
  p.add_argument("--isolation", choices=("auto", "bwrap", "rlimits"), default=d.isolation)
  p.add_argument("--default-timeout", type=float, default=d.default_timeout)
  p.add_argument("--max-timeout", type=float, default=d.max_timeout)
  p.add_argument("--memory-mb", type=int, default=d.memory_mb, help="address-space limit per call")
  p.add_argument("--tmp-mb", type=int, default=d.tmp_mb, help="size of each call's private /tmp")
  p.add_argument("--shm-mb", type=int, default=d.shm_mb, help="size of each call's private /dev/shm")
  p.add_argument("--memory-budget-mb", type=int, default=d.memory_budget_mb,
                 help="memory of all running calls together (0: 75%% of the host's)")
  p.add_argument("--cgroups", choices=("auto", "off"), default=d.cgroups,
                 help="per-call memory cgroups where the host allows (else admission control)")
  p.add_argument("--max-body-mb", type=int, default=d.max_body_mb, help="largest request body")
  p.add_argument("--max-batch", type=int, default=d.max_batch, help="most calls in one request")
  p.add_argument("--client-timeout", type=float, default=d.client_timeout,
                 help="seconds a client has to send a request's headers and body")
  p.add_argument("--start-timeout", type=float, default=d.start_timeout,
                 help="seconds for the warm parent to start, and the longest a call waits "
                      "for a process to take it")
  p.add_argument("--result-ttl", type=float, default=d.result_ttl,
                 help="seconds a call's result is kept for a retry of its id")
  p.add_argument("--result-cache-mb", type=int, default=d.result_cache_mb,
                 help="most stored output kept for retries")
  p.add_argument("--allow-weak-isolation", action="store_true",
                 help="start even without bubblewrap (rlimits and uids only; see README)")
  p.add_argument("--max-output-bytes", type=int, default=d.max_output_bytes, help="per stream")
  p.add_argument("--max-processes", type=int, default=d.max_processes)
  p.add_argument("--max-sessions", type=int, default=d.max_sessions)
  p.add_argument("--session-ttl", type=float, default=d.session_ttl)
  p.add_argument("--nice", type=int, default=d.nice, help="niceness of the calls (absolute)")
  p.add_argument("--supervisor-nice", type=int, default=d.supervisor_nice,
                 help="niceness of the server and warm parent (applied when root)")
  p.add_argument("--preload", default=",".join(d.preload),
                 help="comma-separated modules the warm parent imports (default: numpy, sympy, "
                      "scipy and common stdlib); fewer make each fork cheaper")
  p.add_argument("--parent-pid", type=int, default=0,
                 help="exit (gracefully) when this process, our parent, dies; used by "
                      "sandbox.launcher so a killed test run leaves no server behind")
  p.add_argument("--log-level", default="INFO")
  return p.parse_args(argv)


def main(argv=None) -> None:
  args = parse_args(argv)
  logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                      format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  try:
    config = ExecutorConfig(
        max_children=args.max_children, pool_size=args.pool_size, isolation=args.isolation,
        default_timeout=args.default_timeout, max_timeout=args.max_timeout,
        memory_mb=args.memory_mb, max_output_bytes=args.max_output_bytes,
        tmp_mb=args.tmp_mb, shm_mb=args.shm_mb, memory_budget_mb=args.memory_budget_mb,
        cgroups=args.cgroups, max_body_mb=args.max_body_mb, max_batch=args.max_batch,
        client_timeout=args.client_timeout, result_ttl=args.result_ttl,
        start_timeout=args.start_timeout,
        result_cache_mb=args.result_cache_mb, allow_weak_isolation=args.allow_weak_isolation,
        max_processes=args.max_processes, max_sessions=args.max_sessions,
        session_ttl=args.session_ttl, nice=args.nice, supervisor_nice=args.supervisor_nice,
        preload=tuple(m.strip() for m in args.preload.split(",") if m.strip()))
  except ValueError as e:
    raise SystemExit(f"sandbox.server: {e}") from None
  if args.parent_pid:
    _exit_with_parent(args.parent_pid)
  app = make_app(Executor(config))
  log.info("sandbox server on http://%s:%d (max_children=%d)", args.host, args.port,
           args.max_children)
  # run_app turns SIGTERM/SIGINT into a graceful shutdown that closes the executor.
  # keepalive_timeout also bounds how long a new connection may take to send its headers.
  try:
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None,
                handle_signals=True, keepalive_timeout=config.client_timeout)
  except RuntimeError as e:  # isolation refused, worker could not start: say why, no traceback
    raise SystemExit(f"sandbox.server: {e}") from None


if __name__ == "__main__":
  signal.signal(signal.SIGPIPE, signal.SIG_IGN)
  main()
