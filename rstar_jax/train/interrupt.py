"""Ctrl-C / SIGTERM during training: finish the step, save, stop; resume exactly.

A signal that arrives in the middle of a step would otherwise leave the state
half-updated (the jitted step donates its input buffers) or the data iterator one
batch ahead of the saved parameters. Inside `StopRequests`, the first SIGINT or
SIGTERM only sets `requested`; the training loop checks it between steps, writes a
checkpoint of the finished step with its data position and raises `Interrupted`.
A second SIGINT aborts at once (`Aborted`, a KeyboardInterrupt), for a step that would
take too long; then nothing of the unfinished step is saved. Inside `uninterrupted()`
(a checkpoint being written) the abort waits until the write is done: orbax's save
threads would otherwise die half-way with pages of tracebacks, next to a checkpoint
that may not be whole. The entry points (`config_utils.run`) end an abort with one line.

`StopRequests` nest: an inner one (a trainer's loop) shares the outer one's (the
recipe's stage loop) request, so a signal that lands after a trainer's last step is
not lost: the recipe finishes the stage in flight and stops before the next one.
"""
from __future__ import annotations

import contextlib
import signal
import threading

from absl import logging


class Interrupted(Exception):
  """Training stopped on a signal after saving its last finished step."""

  def __init__(self, signum: int, step: int | None = None, *, after: str | None = None,
               saved: str = "checkpoint saved"):
    self.signum, self.step = signum, step
    where = after if after is not None else f"step {step}"
    super().__init__(f"stopped by {signal.Signals(signum).name} after {where} "
                     f"({saved}; run the same command again to resume)")


class Aborted(KeyboardInterrupt):
  """A second SIGINT: stop now, without saving the step in flight."""

  def __init__(self, signum: int = signal.SIGINT, first: int | None = None):
    self.signum = signum
    name = signal.Signals(signum).name
    how = (f"a second {name}" if first in (None, signum) else
           f"{name} after {signal.Signals(first).name}")
    super().__init__(f"aborted by {how}: the step in flight is not saved; run the same "
                     "command again to resume from the last checkpoint")


# Depth of `uninterrupted()` blocks, and an abort that arrived inside one.
_critical = 0
_pending: Aborted | None = None


@contextlib.contextmanager
def uninterrupted():
  """A block that a second SIGINT does not cut (a checkpoint write): the abort is
  raised when the block ends. Outside `StopRequests` (whose handler knows of this
  block), Python's own SIGINT handler is replaced for the block, in the main thread."""
  global _critical, _pending
  own = None
  if (threading.current_thread() is threading.main_thread()
      and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
    own = signal.signal(signal.SIGINT, _hold_abort)
  _critical += 1
  try:
    yield
  finally:
    _critical -= 1
    if own is not None:
      signal.signal(signal.SIGINT, own)
    if _critical == 0 and _pending is not None:
      pending, _pending = _pending, None
      raise pending


def _abort(signum: int, first: int | None = None) -> None:
  global _pending
  if _critical:
    if _pending is None:
      logging.warning("%s%s received: aborting once the checkpoint being written is "
                      "complete", "second " if first in (None, signum) else "",
                      signal.Signals(signum).name)
    _pending = Aborted(signum, first)
    return
  raise Aborted(signum, first)


def _hold_abort(signum, frame) -> None:
  del frame
  _abort(signum)


def stop_signal() -> int | None:
  """The signal of the stop requested of the active `StopRequests` (None: none asked, or
  no `StopRequests` active). Read by loops that stop at a boundary of their own rather
  than a step's: a journaled rollout collection (`rl.rollout_collector.collect`) stops at the
  next finished trajectory."""
  active = StopRequests._active
  return None if active is None else active.signum


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
    del frame
    root = self._root
    name = signal.Signals(signum).name
    if root._signum is not None:
      if signum == signal.SIGINT:
        _abort(signum, root._signum)   # abort now (after a checkpoint write in flight)
      else:
        logging.warning("%s received: already stopping at the next step boundary (a "
                        "SIGINT aborts at once, without saving the step in flight)", name)
      return
    root._signum = signum
    logging.warning("%s received: stopping at the next step boundary, after saving it (a "
                    "%sSIGINT aborts at once, without saving the step in flight)", name,
                    "second " if signum == signal.SIGINT else "")

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
