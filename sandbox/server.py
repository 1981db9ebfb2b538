"""HTTP front of one executor: `python -m sandbox.server --host --port --max-children`.

Endpoints (JSON):
  POST /execute         {"calls": [{"code", "input"?, "timeout"?, "session_id"?}, ...]}
                        -> {"results": [Result, ...]} in the same order. 400 names the bad call.
  POST /sessions/close  {"session_ids": [...]} -> {"closed": [...]}
  GET  /health          200 {"status": "ok", ...} or 503 while the worker is (re)starting
  GET  /stats           calls, statuses, latency percentiles, queue depth, sessions
Per-call failures (timeouts, crashes, even a dead worker) are statuses inside a
200 answer; 5xx only means no call was run, so a client may safely retry it.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from aiohttp import web

from sandbox.config import ExecutorConfig
from sandbox.executor import Executor
from sandbox.schema import Call

log = logging.getLogger("sandbox")

MAX_BATCH = 4096
_EXECUTOR = web.AppKey("executor", Executor)


def _bad(message: str) -> web.Response:
  return web.json_response({"error": message}, status=400)


async def _execute(request: web.Request) -> web.Response:
  ex = request.app[_EXECUTOR]
  try:
    body = await request.json()
  except ValueError as e:
    return _bad(f"request body is not JSON: {e}")
  if not isinstance(body, dict) or not isinstance(body.get("calls"), list):
    return _bad("request body must be an object with a list field 'calls'")
  raw = body["calls"]
  if len(raw) > MAX_BATCH:
    return _bad(f"too many calls in one request: {len(raw)} > {MAX_BATCH}")
  calls = []
  for i, obj in enumerate(raw):
    try:
      call = Call.from_obj(obj, where=f"calls[{i}]")
      ex.validate(call)
    except ValueError as e:
      return _bad(str(e) if str(e).startswith("calls[") else f"calls[{i}]: {e}")
    calls.append(call)
  if not ex.healthy:
    return web.json_response({"error": "sandbox worker is not ready"}, status=503)
  results = await asyncio.gather(*(ex.run(c) for c in calls))
  return web.json_response({"results": [r.to_dict() for r in results]})


async def _close_sessions(request: web.Request) -> web.Response:
  ex = request.app[_EXECUTOR]
  try:
    body = await request.json()
  except ValueError as e:
    return _bad(f"request body is not JSON: {e}")
  ids = body.get("session_ids") if isinstance(body, dict) else None
  if not isinstance(ids, list) or not all(isinstance(s, str) for s in ids):
    return _bad("request body must be an object with a list of strings 'session_ids'")
  closed = [sid for sid in ids if await ex.close_session(sid)]
  return web.json_response({"closed": closed})


async def _health(request: web.Request) -> web.Response:
  ex = request.app[_EXECUTOR]
  info = ex.info() | {"pid": os.getpid()}
  if ex.healthy:
    return web.json_response({"status": "ok", **info})
  return web.json_response({"status": "unavailable", **info}, status=503)


async def _stats(request: web.Request) -> web.Response:
  return web.json_response(request.app[_EXECUTOR].snapshot())


def make_app(executor: Executor) -> web.Application:
  """The aiohttp application; the executor is started and closed with it."""
  app = web.Application(client_max_size=256 << 20)
  app[_EXECUTOR] = executor

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
  web.run_app(app, host=args.host, port=args.port, print=None, access_log=None,
              handle_signals=True)


if __name__ == "__main__":
  signal.signal(signal.SIGPIPE, signal.SIG_IGN)
  main()
