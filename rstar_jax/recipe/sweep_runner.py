"""Running a sweep's points: one child process each, up to `workers` at once.

SIGINT / SIGTERM to the sweep reach every running point once (`Stop`): they save and
stop, and a rerun resumes them. A point that exits 0 gets its done marker, with the
command that finished it (sweep_points.finished).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from rstar_jax.recipe import sweep_points


# Exit statuses of a child stopped by Ctrl-C or SIGTERM (a preemption): the recipe's
# 128 + signal after it saved, or killed by the signal itself.
_INTERRUPTED = tuple(x for s in (signal.SIGINT, signal.SIGTERM) for x in (128 + s, -s))
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _signal_name(signum: int) -> str:
  try:
    return signal.Signals(signum).name
  except ValueError:
    return f"signal {signum}"


class Stop:
  """SIGINT / SIGTERM to the sweep, passed on to the points it runs.

  Each point runs in its own process group: a Ctrl-C at the terminal reaches the sweep
  alone (the terminal signals its foreground group), and the sweep sends each running
  point's group the signal it got, exactly once per signal received. A point thus gets
  one SIGINT for one Ctrl-C (a second one would make the recipe abort without saving),
  and a SIGTERM from a scheduler, which reaches only the sweep's PID, reaches the points
  too. No point starts after a signal. A point is started with PR_SET_PDEATHSIG =
  SIGTERM on Linux: a sweep killed outright (SIGKILL, an OOM kill) still stops its
  points the way a scheduler would, checkpoint included, instead of orphaning them.

  As a context manager (in the main thread), it installs the handlers explicitly:
  a background job of a non-interactive shell starts with SIGINT ignored, and
  Python then leaves it ignored. Handlers run in the main thread, so the lock below
  is never held by the thread a handler interrupts.
  """

  def __init__(self, log: Callable[[str], None] = print):
    self.signum: int | None = None    # the first signal received
    self.received = 0
    self._log = log
    self._lock = threading.Lock()
    self._running: dict[str, subprocess.Popen] = {}
    self._old: dict[int, Any] = {}

  @property
  def requested(self) -> bool:
    return self.signum is not None

  @property
  def name(self) -> str:
    return _signal_name(self.signum) if self.signum is not None else ""

  def __enter__(self) -> "Stop":
    if threading.current_thread() is threading.main_thread():
      self._old = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
    return self

  def __exit__(self, *exc) -> None:
    for s, old in self._old.items():
      signal.signal(s, old)
    self._old = {}

  def _handle(self, signum, frame) -> None:
    del frame
    self.request(signum)

  def request(self, signum: int) -> None:
    """Stops the sweep on `signum`: no point starts; the running ones get `signum`."""
    with self._lock:
      first = self.signum is None
      if first:
        self.signum = signum
      self.received += 1
      running = dict(self._running)
      for proc in running.values():
        _signal_group(proc, signum)
    name = _signal_name(signum)
    if not running:
      self._log(f"[sweep] {name} received: no point is running; none is started")
    elif first:
      self._log(f"[sweep] {name} received: sent to the {len(running)} running point(s) "
                f"({', '.join(running)}), which save and stop; none is started. Waiting "
                "for them (a rerun resumes them)")
    else:
      self._log(f"[sweep] {name} received again: sent to the {len(running)} running "
                "point(s) again (a second SIGINT makes a recipe stop at once, without "
                "saving the step in flight); waiting for them")

  def start(self, name: str, argv: Sequence[str], **kwargs) -> subprocess.Popen | None:
    """The point's process, started in its own process group and registered (None when
    the sweep is stopping): under the lock, so a signal reaches it exactly once."""
    with self._lock:
      if self.signum is not None:
        return None
      proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL,
                              preexec_fn=_point_preexec(os.getpid()), **kwargs)
      self._running[name] = proc
      return proc

  def finished(self, name: str) -> None:
    with self._lock:
      self._running.pop(name, None)


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
  with contextlib.suppress(ProcessLookupError, PermissionError):
    if proc.poll() is None:
      os.killpg(proc.pid, signum)


def _point_preexec(parent: int) -> Callable[[], None]:
  """What a point's process does between fork and exec: its own process group, SIGINT
  and SIGTERM at their defaults (a sweep started in the background passes SIGINT on
  ignored, and a point would then miss the Ctrl-C the sweep forwards before its own
  handlers are installed), and SIGTERM when the sweep dies (Linux). The kernel sends
  that signal when the *thread* that forked the point ends: the worker thread that
  starts a point waits for it (`_run_one`), so it outlives the point unless the sweep
  dies."""
  prctl = None
  if sys.platform.startswith("linux"):
    import ctypes
    with contextlib.suppress(OSError, AttributeError):
      prctl = ctypes.CDLL(None, use_errno=True).prctl
  pr_set_pdeathsig = 1

  def preexec() -> None:
    os.setpgid(0, 0)
    for s in STOP_SIGNALS:
      signal.signal(s, signal.SIG_DFL)
    if prctl is not None:
      prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
      if os.getppid() != parent:   # the sweep died before prctl: stop now
        os.kill(os.getpid(), signal.SIGTERM)
  return preexec


def _run_one(point: sweep_points.Point, argv: Sequence[str], env: Mapping[str, str] | None,
             cwd: str | None, stop: Stop) -> sweep_points.Outcome:
  os.makedirs(point.workdir, exist_ok=True)
  t0 = time.time()
  with open(point.log, "a") as log:
    log.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(argv)}\n")
    log.flush()
    try:
      proc = stop.start(point.name, argv, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                        env=None if env is None else dict(env))
    except OSError as e:
      log.write(f"# could not start: {e}\n")
      return sweep_points.Outcome(point, "failed", None, time.time() - t0, f"could not start: {e}")
    if proc is None:
      return sweep_points.Outcome(point, "not started", None, 0.0,
                     f"not started ({stop.name} received before it)")
    try:
      rc = proc.wait()
    finally:
      stop.finished(point.name)
  seconds = time.time() - t0
  if rc != 0:
    if rc in _INTERRUPTED:
      sig = _signal_name(rc - 128 if rc > 0 else -rc)
      how = (f"saved and exited with status {rc}" if rc > 0 else
             f"killed by {sig} before it could save")
      return sweep_points.Outcome(point, "interrupted", rc, seconds, f"stopped by {sig} ({how})")
    return sweep_points.Outcome(point, "failed", rc, seconds, f"exit status {rc}")
  sweep_points.write_atomic(os.path.join(point.workdir, sweep_points.DONE_MARKER),
                            json.dumps({"command": list(argv), "overrides": point.overrides,
                                        "returncode": rc, "seconds": round(seconds, 1)},
                                       indent=2, default=str))
  return sweep_points.Outcome(point, "done", rc, seconds)


def run_points(points: Sequence[sweep_points.Point],
               argv_of: Callable[[sweep_points.Point], Sequence[str]], *,
               workers: int = 1, env: Mapping[str, str] | None = None, cwd: str | None = None,
               log: Callable[[str], None] = print, stop: Stop | None = None
               ) -> list[sweep_points.Outcome]:
  """Runs the unfinished points, up to `workers` at once; a failed point is reported
  with its log and the others go on. Outcomes are in the order of `points`.

  SIGINT / SIGTERM (see `Stop`; pass one to read which signal stopped the sweep) are
  passed on to the running points, which save and stop (status "interrupted": a rerun
  resumes them); the points not started yet are "not started"; this returns when every
  running point has exited."""
  if workers < 1:
    raise sweep_points.SweepError(f"--workers must be >= 1, got {workers}")
  outcomes: dict[str, sweep_points.Outcome] = {}
  todo = []
  for p in points:
    marker = sweep_points.finished(p)
    changed = marker and sweep_points.changed_command(p, argv_of(p))
    if marker and not changed:
      outcomes[p.name] = sweep_points.Outcome(p, "skipped", detail=marker)
      log(f"[sweep] {p.name}: finished before ({marker}), skipped")
    else:
      if changed:
        log(f"[sweep] {p.name}: finished before with another command ({changed}); running "
            "it again with this one (a recipe resumes what is left, or refuses a changed config)")
      todo.append(p)
  lock = threading.Lock()
  count = [0]
  own = stop is None
  stop = Stop(log) if own else stop

  def one(p: sweep_points.Point) -> sweep_points.Outcome:
    if stop.requested:
      return sweep_points.Outcome(p, "not started", None, 0.0,
                                  f"not started ({stop.name} received before it)")
    with lock:
      log(f"[sweep] start {p.name} (log: {p.log})")
    out = _run_one(p, argv_of(p), env, cwd, stop)
    with lock:
      if out.status == "not started":
        return out
      count[0] += 1
      head = f"[sweep] {count[0]}/{len(todo)}"
      if out.status == "interrupted":
        log(f"{head} interrupted {p.name} after {out.seconds:.0f} s: {out.detail}; a rerun "
            f"resumes it; log: {p.log}")
      elif out.status == "failed":
        log(f"{head} FAILED {p.name}: {out.detail} after {out.seconds:.0f} s; log: {p.log}")
      else:
        log(f"{head} done {p.name} in {out.seconds:.0f} s")
    return out

  if todo:
    with stop if own else contextlib.nullcontext():
      with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        for out in pool.map(one, todo):
          outcomes[out.point.name] = out
  return [outcomes[p.name] for p in points]
