"""JAX's persistent compilation cache, set up so that several processes can share it."""
import os

# Far above what a run writes (the toy recipe: ~3 MB); set only so that JAX guards the
# cache with its file lock (see `enable`).
MAX_BYTES = 16 << 30
# JAX's file names in the cache directory (jax/_src/lru_cache.py).
_ENTRY, _ATIME, _LOCK = "-cache", "-atime", ".lockfile"


def enable(path: str, min_compile_time_secs: float = 0.5) -> None:
  """Keeps compiled programs in `path` and loads them from there.

  Every recipe stage builds fresh jitted functions (new trainer, new engine) with the
  same shapes as the stage before; with the cache they load in milliseconds instead of
  compiling again, and a resumed or repeated run compiles nothing it compiled before.

  Several processes on one machine may use one directory at once (a sweep's points,
  rollout servers started together): with a size limit set, JAX reads, writes and
  evicts each entry under a file lock. Without one (JAX's default: no eviction) it
  writes entries in place, and a process loading a program while another writes it
  could read half a file. (Hosts of different CPU types should not share a directory:
  on CPU the cache key does not name the instruction set a program was built for.)

  Takes effect for the next compile even if this process has compiled before (JAX
  otherwise fixes its cache at the first compile).
  """
  import filelock  # JAX's lock; without it JAX would only warn and run uncached
  import jax
  from jax.experimental.compilation_cache import compilation_cache

  # JAX puts a directory under this path into every program's compile options (XLA's
  # GPU autotune cache), so the path's text is part of each cache key: a directory
  # reached through a symlink would miss every entry written under its real name.
  path = os.path.realpath(path)
  os.makedirs(path, exist_ok=True)
  with filelock.FileLock(os.path.join(path, _LOCK)):
    _drop_unfinished_entries(path)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_time_secs)
  jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
  compilation_cache.reset_cache()


def _drop_unfinished_entries(path: str) -> None:
  """Removes entries without an access-time file (called under the cache's lock).

  JAX writes an entry, then its access time. An entry without one was cut off by a
  killed process (possibly half written: JAX would fail to load it on every read and
  never replace it) or written without the lock (a directory from before this module).
  JAX's eviction reads every entry's access time on each write and, missing one, fails
  that write: the directory would take no new program. Dropped, it is compiled again.
  """
  names = set(os.listdir(path))
  for name in names:
    if name.endswith(_ENTRY) and name[:-len(_ENTRY)] + _ATIME not in names:
      try:
        os.remove(os.path.join(path, name))
      except FileNotFoundError:
        pass
