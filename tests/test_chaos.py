"""Chaos on a local Ray fleet: the toy RL stage (3 steps) runs under `Cluster.run_trainers`
with 2 sandbox servers, 2 rollout servers of ours and 2 trainer processes (one JAX job,
params sharded over both), while a seeded schedule SIGKILLs a sandbox server after step 1,
a rollout server and a trainer process after step 2.
The servers' actors restart them on their ports, the supervisor restarts the trainer from
its checkpoint, and the stage's per-step metrics equal the uninterrupted in-process run's
(trajectory counts, rewards, losses: nothing lost or counted twice); no process of the
fleet is left behind.

What it needs is made here, no more: the SFT stage alone (not test_recipe's whole smoke
recipe) and the uninterrupted stage 1 from it, in-process."""
import os
import random
import signal
import threading

import pytest

from tests import procs
from tests.test_recipe import (REPO, RL_ARGS, SMOKE, _assert_same_metrics, _copy_sft,
                               _metrics, _run)


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
  """The smoke config's SFT stage, nothing after it (what every run below starts from)."""
  workdir = str(tmp_path_factory.mktemp("chaos_sft"))
  _run(workdir, "--stages=sft")
  return workdir


@pytest.fixture(scope="module")
def straight_rl(sft_dir, tmp_path_factory):
  """Stage 1 (3 steps) uninterrupted, in-process: the reference rows."""
  d = _copy_sft(sft_dir, tmp_path_factory.mktemp("chaos_straight") / "run")
  _run(d, *RL_ARGS)
  return _metrics(os.path.join(d, "stage1", "metrics_rl.jsonl"))


def test_a_fleet_under_a_kill_schedule_finishes_with_the_uninterrupted_metrics(
    sft_dir, straight_rl, tmp_path):
  ray = pytest.importorskip("ray")
  from rstar_jax.recipe import cluster
  d = _copy_sft(sft_dir, tmp_path / "chaos")
  cfg = cluster.ClusterConfig(
      sandbox_servers=2, sandbox_cpus=0.25, rollout_servers=2, rollout_cpus=0.25,
      rollout_hf_dir=os.path.join(d, "sft", "export"),
      rollout_args=("--num_slots", "4", "--max_len", "320", "--min_prefill_bucket", "16"),
      trainer_processes=2, trainer_cpus=0.25, trainer_config=SMOKE,
      trainer_args=(f"--config.workdir={d}", *RL_ARGS,
                    "--config.rollout.weight_sync.dtype=float32",
                    "--config.mesh.enabled=True", "--config.mesh.fsdp=-1"),
      restart_backoff_s=0.0, log_dir=str(tmp_path / "logs"), startup_timeout_s=600)
  ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
           runtime_env={"env_vars": {"XLA_FLAGS": procs.xla_flags(), "JAX_PLATFORMS": "cpu",
                                     "PYTHONPATH": REPO}})
  killed, pids = [], set()
  rng = random.Random(39)
  over = threading.Event()
  try:
    fleet = cluster.Cluster(cfg)
    try:
      path = os.path.join(d, "stage1", "metrics_rl.jsonl")
      rows = lambda: len(_metrics(path)) if os.path.exists(path) else 0
      for info in fleet.server_info().values():
        pids |= {i["pid"] for i in info}

      def schedule():
        plan = [(1, "sandbox", rng.randrange(2)), (2, "rollout", rng.randrange(2)),
                (2, "trainer", rng.randrange(2))]
        while plan and not over.is_set():
          after, what, which = plan[0]
          if rows() >= after:
            if what == "trainer":
              pid = ray.get(fleet.trainers[which].pid.remote())
              pids.update(ray.get([t.pid.remote() for t in fleet.trainers]))
            else:
              pid = fleet.server_info()[what][which]["pid"]
            os.kill(pid, signal.SIGKILL)
            killed.append((what, which, rows()))
            plan.pop(0)
            continue
          over.wait(0.05)

      killer = threading.Thread(target=schedule)
      killer.start()
      try:
        codes = fleet.run_trainers()
      finally:
        over.set()
        killer.join()
      logs = fleet.trainer_logs()
      info = fleet.server_info()
      for i in info.values():
        pids |= {x["pid"] for x in i}
      pids.update(ray.get([t.pid.remote() for t in fleet.trainers]))   # the restarted job
    finally:
      fleet.shutdown()
  finally:
    ray.shutdown()
  assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
  assert [w for w, _, _ in killed] == ["sandbox", "rollout", "trainer"], killed
  assert all(n < 3 for _, _, n in killed), killed     # every kill landed mid-stage
  for what, which, _ in killed[:2]:
    assert [i["restarts"] for i in info[what]] == [int(j == which) for j in range(2)], info
  assert len(fleet.restarts) == 1 and "killed by SIGKILL" in fleet.restarts[0]["cause"]
  assert fleet.restarts[0]["resumed_step"] >= 1, fleet.restarts   # from a checkpoint
  _assert_same_metrics(straight_rl, _metrics(os.path.join(d, "stage1", "metrics_rl.jsonl")))
  # Ray's workers and the servers they ran end a moment after the shutdown: waited for.
  assert not procs.left_running(pids, wait_s=60), "fleet processes left behind"
