"""Fixtures for the sandbox tests: one real server per test module.

Deadlines are generous (60 s by default; tests that race a deadline set a short
one and allow seconds of slack): the suite must hold at a load average of 10+.

SANDBOX_TEST_ISOLATION=rlimits runs the modules below on the fallback (what a
host without bubblewrap gets); the default takes bwrap where it works.
"""
from __future__ import annotations

import os

import pytest

from sandbox.client import SyncSandboxClient
from sandbox.launcher import running_server


@pytest.fixture(scope="module")
def server_url():
  isolation = os.environ.get("SANDBOX_TEST_ISOLATION", "auto")
  with running_server(max_children=32, pool_size=2, isolation=isolation,
                      allow_weak_isolation=True if isolation == "rlimits" else None,
                      extra_args=["--max-timeout", "120", "--default-timeout", "60"]) as url:
    yield url


@pytest.fixture(scope="module")
def client(server_url):
  with SyncSandboxClient([server_url], max_concurrency=64, batch_size=16) as c:
    yield c


@pytest.fixture
def run(client):
  """run(code, **call_fields) -> Result, through the real HTTP server."""
  def _run(code, **kw):
    return client.execute([dict(code=code, **kw)])[0]
  return _run
