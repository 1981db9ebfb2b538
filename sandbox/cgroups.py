"""Memory cgroups for the calls: one per call slot inside one for the whole sandbox.

Layout (created by the server, as root, under its own cgroup):

    <base>/sandbox-<server pid>-<random>/
        w/                                     the warm parent (and bwrap): no limit
        calls/                                 memory limit: the budget of all calls
            c<slot>/                           one call at a time; limit: one call's memory

The warm parent stays outside the budget on purpose: its pages (the interpreter's
and the preloaded libraries' files) would otherwise be what the kernel reclaims when
the calls reach the budget, and every call would slow to a crawl re-reading them
(thrashing) instead of the largest call being OOM-killed.

The children join their slot's cgroup themselves (they write 0 to its
`cgroup.procs` while still root). All processes of a call, and the pages of its
private /tmp and /dev/shm, are charged there: past the limit the kernel's OOM
killer kills inside that cgroup only, and the server (outside) is never a
candidate. cgroup v2 needs the memory controller enabled for our cgroup's
children (delegation: our cgroup is the namespace root, or a systemd scope with
Delegate=yes); cgroup v1 needs a writable memory hierarchy. Where neither works
the executor falls back to admission control (see ExecutorConfig.memory_budget_mb).
"""
from __future__ import annotations

import logging
import os
import secrets
import signal
import time

log = logging.getLogger("sandbox")

_PREFIX = "sandbox-"


def _mounts() -> list[tuple[str, str, str]]:
  """(mount point, fs type, super options) of every mount, from /proc/self/mountinfo."""
  out = []
  with open("/proc/self/mountinfo") as f:
    for line in f:
      left, _, right = line.partition(" - ")
      fields, rfields = left.split(), right.split()
      if len(fields) >= 5 and len(rfields) >= 3:
        out.append((fields[4].replace("\\040", " "), rfields[0], rfields[2]))
  return out


def _own_path(want: str) -> str | None:
  """Our cgroup path in the hierarchy holding controller `want` ('' for v2)."""
  with open("/proc/self/cgroup") as f:
    for line in f:
      _, controllers, path = line.rstrip("\n").split(":", 2)
      if (want == "" and controllers == "") or want in controllers.split(","):
        return path
  return None


def _write(path: str, value: str) -> None:
  with open(path, "w") as f:
    f.write(value)


def _read(path: str) -> str:
  with open(path) as f:
    return f.read()


class MemoryCgroups:
  """The sandbox's cgroup tree; `create()` returns None (and why) where it cannot exist."""

  def __init__(self, version: int, base: str):
    self.version = version
    self.base = base  # our own cgroup (the parent of the sandbox's)
    self.top = os.path.join(base, f"{_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
    self.limit_file = "memory.max" if version == 2 else "memory.limit_in_bytes"
    self.events_file = "memory.events" if version == 2 else "memory.oom_control"

  # -- discovery --------------------------------------------------------------
  @classmethod
  def create(cls, total_bytes: int, per_call_bytes: int, n_slots: int) -> tuple["MemoryCgroups | None", str]:
    """The tree with its limits set, or (None, why not)."""
    if os.geteuid() != 0:
      return None, "not root"
    reasons = []
    for version in (2, 1):
      try:
        base = cls._base(version)
      except OSError as e:
        reasons.append(f"cgroup v{version}: {e}")
        continue
      if isinstance(base, str) and base.startswith("/"):
        cg = cls(version, base)
        try:
          cg._make(total_bytes, per_call_bytes, n_slots)
          return cg, ""
        except OSError as e:
          cg.remove()
          reasons.append(f"cgroup v{version} at {base}: {e}")
      else:
        reasons.append(f"cgroup v{version}: {base}")
    return None, "; ".join(reasons)

  @staticmethod
  def _base(version: int) -> str:
    """Our cgroup directory in a hierarchy with the memory controller, or why none."""
    mounts = _mounts()
    if version == 2:
      points = [m for m, fs, _ in mounts if fs == "cgroup2"]
      if not points:
        return "no cgroup2 mount"
      own = _own_path("")
      if own is None:
        return "not in a cgroup2 hierarchy"
      base = os.path.join(points[0], own.lstrip("/"))
      if "memory" not in _read(os.path.join(base, "cgroup.controllers")).split():
        return f"the memory controller is not delegated to {base}"
      if "memory" not in _read(os.path.join(base, "cgroup.subtree_control")).split():
        # Fails with EBUSY when our cgroup holds processes and is not the root
        # (cgroup v2's no-internal-processes rule): then it is not delegated to us.
        _write(os.path.join(base, "cgroup.subtree_control"), "+memory")
      return base
    points = [m for m, fs, opts in mounts if fs == "cgroup" and "memory" in opts.split(",")]
    if not points:
      return "no cgroup v1 memory hierarchy mounted"
    own = _own_path("memory")
    if own is None:
      return "not in the memory hierarchy"
    base = os.path.join(points[0], own.lstrip("/"))
    if not os.access(base, os.W_OK):
      return f"{base} is not writable"
    return base

  def _make(self, total_bytes: int, per_call_bytes: int, n_slots: int) -> None:
    os.mkdir(self.top)
    calls = os.path.join(self.top, "calls")
    if self.version == 2:
      _write(os.path.join(self.top, "cgroup.subtree_control"), "+memory")
    os.mkdir(os.path.join(self.top, "w"))
    os.mkdir(calls)
    _write(os.path.join(calls, self.limit_file), str(total_bytes))
    if self.version == 2:
      _write(os.path.join(calls, "cgroup.subtree_control"), "+memory")
      try:  # no swap for calls, where swap exists
        _write(os.path.join(calls, "memory.swap.max"), "0")
      except OSError:
        pass
    for name in [f"c{i}" for i in range(n_slots)]:
      path = os.path.join(calls, name)
      os.mkdir(path)
      _write(os.path.join(path, self.limit_file), str(per_call_bytes))
      if self.version == 1:
        try:  # memory + swap: the same limit (only where swap accounting is on)
          _write(os.path.join(path, "memory.memsw.limit_in_bytes"), str(per_call_bytes))
        except OSError:
          pass

  # -- use --------------------------------------------------------------------
  def slot_dir(self, slot: int) -> str:
    return os.path.join(self.top, "calls", f"c{slot}")

  def worker_procs(self) -> str:
    """The file the warm parent's launcher writes its pid to."""
    return os.path.join(self.top, "w", "cgroup.procs")

  def remove(self) -> None:
    """Kills whatever is left in the tree and removes it."""
    _remove_tree(self.top)

  @classmethod
  def sweep_stale(cls) -> int:
    """Removes the trees of sandbox servers that are gone, killing what they left running.

    A server killed by SIGKILL cannot clean up: a call's daemon would survive in
    its cgroup. The next server on the host finds and ends it here.
    """
    n = 0
    for version in (2, 1):
      try:
        base = cls._base(version)
      except OSError:
        continue
      if not base.startswith("/"):
        continue
      try:
        names = os.listdir(base)
      except OSError:
        continue
      for name in names:
        if not name.startswith(_PREFIX):
          continue
        try:
          pid = int(name[len(_PREFIX):].split("-")[0])
        except ValueError:
          continue
        if pid != os.getpid() and _alive(pid):
          continue
        _remove_tree(os.path.join(base, name))
        n += 1
    return n


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _remove_tree(top: str) -> None:
  if not os.path.isdir(top):
    return
  for attempt in range(50):
    left = 0
    for dirpath, dirnames, _ in os.walk(top, topdown=False):
      try:
        pids = _read(os.path.join(dirpath, "cgroup.procs")).split()
      except OSError:
        pids = []
      for p in pids:
        try:
          os.kill(int(p), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
          pass
      try:
        os.rmdir(dirpath)
      except OSError:
        left += 1
    if not left:
      return
    time.sleep(0.02 * (attempt + 1))  # killed processes take a moment to leave
  log.warning("could not remove cgroup %s (processes still in it?)", top)


def oom_kills(slot_dir: str, version: int) -> int:
  """How many processes the kernel's OOM killer has killed in this cgroup so far."""
  name = "memory.events" if version == 2 else "memory.oom_control"
  try:
    for line in _read(os.path.join(slot_dir, name)).splitlines():
      key, _, value = line.partition(" ")
      if key == "oom_kill":
        return int(value)
  except (OSError, ValueError):
    pass
  return 0


def host_memory_bytes() -> int:
  """The host's memory, or our own cgroup's limit when that is lower."""
  total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  for version, fname in ((2, "memory.max"), (1, "memory.limit_in_bytes")):
    try:
      base = MemoryCgroups._base(version) if version == 1 else None
      if version == 2:
        points = [m for m, fs, _ in _mounts() if fs == "cgroup2"]
        own = _own_path("")
        base = os.path.join(points[0], own.lstrip("/")) if points and own else None
      if base and base.startswith("/"):
        value = _read(os.path.join(base, fname)).strip()
        if value.isdigit():
          total = min(total, int(value))
    except OSError:
      continue
  return total
