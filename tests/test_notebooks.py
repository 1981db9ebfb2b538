"""The notebooks (notebooks/*.ipynb) run headless with papermill on tiny inputs built
here: each has a cell tagged `parameters` that papermill overrides, and any error in
any cell fails the test. Inputs: none for the quickstart (00 runs the README's first run
into a fresh work directory, as from a fresh clone), a sweep directory written through
rstar_jax.recipe.sweep_points' own writers (01, 05), a random tiny toy policy with toy
traces (02), and the JSON of the three benchmarks run at tiny sizes (03)."""
from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys

import nbformat
import numpy as np
import pytest

from rstar_jax.recipe import sweep_points
from tests import toy_fixtures

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(REPO, "notebooks")
NAMES = ["00_quickstart", "01_roc_ablation", "02_entropy", "03_sandbox_and_engine_perf",
         "04_async_ablation"]


def _run(name: str, out_dir, **parameters) -> nbformat.NotebookNode:
  import papermill
  out = os.path.join(str(out_dir), f"{name}.out.ipynb")
  papermill.execute_notebook(os.path.join(NOTEBOOKS, f"{name}.ipynb"), out,
                             parameters=parameters, kernel_name="python3", cwd=REPO,
                             progress_bar=False, execution_timeout=600)
  return nbformat.read(out, as_version=4)


def _text(nb) -> str:
  """Everything the executed cells printed or displayed as text."""
  parts = []
  for cell in nb.cells:
    for o in cell.get("outputs", []):
      if o.output_type == "stream":
        parts.append(o.text)
      elif o.output_type in ("display_data", "execute_result"):
        parts.append(o.data.get("text/markdown", "") or o.data.get("text/plain", ""))
  return "\n".join(parts)


def test_committed_notebooks_are_clean_and_parameterised():
  assert sorted(f[:-6] for f in os.listdir(NOTEBOOKS) if f.endswith(".ipynb")) == NAMES
  for name in NAMES:
    nb = nbformat.read(os.path.join(NOTEBOOKS, f"{name}.ipynb"), as_version=4)
    nbformat.validate(nb)
    first = nb.cells[0]
    assert first.cell_type == "markdown" and "**What it shows.**" in first.source, name
    assert "**How to run.**" in first.source and "papermill" in first.source, name
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1 and tagged[0] is nb.cells[1], name
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), \
        f"{name}: committed with outputs (clear them before committing)"


def test_01_roc_ablation_reads_a_sweep(tmp_path):
  rng = np.random.RandomState(0)
  arms = {"roc": -0.02, "uniform": -0.01}
  pts = sweep_points.make_points([{"rl.downsample.method": a, "seed": s}
                                  for a in arms for s in (0, 1)],
                                 str(tmp_path / "sweep"))
  for p in pts[:-1]:   # the last point has not run yet
    slope = arms[p.overrides["rl.downsample.method"]]
    # The first arm has too few steps for the direction table: the other's still shows.
    steps = 6 if p.overrides["rl.downsample.method"] == "roc" else 20
    os.makedirs(os.path.join(p.workdir, "stage1"))
    with open(os.path.join(p.workdir, "stage1", "metrics_rl.jsonl"), "w") as f:
      for step in range(1, steps + 1):
        row = {"step": step, "rollout/tool_error_rate_correct": max(0.3 + slope * step, 0) +
               0.01 * rng.rand(), "rollout/reward_mean": 0.5 + 0.01 * step,
               "rollout/model_tokens_mean": 60 - 0.2 * step}
        if steps == 20 and step == 2:   # no correct trajectory at this step: no rate
          del row["rollout/tool_error_rate_correct"]
        f.write(json.dumps(row) + "\n")
    uniform = p.overrides["rl.downsample.method"] == "uniform"
    with open(os.path.join(p.workdir, "eval_final.json"), "w") as f:
      json.dump({"pass_at_1": 0.7 + 0.01 * p.overrides["seed"],
                 "tool_error_rate_correct": None if uniform else 0.05,
                 "mean_response_tokens": 55.0, "pass_at_k": {"1": 0.7, "4": 0.9}}, f)
  sweep_points.write_manifest(str(tmp_path / "sweep"), pts, lambda p: ["python", "-m", "x"])
  text = _text(_run("01_roc_ablation", tmp_path, sweep_dir=str(tmp_path / "sweep"), smooth=3,
                    early_late=4))
  assert "4 points in" in text and "not finished" in text
  assert "| rl.downsample.method=roc | 2 | 0.705 ± 0.007071 |" in text
  # A missing value is "n/a", never 0, and means skip it saying over how many.
  assert "| rl.downsample.method=uniform | 1 | 0.7 (n=1) | n/a |" in text, text
  assert "| rl.downsample.method=roc | 2 | 0.705 ± 0.007071 | 0.05 ± 0 |" in text, text
  assert "3/4, 4/4" in text   # the uniform arm's first steps: one without a value
  assert "too few steps" in text
  assert "err change" in text


def test_04_async_ablation_reads_a_sweep(tmp_path):
  key = "rl.async_rollouts.max_staleness"
  inflight = "rl.async_rollouts.weight_updates"
  pts = sweep_points.make_points(
      [{key: k, "seed": s} for k in (0, 1, 2) for s in (0, 1, 2)]
      + [{key: 1, inflight: "between_requests", "seed": s} for s in (0, 1)],
      str(tmp_path / "sweep"))
  for p in pts[:8] + pts[9:]:   # k=2, seed 2 has not run yet
    k, seed, arm = p.overrides[key], p.overrides["seed"], inflight in p.overrides
    os.makedirs(os.path.join(p.workdir, "stage1"))
    with open(os.path.join(p.workdir, "stage1", "metrics_rl.jsonl"), "w") as f:
      for step in range(1, 11):
        row = {"step": step, "rollout/reward_mean": 0.4 + 0.02 * step - 0.05 * k + 0.01 * seed,
               "rollout/tool_error_rate_correct": 0.3 - 0.01 * step}
        if k == 1 and step == 3:   # no correct trajectory at this step in any seed: a gap
          del row["rollout/tool_error_rate_correct"]
        if k >= 1:   # k=0, the synchronous loop, logs none of these
          age = min(k, step - 1)   # the schedule: step s trains on version max(s - k, 0)
          row.update({"async/staleness_mean": age, "async/staleness_max": age,
                      "async/stale_dropped_groups": int(k == 2 and seed == 1 and step == 5),
                      "time/rollout_wait_s": 0.5 / k, "async/multi_version_share": 0.5 * arm})
        f.write(json.dumps(row) + "\n")
    with open(os.path.join(p.workdir, "eval_final.json"), "w") as f:
      json.dump({"pass_at_1": {0: 0.70, 1: 0.71, 2: 0.60}[k] + 0.02 * seed + 0.1 * arm,
                 "tool_error_rate_correct": (None if (k, seed) == (0, 1) else
                                             {0: 0.0625, 1: 0.125, 2: 0.25}[k]),
                 "mean_response_tokens": 55.0, "pass_at_k": {"1": 0.7, "4": 0.9}}, f)
  sweep_points.write_manifest(str(tmp_path / "sweep"), pts, lambda p: ["python", "-m", "x"])
  text = _text(_run("04_async_ablation", tmp_path, sweep_dir=str(tmp_path / "sweep"), smooth=3))
  assert "11 points in" in text and "not finished" in text
  # Final evaluation per arm: mean ± std over the finished seeds, "(n=k)" where one is missing.
  assert "| k=0 | 0 1 2 | 3 |  | 0.72 ± 0.02 | 0.0625 ± 0 (n=2) |" in text, text
  assert "| k=1 | 0 1 2 | 3 |  | 0.73 ± 0.02 | 0.125 ± 0 |" in text, text
  assert ("| k=1, weight_updates=between_requests | 0 1 | 2 |  | 0.82 ± 0.01414 | 0.125 ± 0 |"
          in text), text
  assert "| k=2 | 0 1 2 | 2 | 2 (missing) | 0.61 ± 0.01414 (n=2) | 0.25 ± 0 (n=2) |" in text, text
  # Curves: k=0 logged no staleness (n/a, not 0); k=1's error rate has a gap at step 3.
  assert "| async/staleness_mean | n/a (0/10) | 0.9 (10/10) | 0.9 (10/10) | 1.7 (10/10) |" in text
  assert "| rollout/reward_mean | 0.52 (10/10) | 0.47 (10/10) | 0.465 (10/10) | 0.415 (10/10) |" in text
  assert ("| rollout/tool_error_rate_correct | 0.245 (10/10) | 0.2422 (9/10) | 0.2422 (9/10) | "
          "0.245 (10/10) |") in text, text
  # Async metrics pooled over steps: k=1 ages 0,1,1,... (mean 0.9), k=2 0,1,2,2,... (1.7).
  assert "| k=0 | 3 | 30 | n/a | n/a | n/a | n/a | n/a | n/a | n/a |" in text, text
  assert "| k=1 | 3 | 30 | 0.9 | 1 | yes | 0 | n/a | 0.5 | 0 |" in text, text
  assert ("| k=1, weight_updates=between_requests | 2 | 20 | 0.9 | 1 | yes | 0 | n/a | 0.5 | 0.5 |"
          in text), text
  assert "| k=2 | 2 | 20 | 1.7 | 2 | yes | 1 | n/a | 0.25 | 0 |" in text, text
  # The reading, computed: k=1 (0.73) within k=0's 0.72 ± 0.02, k=2 (0.61) below it.
  assert "Asynchrony costs accuracy at this scale" not in text
  assert "**A cost only from k=2 on**" in text, text
  assert ("k=1: 0.73 (+0.01), within the k=0 spread; k=1, weight_updates=between_requests: 0.82 "
          "(+0.1, n=2), above it; k=2: 0.61 (-0.11, n=2), below it") in text, text
  assert "k=2 dropped 1 group(s) past the bound" in text


@pytest.fixture(scope="module")
def toy_policy(tmp_path_factory):
  root = tmp_path_factory.mktemp("toy_policy")
  hf_dir, _, tok = toy_fixtures.toy_export(str(root), seed=0)
  samples = toy_fixtures.write_toy_samples(str(root / "samples.jsonl"), tok, n=6, seed=1)
  return hf_dir, samples


def test_02_entropy_on_a_tiny_policy(toy_policy, tmp_path):
  hf_dir, samples = toy_policy
  text = _text(_run("02_entropy", tmp_path, hf_dir=hf_dir, trajectories=samples, top_q=0.25,
                    window=4, limit=0, chunk=64))
  assert "6 trajectories" in text and "forking tokens" in text
  assert "reflection share of the selected" in text


def test_00_quickstart_runs_from_a_fresh_work_directory(tmp_path):
  """No prior run, no export: the notebook runs the README's first run itself, then rolls
  out the model it trained with the sandbox and scores it."""
  workdir = tmp_path / "fresh"
  nb = _run("00_quickstart", tmp_path, workdir=str(workdir), num_problems=2,
            samples_per_problem=2)
  text = _text(nb)
  assert "$ python -m experiments.recipe --config experiments/configs/toy.py:first_run" in text
  assert "Evaluation: after_sft (64 problems, 256 samples)" in text
  assert "Evaluation: final (64 problems, 256 samples)" in text and "pass@1 after SFT" in text
  assert os.path.isdir(workdir / "stage1" / "export")
  assert "step 1: reward_mean" in text   # the RL stage's rows, and their plot
  assert any(o.get("data", {}).get("image/png") for c in nb.cells for o in c.get("outputs", []))
  assert "'status': 'ok', 'stdout': '120\\n'" in text   # the call by hand ran in the sandbox
  assert "toy-eval-0" in text and "rewards [" in text and "rollout/reward_mean" in text
  assert " pos     id mask  logprob  token" in text


def test_03_perf_from_the_benchmarks_json(tmp_path):
  env = dict(os.environ, PYTHONPATH=REPO)
  out = {k: str(tmp_path / f"bench_{k}.json") for k in ("sandbox", "model", "rollout")}
  commands = {
      "sandbox": [sys.executable, "-m", "experiments.benchmarks.bench_sandbox", "--quick",
                  "--nobaseline", "--spin_rounds=1", f"--out={out['sandbox']}"],
      "model": [sys.executable, "-m", "experiments.benchmarks.bench_model", "--layers=1",
                "--hidden=32", "--heads=4", "--kv_heads=2", "--vocab=128", "--seq=16",
                "--batch=2", "--repeats=1", f"--out={out['model']}"],
      "rollout": [sys.executable, "-m", "experiments.benchmarks.bench_rollout", "--preset=tiny",
                  "--batch=2", "--prompt_len=8", "--new_tokens=4", "--repeats=1",
                  "--trajectories=4", "--slots=4", "--max_len=256", "--max_turns=2",
                  "--max_response_tokens=64",
                  "--calls_per_traj=1", "--think_tokens=4", "--sandbox_children=2",
                  # One decode step a call and one request a prefill, each shape compiled
                  # when first met: 19 shapes compiled up front took ~19 s of the test
                  # (the engine's tests cover warm_up and the other shapes).
                  "--decode_steps=1", "--prefill_batch_tokens=0", "--nowarm_up",
                  f"--out={out['rollout']}"],
  }
  def run(cmd):
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    done = dict(zip(commands, pool.map(run, commands.values())))
  for k, r in done.items():
    assert r.returncode == 0 and os.path.exists(out[k]), (k, r.stdout[-2000:], r.stderr[-2000:])
  text = _text(_run("03_sandbox_and_engine_perf", tmp_path, sandbox_json=out["sandbox"],
                    model_json=out["model"], rollout_json=out["rollout"]))
  assert "| sandbox service | print(1+1) | 1 |" in text and "share_of_limit" in text
  assert "ratio jax/torch" in text and "(a) batch 2, prompt 8" in text and "(b) 4 trajectories" in text
  assert "roofline: measured matmul peak" in text and "of the binding limit" in text
  # A missing file names the command that makes it, and the rest still runs.
  text = _text(_run("03_sandbox_and_engine_perf", tmp_path, sandbox_json=out["sandbox"],
                    model_json=str(tmp_path / "none.json"), rollout_json=out["rollout"]))
  assert "none.json: not there; make it with" in text
  assert "python -m experiments.benchmarks.bench_model" in text
