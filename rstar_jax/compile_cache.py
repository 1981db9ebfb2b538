"""JAX's persistent compilation cache, set up so that several processes can share it."""

# Far above what a run writes (the toy recipe: ~3 MB); set only so that JAX guards the
# cache with its file lock (see `enable`).
MAX_BYTES = 16 << 30


def enable(path: str, min_compile_time_secs: float = 0.5) -> None:
  """Keeps compiled programs in `path` and loads them from there.

  Every recipe stage builds fresh jitted functions (new trainer, new engine) with the
  same shapes as the stage before; with the cache they load in milliseconds instead of
  compiling again, and a resumed or repeated run compiles nothing it compiled before.

  Several processes may use one directory at once (a sweep's points, rollout servers
  started together, the processes of a multi-host job): with a size limit set, JAX
  reads and writes each entry under a file lock. Without one (JAX's default: no
  eviction) it writes entries in place, and a process loading a program while another
  writes it could read half a file.
  """
  import jax
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_time_secs)
  jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
