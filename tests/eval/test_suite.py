"""`python -m experiments.evaluate --suite`: a tiny toy policy over fixture benchmarks,
through the real sandbox, the JAX engine and the grader, to the table; resumed runs."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import toy_fixtures
from tests.eval import benchmark_fixtures as fx
from tests import procs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cmd(workdir, hf_dir, benches, *extra):
  spec = ",".join(f"{name}={path}" for name, path in benches.items())
  return [sys.executable, "-m", "experiments.evaluate",
          "--config", "experiments/configs/toy.py:smoke", f"--config.workdir={workdir}",
          f"--hf_dir={hf_dir}", "--suite=report", "--protocol=config", f"--benchmarks={spec}",
          *extra]


def _env():
  return procs.cpu_env(PYTHONPATH=REPO)


def _run(*args, check=True):
  out = subprocess.run(_cmd(*args), cwd=REPO, env=_env(), capture_output=True, text=True)
  if check:
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return out


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
  root = tmp_path_factory.mktemp("suite")
  hf_dir, _, _ = toy_fixtures.toy_export(str(root / "policy"))
  data = root / "data"
  data.mkdir()
  benches = {"aime24": fx.aime24(str(data)), "gpqa_diamond": fx.gpqa_diamond(str(data))}
  return str(root), hf_dir, benches


def _lines(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def test_a_suite_run_writes_the_table_and_a_rerun_reads_it_back(toy, tmp_path):
  root, hf_dir, benches = toy
  workdir = str(tmp_path / "run")
  out = _run(workdir, hf_dir, benches)
  suite_dir = os.path.join(workdir, "suite")
  table = json.load(open(os.path.join(suite_dir, "suite.json")))
  assert [r["name"] for r in table["results"]] == ["aime24", "gpqa_diamond"]
  assert table["not_run"] == ["aime25", "hmmt25", "math500"]
  assert (table["protocol"], table["samples_per_problem"], table["greedy"]) == ("config", 2, False)
  for r in table["results"]:
    name = r["name"]
    samples = _lines(os.path.join(suite_dir, f"{name}_samples.jsonl"))
    assert len(samples) == 3 * 2   # 3 problems x k=2
    # pass@1 is the mean reward of the samples, and each reward is the grader's verdict.
    assert r["pass_at_1"] == pytest.approx(sum(s["reward"] for s in samples) / len(samples))
    assert r["ci_low"] <= r["pass_at_1"] <= r["ci_high"]
    assert r["report_inside"] == (r["ci_low"] <= r["report_pass_at_1"] / 100 <= r["ci_high"])
    assert r["num_problems"] == 3 and r["expected_problems"] in (30, 198)
    assert not os.path.exists(os.path.join(suite_dir, f"{name}.journal.jsonl"))
    assert f"| {r['title']} | 3 (of {r['expected_problems']}) |" in out.stdout
  gpqa = _lines(os.path.join(suite_dir, "gpqa_diamond_samples.jsonl"))
  assert all("\n(A) " in s["problem"] and s["answer"] in "ABCD" for s in gpqa)
  md = open(os.path.join(suite_dir, "suite.md")).read()
  assert "| benchmark | problems | pass@1 [95% CI] | report | inside |" in md
  assert "temperature 1.0" in md and "Not run (no file given): aime25, hmmt25, math500" in md
  # The same command again: read back, nothing generated, the same table.
  again = _run(workdir, hf_dir, benches)
  assert again.stdout.count("already evaluated with these settings") == 2
  assert json.load(open(os.path.join(suite_dir, "suite.json"))) == table


def test_bad_suite_input_is_refused_before_the_model_loads(toy, tmp_path):
  from experiments import evaluate
  from experiments.configs import toy as toy_config
  from rstar_jax import config_utils
  root, hf_dir, benches = toy
  spec = [f"{name}={path}" for name, path in benches.items()]

  def refused(spec, protocol="config", **eval_agent):
    c = toy_config.get_config("smoke")
    c.workdir = str(tmp_path / "run")
    c.eval.agent.update(**eval_agent)
    with pytest.raises(config_utils.ConfigError) as e:
      evaluate.run_suite(c, hf_dir, benchmark_spec=spec, protocol=protocol)
    return str(e.value)

  missing = str(tmp_path / "none.parquet")
  assert refused([f"aime24={missing}"]).startswith(f"benchmark aime24: no file at '{missing}'")
  assert "--protocol=greedy" in refused(spec, temperature=0.0)
  assert "max_len=320" in refused(spec, protocol="report")   # 30,720 tokens on the toy engine
  assert "--benchmarks" in refused([])
  assert not os.path.exists(tmp_path / "run")   # nothing written


@pytest.mark.slow
def test_a_signal_stops_the_suite_and_the_rerun_resumes_to_the_same_table(toy, tmp_path):
  root, hf_dir, _ = toy
  data = tmp_path / "data"
  data.mkdir()
  benches = {"aime25": fx.aime25(str(data), n=24)}
  slow = ("--config.rollout.engine.num_slots=2",)
  whole = str(tmp_path / "whole")
  _run(whole, hf_dir, benches, *slow)
  cut = str(tmp_path / "cut")
  proc = subprocess.Popen(_cmd(cut, hf_dir, benches, *slow), cwd=REPO, env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  journal = os.path.join(cut, "suite", "aime25.journal.jsonl")
  while proc.poll() is None:   # a few trajectories journaled, then SIGTERM
    if os.path.exists(journal) and len(open(journal).read().splitlines()) >= 4:
      proc.send_signal(signal.SIGTERM)
      break
    time.sleep(0.05)
  try:
    log = proc.communicate()[0]   # no timeout: pytest-timeout ends a hang
  finally:
    proc.kill()                   # on the way out of a hang; nothing once it has exited
  assert proc.returncode == 128 + signal.SIGTERM, log[-3000:]
  assert "run the same command again to resume" in log
  kept = len(_lines(journal)) - 1   # its header line
  assert 0 < kept < 48
  resumed = _run(cut, hf_dir, benches, *slow)
  assert f"{kept} of 48 trajectories from" in resumed.stderr
  strip = lambda d: {k: v for k, v in d.items() if k != "file"}
  a = json.load(open(os.path.join(whole, "suite", "aime25.result.json")))
  b = json.load(open(os.path.join(cut, "suite", "aime25.result.json")))
  assert strip(a) == strip(b)
  assert (_lines(os.path.join(whole, "suite", "aime25_samples.jsonl"))
          == _lines(os.path.join(cut, "suite", "aime25_samples.jsonl")))


def test_results_of_other_settings_are_moved_aside_not_overwritten(tmp_path):
  from rstar_jax.eval import suite
  stem = str(tmp_path / "aime24")
  for suffix, text in ((".json", "old report"), (".made_with.json", '{"k": 2}'),
                       (".result.json", "old row"), ("_samples.jsonl", "old samples"),
                       (".journal.jsonl", json.dumps({"journal": 2, "key": {"k": 2}}) + "\n")):
    open(stem + suffix, "w").write(text)
  suite._keep_previous(stem, {"k": 4})
  assert sorted(os.listdir(tmp_path)) == sorted(
      f"aime24_1{s}" for s in (".json", ".made_with.json", ".result.json", "_samples.jsonl",
                               ".journal.jsonl"))
  assert open(stem + "_1.json").read() == "old report"
  # A journal of these very settings (a run cut off before it finished) stays to resume.
  open(stem + ".journal.jsonl", "w").write(json.dumps({"journal": 2, "key": {"k": 4}}) + "\n")
  suite._keep_previous(stem, {"k": 4})
  assert os.path.exists(stem + ".journal.jsonl") and not os.path.exists(stem + "_2.json")
  open(stem + ".json", "w").write("second")
  suite._keep_previous(stem, {"k": 8})
  assert open(stem + "_2.json").read() == "second"
  assert open(stem + "_2.journal.jsonl").read().startswith('{"journal": 2')
