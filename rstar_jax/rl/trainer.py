"""The GRPO-RoC training loop.

One step: a batch of prompts -> 2G rollouts each (engines + sandbox, concurrently)
-> outcome rewards -> RoC down-sampling to G -> group advantages -> one sharded
policy update -> the engines read the new parameters (in process: no copy).

Reproducibility and resumption: every random choice of step s derives from
(seed, s): rollout seeds, the RoC generator. The data iterator's position is saved
with the checkpoint, so a resumed run takes the same next batch and, with the same
parameters and optimizer state, produces the same next step.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from typing import Any, Sequence

from absl import logging
from flax import nnx
import jax
import numpy as np

from rstar_jax import checkpoint as ckpt_lib
from rstar_jax import metrics as metrics_lib
from rstar_jax import optim
from rstar_jax.data import math_data
from rstar_jax.rl import advantages as adv_lib
from rstar_jax.rl import batching, losses, rewards, roc
from rstar_jax.rl import train_step as ts
from rstar_jax.rollout import agent_loop, chat
from rstar_jax.rollout.jax_engine import EngineConfig, JaxEngine
from rstar_jax.rollout.scheduler import EnginePool

OLD_LOGPROBS = ("sampler", "recompute")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLConfig:
  seed: int = 0
  num_steps: int = 10
  prompts_per_step: int = 8
  samples_per_prompt: int = 32     # 2G rollouts; RoC keeps downsample.group_size (G)
  old_logprobs: str = "sampler"    # or "recompute" (trainer-side forward before the update)
  checkpoint_every: int = 50
  keep_checkpoints: int = 3
  length_multiple: int = 64        # pad T to a multiple (fewer recompiles)
  # Pad the row count to a power of two: with dropped groups the number of kept
  # trajectories varies per step and every distinct count would be a fresh compile.
  pow2_rows: bool = True
  # Pad every batch to the most rows a step can keep: with dropped groups the kept
  # count varies, and each power-of-two row bucket is another compile. Worth it when
  # compiles cost more than the padding (small models: the toy).
  fixed_rows: bool = False
  scheduler_policy: str = "kv_capacity"

  def __post_init__(self):
    if self.old_logprobs not in OLD_LOGPROBS:
      raise ValueError(f"RLConfig.old_logprobs={self.old_logprobs!r}; choose from {OLD_LOGPROBS}")
    for name in ("num_steps", "prompts_per_step", "samples_per_prompt", "checkpoint_every",
                 "length_multiple"):
      if getattr(self, name) <= 0:
        raise ValueError(f"RLConfig.{name} must be positive")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLSetup:
  """Everything a stage of RL needs, validated once."""
  rl: RLConfig
  agent: agent_loop.AgentConfig
  engine: EngineConfig
  downsample: roc.DownsampleConfig
  advantage: adv_lib.AdvantageConfig
  loss: losses.LossConfig
  optimizer: optim.OptimizerConfig
  step: ts.StepConfig

  def __post_init__(self):
    if self.downsample.group_size > self.rl.samples_per_prompt:
      raise ValueError(f"downsample.group_size ({self.downsample.group_size}) exceeds "
                       f"rl.samples_per_prompt ({self.rl.samples_per_prompt})")
    need = self.agent.max_response_tokens + 1
    if self.engine.max_len <= need:
      logging.warning("engine.max_len=%d leaves little room for prompts beyond the %d-token "
                      "response budget", self.engine.max_len, self.agent.max_response_tokens)


def _seed(*parts: int) -> int:
  return int(np.random.SeedSequence([p & 0xFFFFFFFF for p in parts]).generate_state(1)[0]
             % (2 ** 31 - 1))


def rollout_metrics(trajs: Sequence[agent_loop.Trajectory], prefix: str = "rollout/"
                    ) -> dict[str, float]:
  n = max(len(trajs), 1)
  calls = sum(t.num_tool_calls for t in trajs)
  errs = sum(t.num_tool_errors for t in trajs)
  pos = [t for t in trajs if t.reward and t.reward > 0]
  pos_calls = sum(t.num_tool_calls for t in pos)
  out = {
      "reward_mean": sum(t.reward or 0.0 for t in trajs) / n,
      "tool_calls_per_traj": calls / n,
      "tool_error_rate": errs / calls if calls else 0.0,
      "tool_error_rate_correct": (sum(t.num_tool_errors for t in pos) / pos_calls
                                  if pos_calls else 0.0),
      "no_tool_share": sum(t.num_tool_calls == 0 for t in trajs) / n,
      "truncated_share": sum(t.truncated for t in trajs) / n,
      "model_tokens_mean": sum(t.model_tokens for t in trajs) / n,
      "response_tokens_mean": sum(len(t.response_ids) for t in trajs) / n,
      "turns_mean": sum(t.num_turns for t in trajs) / n,
  }
  return {prefix + k: v for k, v in out.items()}


class RLTrainer:
  """Owns the train state, the engines and the data position of one RL stage."""

  def __init__(self, setup: RLSetup, model, tokenizer, proto: chat.ChatProtocol,
               problems: Sequence[math_data.MathProblem], tools: agent_loop.ToolExecutor,
               workdir: str, *, mesh=None, fresh_optimizer: bool = True):
    self.setup = setup
    self.tok, self.proto, self.tools = tokenizer, proto, tools
    self.workdir = workdir
    self.mesh = mesh
    self.tx = optim.make_optimizer(setup.optimizer)
    self.graphdef, self.state, self.shardings = ts.init_train_state(model, self.tx, mesh)
    self.data = math_data.EpochIterator(list(problems), batch_size=setup.rl.prompts_per_step,
                                        seed=setup.rl.seed)
    self.ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                      max_to_keep=setup.rl.keep_checkpoints)
    self.writer = metrics_lib.MetricsWriter(workdir, "rl")
    self.train_step = ts.make_train_step(self.graphdef, self.tx, setup.loss, setup.step,
                                         mesh=mesh, state_shardings=self.shardings)
    self.logprob_fn = (ts.make_logprob_fn(self.graphdef, setup.step, mesh=mesh)
                       if setup.rl.old_logprobs == "recompute" else None)
    self.engine = JaxEngine(model, setup.engine, name="jax0")
    self.engine.update_params(self.state.params)
    self.pool = EnginePool([self.engine], policy=setup.rl.scheduler_policy)
    self.step = 0
    self.last_trajectories: list[agent_loop.Trajectory] = []

  # ---- checkpoints -------------------------------------------------------------
  def maybe_restore(self) -> bool:
    if self.ckpt.latest_step() is None:
      return False
    self.state, meta = self.ckpt.restore(self.state, self.shardings)
    self.data.restore(meta["data"])
    self.step = int(meta["step"])
    self.engine.update_params(self.state.params)
    self.writer.truncate_after(self.step)
    logging.info("resumed RL from %s at step %d", self.ckpt.directory, self.step)
    return True

  def save(self) -> None:
    self.ckpt.save(self.step, self.state, {"step": self.step, "data": self.data.state()})

  def params(self):
    return self.state.params

  def model(self):
    return nnx.merge(self.graphdef, self.state.params)

  def fixed_rows(self, row_multiple: int) -> int | None:
    """Rows of every batch with rl.fixed_rows: the most trajectories a step can keep."""
    s = self.setup
    if not s.rl.fixed_rows:
      return None
    per_group = (s.rl.samples_per_prompt if s.downsample.method == "none"
                 else s.downsample.group_size)
    return -(-s.rl.prompts_per_step * per_group // row_multiple) * row_multiple

  def max_batch_len(self) -> int:
    """No trajectory is longer than the engine's KV cache, so the power-of-two length
    bucket never needs to exceed it (rounded to rl.length_multiple)."""
    m = self.setup.rl.length_multiple
    return -(-self.setup.engine.max_len // m) * m

  # ---- one step ------------------------------------------------------------------
  def rollouts(self, batch: Sequence[math_data.MathProblem], step: int
               ) -> list[list[agent_loop.Trajectory]]:
    n = self.setup.rl.samples_per_prompt
    items = [(f"{p.uid}#{k}", p.problem) for p in batch for k in range(n)]
    seeds = [_seed(self.setup.rl.seed, step, i) for i in range(len(items))]
    trajs = asyncio.run(agent_loop.run_many(self.pool, self.tools, self.proto, items,
                                            self.setup.agent, seeds=seeds))
    for t, (p, _) in zip(trajs, [(p, k) for p in batch for k in range(n)]):
      t.reward = rewards.compute_reward(t.model_text(self.tok), p.answer,
                                        truncated=t.truncated)
      t.meta["problem_uid"] = p.uid
    return [trajs[i * n:(i + 1) * n] for i in range(len(batch))]

  def run_step(self) -> dict[str, float]:
    setup, step = self.setup, self.step
    t0 = time.perf_counter()
    batch = next(self.data)
    groups = self.rollouts(batch, step)
    t_roll = time.perf_counter() - t0
    flat = [t for g in groups for t in g]
    metrics = rollout_metrics(flat)
    self.last_trajectories = flat

    stats = [[t.rollout_stats() for t in g] for g in groups]
    ds = roc.downsample(stats, setup.downsample, np.random.default_rng([setup.rl.seed, step]))
    metrics.update(ds.stats)  # keys already carry the "roc/" prefix
    kept = [[g[i] for i in idx] for g, idx in zip(groups, ds.kept)]
    kept = [g for g in kept if g]
    metrics.update(rollout_metrics([t for g in kept for t in g], prefix="kept/"))
    metrics["time/rollout_s"] = t_roll
    gen_tokens = sum(t.model_tokens for t in flat)
    metrics["time/rollout_tokens_per_s"] = gen_tokens / max(t_roll, 1e-9)
    if not kept:
      logging.warning("step %d: every group was dropped; no update", step)
      metrics["update/skipped"] = 1.0
      self.step += 1
      return metrics

    advs = adv_lib.compute_advantages([[t.reward for t in g] for g in kept], setup.advantage)
    trajs = [t for g in kept for t in g]
    adv_flat = np.concatenate(advs).astype(np.float32)
    rows = setup.step.micro_batches * (1 if self.mesh is None else
                                       self.mesh.shape["data"] * self.mesh.shape["fsdp"])
    arrays = batching.build_batch([t.token_trajectory() for t in trajs], adv_flat,
                                  row_multiple=rows, length_multiple=setup.rl.length_multiple,
                                  pow2_rows=setup.rl.pow2_rows,
                                  max_len=self.max_batch_len(),
                                  fixed_rows=self.fixed_rows(rows),
                                  pad_id=self.tok.pad_id)
    t1 = time.perf_counter()
    if self.logprob_fn is not None:
      arrays["old_logp"] = np.asarray(self.logprob_fn(
          self.state.params, arrays["input_ids"], arrays["target_ids"],
          arrays["attention_mask"]))
    new_state, m = self.train_step(self.state, arrays)
    m = jax.device_get(m)
    if not (np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"])):
      path = os.path.join(self.workdir, f"nonfinite_batch_step{step}.npz")
      np.savez(path, **arrays)
      raise FloatingPointError(f"step {step}: loss={m['loss']} grad_norm={m['grad_norm']}; "
                               f"batch saved to {path}; last checkpoint is intact")
    self.state = new_state
    self.engine.update_params(self.state.params)
    metrics.update({f"train/{k}": float(v) for k, v in m.items()})
    metrics["train/learning_rate"] = float(optim.make_schedule(setup.optimizer)(step))
    metrics["time/train_s"] = time.perf_counter() - t1
    metrics["update/skipped"] = 0.0
    self.step += 1
    return metrics

  # ---- the loop --------------------------------------------------------------------
  def run(self, num_steps: int | None = None, progress: bool = True,
          on_step=None) -> list[dict[str, float]]:
    total = num_steps if num_steps is not None else self.setup.rl.num_steps
    history = []
    bar = None
    if progress:
      from tqdm import tqdm
      bar = tqdm(total=total, initial=min(self.step, total), desc="RL", unit="step")
    poisoned = False
    try:
      while self.step < total:
        try:
          m = self.run_step()
        except FloatingPointError:
          poisoned = True   # the donated state is gone; the last checkpoint is the truth
          raise
        self.writer.write(self.step, m)
        history.append(m)
        if bar is not None:
          bar.update(1)
          bar.set_postfix(reward=f"{m['rollout/reward_mean']:.3f}",
                          tool_err=f"{m['rollout/tool_error_rate']:.2f}",
                          len=f"{m['rollout/model_tokens_mean']:.0f}")
        if on_step is not None:
          on_step(self.step, m)
        if self.step % self.setup.rl.checkpoint_every == 0:
          self.save()
    finally:
      if bar is not None:
        bar.close()
      if not poisoned and self.ckpt.latest_step() != self.step and self.step > 0:
        self.save()   # at exit too (also on Ctrl-C), so nothing finished is lost
    return history

  def close(self):
    self.engine.stop()
    self.ckpt.close()
    self.writer.close()
