r"""python -m experiments.evaluate --config experiments/configs/toy.py --config.workdir=/tmp/rstar_toy

Evaluates the latest finished stage (or --hf_dir): pass@1 over k samples, tool stats.

Sampling temperature and k come from config.eval and are printed with the results.
With --hf_dir, the tokenizer saved in that export is used (the one it was trained
with), and the result file (<workdir>/eval_hf_dir.json) records the directory and seed.
"""
import os

from absl import flags
from ml_collections import config_flags

from rstar_jax import config_utils

_CONFIG = config_flags.DEFINE_config_file("config", None, "ml_collections config file",
                                          lock_config=True)
_HF_DIR = flags.DEFINE_string("hf_dir", None, "evaluate this HF Qwen3 directory instead")


def main(argv):
  del argv
  from rstar_jax import recipe
  if _HF_DIR.value is None:
    recipe.run(_CONFIG.value, stages=["eval"])
    return
  print(recipe.evaluate_hf_dir(_CONFIG.value, os.path.abspath(_HF_DIR.value)).to_table())


if __name__ == "__main__":
  config_utils.run(main)
