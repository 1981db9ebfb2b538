"""rl.trainer.RLTrainer: when the engines get the trainer's weights and under which name;
what a failed sync and an early stop leave behind.

A weight sync is a full checkpoint write and a reload on every rollout server (minutes
at 14B), so a launch must not publish parameters that a resume or a carry-over is about
to replace; and an earlier launch's version names must not be taken for this one's.
"""
import re

import pytest

from rstar_jax.recipe import stages
from rstar_jax.rl import trainer as rl_trainer


class _Recording:
  """The engine pool, with every weight update and generation call logged in order."""

  def __init__(self, pool, log):
    self._pool, self.log = pool, log

  def update_weights(self, params, version=None):
    self.log.append(("sync", version))
    self._pool.update_weights(params, version)

  async def generate(self, request):
    self.log.append(("generate", None))
    return await self._pool.generate(request)

  def __getattr__(self, name):
    return getattr(self._pool, name)


@pytest.fixture(scope="module")
def parts(smoke_rl):
  return smoke_rl


def _trainer(parts, stage, log):
  cfg, ctx, _, pool, root = parts
  # A model of its own: a trainer's jitted step donates (deletes) the arrays it started from.
  model = stages.initial_model(cfg, ctx.tokenizer, ctx.mesh, ctx.rules)
  return rl_trainer.RLTrainer(cfg.rl, cfg.stage1.agent, model, ctx.tokenizer, ctx.proto,
                              ctx.train_problems, engines=_Recording(pool, log), tools=ctx.tools,
                              workdir=str(root / stage), seed=0, mesh=ctx.mesh, rules=ctx.rules)


def test_engines_get_the_weights_once_at_the_first_step_and_after_each_update(parts):
  log = []
  t = _trainer(parts, "stage1", log)
  assert not t.maybe_restore()
  assert log == []                        # nothing published at construction
  t.run(1, progress=False)
  t.close()
  syncs = [v for kind, v in log if kind == "sync"]
  assert log[0][0] == "sync" and len(syncs) == 2, log[:3]   # before generating, after updating
  first = log.index(("generate", None))
  assert all(kind == "sync" for kind, _ in log[:first]) and first == 1
  launch = syncs[0].rsplit("-", 1)[1]
  assert re.fullmatch(r"[0-9a-f]{6}", launch)
  assert syncs == [f"stage1-step0-{launch}", f"stage1-step1-{launch}"]

  # The same stage resumed: the restored parameters are published once, at the next
  # step (before: once at construction and again at the restore), under a new launch's
  # names, so a server holding the first launch's step 1 is not taken to be current.
  log.clear()
  again = _trainer(parts, "stage1", log)
  assert again.maybe_restore() and again.step == 1 and log == []
  again.run(2, progress=False)
  again.close()
  syncs = [v for kind, v in log if kind == "sync"]
  assert log[0][0] == "sync" and len(syncs) == 2
  relaunch = syncs[0].rsplit("-", 1)[1]
  assert relaunch != launch and syncs == [f"stage1-step1-{relaunch}", f"stage1-step2-{relaunch}"]



class _FailsSync(_Recording):
  def __init__(self, pool, log, fail_at):
    super().__init__(pool, log)
    self.fail_at = fail_at

  def update_weights(self, params, version=None):
    if len([1 for kind, _ in self.log if kind == "sync"]) + 1 == self.fail_at:
      self.log.append(("sync failed", version))
      raise OSError("the weight-sync disk is full")
    super().update_weights(params, version)


def test_a_failed_sync_after_an_update_keeps_the_steps_row_and_checkpoint(parts):
  """The update is done when its sync fails: the step is saved (as before) and now its
  metrics row is written too; a resume went on from the next step without it."""
  import json
  log = []
  t = _trainer(parts, "stage_syncfail", log)
  t.engines = _FailsSync(parts[3], log, fail_at=2)   # the sync after step 1's update
  with pytest.raises(OSError, match="disk is full"):
    t.run(2, progress=False)
  t.close()
  path = parts[4] / "stage_syncfail" / "metrics_rl.jsonl"
  rows = [json.loads(line) for line in path.read_text().splitlines()]
  assert [r["step"] for r in rows] == [1] and "train/loss" in rows[0]
  again = _trainer(parts, "stage_syncfail", [])
  assert again.maybe_restore() and again.step == 1
  again.close()
  assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1]


def test_a_stop_requested_before_the_first_step_runs_none(parts):
  """A signal during a stage's set-up (a restore, the stage-3 filter) stops it before
  its first step; it ran a whole step first (minutes at 14B)."""
  import os
  import signal
  from rstar_jax.train import interrupt
  log = []
  t = _trainer(parts, "stage_stop", log)
  with interrupt.StopRequests():              # the recipe's, around the stage
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(interrupt.Interrupted, match="after step 0"):
      t.run(2, progress=False)
  t.close()
  assert not [kind for kind, _ in log if kind == "generate"] and t.step == 0
