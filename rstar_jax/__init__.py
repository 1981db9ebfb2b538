"""rstar_jax: rStar2-Agent (agentic RL with a Python tool) in JAX/Flax NNX."""
import logging as _logging


class _StartupNoise(_logging.Filter):
  """Drops jax's INFO lines that greet every run and say nothing about it.

  With JAX_PLATFORMS unset, jax probes every platform it knows, TPU included, and logs
  "Unable to initialize backend 'tpu': ... libtpu.so ..." at INFO when libtpu is not
  installed (every CPU and GPU host); absl's entry points print INFO. Only that probe
  line is dropped: the platform choice stays jax's (a GPU host still gets its GPU), a
  TPU host whose libtpu is installed but fails still says so, and a platform named in
  JAX_PLATFORMS that fails still raises. Likewise "Resetting cache at <empty>", logged
  when the compile cache is pointed at its directory (rstar_jax/compile_cache.py)."""

  def filter(self, record: _logging.LogRecord) -> bool:
    if record.levelno > _logging.INFO:
      return True
    msg = record.getMessage()
    if msg.startswith("Unable to initialize backend 'tpu'") and "libtpu" in msg and (
        "cannot open shared object file" in msg or "Failed to open libtpu" in msg):
      return False
    return not msg.startswith("Resetting cache at")


_logging.getLogger("jax._src.xla_bridge").addFilter(_StartupNoise())
_logging.getLogger("jax._src.compilation_cache").addFilter(_StartupNoise())
