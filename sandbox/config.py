"""Executor configuration: limits, pool sizes, isolation choice."""
from __future__ import annotations

import dataclasses

# Imported by the warm parent before it forks anything. The lazily imported
# ones (secrets, numpy.random, scipy submodules) are listed explicitly because a
# child may not be able to read the interpreter's files once it has dropped its uid.
DEFAULT_PRELOAD = (
    "abc", "array", "ast", "bisect", "cmath", "collections", "collections.abc", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "enum", "fractions", "functools",
    "hashlib", "heapq", "io", "itertools", "json", "math", "numbers", "operator", "pprint",
    "random", "re", "secrets", "statistics", "string", "struct", "subprocess", "textwrap",
    "threading", "time", "traceback", "typing", "unicodedata", "ctypes", "socket", "tempfile",
    "encodings.idna",
    "numpy", "numpy.random", "numpy.linalg", "numpy.fft", "numpy.polynomial",
    "sympy", "sympy.abc", "mpmath",
    "scipy", "scipy.special", "scipy.optimize", "scipy.integrate", "scipy.linalg",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExecutorConfig:
  """Limits and sizes of one executor (one server process).

  max_children: calls running at once; more queue (admission control).
  isolation: 'auto' (bwrap if it works, else rlimits with a loud warning),
    'bwrap' (fail if unavailable) or 'rlimits'.
  """
  max_children: int = 32
  pool_size: int = 2              # children forked ahead of demand
  default_timeout: float = 10.0
  max_timeout: float = 300.0
  memory_mb: int = 2048           # RLIMIT_AS per call
  max_output_bytes: int = 64 * 1024  # per stream (stdout, stderr)
  max_code_bytes: int = 1 << 20
  max_input_bytes: int = 16 << 20
  max_file_mb: int = 64           # RLIMIT_FSIZE
  max_open_files: int = 256       # RLIMIT_NOFILE
  max_processes: int = 64         # RLIMIT_NPROC, per call (each call has its own uid)
  tmpfs_mb: int = 64              # size of the warm parent's own /tmp inside bwrap
  # Every call gets its own /tmp and /dev/shm (tmpfs in its own mount namespace, where
  # the host allows: as root), gone when the call ends; past its quota a write fails
  # with ENOSPC and no other call notices.
  tmp_mb: int = 128
  shm_mb: int = 64
  # The memory of all running calls together: at most budget // per_call_mb calls run
  # at once (admission control). Where memory cgroups can be created (cgroup v2 with
  # the memory controller delegated, or cgroup v1's memory hierarchy) each call also
  # gets a cgroup limited to per_call_mb (all its processes and its tmpfs files);
  # otherwise only RLIMIT_AS per process and the tmpfs quotas bound a call.
  # 0: 75% of the host's memory (or of the server's own cgroup limit, if lower).
  memory_budget_mb: int = 0
  cgroups: str = "auto"           # "auto" (use them when possible) or "off"
  # HTTP: request bodies above this are refused (413); a client must send a request's
  # headers and body within client_timeout seconds (408 or a closed connection).
  max_body_mb: int = 32
  max_batch: int = 1024
  client_timeout: float = 30.0
  # Exactly-once: results of calls with ids are kept this long (and up to this many MB)
  # so that a retried id gets the stored result instead of a second run.
  result_ttl: float = 900.0
  result_cache_mb: int = 256
  # Without bubblewrap the server refuses to start unless this is set (see README).
  allow_weak_isolation: bool = False
  # Children run at niceness `nice` (absolute); the server and the warm parent at
  # `supervisor_nice` (applied only when running as root). The children share the
  # warm parent's scheduling autogroup (its session), where only these two weigh:
  # at -5 vs +19 the warm parent keeps ~87% of the group's CPU against 32 spinners
  # (at +5: ~24%, and timeout lateness p99 went from 27 to 117 ms on a loaded host).
  # Across autogroups (other sessions, other users) niceness does not count.
  nice: int = 19
  supervisor_nice: int = -5
  isolation: str = "auto"
  max_sessions: int = 128
  session_ttl: float = 600.0      # idle seconds before a session is closed
  preload: tuple[str, ...] = DEFAULT_PRELOAD
  # Seconds for the warm parent to import everything at start, and the longest a call
  # may wait for a child to take it (it then fails unrun as internal_error).
  start_timeout: float = 120.0

  def __post_init__(self):
    def positive(name, value):
      if value <= 0:
        raise ValueError(f"ExecutorConfig.{name} must be > 0, got {value!r}")
    for name in ("max_children", "default_timeout", "max_timeout", "memory_mb", "max_output_bytes",
                 "max_code_bytes", "max_input_bytes", "max_file_mb", "max_open_files",
                 "max_processes", "tmpfs_mb", "tmp_mb", "shm_mb", "max_sessions", "session_ttl",
                 "start_timeout", "max_body_mb", "max_batch", "client_timeout", "result_ttl",
                 "result_cache_mb"):
      positive(name, getattr(self, name))
    if self.pool_size < 0:
      raise ValueError(f"ExecutorConfig.pool_size must be >= 0, got {self.pool_size}")
    if self.default_timeout > self.max_timeout:
      raise ValueError(f"ExecutorConfig.default_timeout ({self.default_timeout}) exceeds "
                       f"max_timeout ({self.max_timeout})")
    if not 0 <= self.nice <= 19:
      raise ValueError(f"ExecutorConfig.nice must be in [0, 19], got {self.nice}")
    if not -20 <= self.supervisor_nice < self.nice:
      raise ValueError(f"ExecutorConfig.supervisor_nice must be in [-20, nice={self.nice}), "
                       f"got {self.supervisor_nice}")
    if self.isolation not in ("auto", "bwrap", "rlimits"):
      raise ValueError(f"ExecutorConfig.isolation must be 'auto', 'bwrap' or 'rlimits', "
                       f"got {self.isolation!r}")
    if self.memory_budget_mb < 0:
      raise ValueError(f"ExecutorConfig.memory_budget_mb must be >= 0 (0: automatic), "
                       f"got {self.memory_budget_mb}")
    if self.memory_budget_mb and self.memory_budget_mb < self.per_call_mb:
      raise ValueError(f"ExecutorConfig.memory_budget_mb ({self.memory_budget_mb}) is below one "
                       f"call's memory (memory_mb + tmp_mb + shm_mb = {self.per_call_mb})")
    if self.cgroups not in ("auto", "off"):
      raise ValueError(f"ExecutorConfig.cgroups must be 'auto' or 'off', got {self.cgroups!r}")
    if self.memory_mb < 512:
      # The warm parent alone maps ~300 MB (numpy, sympy, scipy); less would fail every call.
      raise ValueError(f"ExecutorConfig.memory_mb must be >= 512, got {self.memory_mb}")

  @property
  def per_call_mb(self) -> int:
    """What one call may hold: its processes' memory plus its /tmp and /dev/shm files."""
    return self.memory_mb + self.tmp_mb + self.shm_mb
