r"""python -m experiments.toy_sft_curve --config experiments/configs/toy.py --every=200

How fast the toy's SFT teaches the model to copy numbers: a learning curve.

The toy's bottleneck is copying: operands from the problem into the code, and the
printed result into the answer (see WORKSPACE.md, "Toy recipe"). This runs exactly
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
SFT (config.sft.no_tool_share) is the room RL has on top. No timing is asserted;
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
_EVERY = flags.DEFINE_integer("every", 200, "probe every N SFT steps (and at the end)")
_PROBE = flags.DEFINE_integer("probe_problems", 256, "held-out clean traces to score")
_SAVE = flags.DEFINE_string("save", "", "export the final model (HF layout) here")


def copy_probe(ctx, n: int, seed: int):
  """Held-out clean traces as [N, T] arrays + a mask of their assistant digit tokens."""
  import numpy as np
  from rstar_jax import recipe
  from rstar_jax.data import toy_task
  levels, kinds = recipe.toy_levels_kinds(ctx.config)
  problems = toy_task.generate_problems(n, seed=seed, levels=levels, kinds=kinds)
  traces = toy_task.make_traces(problems, seed=seed + 1, chat_config=ctx.proto.config,
                                config=toy_task.TraceConfig(bug_share=0.0, no_tool_share=0.0))
  rendered = [toy_task.render_trace(ctx.proto, t) for t in traces]
  tok = ctx.tokenizer
  is_digit = np.array([any(ch.isdigit() for ch in tok.decode([i])) for i in
                       range(tok.vocab_size)])
  response_start = tok.token_id("<tool_response>")
  t_len = max(len(r.ids) for r in rendered) - 1
  arr = {k: np.zeros((n, t_len), np.int32) for k in ("input_ids", "target_ids", "segment_ids")}
  mask = np.zeros((n, t_len), np.float32)
  in_code = np.zeros((n, t_len), bool)
  for i, r in enumerate(rendered):
    ids, length = np.asarray(r.ids), len(r.ids) - 1
    arr["input_ids"][i, :length] = ids[:-1]
    arr["target_ids"][i, :length] = ids[1:]
    arr["segment_ids"][i, :length] = 1
    mask[i, :length] = np.asarray(r.loss_mask[1:]) * is_digit[ids[1:]]
    in_code[i, :list(ids).index(response_start)] = True
  return arr, mask, in_code, [p.kind for p in problems]


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from rstar_jax import recipe

  config = _CONFIG.value
  if config.data.kind != "toy":
    raise config_utils.ConfigError("toy_sft_curve needs config.data.kind='toy'")
  with tempfile.TemporaryDirectory() as tmp:
    with config.unlocked():
      config.workdir = tmp
    ctx = recipe.build_context(config, tools=None)
    model = recipe.initial_model(config, ctx.tokenizer, ctx.mesh)
    trainer = recipe.sft_trainer_for(ctx, model, os.path.join(tmp, "sft"))
    arr, mask, in_code, kinds = copy_probe(ctx, _PROBE.value, seed=config.seed + 30_000)

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
    rows = [header]
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
      rows.append(row)
      print(row, flush=True)

    trainer.run(progress=False, on_step=probe)
    if _SAVE.value:
      recipe.hf_io.save_hf(trainer.model(), _SAVE.value)
      ctx.tokenizer.save(_SAVE.value)
    trainer.close()
  print("\n" + "\n".join(rows))


if __name__ == "__main__":
  config_utils.run(main)
