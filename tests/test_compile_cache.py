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
if "early" in sys.argv[2:]:   # an earlier run in this process used another directory
  compile_cache.enable(sys.argv[1] + "_earlier", min_compile_time_secs=0.0)
  print("early", jax.jit(lambda x: x + 1)(1.0))
compile_cache.enable(sys.argv[1], min_compile_time_secs=0.0)
jax.config.update("jax_log_compiles", True)   # logs each persistent-cache hit

@jax.jit
def f(x):
  return jnp.tanh(x @ x.T).sum(axis=1)

print("result", f(jnp.arange(16.0).reshape(4, 4) / 16).tolist())
"""


def _start(cache_dir, *args):
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  return subprocess.Popen([sys.executable, "-c", SCRIPT, str(cache_dir), *args], cwd=REPO,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc):
  try:
    out = proc.communicate()[0]   # no timeout: pytest-timeout ends a hang
  finally:
    proc.kill()                   # on the way out of a hang; nothing once it has exited
  assert proc.returncode == 0, out[-3000:]
  # JAX turns a failed cache read or write into a warning and goes on uncached.
  assert "persistent compilation cache entry" not in out, out[-3000:]
  return out


def _entries(cache, name="jit_f"):
  return [e for e in os.listdir(cache) if e.startswith(name + "-") and e.endswith("-cache")]


def test_processes_share_one_directory_under_jaxs_file_lock(tmp_path):
  cache = tmp_path / "cache"
  # Three processes compile and write the same program at once, then a fourth loads it.
  first = [_finish(p) for p in [_start(cache) for _ in range(3)]]
  later = _finish(_start(cache))
  results = {line for out in first + [later] for line in out.splitlines()
             if line.startswith("result")}
  assert len(results) == 1, results
  assert "Persistent compilation cache hit for 'jit_f'" in later
  assert len(_entries(cache)) == 1
  # JAX's locked (size-limited) cache: its lock file and the access times it evicts by.
  # Without a size limit JAX writes neither, and reads and writes entries unguarded.
  entries = os.listdir(cache)
  assert ".lockfile" in entries and any(e.endswith("-atime") for e in entries)


def test_unfinished_entries_are_dropped_and_a_late_enable_still_counts(tmp_path):
  cache = tmp_path / "cache"
  cache.mkdir()
  # An entry cut off by a killed writer (no access time, half its bytes): JAX would fail
  # to read it, never replace it, and fail every later write on its missing access time.
  (cache / "jit_g-0123abcd-cache").write_bytes(b"\x28\xb5\x2f\xfd half an executable")
  out = _finish(_start(cache, "early"))
  assert "early 2.0" in out
  assert not (cache / "jit_g-0123abcd-cache").exists()
  assert len(_entries(cache)) == 1      # here, not in the directory of the earlier compile
  assert not _entries(str(cache) + "_earlier")
  assert "Persistent compilation cache hit for 'jit_f'" in _finish(_start(cache, "early"))


def test_a_directory_reached_through_a_symlink_hits_what_its_real_name_wrote(tmp_path):
  """JAX puts a path under the cache directory into every program's compile options,
  so the key depends on the path's text: a workdir whose cache was a symlink to a
  warm one compiled everything again (and wrote a second entry per program)."""
  cache = tmp_path / "cache"
  _finish(_start(cache))
  link = tmp_path / "elsewhere" / "compile_cache"
  link.parent.mkdir()
  link.symlink_to(cache)
  later = _finish(_start(link))
  assert "Persistent compilation cache hit for 'jit_f'" in later
  assert len(_entries(cache)) == 1
