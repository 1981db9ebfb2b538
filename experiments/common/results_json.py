"""The benchmarks' JSON output (read by notebooks/03_sandbox_and_engine_perf.ipynb) and the
stamp every figure carries: date, commit, CPU model, core count."""
import datetime
import json
import os
import platform
import subprocess

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write(path: str, result: dict) -> None:
  """Writes `result` to `path` (no-op for an empty path) and says where."""
  if not path:
    return
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(result, f, indent=1, default=float)
  print(f"figures written to {path}")


def cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown"


def commit() -> str:
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True,   # the repository's, from any directory
                          cwd=_REPO).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def stamp() -> dict:
  """Where and when a figure was measured."""
  return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "commit": commit(), "cpu_model": cpu_model(), "cores": os.cpu_count()}
