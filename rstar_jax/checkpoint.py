"""Orbax checkpoints of a TrainState plus JSON metadata (data position, config).

Saves are atomic in orbax (a step directory appears only when complete), so a job
killed mid-save resumes from the previous checkpoint. Restores place every array
straight onto the target shardings.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any

from absl import logging
import jax
import orbax.checkpoint as ocp

from rstar_jax.train import interrupt


@contextlib.contextmanager
def _quiet():
  # Orbax logs a dozen INFO lines per save through absl; keep the console readable.
  old = logging.get_verbosity()
  logging.set_verbosity(logging.WARNING)
  try:
    yield
  finally:
    logging.set_verbosity(old)


class Checkpointer:
  def __init__(self, directory: str, *, max_to_keep: int | None = 3):
    self.directory = os.path.abspath(directory)
    with _quiet():
      self.manager = ocp.CheckpointManager(
          self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                                               create=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: Any, meta: dict[str, Any], *, wait: bool = True) -> None:
    # A second Ctrl-C during the write aborts after it (`interrupt.uninterrupted`):
    # cutting orbax's wait leaves its save threads failing with pages of tracebacks.
    with _quiet(), interrupt.uninterrupted():
      self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                      meta=ocp.args.JsonSave(meta)), force=True)
      if wait:
        self.manager.wait_until_finished()

  def restore(self, state_like: Any, shardings: Any | None = None, step: int | None = None):
    """Restores (state, meta) at `step` (default latest) into `state_like`'s structure."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    if shardings is None:
      abstract = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
          state_like)
    else:
      abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                              state_like, shardings)
    try:
      with _quiet():
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    except Exception as e:  # orbax errors are long; say what failed first
      raise RuntimeError(f"could not restore checkpoint step {step} from {self.directory}: "
                         f"{type(e).__name__}: {e}") from e
    return out.state, out.meta

  def close(self) -> None:
    with _quiet(), interrupt.uninterrupted():
      self.manager.wait_until_finished()
      self.manager.close()
