"""Bad command lines of the experiment scripts end in one line naming what is wrong.
Zero counts are refused when the flags are parsed, not after a benchmark's work
(they raised StatisticsError / IndexError / ZeroDivisionError at the end)."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("cmd", [
    ["-m", "experiments.benchmarks.bench_model", "--repeats=0"],
    ["-m", "experiments.gpu_smoke", "--micro_batches=0"],
    ["-m", "experiments.benchmarks.bench_sandbox", "--spin_rounds=0"],
])
def test_zero_counts_are_flag_errors(cmd):
  out = subprocess.run([sys.executable, *cmd], cwd=REPO, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"))
  flag = cmd[-1].split("=")[0]
  assert out.returncode != 0 and f"flag {flag}=0: 0 is not a positive integer" in out.stderr
  assert "Traceback" not in out.stderr


@pytest.mark.parametrize("args, message", [
    (["--tiny", "--mesh", "fsdp=x"], "the size of 'fsdp' must be an integer, got 'x'"),
    (["--preset", "bogus"], "Unknown model preset 'bogus'"),
])
def test_gpu_smoke_names_a_bad_mesh_or_preset(args, message):
  out = subprocess.run([sys.executable, "-m", "experiments.gpu_smoke", *args], cwd=REPO,
                       capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"))
  assert out.returncode == 1 and "gpu_smoke: " in out.stderr and message in out.stderr
  assert "Traceback" not in out.stderr


@pytest.mark.parametrize("args, message", [
    (["--config.meshes=fsdp=x"], "mesh spec 'fsdp=x': expected comma-separated axis=size"),
    (["--config.preset=bogus"], "Unknown model preset 'bogus'"),
    (["--config.response_lens=a"], "config.response_lens='a': expected comma-separated ints"),
])
def test_plan_memory_runs_on_its_default_config_and_names_a_bad_case(args, message):
  # Its --config has a default (no "--config is required"), and a bad case is one line
  # before any compile.
  out = subprocess.run([sys.executable, "-m", "experiments.plan_memory", *args], cwd=REPO,
                       capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"))
  assert out.returncode == 2 and f"config error: {message}" in out.stderr, out.stderr[-2000:]
  assert "Traceback" not in out.stderr and "--config is required" not in out.stderr
