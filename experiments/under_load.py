r"""python -m experiments.under_load --burners 8 --repeat 2 --out /tmp/under_load.json

Runs a command (default: the README's test command, without its install step) several
times in a row while N CPU burners spin, and says whether every run passed: the check
that no test depends on the host's speed (docs/testing.md). Each burner is a process
spinning at full priority, so 2 cores with 8 burners give the command about a fifth of
the CPU it would get alone. The burners stop when the runs end, on SIGINT / SIGTERM,
and if this process dies (each burner watches its parent).

Prints a table (run, exit status, seconds, pytest's summary line) and writes --out as
JSON with the date, commit, CPU model, core count and the load average before and
after. Pass another command after `--`, e.g.
  python -m experiments.under_load --burners 8 --repeat 2 -- python -m pytest -q tests/sandbox
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from absl import app
from absl import flags

from experiments.common import results_json

README_TESTS = ["python", "-m", "pytest", "-q", "-m", "not slow", "-n", "2", "--dist", "loadfile"]
# A burner spins until its parent (this process) is gone.
BURNER = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n  for _ in range(10**6): pass\n"

flags.DEFINE_integer("burners", 8, "CPU-spinning processes beside the command", lower_bound=0)
flags.DEFINE_integer("repeat", 2, "runs of the command, one after the other", lower_bound=1)
flags.DEFINE_string("out", "", "where to write the JSON (none if empty)")
FLAGS = flags.FLAGS


def _summary(text: str) -> str:
  """pytest's last summary line ('N passed, M failed in Xs'), or ''."""
  lines = [l for l in text.splitlines() if re.search(r"\b(passed|failed|error)\b", l)]
  return lines[-1].strip("= ").strip() if lines else ""


def run(command: list[str], burners: int, repeat: int) -> dict:
  procs = [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(burners)]
  info = {"command": command, "burners": burners, "load_before": list(os.getloadavg()),
          "runs": []}
  stop = {"signal": None}

  def on_signal(signum, _frame):
    stop["signal"] = signum
    raise KeyboardInterrupt
  old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    for i in range(repeat):
      t = time.perf_counter()
      child = subprocess.run(command, capture_output=True, text=True)
      out = child.stdout + child.stderr
      info["runs"].append({"run": i + 1, "returncode": child.returncode,
                           "seconds": time.perf_counter() - t, "summary": _summary(out),
                           "tail": out[-3000:]})
      print(f"[under_load] run {i + 1}/{repeat}: exit {child.returncode} in "
            f"{info['runs'][-1]['seconds']:.0f} s: {info['runs'][-1]['summary']}", flush=True)
  except KeyboardInterrupt:
    info["interrupted_by"] = stop["signal"] or signal.SIGINT
  finally:
    for p in procs:
      p.kill()
    for p in procs:
      p.wait()
    for s, h in old.items():
      signal.signal(s, h)
  info["load_after"] = list(os.getloadavg())
  info["all_passed"] = (len(info["runs"]) == repeat
                        and all(r["returncode"] == 0 for r in info["runs"]))
  return info


def main(argv):
  command = argv[1:] or README_TESTS
  if command and command[0] == "--":
    command = command[1:]
  info = run(command, FLAGS.burners, FLAGS.repeat)
  info.update(results_json.stamp())
  print("\n| run | exit | seconds | summary |\n|---|---|---|---|")
  for r in info["runs"]:
    print(f"| {r['run']} | {r['returncode']} | {r['seconds']:.0f} | {r['summary']} |")
  print(f"\n{FLAGS.burners} burners on {os.cpu_count()} cores; load before "
        f"{info['load_before'][0]:.1f}, after {info['load_after'][0]:.1f}; "
        f"all passed: {info['all_passed']}")
  results_json.write(FLAGS.out, info)
  if "interrupted_by" in info:
    sys.exit(128 + int(info["interrupted_by"]))
  sys.exit(0 if info["all_passed"] else 1)


if __name__ == "__main__":
  app.run(main)
