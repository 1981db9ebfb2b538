"""The warm parent ("zygote") and the children it forks. Runs inside the sandbox.

Started by `executor.Executor` as `python -m sandbox.worker '<json config>'` with
a SOCK_SEQPACKET control socket on the fd named in the config. Protocol (JSON
datagrams, file descriptors passed with SCM_RIGHTS):

  supervisor -> zygote  {"op": "run", "id", "timeout"}      fds: code, stdin, stdout, stderr, result
                        {"op": "session", "id"}             fds: session control socket
                        {"op": "kill", "id"} | {"op": "ping"}
  zygote -> supervisor  {"ev": "ready", ...} | {"ev": "exit", "id", "exitcode"|"signal", "cpu_time"}
                        {"ev": "killed", "id", "cpu_time"} (right after a kill request is done)
                        {"ev": "started", "id"} (a child took a "run" job: its deadline starts)
  supervisor -> session {"op": "run", "id", "timeout"} (fds as above) | {"op": "close"}

A child writes one JSON record (status, error fields, cpu_time) to its result
pipe when the code ends by itself; when it is killed there is no record and the
zygote's "exit" event tells how it died.

The zygote stays single-threaded and keeps `pool_size` children forked ahead of
demand: a child does its set-up (own process group, nice, uid drop, rlimits, fresh
tmp dir, reseeded RNGs) while idle, so a call only pays for sending one message.
"""
from __future__ import annotations

import os
import sys

# BLAS/OpenMP pools must be pinned before numpy is imported: a forked child cannot
# inherit a thread pool, and extra threads would count against RLIMIT_NPROC.
THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
               "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "BLIS_NUM_THREADS")
for _var in THREAD_VARS:
  os.environ[_var] = "1"

import array  # noqa: E402
import builtins  # noqa: E402
import collections  # noqa: E402
import ctypes  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import mmap  # noqa: E402
import random  # noqa: E402
import resource  # noqa: E402
import selectors  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import types  # noqa: E402

from sandbox import isolation, runner  # noqa: E402

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 1 << 14, 1 << 18
MS_RDONLY, MS_REMOUNT, MS_BIND = 1, 32, 1 << 12
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
MAX_MSG = 1 << 16
MAX_FDS = 8
CHILD_FAILED = 70  # exit code of a child whose own set-up failed (EX_SOFTWARE)
_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, arg: int) -> None:
  if _libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"prctl({option}) failed: {os.strerror(err)}")


def _unshare(flags: int) -> None:
  if _libc.unshare(flags) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"unshare({flags:#x}) failed: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
  enc = lambda x: None if x is None else x.encode()  # noqa: E731
  if _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"mount {fstype or ''} on {target} failed: {os.strerror(err)}")


# The interpreter's directories under /tmp (a virtualenv there): fixed for the process,
# so found once here in the warm parent rather than in every call's child.
_INTERPRETER_DIRS_UNDER_TMP = isolation.interpreter_dirs_under()


def private_tmp(owner: int, tmp_mb: int, shm_mb: int) -> None:
  """Gives this process (and what it forks) its own empty /tmp and /dev/shm, and its
  own SysV IPC objects (shared memory, semaphores, message queues).

  Both are tmpfs in a new mount namespace, sized to the call's quota (a write past
  it fails with ENOSPC) and owned by the call's uid; the IPC objects live in a new IPC
  namespace, which no other call sees. When the last process of the call exits the
  namespaces go, and the kernel frees it all: nothing to clean up, even when the
  server is killed. (A SysV segment outlives its creator otherwise: calls could read
  each other's, and its pages stayed charged to the calls' memory budget.)
  """
  _unshare(CLONE_NEWNS | CLONE_NEWIPC)
  _mount(None, "/", None, MS_REC | MS_PRIVATE, None)  # nothing propagates back out
  # The interpreter's directories under /tmp (a virtualenv there) are held open and
  # bound back read-only over the new /tmp: later imports still find their files.
  keep = [(p, os.open(p, os.O_PATH | os.O_DIRECTORY)) for p in _INTERPRETER_DIRS_UNDER_TMP]
  try:
    for target, mb in (("/tmp", tmp_mb), ("/dev/shm", shm_mb)):
      _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV,
             f"size={mb}m,nr_inodes=65536,mode=0700,uid={owner},gid={owner}")
    for path, fd in keep:
      os.makedirs(path, mode=0o755, exist_ok=True)
      _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None)
      _mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY, None)
  finally:
    for _, fd in keep:
      os.close(fd)


def _write_file(path: str, data: bytes) -> None:
  """One write(2) to a kernel file (/proc, cgroupfs) without Python's file objects."""
  fd = os.open(path, os.O_WRONLY)
  try:
    os.write(fd, data)
  finally:
    os.close(fd)


def _log(msg: str) -> None:
  try:
    os.write(2, f"[sandbox.worker {os.getpid()}] {msg}\n".encode())
  except OSError:
    pass


def _cpu_seconds() -> float:
  s = resource.getrusage(resource.RUSAGE_SELF)
  c = resource.getrusage(resource.RUSAGE_CHILDREN)
  return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def _empty_dir(path: str) -> None:
  for name in os.listdir(path):
    full = os.path.join(path, name)
    try:
      if os.path.isdir(full) and not os.path.islink(full):
        shutil.rmtree(full, ignore_errors=True)
      else:
        os.unlink(full)
    except OSError:
      pass


def recv_fds(sock: socket.socket, flags: int = 0) -> tuple[bytes, list[int]]:
  """One datagram and the descriptors sent with it.

  socket.recv_fds ignores its `flags` argument in Python 3.11, so it cannot be
  used without blocking.
  """
  fds = array.array("i")
  msg, ancdata, msg_flags, _ = sock.recvmsg(MAX_MSG, socket.CMSG_LEN(MAX_FDS * fds.itemsize), flags)
  for level, kind, data in ancdata:
    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
      fds.frombytes(data[:len(data) - (len(data) % fds.itemsize)])
  if msg_flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
    for fd in fds:
      os.close(fd)
    raise OSError(f"control message truncated (flags={msg_flags:#x})")
  return msg, list(fds)


def _proc_cpu_seconds(pid: int) -> float:
  """utime + stime of a live process, from /proc (0.0 if it is gone)."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      stat = f.read()
    fields = stat[stat.rindex(b")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
  except (OSError, ValueError, IndexError):
    return 0.0


def _read_fd(fd: int) -> bytes:
  chunks = []
  while True:
    b = os.read(fd, 1 << 20)
    if not b:
      return b"".join(chunks)
    chunks.append(b)


class _Skip(Exception):
  pass


def preload(modules) -> list[str]:
  """Imports `modules` and runs a little of sympy/numpy so lazy paths are warm."""
  failed = []
  for name in modules:
    try:
      importlib.import_module(name)
    except Exception as e:  # noqa: BLE001: a missing optional module is not fatal
      failed.append(f"{name}: {type(e).__name__}: {e}")
  try:
    sympy = sys.modules.get("sympy")
    if sympy is None:
      raise _Skip
    x, y = sympy.symbols("x y")
    sympy.solve(x**2 - 3 * x + 2, x)
    sympy.solve([x + y - 3, x - y - 1], [x, y])
    sympy.simplify((x**2 - 1) / (x - 1))
    sympy.factor(x**3 - x)
    sympy.expand((x + 1)**4)
    sympy.integrate(x**2 + 1, x)
    sympy.diff(sympy.sin(x) * x, x)
    sympy.Rational(1, 3) + sympy.sqrt(8) + sympy.N(sympy.pi, 30)
    sympy.nsimplify(0.5)
    sympy.isprime(97)
    sympy.factorint(360)
    str(sympy.Matrix([[1, 2], [3, 4]]).det())
  except _Skip:
    pass
  except Exception as e:  # noqa: BLE001
    failed.append(f"sympy warm-up: {type(e).__name__}: {e}")
  try:
    np = sys.modules.get("numpy")
    if np is None:
      raise _Skip
    rng = np.random.default_rng(0)
    np.linalg.solve(np.eye(3), rng.random(3))
    np.random.random(3)
    repr(np.arange(10).reshape(2, 5).sum(axis=0))
  except _Skip:
    pass
  except Exception as e:  # noqa: BLE001
    failed.append(f"numpy warm-up: {type(e).__name__}: {e}")
  try:
    warm_cells()
  except Exception as e:  # noqa: BLE001
    failed.append(f"cell warm-up: {type(e).__name__}: {e}")
  return failed


# Typical tool-call cells, run once through the same path as a call (runner, a fresh
# `__main__`, text streams on a file descriptor) before the warm parent forks: code
# and caches a call's first use would fill (sympy's printer, number formatting,
# tracebacks, syntax errors) are then inherited warm instead of built per call. Only
# generic work: nothing here is tuned to a benchmark's expression.
WARM_CELLS = (
    "from sympy import symbols, solve, simplify, Rational, sqrt\n"
    "w = symbols('w')\nprint(solve(w**2 + 3*w - 4, w), simplify((w**2 - 1)/(w - 1)), Rational(3, 4) + sqrt(2))",
    "import numpy as np\na = np.arange(6.0).reshape(2, 3)\nprint(a, a.mean(), np.linalg.norm(a))\na.sum(axis=0)",
    "import math\nprint(sum(math.comb(10, k) for k in range(11)), 1 / 3, [1.5, 2], {'a': (1, 'b')})\n7 ** 30",
    "def f(n):\n  return 1 // n\nf(0)",
    "print(undefined_name)",
    "x = (",
)


def warm_cells() -> None:
  saved = sys.stdout, sys.stderr, sys.modules.get("__main__")
  fd = os.open(os.devnull, os.O_WRONLY)
  try:
    sys.stdout = _text_stream(fd, "w", "backslashreplace")
    sys.stderr = _text_stream(fd, "w", "backslashreplace")
    for cell in WARM_CELLS:
      json.dumps(runner.run_cell(cell, _fresh_globals()))
    sys.stdout.flush()
    sys.stderr.flush()
  finally:
    sys.stdout, sys.stderr = saved[0], saved[1]
    if saved[2] is not None:
      sys.modules["__main__"] = saved[2]
    os.close(fd)


class _Child:
  __slots__ = ("pid", "slot", "sock", "job_id", "session", "oom0")

  def __init__(self, pid: int, slot: int, sock: socket.socket, oom0: int = 0):
    self.pid, self.slot, self.sock, self.job_id = pid, slot, sock, None
    self.session = False
    self.oom0 = oom0


class Zygote:
  """The warm parent: forks children, hands them jobs, reaps them, reports exits."""

  def __init__(self, cfg: dict):
    self.cfg = cfg
    self.ctrl = socket.socket(fileno=cfg["ctrl_fd"])
    self.drop_uid = os.geteuid() == 0
    self.cgroup = cfg.get("cgroup")  # {"top", "version"} or None
    self.uid_base = int(cfg["uid_base"])
    self.pool_size = int(cfg["pool_size"])
    n_slots = int(cfg["n_slots"])
    self.free_slots = collections.deque(range(n_slots))
    # One byte per slot, shared with the children: 1 = "ended through the clean
    # path, nothing of this uid is left running", so no /proc sweep is needed.
    self.flags = mmap.mmap(-1, n_slots)
    self.children: dict[int, _Child] = {}
    self.by_job: dict[int, _Child] = {}
    self.idle: collections.deque[_Child] = collections.deque()
    self.pending: collections.deque[tuple[dict, list[int]]] = collections.deque()
    self.wake_r, self.wake_w = os.pipe()
    os.set_blocking(self.wake_r, False)
    os.set_blocking(self.wake_w, False)
    self.sel = selectors.DefaultSelector()

  # -- set-up -----------------------------------------------------------------
  def probe_fork(self) -> str | None:
    """Forks one test child: can it get its own /tmp and /dev/shm (None if so, else
    why not), and did CPython reseed `random` in it (else children reseed it)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
      try:
        os.close(r)
        os.write(w, b"%d" % random.getrandbits(64))
        if self.cfg.get("private_tmp"):
          private_tmp(os.getuid(), 1, 1)
        os._exit(0)
      except BaseException as e:  # noqa: BLE001
        _log(f"no private /tmp per call: {e}")
        os._exit(1)
    os.close(w)
    drawn = _read_fd(r)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    # The child's first draw equals ours (same state) unless it was reseeded at fork.
    self.cfg["reseed_random"] = drawn == b"%d" % random.getrandbits(64)
    if self.cfg["reseed_random"]:
      _log("random is not reseeded at fork by this Python; every child reseeds it")
    if not self.cfg.get("private_tmp"):
      return "not asked for"
    return None if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 else "mount failed"

  def slot_cgroup(self, slot: int) -> str | None:
    return None if not self.cgroup else os.path.join(self.cgroup["top"], "calls", f"c{slot}")

  def oom_kills(self, slot: int) -> int:
    if not self.cgroup:
      return 0
    name = "memory.events" if self.cgroup["version"] == 2 else "memory.oom_control"
    try:
      with open(os.path.join(self.slot_cgroup(slot), name), "rb") as f:
        for line in f.read().splitlines():
          if line.startswith(b"oom_kill "):
            return int(line.split()[1])
    except (OSError, ValueError):
      pass
    return 0

  def prepare(self) -> None:
    why = self.probe_fork()
    self.cfg["private_tmp"] = why is None
    if self.cfg["private_tmp"]:
      # Every call runs with cwd, HOME and TMPDIR = its private /tmp: set the calls'
      # environment here once, so that children do not rebuild (and copy) it per call.
      env = _child_env("/tmp")
      os.environ.clear()
      os.environ.update(env)
    reseed_numpy()  # warms the children's reseeding (our own state is never used)
    root = self.cfg["work_root"]
    os.makedirs(root, exist_ok=True)
    os.chmod(root, 0o711)  # children may enter their own dir but not list others
    for slot in range(len(self.free_slots)):
      d = os.path.join(root, str(slot))
      os.makedirs(d, exist_ok=True)
      if self.drop_uid:
        os.chown(d, self.uid_base + slot, self.uid_base + slot)
      os.chmod(d, 0o700)
    # bwrap's init leaves SIGCHLD blocked in our mask; we rely on it to reap.
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(self.wake_w)
    self.sel.register(self.ctrl, selectors.EVENT_READ, "ctrl")
    self.sel.register(self.wake_r, selectors.EVENT_READ, "wake")

  def send(self, ev: dict) -> None:
    try:
      self.ctrl.send(json.dumps(ev).encode())
    except BrokenPipeError:
      pass  # the supervisor is gone; the EOF on ctrl shuts us down next
    except OSError as e:
      _log(f"cannot reach the supervisor: {e}")

  # -- main loop --------------------------------------------------------------
  def serve(self) -> None:
    while True:
      want_fork = bool(self.free_slots) and (bool(self.pending) or len(self.idle) < self.pool_size)
      events = self.sel.select(0 if want_fork else None)
      for key, _ in events:
        if key.data == "wake":
          try:
            while os.read(self.wake_r, 4096):
              pass
          except BlockingIOError:
            pass
          self.reap()
        elif not self.read_ctrl():
          self.shutdown()
          os._exit(0)  # skip interpreter teardown of everything preloaded
      if not events and want_fork:
        # One fork per turn of the loop: kill requests never wait behind a burst of forks.
        self.idle.append(self.fork())
        self.pump()

  def read_ctrl(self) -> bool:
    """Handles every queued control message; False when the supervisor is gone."""
    kills: list[int] = []
    alive = True
    while True:
      try:
        msg, fds = recv_fds(self.ctrl, socket.MSG_DONTWAIT)
      except BlockingIOError:
        break
      except ConnectionResetError:
        alive = False  # the supervisor went away
        break
      except OSError as e:
        _log(f"control socket failed: {e}")
        alive = False
        break
      if not msg:
        alive = False
        break
      try:
        req = json.loads(msg)
        op = req["op"]
      except (ValueError, KeyError) as e:
        _log(f"bad control message {msg[:200]!r}: {e}")
        for fd in fds:
          os.close(fd)
        continue
      if op in ("run", "session"):
        self.pending.append((req, fds))
      elif op == "kill":
        kills.append(int(req["id"]))
      elif op == "ping":
        self.send({"ev": "pong", "children": len(self.children), "idle": len(self.idle)})
      else:
        _log(f"unknown op {op!r}")
        for fd in fds:
          os.close(fd)
    if kills:
      self.kill_jobs(kills)
    self.pump()
    return alive

  def pump(self) -> None:
    """Hands pending jobs to idle children (the main loop forks more when none is idle)."""
    while self.pending and self.idle:
      child = self.idle.popleft()
      req, fds = self.pending[0]
      try:
        socket.send_fds(child.sock, [json.dumps(req).encode()], fds)
      except OSError as e:
        # The child died before taking the job: keep the job, try the next child.
        _log(f"could not hand job {req.get('id')} to child {child.pid}: {e}")
        child.sock.close()
        child.sock = None
        continue
      self.pending.popleft()
      for fd in fds:
        os.close(fd)
      child.sock.close()
      child.sock = None
      child.job_id = int(req["id"])
      child.session = req["op"] == "session"
      self.by_job[child.job_id] = child
      if not child.session:
        self.send({"ev": "started", "id": child.job_id})

  def fork(self) -> _Child:
    slot = self.free_slots.popleft()
    self.flags[slot] = 0
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:  # child
      try:
        mine.close()
        self.close_in_child()
        child_main(self.cfg, slot, theirs, self.flags, self.drop_uid)
      except BaseException:  # noqa: BLE001: must never return into the zygote loop
        try:
          traceback.print_exc()
        finally:
          os._exit(CHILD_FAILED)
      os._exit(0)
    theirs.close()
    child = _Child(pid, slot, mine, self.oom_kills(slot))
    self.children[pid] = child
    return child

  def close_in_child(self) -> None:
    """Drops every zygote file descriptor in a fresh child (they must not leak to user code)."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    self.sel.close()
    self.ctrl.close()
    os.close(self.wake_r)
    os.close(self.wake_w)
    for c in self.children.values():
      if c.sock is not None:
        c.sock.close()
    for _, fds in self.pending:
      for fd in fds:
        os.close(fd)
    self.pending.clear()

  # -- ending calls -----------------------------------------------------------
  def kill_jobs(self, job_ids: list[int]) -> None:
    """Kills the calls' process groups, sweeps their uids once, reports each at once."""
    events, uids = [], set()
    for job_id in job_ids:
      child = self.by_job.get(job_id)
      if child is None:
        for i, (req, fds) in enumerate(self.pending):
          if int(req["id"]) == job_id:  # killed before it started
            del self.pending[i]
            for fd in fds:
              os.close(fd)
            break
        # Answered even when already gone, so the supervisor never waits on it.
        events.append({"ev": "killed", "id": job_id, "cpu_time": 0.0})
        continue
      cpu = _proc_cpu_seconds(child.pid)
      for target in (lambda: os.killpg(child.pid, signal.SIGKILL),
                     lambda: os.kill(child.pid, signal.SIGKILL)):
        try:
          target()
        except ProcessLookupError:
          pass
      uids.add(self.uid_base + child.slot)
      # Reported now, not at the reap: tearing down a dying child's address space
      # can take a while on a busy machine, and the deadline is met already.
      events.append({"ev": "killed", "id": job_id, "cpu_time": cpu})
    self.sweep(uids)
    for ev in events:
      self.send(ev)

  def sweep(self, uids: set[int]) -> None:
    """SIGKILLs every process of these uids (subprocesses that left the call's group).

    Passes repeat only while they find processes not yet signalled (forked during
    the previous pass); a process with SIGKILL pending can no longer fork.
    """
    if not self.drop_uid:
      return  # without our own uid per call there is nothing safe to sweep by
    uids = {u for u in uids if u >= self.uid_base and u != os.getuid()}
    if not uids:
      return
    wanted = {str(u).encode() for u in uids}
    signalled: set[int] = set()
    for _ in range(1000):
      new = False
      for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in signalled:
          continue
        try:
          owner = os.stat(f"/proc/{name}").st_uid
        except OSError:
          continue
        if owner not in uids:
          if owner != 0:
            continue
          # Root-owned entries include processes that made themselves non-dumpable
          # to hide their owner: read their real uids.
          try:
            with open(f"/proc/{name}/status", "rb") as f:
              status = f.read()
          except OSError:
            continue
          line = next((l for l in status.splitlines() if l.startswith(b"Uid:")), b"")
          if not wanted.intersection(line.split()[1:]):
            continue
        try:
          os.kill(int(name), signal.SIGKILL)
        except ProcessLookupError:
          continue
        signalled.add(int(name))
        new = True
      if not new:
        return

  def reap(self) -> None:
    while True:
      try:
        pid, status, ru = os.wait4(-1, os.WNOHANG)
      except ChildProcessError:
        break
      if pid == 0:
        break
      child = self.children.pop(pid, None)
      if child is None:
        continue  # an orphan handed to us as subreaper
      try:
        self.idle.remove(child)
        _log(f"idle child {pid} died (status {status}); its set-up failed")
      except ValueError:
        pass
      clean = self.flags[child.slot] == 1 and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
      if not clean:
        self.sweep({self.uid_base + child.slot})
      if child.sock is not None:
        child.sock.close()
      self.free_slots.append(child.slot)
      if child.job_id is not None:
        self.by_job.pop(child.job_id, None)
        if clean and not child.session and not self.cgroup:
          continue  # the call's own record has told the supervisor everything
        # With cgroups a clean exit is reported too: the kernel may have killed one of
        # the call's processes at the limit while the call itself went on to finish.
        ev = {"ev": "exit", "id": child.job_id, "cpu_time": ru.ru_utime + ru.ru_stime}
        if self.cgroup and self.oom_kills(child.slot) > child.oom0:
          ev["oom"] = True  # the kernel killed (part of) the call at its memory cgroup limit
        if os.WIFSIGNALED(status):
          ev["signal"] = signal.Signals(os.WTERMSIG(status)).name
        else:
          ev["exitcode"] = os.WEXITSTATUS(status)
        self.send(ev)
    self.pump()

  def die(self) -> None:
    """Our supervisor is gone: end every call and everything of our uid range, exit."""
    self.shutdown()
    if self.drop_uid:
      self.sweep(set(range(self.uid_base, self.uid_base + int(self.cfg["n_slots"]))))
    os._exit(0)

  def shutdown(self) -> None:
    for child in list(self.children.values()):
      try:
        os.killpg(child.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      try:
        os.kill(child.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      self.sweep({self.uid_base + child.slot})


# ------------------------------------------------------------------- the child
def _child_env(workdir: str) -> dict[str, str]:
  env = {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "HOME": workdir,
         "TMPDIR": workdir, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
         "PYTHONDONTWRITEBYTECODE": "1", "MPLBACKEND": "Agg"}
  for var in THREAD_VARS:
    env[var] = "1"
  return env


def child_main(cfg: dict, slot: int, sock: socket.socket, flags: mmap.mmap, drop_uid: bool) -> None:
  """Set-up done while idle, then one job: a one-shot call or a session."""
  # Own process group (killed whole at the deadline), but the warm parent's session:
  # with scheduler autogroups (on by default) every session is a scheduling group
  # of its own and niceness only ranks tasks inside one, so a child in a new session
  # would weigh as much as the warm parent however nice it is.
  os.setpgid(0, 0)
  for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, signal.SIG_DFL)
  signal.signal(signal.SIGINT, signal.default_int_handler)
  os.setpriority(os.PRIO_PROCESS, 0, int(cfg["nice"]))  # absolute: below the warm parent
  uid = int(cfg["uid_base"]) + slot
  cgroup = cfg.get("cgroup")
  if cgroup:  # while still root: this call's memory cgroup (all it forks stays in it)
    _write_file(os.path.join(cgroup["top"], "calls", f"c{slot}", "cgroup.procs"), b"0")
  try:  # the first to go if memory runs out (the warm parent and server are at -1000)
    _write_file("/proc/self/oom_score_adj", b"1000")
  except OSError:
    pass
  if cfg.get("private_tmp"):
    private_tmp(uid if drop_uid else os.getuid(), int(cfg["tmp_mb"]), int(cfg["shm_mb"]))
    workdir = "/tmp"
  else:
    workdir = os.path.join(cfg["work_root"], str(slot))
  if drop_uid:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getuid() != uid or os.geteuid() != uid:
      raise RuntimeError(f"uid drop to {uid} failed")
    os.kill(-1, signal.SIGKILL)  # anything an earlier call of this uid left behind
  _prctl(PR_SET_NO_NEW_PRIVS, 1)  # no setuid binaries regaining root
  # The uid change made us non-dumpable, which shows /proc/<pid> as root's; dumpable
  # again, our processes are found by a cheap stat in the sweep (core dumps stay off
  # through RLIMIT_CORE=0, and no other call shares our uid to ptrace us).
  _prctl(PR_SET_DUMPABLE, 1)
  _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it
  os.umask(0o077)
  if not cfg.get("private_tmp"):
    _empty_dir(workdir)
  os.chdir(workdir)
  mb = 1 << 20
  resource.setrlimit(resource.RLIMIT_AS, (cfg["memory_mb"] * mb,) * 2)
  resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["max_file_mb"] * mb,) * 2)
  resource.setrlimit(resource.RLIMIT_NOFILE, (cfg["max_open_files"],) * 2)
  resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
  if drop_uid:  # per-uid count; without our own uid it would count the server's processes
    resource.setrlimit(resource.RLIMIT_NPROC, (cfg["max_processes"],) * 2)
  if cfg.get("private_tmp"):
    # The environment is the same for every call (workdir is /tmp): the warm parent
    # set it once before forking (see `Zygote.prepare`), so nothing is copied here.
    if os.environ.get("TMPDIR") != workdir:
      raise RuntimeError("the warm parent's environment is not the calls' environment")
  else:
    os.environ.clear()
    os.environ.update(_child_env(workdir))
  tempfile.tempdir = workdir
  sys.argv = [""]
  # A fork copies the parent's RNG state: every call must draw its own numbers.
  # `random` is reseeded from the OS by CPython itself in every forked child (the
  # module's os.register_at_fork hook; `Zygote.probe_fork` checks that it did);
  # numpy's global RandomState is not, so it is reseeded here.
  if cfg.get("reseed_random"):
    random.seed()
  reseed_numpy()

  msg, fds = recv_fds(sock)
  sock.close()
  if not msg:
    os._exit(0)  # the zygote is shutting down
  req = json.loads(msg)
  if req["op"] == "session":
    _session_loop(socket.socket(fileno=fds[0]), drop_uid)
  else:
    _run_job(req, fds, _fresh_globals(), drop_uid, one_shot=True)
  if drop_uid:
    os.kill(-1, signal.SIGKILL)
  flags[slot] = 1
  os._exit(0)


def reseed_numpy() -> None:
  """numpy's global RandomState from 128 bits of the OS (np.random.seed() would read
  2.5 KB, 0.6 ms). The warm parent runs it once too, so that the code paths it takes
  are warm (measured in a fresh fork: 1.3 ms cold, 1.0 ms after that warm-up)."""
  np = sys.modules.get("numpy")
  if np is not None:
    np.random.seed(np.frombuffer(os.urandom(16), dtype=np.uint32))


def _fresh_globals() -> dict:
  """A new `__main__` module for the cell: functions it defines can be pickled by
  reference (multiprocessing.Pool, concurrent.futures send them to workers that way)."""
  main = types.ModuleType("__main__")
  main.__dict__["__builtins__"] = builtins
  sys.modules["__main__"] = main
  return main.__dict__


def _text_stream(fd: int, mode: str, errors: str) -> io.TextIOWrapper:
  raw = io.FileIO(fd, mode, closefd=False)
  buf = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
  # Line buffering: output printed before a kill still reaches the supervisor.
  return io.TextIOWrapper(buf, encoding="utf-8", errors=errors, line_buffering=(mode == "w"))


def _run_job(req: dict, fds: list[int], globals_: dict, drop_uid: bool, one_shot: bool) -> None:
  code_fd, stdin_fd, out_fd, err_fd, res_fd = fds
  cpu0 = _cpu_seconds()
  soft = int(cpu0) + int(math.ceil(float(req["timeout"]))) + 1
  _, hard = resource.getrlimit(resource.RLIMIT_CPU)
  if one_shot:
    hard = soft + 1
  elif hard != resource.RLIM_INFINITY:
    soft = min(soft, hard)
  resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
  code = _read_fd(code_fd).decode("utf-8", "surrogatepass")
  os.close(code_fd)
  for src, dst in ((stdin_fd, 0), (out_fd, 1), (err_fd, 2)):
    os.dup2(src, dst)
    os.close(src)
  sys.stdin = sys.__stdin__ = _text_stream(0, "r", "surrogatepass")
  sys.stdout = sys.__stdout__ = _text_stream(1, "w", "backslashreplace")
  sys.stderr = sys.__stderr__ = _text_stream(2, "w", "backslashreplace")
  ours = (sys.stdout, sys.stderr)
  me = os.getpid()
  outcome = runner.run_cell(code, globals_)
  for stream in {id(s): s for s in (sys.stdout, sys.stderr) + ours}.values():
    try:
      stream.flush()
    except Exception:  # noqa: BLE001: a closed or replaced stream must not lose the record
      pass
  if os.getpid() != me:
    # A process the cell forked (os.fork) reached the end of the cell: it is not
    # the call, so it must neither write the record nor sweep its siblings.
    os._exit(0)
  if drop_uid:
    os.kill(-1, signal.SIGKILL)  # subprocesses that tried to outlive the call
  outcome["cpu_time"] = _cpu_seconds() - cpu0
  for key, cap in (("error_message", 4000), ("error_source", 400)):
    if outcome.get(key) and len(outcome[key]) > cap:
      outcome[key] = outcome[key][:cap] + "..."
  record = json.dumps(outcome).encode()
  try:
    while record:
      record = record[os.write(res_fd, record):]
  except OSError:
    pass
  os.close(res_fd)
  # Close the call's pipes now: the kernel closes them only after tearing down the
  # address space at exit, which would add milliseconds to every call.
  null = os.open(os.devnull, os.O_RDWR)
  for fd in (0, 1, 2):
    os.dup2(null, fd)
  os.close(null)


def _session_loop(ctrl: socket.socket, drop_uid: bool) -> None:
  """Runs a session's calls in one process and one globals dict, like a notebook kernel."""
  globals_ = _fresh_globals()
  while True:
    try:
      msg, fds = recv_fds(ctrl)
    except OSError:
      return
    if not msg:
      return
    req = json.loads(msg)
    if req.get("op") != "run":
      for fd in fds:
        os.close(fd)
      return
    _run_job(req, fds, globals_, drop_uid, one_shot=False)


def _own_netns_is_empty() -> bool:
  """True when this process sees no network interface but lo (a private network namespace)."""
  try:
    return _ifaces() <= {"lo"}
  except OSError:
    return False


def _ifaces() -> set[str]:
  with open("/proc/net/dev") as f:
    return {line.split(":")[0].strip() for line in f.readlines()[2:]}


def main(argv: list[str]) -> None:
  if len(argv) != 2:
    raise SystemExit("usage: python -m sandbox.worker '<json config>' (started by sandbox.executor)")
  cfg = json.loads(argv[1])
  try:
    # The supervisor died (even by SIGKILL): SIGTERM, whose handler below kills every
    # process of our calls' uids (daemons that left the call's process group) and exits.
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)         # orphaned grandchildren come back to us
  except OSError as e:
    _log(str(e))
  if cfg.get("private_net"):
    # No bwrap: still no network for the calls (a new network namespace, only a down lo).
    try:
      _unshare(CLONE_NEWNET)
    except OSError as e:
      _log(f"calls keep the host's network: {e}")
  t0 = time.monotonic()
  failed = preload(cfg["preload"])
  for f in failed:
    _log(f"preload: {f}")
  sys.set_int_max_str_digits(0)  # big-integer maths is normal here; the deadline bounds the cost
  zygote = Zygote(cfg)
  signal.signal(signal.SIGTERM, lambda *_: zygote.die())
  zygote.prepare()
  gc.collect()
  gc.freeze()  # keeps the collector from touching (and so copying) inherited pages
  zygote.send({"ev": "ready", "pid": os.getpid(), "drop_uid": zygote.drop_uid,
               "private_tmp": zygote.cfg["private_tmp"],
               "private_net": _own_netns_is_empty(),
               "preload_failed": failed, "preload_s": round(time.monotonic() - t0, 3)})
  zygote.serve()


if __name__ == "__main__":
  main(sys.argv)
