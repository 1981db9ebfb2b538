"""The real trainer under the Ray supervisor: the toy RL stage's trainer process is
SIGKILLed mid-stage; `Cluster.run_trainers` restarts it, it resumes from its latest
complete checkpoint, and the stage's per-step metrics equal the uninterrupted run's."""
import os
import signal
import threading
import time

import pytest

from tests.test_recipe import (REPO, RL_ARGS, SMOKE, _assert_same_metrics, _copy_sft,  # noqa: F401
                               _metrics, recipe_dir, straight_rl, straight_run)
from tests import procs


@pytest.mark.slow
def test_a_killed_trainer_is_restarted_by_the_supervisor_and_matches_uninterrupted(
    recipe_dir, straight_rl, tmp_path):
  ray = pytest.importorskip("ray")
  from rstar_jax.recipe import cluster
  d = _copy_sft(recipe_dir[0], tmp_path / "supervised")
  cfg = cluster.ClusterConfig(
      sandbox_servers=0, rollout_servers=0, trainer_processes=1, trainer_cpus=1.0,
      trainer_config=SMOKE, trainer_args=(f"--config.workdir={d}", *RL_ARGS),
      restart_backoff_s=0.5, log_dir=str(tmp_path / "logs"))
  ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
           runtime_env={"env_vars": {"XLA_FLAGS": procs.xla_flags(), "JAX_PLATFORMS": "cpu",
                                     "PYTHONPATH": REPO}})
  killed = {}
  try:
    fleet = cluster.Cluster(cfg)
    try:
      path = os.path.join(d, "stage1", "metrics_rl.jsonl")
      finished = threading.Event()

      def kill_after_two_steps():
        # No deadline: polled until step 2's row is written or the trainers have ended
        # (then `killed` stays empty and the assertion below says so).
        while not finished.is_set():
          if os.path.exists(path) and len(_metrics(path)) >= 2:
            pid = ray.get(fleet.trainers[0].pid.remote())
            os.kill(pid, signal.SIGKILL)
            killed["rows"] = len(_metrics(path))
            return
          time.sleep(0.05)

      killer = threading.Thread(target=kill_after_two_steps)
      killer.start()
      try:
        codes = fleet.run_trainers()   # until they end: a loaded host is slow, not wrong
      finally:
        finished.set()
        killer.join()
      logs = fleet.trainer_logs()
    finally:
      fleet.shutdown()
  finally:
    ray.shutdown()
  assert codes == [0], logs[0][-3000:]
  assert killed.get("rows") == 2, killed            # killed after step 2, before step 3
  assert len(fleet.restarts) == 1 and "killed by SIGKILL" in fleet.restarts[0]["cause"]
  assert fleet.restarts[0]["resumed_step"] in (1, 2), fleet.restarts
  _assert_same_metrics(straight_rl, _metrics(os.path.join(d, "stage1", "metrics_rl.jsonl")))
