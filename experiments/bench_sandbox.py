r"""Benchmark: fresh `python3 -c` per call (the release's design) vs the sandbox service.

  python experiments/bench_sandbox.py            # full run, a few minutes on 2 cores
  python experiments/bench_sandbox.py --quick    # fewer calls, for a smoke check

Prints one table: for `print(1+1)` and a sympy `solve` snippet, at concurrency 1
and 32, the median and p99 latency seen by the caller and calls/s, for
  (a) baseline: `python3 -c CODE` per call, rlimits set in the child (as the release);
  (b) service: `python -m sandbox.server` on loopback, through `SandboxClient`
      (one call per request, like a rollout issuing tool calls one by one).
Then the throughput ratio (b)/(a) and the timeout lateness (wall time past the
deadline) of 32 concurrent spinners. The machine may be shared: the load average
is printed with the results.
"""
from __future__ import annotations

import asyncio
import os
import resource
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sandbox.client import SandboxClient  # noqa: E402
from sandbox.launcher import health, running_server  # noqa: E402
from sandbox.stats import percentile  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_bool("quick", False, "fewer calls per cell (smoke check, noisier figures)")
flags.DEFINE_integer("max_children", 32, "server --max-children")
flags.DEFINE_float("spin_timeout", 1.0, "deadline of the spinners in the lateness test (s)")
flags.DEFINE_integer("spin_rounds", 4, "rounds of 32 concurrent spinners")
flags.DEFINE_bool("baseline", True, "also measure (a); --nobaseline reports the service alone")
flags.DEFINE_list("server_args", [], "extra `python -m sandbox.server` flags, e.g. --server_args=--nice=10")

SNIPPETS = {
    "print(1+1)": "print(1+1)",
    "sympy solve": "from sympy import symbols, solve\nx = symbols('x')\nprint(solve(x**2 - 5*x + 6, x))",
}
EXPECTED = {"print(1+1)": "2\n", "sympy solve": "[2, 3]\n"}
MEMORY = 2 << 30
TIMEOUT = 30.0


def _limits():
  """The release's per-call rlimits, set in the fresh child before exec."""
  resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
  resource.setrlimit(resource.RLIMIT_CPU, (int(TIMEOUT), int(TIMEOUT) + 1))
  resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
  resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))
  resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


async def _baseline_one(code: str) -> tuple[float, str]:
  t = time.perf_counter()
  proc = await asyncio.create_subprocess_exec(
      sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
      stdin=asyncio.subprocess.DEVNULL, preexec_fn=_limits,
      env={"PATH": os.environ.get("PATH", ""), "OPENBLAS_NUM_THREADS": "1", "LANG": "C.UTF-8"})
  try:
    out, _ = await asyncio.wait_for(proc.communicate(), 20 * TIMEOUT)  # queueing, not the code
  except asyncio.TimeoutError:
    proc.kill()
    await proc.wait()
    out = b""
  return time.perf_counter() - t, out.decode()


async def _service_one(client: SandboxClient, code: str) -> tuple[float, str]:
  t = time.perf_counter()
  r = await client.run(code, timeout=TIMEOUT)
  return time.perf_counter() - t, r.stdout


async def _cell(one, code: str, n: int, concurrency: int) -> dict:
  sem = asyncio.Semaphore(concurrency)
  outs: list[tuple[float, str]] = []

  async def go():
    async with sem:
      outs.append(await one(code))

  await one(code)  # warm-up (page cache, connection)
  t = time.perf_counter()
  await asyncio.gather(*(go() for _ in range(n)))
  elapsed = time.perf_counter() - t
  lat = sorted(x for x, _ in outs)
  return {"calls": n, "median_ms": 1000 * statistics.median(lat),
          "p99_ms": 1000 * percentile(lat, 99), "calls_s": n / elapsed,
          "wrong": sum(1 for _, o in outs if o not in EXPECTED.values())}


def _load() -> str:
  return "/".join(f"{x:.2f}" for x in os.getloadavg())


async def _run(url: str) -> None:
  q = FLAGS.quick
  counts = {  # (mode, snippet, concurrency) -> calls; the baseline's sympy is ~1 s a call
      ("a", "print(1+1)", 1): 10 if q else 40, ("a", "print(1+1)", 32): 32 if q else 160,
      ("a", "sympy solve", 1): 3 if q else 8, ("a", "sympy solve", 32): 32 if q else 64,
      ("b", "print(1+1)", 1): 30 if q else 200, ("b", "print(1+1)", 32): 200 if q else 1500,
      ("b", "sympy solve", 1): 20 if q else 100, ("b", "sympy solve", 32): 100 if q else 600,
  }
  rows = {}
  load_before = _load()
  async with SandboxClient([url], max_concurrency=64, batch_size=1) as client:
    for (mode, name, conc), n in counts.items():
      if mode == "a" and not FLAGS.baseline:
        continue
      one = _baseline_one if mode == "a" else (lambda code: _service_one(client, code))
      rows[(mode, name, conc)] = await _cell(one, SNIPPETS[name], n, conc)
      print(f"  measured {mode} {name!r} c={conc}: {rows[(mode, name, conc)]}", file=sys.stderr)

    # Timeout lateness: rounds of 32 concurrent spinners with a short deadline.
    lateness, statuses = [], []
    spin = {"code": "x = 0\nwhile True:\n  x += 1", "timeout": FLAGS.spin_timeout}
    for _ in range(FLAGS.spin_rounds):
      for r in await client.execute([spin] * 32):
        statuses.append(r.status)
        lateness.append(r.wall_time - FLAGS.spin_timeout)
  load_after = _load()

  print(f"\nSandbox benchmark (isolation={health(url)['isolation']}, {os.cpu_count()} cores, "
        f"load avg before {load_before}, after {load_after})")
  print("(a) fresh `python3 -c` per call with rlimits   (b) sandbox service, one call per request\n")
  hdr = f"| {'mode':4} | {'snippet':11} | {'conc':>4} | {'calls':>5} | {'median ms':>9} | {'p99 ms':>8} | {'calls/s':>8} | {'wrong':>5} |"
  print(hdr)
  print("|" + "|".join("-" * (len(c)) for c in hdr.split("|")[1:-1]) + "|")
  for (mode, name, conc), r in rows.items():
    print(f"| {mode:4} | {name:11} | {conc:>4} | {r['calls']:>5} | {r['median_ms']:>9.1f} | "
          f"{r['p99_ms']:>8.1f} | {r['calls_s']:>8.1f} | {r['wrong']:>5} |")
  if FLAGS.baseline:
    print("\nThroughput ratio (b)/(a):")
    for name in SNIPPETS:
      for conc in (1, 32):
        ratio = rows[("b", name, conc)]["calls_s"] / rows[("a", name, conc)]["calls_s"]
        print(f"  {name:11} c={conc:<2}: {ratio:6.1f}x")
  lat = sorted(lateness)
  print(f"\nTimeout lateness, {FLAGS.spin_rounds} x 32 concurrent spinners, deadline "
        f"{FLAGS.spin_timeout:g} s (server wall time minus deadline), ms: "
        + ", ".join(f"p{q}={1000 * percentile(lat, q):.1f}" for q in (50, 90, 99))
        + f", max={1000 * lat[-1]:.1f}; statuses: "
        + ", ".join(f"{s}={statuses.count(s)}" for s in sorted(set(statuses))))
  s1 = rows[("b", "sympy solve", 1)]
  s32 = rows[("b", "sympy solve", 32)]
  base32 = rows.get(("a", "sympy solve", 32), {"calls_s": float("nan")})
  print("\nTargets (issue 6, 2 cores):")
  for ok, text in (
      (s1["median_ms"] <= 20, f"sympy median <= 20 ms at c=1: {s1['median_ms']:.1f} ms"),
      (s32["calls_s"] >= 100, f"sympy >= 100 calls/s at c=32: {s32['calls_s']:.1f}"),
      (s32["calls_s"] >= 40 * base32["calls_s"],
       f"sympy >= 40x baseline at c=32: {s32['calls_s'] / base32['calls_s']:.1f}x"),
      (s32["p99_ms"] <= 300, f"sympy p99 <= 300 ms at c=32: {s32['p99_ms']:.1f} ms"),
      (percentile(lat, 99) <= 0.1, f"timeout lateness p99 <= 100 ms: {1000 * percentile(lat, 99):.1f} ms"),
  ):
    print(f"  [{'met' if ok else 'MISSED'}] {text}")


def main(argv):
  del argv
  with running_server(max_children=FLAGS.max_children, pool_size=2,
                      extra_args=["--max-timeout", str(TIMEOUT), *FLAGS.server_args]) as url:
    asyncio.run(_run(url))


if __name__ == "__main__":
  app.run(main)
