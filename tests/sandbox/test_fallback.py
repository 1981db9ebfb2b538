"""The rlimits-only fallback (what runs where bubblewrap cannot), and the launcher."""
from __future__ import annotations

import os
import time

import pytest

from sandbox.client import SyncSandboxClient
from sandbox.launcher import _descendants, health, running_server


@pytest.fixture(scope="module")
def fallback():
  with running_server(max_children=8, isolation="rlimits") as url:
    pid = health(url)["pid"]
    tree = [pid] + _descendants(pid)
    with SyncSandboxClient([url]) as client:
      yield url, client, tree
  # Leaving the context killed the whole tree.
  deadline = time.monotonic() + 10
  while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in tree):
    time.sleep(0.05)
  leftover = [p for p in tree if os.path.exists(f"/proc/{p}")
              and open(f"/proc/{p}/stat").read().split()[2] != "Z"]
  assert not leftover, f"processes left behind by running_server: {leftover}"


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
  deadline = time.monotonic() + 60
  results = []
  while time.monotonic() < deadline:
    results = client.execute(["print('back')"])
    if results[0].status == "ok":
      break
    assert results[0].status == "internal_error"  # while it restarts, never a wrong answer
    time.sleep(0.2)
  assert results[0].stdout == "back\n"
