"""Soak: 4,000 mixed calls (good, failing, hostile: memory hogs, /tmp fillers, crashes,
floods, timeouts) at concurrency 32.

Every call carries a unique token; each result must be the one for its call:
nothing lost, nothing duplicated, nothing swapped, nothing run twice.
"""
from __future__ import annotations

import asyncio
import random

from sandbox.client import SandboxClient
from sandbox.isolation import interpreter_dirs_under
from sandbox.launcher import running_server

N_CALLS = 4000


def _mixed_calls(n: int, seed: int = 0):
  rng = random.Random(seed)
  calls, expect = [], []
  for i in range(n):
    u = rng.random()
    if u < 0.60:
      calls.append({"code": f"print({i})"}); expect.append(("ok", f"{i}\n"))
    elif u < 0.75:
      calls.append({"code": f"x = {i}\nx * 2"}); expect.append(("ok", f"{2 * i}\n"))
    elif u < 0.85:
      calls.append({"code": f"print({i})\nraise ValueError({i})"}); expect.append(("error", f"{i}\n"))
    elif u < 0.90:
      calls.append({"code": "print(input())", "input": str(i)}); expect.append(("ok", f"{i}\n"))
    elif u < 0.93:
      calls.append({"code": f"import os\nprint({i}, flush=True)\nos._exit(3)"})
      expect.append(("error", f"{i}\n"))
    elif u < 0.96:
      calls.append({"code": f"print({i}, flush=True)\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)"})
      expect.append(("killed", f"{i}\n"))
    elif u < 0.98:
      calls.append({"code": f"print({i}, flush=True)\nimport ctypes\nctypes.string_at(0)"})
      expect.append(("killed", f"{i}\n"))
    elif u < 0.985:
      calls.append({"code": f"print({i})\nx = bytearray(10 * 1024**3)"})
      expect.append(("memory_exceeded", f"{i}\n"))
    elif u < 0.99:
      calls.append({"code": f"print({i})\nchunks = []\nwhile True:\n  chunks.append(bytearray(32 << 20))",
                    "timeout": 60})
      expect.append(("memory_exceeded", f"{i}\n"))
    elif u < 0.993:  # fills its /tmp: ENOSPC for it alone
      calls.append({"code": "import errno\ntry:\n  for k in range(8):\n"
                            "    open(f'/tmp/f{k}', 'wb').write(b'x' * (50 << 20))\n"
                            f"except OSError as e:\n  print({i}, errno.errorcode[e.errno])",
                    "timeout": 60})
      expect.append(("ok", f"{i} ENOSPC\n"))
    elif u < 0.996:
      # The deadline counts from the hand-over: a busy machine may kill it before it prints.
      calls.append({"code": f"print({i}, flush=True)\nwhile True:\n  pass", "timeout": 0.3})
      expect.append(("timeout", ("", f"{i}\n")))
    else:
      calls.append({"code": f"print({i})\nwhile True:\n  print('z' * 4000)"})
      expect.append(("output_exceeded", None))
  return calls, expect


def test_soak_5000_mixed_calls_at_concurrency_32():
  calls, expect = _mixed_calls(N_CALLS)

  async def main():
    # A light warm parent (no numpy/sympy/scipy): the soak checks the machinery, and
    # a smaller parent forks several times faster, keeping the suite within budget.
    with running_server(max_children=32, pool_size=2,
                        extra_args=["--preload", "math,json,ctypes,signal"]) as url:
      async with SandboxClient([url], max_concurrency=32, batch_size=8) as client:
        results = await client.execute(calls)
        stats = (await client.stats())[url]
        tmp = (await client.execute(["import os\nprint(os.listdir('/tmp'))"]))[0]
    return results, stats, tmp

  results, stats, tmp = asyncio.run(main())
  # No call's files are left for the next (a venv under /tmp is the interpreter's own).
  own = sorted({p.split("/")[2] for p in interpreter_dirs_under("/tmp")})
  assert tmp.stdout == f"{own}\n"
  assert len(results) == N_CALLS
  def matches(r, want):
    status, stdout = want
    if r.status != status:
      return False
    if stdout is None:
      return True
    return r.stdout in stdout if isinstance(stdout, tuple) else r.stdout == stdout

  bad = [(i, r.status, r.stdout[:40], want) for i, (r, want) in enumerate(zip(results, expect))
         if not matches(r, want)]
  assert not bad, f"{len(bad)} mismatched results, first: {bad[:5]}"
  assert stats["calls"] == N_CALLS and stats["replayed"] == 0  # each call ran exactly once
  assert stats["statuses"]["internal_error"] == 0
  assert sum(stats["statuses"].values()) == N_CALLS
