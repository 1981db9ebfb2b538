"""The memory budget: memory hogs (one process, many processes, /tmp fillers) next to
benign calls. The server survives, every benign call is right, every hog is stopped."""
from __future__ import annotations

import pytest

from sandbox.client import SyncSandboxClient
from sandbox.launcher import health, running_server

PER_CALL_MB = 512 + 64 + 16
BUDGET_MB = 2400  # 4 calls at once

HOG = "chunks = []\nwhile True:\n  chunks.append(bytearray(64 << 20))"
# Four processes of 150-300 MB: each under its address-space limit, together past the
# call's 592 MB. Only a memory cgroup per call can see that.
FORK_HOG = ("import os, time\nfor _ in range(3):\n  if os.fork() == 0:\n"
            "    x = bytearray(150 << 20)\n    time.sleep(60)\n    os._exit(0)\n"
            "time.sleep(0.5)\ny = bytearray(300 << 20)\nprint('not contained')")
TMP_FILLER = ("import errno\ntry:\n  for i in range(4):\n"
              "    open(f'/tmp/f{i}', 'wb').write(b'x' * (60 << 20))\n"
              "except OSError as e:\n  print(errno.errorcode[e.errno])")


@pytest.mark.parametrize("cgroups", ["auto", "off"])
def test_hogs_next_to_benign_calls(cgroups):
  args = ["--preload", "math,json,time", "--memory-mb", "512", "--tmp-mb", "64", "--shm-mb", "16",
          "--memory-budget-mb", str(BUDGET_MB), "--cgroups", cgroups, "--max-timeout", "120"]
  with running_server(max_children=32, pool_size=2, extra_args=args) as url:
    h = health(url)
    assert h["max_running"] == BUDGET_MB // PER_CALL_MB == 4
    if cgroups == "off":
      assert h["memory"] == "rlimits"
    calls, kinds = [], []
    for i in range(32):
      calls.append({"code": f"print(sum(range({i})))", "timeout": 120})
      kinds.append(("benign", f"{sum(range(i))}\n"))
      hog = [HOG, HOG, FORK_HOG, TMP_FILLER][i % 4]
      calls.append({"code": hog, "timeout": 120})
      kinds.append(({HOG: "hog", FORK_HOG: "fork_hog", TMP_FILLER: "tmp"}[hog], None))
    with SyncSandboxClient([url], max_concurrency=64, batch_size=8) as client:
      results = client.execute(calls)
      stats = client.stats()[url]
    assert health(url)["pid"] == h["pid"] and health(url)["status"] == "ok"
    cgroup_mode = h["memory"].startswith("cgroup")
    for (kind, want), r in zip(kinds, results):
      if kind == "benign":
        assert (r.status, r.stdout) == ("ok", want), r
      elif kind == "hog":
        assert (r.status, r.error_type) == ("memory_exceeded", "MemoryError"), r
      elif kind == "tmp":
        assert (r.status, r.stdout) == ("ok", "ENOSPC\n"), r
      elif cgroup_mode:  # fork_hog: killed by the kernel inside its own cgroup
        assert r.status == "memory_exceeded" and "memory limit of 592 MB" in r.error_message, r
      else:  # without cgroups the sum of processes is not bounded (documented)
        assert r.status in ("ok", "memory_exceeded"), r
    assert stats["statuses"]["internal_error"] == 0 and stats["statuses"]["timeout"] == 0


# Four children of 160 MB each (under the per-process address-space limit), together past
# the call's 592 MB: the kernel kills a child (the parent is the smallest process) and the
# parent goes on to finish cleanly.
CHILD_KILLED = ("import os\npids = []\nfor _ in range(4):\n  pid = os.fork()\n  if pid == 0:\n"
                "    x = b'x' * (160 << 20)\n    import time; time.sleep(30)\n    os._exit(0)\n"
                "  pids.append(pid)\n"
                "import time; time.sleep(3)\nfor pid in pids: os.kill(pid, 9)\n"
                "codes = [os.waitpid(p, 0)[1] for p in pids]\nprint('parent finished')")


def test_a_child_killed_at_the_limit_marks_a_finished_call():
  args = ["--memory-mb", "512", "--tmp-mb", "64", "--shm-mb", "16", "--cgroups", "auto"]
  with running_server(max_children=4, pool_size=1, extra_args=args) as url:
    if not health(url)["memory"].startswith("cgroup"):
      pytest.skip("no memory cgroups on this machine")
    with SyncSandboxClient([url]) as client:
      r, ok = client.execute([{"code": CHILD_KILLED, "timeout": 60}, {"code": "print(1)"}])
  assert (r.status, r.stdout, r.exit_code) == ("memory_exceeded", "parent finished\n", 0), r
  assert "killed one of its processes" in r.error_message, r
  assert (ok.status, ok.stdout) == ("ok", "1\n"), ok
