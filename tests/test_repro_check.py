"""experiments/repro_check.py --reuse: two finished runs compared, the printed evaluation
tables included. Fake run directories (no recipe run): the tables are EvalReport.to_table()
written into logs where stderr's log lines and progress bars fall between and inside them,
differently in each run, as they do when stdout is block-buffered beside stderr."""
import json
import os
import subprocess
import sys

from rstar_jax.eval.pass_at_k import EvalReport

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _report(pass_at_1, by_source=None):
  return EvalReport(temperature=1.0, samples_per_problem=4, num_problems=128, num_samples=512,
                    pass_at_1=pass_at_1, pass_at_k={1: pass_at_1, 4: 0.9},
                    mean_response_tokens=80.5, mean_response_tokens_correct=75.0,
                    mean_turns=2.1, tool_calls_per_trajectory=1.1, tool_error_rate=0.05,
                    tool_error_rate_correct=0.01, share_no_tool_call=0.02,
                    share_truncated=0.0, by_source=by_source or {})


def _log(tables, noise):
  """A recipe log: absl lines and a progress bar (stderr) around and inside the tables."""
  out = [f"I1127 06:40:0{noise}.241875 1405 trainer.py:86] SFT packing: {{}}",
         f"SFT:   0%|   | {noise}/2010 [00:18<10:22:40]\rSFT: 100%|###| 2010/2010"]
  for t in tables:
    lines = t.splitlines()
    cut = 2 + noise % 3                      # stderr lands inside the table
    out += lines[:cut] + [f"W1127 06:5{noise}:01.000001 1405 engine.py:1] slow step"]
    out += lines[cut:]
  out.append("pass@1 after SFT 60.2% -> final 85.1% (temperature 1.0, k=4)")
  return "\n".join(out) + "\n"


def _run(workdir, final_pass_at_1, noise):
  os.makedirs(os.path.join(workdir, "stage1", "export"))
  with open(os.path.join(workdir, "stage1", "export", "model.bin"), "wb") as f:
    f.write(b"\x00\x01")
  with open(os.path.join(workdir, "stage1", "metrics_rl.jsonl"), "w") as f:
    f.write(json.dumps({"step": 1, "train/loss": 0.5, "time/step_s": noise}) + "\n")
  src = {"level1": {"num_problems": 64, "pass_at_k": {"1": 0.7, "4": 0.9}}}
  sft, final = _report(0.602), _report(final_pass_at_1, src)
  with open(os.path.join(workdir, "eval_final.json"), "w") as f:
    f.write(_report(0.851, src).to_json())           # the same report in both runs
  with open(workdir + ".log", "w") as f:
    f.write(_log([sft.to_table(), final.to_table()], noise))


def _check(tmp_path):
  out = tmp_path / "out.json"
  subprocess.run([sys.executable, "-m", "experiments.repro_check", "--reuse",
                  f"--workdir={tmp_path}", f"--out={out}"], check=True, cwd=REPO,
                 capture_output=True, text=True)
  return json.loads(out.read_text())["two_runs"]


def test_identical_runs_compare_equal_whatever_the_log_noise(tmp_path):
  _run(str(tmp_path / "run0"), 0.851, noise=1)
  _run(str(tmp_path / "run1"), 0.851, noise=2)
  r = _check(tmp_path)
  assert r["identical"], r["items"]
  assert {i["item"] for i in r["items"]} == {
      "eval_final.json", "stage1/export sha256", "stage1/metrics_rl.jsonl",
      "stdout: evaluation tables"}


def test_a_printed_table_that_differs_is_reported(tmp_path):
  _run(str(tmp_path / "run0"), 0.851, noise=1)
  _run(str(tmp_path / "run1"), 0.849, noise=1)       # only the printed final table differs
  r = _check(tmp_path)
  assert not r["identical"]
  bad = [i for i in r["items"] if not i["same"]]
  assert [i["item"] for i in bad] == ["stdout: evaluation tables"]
  assert "85.1%" in bad[0]["first_difference"] and "84.9%" in bad[0]["first_difference"]
