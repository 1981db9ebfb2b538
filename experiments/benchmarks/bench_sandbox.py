r"""Benchmark: fresh `python3 -c` per call (the release's design) vs the sandbox service.

  python -m experiments.benchmarks.bench_sandbox           # full run, a few minutes on 2 cores
  python -m experiments.benchmarks.bench_sandbox --quick   # fewer calls, for a smoke check

Prints one table: for `print(1+1)` and a sympy `solve` snippet, at concurrency 1
and 32, the median and p99 latency seen by the caller and calls/s, for
  (a) baseline: `python3 -c CODE` per call, rlimits set in the child (as the release);
  (b) service: `python -m sandbox.server` on loopback, through `SandboxClient`
      (one call per request, like a rollout issuing tool calls one by one).
Then the throughput ratio (b)/(a) and the timeout lateness (wall time past the
deadline) of 32 concurrent spinners. The machine may be shared: the load average
is printed with the results.

Where the CPU goes per call (service cells at c=32), from /proc accounting of the
server (HTTP, JSON, supervisor), the warm parent (fork, IPC), its reaped children
(set-up, copy-on-write faults, the snippet, exit) and this client, next to the
machine's limit measured in the same run: the snippet's CPU in a warm interpreter
plus one fork+exit of a warm parent with the same preload, times the cores.
Everything goes to --out as JSON too.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import resource
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from sandbox.client import SandboxClient  # noqa: E402
from sandbox.launcher import health, running_server  # noqa: E402
from sandbox.stats import percentile  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_bool("quick", False, "fewer calls per cell (smoke check, noisier figures)")
flags.DEFINE_integer("max_children", 32, "server --max-children")
flags.DEFINE_float("spin_timeout", 1.0, "deadline of the spinners in the lateness test (s)")
flags.DEFINE_integer("spin_rounds", 4, "rounds of 32 concurrent spinners", lower_bound=1)
flags.DEFINE_bool("baseline", True, "also measure (a); --nobaseline reports the service alone")
flags.DEFINE_list("server_args", [], "extra `python -m sandbox.server` flags, e.g. --server_args=--nice=10")
flags.DEFINE_string("out", "/tmp/bench_sandbox.json", "where the figures go as JSON")

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
          "mean_ms": 1000 * statistics.mean(lat),
          "p99_ms": 1000 * percentile(lat, 99), "calls_s": n / elapsed,
          "wrong": sum(1 for _, o in outs if o not in EXPECTED.values())}


_TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int) -> dict:
  """Own and reaped-children CPU seconds and minor faults of a process, from /proc."""
  with open(f"/proc/{pid}/stat", "rb") as f:
    fields = f.read().rsplit(b")", 1)[1].split()
  # fields[0] is the state: minflt=7, cminflt=8, utime=11, stime=12, cutime=13, cstime=14
  return {"self": (int(fields[11]) + int(fields[12])) / _TICK,
          "children": (int(fields[13]) + int(fields[14])) / _TICK,
          "cminflt": int(fields[8])}


def _zygote_pid(server_pid: int) -> int | None:
  from sandbox.launcher import _descendants
  for pid in sorted(_descendants(server_pid)):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
      # The lowest pid running the worker (its children fork later); not bwrap, whose
      # own command line names it too.
      if b"sandbox.worker" in argv and not argv[0].endswith(b"bwrap"):
        return pid
    except OSError:
      pass
  return None


def _snapshot(server_pid: int, zygote_pid: int | None) -> dict:
  me = resource.getrusage(resource.RUSAGE_SELF)
  snap = {"server": _proc_cpu(server_pid)["self"], "client": me.ru_utime + me.ru_stime}
  if zygote_pid:
    z = _proc_cpu(zygote_pid)
    snap.update(zygote=z["self"], children=z["children"], cminflt=z["cminflt"])
  return snap


# The snippet's CPU three ways, in a process warmed exactly like the warm parent
# (sandbox.worker.preload: the same imports and sympy/numpy warm-up, gc.freeze):
#   same:  the same text again and again in that interpreter. sympy caches results,
#          so from the second run on this is mostly a cache lookup: no forked call can
#          have it (a fork inherits the parent's cache, never a sibling's results);
#   fresh: sympy snippets with a new symbol name each run (`VARIANT` below): the
#          work without sympy's result cache, with the interpreter's pages warm;
#   fork:  the snippet run once in a fresh fork of that interpreter, copy-on-write of
#          every page it writes included;
# plus one fork+exit of a child that does nothing (CPU of parent and child), and the
# whole of a fork that runs the snippet: the fork, the child's life and its exit (which
# frees every page it copied): what any fork-per-call design pays at the least.
_LIMIT_PROBE = r"""
import gc, json, os, resource, sys, time
from sandbox import worker
from sandbox.config import DEFAULT_PRELOAD
worker.preload(DEFAULT_PRELOAD)
gc.collect()
gc.freeze()
src, variant = sys.argv[1], sys.argv[2]
code = compile(src, "<snippet>", "exec")
null = os.open(os.devnull, os.O_WRONLY)
saved = os.dup(1)
os.dup2(null, 1)
def cpu():
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime
def timed(c):
  t = cpu()
  exec(c, {"__name__": "__main__"})
  sys.stdout.flush()
  return cpu() - t
def med(xs):
  return sorted(xs)[len(xs) // 2]
n = 30
fresh = [compile(src.replace(variant, f"{variant}_{i}") if variant else src, "<snippet>", "exec")
         for i in range(n + 3)]
for c in fresh[n:]:
  timed(c)
fork_runs, call_runs = [], []
for _ in range(n):
  r, w = os.pipe()
  t = cpu()
  pid = os.fork()
  if pid == 0:
    os.write(w, repr(timed(code)).encode())
    os._exit(0)
  t = cpu() - t
  os.close(w)
  fork_runs.append(float(os.read(r, 100)))
  os.close(r)
  _, _, ru = os.wait4(pid, 0)
  call_runs.append(t + ru.ru_utime + ru.ru_stime)  # fork + the child's whole life
fresh_runs = [timed(c) for c in fresh[:n]]
for _ in range(3):
  timed(code)
same_runs = [timed(code) for _ in range(n)]
ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
t = cpu()
m = 100
for _ in range(m):
  pid = os.fork()
  if pid == 0:
    os._exit(0)
  os.waitpid(pid, 0)
ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
fork = (cpu() - t + (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)) / m
os.dup2(saved, 1)
print(json.dumps({"snippet_same_cpu_s": med(same_runs), "snippet_fresh_cpu_s": med(fresh_runs),
                  "snippet_in_fork_cpu_s": med(fork_runs), "fork_exit_cpu_s": fork,
                  "fork_run_exit_cpu_s": med(call_runs)}))
"""
# Text to vary per run for the `fresh` figure (None: nothing is cached, same = fresh).
VARIANT = {"print(1+1)": "", "sympy solve": "symbols('x"}


def _limit(name: str, code: str) -> dict:
  """The snippet's CPU (same / fresh / in a fork) and one fork+exit, in a process with
  the warm parent's preload, warm-up and malloc settings; calls/s the cores could do."""
  from sandbox.isolation import PKG_DIR
  env = dict(os.environ, PYTHONMALLOC="malloc", GLIBC_TUNABLES="glibc.malloc.hugetlb=1",
             PYTHONPATH=os.path.dirname(PKG_DIR))
  out = subprocess.run([sys.executable, "-c", _LIMIT_PROBE, code, VARIANT[name]],
                       capture_output=True, text=True, env=env, check=True, stdin=subprocess.DEVNULL)
  d = json.loads(out.stdout.strip().splitlines()[-1])
  cores = os.cpu_count()
  # The definition (snippet in a warm interpreter + one fork and exit), with the
  # snippet measured without sympy's result cache, and the fork-per-call floor.
  d["limit_calls_s"] = cores / (d["snippet_fresh_cpu_s"] + d["fork_exit_cpu_s"])
  d["limit_cached_calls_s"] = cores / (d["snippet_same_cpu_s"] + d["fork_exit_cpu_s"])
  d["fork_floor_calls_s"] = cores / d["fork_run_exit_cpu_s"]
  return d


def _load() -> str:
  return "/".join(f"{x:.2f}" for x in os.getloadavg())


async def _run(url: str) -> dict:
  q = FLAGS.quick
  counts = {  # (mode, snippet, concurrency) -> calls; the baseline's sympy is ~1 s a call
      ("a", "print(1+1)", 1): 10 if q else 40, ("a", "print(1+1)", 32): 32 if q else 160,
      ("a", "sympy solve", 1): 3 if q else 8, ("a", "sympy solve", 32): 32 if q else 64,
      ("b", "print(1+1)", 1): 30 if q else 200, ("b", "print(1+1)", 32): 200 if q else 1500,
      ("b", "sympy solve", 1): 20 if q else 100, ("b", "sympy solve", 32): 100 if q else 600,
  }
  rows = {}
  breakdown = {}
  load_before = _load()
  h = health(url)
  server_pid, zygote_pid = h["pid"], _zygote_pid(h["pid"])
  async with SandboxClient([url], max_concurrency=64, batch_size=1) as client:
    for (mode, name, conc), n in counts.items():
      if mode == "a" and not FLAGS.baseline:
        continue
      one = _baseline_one if mode == "a" else (lambda code: _service_one(client, code))
      before = _snapshot(server_pid, zygote_pid) if mode == "b" else None
      stats0 = (await client.stats())[url] if mode == "b" else None
      rows[(mode, name, conc)] = await _cell(one, SNIPPETS[name], n, conc)
      if mode == "b" and conc == 32:
        after = _snapshot(server_pid, zygote_pid)
        stats1 = (await client.stats())[url]
        calls = stats1["calls"] - stats0["calls"]  # includes the cell's warm-up call
        per = {k: 1000 * (after[k] - before[k]) / calls for k in after if k != "cminflt"}
        per["snippet_in_child"] = 1000 * (stats1["cpu_seconds_total"] - stats0["cpu_seconds_total"]) / calls
        if "children" in per:
          per["child_setup_cow_exit"] = per["children"] - per["snippet_in_child"]
          per["minor_faults_per_call"] = (after["cminflt"] - before["cminflt"]) / calls
        breakdown[name] = per
      print(f"  measured {mode} {name!r} c={conc}: {rows[(mode, name, conc)]}", file=sys.stderr)

    # Timeout lateness: rounds of 32 concurrent spinners with a short deadline.
    lateness, statuses = [], []
    spin = {"code": "x = 0\nwhile True:\n  x += 1", "timeout": FLAGS.spin_timeout}
    for _ in range(FLAGS.spin_rounds):
      for r in await client.execute([spin] * 32):
        statuses.append(r.status)
        lateness.append(r.wall_time - FLAGS.spin_timeout)
  load_after = _load()
  limits = {name: _limit(name, code) for name, code in SNIPPETS.items()}

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
  print("\nCPU per call at c=32, ms (server = HTTP + JSON + supervisor; warm parent = fork + IPC;"
        "\nchildren = set-up + copy-on-write faults + snippet + exit, of which the snippet as the"
        "\nchild measures it; client = this benchmark's SandboxClient):")
  print("| snippet | server | warm parent | children | of which snippet | set-up+COW+exit | minor faults | client | total |")
  print("|---|---|---|---|---|---|---|---|---|")
  for name, per in breakdown.items():
    total = per["server"] + per.get("zygote", 0) + per.get("children", 0) + per["client"]
    per["total_service"] = total - per["client"]
    print(f"| {name} | {per['server']:.2f} | {per.get('zygote', float('nan')):.2f} | "
          f"{per.get('children', float('nan')):.2f} | {per['snippet_in_child']:.2f} | "
          f"{per.get('child_setup_cow_exit', float('nan')):.2f} | "
          f"{per.get('minor_faults_per_call', float('nan')):.0f} | {per['client']:.2f} | {total:.2f} |")
  print(f"\nThe limit on this machine ({os.cpu_count()} cores), measured now in a process warmed like "
        "the warm parent: the snippet's CPU\n(same = the same text again, answered from sympy's "
        "result cache; fresh = a new symbol each run, no cache hit;\nin fork = once in a fresh fork, "
        "copy-on-write included) + one fork+exit of a child that does nothing:")
  for name, lim in limits.items():
    got = rows[("b", name, 32)]["calls_s"]
    ms = {k: 1000 * lim[k] for k in ("snippet_same_cpu_s", "snippet_fresh_cpu_s", "snippet_in_fork_cpu_s",
                                     "fork_exit_cpu_s", "fork_run_exit_cpu_s")}
    print(f"  {name:11}: snippet same {ms['snippet_same_cpu_s']:.2f} / fresh {ms['snippet_fresh_cpu_s']:.2f} / "
          f"in fork {ms['snippet_in_fork_cpu_s']:.2f} ms, fork+exit {ms['fork_exit_cpu_s']:.2f} ms; "
          f"fork + snippet + exit {ms['fork_run_exit_cpu_s']:.2f} ms")
    print(f"  {'':11}  limit (fresh + fork+exit) {lim['limit_calls_s']:.1f} calls/s; with the cached "
          f"figure {lim['limit_cached_calls_s']:.1f}; fork-per-call floor (fork + snippet + exit) "
          f"{lim['fork_floor_calls_s']:.1f}")
    print(f"  {'':11}  service at c=32: {got:.1f} calls/s = {100 * got / lim['limit_calls_s']:.0f}% of the "
          f"limit, {100 * got / lim['fork_floor_calls_s']:.0f}% of the fork-per-call floor")
    per = breakdown.get(name)
    if per and per.get("total_service"):
      # Independent of how much of the machine other work took: what the service's own
      # CPU per call would allow with every core to itself.
      ceiling = os.cpu_count() / (per["total_service"] / 1000)
      lim["service_cpu_ceiling_calls_s"] = ceiling
      print(f"  {'':11}  service CPU {per['total_service']:.1f} ms/call (client excluded) -> "
            f"{ceiling:.1f} calls/s with all {os.cpu_count()} cores = "
            f"{100 * ceiling / lim['limit_calls_s']:.0f}% of the limit")
  # Little's law: with 32 calls always in flight, mean latency = 32 / throughput. So p99
  # <= 300 ms needs more than 32 / 0.3 calls/s, and that times the tail's own spread.
  need = 32 / 0.3
  tail = s32["p99_ms"] / s32["mean_ms"]
  print(f"\n  p99 <= 300 ms at c=32 needs a mean latency below 300 ms, i.e. (Little's law, 32 in "
        f"flight) more than {need:.0f} calls/s;\n  with this run's tail (p99 = {tail:.2f}x the "
        f"mean, {s32['mean_ms']:.0f} ms) more than {need * tail:.0f} calls/s. The limit above: "
        f"{limits['sympy solve']['limit_calls_s']:.1f} calls/s.")
  print("\nTargets (the sandbox service's, 2 cores):")
  for ok, text in (
      (s1["median_ms"] <= 20, f"sympy median <= 20 ms at c=1: {s1['median_ms']:.1f} ms"),
      (s32["calls_s"] >= 100, f"sympy >= 100 calls/s at c=32: {s32['calls_s']:.1f}"),
      (s32["calls_s"] >= 40 * base32["calls_s"],
       f"sympy >= 40x baseline at c=32: {s32['calls_s'] / base32['calls_s']:.1f}x"),
      (s32["p99_ms"] <= 300, f"sympy p99 <= 300 ms at c=32: {s32['p99_ms']:.1f} ms"),
      (s32["p99_ms"] <= 300 or limits["sympy solve"]["limit_calls_s"] < need,
       f"sympy p99 <= 300 ms at c=32, or the limit below the {need:.0f} calls/s it needs: "
       f"{s32['p99_ms']:.1f} ms, limit {limits['sympy solve']['limit_calls_s']:.1f} calls/s"),
      (percentile(lat, 99) <= 0.1, f"timeout lateness p99 <= 100 ms: {1000 * percentile(lat, 99):.1f} ms"),
      (s32["calls_s"] >= 100 or limits["sympy solve"]["limit_calls_s"] < 100,
       f"sympy >= 100 calls/s at c=32, or the limit below 100: {s32['calls_s']:.1f} calls/s, "
       f"limit {limits['sympy solve']['limit_calls_s']:.1f}"),
  ):
    print(f"  [{'met' if ok else 'MISSED'}] {text}")
  return {"load_before": load_before, "load_after": load_after, "cores": os.cpu_count(),
          "isolation": health(url)["isolation"], "memory": health(url)["memory"],
          "max_running": health(url)["max_running"],
          "rows": [{"mode": m, "snippet": n, "concurrency": c, **r} for (m, n, c), r in rows.items()],
          "cpu_ms_per_call": breakdown, "limit": limits,
          "lateness_ms": {f"p{q}": 1000 * percentile(lat, q) for q in (50, 90, 99)}}


def main(argv):
  del argv
  with running_server(max_children=FLAGS.max_children, pool_size=2,
                      extra_args=["--max-timeout", str(TIMEOUT), *FLAGS.server_args]) as url:
    out = asyncio.run(_run(url))
  out["server_args"] = FLAGS.server_args
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
  with open(FLAGS.out, "w") as f:
    json.dump(out, f, indent=1)
  print(f"\nJSON: {FLAGS.out}")


if __name__ == "__main__":
  app.run(main)
