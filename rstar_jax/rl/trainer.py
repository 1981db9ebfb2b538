"""The GRPO-RoC training loop.

One step: a batch of prompts -> 2G rollouts each (engines + sandbox, concurrently)
-> outcome rewards -> RoC down-sampling to G -> group advantages -> one sharded
policy update -> the engines get the new parameters (in process: a reference).

The engines and the tool executor are given to the trainer (see
`rollout.backends.build_engine_pool`, `rollout.sandbox_client.build_tools`); it never builds them.

Reproducibility and resumption: every random choice of step s derives from
(seed, s): rollout seeds, the RoC generator. The data iterator's position is saved
with the checkpoint, so a resumed run takes the same next batch and, with the same
parameters and optimizer state, produces the same next step. SIGINT / SIGTERM stop
the loop at a step boundary (see `train.interrupt`), so that holds for them too.

With rl.async_rollouts.max_staleness = k >= 1 the rollouts of the next k steps are
generated in a worker thread while a step trains, step s by the policy after exactly
max(s - k, t0) updates (rl/async_rollouts.py: the schedule, why it is not timing's, and
the pending rollouts a checkpoint carries); k = 0 runs the loop above unchanged.
"""
from __future__ import annotations

import dataclasses
import math
import os
import secrets
import time
from typing import Sequence

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from rstar_jax import checkpoint as ckpt_lib
from rstar_jax import config_utils
from rstar_jax import distributed
from rstar_jax import metrics_writer as metrics_lib
from rstar_jax import optim
from rstar_jax import sharding
from rstar_jax.data import math_problems
from rstar_jax.rl import advantages as adv_lib
from rstar_jax.rl import async_rollouts as async_lib
from rstar_jax.rl import batching, losses, roc, rollout_collector
from rstar_jax.rl import train_step as ts
from rstar_jax.rollout import agent_loop, chat
from rstar_jax.train import interrupt
from rstar_jax.train import step as core

OLD_LOGPROBS = ("sampler", "recompute")
# rl.reference: the policy the KL term (loss.kl_coef > 0) measures against.
STAGE_START = "stage_start"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLConfig:
  """`config.rl`: what every RL stage shares (the stage sets steps and the agent budget).

  Attributes:
    prompts_per_step: problems per step.
    samples_per_prompt: rollouts per problem (2G); RoC keeps downsample.group_size (G).
    old_logprobs: "sampler" (the engine's log-probs) or "recompute" (a trainer-side
      forward before the update).
    checkpoint_every / keep_checkpoints: orbax checkpoints of the stage.
    length_multiple: pad the batch length to a multiple (fewer recompiles).
    pow2_rows: pad the row count to a power of two: with dropped groups the kept
      count varies per step and every distinct count would be a fresh compile.
    fixed_rows: pad every batch to the most rows a step can keep (one compile per
      stage; worth it when compiles cost more than the padding: small models).
    reference: the reference policy of the KL term, used only when loss.kl_coef > 0:
      "stage_start" (the parameters the stage starts from: the previous stage's export,
      or the SFT export for stage 1; a resumed stage derives them again from that
      export), or the path of a Hugging Face export directory (e.g. `<workdir>/sft/export`
      to keep every stage close to the SFT model). Its log-probs are computed on the
      trainer's mesh with the policy's chunked log-prob function; it costs one more copy
      of the parameters (no gradient, no optimizer state) and one forward per step.
    async_rollouts: bounded-staleness asynchronous rollouts (`max_staleness` k; 0: the
      synchronous loop), rl/async_rollouts.py and docs/guides/async_rollouts.md. The
      off-policy correction that goes with it is `loss.off_policy`.
    downsample, advantage, loss, optimizer, step: the components' own configs.
  """
  prompts_per_step: int = 8
  samples_per_prompt: int = 32
  old_logprobs: str = "sampler"
  checkpoint_every: int = 50
  keep_checkpoints: int = 3
  length_multiple: int = 64
  pow2_rows: bool = True
  fixed_rows: bool = False
  reference: str = STAGE_START
  downsample: roc.DownsampleConfig = dataclasses.field(default_factory=roc.DownsampleConfig)
  advantage: adv_lib.AdvantageConfig = dataclasses.field(
      default_factory=adv_lib.AdvantageConfig)
  loss: losses.LossConfig = dataclasses.field(default_factory=losses.LossConfig)
  optimizer: optim.OptimizerConfig = dataclasses.field(default_factory=optim.OptimizerConfig)
  step: core.StepConfig = dataclasses.field(default_factory=core.StepConfig)
  async_rollouts: async_lib.AsyncRolloutsConfig = dataclasses.field(
      default_factory=async_lib.AsyncRolloutsConfig)

  def __post_init__(self):
    if self.old_logprobs not in OLD_LOGPROBS:
      raise ValueError(f"RLConfig.old_logprobs={self.old_logprobs!r}; choose from {OLD_LOGPROBS}")
    for name in ("prompts_per_step", "samples_per_prompt", "checkpoint_every",
                 "keep_checkpoints", "length_multiple"):
      if getattr(self, name) <= 0:
        raise ValueError(f"RLConfig.{name} must be positive, got {getattr(self, name)}")
    if not isinstance(self.reference, str) or not self.reference.strip():
      raise ValueError(f"RLConfig.reference must be {STAGE_START!r} or the path of a Hugging "
                       f"Face export directory, got {self.reference!r}")
    if self.loss.needs_proximal and self.old_logprobs != "sampler":
      # The decoupled objective's behaviour policy IS the sampler; recomputed log-probs
      # are the proximal policy's, which it computes itself.
      raise ValueError(f"RLConfig: loss.off_policy={self.loss.off_policy!r} weighs by the "
                       "sampler's log-probs; set old_logprobs='sampler'")
    if self.async_rollouts.max_staleness > 0 and self.old_logprobs == "recompute" and (
        not self.loss.needs_proximal):
      # The recomputation runs on the parameters being updated, not on the (older) ones
      # that sampled: the ratio would ignore the staleness altogether.
      raise ValueError("RLConfig: old_logprobs='recompute' under async_rollouts."
                       "max_staleness > 0 would take the ratio against the current "
                       "parameters, not the sampler's; use old_logprobs='sampler' (and "
                       "loss.off_policy='behaviour' or 'decoupled')")
    if self.step.fused_head_loss:
      losses.require_token_linear(self.loss, "RLConfig.step.fused_head_loss")
    if self.downsample.group_size > self.samples_per_prompt:
      raise ValueError(f"RLConfig: downsample.group_size ({self.downsample.group_size}) "
                       f"exceeds samples_per_prompt ({self.samples_per_prompt})")


class RLTrainer:
  """Owns the train state and the data position of one RL stage.

  `engines` is an engine pool (`Engine` protocol plus `update_weights` and `max_len`);
  `tools` the agent loop's tool executor. Both belong to the caller.
  `reference`: with loss.kl_coef > 0, the reference policy's model (rl.reference as a
  path, loaded by the caller); None: the stage's starting parameters, `model`'s.
  """

  def __init__(self, config: RLConfig, agent: agent_loop.AgentConfig, model, tokenizer,
               proto: chat.ChatProtocol, problems: Sequence[math_problems.MathProblem], *,
               engines, tools: agent_loop.ToolExecutor, workdir: str, seed: int = 0,
               mesh=None, rules=sharding.DEFAULT_RULES, reference=None):
    self.config, self.agent, self.seed = config, agent, seed
    self.tok, self.proto, self.tools, self.engines = tokenizer, proto, tools, engines
    self.workdir, self.mesh = workdir, mesh
    need = agent.max_response_tokens + 1
    if engines.max_len <= need:
      logging.warning("engines hold %d tokens: little room for prompts beyond the %d-token "
                      "response budget", engines.max_len, agent.max_response_tokens)
    loss_cfg = config.loss
    if loss_cfg.max_response_len is None:
      # seq-mean-token-sum-norm's constant: the stage's response budget.
      loss_cfg = dataclasses.replace(loss_cfg, max_response_len=agent.max_response_tokens)
    self.tx = optim.make_optimizer(config.optimizer)
    self.graphdef, self.state, self.shardings = core.init_train_state(model, self.tx, mesh,
                                                                      rules)
    self.data = math_problems.EpochIterator(list(problems),
                                            batch_size=config.prompts_per_step, seed=seed)
    self.ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                      max_to_keep=config.keep_checkpoints)
    self.writer = metrics_lib.MetricsWriter(workdir, "rl")
    self.train_step = ts.make_train_step(self.graphdef, self.tx, loss_cfg, config.step,
                                         temperature=agent.temperature, mesh=mesh,
                                         rules=rules, state_shardings=self.shardings)
    need_logprobs = (config.old_logprobs == "recompute" or loss_cfg.kl_coef > 0
                     or loss_cfg.needs_proximal)
    # One jitted forward (chunked log-probs, micro-batched) for the recomputed old
    # log-probs and the reference's: the same program on other parameters.
    self._logprobs = (ts.make_logprob_fn(self.graphdef, config.step,
                                         temperature=agent.temperature, mesh=mesh,
                                         rules=rules) if need_logprobs else None)
    self.logprob_fn = self._logprobs if config.old_logprobs == "recompute" else None
    self.ref_params = None
    self.ref_fingerprint: list[float] | None = None
    if loss_cfg.kl_coef > 0:
      self.ref_params = self._reference_params(reference)
      self.ref_fingerprint = _fingerprint(self.ref_params)
    self.step = 0
    # This launch's mark on every version name: a server that missed this launch's
    # updates (out of rotation, or restarted) holding an earlier launch's `stage1-step13`
    # must not pass for holding this one's (a resumed step is not bitwise the same on
    # every backend, nor after allow_config_change).
    self.launch = distributed.share_from_main(secrets.token_hex(3))
    # The engines move onto these parameters at the first step, not here: a resume or a
    # carry-over replaces them first, and each sync is a full checkpoint write and a
    # reload on every server (minutes at 14B).
    self.version: str | None = None
    self._state_ok = True     # False while a donated state is inside the jitted step
    self._unwritten: tuple[int, dict] | None = None   # a finished step's row, not yet written
    self.last_trajectories: list[agent_loop.Trajectory] = []
    # Asynchronous rollouts (rl.async_rollouts.max_staleness > 0): the worker pipeline,
    # made at the first step (or at a resume, holding the checkpoint's pending steps).
    self.max_staleness = config.async_rollouts.max_staleness
    self._in_flight = config.async_rollouts.weight_updates == "between_requests"
    if self._in_flight and self.max_staleness > 0 and not hasattr(
        engines, "update_weights_between_requests"):
      raise ValueError("rl.async_rollouts.weight_updates='between_requests' needs an engine "
                       "pool (rollout.backends.build_engine_pool) that can hold its calls for "
                       f"an update; got {type(engines).__name__}")
    self._pipeline: async_lib.RolloutPipeline | None = None
    self._version_steps: dict[str, int] = {}    # weight version name -> its update count
    self._num_steps: int | None = None          # the stage's length (run's argument)
    if self.max_staleness > 0 and jax.process_count() > 1:
      raise config_utils.ConfigError(
          "rl.async_rollouts.max_staleness > 0 runs on one process only for now (process "
          "0 alone generates; the parameter copies it hands its engines are global arrays)")
    # The engines get their own copy of each version: the train step donates the state's
    # buffers while they still generate with it (compiled only if called: k > 0).
    self._copy_params = jax.jit(
        lambda p: jax.tree.map(jnp.copy, p),
        out_shardings=None if self.shardings is None else self.shardings.params)

  # ---- the reference policy (KL term) -----------------------------------------------
  def _reference_params(self, reference):
    """The reference's parameters: a copy on the trainer's shardings (the train step
    donates the state's buffers, so the starting parameters cannot be shared)."""
    if reference is None:
      params = self.state.params
    else:
      graphdef, params, rest = nnx.split(reference, nnx.Param, ...)
      mine, theirs = jax.tree.structure(self.state.params), jax.tree.structure(params)
      if jax.tree.leaves(rest) or mine != theirs or any(
          (a.shape, a.dtype) != (b.shape, b.dtype)
          for a, b in zip(jax.tree.leaves(self.state.params), jax.tree.leaves(params))):
        raise config_utils.ConfigError(
            "rl.reference: the reference model's parameters (names, shapes, dtypes) differ "
            "from the policy's; it must be a checkpoint of the same architecture")
      if self.shardings is not None:
        params = jax.device_put(params, self.shardings.params)
      return params    # the caller's model: never donated, no copy needed
    copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p),
                   out_shardings=None if self.shardings is None else self.shardings.params)
    return copy(params)

  def reference_logprobs(self, arrays: dict) -> np.ndarray:
    """[N, T] log-probs of the batch's targets under the reference policy."""
    return distributed.host_value(self._logprobs(
        self.ref_params, arrays["input_ids"], arrays["target_ids"], arrays["attention_mask"]))

  # ---- checkpoints -------------------------------------------------------------
  def maybe_restore(self) -> bool:
    """Resumes from this stage's latest checkpoint, if any."""
    if self.ckpt.latest_step() is None:
      self.writer.truncate_after(0)   # rows of a run killed before its first checkpoint
      return False
    self.state, meta = self.ckpt.restore(self.state, self.shardings)
    saved = meta.get("reference")
    if self.ref_fingerprint is not None and saved is not None and not _same_fingerprint(
        saved, self.ref_fingerprint):
      # The reference is derived again at every launch (from the export the stage
      # started from, or rl.reference's path): refused if that is no longer the model
      # the checkpoint's steps were taken against.
      raise config_utils.ConfigError(
          f"rl.reference: the reference policy differs from the one {self.ckpt.directory} "
          "was trained against (its parameters' fingerprint changed: the starting export or "
          "the rl.reference directory was replaced); restore it, or start the stage again")
    self.data.restore(meta["data"])
    self.step = int(meta["step"])
    self.version = None          # the engines follow at the next step
    self.writer.truncate_after(self.step)
    if self.max_staleness > 0:
      self._adopt_pending()
    logging.info("resumed RL from %s at step %d", self.ckpt.directory, self.step)
    return True

  def carry_over_from(self, checkpoint_dir: str) -> bool:
    """Starts from another stage's last parameters AND optimizer state (Adam moments),
    with this stage's own step count and data order. False if it has no checkpoint."""
    if not os.path.isdir(checkpoint_dir):   # not created here (the Checkpointer would)
      return False
    other = ckpt_lib.Checkpointer(checkpoint_dir)
    try:
      if other.latest_step() is None:
        return False
      state, _ = other.restore(self.state, self.shardings)
    finally:
      other.close()
    self.state = core.TrainState(self.state.step, state.params, state.opt_state)
    self.version = None          # the engines follow at the next step
    return True

  def save(self) -> None:
    """Checkpoints the current step (once: a step already saved is not written again)."""
    if self.ckpt.latest_step() != self.step:
      meta = {"step": self.step, "data": self.data.state()}
      if self.ref_fingerprint is not None:
        meta["reference"] = self.ref_fingerprint
      if self._pipeline is not None:
        # The batches of the pending steps are drawn already: the checkpoint holds the
        # data position of this step's, and the pending rollouts are written first, so
        # that a checkpoint on disk always has its pending file.
        meta["data"] = self._save_pending()
      self.ckpt.save(self.step, self.state, meta)
      if self._pipeline is not None:
        async_lib.drop_other_pending(self._pending_dir(), self.step)

  def params(self):
    return self.state.params

  def weight_version(self, step: int | None = None) -> str:
    """The name of the policy after `step` updates of this stage in this launch
    (`stage1-step12-3fa9c1`)."""
    stage = os.path.basename(os.path.normpath(self.workdir))
    return f"{stage}-step{self.step if step is None else step}-{self.launch}"

  def _sync_weights(self, step: int | None = None) -> None:
    """Engines generate with the current parameters, named by the step they follow."""
    version = self.weight_version(step)
    self.version = None          # a sync that fails is tried again at the next step
    self.engines.update_weights(self.state.params, version)
    self.version = version       # only once the engines hold it

  def model(self):
    return nnx.merge(self.graphdef, self.state.params)

  def fixed_rows(self, row_multiple: int) -> int | None:
    """Rows of every batch with rl.fixed_rows: the most trajectories a step can keep."""
    c = self.config
    if not c.fixed_rows:
      return None
    per_group = c.samples_per_prompt if c.downsample.method == "none" else c.downsample.group_size
    return -(-c.prompts_per_step * per_group // row_multiple) * row_multiple

  def max_batch_len(self) -> int:
    """No trajectory is longer than the engines' KV cache, so the power-of-two length
    bucket never needs to exceed it (rounded to rl.length_multiple)."""
    m = self.config.length_multiple
    return -(-self.engines.max_len // m) * m

  # ---- one step ------------------------------------------------------------------
  def rollouts(self, batch: Sequence[math_problems.MathProblem], step: int
               ) -> list[list[agent_loop.Trajectory]]:
    return rollout_collector.collect(self.engines, self.tools, self.proto, self.tok, batch,
                                     k=self.config.samples_per_prompt, agent=self.agent,
                                     stream=(self.seed, step))

  def run_step(self) -> dict[str, float]:
    if self.max_staleness > 0:
      return self._run_step_async()
    data_before, step_before = self.data.state(), self.step
    try:
      return self._run_step()
    except BaseException:
      if self.step == step_before:   # not updated: the step's batch is drawn again
        self.data.restore(data_before)
      raise

  def _run_step(self) -> dict[str, float]:
    step = self.step
    if self.version is None:     # every process: the export is a collective
      self._sync_weights()
    batch = next(self.data)    # every process draws it: they all keep the data position
    # Process 0 alone generates; every process gets its metrics and batch arrays.
    metrics, arrays = distributed.on_main(lambda: self._prepare(batch, step),
                                          f"step {step}: preparing the batch")
    if arrays is None:
      self.step += 1
      return metrics
    return self._update(metrics, arrays, step)

  def _prepare(self, batch, step: int) -> tuple[dict[str, float], dict | None]:
    """Rollouts, RoC, advantages -> (metrics, the padded batch arrays or None)."""
    t0 = time.perf_counter()
    groups = self.rollouts(batch, step)
    return self._batch_from(groups, step, time.perf_counter() - t0)

  def _batch_from(self, groups, step: int, t_roll: float, pending=None
                  ) -> tuple[dict[str, float], dict | None]:
    """A step's generated groups -> (metrics, the padded batch arrays or None).
    `pending`: an asynchronous step's (entry, seconds waited for it)."""
    config = self.config
    groups, failed = rollout_collector.drop_failed_groups(groups, f"step {step}")
    if pending is None:
      flat = [t for g in groups for t in g]
      rollout_collector.check_weight_versions(flat, self.version, f"step {step}")
    else:
      entry, wait_s = pending
      groups, ages, stale = async_lib.staleness_filter(
          groups, step, self.max_staleness, self._version_steps, entry.version_step)
      flat = [t for g in groups for t in g]
      if stale:
        logging.warning("step %d: %d groups dropped: generated with weights more than %d "
                        "versions old or unknown", step, stale, self.max_staleness)
    metrics = rollout_collector.metrics(flat)
    metrics["rollout/failed_groups"] = float(failed)
    self.last_trajectories = flat
    if pending is not None:
      metrics.update({"async/behaviour_version": float(entry.version_step),
                      "async/stale_dropped_groups": float(stale),
                      "time/rollout_wait_s": wait_s})
      if ages:     # a mean over nothing is missing, not 0 (rollout/stats.py)
        metrics["async/staleness_mean"] = float(np.mean(ages))
        metrics["async/staleness_max"] = float(max(ages))
        # Trajectories whose turns came from more than one version (in-flight updates).
        metrics["async/multi_version_share"] = float(np.mean(
            [len(t.weight_versions) > 1 for t in flat]))
      if not groups:
        logging.warning("step %d: every group was dropped; no update", step)
        metrics.update({"time/rollout_s": t_roll, "update/skipped": 1.0,
                        "update/zero_advantage": 1.0})
        return metrics, None

    stats = [[rollout_collector.rollout_stats(t) for t in g] for g in groups]
    ds = roc.downsample(stats, config.downsample, np.random.default_rng([self.seed, step]))
    metrics.update(ds.stats)  # keys already carry the "roc/" prefix
    kept = [[g[i] for i in idx] for g, idx in zip(groups, ds.kept)]
    kept = [g for g in kept if g]
    metrics.update(rollout_collector.metrics([t for g in kept for t in g], prefix="kept/"))
    metrics["time/rollout_s"] = t_roll
    gen_tokens = sum(t.model_tokens for t in flat)
    metrics["time/rollout_tokens_per_s"] = gen_tokens / max(t_roll, 1e-9)
    if not kept:
      logging.warning("step %d: every group was dropped; no update", step)
      metrics["update/skipped"] = 1.0
      metrics["update/zero_advantage"] = 1.0
      return metrics, None

    advs = adv_lib.compute_advantages([[t.reward for t in g] for g in kept], config.advantage)
    trajs = [t for g in kept for t in g]
    adv_flat = np.concatenate(advs).astype(np.float32)
    # 1: no trajectory of the step has a non-zero advantage, so the policy-gradient term
    # (all the loss but a KL term) and its gradient are 0 (see `no_learning_signal`).
    metrics["update/zero_advantage"] = float(not np.any(adv_flat))
    rows = core.batch_multiple(config.step.micro_batches, self.mesh)
    arrays = batching.build_batch([rollout_collector.token_trajectory(t) for t in trajs], adv_flat,
                                  row_multiple=rows, length_multiple=config.length_multiple,
                                  pow2_rows=config.pow2_rows,
                                  max_len=self.max_batch_len(),
                                  fixed_rows=self.fixed_rows(rows),
                                  pad_id=self.tok.pad_id)
    return metrics, arrays

  def _update(self, metrics: dict[str, float], arrays: dict, step: int, sync: bool = True
              ) -> dict[str, float]:
    """The policy update from the step's batch (every process: the step is one
    program over the global mesh), then the engines move to the new parameters
    (sync=False: asynchronous rollouts, whose worker moves them by its schedule)."""
    config = self.config
    t1 = time.perf_counter()
    if self.logprob_fn is not None:
      arrays["old_logp"] = distributed.host_value(self.logprob_fn(
          self.state.params, arrays["input_ids"], arrays["target_ids"],
          arrays["attention_mask"]))
    if config.loss.needs_proximal:
      # The decoupled objective's proximal policy: these parameters, before the update.
      arrays["prox_logp"] = distributed.host_value(self._logprobs(
          self.state.params, arrays["input_ids"], arrays["target_ids"],
          arrays["attention_mask"]))
    if self.ref_params is not None:
      t_ref = time.perf_counter()
      arrays["ref_logp"] = self.reference_logprobs(arrays)
      metrics["time/ref_logp_s"] = time.perf_counter() - t_ref
    self._state_ok = False
    new_state, m = self.train_step(self.state, arrays)
    m = {k: distributed.host_value(v) for k, v in m.items()}
    if not (np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"])):
      path = os.path.join(self.workdir, f"nonfinite_batch_step{step}.npz")
      if distributed.is_main():
        np.savez(path, **arrays)
      raise FloatingPointError(f"step {step}: loss={m['loss']} grad_norm={m['grad_norm']}; "
                               f"batch saved to {path}; last checkpoint is intact")
    # State, step count and data position move together, before the weight sync: a
    # sync that fails (a server, a full disk, a second Ctrl-C) leaves a state that the
    # exit's checkpoint saves as step + 1, not as this step on updated parameters.
    self.state = new_state
    self.step += 1
    self._state_ok = True
    metrics.update({f"train/{k}": float(v) for k, v in m.items()})
    metrics["train/learning_rate"] = optim.applied_learning_rate(
        config.optimizer, distributed.host_value(optim.schedule_count(self.state.opt_state)))
    metrics["time/train_s"] = time.perf_counter() - t1
    metrics["update/skipped"] = 0.0
    if not sync:
      metrics.update(getattr(self.engines, "sync_metrics", dict)())
      return metrics
    try:
      self._sync_weights(self.step)
    except BaseException:
      # The step is done (its checkpoint is saved on the way out): its row is written
      # too, or a resume would go on from the next step without it.
      self._unwritten = (self.step, metrics)
      raise
    metrics.update(getattr(self.engines, "sync_metrics", dict)())
    return metrics

  # ---- the loop --------------------------------------------------------------------
  def run(self, num_steps: int, progress: bool = True, on_step=None
          ) -> list[dict[str, float]]:
    """Trains until step `num_steps`. On SIGINT / SIGTERM: finishes the step, saves,
    raises `interrupt.Interrupted`."""
    history = []
    bar = None
    self._num_steps = num_steps
    if progress and distributed.is_main():
      from tqdm import tqdm
      bar = tqdm(total=num_steps, initial=min(self.step, num_steps), desc="RL", unit="step")
    try:
      with interrupt.StopRequests() as stop:
        while self.step < num_steps:
          # Before every step, the first included: a signal during set-up (a restore, the
          # stage-3 filter) must not wait for a whole step (process 0 decides for all).
          if distributed.share_from_main(stop.requested):
            raise interrupt.Interrupted(stop.signum, self.step)
          m = self.run_step()
          self.writer.write(self.step, m)
          history.append(m)
          if bar is not None:
            bar.update(1)
            # A rate over nothing is missing from `m` (rollout/stats.py): "n/a".
            fmt = lambda k, f: format(m[k], f) if k in m else "n/a"
            bar.set_postfix(reward=fmt("rollout/reward_mean", ".3f"),
                            tool_err=fmt("rollout/tool_error_rate", ".2f"),
                            len=fmt("rollout/model_tokens_mean", ".0f"))
          if on_step is not None:
            on_step(self.step, m)
          if self.step % self.config.checkpoint_every == 0:
            self.save()
    finally:
      if bar is not None:
        bar.close()
      if self._unwritten is not None:
        self.writer.write(*self._unwritten)
        self._unwritten = None
      # At any exit with a consistent state (an abort during rollouts too), so nothing
      # finished is lost; never a state the jitted step had donated.
      try:
        if self._state_ok and self.step > 0:
          self.save()
      finally:
        if self._pipeline is not None:
          # Nothing is generated past a run: a later run() starts its schedule afresh
          # at its first step (t0 of async_rollouts.behaviour_version).
          self._pipeline.close()
          self._pipeline = None
    return history

  # ---- asynchronous rollouts (rl.async_rollouts.max_staleness > 0) ---------------------
  def _pending_dir(self) -> str:
    return os.path.join(self.workdir, "async_pending")

  def _collect_for_pipeline(self, batch, step: int):
    return self.rollouts(batch, step)

  def _pipeline_or_new(self) -> async_lib.RolloutPipeline:
    if self._pipeline is None:
      self._pipeline = async_lib.RolloutPipeline(self.engines, self._collect_for_pipeline,
                                                 in_flight=self._in_flight)
    return self._pipeline

  def _fill_pipeline(self, step: int) -> None:
    """Submits steps step..step+k (those not pending; none past the stage's end) with the
    current parameters, version `step`: each step s gets v(s) = max(s - k, t0)."""
    pipe = self._pipeline_or_new()
    last = step + self.max_staleness
    if self._num_steps is not None:
      last = min(last, self._num_steps - 1)
    params = name = None
    for s in range(step, last + 1):
      if s in pipe.pending:
        continue
      if params is None:
        params, name = self._copy_params(self.state.params), self.weight_version(step)
        self._version_steps[name] = step
      before = self.data.state()
      batch = next(self.data)
      pipe.submit(s, batch, params, name, step, before, self.data.state())
    if self._in_flight:
      # In-flight updates: the engines take this version now, between two calls of
      # whatever step they are generating (rl.async_rollouts.weight_updates).
      if params is None:
        params, name = self._copy_params(self.state.params), self.weight_version(step)
        self._version_steps[name] = step
      pipe.publish(params, name, step)

  def _run_step_async(self) -> dict[str, float]:
    step = self.step
    pipe = self._pipeline_or_new()
    data_before = pipe.pending[step].data_before if step in pipe.pending else self.data.state()
    try:
      self._fill_pipeline(step)
      entry, groups, gen_s, wait_s = pipe.take(step)
      metrics, arrays = self._batch_from(groups, step, gen_s, pending=(entry, wait_s))
      if arrays is None:
        self.step += 1
        return metrics
      return self._update(metrics, arrays, step, sync=False)
    except BaseException:
      if self.step == step:
        # Not updated: what was pending is dropped and the step's batch drawn again;
        # the next step regenerates with the parameters it then holds (t0 = step).
        pipe.cancel()
        self.data.restore(data_before)
      raise

  def _save_pending(self) -> dict:
    """Waits for the pending steps, writes them for this step's checkpoint; returns the
    data position the checkpoint must hold (before the first step not saved)."""
    pending = self._pipeline.pending
    entries = self._pipeline.finished_prefix()   # a failed one and those after: regenerated
    async_lib.save_pending(self._pending_dir(), self.step, entries, self._version_steps)
    # Pending steps run from this one on (the steps before it are trained): the resume
    # restores this position, then moves past the saved steps' batches.
    return pending[min(pending)].data_before if pending else self.data.state()

  def _adopt_pending(self) -> None:
    """Takes back the pending rollouts saved with the restored checkpoint."""
    entries, names = async_lib.load_pending(self._pending_dir(), self.step,
                                            self.max_staleness)
    if self._pipeline is not None:
      self._pipeline.close()
      self._pipeline = None
    if not entries:
      return
    pipe = self._pipeline_or_new()
    self._version_steps.update(names)
    for p in entries:
      pipe.adopt(p)
    self.data.restore(entries[-1].data_after)
    logging.info("resumed %d pending steps of rollouts (steps %d..%d)", len(entries),
                 entries[0].step, entries[-1].step)

  def close(self):
    if self._pipeline is not None:
      self._pipeline.close()
      self._pipeline = None
    self.ckpt.close()
    self.writer.close()


def _fingerprint(params) -> list[float]:
  """Per-leaf sums of squares (float32, on the devices): a few numbers saved with each
  checkpoint that tell whether a resumed stage's reference is the one it started with."""
  sums = jax.jit(lambda p: [jnp.sum(jnp.square(x.astype(jnp.float32)))
                            for x in jax.tree.leaves(p)])(params)
  return [float(distributed.host_value(x)) for x in sums]


def _same_fingerprint(a: Sequence[float], b: Sequence[float]) -> bool:
  # Not bitwise: a resume on another mesh (process count) sums in another order. A
  # replaced model differs far more than float32 rounding of a sum of squares.
  return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-12)
                                  for x, y in zip(a, b))


def no_learning_signal(rows: Sequence[dict]) -> bool:
  """Whether every RL step in `rows` (a stage's metrics rows) had zero advantage on every
  trajectory: equal rewards in every group (all 0, as an untrained policy gets, or all
  1), so the policy gradient was 0 at every step and the stage learned nothing from its
  rewards."""
  steps = [r for r in rows if "update/zero_advantage" in r]
  return bool(steps) and all(r["update/zero_advantage"] == 1.0 for r in steps)
