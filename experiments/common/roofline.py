"""The machine's limits, measured in the same run as a benchmark: dense-matmul
GFLOP/s and memory bandwidth, and XLA's own FLOP and byte counts of a compiled step.

A figure is only meaningful next to what the machine can do: `fraction = achieved /
peak`, with the peak measured here and now (machines of one kind differ by 1.5x and
more, and load changes them) rather than taken from a data sheet.

  python -m experiments.common.roofline      # the fp32 1024^3 matmul peak, 5 rounds, and the load

(the "measured matmul peak" that docs/results.md names beside each machine).
"""
from __future__ import annotations

import statistics
import time


def _median_time(fn, repeats: int) -> float:
  fn()   # compile / warm
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def matmul_peak_gflops(n: int = 1024, dtype: str = "float32", repeats: int = 7) -> float:
  """GFLOP/s of one jitted n x n x n matmul (median of `repeats`): the dense limit."""
  import jax
  import jax.numpy as jnp
  key = jax.random.PRNGKey(0)
  a = jax.random.normal(key, (n, n), dtype=jnp.dtype(dtype))
  b = jax.random.normal(jax.random.fold_in(key, 1), (n, n), dtype=jnp.dtype(dtype))
  f = jax.jit(lambda x, y: x @ y)
  t = _median_time(lambda: f(a, b).block_until_ready(), repeats)
  return 2 * n ** 3 / t / 1e9


def matmul_chain(m: int, k: int, n: int, links: int = 8):
  """(jitted fn, args, FLOPs): `links` dependent fp32 products alternating [m, k] x [k, n]
  and [m, n] x [n, k] (an MLP's up and down shapes), tanh between (nothing for XLA to
  reassociate or merge)."""
  import jax
  import jax.numpy as jnp
  key = jax.random.PRNGKey(0)
  x = jax.random.normal(key, (m, k), jnp.float32)
  ws = [jax.random.normal(jax.random.fold_in(key, i + 1), (k, n) if i % 2 == 0 else (n, k),
                          jnp.float32) / (k if i % 2 == 0 else n) ** 0.5 for i in range(links)]

  @jax.jit
  def chain(h, ws):
    for w in ws:
      h = jnp.tanh(h @ w)
    return h
  return chain, (x, ws), links * 2 * m * k * n


def matmul_chain_gflops(m: int, k: int, n: int, links: int = 8, repeats: int = 7) -> float:
  """GFLOP/s of `matmul_chain`: the rate this machine gives the matmuls of a decode
  step, whose m is the batch. Small m runs far below `matmul_peak_gflops` (64 rows:
  43-60% of the 1024^3 rate on the 2-core hosts measured), and a layer's products depend
  on each other, so they cannot overlap."""
  chain, args, flops = matmul_chain(m, k, n, links)
  t = _median_time(lambda: chain(*args).block_until_ready(), repeats)
  return flops / t / 1e9


def memory_bandwidth_gbs(mbytes: int = 256, repeats: int = 7) -> float:
  """GB/s of a jitted sum over a float32 array of `mbytes` MB: the streaming READ
  limit, which binds a decode step (it reads weights and k/v, writes little).

  An elementwise pass into a fresh output measured 7-8 GB/s on a 2-core host where
  this reads at ~44: the output's first-touch page faults, not the memory, set it.
  """
  import jax
  import jax.numpy as jnp
  n = mbytes * (1 << 20) // 4
  x = jnp.ones((n,), jnp.float32)
  f = jax.jit(jnp.sum)
  t = _median_time(lambda: f(x).block_until_ready(), repeats)
  return n * 4 / t / 1e9


def xla_cost(jitted, *args, **kwargs) -> dict[str, float]:
  """XLA's cost analysis of `jitted` compiled for these arguments: "flops" and
  "bytes accessed" (0 where the backend does not report them).

  XLA counts the body of a while loop ONCE: for a model whose layers run in a
  `lax.scan` this undercounts by about the number of layers (a scan of 8 matmuls is
  reported as one). Use `train_flops` for the model's FLOPs; this count is only good
  for steps without loops."""
  cost = jitted.lower(*args, **kwargs).compile().cost_analysis()
  if isinstance(cost, (list, tuple)):   # older jax: one dict per computation
    cost = cost[0] if cost else {}
  cost = cost or {}
  return {"flops": float(cost.get("flops", 0.0)),
          "bytes_accessed": float(cost.get("bytes accessed", 0.0))}


def row(label: str, flops: float, seconds: float, peak_gflops: float) -> dict[str, float]:
  """Achieved GFLOP/s of `flops` in `seconds` and its fraction of the peak."""
  achieved = flops / seconds / 1e9 if seconds > 0 else 0.0
  return {"label": label, "flops": flops, "seconds": seconds, "gflops": achieved,
          "fraction_of_peak": achieved / peak_gflops if peak_gflops else 0.0}


def matmul_params(cfg) -> int:
  """Parameters that take part in a matmul per token: every layer's projections and the
  output head (the input embedding is a lookup)."""
  h, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
  q = cfg.num_attention_heads * cfg.head_dim
  kv = cfg.num_key_value_heads * cfg.head_dim
  return L * (2 * h * q + 2 * h * kv + 3 * h * i) + h * cfg.vocab_size


def attention_flops(cfg, batch: int, seq: int, *, causal: bool = False) -> float:
  """FLOPs of attention's two products (scores q k^T and probabilities x v) in one
  forward + backward pass over batch x seq tokens: 2 products x 2 FLOPs a multiply-add x
  3 (forward, two backward products) = 12 L q S^2 per sequence, q = heads x head_dim.

  causal=True halves it (MaxText's convention): a causal mask leaves the upper triangle
  of every score matrix unused, so a kernel that skips it (cuDNN's, `blockwise`) does
  half the work. causal=False counts the full S x S products (PaLM's convention, and
  what `train_flops` has always counted)."""
  q = cfg.num_attention_heads * cfg.head_dim
  full = 12 * cfg.num_hidden_layers * q * seq * seq * batch
  return float(full / 2 if causal else full)


def train_flops(cfg, batch: int, seq: int, *, causal: bool = False) -> float:
  """Model FLOPs of one forward + backward pass over batch x seq tokens: 6 N per token for
  the N matmul parameters plus `attention_flops` (12 L q S per token at sequence length
  S, q = heads x head_dim; halved with causal=True), remat recomputation not counted.

  causal=False is PaLM's convention (attention over the full S x S), causal=True
  MaxText's (the causal half only). Counted in full, attention is 19% of a Qwen3-14B
  step's FLOPs at 8192 tokens, so the causal count (and its MFU) is 9.7% lower there. A
  report states which it used (`mfu_both`)."""
  return float(6 * matmul_params(cfg) * batch * seq) + attention_flops(cfg, batch, seq,
                                                                       causal=causal)


def mfu_both(cfg, batch: int, seq: int, seconds: float, peak_gflops: float) -> dict[str, float]:
  """MFU of one step of `seconds` against `peak_gflops` (the whole mesh's), labelled by
  how attention FLOPs were counted: "full_attention" (PaLM) and "causal_attention"
  (MaxText, half the attention FLOPs). 0.0 where there is no time or peak."""
  if seconds <= 0 or not peak_gflops:
    return {"full_attention": 0.0, "causal_attention": 0.0}
  return {label: train_flops(cfg, batch, seq, causal=causal) / seconds / 1e9 / peak_gflops
          for label, causal in (("full_attention", False), ("causal_attention", True))}


def main(rounds: int = 5) -> None:
  import os
  from experiments.common import results_json
  cpu = results_json.cpu_model()
  load = os.getloadavg()[0]
  peaks = [matmul_peak_gflops() for _ in range(rounds)]
  print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {cpu}, {os.cpu_count()} CPUs, "
        f"load average {load:.1f} before, {os.getloadavg()[0]:.1f} after")
  print(f"fp32 1024^3 matmul peak, {rounds} rounds (each the median of 7): "
        + ", ".join(f"{p:.0f}" for p in peaks)
        + f" GFLOP/s; min {min(peaks):.0f}, median {statistics.median(peaks):.0f}, "
        f"max {max(peaks):.0f}")


if __name__ == "__main__":
  main()
