"""rstar_jax/compile_cache.py: one cache directory shared by processes, as a sweep's
points share it (real processes, real XLA compiles)."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import sys
import jax, jax.numpy as jnp
from rstar_jax import compile_cache
compile_cache.enable(sys.argv[1], min_compile_time_secs=0.0)
jax.config.update("jax_log_compiles", True)   # logs each persistent-cache hit

@jax.jit
def f(x):
  return jnp.tanh(x @ x.T).sum(axis=1)

print("result", f(jnp.arange(16.0).reshape(4, 4) / 16).tolist())
"""


def _start(cache_dir):
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  return subprocess.Popen([sys.executable, "-c", SCRIPT, str(cache_dir)], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc):
  out = proc.communicate(timeout=300)[0]
  assert proc.returncode == 0, out[-3000:]
  return out


def test_processes_share_one_directory_under_jaxs_file_lock(tmp_path):
  cache = tmp_path / "cache"
  # Three processes compile and write the same program at once, then a fourth loads it.
  first = [_finish(p) for p in [_start(cache) for _ in range(3)]]
  later = _finish(_start(cache))
  results = {line for out in first + [later] for line in out.splitlines()
             if line.startswith("result")}
  assert len(results) == 1, results
  assert "Persistent compilation cache hit for 'jit_f'" in later
  entries = sorted(os.listdir(cache))
  assert sum(e.startswith("jit_f-") and e.endswith("-cache") for e in entries) == 1
  # JAX's locked (size-limited) cache: its lock file and the access times it evicts by.
  # Without a size limit JAX writes neither, and reads and writes entries unguarded.
  assert ".lockfile" in entries and any(e.endswith("-atime") for e in entries)
