"""experiments/preflight.py: the 14B layout stated once, its memory checked before launch.

The byte counts are checked against a hand calculation from Qwen3-14B's published shapes
and against the abstract model's parameter shapes; the CLI runs as a real process (the
14B train step compiled ahead of time on 64 fake CPU devices, ~15 s on 2 cores).
"""
import os
import subprocess
import sys

import pytest

from experiments import preflight as pf
from rstar_jax import config_utils
from rstar_jax.model import config as model_config
from rstar_jax.rollout import backends
from rstar_jax.rollout.jax_engine import EngineConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = os.path.join(REPO, "experiments/configs/rstar2_agent_14b.py")
GB = 1e9

# Qwen3-14B's config.json: 40 layers, hidden 5120, 40 query heads, 8 KV heads of 128,
# MLP 17408, vocabulary 151936, untied input and output embeddings.
L, H, Q, KV, D, I, V = 40, 5120, 40, 8, 128, 17408, 151936
PER_LAYER = (H * Q * D + 2 * H * KV * D + Q * D * H   # q, k, v, o projections
             + 3 * H * I                              # gate, up, down
             + 2 * H + 2 * D)                         # two RMSNorms, q_norm and k_norm
PARAMS = L * PER_LAYER + 2 * V * H + H                # embedding, lm_head, final norm


def _run(*args, timeout=600):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}   # the CLI fakes 64
  return subprocess.run([sys.executable, "-m", "experiments.preflight", "--config", CFG, *args],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_bytes_equal_a_hand_calculation():
  cfg = model_config.get_preset("qwen3-14b")
  assert cfg.num_params == PARAMS == 14_768_307_200
  assert pf.kv_bytes_per_token(cfg) == L * KV * D * 2 * 2 == 160 * 1024
  assert pf.weight_bytes(cfg, "bfloat16") == 2 * PARAMS      # 29.5 GB
  assert pf.weight_bytes(cfg, "float32") == 4 * PARAMS
  assert pf.optimizer_bytes(cfg) == 8 * PARAMS               # AdamW's mu and nu, f32
  assert pf.checkpoint_bytes(cfg) == 12 * PARAMS             # 177.2 GB
  # The parameter count from the model's own shapes, not the config's formula.
  import jax
  import numpy as np
  from flax import nnx
  from rstar_jax.model import qwen3
  _, state = nnx.split(qwen3.abstract_model(cfg))
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state)) == PARAMS
  # One JaxEngine of the old 14B config: 64 slots x 13,312 tokens.
  mem = pf.jax_engine_memory(cfg, num_slots=64, max_len=13_312, device_bytes=192 * GB)
  assert mem.kv_bytes == 64 * 13_312 * L * KV * D * 2 * 2    # 139.6 GB
  srv = pf.sglang_server_memory(cfg, device_bytes=192 * GB, mem_fraction=0.85, max_len=13_312)
  assert srv.weight_bytes == 2 * PARAMS
  assert srv.kv_tokens == int((0.85 * 192e9 - 2 * PARAMS) // (160 * 1024))
  assert srv.concurrent == srv.kv_tokens // 13_312


def test_the_old_engine_on_one_device_is_refused_naming_the_field():
  """64 slots x 13,312 tokens: 139.6 GB of KV on the device that also holds the weights
  the engine generates with (the config's float32 parameters: 59 GB)."""
  cfg = model_config.get_preset("qwen3-14b", dtype="bfloat16")   # the cache's dtype
  old = backends.RolloutConfig(backend="jax", engine=EngineConfig(num_slots=64, max_len=13_312))
  weights = pf.weight_bytes(cfg, "float32")
  for accel, hbm in pf.ACCELERATORS.items():
    problems = pf.check_rollout_memory(cfg, old, device_bytes=hbm * GB,
                                       trainer_resident_bytes=weights)
    assert [p.field for p in problems] == ["rollout.engine.num_slots"], accel
    assert "139.6 GB" in problems[0].message and "at most" in problems[0].message
  # What fits is said: at most that many slots, and they do fit.
  room = 0.9 * 192 * GB - weights
  fit = int(room // (13_312 * 160 * 1024))
  assert f"at most {fit} slot(s)" in str(pf.check_rollout_memory(
      cfg, old, device_bytes=192 * GB, trainer_resident_bytes=weights)[0])
  ok = backends.RolloutConfig(backend="jax", engine=EngineConfig(num_slots=fit, max_len=13_312))
  assert not pf.check_rollout_memory(cfg, ok, device_bytes=192 * GB,
                                     trainer_resident_bytes=weights)
  # SGLang on one GPU of each kind holds the bf16 weights and >= one trajectory.
  sg = backends.RolloutConfig(backend="sglang", servers=("http://x:1",),
                              engine=EngineConfig(max_len=13_312))
  for hbm in pf.ACCELERATORS.values():
    assert not pf.check_rollout_memory(cfg, sg, device_bytes=hbm * GB)
  # 0.35 x 80 GB < 29.5 GB of weights; 0.38 x 80 GB leaves 0.9 GB: 5,200 tokens < 13,312.
  for fraction, field in ((0.35, "layout.gpus_per_server"), (0.38, "layout.sglang_mem_fraction")):
    tight = pf.check_rollout_memory(cfg, sg, device_bytes=80 * GB, sglang_mem_fraction=fraction)
    assert [p.field for p in tight] == [field], fraction
  assert not pf.check_rollout_memory(cfg, sg, device_bytes=80 * GB, sglang_mem_fraction=0.38,
                                     gpus_per_server=2)


def test_the_config_states_the_layout_once():
  from rstar_jax.recipe import cluster
  from rstar_jax.recipe import stages as recipe
  layout = config_utils.build(pf.Layout, config_utils._load_config_file(CFG + ":layout"))
  assert (layout.trainer_devices, layout.rollout_servers, layout.sandbox_servers) == (32, 32, 4)
  c = config_utils._load_config_file(CFG)
  assert (c.mesh.data, c.mesh.fsdp, c.mesh.tensor) == (1, 8, 4)
  assert c.mesh.data * c.mesh.fsdp * c.mesh.tensor == layout.trainer_devices
  assert c.rollout.backend == "sglang"
  fleet = config_utils.build(cluster.ClusterConfig,
                             config_utils._load_config_file(CFG + ":cluster").cluster)
  assert (fleet.rollout_servers, fleet.trainer_processes, fleet.sandbox_servers) == (32, 4, 4)
  assert fleet.trainer_gpus == 8 and fleet.rollout_gpus == 1
  assert fleet.rollout_backend == "sglang" and fleet.trainer_config.endswith("rstar2_agent_14b.py")
  assert " ".join(fleet.rollout_args) == ("--tp-size 1 --dtype bfloat16 --mem-fraction-static "
                                          "0.85 --context-length 13312")
  with pytest.raises(ValueError, match="unknown variant"):
    config_utils._load_config_file(CFG + ":nope")
  # The training shapes the preflight plans: SFT 128 rows of 8192 at one row per shard;
  # every RL stage's batch capped at 13,312 (the servers' context), 8,192 rows, 4 a shard.
  c.model.hf_dir, c.tokenizer.path, c.rollout.servers = "/m", "/m", ("http://n:1",)
  c.data.train_files = ("/d.parquet",)
  shapes = pf.train_shapes(recipe.build_config(c), batch_shards=8)
  got = {(s.name, s.seq_len, s.rows, s.micro_batch) for s in shapes}
  assert got == {("sft", 8192, 128, 1), ("stage1,2,3", 13312, 8192, 4),
                 ("stage1,2,3 +KL ref", 13312, 8192, 4)}


def test_cli_accepts_the_chosen_layout_with_its_plan():
  out = _run()
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  text = out.stdout
  assert "verdict: fits" in text and "trainer not compiled" not in text
  assert "mesh fsdp 8 x tensor 4" in text and "32 servers" in text
  assert "KV 163,840 bytes/token" in text and "= 61 trajectories of max_len 13312" in text
  for shape in ("sft ", "stage1,2,3 ", "stage1,2,3 +KL ref"):
    row = next(line for line in text.splitlines() if line.strip().startswith(shape))
    assert row.rstrip().endswith("yes"), row
  assert "checkpoint: 177.2 GB" in text and "29.5 GB (bfloat16) written" in text


def test_cli_refuses_a_misfit_with_exit_2_naming_the_field():
  # The old engine (64 slots) with the in-process backend, on H200s: two problems.
  out = _run("--plan=false", "--config.rollout.backend=jax",
             "--config.rollout.engine.num_slots=64",
             f"--layout={CFG}:layout", "--layout.accelerator=H200")
  assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
  verdict = out.stdout.split("verdict: does not fit", 1)[1]
  assert "rollout.backend: 'jax'" in verdict
  assert "rollout.engine.num_slots: the JaxEngine KV cache (851,968 tokens: 139.6 GB)" in verdict
  # The layout for the batch script: the same checks, then shell assignments.
  out = _run("--print_layout")
  assert out.returncode == 0, out.stderr[-3000:]
  assert "TRAINER_NODES=4\n" in out.stdout and "SERVERS_PER_NODE=8\n" in out.stdout
  out = _run("--print_layout", "--config.mesh.tensor=2")
  assert out.returncode == 2 and "config error: mesh.fsdp: mesh" in out.stderr, out.stderr
