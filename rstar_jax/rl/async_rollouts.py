"""Bounded-staleness asynchronous rollouts: step t+1..t+k are generated while step t trains.

`rl.async_rollouts.max_staleness` = k. k = 0 is the synchronous loop (the trainer does not
use this module). With k >= 1 the rollouts of step s are generated with the policy after
exactly

    v(s) = max(s - k, t0)

updates, t0 the step this launch began its pipeline at (0 for a fresh stage). The
schedule is a function of the config and of t0, never of timing: step t's rollouts are
generated with version t - k whether generation is faster or slower than training, so
the same config gives the same bits (with batch-invariant engines), and a trajectory is
at most k versions old by construction. Why not "the freshest weights the engines hold
when a request starts" (AReaL's scheme): that version depends on when a trainer step
ends relative to a request, i.e. on timing, and reproducibility is a requirement here.

Mechanism: one worker thread owns the engines. At the start of step t the trainer
submits the steps t..t+k not yet submitted (in order, drawing their batches from the
data iterator then), each with a copy of its current parameters (version t): the worker
moves the engines onto a version only between two steps' collections, so no trajectory
mixes versions, and the copy survives the train step's buffer donation. The trainer
then waits for step t's rollouts (submitted k steps earlier) and trains on them while
the worker generates step t+k.

Staleness bound: every trajectory's recorded weight versions are mapped back to their
step; a group holding a trajectory outside [t - k, t] (or of an unknown version: a
server that missed a sync) is DROPPED with its group and counted
(`async/stale_dropped_groups`), not regenerated: regenerating would need the engines to
go back to a version they left, and in process the schedule never produces one, so a
drop only ever means a fault (a server out of step), which should show, not be hidden.

Interrupt and resume: a checkpoint at step r is written with the pending rollouts of
steps r..r+k-1 (`pending_path`): the trainer waits for them (they were submitted with
versions < r, which it no longer holds), pickles them next to the checkpoint, and a
resumed trainer takes them back, so a stopped and resumed stage generates step r+k with
version r as the uninterrupted run would: the same schedule, the same bits. A pending
step whose generation failed, or a checkpoint written without them, leaves the rest to
the rule above with t0 = r: those steps are regenerated with version r (fresher than the
uninterrupted run's, so within the bound), deterministically.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import glob
import os
import pickle
import re
import threading
import time
from typing import Any, Callable, Sequence

from absl import logging

from rstar_jax.rollout import agent_loop


WEIGHT_UPDATES = ("between_steps", "between_requests")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AsyncRolloutsConfig:
  """`config.rl.async_rollouts`.

  Attributes:
    max_staleness: k, how many policy updates the rollouts a step trains on may lag
      behind the parameters it updates. 0: the synchronous loop (generate, then train).
      k >= 1: step t's rollouts come from the policy after max(t - k, t0) updates,
      generated in a thread while the steps before t train (docs/guides/async_rollouts.md).
    weight_updates: when the engines take a new version (k >= 1).
      "between_steps": only between two steps' collections, each step generated with
      exactly v(s): a function of the config, reproducible bit for bit.
      "between_requests" (in-flight updates, as PipelineRL): each version as soon as the
      trainer has it, between two generation calls (the pool holds new calls and lets
      those in flight finish; never inside one), so a trajectory's later turns may come
      from newer weights than its first (each turn's version is recorded,
      `Trajectory.turn_versions`). Fresher rollouts, still within the bound (v(s) is then
      the oldest version a step may hold), but which turn gets which version depends on
      timing: not reproducible.
  """
  max_staleness: int = 0
  weight_updates: str = "between_steps"

  def __post_init__(self):
    if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
      raise ValueError("AsyncRolloutsConfig.max_staleness must be an int >= 0, got "
                       f"{self.max_staleness!r}")
    if self.weight_updates not in WEIGHT_UPDATES:
      raise ValueError(f"AsyncRolloutsConfig.weight_updates={self.weight_updates!r}; choose "
                       f"from {WEIGHT_UPDATES}")


def behaviour_version(step: int, max_staleness: int, start: int) -> int:
  """v(s): the update count of the parameters that generate step `step`'s rollouts."""
  return max(step - max_staleness, start)


def staleness_filter(groups: Sequence[Sequence[agent_loop.Trajectory]], step: int,
                     max_staleness: int, version_steps: dict[str, int], scheduled: int
                     ) -> tuple[list[list[agent_loop.Trajectory]], list[int], int]:
  """(groups within the bound, each kept trajectory's staleness, groups dropped).

  A trajectory's staleness is step - (the step of its OLDEST recorded weight version);
  one whose engine reports no version counts as `scheduled` (the version it was
  submitted with). A version not in `version_steps` is unknown: out of bound, as is a
  turn that spanned a weight update ("a -> b": the engines are only ever updated between
  generation calls here, so that means a server out of step)."""
  kept, ages, dropped = [], [], 0
  for g in groups:
    g_ages = []
    for t in g:
      steps = [version_steps.get(v) for v in t.weight_versions] or [scheduled]
      g_ages.append(None if None in steps else step - min(steps))
    if any(a is None or a > max_staleness or a < 0 for a in g_ages):
      dropped += 1
      continue
    kept.append(list(g))
    ages += g_ages
  return kept, ages, dropped


@dataclasses.dataclass
class Pending:
  """One step's rollouts, submitted (or taken back from a checkpoint)."""
  step: int
  version: str               # the weight version name they are generated with
  version_step: int          # its update count
  data_before: dict          # the data iterator's state before this step's batch
  data_after: dict           # and after it
  future: concurrent.futures.Future   # -> (groups, generation seconds)


class RolloutPipeline:
  """A worker thread that generates steps' rollouts in submission order.

  `collect(batch, step)` returns a step's groups (rl.rollout_collector.collect with the step's
  stream); `engines.update_weights(params, version)` moves the engines.
  `in_flight` ("between_requests"): `publish` also moves them while a collection runs,
  through `engines.update_weights_between_requests`, in a thread of its own."""

  def __init__(self, engines, collect: Callable[[Any, int], list], *, in_flight: bool = False):
    self.engines, self._collect = engines, collect
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="async-rollouts")
    self.pending: dict[int, Pending] = {}
    self._engine_version: str | None = None
    self._engine_version_step = -1
    self.in_flight = in_flight
    self._sync = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weight-updates")
                  if in_flight else None)
    self._version_lock = threading.Lock()   # the engines' version: checked and moved at once
    self.published: list[concurrent.futures.Future] = []

  def submit(self, step: int, batch, params, version: str, version_step: int,
             data_before: dict, data_after: dict) -> None:
    if step in self.pending:
      raise ValueError(f"step {step}'s rollouts are already pending")
    fut = self._pool.submit(self._work, batch, step, params, version, version_step)
    self.pending[step] = Pending(step, version, version_step, data_before, data_after, fut)

  def publish(self, params, version: str, version_step: int) -> None:
    """In-flight mode: hands `version` to the engines as soon as the calls in flight
    allow (never going back to an older one); returns at once."""
    if self._sync is None:
      raise ValueError("RolloutPipeline.publish: not built with in_flight=True")
    self.published = [f for f in self.published if not f.done()]
    self.published.append(self._sync.submit(self._move, params, version, version_step, True))

  def _move(self, params, version: str, version_step: int, between_requests: bool) -> None:
    with self._version_lock:
      if self.in_flight and self._engine_version_step >= version_step:
        return              # the engines already hold this version or a newer one
      if self._engine_version == version:
        return
      self._engine_version = None
      if between_requests:
        self.engines.update_weights_between_requests(params, version)
      else:
        self.engines.update_weights(params, version)
      self._engine_version, self._engine_version_step = version, version_step

  def adopt(self, p: Pending) -> None:
    """A pending step taken back from a checkpoint (its future already done)."""
    self.pending[p.step] = p

  def _work(self, batch, step: int, params, version: str, version_step: int):
    # Between two steps' collections: no request of this pipeline is in flight.
    self._move(params, version, version_step, False)
    t0 = time.perf_counter()
    groups = self._collect(batch, step)
    return groups, time.perf_counter() - t0

  def take(self, step: int) -> tuple[Pending, list, float, float]:
    """(the pending entry, its groups, generation seconds, seconds waited for them)."""
    p = self.pending[step]
    t0 = time.perf_counter()
    groups, gen_s = p.future.result()
    for f in self.published:     # an in-flight update that failed fails the step
      if f.done():
        f.result()
    wait_s = time.perf_counter() - t0
    del self.pending[step]
    return p, groups, gen_s, wait_s

  def finished_prefix(self) -> list[tuple[Pending, list, float]]:
    """The pending steps, oldest first, waiting for each, up to the first that failed."""
    out = []
    for s in sorted(self.pending):
      p = self.pending[s]
      try:
        groups, gen_s = p.future.result()
      except Exception as e:     # noqa: BLE001 - the rest is regenerated (module docstring)
        logging.warning("step %d's pending rollouts failed (%s); not saved", s, e)
        break
      out.append((p, groups, gen_s))
    return out

  def cancel(self) -> dict | None:
    """Drops every pending step (the running one finishes first); returns the data
    state before the oldest of them (None if none was pending)."""
    for p in self.pending.values():
      p.future.cancel()
    oldest = min(self.pending) if self.pending else None
    before = self.pending[oldest].data_before if oldest is not None else None
    concurrent.futures.wait([p.future for p in self.pending.values()] + self.published)
    self.pending.clear()
    self.published = []
    self._engine_version, self._engine_version_step = None, -1
    return before

  def close(self) -> None:
    self.cancel()
    self._pool.shutdown(wait=True)
    if self._sync is not None:
      self._sync.shutdown(wait=True)


# ---- pending rollouts next to a checkpoint -------------------------------------------

def pending_path(directory: str, step: int) -> str:
  return os.path.join(directory, f"pending_step{step}.pkl")


def save_pending(directory: str, step: int, entries: Sequence[tuple[Pending, list, float]],
                 version_steps: dict[str, int]) -> str:
  """Writes step `step`'s pending rollouts (atomically) and removes other steps' files:
  the trainer's own file, read back only by `load_pending` (pickle: trajectories as
  they are, log-probs included, which the behaviour ratio needs)."""
  os.makedirs(directory, exist_ok=True)
  path = pending_path(directory, step)
  records = [dict(step=p.step, version=p.version, version_step=p.version_step,
                  data_before=p.data_before, data_after=p.data_after, groups=groups,
                  gen_s=gen_s) for p, groups, gen_s in entries]
  with open(path + ".tmp", "wb") as f:
    pickle.dump({"step": step, "entries": records, "version_steps": dict(version_steps)}, f)
  os.replace(path + ".tmp", path)
  return path


def drop_other_pending(directory: str, keep_step: int) -> None:
  for f in glob.glob(os.path.join(directory, "pending_step*.pkl")):
    m = re.search(r"pending_step(\d+)\.pkl$", f)
    if m and int(m.group(1)) != keep_step:
      os.remove(f)


def load_pending(directory: str, step: int, max_staleness: int
                 ) -> tuple[list[Pending], dict[str, int]]:
  """The pending steps saved with checkpoint `step` that still fit the bound (a
  contiguous run from `step`), and the version names they carry."""
  path = pending_path(directory, step)
  try:
    with open(path, "rb") as f:
      saved = pickle.load(f)
  except FileNotFoundError:
    return [], {}
  out = []
  for i, r in enumerate(saved["entries"]):
    if r["step"] != step + i or not 0 <= r["step"] - r["version_step"] <= max_staleness:
      break
    fut = concurrent.futures.Future()
    fut.set_result((r["groups"], r["gen_s"]))
    out.append(Pending(r["step"], r["version"], r["version_step"], r["data_before"],
                       r["data_after"], fut))
  return out, dict(saved["version_steps"])


# ---- what the schedule costs: a timing model ---------------------------------------------

def schedule_times(gen_s: Sequence[float], train_s: Sequence[float], max_staleness: int
                   ) -> dict[str, float]:
  """Wall time of a stage under this module's schedule, from each step's generation
  seconds (weight sync included: the worker publishes before it generates) and update
  seconds. The worker generates steps in order, step s as soon as it is free and version
  v(s) = max(s - k, 0) exists (version v exists when update v - 1 ends); the trainer
  updates step t once its rollouts and update t - 1 are done. k = 0 is the synchronous
  loop. Returns the total, the seconds a step, and the share of the total each side idles.
  """
  if len(gen_s) != len(train_s) or not len(gen_s):
    raise ValueError("gen_s and train_s: one entry per step, at least one")
  gen_end, train_end = [], []
  worker_free = 0.0
  for s in range(len(gen_s)):
    v = behaviour_version(s, max_staleness, 0)
    start = max(worker_free, train_end[v - 1] if v > 0 else 0.0)
    gen_end.append(start + gen_s[s])
    worker_free = gen_end[-1]
    train_end.append(max(gen_end[s], train_end[s - 1] if s else 0.0) + train_s[s])
  total = train_end[-1]
  return {"total_s": total, "step_s": total / len(gen_s),
          "trainer_idle_share": 1.0 - sum(train_s) / total,
          "worker_idle_share": 1.0 - sum(gen_s) / total}
