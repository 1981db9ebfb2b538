"""sft.trainer.SFTTrainer stopping: what is saved when it stops early, and when a stop
requested during set-up is honoured."""
import dataclasses
import os
import signal

import pytest

from experiments.configs import toy
from rstar_jax.recipe import recipe_config, stages
from rstar_jax.sft import trainer as sft_trainer
from rstar_jax.train import interrupt


class _Tools:
  async def execute(self, calls):
    raise AssertionError("SFT runs no tools")


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
  root = tmp_path_factory.mktemp("sft_trainer")
  cfg = recipe_config.build_config(toy.get_config("smoke"))
  ctx = stages.build_context(cfg, _Tools(), workdir=str(root))
  return cfg, ctx, stages.sft_pairs(ctx), root


def _trainer(parts, name, pairs=None):
  cfg, ctx, all_pairs, root = parts
  pairs = all_pairs if pairs is None else pairs
  model = stages.initial_model(cfg, ctx.tokenizer, ctx.mesh, ctx.rules)
  sft = dataclasses.replace(cfg.sft, checkpoint_every=100)   # none periodic in this run
  return sft_trainer.SFTTrainer(sft, model, pairs, str(root / name), seed=0,
                                pad_id=ctx.tokenizer.pad_id, mesh=ctx.mesh, rules=ctx.rules)


def test_an_abort_keeps_the_last_finished_step(parts):
  """A second Ctrl-C (KeyboardInterrupt) or an error after step 3: step 3 is saved, as
  RL does; everything since the last periodic checkpoint was lost."""
  t = _trainer(parts, "abort")
  assert t.total_steps > 3

  def second_ctrl_c(step, metrics):
    if step == 3:
      raise KeyboardInterrupt
  with pytest.raises(KeyboardInterrupt):
    t.run(progress=False, on_step=second_ctrl_c)
  assert t.ckpt.latest_step() == 3
  t.close()
  again = _trainer(parts, "abort")
  assert again.maybe_restore() and again.step == 3
  again.close()


def test_a_stop_requested_before_the_first_step_runs_none(parts):
  t = _trainer(parts, "stop")
  with interrupt.StopRequests():              # the recipe's, around the stage
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(interrupt.Interrupted, match="after step 0"):
      t.run(progress=False)
  assert t.step == 0 and t.ckpt.latest_step() is None
  t.close()


def test_a_resume_over_other_data_is_refused(parts):
  """The data file replaced under the same path (the config unchanged): the resume
  went on with another schedule length and other batches without a word."""
  t = _trainer(parts, "data")

  def stop(step, metrics):
    if step == 2:
      raise KeyboardInterrupt
  with pytest.raises(KeyboardInterrupt):
    t.run(progress=False, on_step=stop)
  t.close()
  fewer = _trainer(parts, "data", pairs=parts[2][:len(parts[2]) * 2 // 3])
  with pytest.raises(ValueError, match="made over other data or settings.*rows: "):
    fewer.maybe_restore()
  fewer.close()
