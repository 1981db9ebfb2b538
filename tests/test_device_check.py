"""experiments/device_check.py in its CPU mode (--tiny): every section runs, the report's
schema, and a failing or crashing section is recorded while the others still run."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ("env", "numerics", "train_step", "memory", "rollouts", "hf_io", "recipe")
CHECK_KEYS = {"name", "value", "target", "met", "note", "section"}


def _env(tmp_path):
  # Two host devices: the train step runs on a real (fsdp=2) mesh.
  return dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu",
              XLA_FLAGS="--xla_force_host_platform_device_count=2",
              TMPDIR=str(tmp_path))


def _run(tmp_path, *args):
  out = tmp_path / "out"
  run = subprocess.run([sys.executable, "-m", "experiments.device_check", "--tiny",
                        f"--out={out}", f"--xla_cache={tmp_path / 'cache'}", *args],
                       cwd=REPO, env=_env(tmp_path), capture_output=True, text=True,
                       timeout=1500)
  return run, out


@pytest.fixture(scope="module")
def full(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("device_check")
  run, out = _run(tmp, "--recipe_overrides=--config.eval.k=1")
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  with open(out / "device_check.json") as f:
    return json.load(f), (out / "device_check.md").read_text(), out


def test_every_section_runs_and_no_target_is_missed_on_cpu(full):
  report, _, _ = full
  assert list(report["sections"]) == list(SECTIONS)
  failed = {n: r.get("error") for n, r in report["sections"].items() if not r["ok"]}
  assert not failed, failed
  assert report["failed_sections"] == []
  # Targets that apply on a CPU (numerics, equal losses across attention kernels, the
  # HF round trip, the sandbox's tool calls, the recipe's exit) are met; GPU-only ones
  # say n/a rather than passing.
  missed = [c for c in report["checks"] if c["met"] is False]
  assert not missed, missed
  by_name = {c["name"]: c for c in report["checks"]}
  assert by_name["gradient cosine similarity"]["met"] is True
  assert by_name["dot_product loss vs blockwise, rel. diff"]["met"] is True
  assert by_name["dot_product speed / blockwise speed"]["met"] is None   # a GPU target
  assert any(c["name"].startswith("MFU") and c["met"] is None for c in report["checks"])


def test_report_schema(full):
  report, md, out = full
  assert sorted(os.listdir(out)) == ["device_check.json", "device_check.md"]
  for key in ("schema", "date", "commit", "command", "tiny", "load_average", "sections",
              "total_s", "checks", "failed_sections", "device"):
    assert key in report, key
  assert report["schema"] == 1 and report["tiny"] is True and report["device"] == "cpu"
  for name, r in report["sections"].items():
    assert r["ok"] is True and r["wall_s"] > 0 and r["seconds"] > 0, name
  for c in report["checks"]:
    assert set(c) == CHECK_KEYS, c
    assert c["met"] in (True, False, None)
  env = report["sections"]["env"]
  assert env["backend"] == "cpu" and len(env["devices"]) == 2
  assert env["missing_packages"] == [] and env["matmul_peak_gflops"] > 0
  runs = report["sections"]["train_step"]["runs"]
  assert [(r["attention_impl"], r["seq"]) for r in runs] == [
      ("chunked", 64), ("blockwise", 64), ("dot_product", 64), ("chunked", 96)]
  # The same weights and batch give the same first loss under every attention kernel.
  first = [r["loss"][0] for r in runs if r["seq"] == 64]
  assert max(first) - min(first) <= 2e-2 * max(abs(x) for x in first), first
  # Model FLOPs of the tiny slice by hand: 6 x matmul params + 12 L q S, per token.
  h, i, layers, q, kv, v = 64, 128, 2, 4 * 16, 2 * 16, 512
  params = layers * (2 * h * q + 2 * h * kv + 3 * h * i) + h * v
  for r in runs:
    tokens = r["batch"] * r["seq"]
    assert r["flops"] == (6 * params + 12 * layers * q * r["seq"]) * tokens
  memory = report["sections"]["memory"]
  assert memory["plans"]["cpu_host"]["peak_bytes"] > memory["plans"]["cpu_host"]["state_bytes"]
  agent = report["sections"]["rollouts"]["agent"]
  assert agent["trajectories"] == 4 and agent["tool_calls"] >= 8
  assert report["sections"]["recipe"]["returncode"] == 0
  for name in SECTIONS:
    assert f"| {name} | yes |" in md


def test_a_failing_and_a_crashing_section_are_recorded_and_the_rest_run(tmp_path):
  run, out = _run(tmp_path, "--sections=env,numerics,hf_io", "--inject_failure=numerics")
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.load(open(out / "device_check.json"))
  assert report["failed_sections"] == ["numerics"]
  assert "injected" in report["sections"]["numerics"]["error"]
  assert "RuntimeError" in report["sections"]["numerics"]["traceback"]
  assert report["sections"]["env"]["ok"] and report["sections"]["hf_io"]["ok"]
  assert "| numerics | NO |" in (out / "device_check.md").read_text()

  run, out = _run(tmp_path, "--sections=numerics,hf_io", "--inject_failure=crash:numerics")
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.load(open(out / "device_check.json"))
  assert report["sections"]["numerics"]["error"] == (
      "the section's process exited 3 without a result")
  assert report["sections"]["hf_io"]["ok"]


def test_unknown_section_is_refused(tmp_path):
  run, _ = _run(tmp_path, "--sections=env,warp_drive")
  assert run.returncode != 0 and "warp_drive" in run.stderr
