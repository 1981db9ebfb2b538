"""The benchmarks' JSON output (read by notebooks/03_sandbox_and_engine_perf.ipynb)."""
import json
import os


def write(path: str, result: dict) -> None:
  """Writes `result` to `path` (no-op for an empty path) and says where."""
  if not path:
    return
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(result, f, indent=1, default=float)
  print(f"figures written to {path}")
