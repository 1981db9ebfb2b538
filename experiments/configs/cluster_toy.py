r"""python -m experiments.launch_cluster --config experiments/configs/cluster_toy.py --config.cluster.rollout_hf_dir=/tmp/rstar_toy/sft/export

The toy recipe's RL stage 1 on a Ray-launched fleet: 2 sandbox servers, 1 rollout
server of ours (serving the SFT export; the trainer sends it new weights through disk
after every update) and 1 trainer process, on one machine (a local Ray instance) or a
running cluster (`--config.cluster.ray_address=auto`). Run the toy recipe's SFT first
(`python -m experiments.recipe --config experiments/configs/toy.py --stages=sft
--config.workdir=/tmp/rstar_toy`); stage 1 then continues in that work directory.

The 14B run's fleet is not restated here: `experiments/configs/rstar2_agent_14b.py:cluster`
builds it from that config's one layout (docs/guides/cluster.md).

Result and wall time: not measured yet (no recorded run of this config).
"""
import ml_collections

from rstar_jax.recipe import sections


def get_config():
  c = ml_collections.ConfigDict()
  c.cluster = sections.section(
      sections.ClusterConfig, sandbox_servers=2, sandbox_cpus=0.5, rollout_servers=1,
      rollout_backend="server", rollout_hf_dir="", rollout_cpus=0.5,
      rollout_args=("--num_slots", "16"), trainer_processes=1, trainer_cpus=1.0,
      trainer_module="experiments.train_rl", trainer_config="experiments/configs/toy.py",
      trainer_args=("--config.workdir=/tmp/rstar_toy", "--stage=stage1"),
      log_dir="/tmp/rstar_cluster")
  return c
