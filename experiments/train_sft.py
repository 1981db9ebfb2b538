r"""python -m experiments.train_sft --config experiments/configs/toy.py --config.workdir=/tmp/rstar_toy

Cold-start SFT only (the recipe's first stage).
"""
from ml_collections import config_flags

from rstar_jax import config_utils

_CONFIG = config_flags.DEFINE_config_file("config", None, "ml_collections config file",
                                          lock_config=True)


def main(argv):
  del argv
  from rstar_jax.recipe import stages
  stages.run(_CONFIG.value, stages=["sft"])


if __name__ == "__main__":
  config_utils.run(main)
