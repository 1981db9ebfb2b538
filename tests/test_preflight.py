"""experiments/preflight.py: the 14B layout stated once, its memory checked before launch.

The byte counts are checked against a hand calculation from Qwen3-14B's published shapes
and against the abstract model's parameter shapes; the CLI runs as a real process (the
14B train step compiled ahead of time on 64 fake CPU devices, ~15 s on 2 cores).
"""
import json
import os
import subprocess
import sys

import pytest

from experiments import preflight as pf
from rstar_jax.recipe import layout as layout_lib
from rstar_jax.recipe import preflight_checks as checks
from rstar_jax import config_utils
from rstar_jax.model import model_config
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
  assert checks.kv_bytes_per_token(cfg) == L * KV * D * 2 * 2 == 160 * 1024
  assert checks.weight_bytes(cfg, "bfloat16") == 2 * PARAMS      # 29.5 GB
  assert checks.weight_bytes(cfg, "float32") == 4 * PARAMS
  assert checks.optimizer_bytes(cfg) == 8 * PARAMS               # AdamW's mu and nu, f32
  assert checks.checkpoint_bytes(cfg) == 12 * PARAMS             # 177.2 GB
  # The parameter count from the model's own shapes, not the config's formula.
  import jax
  import numpy as np
  from flax import nnx
  from rstar_jax.model import qwen3
  _, state = nnx.split(qwen3.abstract_model(cfg))
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state)) == PARAMS
  # One JaxEngine of the old 14B config: 64 slots x 13,312 tokens.
  mem = checks.jax_engine_memory(cfg, num_slots=64, max_len=13_312, device_bytes=192 * GB)
  assert mem.kv_bytes == 64 * 13_312 * L * KV * D * 2 * 2    # 139.6 GB
  srv = checks.sglang_server_memory(cfg, device_bytes=192 * GB, mem_fraction=0.85, max_len=13_312)
  assert srv.weight_bytes == 2 * PARAMS
  assert srv.kv_tokens == int((0.85 * 192e9 - 2 * PARAMS) // (160 * 1024))
  assert srv.concurrent == srv.kv_tokens // 13_312


def test_the_old_engine_on_one_device_is_refused_naming_the_field():
  """64 slots x 13,312 tokens: 139.6 GB of KV on the device that also holds the weights
  the engine generates with (the config's float32 parameters: 59 GB)."""
  cfg = model_config.get_preset("qwen3-14b", dtype="bfloat16")   # the cache's dtype
  old = backends.RolloutConfig(backend="jax", engine=EngineConfig(num_slots=64, max_len=13_312))
  weights = checks.weight_bytes(cfg, "float32")
  for accel, hbm in layout_lib.ACCELERATORS.items():
    problems = checks.check_rollout_memory(cfg, old, device_bytes=hbm * GB,
                                       trainer_resident_bytes=weights)
    assert [p.field for p in problems] == ["rollout.engine.num_slots"], accel
    assert "139.6 GB" in problems[0].message and "at most" in problems[0].message
  # What fits is said: at most that many slots, and they do fit.
  room = 0.9 * 192 * GB - weights
  fit = int(room // (13_312 * 160 * 1024))
  assert f"at most {fit} slot(s)" in str(checks.check_rollout_memory(
      cfg, old, device_bytes=192 * GB, trainer_resident_bytes=weights)[0])
  ok = backends.RolloutConfig(backend="jax", engine=EngineConfig(num_slots=fit, max_len=13_312))
  assert not checks.check_rollout_memory(cfg, ok, device_bytes=192 * GB,
                                     trainer_resident_bytes=weights)
  # SGLang on one GPU of each kind holds the bf16 weights and >= one trajectory.
  sg = backends.RolloutConfig(backend="sglang", servers=("http://x:1",),
                              engine=EngineConfig(max_len=13_312))
  for hbm in layout_lib.ACCELERATORS.values():
    assert not checks.check_rollout_memory(cfg, sg, device_bytes=hbm * GB)
  # 0.35 x 80 GB < 29.5 GB of weights; 0.38 x 80 GB leaves 0.9 GB: 5,200 tokens < 13,312.
  for fraction, field in ((0.35, "layout.gpus_per_server"), (0.38, "layout.sglang_mem_fraction")):
    tight = checks.check_rollout_memory(cfg, sg, device_bytes=80 * GB, sglang_mem_fraction=fraction)
    assert [p.field for p in tight] == [field], fraction
  assert not checks.check_rollout_memory(cfg, sg, device_bytes=80 * GB, sglang_mem_fraction=0.38,
                                     gpus_per_server=2)


def test_the_config_states_the_layout_once():
  from rstar_jax.recipe import cluster
  from rstar_jax.recipe import recipe_config
  layout = config_utils.build(layout_lib.Layout, config_utils._load_config_file(CFG + ":layout"))
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
  shapes = pf.train_shapes(recipe_config.build_config(c), batch_shards=8)
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
  # Over the layout's 32-device mesh the engine would split its cache (fsdp 8 x tensor 4):
  # 4.4 GB a device fits; the in-process backend across processes is what is refused.
  assert "rollout.engine.num_slots" not in verdict, verdict
  # On one device the same engine is refused by its cache alone.
  out = _run("--plan=false", "--config.rollout.backend=jax",
             "--config.rollout.engine.num_slots=64", "--config.mesh.enabled=False",
             f"--layout={CFG}:layout", "--layout.accelerator=H200", "--layout.nodes=1",
             "--layout.gpus_per_node=1", "--layout.trainer_nodes=1",
             "--layout.servers_per_node=0")
  assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
  verdict = out.stdout.split("verdict: does not fit", 1)[1]
  assert "rollout.engine.num_slots: the JaxEngine KV cache (851,968 tokens: 139.6 GB)" in verdict
  assert "rollout.backend: 'jax'" not in verdict, verdict
  # The layout for the batch script: the same checks, then shell assignments.
  out = _run("--print_layout")
  assert out.returncode == 0, out.stderr[-3000:]
  assert "TRAINER_NODES=4\n" in out.stdout and "SERVERS_PER_NODE=8\n" in out.stdout
  out = _run("--print_layout", "--config.mesh.tensor=2")
  assert out.returncode == 2 and "config error: mesh.fsdp: mesh" in out.stderr, out.stderr


def test_the_preflight_reads_the_architecture_with_the_config_s_size_overrides():
  """The architecture the recipe builds: the preset with every size the config overrides
  (the tiny preset has 2 KV heads; 4 here), and the 14B rehearsal's sizes over the
  --preset fallback when the config names no preset."""
  c = config_utils._load_config_file(CFG)
  c.model.update(preset="tiny", num_key_value_heads=4, num_hidden_layers=3)
  arch = pf.model_config_of(c, "qwen3-14b")
  assert (arch.num_key_value_heads, arch.num_hidden_layers, arch.hidden_size) == (4, 3, 64)
  assert checks.kv_bytes_per_token(arch) == 2 * 3 * 4 * 16 * 2
  rehearsal = config_utils._load_config_file(
      os.path.join(REPO, "experiments/configs/rstar2_agent_14b_rehearsal.py"))
  assert rehearsal.model.preset is None     # its hf_dir (the SFT export) comes at launch
  arch = pf.model_config_of(rehearsal, "qwen3-14b")
  assert (arch.num_hidden_layers, arch.hidden_size, arch.num_key_value_heads,
          arch.head_dim) == (2, 64, 4, 16)
  # A checkpoint's config.json, when model.hf_dir holds one, is what the recipe loads.
  import tempfile
  from rstar_jax.model import hf_io
  with tempfile.TemporaryDirectory() as d:
    with open(os.path.join(d, "config.json"), "w") as f:
      json.dump(hf_io.config_to_hf_dict(model_config.get_preset("small"), "float32"), f)
    rehearsal.model.hf_dir = d
    assert pf.model_config_of(rehearsal, "qwen3-14b").num_key_value_heads == 4
    assert pf.model_config_of(rehearsal, "qwen3-14b").hidden_size == 256


def _recipe(*args, timeout=300):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  return subprocess.run([sys.executable, "-m", "experiments.recipe", "--config", CFG, *args],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_recipe_refuses_an_engine_that_cannot_fit_at_start_without_loading_weights(
    tmp_path):
  """The 14B config with the in-process engine of 64 slots x 13,312 on one device: the
  recipe's start check (the preflight's rollout-memory check) ends it with exit 2 naming
  the field, the bytes and the fix. The checkpoint directory holds Qwen3-14B's
  config.json and no weights: a run that got as far as loading them would fail otherwise."""
  from rstar_jax.model import hf_io
  ckpt = tmp_path / "qwen3-14b"
  ckpt.mkdir()
  (ckpt / "config.json").write_text(json.dumps(hf_io.config_to_hf_dict(
      model_config.get_preset("qwen3-14b"), "bfloat16")))
  (tmp_path / "train.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
  out = _recipe("--config.rollout.backend=jax", "--config.rollout.engine.num_slots=64",
                "--config.mesh.enabled=False", f"--config.model.hf_dir={ckpt}",
                f"--config.tokenizer.path={ckpt}", f"--config.workdir={tmp_path / 'run'}",
                f"--config.data.train_files=('{tmp_path / 'train.jsonl'}',)", "--stages=stage1")
  assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
  err = out.stderr
  assert ("config error: rollout.engine.num_slots: the JaxEngine KV cache (851,968 tokens: "
          "139.6 GB)") in err, err[-3000:]
  assert "fix:" in err and "rollout.backend=sglang" in err, err[-3000:]
  # Nothing was started or written: no sandbox, no work directory, no config.json.
  assert "local sandbox server" not in out.stdout + err, err[-3000:]
  assert not (tmp_path / "run").exists()


def test_an_sft_only_run_of_the_14b_config_needs_no_rollout_servers(tmp_path):
  """SFT (without its evaluation) generates nothing: the 14B config builds without
  rollout.servers for --stages=sft, and refuses to for a stage that generates, naming the
  field. One SFT step of the rehearsal's tiny model runs so, from the config with no
  servers."""
  from rstar_jax.recipe import recipe_config
  c = config_utils._load_config_file(CFG)
  c.model.hf_dir, c.tokenizer.path = "/m", "/m"
  c.data.train_files = ("/d.parquet",)
  assert not c.rollout.servers and c.rollout.backend == "sglang"
  assert not recipe_config.generates(c, ["sft"]) and recipe_config.generates(c, ["sft", "stage1"])
  cfg = recipe_config.build_config(c, ["sft"])
  assert cfg.rollout.servers == recipe_config.NO_SERVERS
  with pytest.raises(config_utils.ConfigError, match="RolloutConfig.servers is empty"):
    recipe_config.build_config(c, ["sft", "stage1"])
  c.eval.after_sft = True              # SFT's own evaluation generates
  with pytest.raises(config_utils.ConfigError, match="RolloutConfig.servers is empty"):
    recipe_config.build_config(c, ["sft"])
  rehearsal = os.path.join(REPO, "experiments/configs/rstar2_agent_14b_rehearsal.py")
  assert not config_utils._load_config_file(rehearsal + ":sft").rollout.servers
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run(
      [sys.executable, "-m", "experiments.recipe", "--config", rehearsal + ":sft",
       "--config.mesh.enabled=False", "--config.sft.epochs=0.01",
       f"--config.workdir={tmp_path}", "--stages=sft"],
      cwd=REPO, env=dict(env, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  done = json.loads((tmp_path / "sft" / "DONE.json").read_text())
  assert done["steps"] >= 1 and (tmp_path / "sft" / "export" / "config.json").exists()
