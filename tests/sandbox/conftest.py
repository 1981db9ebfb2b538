"""Fixtures for the sandbox tests: one real server per test module.

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
  with running_server(max_children=32, pool_size=2,
                      isolation=os.environ.get("SANDBOX_TEST_ISOLATION", "auto"),
                      extra_args=["--max-timeout", "30", "--default-timeout", "5"]) as url:
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
