r"""The output head and the RL loss, forward + backward, with `StepConfig.fused_head_loss`
off and on, side by side in one run.

  python -m experiments.benchmarks.bench_head [--hidden=1024] [--vocab=151936] [--tokens=2048] \
      [--chunk=512] [--dtype=float32] [--repeats=3] \
      [--json=experiments/results/head/<date>_cpu.json]

What is timed is the part of the RL step the option changes: hidden states [1, T, H] and
the output projection [H, V] -> per-token log-probs (and entropies, as the step computes
them by default) -> the clip-higher PPO loss (token mean) -> the gradient with respect
to both. Off: `qwen3.chunked_logprobs` (the logits matmul in the forward, again in the
backward, then the two gradient matmuls: 4 x 2THV FLOPs) and autodiff through
`rl.losses.ppo_loss`. On: `model.fused_head.fused_logprob_loss` with
`rl.losses.token_loss` (the gradient made in the forward: 3 x 2THV). The shape is
Qwen3's vocabulary at a hidden size where the head dominates (Qwen3-14B's head is H=5120).

Both programs are compiled first, then run alternately, `--repeats` times each (the
median is reported), next to the machine's fp32 1024^3 matmul rate measured in the same
run (experiments/common/roofline.py) and the load average before and after. The figures are
written as JSON with the date, commit and CPU model. `measure(...)` returns them without
printing, and importing this module defines no flags (another script can call it, e.g. on
an accelerator at Qwen3-14B's H=5120 in bfloat16).

Measured on a 2-core AMD EPYC host (experiments/results/head/2026-11-28_cpu_t2048_h1024*.json),
T=2048, H=1024, V=151,936, fp32, chunk 512, medians of 3:
  entropies on (the step's default), load 5-7, peak 146-484 GFLOP/s over the run: off
    18.5 s, on 7.8 s (2.4x); an earlier run at load 15-16: 140 s and 58 s (2.4x);
  entropies off, load 8-12: off 29.9 s, on 22.7 s (1.32x: the 4/3 of the matmuls).
Beyond the matmuls, with entropies the unfused backward passes over each chunk's
[chunk, V] logits again for the softmax and the entropy terms, where the fused program
makes one pass in the forward.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Sequence

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import results_json
from experiments.common import roofline
from rstar_jax.model import fused_head, qwen3
from rstar_jax.rl import losses

FLAGS = flags.FLAGS


def _inputs(t: int, h: int, v: int, dtype, seed: int = 0):
  rng = np.random.default_rng(seed)
  hidden = jnp.asarray(rng.normal(0, 1, (1, t, h)), dtype)
  unembed = jnp.asarray(rng.normal(0, h ** -0.5, (h, v)), dtype)
  targets = jnp.asarray(rng.integers(0, v, (1, t)), jnp.int32)
  mask = np.zeros((1, t), np.float32)
  mask[:, t // 4:] = 1.0   # a quarter prompt, the rest response
  old = np.where(mask > 0, rng.normal(-12.0, 0.5, (1, t)), 0.0).astype(np.float32)
  adv = np.asarray([0.7], np.float32)
  return hidden, unembed, targets, jnp.asarray(mask), jnp.asarray(old), jnp.asarray(adv)


def build(chunk: int, with_entropy: bool, targets, mask, old, adv):
  """(unfused, fused): jitted (hidden, unembed) -> (loss, (d hidden, d unembed))."""
  cfg = losses.LossConfig()

  def unfused(hidden, unembed):
    out = qwen3.chunked_logprobs(hidden, unembed, targets, chunk=chunk,
                                 return_entropy=with_entropy)
    lp = out[0] if with_entropy else out
    return losses.ppo_loss(lp, old, adv, mask, config=cfg)[0]

  def fused(hidden, unembed):
    inputs = losses.token_loss_inputs(old, adv, mask, config=cfg)
    return fused_head.fused_logprob_loss(
        hidden, unembed, targets, lambda x, a: losses.token_loss(x, a, cfg), inputs,
        chunk=chunk, with_entropy=with_entropy)[0]

  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
  return grad(unfused), grad(fused)


def _define_flags() -> None:
  """The command line's flags (defined when run, so that importing `measure` defines none)."""
  flags.DEFINE_integer("hidden", 1024, "hidden size H", lower_bound=1)
  flags.DEFINE_integer("vocab", 151936, "vocabulary size V (Qwen3's)", lower_bound=1)
  flags.DEFINE_integer("tokens", 2048, "positions T (one row)", lower_bound=1)
  flags.DEFINE_integer("chunk", 512, "positions whose logits exist at once "
                       "(StepConfig.logprob_chunk)", lower_bound=1)
  flags.DEFINE_string("dtype", "float32", "compute dtype of the hidden states and projection")
  flags.DEFINE_bool("entropy", True, "also compute the entropies (StepConfig.compute_entropy)")
  flags.DEFINE_integer("repeats", 3, "timed runs of each way, alternating (median reported)",
                       lower_bound=1)
  flags.DEFINE_string("json", "", "write the figures here (e.g. experiments/results/head/...)")


def measure(tokens: int, hidden: int, vocab: int, *, chunk: int = 512,
            dtype: str = "float32", entropy: bool = True, repeats: int = 3) -> dict:
  """Compiles both ways, checks they agree, times them alternately beside the matmul
  peak; returns the figures (what `main` prints and writes)."""
  t, h, v = tokens, hidden, vocab
  dtype = jnp.dtype(dtype)
  load_before = os.getloadavg()[0]
  x_hidden, unembed, targets, mask, old, adv = _inputs(t, h, v, dtype)
  ways = dict(zip(("off", "on"), build(chunk, entropy, targets, mask, old, adv)))
  compile_s, out = {}, {}
  for name, fn in ways.items():
    start = time.perf_counter()
    out[name] = jax.block_until_ready(fn(x_hidden, unembed))
    compile_s[name] = time.perf_counter() - start
  # The two compute the same function: a figure of a wrong program would mean nothing.
  (l_off, (dh_off, dw_off)), (l_on, (dh_on, dw_on)) = out["off"], out["on"]
  rel = lambda a, b: float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max()
                           / jnp.maximum(jnp.abs(b.astype(jnp.float32)).max(), 1e-30))
  agree = {"loss_rel": float(abs(l_on - l_off) / max(abs(l_off), 1e-30)),
           "d_hidden_rel": rel(dh_on, dh_off), "d_unembed_rel": rel(dw_on, dw_off)}
  del out, dh_off, dw_off, dh_on, dw_on
  # The peak before every round and after the last: under a varying load one figure
  # taken once said less than the head itself reached.
  peaks = []
  times = {name: [] for name in ways}
  for _ in range(repeats):
    peaks.append(roofline.matmul_peak_gflops())
    for name, fn in ways.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(x_hidden, unembed))
      times[name].append(time.perf_counter() - start)
  peaks.append(roofline.matmul_peak_gflops())
  peak = max(peaks)
  load_after = os.getloadavg()[0]

  matmul = 2.0 * t * h * v   # one [T, H] x [H, V] product
  rows = []
  for name, n_matmuls in (("off", 4), ("on", 3)):
    med = statistics.median(times[name])
    rows.append({"way": name, "head_matmuls": n_matmuls, "median_s": med,
                 "runs_s": times[name], "compile_s": compile_s[name],
                 "executed_gflops": n_matmuls * matmul / med / 1e9,
                 "fraction_of_peak": n_matmuls * matmul / med / 1e9 / peak,
                 # the 3 matmuls the gradient needs, over the time taken
                 "useful_gflops": 3 * matmul / med / 1e9})
  return {**results_json.stamp(), "backend": jax.default_backend(), "jax": jax.__version__,
          "device_kind": jax.devices()[0].device_kind,
          "load_before": load_before, "load_after": load_after,
          "matmul_peak_gflops": peaks,
          "shape": {"tokens": t, "hidden": h, "vocab": v, "chunk": chunk,
                    "dtype": dtype.name, "entropy": entropy},
          "matmul_gflop": matmul / 1e9, "rows": rows,
          "off_over_on": rows[0]["median_s"] / rows[1]["median_s"], "agreement": agree}


def main(argv: Sequence[str]) -> None:
  del argv
  r = measure(FLAGS.tokens, FLAGS.hidden, FLAGS.vocab, chunk=FLAGS.chunk, dtype=FLAGS.dtype,
              entropy=FLAGS.entropy, repeats=FLAGS.repeats)
  shape, peaks, agree = r["shape"], r["matmul_peak_gflops"], r["agreement"]
  print(f"{r['date']}, {r['cpu_model']}, {r['cores']} CPUs, jax {r['jax']} ({r['backend']}, "
        f"{r['device_kind']}), commit {r['commit']}, load average {r['load_before']:.1f} "
        f"before, {r['load_after']:.1f} after")
  print(f"head + RL loss, forward + backward: T={shape['tokens']} H={shape['hidden']} "
        f"V={shape['vocab']} chunk={shape['chunk']} {shape['dtype']} "
        f"entropy={shape['entropy']}; one [T,H]x[H,V] product = {r['matmul_gflop']:.1f} GFLOP")
  print("fp32 1024^3 matmul peak before each round and after: "
        + ", ".join(f"{p:.0f}" for p in peaks) + " GFLOP/s (\"of peak\": of the highest)")
  print(f"{'fused_head_loss':<16}{'matmuls':>8}{'median s':>10}{'runs s':>24}"
        f"{'GFLOP/s':>9}{'of peak':>9}{'useful GFLOP/s':>16}")
  for row in r["rows"]:
    runs = ",".join(f"{x:.2f}" for x in row["runs_s"])
    print(f"{row['way']:<16}{row['head_matmuls']:>8}{row['median_s']:>10.3f}{runs:>24}"
          f"{row['executed_gflops']:>9.1f}{row['fraction_of_peak']:>9.2f}"
          f"{row['useful_gflops']:>16.1f}")
  print(f"off / on: {r['off_over_on']:.2f}x (4/3 = 1.33x if both ran at the same rate); "
        f"on vs off: loss rel {agree['loss_rel']:.1e}, d hidden {agree['d_hidden_rel']:.1e}, "
        f"d unembed {agree['d_unembed_rel']:.1e} (of each one's largest element)")
  results_json.write(FLAGS.json, r)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
