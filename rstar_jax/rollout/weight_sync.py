"""Trained weights to rollout servers through disk: a versioned HF checkpoint, then
pause -> /update_weights_from_disk -> continue on every server, version confirmed.

The trainer is JAX and SGLang is torch: a HF safetensors checkpoint on storage every
server reads (shared disk on a cluster) is the transport that needs neither torch on
the trainer nor the same host (slime documents the same route for other vendors'
engines). Each version is written under a temporary name and renamed when complete,
so a server never reads half a checkpoint; `hf_io.save_hf` streams the parameters one
tensor (one layer's slice) at a time, so the whole model is never gathered on one
host. In a multi-process job every process calls `publish` and writes its own share
of the tensors into its own safetensors file(s) (`save_hf(parallel=True)`: each
tensor is gathered to its writer alone, and the processes' writes run at the same
time); once every share is on disk, process 0 writes the index and config, renames
the version into place and updates the servers. Old versions are removed, the served
one and `keep - 1` before it kept.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import time
from typing import Any, Sequence

from rstar_jax import distributed
from rstar_jax.model import hf_io

log = logging.getLogger(__name__)

_SAFE = re.compile(r"[^A-Za-z0-9_.=-]+")
_TMP = re.compile(r"\.tmp-\d+$")   # a version being written (by process `pid`)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightSyncConfig:
  """Attributes:
    dir: where versioned checkpoints go (`<dir>/<version>/`); every trainer process
      writes its share there and every rollout server reads it, at the same path (shared
      storage on a cluster). "" = `<workdir>/weight_sync` of the run.
    dtype: the checkpoint's dtype (bfloat16 halves the bytes of float32; servers load
      it in their own dtype).
    keep: versions kept on disk, the served one included (>= 1).
  """
  dir: str = ""
  dtype: str = "bfloat16"
  keep: int = 2

  def __post_init__(self):
    if self.dtype not in ("bfloat16", "float16", "float32"):
      raise ValueError(f"WeightSyncConfig.dtype must be bfloat16, float16 or float32, "
                       f"got {self.dtype!r}")
    if self.keep < 1:
      raise ValueError(f"WeightSyncConfig.keep must be >= 1, got {self.keep}")


def version_dirname(version: str) -> str:
  name = _SAFE.sub("_", str(version)).strip("._")
  if not name:
    raise ValueError(f"weight version {version!r} gives an empty directory name")
  return name


class DiskWeightSync:
  """Publishes policy parameters to HTTP engines: `publish(params, version)`.

  `model` gives the graph (and config) the parameters belong to; `engines` are the
  SGLangEngines to update. `last` holds the figures of the latest sync.
  """

  def __init__(self, cfg: WeightSyncConfig, model, engines: Sequence[Any], directory: str):
    from flax import nnx
    if not directory:
      raise ValueError("DiskWeightSync: no directory (set rollout.weight_sync.dir to storage "
                       "every rollout server reads)")
    self.cfg = cfg
    self.graphdef = nnx.graphdef(model)
    self.engines = list(engines)
    self.directory = os.path.abspath(directory)
    self.published: list[str] = []    # directories written, oldest first
    self.version: str | None = None
    self.last: dict[str, float] = {}
    self._count = 0
    if distributed.is_main():
      self._adopt_earlier_runs()

  def _adopt_earlier_runs(self) -> None:
    """The directory belongs to this run; what an earlier process of it left there (a
    crash, the run resumed here) is cleaned up: checkpoints cut off while written go,
    and its published versions count toward `keep`, oldest first, so that a resumed
    run does not leave a full checkpoint behind per restart."""
    if not os.path.isdir(self.directory):
      return
    entries = [e for e in os.scandir(self.directory) if e.is_dir(follow_symlinks=False)]
    for e in sorted(entries, key=lambda e: e.stat().st_mtime):
      if _TMP.search(e.name):
        shutil.rmtree(e.path, ignore_errors=True)
      else:
        self.published.append(e.path)

  def publish(self, params, version: str | None = None) -> dict[str, float]:
    """Writes `params` as checkpoint `version` and moves every server onto it."""
    from flax import nnx
    self._count += 1
    version = str(version) if version is not None else f"v{self._count}"
    final = os.path.join(self.directory, version_dirname(version))
    # Multi-process: every process writes its share into the temporary directory,
    # process 0 alone renames it and talks to the servers (the name is its own). It is
    # cleared before the others learn its name, so none writes into it first.
    t0 = time.perf_counter()

    def prepare() -> str:
      tmp = f"{final}.tmp-{os.getpid()}"
      shutil.rmtree(tmp, ignore_errors=True)    # a crashed earlier attempt
      os.makedirs(self.directory, exist_ok=True)
      return tmp
    # on_main: a directory process 0 cannot make raises on every process (none waits).
    tmp = distributed.on_main(prepare, f"weight sync {version}: {self.directory}")
    model = nnx.merge(self.graphdef, params)
    hf_io.save_hf(model, tmp, dtype=self.cfg.dtype, parallel=True)
    self.last = distributed.on_main(lambda: self._serve(tmp, final, version, t0),
                                    f"weight sync {version}")
    self.version = version
    return self.last

  def _serve(self, tmp: str, final: str, version: str, t0: float) -> dict[str, float]:
    """Process 0: the written checkpoint into place, then every server onto it."""
    from rstar_jax.rollout.sglang import engine as sglang_engine
    nbytes = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
    if os.path.exists(final):                 # the same version again (a resumed run)
      shutil.rmtree(final)
    os.replace(tmp, final)
    # Counted before the servers are asked: a failed update must not leave it behind.
    if final in self.published:
      self.published.remove(final)
    self.published.append(final)
    t1 = time.perf_counter()
    per_server = sglang_engine.update_weights_from_disk(self.engines, final, version)
    t2 = time.perf_counter()
    while len(self.published) > self.cfg.keep:
      shutil.rmtree(self.published.pop(0), ignore_errors=True)
    gb = nbytes / 1e9
    last = {"sync/write_s": t1 - t0, "sync/update_s": t2 - t1, "sync/total_s": t2 - t0,
            "sync/gb": gb, "sync/servers": float(len(per_server))}
    if gb:   # a rate over nothing is missing, not 0 (rollout/stats.py)
      last["sync/s_per_gb"] = (t2 - t0) / gb
    log.info("weight sync %s: %.3f GB written in %.2f s, %d server(s) updated in %.2f s",
             version, gb, t1 - t0, len(per_server), t2 - t1)
    return last
