r"""python -m experiments.evaluate --config experiments/configs/toy.py --config.workdir=/tmp/rstar_toy

Evaluates the latest finished stage (or --hf_dir): pass@1 over k samples, tool stats.

Sampling temperature and k come from config.eval and are printed with the results.
"""
from absl import flags
from ml_collections import config_flags

from rstar_jax import config_utils

_CONFIG = config_flags.DEFINE_config_file("config", None, "ml_collections config file",
                                          lock_config=True)
_HF_DIR = flags.DEFINE_string("hf_dir", None, "evaluate this HF Qwen3 directory instead")


def main(argv):
  del argv
  from rstar_jax import recipe
  config = _CONFIG.value
  if _HF_DIR.value is None:
    recipe.run(config, stages=["eval"])
    return
  from rstar_jax.model import hf_io
  with recipe.sandbox_tools(config) as tools:
    ctx = recipe.build_context(config, tools)
    model = hf_io.load_hf(_HF_DIR.value, mesh=ctx.mesh, **recipe.model_overrides(config))
    print(recipe.run_eval(ctx, model, "hf_dir").to_table())


if __name__ == "__main__":
  config_utils.run(main)
