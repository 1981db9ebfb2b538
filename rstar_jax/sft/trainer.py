"""Cold-start SFT loop: packed conversations, warm-up + cosine, held-out loss, resumable."""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from typing import Sequence

from absl import logging
from flax import nnx
import numpy as np

from rstar_jax import checkpoint as ckpt_lib
from rstar_jax import distributed
from rstar_jax import metrics_writer as metrics_lib
from rstar_jax import optim
from rstar_jax import sharding
from rstar_jax.sft import packing
from rstar_jax.sft import train_step as sft_ts
from rstar_jax.train import interrupt
from rstar_jax.train import step as ts


def _sft_optimizer() -> optim.OptimizerConfig:
  return optim.OptimizerConfig(learning_rate=5e-6, warmup_steps=10, schedule="warmup_cosine",
                               weight_decay=0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
  """Attributes:
    epochs: passes over the packed rows (fractions allowed).
    seq_len / rows_per_step: packed row length and rows per update.
    heldout_share: the first share of the conversations is held out (held-out NLL).
    eval_every / checkpoint_every / keep_checkpoints: held-out loss and orbax cadence.
    optimizer: AdamW + schedule; "warmup_cosine" decays to the last step.
    step: micro-batching and log-prob chunking of the update.
  """
  epochs: float = 3.0
  seq_len: int = 1024
  rows_per_step: int = 8
  heldout_share: float = 0.05
  eval_every: int = 50
  checkpoint_every: int = 200
  keep_checkpoints: int = 2
  optimizer: optim.OptimizerConfig = dataclasses.field(default_factory=_sft_optimizer)
  step: ts.StepConfig = dataclasses.field(default_factory=ts.StepConfig)

  def __post_init__(self):
    if not self.epochs > 0:
      raise ValueError(f"SFTConfig.epochs must be > 0, got {self.epochs!r}")
    if self.seq_len < 2:   # a row holds inputs and their next-token targets
      raise ValueError(f"SFTConfig.seq_len must be >= 2, got {self.seq_len!r}")
    for name in ("rows_per_step", "eval_every", "checkpoint_every", "keep_checkpoints"):
      if getattr(self, name) <= 0:
        raise ValueError(f"SFTConfig.{name} must be >= 1, got {getattr(self, name)!r}")
    if not 0 <= self.heldout_share < 1:
      raise ValueError(f"SFTConfig.heldout_share must be in [0, 1), got {self.heldout_share}")
    if self.step.fused_head_loss:
      # The fused head makes the RL loss's gradient in its forward pass; SFT's
      # cross-entropy step does not go through it, so the value would do nothing.
      raise ValueError("SFTConfig.step.fused_head_loss=True: the fused head is the RL "
                       "step's (rl.step.fused_head_loss); SFT's step does not use it. Fix: "
                       "leave sft.step.fused_head_loss False")


def num_steps(cfg: SFTConfig, num_rows: int) -> int:
  return max(1, math.ceil(cfg.epochs * max(num_rows // cfg.rows_per_step, 1)))


def split_heldout(pairs: Sequence, share: float) -> tuple[list, list]:
  """(train, heldout): the first `share` of the conversations (at least one) held out."""
  if share <= 0:
    return list(pairs), []
  n_held = max(1, int(len(pairs) * share))
  return list(pairs[n_held:]), list(pairs[:n_held])


class SFTTrainer:
  """Packs `pairs` ((ids, loss_mask) per conversation) and trains on them."""

  def __init__(self, cfg: SFTConfig, model, pairs: Sequence[tuple[list[int], list[int]]],
               workdir: str, *, seed: int = 0, pad_id: int = 0, mesh=None,
               rules=sharding.DEFAULT_RULES):
    self.cfg, self.step_cfg, self.workdir, self.mesh = cfg, cfg.step, workdir, mesh
    self.seed = seed
    train, heldout = split_heldout(pairs, cfg.heldout_share)
    step_cfg, opt_cfg = cfg.step, cfg.optimizer
    self.rows, pack_stats = packing.pack(train, cfg.seq_len, pad_id=pad_id)
    self.heldout, _ = packing.pack(heldout, cfg.seq_len, pad_id=pad_id) if heldout else (None, None)
    logging.info("SFT packing: %s", pack_stats)
    if pack_stats["truncated"]:
      logging.warning("SFT: %d conversations longer than seq_len=%d were truncated",
                      pack_stats["truncated"], cfg.seq_len)
    n_rows = len(self.rows["input_ids"])
    if n_rows < cfg.rows_per_step:
      raise ValueError(f"SFT: only {n_rows} packed rows for rows_per_step={cfg.rows_per_step}")
    self.total_steps = num_steps(cfg, n_rows)
    if opt_cfg.total_steps is None and opt_cfg.warmup_ratio is not None:
      opt_cfg = dataclasses.replace(opt_cfg, total_steps=self.total_steps)
    elif opt_cfg.schedule == "warmup_cosine" and opt_cfg.total_steps is None:
      opt_cfg = dataclasses.replace(opt_cfg, total_steps=max(self.total_steps,
                                                             opt_cfg.warmup_steps + 1))
    self.opt_cfg = opt_cfg
    self.tx = optim.make_optimizer(opt_cfg)
    self.graphdef, self.state, self.shardings = ts.init_train_state(model, self.tx, mesh,
                                                                    rules)
    self.step_fn = sft_ts.make_sft_step(self.graphdef, self.tx, step_cfg, mesh=mesh,
                                        rules=rules, state_shardings=self.shardings)
    self.eval_fn = sft_ts.make_eval_fn(self.graphdef, step_cfg, mesh=mesh, rules=rules)
    self.ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                      max_to_keep=cfg.keep_checkpoints)
    self.writer = metrics_lib.MetricsWriter(workdir, "sft")
    self.step = 0
    self.pack_stats = pack_stats
    # What a checkpoint's steps were taken over: the packed rows, the batch order's seed,
    # the step count (the schedule's length). A resume over other data or settings would
    # go on with another schedule and other batches, silently.
    h = hashlib.sha1()
    for k in sorted(self.rows):
      h.update(k.encode())
      h.update(np.ascontiguousarray(self.rows[k]).tobytes())
    self.run_key = {"rows": h.hexdigest()[:16], "seed": seed, "total_steps": self.total_steps,
                    "rows_per_step": cfg.rows_per_step}

  def _batch_indices(self, step: int) -> np.ndarray:
    n = len(self.rows["input_ids"])
    per_epoch = n // self.cfg.rows_per_step
    epoch, k = divmod(step, per_epoch)
    order = np.random.default_rng([self.seed, epoch]).permutation(n)
    return order[k * self.cfg.rows_per_step:(k + 1) * self.cfg.rows_per_step]

  def heldout_loss(self) -> float | None:
    if self.heldout is None:
      return None
    n = len(self.heldout["input_ids"])
    mult = ts.batch_multiple(self.step_cfg.micro_batches, self.mesh)
    pad = (-n) % mult
    batch = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)])
             for k, v in self.heldout.items()}
    s, t = self.eval_fn(self.state.params, batch)
    s, t = float(distributed.host_value(s)), float(distributed.host_value(t))
    return s / t if t else None   # no target token: missing, not 0 (rollout/stats.py)

  def maybe_restore(self) -> bool:
    if self.ckpt.latest_step() is None:
      self.writer.truncate_after(0)   # rows of a run killed before its first checkpoint
      return False
    self.state, meta = self.ckpt.restore(self.state, self.shardings)
    saved = meta.get("run")   # None: a checkpoint from before it was recorded
    if saved is not None and saved != self.run_key:
      changed = ", ".join(f"{k}: {saved.get(k)} -> {v}" for k, v in self.run_key.items()
                          if saved.get(k) != v)
      raise ValueError(f"SFT checkpoint in {self.ckpt.directory} was made over other data or "
                       f"settings ({changed}); resuming would change the run's batches and "
                       f"schedule. Move that directory away to start SFT afresh")
    self.step = int(meta["step"])
    self.writer.truncate_after(self.step)
    logging.info("resumed SFT at step %d", self.step)
    return True

  def run(self, progress: bool = True, on_step=None) -> list[dict[str, float]]:
    """Trains to the end; `on_step(step, metrics)` after every step (e.g. probes).
    On SIGINT / SIGTERM: finishes the step, saves, raises `interrupt.Interrupted`."""
    from tqdm import tqdm
    history = []
    state_ok = True      # False while the jitted step holds the donated state
    try:
      with tqdm(total=self.total_steps, initial=self.step, desc="SFT", unit="step",
                disable=not progress or not distributed.is_main()) as bar, \
          interrupt.StopRequests() as stop:
        while self.step < self.total_steps:
          # Before every step, the first included: a signal during set-up must not wait
          # for a step (process 0 decides for all).
          if distributed.share_from_main(stop.requested):
            raise interrupt.Interrupted(stop.signum, self.step)
          idx = self._batch_indices(self.step)
          batch = {k: v[idx] for k, v in self.rows.items()}
          state_ok = False
          new_state, m = self.step_fn(self.state, batch)
          m = {f"sft/{k}": float(distributed.host_value(v)) for k, v in m.items()}
          if not math.isfinite(m["sft/loss"]):
            raise FloatingPointError(f"SFT step {self.step}: non-finite loss")
          self.state, state_ok = new_state, True
          m["sft/learning_rate"] = float(optim.make_schedule(self.opt_cfg)(self.step))
          self.step += 1
          if self.step % self.cfg.eval_every == 0 or self.step == self.total_steps:
            m["sft/heldout_nll"] = self.heldout_loss()
          self.writer.write(self.step, {k: v for k, v in m.items() if v is not None})
          history.append(m)
          bar.update(1)
          bar.set_postfix(loss=f"{m['sft/loss']:.3f}")
          if on_step is not None:
            on_step(self.step, m)
          if self.step % self.cfg.checkpoint_every == 0:
            self.save()
    finally:
      # At any exit with a consistent state (a second Ctrl-C, an error), the last
      # finished step is saved, as RL does: up to checkpoint_every - 1 steps were lost.
      if state_ok and self.step > 0:
        self.save()
    return history

  def save(self) -> None:
    if self.ckpt.latest_step() != self.step:
      self.ckpt.save(self.step, self.state, {"step": self.step, "run": self.run_key})

  def model(self):
    return nnx.merge(self.graphdef, self.state.params)

  def close(self):
    self.ckpt.close()
    self.writer.close()
