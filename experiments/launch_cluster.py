r"""python -m experiments.launch_cluster --config experiments/configs/cluster_toy.py --config.cluster.rollout_hf_dir=/tmp/rstar_toy/sft/export

Starts the fleet of `config.cluster` (rstar_jax.recipe.cluster.ClusterConfig) on Ray - sandbox
servers, rollout servers (ours or SGLang), the trainer processes - hands the servers'
URLs and the multi-process settings to the trainer, restarts a server that dies, and
supervises the trainer job: when one of its processes dies, all are stopped and the job
restarts from its latest complete checkpoint (`cluster.max_restarts`, with back-off;
each restart's cause and resumed step in <log_dir>/cluster.log). `--serve_only` starts the servers, prints the trainer overrides
and holds them until Ctrl-C (to run the trainer by hand or under SLURM).

Needs Ray: `pip install -r requirements-cluster.txt`.
"""
import json
import sys
import time

from absl import flags
from ml_collections import config_flags

from rstar_jax import config_utils

_CONFIG = config_flags.DEFINE_config_file("config", None, "launch config (a `cluster` section)",
                                          lock_config=True)
_SERVE_ONLY = flags.DEFINE_bool("serve_only", False, "start the servers only, print the "
                                "trainer's overrides and keep them up until interrupted")
_TIMEOUT = flags.DEFINE_float("timeout_s", 0.0, "give up on the trainer after this long (0: never)")


def main(argv):
  del argv
  try:
    import ray  # noqa: F401
  except ImportError:
    raise config_utils.ConfigError("Ray is not installed: pip install -r requirements-cluster.txt") from None
  from rstar_jax.recipe import cluster
  extra = set(_CONFIG.value) - {"cluster"}
  if extra:
    raise config_utils.ConfigError(f"--config: unknown section(s) {sorted(extra)}; a launch "
                                   "config has one section, `cluster`")
  cfg = config_utils.build(cluster.ClusterConfig, _CONFIG.value.cluster, "config.cluster")
  fleet = cluster.Cluster(cfg)
  try:
    print(f"fleet up in {fleet.launch_s:.1f} s (logs in {cfg.log_dir}):")
    print(json.dumps(fleet.info, indent=2))
    if _SERVE_ONLY.value or not fleet.trainers:
      print("trainer overrides:\n  " + " \\\n  ".join(fleet.trainer_overrides()))
      while True:
        time.sleep(3600)
    # Supervised: a trainer process that dies restarts the whole job from its latest
    # complete checkpoint (cluster.max_restarts within restart_window_s, with back-off).
    codes = fleet.run_trainers(_TIMEOUT.value or None)
    for i, r in enumerate(fleet.restarts, 1):
      print(f"restart {i}: {r['cause']}; resumed from step {r['resumed_step']}")
    for i, (code, tail) in enumerate(zip(codes, fleet.trainer_logs())):
      print(f"--- trainer {i}: exit {code}\n{tail[-1500:]}")
    print("servers:", json.dumps(fleet.server_info(), indent=2))
    if any(c != 0 for c in codes):
      sys.exit(1)
  except KeyboardInterrupt:
    print("interrupted: stopping the fleet")
  finally:
    fleet.shutdown()


if __name__ == "__main__":
  config_utils.run(main)
