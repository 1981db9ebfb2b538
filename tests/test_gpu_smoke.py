"""experiments/gpu_smoke.py in its CPU mode: the script a GPU host runs first."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_smoke_tiny_on_a_two_by_two_cpu_mesh(tmp_path):
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=4")
  out = tmp_path / "smoke.json"
  run = subprocess.run([sys.executable, "-m", "experiments.gpu_smoke", "--tiny", "--steps=2",
                        "--mesh=data=2,fsdp=2", f"--out={out}"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  assert "4 device(s):" in run.stdout and "MFU" in run.stdout
  r = json.load(open(out))
  assert r["mesh"] == {"data": 2, "fsdp": 2, "tensor": 1} and len(r["devices"]) == 4
  assert r["flops"] > 0 and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
  assert all(abs(x) < 1e3 for x in r["loss"])
  bad = subprocess.run([sys.executable, "-m", "experiments.gpu_smoke", "--tiny", "--steps=1",
                        "--mesh=data=3"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
  assert bad.returncode != 0
