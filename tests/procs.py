"""Process checks the tests share (a fleet, a batch script or a sweep leaving nothing behind)."""
import time


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
