"""rl.rollout_collector.run_sync: rollouts from plain code and from inside a running event loop
(a Jupyter kernel runs one, where asyncio.run refuses)."""
import asyncio
import threading

from rstar_jax.rl import rollout_collector


async def _where():
  await asyncio.sleep(0)
  return threading.current_thread().name


def test_run_sync_without_and_inside_a_running_loop():
  assert rollout_collector.run_sync(_where()) == threading.current_thread().name

  async def kernel_cell():
    return rollout_collector.run_sync(_where())   # asyncio.run would raise here

  assert asyncio.run(kernel_cell()).startswith("rollouts")


def test_weight_versions_checked_per_step():
  from rstar_jax.rollout.agent_loop import Trajectory
  ok = [Trajectory(uid="a", prompt_ids=[1], weight_versions=["stage1-step3"]),
        Trajectory(uid="b", prompt_ids=[1])]   # an engine that reports no version
  rollout_collector.check_weight_versions(ok, "stage1-step3", "step 3")
  mixed = ok + [Trajectory(uid="c", prompt_ids=[1], weight_versions=["stage1-step2", "stage1-step3"]),
                Trajectory(uid="d", prompt_ids=[1], weight_versions=["stage1-step2"])]
  try:
    rollout_collector.check_weight_versions(mixed, "stage1-step3", "step 3")
  except RuntimeError as e:
    msg = str(e)
  else:
    raise AssertionError("mixed versions were accepted")
  assert msg.startswith("step 3: 2 of 4 trajectories were not generated with the current "
                        "weights 'stage1-step3'")
  assert "'stage1-step2 -> stage1-step3': 1" in msg and "'stage1-step2': 1" in msg
