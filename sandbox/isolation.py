"""How the warm parent is started: inside bubblewrap, or bare with rlimits only.

Backends live in a registry so a deployment can add one (e.g. a container
runtime) without touching the executor: `@register("name")` on a class with
`probe()` and `command()`.
"""
from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from typing import Callable, Sequence

log = logging.getLogger("sandbox")

_REGISTRY: dict[str, Callable[[], "Backend"]] = {}


def register(name: str):
  def deco(cls):
    if name in _REGISTRY:
      raise ValueError(f"isolation backend {name!r} is already registered")
    _REGISTRY[name] = cls
    return cls
  return deco


def get(name: str) -> "Backend":
  if name not in _REGISTRY:
    raise ValueError(f"unknown isolation backend {name!r}; known: {sorted(_REGISTRY)}")
  return _REGISTRY[name]()


def names() -> list[str]:
  return sorted(_REGISTRY)


PKG_DIR = os.path.dirname(os.path.abspath(__file__))


class Backend:
  """Starts the worker process; subclasses say how."""
  name = ""
  # Inside the sandbox: where the per-call directories live.
  work_root: str

  def probe(self) -> str | None:
    """None when usable here, else the reason it is not."""
    raise NotImplementedError

  def setup(self) -> str:
    """Prepares a start; returns the directory (as the worker sees it) for per-call dirs."""
    return self.work_root

  def command(self, worker_argv: Sequence[str], tmpfs_mb: int,
              binds: Sequence[str] = ()) -> tuple[list[str], dict[str, str], str]:
    """(argv, env, cwd) that start `python -m sandbox.worker ...`; `binds`: host
    directories the worker must be able to write (its memory cgroups)."""
    raise NotImplementedError

  def level(self, drop_uid: bool) -> str:
    raise NotImplementedError

  def cleanup(self) -> None:
    pass


def _base_env(pythonpath: str) -> dict[str, str]:
  env = {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "LANG": "C.UTF-8",
         "PYTHONPATH": pythonpath, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1",
         "HOME": "/tmp",
         # glibc malloc on transparent huge pages instead of pymalloc's 1 MiB arenas:
         # the warm parent's heap then maps with a few hundred PMD entries instead of
         # ~30k PTEs, which measured halved fork+exit (7.5 vs 15 ms on 2 cores).
         "PYTHONMALLOC": "malloc", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
  return env


def interpreter_dirs_under(root: str = "/tmp") -> list[str]:
  """The interpreter's own directories below `root` (a virtualenv made under /tmp),
  outermost only: a private /tmp would hide them, so they are bound back read-only."""
  dirs = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                        os.path.dirname(os.path.abspath(sys.executable)))}
  below = sorted(d for d in dirs if d.startswith(root.rstrip("/") + "/"))
  return [d for d in below if not any(d.startswith(k + "/") for k in below)]


def _hidden_ancestor(path: str) -> str | None:
  """The highest ancestor of `path` that others cannot traverse (e.g. /root, mode 0700)."""
  parts = os.path.abspath(path).split(os.sep)[1:]
  cur = ""
  for part in parts[:-1]:
    cur = f"{cur}/{part}"
    try:
      if not os.stat(cur).st_mode & stat.S_IXOTH:
        return cur
    except OSError:
      return None
  return None


@register("bwrap")
class Bwrap(Backend):
  """bubblewrap: read-only root, private /tmp, no network, own PID/IPC/UTS namespaces.

  Run as root without a user namespace, so the warm parent keeps just the
  capabilities it needs to give every call its own uid (setuid/setgid), kill and
  clean up after it (kill, chown, dac_override, fowner). Children drop them all.
  """
  name = "bwrap"
  work_root = "/tmp/w"
  lib_dir = "/tmp/.lib"
  # CAP_SYS_ADMIN: to mount each call's private /tmp and /dev/shm (in the child, before it
  # drops to its own uid, which clears every capability).
  caps = ("CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER",
          "CAP_SYS_ADMIN")

  def __init__(self):
    self.bwrap = shutil.which("bwrap")

  def _args(self, tmpfs_mb: int, binds: Sequence[str] = ()) -> list[str]:
    args = [self.bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
            "--perms", "0711", "--size", str(tmpfs_mb << 20), "--tmpfs", "/tmp"]
    for p in interpreter_dirs_under("/tmp"):   # a virtualenv under /tmp stays visible
      args += ["--ro-bind", p, p]
    # Directories the interpreter needs but that sit below one that a dropped uid
    # cannot traverse (pyenv under /root): hide the parent, bind back only these.
    needed = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                            os.path.dirname(os.path.realpath(sys.executable)))}
    needed |= {os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)}
    hidden: dict[str, list[str]] = {}
    for p in sorted(needed):
      top = _hidden_ancestor(p + "/x")
      if top is not None and not p.startswith("/tmp"):
        hidden.setdefault(top, []).append(p)
    for top, paths in sorted(hidden.items()):
      args += ["--perms", "0755", "--tmpfs", top]
      kept: list[str] = []
      made: set[str] = set()
      for p in sorted(paths, key=len):
        if any(p == k or p.startswith(k + "/") for k in kept):
          continue
        kept.append(p)
        # bwrap would create the directories in between as 0700: make them traversable.
        rel = os.path.relpath(p, top).split(os.sep)[:-1]
        for i in range(1, len(rel) + 1):
          d = os.path.join(top, *rel[:i])
          if d not in made:
            made.add(d)
            args += ["--perms", "0755", "--dir", d]
        args += ["--ro-bind", p, p]
    for path in binds:
      args += ["--bind", path, path]
    args += ["--ro-bind", PKG_DIR, f"{self.lib_dir}/sandbox",
             "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
             "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    for cap in self.caps:
      args += ["--cap-add", cap]
    return args + ["--chdir", "/tmp"]

  def probe(self) -> str | None:
    if self.bwrap is None:
      return "bwrap is not installed (Debian package 'bubblewrap')"
    if os.geteuid() != 0:
      return "bwrap isolation needs root (to give each call its own uid)"
    try:
      p = subprocess.run(self._args(16) + ["--", sys.executable, "-c", "import os; os.setuid(65534)"],
                         capture_output=True, timeout=30, env=_base_env(self.lib_dir))
    except (OSError, subprocess.TimeoutExpired) as e:
      return f"bwrap failed to start: {e}"
    if p.returncode != 0:
      return f"bwrap cannot create the sandbox here: {p.stderr.decode(errors='replace').strip()}"
    return None

  def command(self, worker_argv, tmpfs_mb, binds=()):
    argv = self._args(tmpfs_mb, binds) + ["--", sys.executable, "-m", "sandbox.worker", *worker_argv]
    return argv, _base_env(self.lib_dir), "/"

  def level(self, drop_uid: bool) -> str:
    return "bwrap"


@register("rlimits")
class Rlimits(Backend):
  """No namespaces: rlimits, and an own uid per call when running as root.

  The network, the file system (whatever the call's uid may write) and other
  processes' /proc entries stay reachable. Use only where bwrap cannot run.
  """

  name = "rlimits"

  def __init__(self):
    self.work_root = ""

  def probe(self) -> str | None:
    return None

  def setup(self) -> str:
    self.cleanup()
    self.work_root = tempfile.mkdtemp(prefix="sandbox-")
    os.chmod(self.work_root, 0o711)  # each call may enter its own dir, list none
    return self.work_root

  def command(self, worker_argv, tmpfs_mb, binds=()):
    return ([sys.executable, "-m", "sandbox.worker", *worker_argv],
            _base_env(os.path.dirname(PKG_DIR)), self.work_root)

  def level(self, drop_uid: bool) -> str:
    return "rlimits+uid" if drop_uid else "rlimits"

  def cleanup(self) -> None:
    if self.work_root:
      shutil.rmtree(self.work_root, ignore_errors=True)


WEAK = """\
Without bubblewrap, calls run with rlimits only, plus where the server is root: an own
uid per call, a private /tmp and /dev/shm per call, an empty network namespace, memory
cgroups where the host has them, and a sweep of the calls' uids when the server dies.
Given up compared with bwrap: calls can read every world-readable file of the host
(home directories, configuration, other users' world-readable data) and write where
their uid may (world-writable directories such as /var/tmp), and see the host's
processes in /proc. Without root there is also no own uid, no private /tmp, no
network isolation and no fork-bomb containment."""


def choose(isolation: str, allow_weak: bool = False) -> Backend:
  """'auto' takes bwrap when it works; anything weaker needs `allow_weak`."""
  backend, warning = _select(isolation, allow_weak)
  if warning:
    _warn(warning)
  return backend


def check(isolation: str = "auto", allow_weak: bool = False) -> None:
  """Raises the RuntimeError `choose` would raise, without starting or warning anything:
  lets a launcher refuse in its own process, naming the fix, before it spawns a server."""
  _select(isolation, allow_weak)


def _select(isolation: str, allow_weak: bool) -> tuple[Backend, str | None]:
  """The backend and the warning that taking it deserves (None for bwrap)."""
  if isolation == "bwrap" or isolation == "auto":
    backend = get("bwrap")
    why = backend.probe()
    if why is None:
      return backend, None
    if isolation == "bwrap":
      raise RuntimeError(f"isolation 'bwrap' is not available: {why}")
    if not allow_weak:
      raise RuntimeError(
          f"bubblewrap isolation is unavailable: {why}.\n"
          "Install it (Debian/Ubuntu: apt-get install -y bubblewrap; Fedora: dnf install "
          "bubblewrap) and run as root, or start with --allow-weak-isolation to run model code "
          "with weaker isolation.\n" + WEAK)
    return get("rlimits"), f"bubblewrap isolation unavailable: {why}"
  backend = get(isolation)
  why = backend.probe()
  if why is not None:
    raise RuntimeError(f"isolation {isolation!r} is not available: {why}")
  if not allow_weak:
    raise RuntimeError(f"isolation {isolation!r} is weaker than bubblewrap; start with "
                       f"--allow-weak-isolation to accept that.\n" + WEAK)
  return backend, f"{isolation} isolation was asked for"


def _warn(why: str) -> None:
  banner = ("!" * 78 + f"\nSANDBOX WARNING: {why} (--allow-weak-isolation).\n" + WEAK + "\n"
            "Every result reports isolation='rlimits+uid' or 'rlimits'.\n" + "!" * 78)
  log.warning(banner)
  print(banner, file=sys.stderr, flush=True)
