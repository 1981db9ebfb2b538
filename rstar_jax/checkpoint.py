"""Orbax checkpoints of a TrainState plus JSON metadata (data position, config).

A step directory counts only when it is complete: orbax writes a step into
`<step>.orbax-checkpoint-tmp-*`, puts `commit_success.txt` in it last and renames it,
so a job killed mid-save leaves a temporary directory, removed when the next
Checkpointer opens the directory. A step directory without `commit_success.txt` (a
copy cut off part-way, a file system without atomic rename, a tree damaged by hand)
is moved aside to `<step>.incomplete-<ns>` before orbax lists the steps, with a
warning, so a restart never picks it (orbax itself would) and never deletes it either.

A save that runs out of disk raises `CheckpointWriteError` naming the step, the
directory and the cause; orbax removes old steps only after a save commits, so the
previous checkpoints stay readable. `max_to_keep` counts the complete steps on disk,
so it holds across restarts. Restores place every array straight onto the target
shardings.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
from typing import Any

from absl import logging
import jax
import orbax.checkpoint as ocp

from rstar_jax.train import interrupt

# orbax's marker of a finished step (orbax.checkpoint._src.path.atomicity_types).
COMMIT_FILE = "commit_success.txt"
TMP_MARK = ".orbax-checkpoint-tmp"


class CheckpointWriteError(OSError):
  """A save that did not complete (disk full, permissions): the previous steps are intact."""


@contextlib.contextmanager
def _quiet():
  # Orbax logs a dozen INFO lines per save through absl; keep the console readable.
  old = logging.get_verbosity()
  logging.set_verbosity(logging.WARNING)
  try:
    yield
  finally:
    logging.set_verbosity(old)


def move_aside_incomplete(directory: str) -> list[str]:
  """Renames every step directory of `directory` that lacks orbax's commit file to
  `<name>.incomplete-<ns>`; returns the new paths. Safe to run from every process of
  a job at once: a rename another process already made fails here and is skipped."""
  moved = []
  if not os.path.isdir(directory):
    return moved
  for name in sorted(os.listdir(directory)):
    path = os.path.join(directory, name)
    if not name.isdigit() or not os.path.isdir(path):
      continue
    if os.path.exists(os.path.join(path, COMMIT_FILE)):
      continue
    target = f"{path}.incomplete-{time.time_ns()}"
    try:
      os.rename(path, target)
    except FileNotFoundError:
      continue     # another process of the job moved it first
    logging.warning("checkpoint step %s in %s is incomplete (no %s): moved to %s; it is "
                    "never restored; delete it once inspected", name, directory, COMMIT_FILE,
                    target)
    moved.append(target)
  return moved


class Checkpointer:
  def __init__(self, directory: str, *, max_to_keep: int | None = 3):
    self.directory = os.path.abspath(directory)
    self.moved_aside = move_aside_incomplete(self.directory)
    with _quiet():
      self.manager = ocp.CheckpointManager(
          self.directory, options=ocp.CheckpointManagerOptions(
              max_to_keep=max_to_keep, create=True,
              # A save cut off by a kill or a full disk leaves its temporary directory:
              # remove it, or it would hold the space the next save needs.
              cleanup_tmp_directories=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, state: Any, meta: dict[str, Any], *, wait: bool = True) -> None:
    try:
      # A second Ctrl-C during the write aborts after it (`interrupt.uninterrupted`):
      # cutting orbax's wait leaves its save threads failing with pages of tracebacks.
      with _quiet(), interrupt.uninterrupted():
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)
        if wait:
          self.manager.wait_until_finished()
    except Exception as e:
      self._drop_tmp(step)
      cause = _os_error(e)
      why = ("the disk is full (ENOSPC)" if cause is not None and cause.errno == errno.ENOSPC
             else f"{type(e).__name__}: {e}")
      raise CheckpointWriteError(
          cause.errno if cause is not None else errno.EIO,
          f"checkpoint step {step} was not written to {self.directory}: {why}; the previous "
          f"steps {self._complete_steps()} are intact and a restart resumes from the "
          f"latest of them") from e

  def _complete_steps(self) -> list[int]:
    return sorted(int(n) for n in os.listdir(self.directory)
                  if n.isdigit() and os.path.exists(os.path.join(self.directory, n, COMMIT_FILE)))

  def _drop_tmp(self, step: int) -> None:
    # The failed save's temporary directory holds the space a retry would need.
    if jax.process_index() != 0:
      return
    for name in os.listdir(self.directory):
      if name.startswith(f"{step}{TMP_MARK}"):
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

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


def _os_error(e: BaseException) -> OSError | None:
  """The first OSError in `e`'s cause/context chain (orbax wraps the writer's error)."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno is not None:
      return e
    if "No space left on device" in str(e):   # tensorstore reports it in a ValueError
      return OSError(errno.ENOSPC, str(e))
    e = e.__cause__ or e.__context__
  return None


def files_stamp(path: str) -> list:
  """Names, sizes and modification times of a checkpoint directory's files (an HF export:
  its .json and .safetensors): what an evaluation journal is keyed on, so that an export
  written again in place (another model under the same path) stamps differently. [] for
  a path that is not a directory."""
  if not path or not os.path.isdir(path):
    return []
  return sorted([e.name, e.stat().st_size, e.stat().st_mtime_ns] for e in os.scandir(path)
                if e.is_file() and e.name.endswith((".json", ".safetensors")))
