"""experiments/under_load.py: runs a command beside CPU burners and stops them after."""
import json
import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("code,passed", [("0", True), ("3", False)])
def test_runs_the_command_beside_burners_and_reports_each_run(tmp_path, code, passed):
  out = tmp_path / "u.json"
  marker = tmp_path / "burners.txt"
  # The command records how many burner processes run beside it (this script's other
  # children), then exits with `code`.
  cmd = [sys.executable, "-c",
         "import os, subprocess, sys; ppid = os.getppid(); "
         "kids = subprocess.run(['ps', '-o', 'pid=', '--ppid', str(ppid)], capture_output=True,"
         " text=True).stdout.split(); "
         f"open({str(marker)!r}, 'a').write(str(len(kids)) + '\\n'); "
         f"print('1 passed in 0.01s'); sys.exit({code})"]
  proc = subprocess.run([sys.executable, "-m", "experiments.under_load", "--burners=2",
                         "--repeat=2", f"--out={out}", "--", *cmd],
                        capture_output=True, text=True, cwd=os.getcwd())
  assert proc.returncode == (0 if passed else 1), proc.stderr[-2000:]
  info = json.loads(out.read_text())
  assert info["all_passed"] is passed and info["burners"] == 2
  assert [r["run"] for r in info["runs"]] == [1, 2]
  assert [r["returncode"] for r in info["runs"]] == [int(code)] * 2
  assert all(r["summary"] == "1 passed in 0.01s" for r in info["runs"])
  assert {"date", "commit", "cpu_model", "cores"} <= set(info)
  # Each run saw the two burners beside itself (3 children: 2 burners + the command).
  assert marker.read_text().split() == ["3", "3"]
  assert "| 1 | " + code + " |" in proc.stdout
  # No burner outlives the script.
  left = subprocess.run(["pgrep", "-f", "while os.getppid"], capture_output=True, text=True)
  assert left.stdout.split() == []
