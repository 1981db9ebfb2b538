"""Process checks the tests share (a fleet, a batch script or a sweep leaving nothing behind)."""
import os
import time


def xla_flags(*flags: str) -> str:
  """XLA_FLAGS for a process a test starts: `flags` plus RSTAR_TEST_XLA_FLAGS (the
  emulated other rounding of docs/testing.md, which must reach every process)."""
  return " ".join(f for f in (*flags, os.environ.get("RSTAR_TEST_XLA_FLAGS", "").strip()) if f)


def cpu_env(**extra: str) -> dict[str, str]:
  """The environment of a subprocess that runs on one CPU device, as on a laptop: the
  tests' 8 fake devices dropped, RSTAR_TEST_XLA_FLAGS kept."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", **extra)
  env.pop("XLA_FLAGS", None)
  if xla_flags():
    env["XLA_FLAGS"] = xla_flags()
  return env


def alive(pid: int) -> bool:
  """The process exists and is not a zombie (a killed child not yet reaped by its parent
  still answers `os.kill(pid, 0)`)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except (FileNotFoundError, ProcessLookupError):
    return False


def left_running(pids, wait_s: float) -> list[int]:
  """The processes of `pids` still running after waiting up to `wait_s` seconds for all of
  them to end (a tear-down takes a moment; this is a bound on the wait, not a timing)."""
  deadline = time.monotonic() + wait_s
  while time.monotonic() < deadline and any(alive(p) for p in pids):
    time.sleep(0.1)
  return [p for p in pids if alive(p)]
