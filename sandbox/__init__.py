"""Code-execution sandbox service: warm forking executor, HTTP server, client.

Standalone: imports nothing from rstar_jax and no JAX. See sandbox/README.md.
Heavier names (client, launcher, executor) load on first use, so the worker
process inside the sandbox never imports aiohttp.
"""
from sandbox.schema import ISOLATION_LEVELS, STATUSES, Call, Result

_LAZY = {
    "SandboxClient": "sandbox.client",
    "SyncSandboxClient": "sandbox.client",
    "running_server": "sandbox.launcher",
    "Executor": "sandbox.executor",
    "ExecutorConfig": "sandbox.config",
}

__all__ = ["Call", "Result", "STATUSES", "ISOLATION_LEVELS", *_LAZY]


def __getattr__(name):
  if name in _LAZY:
    import importlib
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'sandbox' has no attribute {name!r}")
