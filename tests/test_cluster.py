"""rstar_jax.cluster without Ray: the launch config's checks and the commands it builds.
(The fleet itself runs on a real local Ray cluster in tests/test_recipe.py.)"""
import ast

import pytest

from rstar_jax import cluster


def test_config_checks_name_the_field():
  with pytest.raises(ValueError, match="rollout_backend='vllm'"):
    cluster.ClusterConfig(rollout_backend="vllm", rollout_hf_dir="/m")
  with pytest.raises(ValueError, match="rollout_hf_dir"):
    cluster.ClusterConfig(rollout_servers=1)
  with pytest.raises(ValueError, match="sandbox_servers must be >= 0"):
    cluster.ClusterConfig(sandbox_servers=-1, rollout_servers=0)
  with pytest.raises(ValueError, match="trainer_gpus must be >= 0"):
    cluster.ClusterConfig(rollout_servers=0, trainer_gpus=-1)
  cluster.ClusterConfig(rollout_servers=0)   # servers-only fleets need no checkpoint


def test_server_commands():
  cfg = cluster.ClusterConfig(rollout_hf_dir="/ckpt", rollout_args=("--num_slots", "8"),
                              sandbox_args=("--max-children", "64"))
  sb = cluster.server_command("sandbox", cfg, "10.0.0.1", 8321)
  assert sb[1:] == ["-m", "sandbox.server", "--host", "10.0.0.1", "--port", "8321",
                    *(["--allow-weak-isolation"] if "--allow-weak-isolation" in sb else []),
                    "--max-children", "64"]
  ours = cluster.server_command("rollout", cfg, "10.0.0.1", 30000)
  assert ours[1:5] == ["-m", "rstar_jax.rollout.server", "--hf_dir", "/ckpt"]
  assert ours[-2:] == ["--num_slots", "8"]
  sg = cluster.server_command("rollout", cluster.ClusterConfig(
      rollout_backend="sglang", rollout_hf_dir="/ckpt"), "h", 30001)
  assert sg[1:] == ["-m", "sglang.launch_server", "--model-path", "/ckpt", "--host", "h",
                    "--port", "30001"]


def test_url_tuples_are_config_literals():
  urls = ["http://a:1", "http://b:2"]
  assert ast.literal_eval(cluster._tuple_text(urls)) == tuple(urls)
  assert ast.literal_eval(cluster._tuple_text(urls[:1])) == ("http://a:1",)
