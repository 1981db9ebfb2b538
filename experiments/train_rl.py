r"""python -m experiments.train_rl --config experiments/configs/toy.py --config.workdir=/tmp/rstar_toy --stage=stage1

GRPO-RoC RL stages only, starting from the last finished stage (SFT export or earlier
RL). Without one it refuses to start from a random model unless
--config.allow_random_init=True (or --config.model.hf_dir names a checkpoint).
"""
from absl import flags
from ml_collections import config_flags

from rstar_jax import config_utils

_CONFIG = config_flags.DEFINE_config_file("config", None, "ml_collections config file",
                                          lock_config=True)
_STAGE = flags.DEFINE_list("stage", ["stage1"], "RL stage(s) to run: stage1,stage2,stage3")


def main(argv):
  del argv
  from rstar_jax.recipe import recipe_config, stages
  bad = set(_STAGE.value) - set(recipe_config.RL_STAGES)
  if bad:
    raise config_utils.ConfigError(
        f"--stage: unknown {sorted(bad)}; known {recipe_config.RL_STAGES}")
  stages.run(_CONFIG.value, stages=list(_STAGE.value))


if __name__ == "__main__":
  config_utils.run(main)
