"""rl.rollouts.run_sync: rollouts from plain code and from inside a running event loop
(a Jupyter kernel runs one, where asyncio.run refuses)."""
import asyncio
import threading

from rstar_jax.rl import rollouts


async def _where():
  await asyncio.sleep(0)
  return threading.current_thread().name


def test_run_sync_without_and_inside_a_running_loop():
  assert rollouts.run_sync(_where()) == threading.current_thread().name

  async def kernel_cell():
    return rollouts.run_sync(_where())   # asyncio.run would raise here

  assert asyncio.run(kernel_cell()).startswith("rollouts")
