"""Pytest set-up shared by every test.

XLA_FLAGS must be set before jax is first imported, so it lives here at the top of
the root conftest: every test sees 8 fake CPU devices, so sharding is exercised on
any machine.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
