"""Pytest set-up shared by every test.

XLA_FLAGS must be set before jax is first imported, so it lives here at the top of
the root conftest: every test sees 8 fake CPU devices, so sharding is exercised on
any machine.

One XLA compile cache serves the whole session, this process and every process a test
starts (recipes, rollout servers, multi-process jobs): the tests build the same tiny
programs again and again, and loading one is far cheaper than compiling it. It is a
fresh directory per session (nothing carries over between runs), shared under JAX's
file lock (a size limit set: `rstar_jax/compile_cache.py`).
"""
import os
import shutil
import sys
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

if "RSTAR_COMPILE_CACHE" not in os.environ:
  _OWN_CACHE = os.environ["RSTAR_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="rstar_test_xla_")
else:
  _OWN_CACHE = None
_CACHE = os.environ["RSTAR_COMPILE_CACHE"]
# JAX reads these at import, here and in subprocesses; the recipe and the rollout
# server point their own caches at RSTAR_COMPILE_CACHE.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(16 << 30))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


@pytest.fixture(autouse=True)
def _session_compile_cache():
  """A test that pointed this process's cache elsewhere (compile_cache.enable) gives it back."""
  yield
  jax = sys.modules.get("jax")
  if jax is not None and jax.config.jax_compilation_cache_dir != _CACHE:
    from rstar_jax import compile_cache
    compile_cache.enable(_CACHE, min_compile_time_secs=0.0)


def pytest_unconfigure(config):
  if _OWN_CACHE:
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)
