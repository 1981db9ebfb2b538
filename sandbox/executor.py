"""The supervisor: runs calls on the warm parent, enforces deadlines and output caps.

One `Executor` per server process. It starts `sandbox.worker` (inside bubblewrap
where possible), then for each call creates the call's pipes, hands them to the
warm parent over a control socket, reads stdout/stderr as they come, and turns
what happened into a `Result`:

  * the wall deadline is a timer here, started when a child takes the call (the
    worker's "started" event: a call that waited for a fork or a slot did not run
    meanwhile); at expiry the worker kills the child's process group and sweeps the
    call's uid, so nothing it started survives;
  * stdout/stderr are capped; past the cap the call is killed (output_exceeded);
  * an admission semaphore keeps at most `max_children` calls running; the rest
    queue here (they cost nothing until they start).
"""
from __future__ import annotations

import asyncio
import codecs
import collections
import itertools
import json
import logging
import os
import random
import signal
import socket
import time
from typing import Any

from sandbox import cgroups, isolation
from sandbox.config import ExecutorConfig
from sandbox.schema import Call, Result
from sandbox.stats import Stats

log = logging.getLogger("sandbox")

_GRACE_S = 1.0  # after a call ended, how long stray holders of its pipes may keep them
_MAX_RECORD = 1 << 20


def _memfd(name: str, data: bytes) -> int:
  fd = os.memfd_create(name, os.MFD_CLOEXEC)
  view = memoryview(data)
  while view:
    view = view[os.write(fd, view):]
  os.lseek(fd, 0, os.SEEK_SET)
  return fd


class _Job:
  __slots__ = ("id", "timeout", "fut", "bufs", "fds", "record", "exit", "timed_out", "exceeded",
               "kill_sent", "kill_id", "t0", "wall", "handles", "grace", "session", "finished",
               "started", "not_started", "start_late", "start_handle")

  def __init__(self, job_id: int, timeout: float, fut: asyncio.Future):
    self.id = job_id
    self.timeout = timeout
    self.fut = fut
    self.bufs = {"out": bytearray(), "err": bytearray(), "res": bytearray()}
    self.fds: dict[int, str] = {}
    self.record: dict | None = None
    self.exit: dict | None = None
    self.timed_out = False
    self.exceeded: str | None = None
    self.kill_sent = False
    self.kill_id = job_id
    self.t0 = 0.0
    self.wall = 0.0
    self.handles: list[asyncio.TimerHandle] = []
    self.grace = False
    self.session: _Session | None = None
    self.finished = False
    self.started = False       # a child took it (one-shot calls; sessions run at once)
    self.not_started = False   # no child took it within start_timeout
    self.start_late = False    # a child took it as that limit's kill was sent
    self.start_handle: asyncio.TimerHandle | None = None


class _Session:
  __slots__ = ("sid", "sock", "holder_id", "lock", "last_used", "alive", "calls", "job")

  def __init__(self, sid: str, sock: socket.socket, holder_id: int):
    self.sid, self.sock, self.holder_id = sid, sock, holder_id
    self.lock = asyncio.Lock()
    self.last_used = time.monotonic()
    self.alive = True
    self.calls = 0
    self.job: _Job | None = None


class Executor:
  """Runs `Call`s; `await start()` first, `await close()` at the end."""

  def __init__(self, config: ExecutorConfig | None = None):
    self.config = config or ExecutorConfig()
    self.stats = Stats()
    self.isolation = ""
    self._backend: isolation.Backend | None = None
    self._ids = itertools.count(1)
    self._jobs: dict[int, _Job] = {}
    self._sessions: collections.OrderedDict[str, _Session] = collections.OrderedDict()
    self._holders: dict[int, _Session] = {}
    self._admission: asyncio.Semaphore | None = None
    self._queued = 0
    self._running = 0
    self._ctrl: socket.socket | None = None
    self._proc: asyncio.subprocess.Process | None = None
    self._ready: asyncio.Event | None = None
    self._ready_info: dict = {}
    self._closing = False
    self._restarts = 0
    self._tasks: list[asyncio.Task] = []
    self._uid_base = 0
    self._started = False
    self._cgroup: cgroups.MemoryCgroups | None = None
    self.memory_mode = ""
    self.memory_budget = 0
    self.max_running = self.config.max_children

  # -- life cycle -------------------------------------------------------------
  async def start(self) -> None:
    cfg = self.config
    self._ready = asyncio.Event()
    self._backend = isolation.choose(cfg.isolation, cfg.allow_weak_isolation)
    self._setup_memory()
    self._admission = asyncio.Semaphore(self.max_running)
    if os.geteuid() == 0:
      try:  # the kernel's OOM killer takes calls (+1000), never the server or warm parent
        with open("/proc/self/oom_score_adj", "w") as f:
          f.write("-1000")
      except OSError as e:
        log.info("could not lower the server's oom_score_adj (%s); calls still run at +1000", e)
      # Above the children (and other busy users of the host), so that deadlines hold;
      # the worker started below inherits it.
      try:
        os.setpriority(os.PRIO_PROCESS, 0, cfg.supervisor_nice)
      except OSError as e:
        log.warning("could not set the supervisor's niceness to %d: %s", cfg.supervisor_nice, e)
    # A random uid range per server: two servers on one host never share a uid,
    # so neither RLIMIT_NPROC nor a uid sweep of one can touch the other.
    self._uid_base = random.SystemRandom().randrange(1 << 20, 1 << 30) & ~0xFFF
    await self._spawn()
    self._started = True
    self._tasks.append(asyncio.ensure_future(self._reap_sessions()))

  @property
  def n_slots(self) -> int:
    cfg = self.config
    return cfg.max_children + cfg.pool_size + cfg.max_sessions + 4

  def _setup_memory(self) -> None:
    """Admission control on the memory budget, enforced per call by cgroups where possible.

    At most budget // per_call_mb calls run at once, so the calls' limits together fit
    the budget. Overcommitting and leaving the rest to the kernel does not work: with
    32 calls at a shared cgroup limit the kernel reclaims in every one of them for
    tens of seconds (measured: all 32 in direct reclaim, no OOM kill, 30 s deadlines
    missed) instead of killing one.
    """
    cfg = self.config
    host = cgroups.host_memory_bytes()
    budget = (cfg.memory_budget_mb << 20) if cfg.memory_budget_mb else int(host * 0.75)
    self.memory_budget = budget
    per_call = cfg.per_call_mb << 20
    self.max_running = max(1, min(cfg.max_children, budget // per_call))
    self._cgroup = None
    why = "disabled (--cgroups off)"
    if cfg.cgroups == "auto":
      stale = cgroups.MemoryCgroups.sweep_stale()
      if stale:
        log.info("removed %d cgroup tree(s) left by sandbox servers that are gone", stale)
      self._cgroup, why = cgroups.MemoryCgroups.create(budget, per_call, self.n_slots)
    if self._cgroup is not None:
      self.memory_mode = f"cgroup v{self._cgroup.version}"
      log.info("memory: cgroup v%d at %s: each call's processes and files <= %d MB", self._cgroup.version,
               self._cgroup.top, cfg.per_call_mb)
    else:
      self.memory_mode = "rlimits"
      log.warning("memory: no cgroups (%s): a call is limited per process (RLIMIT_AS) and by "
                  "its /tmp quota only; one that forks many large processes can exceed its share",
                  why)
    log.info("memory budget %d MB / %d MB per call (memory_mb + tmp_mb + shm_mb): at most %d "
             "calls run at once%s", budget >> 20, cfg.per_call_mb, self.max_running,
             "" if self.max_running == cfg.max_children else
             f" (below --max-children {cfg.max_children}; raise --memory-budget-mb or lower "
             "--memory-mb for more)")

  def _preexec(self) -> None:
    """In the worker's process before exec: its memory cgroup."""
    if self._cgroup is not None:
      with open(self._cgroup.worker_procs(), "w") as f:
        f.write("0")

  async def _spawn(self) -> None:
    cfg = self.config
    loop = asyncio.get_running_loop()
    self._ready.clear()
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    work_root = self._backend.setup()
    worker_cfg = {
        "ctrl_fd": theirs.fileno(), "uid_base": self._uid_base,
        "n_slots": self.n_slots, "private_tmp": True, "tmp_mb": cfg.tmp_mb, "shm_mb": cfg.shm_mb,
        "private_net": self._backend.name != "bwrap",
        "cgroup": None if self._cgroup is None else {"top": self._cgroup.top,
                                                     "version": self._cgroup.version},
        "pool_size": cfg.pool_size, "work_root": work_root, "nice": cfg.nice,
        "memory_mb": cfg.memory_mb, "max_file_mb": cfg.max_file_mb,
        "max_open_files": cfg.max_open_files, "max_processes": cfg.max_processes,
        "preload": list(cfg.preload),
    }
    binds = [] if self._cgroup is None else [self._cgroup.top]
    argv, env, cwd = self._backend.command([json.dumps(worker_cfg)], cfg.tmpfs_mb, binds)
    self._proc = await asyncio.create_subprocess_exec(
        *argv, env=env, cwd=cwd, pass_fds=(theirs.fileno(),), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL, start_new_session=True, preexec_fn=self._preexec)
    theirs.close()
    mine.setblocking(False)
    self._ctrl = mine
    loop.add_reader(mine.fileno(), self._on_ctrl)
    self._tasks.append(asyncio.ensure_future(self._watch(self._proc, mine)))
    try:
      await asyncio.wait_for(self._ready.wait(), cfg.start_timeout)
    except asyncio.TimeoutError:
      self._proc.kill()  # its watcher restarts it (after a first successful start)
      raise RuntimeError(f"sandbox worker not ready after {cfg.start_timeout} s") from None
    if not self._ready.is_set() or self._proc.returncode is not None:
      raise RuntimeError(f"sandbox worker exited during start-up (rc={self._proc.returncode}); "
                         "see its stderr above")

  async def _watch(self, proc: asyncio.subprocess.Process, ctrl: socket.socket) -> None:
    rc = await proc.wait()
    if self._ctrl is ctrl:
      self._drop_ctrl()
    self._ready.set()  # wakes a start() that waits on a dead worker
    if self._closing or not self._started:
      return
    log.error("sandbox worker exited (rc=%s); failing its calls and restarting", rc)
    self._fail_all("the sandbox worker process died")
    self._restarts += 1
    await asyncio.sleep(min(5.0, 0.2 * self._restarts))
    if not self._closing:
      try:
        await self._spawn()
      except Exception:  # noqa: BLE001: keep serving errors; the dead worker's watcher retries
        log.exception("sandbox worker restart failed")

  def _drop_ctrl(self) -> None:
    if self._ctrl is not None:
      asyncio.get_running_loop().remove_reader(self._ctrl.fileno())
      self._ctrl.close()
      self._ctrl = None

  def _fail_all(self, why: str) -> None:
    for job in list(self._jobs.values()):
      if job.exit is None:
        job.exit = {"internal": why}
      self._finish(job)
    for sess in list(self._sessions.values()):
      self._drop_session(sess)

  async def close(self) -> None:
    self._closing = True
    for t in self._tasks:
      t.cancel()
    self._fail_all("the sandbox is shutting down")
    self._drop_ctrl()  # EOF tells the worker to kill its children and exit
    if self._proc is not None and self._proc.returncode is None:
      try:
        await asyncio.wait_for(self._proc.wait(), 5)
      except asyncio.TimeoutError:
        self._proc.kill()
        await self._proc.wait()
    if self._backend is not None:
      self._backend.cleanup()
    if self._cgroup is not None:
      self._cgroup.remove()

  @property
  def healthy(self) -> bool:
    return (self._ready is not None and self._ready.is_set() and self._ctrl is not None
            and self._proc is not None and self._proc.returncode is None)

  def snapshot(self) -> dict:
    s = self.stats.snapshot()
    s.update(isolation=self.isolation, healthy=self.healthy, queue_depth=self._queued,
             running=self._running, max_children=self.config.max_children,
             sessions=len(self._sessions), worker_restarts=self._restarts,
             memory=self.memory_mode, memory_budget_mb=self.memory_budget >> 20,
             max_running=self.max_running,
             worker_preload_s=self._ready_info.get("preload_s"))
    return s

  # -- control socket ---------------------------------------------------------
  def _on_ctrl(self) -> None:
    ctrl = self._ctrl
    while ctrl is not None:
      try:
        msg = ctrl.recv(1 << 16)
      except BlockingIOError:
        return
      except OSError:
        msg = b""
      if not msg:
        self._drop_ctrl()
        return
      ev = json.loads(msg)
      kind = ev.get("ev")
      if kind == "ready":
        self._ready_info = ev
        self.isolation = self._backend.level(bool(ev["drop_uid"]))
        if not ev.get("private_tmp"):
          log.warning("calls share the worker's /tmp (no private /tmp and /dev/shm per call: "
                      "that needs root); each gets a fresh directory as TMPDIR")
        if self._backend.name != "bwrap" and not ev.get("private_net"):
          log.warning("calls can reach the network (no network namespace without root)")
        if ev.get("preload_failed"):
          log.warning("sandbox preload failures: %s", ev["preload_failed"])
        log.info("sandbox worker ready: isolation=%s preload=%.2fs", self.isolation,
                 ev.get("preload_s", 0))
        self._ready.set()
      elif kind == "started":
        self._on_started(ev)
      elif kind in ("exit", "killed"):
        self._on_exit(ev)

  def _on_started(self, ev: dict) -> None:
    job = self._jobs.get(ev["id"])
    if job is None or job.started or job.finished:
      return
    job.started = True
    if job.not_started:
      # The start limit's kill crossed this event: it ran, briefly. Said so, not "did
      # not run".
      job.not_started, job.start_late = False, True
      return
    job.t0 = time.monotonic()   # wall time counts from here, as the deadline does
    # Only the start limit goes: a grace timer may be set already (the call's record and
    # pipes can be read before this datagram).
    if job.start_handle is not None:
      job.start_handle.cancel()
    job.handles.append(asyncio.get_running_loop().call_later(job.timeout, self._on_deadline,
                                                             job))

  def _on_no_start(self, job: _Job) -> None:
    if not job.finished and not job.started:
      job.not_started = True
      self._kill(job)   # the worker drops it from its queue: it never runs

  def _on_exit(self, ev: dict) -> None:
    sess = self._holders.pop(ev["id"], None)
    if sess is not None:
      job = sess.job
      self._drop_session(sess)
    else:
      job = self._jobs.get(ev["id"])
    if job is not None and job.exit is None:
      job.exit = ev
      if ev["ev"] == "killed":
        self._finish(job)  # SIGKILL is sent and final; what the pipes hold is drained
      else:
        self._maybe_finish(job)

  async def _send(self, sock: socket.socket, msg: dict, fds: list[int]) -> None:
    data = json.dumps(msg).encode()
    loop = asyncio.get_running_loop()
    while True:
      try:
        socket.send_fds(sock, [data], fds)
        return
      except BlockingIOError:
        fut = loop.create_future()
        loop.add_writer(sock.fileno(), lambda: fut.done() or fut.set_result(None))
        try:
          await fut
        finally:
          loop.remove_writer(sock.fileno())

  def _send_nowait(self, msg: dict) -> None:
    if self._ctrl is None:
      return
    try:
      self._ctrl.send(json.dumps(msg).encode())
    except OSError as e:
      log.warning("could not send %s to the worker: %s", msg, e)

  # -- calls ------------------------------------------------------------------
  def validate(self, call: Call) -> float:
    """Checks size limits; returns the effective timeout. Raises ValueError."""
    cfg = self.config
    if len(call.code.encode("utf-8", "surrogatepass")) > cfg.max_code_bytes:
      raise ValueError(f"code is larger than max_code_bytes={cfg.max_code_bytes}")
    if len(call.input.encode("utf-8", "surrogatepass")) > cfg.max_input_bytes:
      raise ValueError(f"input is larger than max_input_bytes={cfg.max_input_bytes}")
    timeout = cfg.default_timeout if call.timeout is None else float(call.timeout)
    if timeout > cfg.max_timeout:
      raise ValueError(f"timeout {timeout} exceeds the server's max_timeout={cfg.max_timeout}")
    return timeout

  async def run(self, call: Call) -> Result:
    """Runs one call; never raises for anything the code does (see Result.status)."""
    timeout = self.validate(call)
    if call.session_id is not None:
      result = await self._run_in_session(call, timeout)
    else:
      result = await self._admitted(call, timeout, None)
    self.stats.record(result)
    return result

  async def _admitted(self, call: Call, timeout: float, sess: _Session | None) -> Result:
    self._queued += 1
    try:
      await self._admission.acquire()
    finally:
      self._queued -= 1
    self._running += 1
    try:
      return await self._execute(call, timeout, sess)
    finally:
      self._running -= 1
      self._admission.release()

  async def _run_in_session(self, call: Call, timeout: float) -> Result:
    sess = self._sessions.get(call.session_id)
    new = sess is None or not sess.alive
    if new:
      sess = await self._open_session(call.session_id)
      if sess is None:
        return Result.internal_error("the sandbox worker is not running", isolation=self.isolation,
                                     session_id=call.session_id, session_new=True)
    async with sess.lock:
      if not sess.alive:  # died while this call waited for the lock
        return await self._run_in_session(call, timeout)
      sess.last_used = time.monotonic()
      self._sessions.move_to_end(sess.sid)
      result = await self._admitted(call, timeout, sess)
      sess.calls += 1
      sess.last_used = time.monotonic()
    # A burst of new sessions while every open one was busy went past the cap; each
    # holds a worker slot, so it comes back down as soon as sessions are idle.
    self._trim_sessions(self.config.max_sessions)
    result.session_id = call.session_id
    result.session_new = new
    return result

  def _trim_sessions(self, keep: int) -> None:
    """Closes the least recently used idle sessions until at most `keep` are open."""
    while len(self._sessions) > keep:
      victim = next((s for s in self._sessions.values() if not s.lock.locked()), None)
      if victim is None:
        return
      log.info("closing least recently used session %r (max_sessions reached)", victim.sid)
      self._close_session_obj(victim)

  async def _open_session(self, sid: str) -> _Session | None:
    if not self._ready.is_set() or self._ctrl is None:
      return None
    self._trim_sessions(self.config.max_sessions - 1)
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    mine.setblocking(False)
    sess = _Session(sid, mine, next(self._ids))
    self._sessions[sid] = sess
    self._holders[sess.holder_id] = sess
    try:
      await self._send(self._ctrl, {"op": "session", "id": sess.holder_id}, [theirs.fileno()])
    except OSError as e:
      log.warning("could not open session %r: %s", sid, e)
      self._drop_session(sess)
      return None
    finally:
      theirs.close()
    return sess

  def _drop_session(self, sess: _Session) -> None:
    sess.alive = False
    if self._sessions.get(sess.sid) is sess:
      del self._sessions[sess.sid]
    self._holders.pop(sess.holder_id, None)
    try:
      sess.sock.close()
    except OSError:
      pass

  def _close_session_obj(self, sess: _Session) -> None:
    try:
      sess.sock.send(json.dumps({"op": "close"}).encode())
    except OSError:
      pass
    # The holder exits on "close" (or on EOF); its clean exit needs no event.
    self._holders.pop(sess.holder_id, None)
    self._drop_session(sess)

  async def close_session(self, sid: str) -> bool:
    sess = self._sessions.get(sid)
    if sess is None:
      return False
    async with sess.lock:
      self._close_session_obj(sess)
    return True

  async def _reap_sessions(self) -> None:
    ttl = self.config.session_ttl
    while True:
      await asyncio.sleep(min(30.0, ttl / 4))
      now = time.monotonic()
      for sess in list(self._sessions.values()):
        if not sess.lock.locked() and now - sess.last_used > ttl:
          self._close_session_obj(sess)

  async def _execute(self, call: Call, timeout: float, sess: _Session | None) -> Result:
    loop = asyncio.get_running_loop()
    if not self.healthy:
      try:
        await asyncio.wait_for(self._ready.wait(), self.config.start_timeout)
      except asyncio.TimeoutError:
        pass
      if not self.healthy:
        return Result.internal_error("the sandbox worker is not running", isolation=self.isolation)
    job = _Job(next(self._ids), timeout, loop.create_future())
    job.session = sess
    send_fds: list[int] = []
    try:
      # surrogatepass: a lone surrogate (a model's broken "\ud83d" escape) is a valid str
      # and runs as written; the child decodes the same way.
      send_fds.append(_memfd("code", call.code.encode("utf-8", "surrogatepass")))
      send_fds.append(_memfd("stdin", call.input.encode("utf-8", "surrogatepass")))
      for kind in ("out", "err", "res"):
        r, w = os.pipe()
        os.set_blocking(r, False)
        job.fds[r] = kind
        send_fds.append(w)
      self._jobs[job.id] = job
      for fd, kind in job.fds.items():
        loop.add_reader(fd, self._on_pipe, job, fd)
      job.t0 = time.monotonic()
      msg = {"op": "run", "id": job.id, "timeout": timeout}
      if sess is not None:
        job.kill_id = sess.holder_id
        sess.job = job
        await self._send(sess.sock, msg, send_fds)
      else:
        if self._ctrl is None:
          raise OSError("the sandbox worker is not running")
        await self._send(self._ctrl, msg, send_fds)
    except OSError as e:
      job.exit = {"internal": f"could not hand the call to the worker: {e}"}
      self._finish(job)
    finally:
      for fd in send_fds:
        os.close(fd)
    if not job.finished:
      if sess is not None:
        job.started = True
        job.handles.append(loop.call_later(timeout, self._on_deadline, job))
      else:   # the deadline starts with the worker's "started"; this only bounds the wait
        job.start_handle = loop.call_later(self.config.start_timeout, self._on_no_start, job)
        job.handles.append(job.start_handle)
    try:
      await job.fut
    except asyncio.CancelledError:
      if not job.finished:  # nobody waits for it any more: stop it and free its pipes
        self._kill(job)
        self._finish(job)
      raise
    finally:
      if sess is not None:
        sess.job = None
    return self._result(job, sess)

  def _on_pipe(self, job: _Job, fd: int) -> None:
    try:
      data = os.read(fd, 1 << 16)
    except BlockingIOError:
      return
    except OSError:
      data = b""
    if not data:
      self._close_fd(job, fd)
      self._maybe_finish(job)
      return
    self._take(job, fd, data)

  def _take(self, job: _Job, fd: int, data: bytes) -> None:
    kind = job.fds[fd]
    buf = job.bufs[kind]
    cap = _MAX_RECORD if kind == "res" else self.config.max_output_bytes
    room = cap - len(buf)
    if len(data) <= room:
      buf += data
      return
    buf += data[:max(room, 0)]
    if kind != "res" and job.exceeded is None and not job.timed_out:
      job.exceeded = kind
      self._kill(job)

  def _drain(self, job: _Job, fd: int) -> None:
    """Reads what a pipe already holds, without waiting."""
    for _ in range(64):
      try:
        data = os.read(fd, 1 << 16)
      except OSError:
        return
      if not data:
        return
      self._take(job, fd, data)

  def _close_fd(self, job: _Job, fd: int) -> None:
    if job.fds.pop(fd, None) is not None:
      asyncio.get_running_loop().remove_reader(fd)
      os.close(fd)

  def _maybe_finish(self, job: _Job) -> None:
    if job.finished:
      return
    if "res" not in job.fds.values() and job.record is None and job.bufs["res"]:
      try:
        job.record = json.loads(bytes(job.bufs["res"]))
      except ValueError:
        job.record = None  # a torn record: the exit event decides
    # With cgroups the worker reports every call's exit (an OOM kill of one of its
    # processes shows only there), so a one-shot call's record alone does not end it.
    ended = job.exit is not None or (job.record is not None
                                     and (self._cgroup is None or job.session is not None))
    torn = not job.fds and job.record is None and bool(job.bufs["res"])
    if ended and not job.fds:
      self._finish(job)
    elif (ended or torn) and not job.grace:
      # Something else still holds the call's stdout/stderr (the sweep kills it), or
      # the record is torn and an exit event may or may not follow: never wait long.
      job.grace = True
      job.handles.append(asyncio.get_running_loop().call_later(_GRACE_S, self._finish, job))

  def _finish(self, job: _Job) -> None:
    if job.finished:
      return
    job.finished = True
    for h in job.handles:
      h.cancel()
    for fd in list(job.fds):
      self._drain(job, fd)
      self._close_fd(job, fd)
    if job.record is None and job.bufs["res"]:
      try:
        job.record = json.loads(bytes(job.bufs["res"]))
      except ValueError:
        pass
    self._jobs.pop(job.id, None)
    job.wall = time.monotonic() - job.t0 if job.t0 else 0.0
    if not job.fut.done():  # cancelled when the HTTP client went away
      job.fut.set_result(None)

  def _on_deadline(self, job: _Job) -> None:
    if not job.finished:
      job.timed_out = True
      self._kill(job)

  def _kill(self, job: _Job) -> None:
    if not job.kill_sent:
      job.kill_sent = True
      self._send_nowait({"op": "kill", "id": job.kill_id})

  # -- the result -------------------------------------------------------------
  def _decode(self, job: _Job, kind: str) -> str:
    data = bytes(job.bufs[kind])
    if job.exceeded != kind:
      return data.decode("utf-8", "replace")
    # Cut at the byte cap: a character split there is left out, not replaced.
    text = codecs.getincrementaldecoder("utf-8")("replace").decode(data, final=False)
    return text + f"\n[... output truncated: {kind} exceeded {self.config.max_output_bytes} bytes ...]"

  def _result(self, job: _Job, sess: _Session | None) -> Result:
    r = Result(status="ok", stdout=self._decode(job, "out"), stderr=self._decode(job, "err"),
               wall_time=round(job.wall, 6), isolation=self.isolation,
               truncated=job.exceeded is not None)
    rec, ex = job.record, job.exit
    if rec:
      r.cpu_time = float(rec.get("cpu_time", 0.0))
    elif ex:
      r.cpu_time = float(ex.get("cpu_time", 0.0))
    r.cpu_time = round(r.cpu_time, 6)
    if ex and "internal" in ex:
      r.status, r.error_type, r.error_message = "internal_error", "SandboxError", ex["internal"]
    elif job.not_started or job.start_late:
      r.status, r.error_type = "internal_error", "SandboxError"
      r.error_message = (f"no sandbox process took the call within start_timeout="
                         f"{self.config.start_timeout:g} s; " +
                         ("it did not run" if job.not_started else
                          "it was killed as it started (it may have run in part)"))
    elif job.exceeded is not None:
      stream = "stdout" if job.exceeded == "out" else "stderr"
      r.status, r.error_type = "output_exceeded", "OutputLimitExceeded"
      r.error_message = f"{stream} exceeded {self.config.max_output_bytes} bytes; the call was killed"
    elif job.timed_out:
      r.status, r.error_type = "timeout", "TimeoutError"
      r.error_message = f"timed out after {job.timeout:g} s (wall clock); the call was killed"
    elif ex and ex.get("oom"):
      # Before the record: a call whose child the kernel killed may still have finished.
      r.status, r.error_type = "memory_exceeded", "MemoryError"
      what = "it" if "signal" in ex else "one of its processes"
      r.error_message = (f"the call's processes and /tmp files went past its memory limit of "
                         f"{self.config.per_call_mb} MB; the kernel killed {what}")
      if "signal" in ex:
        r.exit_code = -int(getattr(signal.Signals, ex["signal"], 0))
      elif rec:
        r.exit_code = rec.get("exit_code")
    elif rec:
      r.status = rec["status"]
      r.exit_code = rec.get("exit_code")
      for k in ("error_type", "error_line", "error_message", "error_source"):
        setattr(r, k, rec.get(k))
    elif ex and "signal" in ex:
      sig = ex["signal"]
      if sig == "SIGXCPU":
        r.status, r.error_type = "timeout", "TimeoutError"
        r.error_message = f"CPU time limit of {job.timeout:g} s exceeded; the call was killed"
      else:
        r.status, r.error_type = "killed", sig
        r.error_message = f"killed by signal {sig}"
      r.exit_code = -int(getattr(signal.Signals, sig, 0))
    elif job.bufs["res"]:   # a record came and cannot be read: no clean exit to report
      r.status, r.error_type = "internal_error", "SandboxError"
      r.error_message = "the call's result record could not be read"
    elif ex and "exitcode" in ex:
      code = int(ex["exitcode"])
      r.exit_code = code
      if code != 0:
        r.status, r.error_type = "error", "SystemExit"
        r.error_message = f"process exited with code {code}"
    else:
      r.status, r.error_type = "internal_error", "SandboxError"
      r.error_message = "the call ended without a result"
    if sess is not None and r.status in ("timeout", "killed", "output_exceeded", "internal_error"):
      r.error_message = (r.error_message or "") + "; the session was lost (its state starts afresh)"
    return r

  def info(self) -> dict[str, Any]:
    return {"isolation": self.isolation, "max_children": self.config.max_children,
            "healthy": self.healthy, "queue_depth": self._queued, "running": self._running,
            "memory": self.memory_mode, "max_running": self.max_running,
            "private_tmp": bool(self._ready_info.get("private_tmp")),
            "private_net": self._backend is not None and (
                self._backend.name == "bwrap" or bool(self._ready_info.get("private_net")))}
