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
from tests.skip_policy import (pytest_addoption, pytest_collectreport,  # noqa: E402,F401
                               pytest_configure, pytest_runtest_logreport,
                               pytest_terminal_summary)
from tests import skip_policy  # noqa: E402

# tests/test_multihost.py's gloo test: its two processes, started when collection ends.
STALL_PROCS = pytest.StashKey[list]()


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
