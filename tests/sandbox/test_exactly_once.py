"""The client's retry path against real servers, one of them killed mid-batch:
nothing runs twice, nothing is lost, and the killed server leaves nothing behind."""
from __future__ import annotations

import asyncio
import os
import signal
import time

from sandbox.client import SandboxClient
from sandbox.launcher import _descendants, health, running_server

LIGHT = ["--preload", "math,json,time", "--max-timeout", "60"]


def _alive(pids):
  out = []
  for p in pids:
    try:
      with open(f"/proc/{p}/stat") as f:
        if f.read().rsplit(")", 1)[1].split()[0] != "Z":
          out.append(p)
    except OSError:
      pass
  return out


def test_server_killed_mid_batch_nothing_runs_twice():
  n = 32
  calls = [{"code": f"import time\ntime.sleep(1.5)\nprint({i})", "timeout": 60} for i in range(n)]
  with running_server(max_children=16, pool_size=1, extra_args=LIGHT) as a_url, \
       running_server(max_children=16, pool_size=1, extra_args=LIGHT) as b_url:
    a_pid = health(a_url)["pid"]
    a_tree = [a_pid] + _descendants(a_pid)

    async def main():
      async with SandboxClient([a_url, b_url], max_concurrency=16, batch_size=4,
                               backoff_s=0.1, health_interval_s=60) as client:
        task = asyncio.ensure_future(client.execute(calls))
        # Wait until A runs calls of the batch (however loaded the host: no deadline,
        # pytest-timeout ends a hang), then kill it.
        while not (health(a_url) or {}).get("running"):
          await asyncio.sleep(0.05)
        os.kill(a_pid, signal.SIGKILL)
        results = await task
        b_stats = (await client.stats())[b_url]
      return results, b_stats

    results, b_stats = asyncio.run(main())
    lost = [i for i, r in enumerate(results) if r.server is None]
    ran_on_b = [i for i, r in enumerate(results) if r.server == b_url]
    assert sorted(lost + ran_on_b) == list(range(n))  # every call accounted for
    for i in ran_on_b:
      assert (results[i].status, results[i].stdout) == ("ok", f"{i}\n"), results[i]
    for i in lost:  # A had taken them: reported, not re-run on B
      assert results[i].status == "internal_error", results[i]
      assert "may have run and are not re-run" in results[i].error_message
    assert 1 <= len(lost) <= 16 and ran_on_b
    assert b_stats["calls"] == len(ran_on_b)  # B ran exactly these, each once
    assert b_stats["replayed"] == 0
    # Everything of the killed server (its worker, bwrap, the calls) goes with it: polled
    # until it has, however long a loaded host takes (pytest-timeout ends a hang).
    while _alive(a_tree):
      time.sleep(0.1)
