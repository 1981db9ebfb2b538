r"""python -m experiments.benchmarks.bench_model --layers=4 --hidden=256 --seq=256 --batch=8

Forward+backward tokens/s: our jitted Qwen3 versus transformers/torch, same CPU.
A larger size: `--layers 8 --hidden 1024 --seq 1024 --batch 2
--attention_chunk 128 --repeats 3`.

The "jax" row runs `--attention_impl` (default "blockwise": causal query blocks of
`--attention_chunk`); `--also_impls` adds rows for other attention paths of the same
model in the same interleaved run (default "xla": the full [T, T] einsum path).

Everything goes to --out as JSON too (read by notebooks/03_sandbox_and_engine_perf.ipynb).

Both sides compute the same thing: next-token cross-entropy of a random batch and
its gradient w.r.t. every parameter, fp32, same architecture and weights (the torch
model is loaded from the directory our model was exported to). Runs alternate
between the two (A, B, A, B, ...) so machine noise hits both equally; the table
reports medians and the ratio. Not a test: nothing here is asserted.
"""
import functools
import shutil
import os
import statistics
import tempfile
import time

from absl import app
from absl import flags

from experiments.common import results_json
from experiments.common import roofline

flags.DEFINE_integer("layers", 4, "decoder layers")
flags.DEFINE_integer("hidden", 256, "hidden size")
flags.DEFINE_integer("heads", 8, "query heads (head_dim = hidden / heads)")
flags.DEFINE_integer("kv_heads", 4, "KV heads")
flags.DEFINE_integer("vocab", 8192, "vocabulary size")
flags.DEFINE_integer("seq", 256, "sequence length")
flags.DEFINE_integer("batch", 8, "batch size")
flags.DEFINE_integer("repeats", 5, "timed repeats per side (after one warm-up)",
                     lower_bound=1)
flags.DEFINE_string("attention_impl", "blockwise", "Qwen3Config.attention_impl of the jax row")
flags.DEFINE_integer("attention_chunk", 64, "Qwen3Config.attention_chunk (query-block length)")
flags.DEFINE_string("remat_policy", "none", "Qwen3Config.remat_policy")
flags.DEFINE_list("also_impls", ["xla"], "extra jax rows, one per attention_impl")
flags.DEFINE_integer("threads", 0, "torch intra-op threads (0 = all cores)")
flags.DEFINE_integer("peak_n", 1024, "matmul size of the machine's measured dense peak")
flags.DEFINE_string("out", "/tmp/bench_model.json", "where the figures go as JSON")
FLAGS = flags.FLAGS


def main(_):
  from flax import nnx
  import jax
  import jax.numpy as jnp
  import numpy as np
  import torch
  import transformers

  from rstar_jax.model import hf_io, qwen3
  from rstar_jax.model.model_config import Qwen3Config

  if FLAGS.threads:
    torch.set_num_threads(FLAGS.threads)
  cfg = Qwen3Config(vocab_size=FLAGS.vocab, hidden_size=FLAGS.hidden,
                    intermediate_size=3 * FLAGS.hidden, num_hidden_layers=FLAGS.layers,
                    num_attention_heads=FLAGS.heads, num_key_value_heads=FLAGS.kv_heads,
                    head_dim=FLAGS.hidden // FLAGS.heads)
  model = qwen3.create_model(cfg, seed=0)
  tmp = tempfile.mkdtemp()
  hf_io.save_hf(model, tmp, dtype="float32")
  tmodel = transformers.Qwen3ForCausalLM.from_pretrained(
      tmp, dtype=torch.float32, attn_implementation="sdpa")
  shutil.rmtree(tmp)   # loaded; at 8 x 1024 the export is ~0.5 GB a run
  tmodel.train()

  rng = np.random.RandomState(0)
  tokens = rng.randint(0, cfg.vocab_size, size=(FLAGS.batch, FLAGS.seq))
  _, state = nnx.split(model)
  jtok = jnp.asarray(tokens)
  ttok = torch.tensor(tokens)

  def jax_step(impl):
    run_cfg = cfg.replace(attention_impl=impl, attention_chunk=FLAGS.attention_chunk,
                          remat_policy=FLAGS.remat_policy)
    graphdef, _ = nnx.split(qwen3.abstract_model(run_cfg))

    def loss_fn(state, tok):
      m = nnx.merge(graphdef, state)
      h, _ = m(tok)
      return -m.token_logprobs(h[:, :-1], tok[:, 1:], chunk=FLAGS.seq).mean()
    return jax.jit(jax.value_and_grad(loss_fn))

  step = jax_step(FLAGS.attention_impl)

  def run_jax(step=step):
    loss, grads = step(state, jtok)
    jax.block_until_ready(grads)
    return float(loss)

  def run_torch():
    tmodel.zero_grad(set_to_none=True)
    out = tmodel(ttok, labels=ttok)
    out.loss.backward()
    return float(out.loss)

  sides = {"jax": run_jax}
  for impl in FLAGS.also_impls:
    if impl and impl != FLAGS.attention_impl:
      sides[f"jax_{impl}"] = functools.partial(run_jax, step=jax_step(impl))
  sides["torch"] = run_torch
  t0 = time.perf_counter()
  run_jax()
  compile_s = time.perf_counter() - t0
  losses = {name: fn() for name, fn in sides.items()}   # also compiles the extra rows
  # Wall time, and CPU time of this process (all threads): the machines are shared,
  # and CPU seconds measure the work done even while other jobs take cores away.
  times = {name: [] for name in sides}
  cpu = {name: [] for name in sides}
  # The machine's limit is probed after every round, in the same phase as the steps: a
  # host's speed can shift by 1.5x within seconds (seen 2026-11-26).
  peaks = []
  for _ in range(FLAGS.repeats):
    for name, fn in sides.items():
      t, c = time.perf_counter(), time.process_time()
      fn()
      times[name].append(time.perf_counter() - t)
      cpu[name].append(time.process_time() - c)
    peaks.append(roofline.matmul_peak_gflops(FLAGS.peak_n, repeats=3))
  ntok = FLAGS.batch * FLAGS.seq
  # The machine's limit, measured now, and XLA's FLOP count of this very step.
  peak = statistics.median(peaks)
  cost = roofline.xla_cost(step, state, jtok)   # counts the layer scan's body once
  flops = roofline.train_flops(cfg, FLAGS.batch, FLAGS.seq)
  med = {k: statistics.median(v) for k, v in times.items()}
  roof = {"peak_gflops": peak, "peak_probes_gflops": peaks, "peak_matmul_n": FLAGS.peak_n,
          "model_flops": flops,
          "xla_flops_scan_body_once": cost["flops"],
          **{name: roofline.row(name, flops, med[name], peak) for name in sides}}
  cmed = {k: statistics.median(v) for k, v in cpu.items()}
  print(f"\nQwen3 fwd+bwd, {FLAGS.layers} layers, hidden {FLAGS.hidden}, heads "
        f"{FLAGS.heads}/{FLAGS.kv_heads}, vocab {FLAGS.vocab}, batch {FLAGS.batch} x seq "
        f"{FLAGS.seq}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
  print("losses agree: " + ", ".join(f"{k} {v:.5f}" for k, v in losses.items())
        + f"; jax compile+first step {compile_s:.1f}s")
  print(f"{'impl':<30}{'median s/step':>14}{'min s/step':>12}{'tokens/s':>12}"
        f"{'CPU s/step':>12}{'tokens/CPU-s':>14}{'% of peak':>10}")
  labels = {"jax": f"rstar_jax ({FLAGS.attention_impl})", "torch": "transformers (torch)"}
  for name in sides:
    label = labels.get(name, f"rstar_jax ({name[4:]})")
    print(f"{label:<30}{med[name]:>14.4f}{min(times[name]):>12.4f}{ntok / med[name]:>12.0f}"
          f"{cmed[name]:>12.3f}{ntok / cmed[name]:>14.0f}"
          f"{100 * roof[name]['fraction_of_peak']:>9.0f}%")
  print(f"ratio jax/torch tokens/s (wall, median): {med['torch'] / med['jax']:.2f}x; "
        f"(wall, best): {min(times['torch']) / min(times['jax']):.2f}x; "
        f"(CPU time): {cmed['torch'] / cmed['jax']:.2f}x")
  print(f"roofline: measured fp32 matmul peak {peak:.1f} GFLOP/s ({FLAGS.peak_n}^3, median of a probe "
        f"after each round: {min(peaks):.0f}-{max(peaks):.0f}); model "
        f"FLOPs {flops / 1e9:.1f} GFLOP per step (6N + attention; XLA's count, which sees the "
        f"layer scan once, is {cost['flops'] / 1e9:.1f}) -> jax {roof['jax']['gflops']:.1f} "
        f"GFLOP/s = {100 * roof['jax']['fraction_of_peak']:.0f}% of peak; torch "
        f"{roof['torch']['gflops']:.1f} GFLOP/s = {100 * roof['torch']['fraction_of_peak']:.0f}%")
  result = {"benchmark": "bench_model", "flags": {k: getattr(FLAGS, k) for k in (
                "layers", "hidden", "heads", "kv_heads", "vocab", "seq", "batch", "repeats",
                "attention_impl", "attention_chunk", "remat_policy", "also_impls")},
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_average": os.getloadavg(), "tokens_per_step": ntok,
            "loss": losses, "jax_compile_s": compile_s,
            "wall_s": times, "cpu_s": cpu, "roofline": roof,
            "tokens_per_s": {k: ntok / med[k] for k in med},
            "ratio_jax_over_torch": {"wall_median": med["torch"] / med["jax"],
                                     "wall_best": min(times["torch"]) / min(times["jax"]),
                                     "cpu": cmed["torch"] / cmed["jax"]}}
  results_json.write(FLAGS.out, result)


if __name__ == "__main__":
  app.run(main)
