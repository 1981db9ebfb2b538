"""Config files load, validate, and reject bad overrides with clear messages."""
import os
import subprocess
import sys

import pytest

from rstar_jax import config_utils, recipe

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ["experiments/configs/toy.py", "experiments/configs/rstar2_agent_14b.py"]


@pytest.mark.parametrize("path", CONFIGS)
def test_config_builds_every_rl_stage(path):
  config = config_utils._load_config_file(os.path.join(REPO, path))
  doc = open(os.path.join(REPO, path)).read().split('"""')[1]
  assert doc.startswith("python -m experiments.")   # the docstring opens with the command
  for stage in recipe.RL_STAGES:
    setup = recipe.rl_setup(config, config[stage])
    assert setup.downsample.group_size <= setup.rl.samples_per_prompt


def test_14b_config_matches_spec():
  c = config_utils._load_config_file(os.path.join(REPO, "experiments/configs/rstar2_agent_14b.py"))
  s1 = recipe.rl_setup(c, c.stage1)
  assert (s1.loss.eps_low, s1.loss.eps_high, s1.optimizer.learning_rate,
          s1.optimizer.warmup_steps, s1.optimizer.weight_decay) == (0.2, 0.28, 1e-6, 20, 0.01)
  assert (c.rl.samples_per_prompt, c.rl.group_size) == (32, 16)
  assert (c.stage1.max_response_tokens, c.stage2.max_response_tokens, c.stage3.max_turns) == (
      8192, 12288, 15)
  assert c.stage3.hard_only and c.stage3.reset_optimizer and c.stage3.hard_k == 8


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "experiments.recipe", "--config",
                         "experiments/configs/toy.py", *args], cwd=REPO, capture_output=True,
                        text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))


def test_unknown_override_key_is_named():
  out = _cli("--config.rl.learnin_rate=1e-4")
  assert out.returncode != 0
  assert "unknown config key 'learnin_rate' under rl" in out.stderr
  assert "learning_rate" in out.stderr   # lists the valid keys


def test_wrong_type_override_is_rejected():
  out = _cli("--config.stage1.num_steps=many")
  assert out.returncode != 0 and "num_steps" in out.stderr


def test_mesh_that_does_not_fit_the_devices_is_rejected():
  with pytest.raises(config_utils.ConfigError, match="multiply to 6 but there are 8 devices"):
    config_utils.mesh_from_config({"data": 1, "fsdp": 3, "tensor": 2})


def test_toy_levels_and_kinds_select_the_problems():
  c = config_utils._load_config_file(os.path.join(REPO, "experiments/configs/toy.py"))
  with c.unlocked():
    c.data.toy_levels, c.data.toy_kinds = "1", "product, modpow"
    c.data.toy_train_problems, c.data.toy_eval_problems = 40, 8
  train, evals = recipe.load_problems(c)
  assert len(train) == 40 and len(evals) == 8
  assert {p.meta["kind"] for p in train} == {"product", "modpow"}
  assert {p.meta["level"] for p in train + evals} == {1}
  with c.unlocked():
    c.data.toy_kinds = "product,cube"
  with pytest.raises(config_utils.ConfigError, match=r"toy_kinds: unknown \['cube'\]"):
    recipe.load_problems(c)
  with c.unlocked():
    c.data.toy_kinds, c.data.toy_levels = "", "1,two"
  with pytest.raises(config_utils.ConfigError, match="toy_levels='1,two'"):
    recipe.load_problems(c)
