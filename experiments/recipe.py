r"""python -m experiments.recipe --config experiments/configs/toy.py --config.workdir=/tmp/rstar_toy

Runs (or resumes) the multi-stage recipe: SFT -> RL stages 1-3 -> evaluation.

`--stages=sft,stage1` runs only those stages (finished stages are always skipped).
The whole config is checked before anything runs and written to <workdir>/config.json;
what it changes from the config file's own values is printed; a changed config against
finished stages is refused (see rstar_jax/recipe/workdir_state.py).
"""
from absl import flags
from ml_collections import config_flags

from rstar_jax import config_utils

_CONFIG = config_flags.DEFINE_config_file("config", None, "ml_collections config file",
                                          lock_config=True)
_STAGES = flags.DEFINE_list("stages", [], "subset of sft,stage1,stage2,stage3,eval (default all)")


def main(argv):
  del argv
  from rstar_jax.recipe import stages
  stages.run(_CONFIG.value, stages=_STAGES.value or None)


if __name__ == "__main__":
  config_utils.run(main)
