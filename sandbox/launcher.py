"""Start a real sandbox server in a subprocess, for tests and notebooks.

    from sandbox.launcher import running_server
    with running_server(max_children=8) as url:   # e.g. "http://127.0.0.1:40123"
      ...

The server listens on a free loopback port; the context waits until /health says
ok and, on exit, terminates the server and kills every process it left behind. If
the calling process dies without leaving the context (even by SIGKILL), the server
gets SIGTERM from the kernel (PR_SET_PDEATHSIG) and shuts down by itself.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Iterator, Sequence

from sandbox import isolation as isolation_lib
from sandbox.isolation import PKG_DIR

_REPO_ROOT = os.path.dirname(PKG_DIR)
# No proxies, ever: the server is on this machine.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


WEAK_ENV = "SANDBOX_ALLOW_WEAK_ISOLATION"


class SandboxUnavailable(RuntimeError):
  """The local sandbox server cannot run here (no bubblewrap, a refused setting) or did
  not come up; the message says why, in the server's own words where it gave any."""


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def health(url: str, timeout: float = 2.0) -> dict | None:
  """The server's /health answer when it is ok, else None."""
  try:
    with _OPENER.open(f"{url}/health", timeout=timeout) as resp:
      if resp.status == 200:
        return json.loads(resp.read())
  except (urllib.error.URLError, OSError, ValueError):
    pass
  return None


def _descendants(pid: int) -> list[int]:
  children: dict[int, list[int]] = {}
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/stat", "rb") as f:
        stat = f.read()
      ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
      continue
    children.setdefault(ppid, []).append(int(name))
  out, todo = [], [pid]
  while todo:
    for c in children.get(todo.pop(), []):
      out.append(c)
      todo.append(c)
  return out


def _kill_tree(proc: subprocess.Popen, grace: float) -> None:
  tree = _descendants(proc.pid)
  if proc.poll() is None:
    with contextlib.suppress(ProcessLookupError):
      os.killpg(proc.pid, signal.SIGTERM)  # graceful: the server stops its worker
    try:
      proc.wait(grace)
    except subprocess.TimeoutExpired:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  for pid in tree + _descendants(proc.pid):
    with contextlib.suppress(ProcessLookupError, PermissionError):
      os.kill(pid, signal.SIGKILL)


def check_can_start(isolation: str = "auto", allow_weak_isolation: bool | None = None) -> None:
  """Raises SandboxUnavailable when `running_server` with these settings would be refused:
  the server would refuse in the same words, but only once spawned; this says it in the
  caller's process, before anything starts, with how to accept weaker isolation from here.
  allow_weak_isolation None reads SANDBOX_ALLOW_WEAK_ISOLATION=1."""
  if allow_weak_isolation is None:
    allow_weak_isolation = os.environ.get(WEAK_ENV, "") == "1"
  try:
    isolation_lib.check(isolation, allow_weak_isolation)
  except RuntimeError as e:
    raise SandboxUnavailable(
        f"the sandbox server cannot start here: {e}\n"
        f"To accept the weaker isolation for a run started from Python (the recipe, tests, "
        f"notebooks), set {WEAK_ENV}=1 in its environment; it passes --allow-weak-isolation "
        f"to the server.") from None


def _server_error(log_text: str) -> str:
  """The server's own last words: from its last `sandbox.server:` line (how it reports a
  refusal, see sandbox/server.py) or its traceback, else the log's tail."""
  lines = log_text.rstrip().splitlines()
  for marker in ("sandbox.server: ", "Traceback (most recent call last):"):
    starts = [i for i, line in enumerate(lines) if line.startswith(marker)]
    if starts:
      return "\n".join(lines[starts[-1]:])[-3000:]
  return "\n".join(lines)[-3000:] or "(it wrote nothing)"


@contextlib.contextmanager
def running_server(*, max_children: int = 8, pool_size: int = 2, isolation: str = "auto",
                   extra_args: Sequence[str] = (), startup_timeout: float = 120.0,
                   log_path: str | None = None,
                   allow_weak_isolation: bool | None = None) -> Iterator[str]:
  """Runs `python -m sandbox.server` on 127.0.0.1:<free port>; yields its base URL.

  extra_args go to the server's command line (e.g. ["--max-timeout", "30"]).
  The server's log goes to `log_path` (a temporary file when None; its tail is
  in the error if the server does not come up).
  allow_weak_isolation: pass --allow-weak-isolation (start without bubblewrap);
  None reads the environment variable SANDBOX_ALLOW_WEAK_ISOLATION=1.
  """
  if allow_weak_isolation is None:
    allow_weak_isolation = os.environ.get(WEAK_ENV, "") == "1"
  check_can_start(isolation, allow_weak_isolation)
  weak = ["--allow-weak-isolation"] if allow_weak_isolation else []
  own_log = log_path is None
  if own_log:
    fd, log_path = tempfile.mkstemp(prefix="sandbox-server-", suffix=".log")
    os.close(fd)
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, env.get("PYTHONPATH")) if p)
  proc = None
  try:
    exit_code = None
    for _ in range(3):  # the free port may be taken between our probe and the server's bind
      port = free_port()
      url = f"http://127.0.0.1:{port}"
      cmd = [sys.executable, "-m", "sandbox.server", "--host", "127.0.0.1", "--port", str(port),
             "--max-children", str(max_children), "--pool-size", str(pool_size),
             "--isolation", isolation, "--parent-pid", str(os.getpid()), *weak, *extra_args]
      with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=_REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=log, start_new_session=True)
      deadline = time.monotonic() + startup_timeout
      while time.monotonic() < deadline and proc.poll() is None:
        if health(url, timeout=1.0) is not None:
          break
        time.sleep(0.1)
      if proc.poll() is None and health(url) is not None:
        break
      exit_code = proc.poll()
      _kill_tree(proc, 5.0)
      proc = None
      with open(log_path, "rb") as f:
        busy = b"address already in use" in f.read()[-4000:].lower()
      if exit_code is not None and not busy:
        break  # it refused to start: trying other ports will not help
    if proc is None:
      with open(log_path, "rb") as f:
        log_text = f.read().decode(errors="replace")
      if exit_code is not None:
        raise SandboxUnavailable(f"the sandbox server exited at start (exit code {exit_code}): "
                                 f"{_server_error(log_text)}")
      raise SandboxUnavailable(f"the sandbox server did not become healthy within "
                               f"{startup_timeout} s; log tail:\n{log_text[-3000:]}")
    yield url
  finally:
    if proc is not None:
      _kill_tree(proc, 10.0)
    if own_log:
      with contextlib.suppress(OSError):
        os.unlink(log_path)
