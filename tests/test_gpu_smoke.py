"""experiments/gpu_smoke.py in its CPU mode: the script a GPU host runs first. Its first
step's loss is checked against numpy on the same weights and batch."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _reference_first_loss():
  """The clip-higher token-mean loss of the tiny model's first step, from full logits
  in float64 (numpy), with the report's defaults eps_low 0.2, eps_high 0.28."""
  from experiments.common import step_timing
  from rstar_jax.model import model_config, qwen3
  cfg = model_config.get_preset("tiny", hidden_size=64, intermediate_size=128, head_dim=16,
                                num_hidden_layers=2, vocab_size=512)
  batch = step_timing.random_batch(cfg.vocab_size, 4, 64, row_multiple=4, length_multiple=8)
  model = qwen3.create_model(cfg, seed=0)
  logits = np.asarray(qwen3.forward_logits(model, batch["input_ids"]), np.float64)
  logits -= logits.max(-1, keepdims=True)
  logp_all = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  total, count = 0.0, 0
  for b in range(logp_all.shape[0]):
    a = float(batch["advantages"][b])
    for t in range(logp_all.shape[1]):
      if batch["loss_mask"][b, t]:
        ratio = np.exp(logp_all[b, t, batch["target_ids"][b, t]] - batch["old_logp"][b, t])
        total += -min(ratio * a, np.clip(ratio, 0.8, 1.28) * a)
        count += 1
  return total / count


def test_gpu_smoke_tiny_on_a_two_by_two_cpu_mesh(tmp_path):
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=4")
  out = tmp_path / "smoke.json"
  run = subprocess.run([sys.executable, "-m", "experiments.gpu_smoke", "--tiny", "--steps=2",
                        "--mesh=data=2,fsdp=2", f"--out={out}"], cwd=REPO, env=env,
                       capture_output=True, text=True)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  assert "4 device(s):" in run.stdout and "MFU" in run.stdout
  r = json.load(open(out))
  assert r["mesh"] == {"data": 2, "fsdp": 2, "tensor": 1} and len(r["devices"]) == 4
  np.testing.assert_allclose(r["loss"][0], _reference_first_loss(), rtol=1e-4)
  # Model FLOPs by hand (6 x matmul params + 12 L q S per token) and the MFU from them.
  h, i, layers, q, kv, v, seq = 64, 128, 2, 4 * 16, 2 * 16, 512, 64
  per_token = 6 * (layers * (2 * h * q + 2 * h * kv + 3 * h * i) + h * v) + 12 * layers * q * seq
  assert r["flops"] == per_token * 4 * seq
  assert r["tokens_per_s"] == 4 * seq / r["median_s"]
  assert r["achieved_gflops"] == r["flops"] / r["median_s"] / 1e9
  (peak_name, mfu), = r["mfu"].items()
  assert mfu == r["achieved_gflops"] / r["peaks_gflops"][peak_name]
  # The causal half of the attention FLOPs (MaxText's convention), labelled beside it.
  causal = per_token - 6 * layers * q * seq
  assert r["flops_causal_attention"] == causal * 4 * seq
  both = r["mfu_both"][peak_name]
  assert both["full_attention"] == pytest.approx(mfu)
  assert both["causal_attention"] == pytest.approx(
      causal * 4 * seq / r["median_s"] / 1e9 / r["peaks_gflops"][peak_name])
  assert "(attention FLOPs in full)" in run.stdout and "(causal half)" in run.stdout
  bad = subprocess.run([sys.executable, "-m", "experiments.gpu_smoke", "--tiny", "--steps=1",
                        "--mesh=data=3"], cwd=REPO, env=env, capture_output=True, text=True)
  assert bad.returncode != 0
