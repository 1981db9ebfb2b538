"""End to end: a minimal recipe run, and RL killed mid-run then resumed.

Everything is real: the toy tokenizer is trained here, the sandbox server is a
subprocess, SFT and RL run the same code as the CPU recipe, with tiny sizes.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "--config.model.preset=tiny", "--config.model.hidden_size=64",
    "--config.model.intermediate_size=128", "--config.model.head_dim=16",
    "--config.rl.drop_equal_reward_groups=False", "--config.data.toy_train_problems=64",
    "--config.data.toy_eval_problems=4", "--config.sft.num_traces=64",
    "--config.sft.epochs=1", "--config.sft.rows_per_step=4", "--config.sft.seq_len=256",
    "--config.sft.eval_every=5", "--config.rl.prompts_per_step=2",
    "--config.rl.samples_per_prompt=4", "--config.rl.group_size=2",
    "--config.rl.checkpoint_every=1", "--config.engine.num_slots=8",
    "--config.engine.max_len=320", "--config.stage1.max_response_tokens=48",
    "--config.stage2.num_steps=0", "--config.stage3.num_steps=0", "--config.eval.k=2",
    "--config.eval.max_response_tokens=48", "--config.eval.after_sft=False",
]


def _run(workdir, *extra, module="experiments.recipe", wait=True):
  cmd = [sys.executable, "-m", module, "--config", "experiments/configs/toy.py",
         f"--config.workdir={workdir}", *TINY, *extra]
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # one CPU device, as on a laptop
  if not wait:
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
  out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return out.stdout + out.stderr


def _metrics(path):
  with open(path) as f:
    return [json.loads(l) for l in f if l.strip()]


@pytest.fixture(scope="module")
def recipe_dir(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("recipe"))
  log = _run(workdir, "--config.stage1.num_steps=2")
  return workdir, log


def test_two_step_recipe_end_to_end(recipe_dir):
  workdir, log = recipe_dir
  for stage in ("sft", "stage1"):
    assert os.path.exists(os.path.join(workdir, stage, "DONE.json")), stage
    assert os.path.exists(os.path.join(workdir, stage, "export", "config.json")), stage
  rows = _metrics(os.path.join(workdir, "stage1", "metrics_rl.jsonl"))
  assert [r["step"] for r in rows] == [1, 2]
  assert all("train/loss" in r and "rollout/reward_mean" in r for r in rows)
  report = json.load(open(os.path.join(workdir, "eval_final.json")))
  assert report["temperature"] == 1.0 and report["samples_per_problem"] == 2
  samples = _metrics(os.path.join(workdir, "eval_final_samples.jsonl"))
  assert len(samples) == 4 * 2   # 4 eval problems x k=2, one line each
  assert {s["uid"].rpartition("#")[0] for s in samples} == {f"toy-eval-{i}" for i in range(4)}
  assert all(s["problem"].startswith("What is") and s["answer"] and s["reward"] in (0.0, 1.0)
             and s["response"] for s in samples)
  assert os.listdir(os.path.join(workdir, "compile_cache"))   # persistent XLA cache in use
  assert "temperature 1.0" in log and "pass@1" in log
  assert os.path.getsize(os.path.join(workdir, "rl_progress.png")) > 1000
  sft = _metrics(os.path.join(workdir, "sft", "metrics_sft.jsonl"))
  assert sft[-1]["sft/loss"] < sft[0]["sft/loss"]   # SFT learns something


def test_rerun_skips_finished_stages(recipe_dir):
  workdir, _ = recipe_dir
  t0 = time.time()
  log = _run(workdir, "--config.stage1.num_steps=2", "--stages=sft,stage1")
  assert "SFT:" not in log and "RL:" not in log   # no progress bars: nothing re-ran
  assert time.time() - t0 < 120


def test_rl_killed_and_resumed_matches_uninterrupted(recipe_dir, tmp_path):
  src, _ = recipe_dir
  runs = {}
  for name in ("straight", "killed"):
    d = tmp_path / name
    d.mkdir()
    shutil.copytree(os.path.join(src, "tokenizer"), d / "tokenizer")
    shutil.copytree(os.path.join(src, "sft"), d / "sft")
    runs[name] = str(d)
  args = ("--config.stage1.num_steps=3", "--stages=stage1",
          "--config.engine.num_slots=4")
  _run(runs["straight"], *args)
  # Start the same run, kill -9 it once it has finished two steps, then resume.
  proc = _run(runs["killed"], *args, wait=False)
  path = os.path.join(runs["killed"], "stage1", "metrics_rl.jsonl")
  deadline = time.time() + 400
  while time.time() < deadline and proc.poll() is None:
    if os.path.exists(path) and len(_metrics(path)) >= 2:
      break
    time.sleep(0.2)
  assert proc.poll() is None, "run ended before it could be killed:\n" + proc.stdout.read()[-3000:]
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert not os.path.exists(os.path.join(runs["killed"], "stage1", "DONE.json"))
  _run(runs["killed"], *args)
  a = _metrics(os.path.join(runs["straight"], "stage1", "metrics_rl.jsonl"))
  b = _metrics(os.path.join(runs["killed"], "stage1", "metrics_rl.jsonl"))
  assert [r["step"] for r in b] == [1, 2, 3]
  for ra, rb in zip(a, b):
    for k, v in ra.items():
      if k.startswith("time/"):
        continue   # wall-clock figures differ, everything else must not
      if isinstance(v, float):
        assert rb[k] == pytest.approx(v, rel=1e-6, abs=1e-7), (ra["step"], k)
      else:
        assert rb[k] == v, (ra["step"], k)
