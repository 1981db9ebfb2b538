r"""What the KL term to a reference policy costs: memory and step time, side by side.

  python -m experiments.benchmarks.bench_kl [--variant=smoke] [--json=/tmp/bench_kl.json]

The RL update of the toy recipe's model (experiments/configs/toy.py; `--variant=smoke`
for the smoke model) on a batch shaped like a toy RL step (rl.fixed_rows rows of
`--seq` tokens, the second half of each row model-written), run two ways:
  kl=0    the train step alone (the recipe's default);
  kl>0    the reference's log-probs (`RLTrainer.reference_logprobs`: the policy's chunked
          log-prob program on the reference parameters) and then the train step with the
          k3 KL term, as `RLTrainer._update` does.
Memory is exact, from the arrays and XLA's memory analysis of the compiled programs: the
reference adds one copy of the parameters (no gradient, no optimizer state: a third of
the fp32 train state with Adam); its log-prob program is forward-only, with less temp
memory than the train step, so the process peak grows by the reference copy alone.
Step time: medians of `--repeats` alternating runs, next to the machine's dense-matmul
rate measured in the same run (experiments/common/roofline.py).
"""
from __future__ import annotations

import dataclasses
import datetime
import statistics
import time
from typing import Sequence

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import results_json
from experiments.common import roofline
from experiments.configs import toy
from rstar_jax import optim
from rstar_jax.recipe import recipe_config
from rstar_jax.model import model_config, qwen3
from rstar_jax.rl import train_step as ts
from rstar_jax.train import step as core

flags.DEFINE_string("variant", "", "toy.py variant: '' (the toy recipe's model) or smoke")
flags.DEFINE_integer("seq", 256, "tokens per row (the toy's rollouts: prompt ~75 + response)")
flags.DEFINE_integer("repeats", 7, "timed runs of each way (median reported)")
flags.DEFINE_string("json", "", "write the figures here")
FLAGS = flags.FLAGS

GB = 1e9


def _bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _batch(rows: int, seq: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, vocab, (rows, seq + 1), dtype=np.int32)
  loss_mask = np.zeros((rows, seq), np.float32)
  loss_mask[:, seq // 2:] = 1.0
  old = np.where(loss_mask > 0, rng.normal(-2.0, 0.5, (rows, seq)), 0.0).astype(np.float32)
  return {"input_ids": ids[:, :-1], "target_ids": ids[:, 1:],
          "attention_mask": np.ones((rows, seq), np.int32), "loss_mask": loss_mask,
          "old_logp": old, "sampler_logp": old.copy(),
          "advantages": rng.choice([-1.0, 1.0], rows).astype(np.float32)}


def main(argv: Sequence[str]) -> None:
  del argv
  cfg = recipe_config.build_config(toy.get_config(FLAGS.variant))
  rl = cfg.rl
  rows = rl.prompts_per_step * rl.downsample.group_size   # rl.fixed_rows: the most kept
  vocab = cfg.tokenizer.vocab_size
  qcfg = model_config.get_preset(cfg.model.preset, vocab_size=vocab,
                                 **{k: v for k, v in model_config.overrides_of(
                                     cfg.model).items() if k != "vocab_size"})
  tx = optim.make_optimizer(rl.optimizer)
  batch = _batch(rows, FLAGS.seq, vocab)
  loss_off = dataclasses.replace(rl.loss, kl_coef=0.0)
  loss_on = dataclasses.replace(rl.loss, kl_coef=0.5, kl_estimator="k3")
  temperature = cfg.stage1.agent.temperature

  def fresh():
    graphdef, state, _ = core.init_train_state(qwen3.create_model(qcfg, seed=0), tx)
    return graphdef, state

  graphdef, state_off = fresh()
  _, state_on = fresh()
  ref_params = jax.tree.map(jnp.copy, state_on.params)
  step_off = ts.make_train_step(graphdef, tx, loss_off, rl.step, temperature)
  step_on = ts.make_train_step(graphdef, tx, loss_on, rl.step, temperature)
  logprobs = ts.make_logprob_fn(graphdef, rl.step, temperature)

  def run_off():
    nonlocal state_off
    state_off, m = step_off(state_off, batch)
    jax.block_until_ready(m["loss"])

  def run_on():
    nonlocal state_on
    ref = np.asarray(logprobs(ref_params, batch["input_ids"], batch["target_ids"],
                              batch["attention_mask"]))
    state_on, m = step_on(state_on, dict(batch, ref_logp=ref))
    jax.block_until_ready(m["loss"])

  run_off(), run_on()   # compile
  t_off, t_on = [], []
  for _ in range(FLAGS.repeats):   # alternating: a load change hits both ways alike
    t = time.perf_counter()
    run_off()
    t_off.append(time.perf_counter() - t)
    t = time.perf_counter()
    run_on()
    t_on.append(time.perf_counter() - t)
  peak = roofline.matmul_peak_gflops()

  def temp_of(fn, *args):
    mem = jax.jit(fn).lower(*args).compile().memory_analysis()
    return None if mem is None else int(mem.temp_size_in_bytes)

  train_temp_on = temp_of(
      lambda s, b: ts.train_step(graphdef, tx, loss_on, rl.step, temperature, s, b),
      state_on, dict(batch, ref_logp=batch["old_logp"]))
  micro = lambda p, b: ts.sequence_logprobs(graphdef, p, b["input_ids"], b["target_ids"],
                                            b["attention_mask"], chunk=rl.step.logprob_chunk,
                                            temperature=temperature)
  ref_temp = temp_of(micro, ref_params, batch)
  state_bytes = _bytes(state_on.params) + _bytes(state_on.opt_state)
  ref_bytes = _bytes(ref_params)
  flops = roofline.train_flops(qcfg, rows, FLAGS.seq)
  fwd_flops = flops / 3   # the reference's forward: a third of forward + backward
  med_off, med_on = statistics.median(t_off), statistics.median(t_on)
  result = {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "commit": results_json.commit(), "cpu": results_json.cpu_model(), "devices": str(jax.devices()),
      "variant": FLAGS.variant or "toy", "params": qcfg.num_params, "rows": rows,
      "seq": FLAGS.seq, "matmul_peak_gflops": peak,
      "state_bytes": state_bytes, "reference_bytes": ref_bytes,
      "train_temp_bytes_kl": train_temp_on, "reference_logprob_temp_bytes": ref_temp,
      "step_s_kl0": med_off, "step_s_kl": med_on, "step_s_kl0_all": t_off,
      "step_s_kl_all": t_on, "time_ratio": med_on / med_off,
      "model_flops_kl0": flops, "model_flops_kl": flops + fwd_flops,
  }
  print(f"{result['date']}  commit {result['commit']}  {result['cpu']}  "
        f"{result['devices']}")
  print(f"model: toy.py:{FLAGS.variant or '(default)'}, {qcfg.num_params / 1e6:.2f}M params; "
        f"batch {rows} x {FLAGS.seq} tokens; dense matmul peak here {peak:.0f} GFLOP/s")
  print(f"{'':<26}{'kl_coef=0':>14}{'kl_coef=0.5 (k3)':>18}")
  print(f"{'train state (params+Adam)':<26}{state_bytes / 1e6:>11.2f} MB"
        f"{state_bytes / 1e6:>15.2f} MB")
  print(f"{'reference parameters':<26}{0:>11.2f} MB{ref_bytes / 1e6:>15.2f} MB"
        f"   (+{ref_bytes / state_bytes:.0%} of the state)")
  if train_temp_on is not None and ref_temp is not None:
    print(f"{'XLA temp: train step':<26}{'':>14}{train_temp_on / 1e6:>15.2f} MB")
    print(f"{'XLA temp: ref log-probs':<26}{'':>14}{ref_temp / 1e6:>15.2f} MB"
          "   (below the step's: no new peak)")
  print(f"{'step time (median)':<26}{med_off * 1e3:>11.1f} ms{med_on * 1e3:>15.1f} ms"
        f"   (x{med_on / med_off:.2f}; model FLOPs x{(flops + fwd_flops) / flops:.2f})")
  print(f"{'fraction of matmul peak':<26}{flops / med_off / 1e9 / peak:>14.1%}"
        f"{(flops + fwd_flops) / med_on / 1e9 / peak:>18.1%}")
  results_json.write(FLAGS.json, result)


if __name__ == "__main__":
  app.run(main)
