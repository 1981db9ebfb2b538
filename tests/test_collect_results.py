"""experiments.collect_results on stand-in work directories made here (no real run): what
is copied, what is left out, meta.json's fields, and the refusals."""
import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments import collect_results as cr

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# What a finished toy recipe run leaves that a results folder keeps (meta.json aside).
RECIPE_KEPT = {"config.json", "eval_after_sft.json", "eval_after_sft.made_with.json",
               "eval_final.json", "eval_final.made_with.json",
               "eval_after_sft_samples.jsonl.gz", "eval_final_samples.jsonl.gz",
               "sft/DONE.json", "sft/metrics_sft.jsonl", "stage1/DONE.json",
               "stage1/metrics_rl.jsonl", "stage2/DONE.json", "stage2/metrics_rl.jsonl",
               "rl_progress.png"}
META_KEYS = {"name", "kind", "date", "collected", "command", "commit", "dirty", "code_dir",
             "workdir", "cpu_model", "cpu_family", "isa", "cores", "load_start", "load_end", "wall_s",
             "matmul_peak_gflops", "figures", "files"}


def _write(path, text):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.write(text)


def _report(correct_per_problem, k=4):
  per = [{"uid": f"p{i}", "num_samples": k, "num_correct": c, "mean_reward": c / k,
          "mean_response_tokens": 30.0, "tool_calls": k, "tool_errors": 0, "truncated": 0}
         for i, c in enumerate(correct_per_problem)]
  return {"temperature": 1.0, "samples_per_problem": k, "num_problems": len(per),
          "num_samples": k * len(per),
          "pass_at_1": sum(correct_per_problem) / (k * len(per)),
          "tool_error_rate": 0.1, "tool_error_rate_correct": 0.05, "per_problem": per}


def make_recipe_workdir(root, *, plot=None, final=True, stage2_done=True):
  """A finished toy run's layout: stages with metrics and DONE.json, exports and
  checkpoints (never copied), two evaluations with their trajectories."""
  rng = np.random.default_rng(0)
  _write(os.path.join(root, "config.json"), json.dumps({"seed": 0, "workdir": root}))
  _write(os.path.join(root, "sft", "metrics_sft.jsonl"),
         "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 6)))
  _write(os.path.join(root, "sft", "DONE.json"), json.dumps({"step": 5}))
  for stage, steps in (("stage1", 4), ("stage2", 2)):
    _write(os.path.join(root, stage, "metrics_rl.jsonl"), "".join(
        json.dumps({"step": s, "rollout/reward_mean": float(rng.uniform()),
                    "rollout/tool_error_rate_correct": float(rng.uniform()),
                    "rollout/model_tokens_mean": 40.0 + s}) + "\n"
        for s in range(1, steps + 1)))
    if stage != "stage2" or stage2_done:
      _write(os.path.join(root, stage, "DONE.json"), json.dumps({"step": steps}))
    _write(os.path.join(root, stage, "export", "model.safetensors"), "weights" * 1000)
    _write(os.path.join(root, stage, "checkpoints", "4", "state"), "ckpt" * 1000)
  _write(os.path.join(root, "sft", "export", "model.safetensors"), "weights" * 1000)
  _write(os.path.join(root, "stage1", "hard_subset.journal.jsonl"), "{}\n")
  for name, correct in (("after_sft", [0, 1, 2, 4, 3, 1, 0, 2]),
                        ("final", [4, 4, 3, 4, 2, 4, 1, 3])):
    if name == "final" and not final:
      continue
    _write(os.path.join(root, f"eval_{name}.json"), json.dumps(_report(correct)))
    _write(os.path.join(root, f"eval_{name}.made_with.json"), json.dumps({"k": 4}))
    _write(os.path.join(root, f"eval_{name}_samples.jsonl"), "".join(
        json.dumps({"uid": f"p{i}", "text": "x" * 50}) + "\n" for i in range(32)))
    _write(os.path.join(root, f"eval_{name}.journal.jsonl"), "{}\n")
  if plot is not None:
    with open(os.path.join(root, "rl_progress.png"), "wb") as f:
      f.write(plot)
  return root


def make_git_checkout(root):
  os.makedirs(root)
  env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
             GIT_COMMITTER_EMAIL="t@t")
  _write(os.path.join(root, "code.py"), "x = 1\n")
  for args in (["init", "-q"], ["add", "code.py"], ["commit", "-q", "-m", "c"]):
    subprocess.run(["git", *args], cwd=root, check=True, env=env)
  return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, check=True, capture_output=True,
                        text=True).stdout.strip()


def _tree(folder):
  return {os.path.relpath(os.path.join(r, n), folder) for r, _, ns in os.walk(folder) for n in ns}


PEAK = {"what": "stand-in", "rounds": [1.0], "min": 1.0, "median": 1.0, "max": 1.0}


def _collect(tmp_path, workdir, **kw):
  args = dict(workdir=workdir, name="run", out_root=str(tmp_path / "results"),
              command="python -m experiments.recipe", wall_s=60.0, load_start=0.5, started="",
              code_dir=str(tmp_path / "code"), peak=PEAK, load_end=0.7)
  args.update(kw)
  return cr.collect(**args)


@pytest.fixture
def code(tmp_path):
  return make_git_checkout(str(tmp_path / "code"))


def test_wrapping_a_command_runs_it_measures_and_collects(tmp_path, code):
  """The command after -- makes the work directory; the folder holds exactly the kept
  files, byte for byte, and a meta.json with every field measured here."""
  src = make_recipe_workdir(str(tmp_path / "src"))
  work = str(tmp_path / "work")
  out = subprocess.run(
      [sys.executable, "-m", "experiments.collect_results", f"--workdir={work}", "--name=toy",
       f"--out_root={tmp_path / 'results'}", f"--code_dir={tmp_path / 'code'}",
       "--peak_rounds=1", "--", "cp", "-r", src, work],
      cwd=REPO, capture_output=True, text=True,
      env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr[-3000:]
  folder = tmp_path / "results" / "toy"
  assert _tree(folder) == RECIPE_KEPT | {"meta.json"}
  for rel in RECIPE_KEPT - {"rl_progress.png"}:
    original = os.path.join(src, rel[:-len(".gz")] if rel.endswith(".gz") else rel)
    with open(original, "rb") as f:
      want = f.read()
    opener = gzip.open if rel.endswith(".gz") else open
    with opener(folder / rel, "rb") as f:
      assert f.read() == want, rel
  # The stand-in run left no plot: it is drawn from the copied RL metrics.
  assert (folder / "rl_progress.png").read_bytes()[:8] == PNG_MAGIC
  assert not os.path.exists(os.path.join(work, "rl_progress.png"))   # the run is only read

  meta = json.loads((folder / "meta.json").read_text())
  assert META_KEYS <= set(meta) and all(meta[k] is not None for k in META_KEYS)
  assert meta["kind"] == "recipe" and meta["command"] == f"cp -r {src} {work}"
  assert meta["commit"] == code and meta["dirty"] is False
  assert meta["wall_s"] > 0 and meta["load_start"] >= 0 and meta["load_end"] >= 0
  for peak in (meta["matmul_peak_gflops"], meta["matmul_peak_gflops_before"]):
    assert len(peak["rounds"]) == 1 and peak["rounds"][0] > 0
  with open("/proc/cpuinfo") as f:
    cpuinfo = f.read()
  assert meta["cpu_model"] in cpuinfo and meta["cores"] == os.cpu_count()
  family, model = meta["cpu_family"].split()[1::2]
  assert f"cpu family\t: {family}\n" in cpuinfo and f"model\t\t: {model}\n" in cpuinfo
  assert (meta["isa"] == "avx512") == (" avx512f " in cpuinfo.replace("\n", " "))
  listed = {r["path"]: r["bytes"] for r in meta["files"]}
  assert set(listed) == RECIPE_KEPT
  assert all(listed[p] == os.path.getsize(folder / p) for p in listed)
  final = meta["figures"]["eval_final"]
  assert final["pass_at_1"] == pytest.approx(25 / 32)
  lo, hi = final["pass_at_1_ci95_over_problems"]
  assert lo < 25 / 32 < hi and hi - lo < 0.5
  assert meta["figures"]["eval_after_sft"]["pass_at_1"] == pytest.approx(13 / 32)
  assert "pass@1 78.1%" in out.stdout


def test_collecting_after_the_fact_copies_the_runs_plot_and_records_a_dirty_tree(
    tmp_path, code):
  work = make_recipe_workdir(str(tmp_path / "work"), plot=PNG_MAGIC + b"the run's own plot")
  _write(str(tmp_path / "code" / "code.py"), "x = 2\n")   # a change to tracked code
  _write(str(tmp_path / "code" / "notes.txt"), "")          # untracked: not a change
  log = str(tmp_path / "run.log")
  _write(log, "pass@1 after SFT 40.6% -> final 78.1%\n")
  folder = _collect(tmp_path, work, extra=[log], started="2026-11-28T11:34:40+00:00",
                    samples=False)
  assert _tree(folder) == {p for p in RECIPE_KEPT if not p.endswith(".gz")} | {
      "meta.json", "run.log"}
  assert open(os.path.join(folder, "rl_progress.png"), "rb").read() == (
      PNG_MAGIC + b"the run's own plot")
  meta = json.load(open(os.path.join(folder, "meta.json")))
  assert meta["dirty"] is True and meta["commit"] == code
  assert meta["date"] == "2026-11-28T11:34:40+00:00"
  assert (meta["wall_s"], meta["load_start"], meta["load_end"]) == (60.0, 0.5, 0.7)


@pytest.mark.parametrize("make, message", [
    (lambda d: make_recipe_workdir(d, final=False), "no eval_final.json"),
    (lambda d: make_recipe_workdir(d, stage2_done=False), "stage2/ has no DONE.json"),
    (lambda d: os.makedirs(d), "not a run this tool knows"),
    (lambda d: None, "no such directory"),
])
def test_a_workdir_that_is_not_a_finished_run_is_refused(tmp_path, code, make, message):
  work = str(tmp_path / "work")
  make(work)
  with pytest.raises(cr.NotFinished, match=message) as e:
    _collect(tmp_path, work)
  assert f"--workdir={work}" in str(e.value)
  assert not os.path.exists(tmp_path / "results" / "run")
  assert not os.path.exists(tmp_path / "results" / "run.partial")


@pytest.mark.parametrize("kw, message", [
    (dict(wall_s=None), "--wall_s=None"),
    (dict(load_start=-1.0), "--load_start=-1.0"),
    (dict(command=""), "--command is empty"),
    (dict(name="a/b"), "--name='a/b'"),
    (dict(extra=["/no/such/log"]), "--extra=/no/such/log: no such file"),
    (dict(max_mb=0.001), r"over --max_mb=0.001; the largest: .*--nosamples"),
])
def test_bad_arguments_are_refused_naming_the_flag(tmp_path, code, kw, message):
  work = make_recipe_workdir(str(tmp_path / "work"))
  with pytest.raises(ValueError, match=message):
    _collect(tmp_path, work, **kw)
  assert not os.path.exists(tmp_path / "results" / "run")
  assert not os.path.exists(tmp_path / "results" / "run.partial")


def test_an_existing_folder_is_kept_unless_overwrite(tmp_path, code):
  work = make_recipe_workdir(str(tmp_path / "work"))
  first = _collect(tmp_path, work, samples=False)
  with pytest.raises(ValueError, match="exists: choose another --name, or pass --overwrite"):
    _collect(tmp_path, work)
  assert not os.path.exists(os.path.join(first, "eval_final_samples.jsonl.gz"))
  _collect(tmp_path, work, overwrite=True)
  assert os.path.exists(os.path.join(first, "eval_final_samples.jsonl.gz"))


def test_the_cli_refuses_an_unfinished_run_in_one_line(tmp_path, code):
  work = make_recipe_workdir(str(tmp_path / "work"), stage2_done=False)
  out = subprocess.run(
      [sys.executable, "-m", "experiments.collect_results", f"--workdir={work}", "--name=x",
       f"--out_root={tmp_path / 'results'}", f"--code_dir={tmp_path / 'code'}",
       "--command=python -m experiments.recipe", "--wall_s=5", "--load_start=0"],
      cwd=REPO, capture_output=True, text=True,
      env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"))
  assert out.returncode == 2 and "Traceback" not in out.stderr
  assert "stage2/ has no DONE.json" in out.stderr
  assert not os.path.exists(tmp_path / "results")


def _sweep(root, points, *, ended=True):
  for name in points:
    make_recipe_workdir(os.path.join(root, name))
  _write(os.path.join(root, "sweep.json"), json.dumps({"points": [
      {"name": n, "overrides": {"seed": i}, "workdir": os.path.join(root, n)}
      for i, n in enumerate(points)]}))
  if ended:
    _write(os.path.join(root, "results.md"), "| point | pass@1 |\n")
    _write(os.path.join(root, "results.csv"), "point,pass_at_1\n")
  return root


def test_a_sweep_keeps_each_points_metrics_and_reports_without_trajectories(tmp_path, code):
  work = _sweep(str(tmp_path / "sweep"), ["seed=0", "seed=1"])
  folder = _collect(tmp_path, work)
  kept = {p for p in RECIPE_KEPT if not p.endswith(".gz")}
  assert _tree(folder) == {"meta.json", "results.md", "results.csv", "sweep.json"} | {
      f"points/{n}/{p}" for n in ("seed=0", "seed=1") for p in kept}
  meta = json.load(open(os.path.join(folder, "meta.json")))
  assert meta["kind"] == "sweep"
  assert meta["figures"]["seed=1"]["eval_final"]["pass_at_1"] == pytest.approx(25 / 32)


def test_a_sweep_that_did_not_end_is_refused(tmp_path, code):
  with pytest.raises(cr.NotFinished, match="no results.md"):
    _collect(tmp_path, _sweep(str(tmp_path / "a"), ["seed=0"], ended=False))
  work = _sweep(str(tmp_path / "b"), ["seed=0", "seed=1"])
  os.remove(os.path.join(work, "seed=1", "eval_final.json"))
  with pytest.raises(cr.NotFinished, match="point seed=1 has no eval_final.json"):
    _collect(tmp_path, work)


def test_a_benchmark_json_is_copied_with_a_plot_of_its_steps(tmp_path, code):
  work = str(tmp_path / "bench")
  data = {"host": {"cpu_model": "x"}, "measured": [
      {"engines": "process", "max_staleness": k, "per_step_s": [3.0, 1.0, 0.5, 0.4]}
      for k in (0, 1)]}
  _write(os.path.join(work, "async_throughput.json"), json.dumps(data))
  folder = _collect(tmp_path, work)
  assert _tree(folder) == {"async_throughput.json", "async_throughput.png", "meta.json"}
  assert json.load(open(os.path.join(folder, "async_throughput.json"))) == data
  assert open(os.path.join(folder, "async_throughput.png"), "rb").read()[:8] == PNG_MAGIC
  _write(os.path.join(work, "broken.json"), "{")
  with pytest.raises(cr.NotFinished, match="broken.json is not JSON"):
    _collect(tmp_path, work, name="run2")
