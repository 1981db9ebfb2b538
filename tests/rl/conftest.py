"""Shared RL fixtures: the smoke recipe's pieces with a real JaxEngine pool and tools
that answer every call with "1" (the tiny random policy rarely writes one)."""
import pytest

from experiments.configs import toy
from rstar_jax.recipe import recipe_config, stages
from rstar_jax.rollout import backends


class OkTools:
  async def execute(self, calls):
    return [{"status": "ok", "stdout": "1\n", "stderr": ""} for _ in calls]


@pytest.fixture(scope="module")
def smoke_rl(tmp_path_factory):
  """(config, context, model, engine pool, work root) of toy.py:smoke."""
  root = tmp_path_factory.mktemp("smoke_rl")
  cfg = recipe_config.build_config(toy.get_config("smoke"))
  ctx = stages.build_context(cfg, OkTools(), workdir=str(root))
  model = stages.initial_model(cfg, ctx.tokenizer, ctx.mesh, ctx.rules)
  pool = backends.build_engine_pool(cfg.rollout, model, workdir=str(root))
  yield cfg, ctx, model, pool, root
  pool.stop()
