"""The rlimits-only fallback (what runs where bubblewrap cannot), and the launcher."""
from __future__ import annotations

import os
import time

import pytest

from sandbox.client import SyncSandboxClient
from sandbox.launcher import _descendants, health, running_server


@pytest.fixture(scope="module")
def fallback():
  with running_server(max_children=8, isolation="rlimits", allow_weak_isolation=True) as url:
    pid = health(url)["pid"]
    tree = [pid] + _descendants(pid)
    with SyncSandboxClient([url]) as client:
      yield url, client, tree
  # Leaving the context killed the whole tree: every process of it ends (a zombie has).
  _until(lambda: not _living(tree), "no process left behind by running_server")


def test_fallback_reports_its_level_and_runs_code(fallback):
  url, client, tree = fallback
  assert len(tree) >= 2  # server and its worker
  expected = "rlimits+uid" if os.geteuid() == 0 else "rlimits"
  assert health(url)["isolation"] == expected
  r = client.execute([{"code": "import sympy\nx = sympy.symbols('x')\nsympy.factor(x**2 - 1)"},
                      {"code": "print(input()[::-1])", "input": "abc"}, "1/0"])
  assert [x.isolation for x in r] == [expected] * 3
  assert (r[0].stdout, r[1].stdout, r[2].error_type) == ("(x - 1)*(x + 1)\n", "cba\n", "ZeroDivisionError")


def test_fallback_contains_loops_memory_and_floods(fallback):
  _, client, _ = fallback
  r = client.execute([{"code": "while True:\n  pass", "timeout": 0.5},
                      {"code": "x = bytearray(10 * 1024**3)"},
                      {"code": "while True:\n  print('y' * 500)"},
                      {"code": "import ctypes\nctypes.string_at(0)"}])
  assert [x.status for x in r] == ["timeout", "memory_exceeded", "output_exceeded", "killed"]
  assert client.execute(["6 * 7"])[0].stdout == "42\n"


def test_fallback_with_own_uid_contains_fork_bomb_and_parent_kill(fallback):
  _, client, _ = fallback
  if os.geteuid() != 0:
    pytest.skip("an own uid per call needs root")
  r = client.execute([
      {"code": "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass",
       "timeout": 1.0},
      {"code": "import os\nos.kill(os.getppid(), 9)"},
      {"code": "open('/etc/passwd', 'a')"}])
  assert [x.status for x in r] == ["timeout", "error", "error"]
  assert r[1].error_type == "PermissionError" and r[2].error_type == "PermissionError"
  assert client.execute(["6 * 7"])[0].stdout == "42\n"


def test_a_dead_worker_is_restarted(fallback):
  url, client, _ = fallback
  server = health(url)["pid"]
  def parent(pid):
    try:
      return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except OSError:  # a call's child that just ended
      return None

  workers = [p for p in _descendants(server) if parent(p) == server]
  assert len(workers) == 1  # the warm parent is the server's only child
  os.kill(workers[0], 9)
  while True:   # no deadline: a restart on a loaded host is slow, not wrong
    results = client.execute(["print('back')"])
    if results[0].status == "ok":
      break
    assert results[0].status == "internal_error"  # while it restarts, never a wrong answer
    time.sleep(0.2)
  assert results[0].stdout == "back\n"


def _start_refused(args, env=None):
  import subprocess
  import sys
  from sandbox.launcher import _REPO_ROOT, free_port
  return subprocess.run([sys.executable, "-m", "sandbox.server", "--port", str(free_port()), *args],
                        cwd=_REPO_ROOT, env=env, capture_output=True, text=True)


def test_weak_isolation_needs_the_flag():
  p = _start_refused(["--isolation", "rlimits"])
  assert p.returncode != 0 and "--allow-weak-isolation" in p.stderr
  assert "world-readable" in p.stderr  # it says what weak isolation gives up
  # auto on a host without bubblewrap (no bwrap on PATH) refuses too, and says how to get it.
  import sys
  env = dict(os.environ, PATH=os.path.dirname(sys.executable))
  p = _start_refused(["--isolation", "auto"], env=env)
  assert p.returncode != 0 and "apt-get install -y bubblewrap" in p.stderr
  assert "--allow-weak-isolation" in p.stderr


def test_the_launcher_without_bubblewrap_refuses_at_once_naming_the_fix(monkeypatch):
  """A fresh machine's first run: no bwrap on PATH, weak isolation not asked for. The
  launcher says why and how to fix it, without spawning a server: a huge start-up timeout
  shows it did not wait for one."""
  import subprocess
  import sys
  from sandbox.launcher import SandboxUnavailable
  monkeypatch.setenv("PATH", os.path.dirname(sys.executable))
  monkeypatch.delenv("SANDBOX_ALLOW_WEAK_ISOLATION", raising=False)
  spawned = []
  real_popen = subprocess.Popen

  def popen(cmd, *a, **kw):
    if "sandbox.server" in cmd:
      spawned.append(cmd)
    return real_popen(cmd, *a, **kw)

  monkeypatch.setattr(subprocess, "Popen", popen)
  with pytest.raises(SandboxUnavailable) as e:
    with running_server(max_children=2, pool_size=0, startup_timeout=10**6):
      pass
  message = str(e.value)
  assert spawned == []
  assert "bwrap is not installed" in message
  assert "apt-get install -y bubblewrap" in message
  assert "SANDBOX_ALLOW_WEAK_ISOLATION=1" in message and "--allow-weak-isolation" in message
  assert "world-readable" in message   # what the weaker isolation gives up
  assert "healthy" not in message


def test_a_server_that_exits_at_start_is_reported_in_its_own_words():
  """The server refuses a setting the launcher does not check: its exit ends the wait (the
  start-up timeout is far beyond any run), and the error is the server's own message."""
  from sandbox.launcher import SandboxUnavailable
  with pytest.raises(SandboxUnavailable) as e:
    with running_server(max_children=2, pool_size=0, isolation="rlimits",
                        allow_weak_isolation=True, startup_timeout=10**6,
                        extra_args=["--memory-mb", "-5"]):
      pass
  message = str(e.value)
  assert message.startswith("the sandbox server exited at start (exit code 1): sandbox.server: ")
  assert "memory" in message
  assert "healthy" not in message


def test_fallback_closes_network_shm_and_daemon_holes():
  if os.geteuid() != 0:
    pytest.skip("the fallback closes these holes only as root")
  import signal
  with running_server(max_children=4, isolation="rlimits", allow_weak_isolation=True,
                      extra_args=["--preload", "math,json,time,socket,encodings.idna"]) as url:
    h = health(url)
    assert h["private_net"] and h["private_tmp"]
    port = int(url.rsplit(":", 1)[1])
    with SyncSandboxClient([url]) as client:
      net, shm1, shm2, daemon = client.execute([
          {"code": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)"},
          {"code": "open('/dev/shm/left', 'w').write('x')\nimport os\nprint(os.listdir('/dev/shm'))"},
          {"code": "import os\nprint(os.listdir('/dev/shm'))"},
          {"code": "import os, time\nr, w = os.pipe()\nif os.fork() == 0:\n  os.setsid()\n"
                   "  if os.fork() == 0:\n    os.write(w, str(os.getpid()).encode())\n"
                   "    time.sleep(120)\n  os._exit(0)\nprint(os.read(r, 20).decode())"}])
    assert net.status == "error" and net.error_type in ("OSError", "ConnectionRefusedError"), net
    assert (shm1.stdout, shm2.stdout) == ("['left']\n", "[]\n")
    assert not os.path.exists("/dev/shm/left")
    pid = int(daemon.stdout)
    # The call's end already swept its uid; a daemon of a call still running when the
    # server is SIGKILLed is swept by the warm parent as it goes (parent-death signal).
    holder = {"code": "import os, time\nif os.fork() == 0:\n  os.setsid()\n  time.sleep(120)\n"
                      "print(os.getpid(), flush=True)\ntime.sleep(120)", "timeout": 60}
    import threading
    from sandbox.client import SyncSandboxClient as Sync
    with Sync([url], max_retries=0) as c2:
      t = threading.Thread(target=c2.execute, args=([holder],), daemon=True)
      t.start()
      victims = []

      def holder_started():
        victims[:] = [p for p in _descendants(h["pid"]) if _uid(p) >= 1 << 20]
        return bool(victims)
      _until(holder_started, "the holder call's processes")
      os.kill(h["pid"], signal.SIGKILL)
      orphans = set(victims)
      _until(lambda: not _living(orphans | {pid}), "the daemons swept with the server")


def _until(pred, what: str) -> None:
  """Polls until pred() holds (`what` names it for a reader of a hang's stack). No deadline:
  a loaded host is slow, not wrong; pytest-timeout (pytest.ini) ends a hang with every
  thread's stack."""
  while not pred():
    time.sleep(0.05)


def _uid(pid):
  try:
    with open(f"/proc/{pid}/status") as f:
      return int(next(l for l in f if l.startswith("Uid:")).split()[1])
  except (OSError, StopIteration):
    return -1


def _living(pids):
  out = set()
  for p in pids:
    try:
      with open(f"/proc/{p}/stat") as f:
        if f.read().rsplit(")", 1)[1].split()[0] != "Z":
          out.add(p)
    except OSError:
      pass
  return out
