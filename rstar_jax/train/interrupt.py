"""Ctrl-C / SIGTERM during training: finish the step, save, stop; resume exactly.

A signal that arrives in the middle of a step would otherwise leave the state
half-updated (the jitted step donates its input buffers) or the data iterator one
batch ahead of the saved parameters. Inside `StopRequests`, the first SIGINT or
SIGTERM only sets `requested`; the training loop checks it between steps, writes a
checkpoint of the finished step with its data position and raises `Interrupted`.
A second SIGINT aborts at once (KeyboardInterrupt), for a step that would take too
long; then nothing of the unfinished step is saved.

`StopRequests` nest: an inner one (a trainer's loop) shares the outer one's (the
recipe's stage loop) request, so a signal that lands after a trainer's last step is
not lost: the recipe finishes the stage in flight and stops before the next one.
"""
from __future__ import annotations

import signal
import threading

from absl import logging


class Interrupted(Exception):
  """Training stopped on a signal after saving its last finished step."""

  def __init__(self, signum: int, step: int | None = None, *, after: str | None = None):
    self.signum, self.step = signum, step
    where = after if after is not None else f"step {step}"
    super().__init__(f"stopped by {signal.Signals(signum).name} after {where} "
                     "(checkpoint saved; run the same command again to resume)")


class StopRequests:
  """Context manager: defers SIGINT / SIGTERM / SIGUSR2 to the next step boundary."""

  # SIGUSR2 too: under SLURM a batch script reaches its step's tasks through srun, which
  # turns a SIGTERM into SIGKILL but passes SIGUSR2 on (experiments/slurm/*.sbatch).
  SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)
  _active: "StopRequests | None" = None   # the innermost entered one

  def __init__(self):
    self._signum: int | None = None
    self._old = {}
    self._root: StopRequests = self
    self._outer: StopRequests | None = None

  @property
  def signum(self) -> int | None:
    return self._root._signum

  @property
  def requested(self) -> bool:
    return self.signum is not None

  def _handle(self, signum, frame):
    if self._signum is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt   # second Ctrl-C: abort now
    self._signum = signum
    logging.warning("%s received: stopping at the next step boundary (Ctrl-C again to "
                    "abort now)", signal.Signals(signum).name)

  def __enter__(self) -> "StopRequests":
    self._outer = StopRequests._active
    if self._outer is not None:
      self._root = self._outer._root
    elif threading.current_thread() is threading.main_thread():
      self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
    StopRequests._active = self
    return self

  def __exit__(self, *exc) -> None:
    StopRequests._active = self._outer
    for s, old in self._old.items():
      signal.signal(s, old)
    self._old = {}
