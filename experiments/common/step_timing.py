"""The RL trainer's sharded GRPO step on a random batch, timed: what `gpu_smoke` and
`device_check` measure (no flags here, so both can import it).

A batch of random trajectories (a quarter prompt, the rest response, every response
token in the loss, sampler log-probs in [-2, 0]) goes through the RL trainer's own
jitted step (`rstar_jax.rl.train_step.make_train_step`: policy log-probs, clip-higher
PPO loss, AdamW update, state donated). One compile step, then `steps` timed steps.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import numpy as np

# Dense bf16 peak per device from the vendors' data sheets (TFLOP/s, without sparsity),
# matched against `device_kind`: MFU is stated against these as well as against a
# matmul measured in the same run. H100 SXM / H200: 989.4; H100 PCIe: 756; A100: 312;
# MI300X: 1307.4; MI325X: 1307.4. HBM bandwidth (TB/s) from the same sheets.
DATA_SHEETS: tuple[tuple[str, float, float], ...] = (
    # (substring of device_kind, dense bf16 TFLOP/s, HBM TB/s); first match wins
    ("H100 PCIe", 756.0, 2.0),
    ("H100", 989.4, 3.35),
    ("H200", 989.4, 4.8),
    ("A100", 312.0, 2.0),
    ("MI300X", 1307.4, 5.3),
    ("MI325X", 1307.4, 6.0),
)


def data_sheet(device_kind: str) -> tuple[float, float] | None:
  """(dense bf16 TFLOP/s, HBM TB/s) of a device by its `device_kind`, or None."""
  for key, tflops, tbs in DATA_SHEETS:
    if key.lower() in (device_kind or "").lower():
      return tflops, tbs
  return None


@dataclasses.dataclass
class StepTiming:
  """What one timed train step run measured."""
  batch: int
  seq: int
  compile_s: float
  step_s: list[float]
  loss: list[float]            # the compile step's loss, then the last timed step's
  grad_norm: float             # of the compile step (same batch and params in every run)
  flops: float                 # model FLOPs of one step (roofline.train_flops)
  xla_flops_per_device: float  # XLA's count of the partitioned program (scan body once)
  hlo_custom_calls: list[str]  # custom-call targets in the compiled step (cuDNN, ...)

  @property
  def median_s(self) -> float:
    return statistics.median(self.step_s)

  @property
  def tokens_per_s(self) -> float:
    return self.batch * self.seq / self.median_s

  def achieved_gflops(self) -> float:
    return self.flops / self.median_s / 1e9


def random_batch(vocab_size: int, batch: int, seq: int, row_multiple: int,
                 length_multiple: int, seed: int = 0) -> dict[str, np.ndarray]:
  """[batch, seq] GRPO batch of random tokens (see the module docstring). `seq` that is
  not a power of two is kept as it is (rounded to `length_multiple`)."""
  from rstar_jax.rl import batching
  rng = np.random.RandomState(seed)
  prompt = seq // 4
  # build_batch's T is the trajectory's length - 1 (targets are shifted by one).
  resp = seq + 1 - prompt
  trajs = [batching.TokenTrajectory(
      prompt_ids=rng.randint(0, vocab_size, prompt).tolist(),
      response_ids=rng.randint(0, vocab_size, resp).tolist(),
      response_mask=[1] * resp,
      response_logprobs=(-rng.rand(resp) * 2).tolist()) for _ in range(batch)]
  pow2 = seq & (seq - 1) == 0
  return batching.build_batch(trajs, rng.randn(batch).astype(np.float32),
                              row_multiple=row_multiple, length_multiple=length_multiple,
                              pow2_lengths=pow2)


def _custom_calls(hlo_text: str) -> list[str]:
  import re
  return sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo_text)))


def time_train_step(cfg, mesh, *, batch: dict[str, np.ndarray], steps: int,
                    micro_batches: int = 1, logprob_chunk: int = 512,
                    learning_rate: float = 1e-6, seed: int = 0,
                    compiled_text: bool = False,
                    step_overrides: dict | None = None) -> StepTiming:
  """Builds a model of `cfg` (random init, `seed`) and its sharded train state on `mesh`,
  compiles the RL train step for `batch` and times `steps` steps after the compile step.

  compiled_text: also read the custom calls of the compiled program (which attention
  kernel ran: cuDNN's fused attention shows as a `__cudnn$fmha...` target).
  step_overrides: other StepConfig fields (the train-step levers, e.g. cast_params_once).
  """
  import jax

  from experiments.common import roofline
  from rstar_jax import distributed, optim, sharding
  from rstar_jax.model import qwen3
  from rstar_jax.rl import losses, train_step as ts
  from rstar_jax.train import step as core

  n, t = batch["input_ids"].shape
  t0 = time.perf_counter()
  model = qwen3.create_model(cfg, seed=seed)
  tx = optim.make_optimizer(optim.OptimizerConfig(learning_rate=learning_rate, warmup_steps=0))
  graphdef, state, shardings = core.init_train_state(model, tx, mesh)
  del model
  step = ts.make_train_step(graphdef, tx, losses.LossConfig(),
                            core.StepConfig(**dict(dict(micro_batches=micro_batches,
                                                        logprob_chunk=min(logprob_chunk, t)),
                                                   **(step_overrides or {}))),
                            mesh=mesh, state_shardings=shardings, donate=True)
  # Compiled once, ahead of time, and called directly: `step(...)` after `step.lower`
  # would compile the program a second time (jit's cache is not filled by AOT).
  compiled = step.lower(state, batch).compile()
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  calls = _custom_calls(compiled.as_text()) if compiled_text else []
  placed = sharding.place_batch(batch, mesh)
  state = sharding.committed(state)
  state, m = compiled(state, placed)
  loss0 = float(distributed.host_value(m["loss"]))
  grad_norm = float(distributed.host_value(m["grad_norm"]))
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(steps):
    t1 = time.perf_counter()
    state, m = compiled(state, placed)
    jax.block_until_ready(m["loss"])
    times.append(time.perf_counter() - t1)
  loss = float(distributed.host_value(m["loss"]))
  if not (np.isfinite(loss0) and np.isfinite(loss) and np.isfinite(grad_norm)):
    raise FloatingPointError(f"non-finite step: loss {loss0} -> {loss}, grad norm {grad_norm}")
  del state
  return StepTiming(batch=n, seq=t, compile_s=compile_s, step_s=times, loss=[loss0, loss],
                    grad_norm=grad_norm, flops=roofline.train_flops(cfg, n, t),
                    xla_flops_per_device=float((cost or {}).get("flops", 0.0)),
                    hlo_custom_calls=calls)


def as_dict(timing: StepTiming, peaks_gflops: dict[str, float]) -> dict[str, Any]:
  """JSON figures of `timing`, MFU against every named peak (GFLOP/s of the whole mesh)."""
  achieved = timing.achieved_gflops()
  return dict(dataclasses.asdict(timing), median_s=timing.median_s,
              tokens_per_s=timing.tokens_per_s, achieved_gflops=achieved,
              mfu={k: achieved / v for k, v in peaks_gflops.items() if v})
