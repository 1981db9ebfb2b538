"""Pytest set-up shared by every test.

XLA_FLAGS must be set before jax is first imported, so it lives here at the top of
the root conftest: every test sees 8 fake CPU devices, so sharding is exercised on
any machine.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
# RSTAR_TEST_XLA_FLAGS: XLA flags that change this host's rounding (another CPU kind's,
# emulated; docs/testing.md). Every test process sees them, and so does every process a
# test starts (tests/procs.py: cpu_env, xla_flags).
_rounding = os.environ.get("RSTAR_TEST_XLA_FLAGS", "").strip()
for _f in (_rounding, _flag):
  if _f and _f not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _f).strip()

import pytest  # noqa: E402

# Skips against tests/skip_allowlist.txt (fails the session under CI=true): see the module.
from tests.skip_policy import (pytest_collectreport,  # noqa: E402,F401
                               pytest_runtest_logreport, pytest_terminal_summary)
from tests import skip_policy  # noqa: E402

# tests/test_multihost.py's gloo test: its two processes, started when collection ends.
STALL_PROCS = pytest.StashKey[list]()


def pytest_sessionstart(session):
  """Under RSTAR_TEST_XLA_FLAGS the suite must in fact round otherwise than plain: a flag
  this jax ignores, or one that changes nothing on this host, would pass for a check of
  another CPU kind's rounding without being one."""
  flags = os.environ.get("RSTAR_TEST_XLA_FLAGS", "").strip()
  if not flags or os.environ.get("PYTEST_XDIST_WORKER"):
    return
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

  def probe(xla_flags):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags, PYTHONPATH=root)
    out = subprocess.run([sys.executable, "-m", "tests.rounding_probe"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
      pytest.exit(f"tests.rounding_probe failed under XLA_FLAGS={xla_flags!r}:\n"
                  f"{out.stderr[-2000:]}", returncode=4)
    return out.stdout.strip()
  if probe("") == probe(flags):
    pytest.exit(f"RSTAR_TEST_XLA_FLAGS={flags!r} does not change this host's rounding "
                "(tests.rounding_probe gives the same bits): pick another flag "
                "(docs/testing.md)", returncode=4)


# Test files that run longest, started first. Under `-n 2 --dist loadfile` a file runs
# whole on one worker, and xdist hands files out in queue order: a file of ~20 minutes
# that came last would run alone at the end while the other worker idles.
LONGEST_FILES_FIRST = ("tests/test_rehearsal.py",)


def pytest_configure(config):
  skip_policy.pytest_configure(config)
  # xdist otherwise reorders files by their number of tests, which says nothing about
  # their time; pytest_collection_modifyitems puts LONGEST_FILES_FIRST at the front.
  if hasattr(config.option, "loadscopereorder"):
    config.option.loadscopereorder = False


def _file_order(items) -> list:
  """LONGEST_FILES_FIRST, then the other files by number of tests, most first (xdist's
  own order); the order within a file is kept."""
  counts: dict[str, int] = {}
  for it in items:
    path = it.nodeid.split("::", 1)[0]
    counts[path] = counts.get(path, 0) + 1
  first = {p: i for i, p in enumerate(LONGEST_FILES_FIRST)}
  files = sorted(counts, key=lambda p: (first.get(p, len(first)), -counts[p]))
  rank = {p: i for i, p in enumerate(files)}
  return sorted(items, key=lambda it: rank[it.nodeid.split("::", 1)[0]])


def pytest_addoption(parser):
  skip_policy.pytest_addoption(parser)
  parser.addoption("--rotate-slow", action="store_true",
                   help="run this commit's share of the [rotating] slow tests of "
                        "tests/slow_tests.txt (on by default when CI=true)")


# Slow tests marked [rotating] in tests/slow_tests.txt: how many run in each CI session,
# chosen from the commit (the same commit runs the same ones; the next, others).
ROTATING_SLOW_PER_RUN = 6


def _slow_list() -> list[tuple[str, str]]:
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow_tests.txt")
  out = []
  with open(path) as f:
    for line in f:
      line = line.strip()
      if line and not line.startswith("#"):
        pattern, _, reason = line.partition("|")
        out.append((pattern.strip(), reason.strip()))
  return out


def _commit() -> str:
  import subprocess
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
  return out.stdout.strip() or "no-commit"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  """Files in _file_order's order; under CI=true (or --rotate-slow), ROTATING_SLOW_PER_RUN
  of the [rotating] slow tests lose their slow mark before `-m "not slow"` deselects, so
  they run."""
  items[:] = _file_order(items)
  if not (os.environ.get("CI") == "true" or config.getoption("--rotate-slow")):
    return
  import fnmatch
  import hashlib
  rotating = [p for p, reason in _slow_list() if reason.startswith("[rotating]")]
  pool = [it for it in items if it.get_closest_marker("slow") is not None
          and any(fnmatch.fnmatchcase(it.nodeid, p) for p in rotating)]
  commit = _commit()
  pool.sort(key=lambda it: hashlib.sha256(f"{commit} {it.nodeid}".encode()).hexdigest())
  for it in pool[:ROTATING_SLOW_PER_RUN]:
    it.own_markers = [m for m in it.own_markers if m.name != "slow"]


def pytest_collection_finish(session):
  if os.environ.get("PYTEST_XDIST_WORKER"):
    return   # a worker does not know whether it will run the test: the test starts them
  from tests import test_multihost
  if any(item.name == test_multihost.STALL_TEST for item in session.items):
    session.config.stash[STALL_PROCS] = test_multihost.start_stall_processes()


def pytest_sessionfinish(session):
  for p in session.config.stash.get(STALL_PROCS, []):
    if p.poll() is None:
      p.kill()
  skip_policy.judge(session)
