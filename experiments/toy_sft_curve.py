r"""python -m experiments.toy_sft_curve --config experiments/configs/toy.py --every=200

How fast the toy's SFT teaches the model to copy numbers: a learning curve.

The toy's bottleneck is copying: operands from the problem into the code, and the
printed result into the answer (see docs/guides/toy_recipe.md). This runs exactly
the recipe's SFT stage (same data, trainer and config; any `--config.sft.*` or
`--config.model.*` override applies) in a temporary directory and, every `--every`
steps, scores held-out CLEAN traces by teacher forcing on their digit tokens (the
numbers the assistant writes, all of them copies):

  digit_acc   share of digit tokens that are the argmax
  greedy_all  share of traces whose every digit token is the argmax
  p_copy      mean over traces of p(every digit token) = exp(sum of their log-probs):
              the chance that sampling at temperature 1 copies all of them right,
              overall, in the code (before the tool response), in the answer, per kind

p_copy predicts the sampled pass@1 of tool-using rollouts; the no-tool share after
SFT (config.sft.data.traces.no_tool_share) is the room RL has on top. No timing is asserted;
the wall column is for comparing settings run one after the other on one machine.
"""
import os
import tempfile
import time

from absl import flags
from ml_collections import config_flags

from rstar_jax import config_utils

_CONFIG = config_flags.DEFINE_config_file("config", None, "ml_collections config file",
                                          lock_config=True)
_EVERY = flags.DEFINE_integer("every", 200, "probe every N SFT steps (and at the end)",
                              lower_bound=1)
_PROBE = flags.DEFINE_integer("probe_problems", 256, "held-out clean traces to score")
_SAVE = flags.DEFINE_string("save", "", "export the final model (HF layout) here")


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from rstar_jax.model import hf_io
  from rstar_jax.recipe import recipe_config, stages
  from rstar_jax.data import data_config, toy_task

  import dataclasses
  config = recipe_config.build_config(_CONFIG.value)
  if config.data.kind != "toy":
    raise config_utils.ConfigError("toy_sft_curve needs config.data.kind='toy'")
  with tempfile.TemporaryDirectory() as tmp:
    config = dataclasses.replace(config, workdir=tmp)
    ctx = stages.build_context(config, tools=None)
    model = stages.initial_model(config, ctx.tokenizer, ctx.mesh, ctx.rules)
    trainer = stages.sft_trainer_for(ctx, model, os.path.join(tmp, "sft"))
    problems = data_config.toy_problems_for(config.data, _PROBE.value,
                                            seed=config.seed + 30_000)
    arr, mask, in_code = toy_task.copy_probe(ctx.proto, problems, seed=config.seed + 30_001)
    kinds = [p.kind for p in problems]

    @jax.jit
    def score(params):
      m = nnx.merge(trainer.graphdef, params)
      hidden, _ = m(arr["input_ids"], None, segment_ids=arr["segment_ids"])
      lp = m.token_logprobs(hidden, arr["target_ids"])
      hit = jnp.argmax(m.logits(hidden), -1) == arr["target_ids"]
      return lp * mask, hit * mask

    kind_names = sorted(set(kinds))
    print(f"SFT: {trainer.total_steps} steps, {trainer.pack_stats}; model "
          f"{model.cfg.num_params / 1e6:.2f}M params; probe "
          f"{len(kinds)} clean traces, {int(mask.sum())} digit tokens", flush=True)
    header = (f"{'step':>6} {'wall_s':>7} {'loss':>6} {'digit_acc':>9} {'greedy_all':>10} "
              f"{'p_copy':>6} {'code':>6} {'answer':>6} " +
              " ".join(f"{k:>9}" for k in kind_names))
    print(header, flush=True)
    t0 = time.perf_counter()

    def probe(step, metrics):
      if step % _EVERY.value and step != trainer.total_steps:
        return
      lp, hit = (np.asarray(x) for x in jax.device_get(score(trainer.state.params)))
      p_all = np.exp(lp.sum(1))
      p_code = np.exp((lp * in_code).sum(1))
      p_answer = np.exp((lp * ~in_code).sum(1))
      greedy = ((mask - hit).sum(1) == 0).mean()
      per_kind = [p_all[[k == name for k in kinds]].mean() for name in kind_names]
      row = (f"{step:6d} {time.perf_counter() - t0:7.1f} {metrics['sft/loss']:6.3f} "
             f"{hit.sum() / mask.sum():9.3f} {greedy:10.3f} {p_all.mean():6.3f} "
             f"{p_code.mean():6.3f} {p_answer.mean():6.3f} " +
             " ".join(f"{v:9.3f}" for v in per_kind))
      print(row, flush=True)

    trainer.run(progress=False, on_step=probe)
    if _SAVE.value:
      hf_io.save_hf(trainer.model(), _SAVE.value)
      ctx.tokenizer.save(_SAVE.value)
    trainer.close()


if __name__ == "__main__":
  config_utils.run(main)
