r"""python -m experiments.benchmarks.bench_publish [--layers 8 --hidden 1024 --repeats 3]

GB/s of the weight sync's export (`DiskWeightSync.publish`: bfloat16 HF safetensors into
a new version directory, renamed into place) from 1 and from 2 real JAX processes on
this host, against the disk's sequential write bandwidth measured in the same run.

  * disk rows: the same number of bytes as the export, in 64 MiB `write`s of a buffer
    already in memory, by 1 and by 2 writers at once (threads, one file each), with and
    without `fsync` before the clock stops; measured once after each job (3 runs). The publish does not fsync (readers see the
    page cache on one host, and close-to-open on shared storage), so the row without
    fsync is its bound where the bytes fit in memory, the fsync rows where they do not.
  * publish, 1 process x 2 CPU devices (fsdp 2): one process converts and writes all.
  * publish, 2 processes x 1 CPU device (fsdp 2 across them, loopback gloo): each
    writes its share of the tensors into its own file, gathered to it alone.
  * save_hf default, 2 processes: the export before the parallel one (every tensor
    gathered to every process, process 0 writes every byte).

Each row: one warm-up (compiles), then --repeats timed runs, median. The model is a
random Qwen3 of float32 parameters (--vocab/--hidden/--layers/... ; the defaults give
~170 M parameters, ~0.33 GB in bfloat16). The machine may be shared: the load average
is printed and stored with the figures. Everything goes to --out as JSON. Not a test:
nothing here is asserted.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from experiments.common import results_json  # noqa: E402

flags.DEFINE_integer("layers", 8, "decoder layers")
flags.DEFINE_integer("hidden", 1024, "hidden size")
flags.DEFINE_integer("intermediate", 3072, "MLP intermediate size")
flags.DEFINE_integer("heads", 16, "query heads (head_dim = hidden / heads)")
flags.DEFINE_integer("kv_heads", 8, "KV heads")
flags.DEFINE_integer("vocab", 32_000, "vocabulary size")
flags.DEFINE_integer("repeats", 3, "timed runs per row (after one warm-up)", lower_bound=1)
flags.DEFINE_string("dir", "", "where the files go (a fresh temporary directory if empty; "
                    "put it on the storage to measure)")
flags.DEFINE_string("out", "", "JSON path (default experiments/results/publish/"
                    "<date>_<commit>.json)")
# A worker process of the run (the benchmark starts these itself).
flags.DEFINE_integer("worker_processes", 0, "internal: this is a worker of a job of N")
flags.DEFINE_integer("worker_id", 0, "internal")
flags.DEFINE_integer("worker_port", 0, "internal")
flags.DEFINE_string("worker_mode", "publish", "internal: publish | serial")
flags.DEFINE_string("worker_result", "", "internal")
FLAGS = flags.FLAGS

CHUNK = 64 << 20


def _model_cfg():
  from rstar_jax.model.model_config import Qwen3Config
  return Qwen3Config(vocab_size=FLAGS.vocab, hidden_size=FLAGS.hidden,
                     intermediate_size=FLAGS.intermediate, num_hidden_layers=FLAGS.layers,
                     num_attention_heads=FLAGS.heads, num_key_value_heads=FLAGS.kv_heads,
                     head_dim=FLAGS.hidden // FLAGS.heads)


def worker() -> None:
  """One process of a timed job: the model on an fsdp mesh over every device of the
  job, then warm-up + repeats of the export; process 0 writes the times."""
  from rstar_jax import distributed
  n = FLAGS.worker_processes
  if n > 1:
    distributed.initialize(distributed.DistributedConfig(
        coordinator_address=f"127.0.0.1:{FLAGS.worker_port}", num_processes=n,
        process_id=FLAGS.worker_id, initialization_timeout_s=600))
  import jax
  import numpy as np
  from flax import nnx

  from rstar_jax import sharding
  from rstar_jax.model import hf_io, qwen3
  from rstar_jax.rollout import weight_sync

  mesh = sharding.make_mesh({"fsdp": -1})
  model = qwen3.create_model(_model_cfg(), seed=0)   # the same values on every process
  graphdef, state = nnx.split(model)
  del model
  shardings = sharding.state_shardings(state, mesh)

  def place(var, sh):
    host = np.asarray(var.get_value())
    return var.replace(jax.make_array_from_callback(host.shape, sh.get_value(),
                                                    lambda idx: host[idx]))
  state = jax.tree_util.tree_map(place, state, shardings,
                                 is_leaf=lambda x: isinstance(x, nnx.Variable))
  model = nnx.merge(graphdef, state)
  root = FLAGS.dir
  times, nbytes = [], 0
  sync = weight_sync.DiskWeightSync(weight_sync.WeightSyncConfig(keep=1), model, [],
                                    os.path.join(root, "sync"))
  for k in range(FLAGS.repeats + 1):
    distributed.barrier(f"bench_publish {k}")
    t0 = time.perf_counter()
    if FLAGS.worker_mode == "publish":
      sync.publish(state, f"r{k}")
      where = sync.published[-1] if distributed.is_main() else ""
    else:
      where = os.path.join(root, f"serial_{k}")
      hf_io.save_hf(model, where, dtype="bfloat16")
    elapsed = time.perf_counter() - t0
    if distributed.is_main():
      nbytes = sum(os.path.getsize(os.path.join(where, f)) for f in os.listdir(where))
      if FLAGS.worker_mode != "publish":
        shutil.rmtree(where)
    if k:   # the first run compiles
      times.append(elapsed)
  distributed.barrier("bench_publish done")
  if distributed.is_main():
    with open(FLAGS.worker_result, "w") as f:
      json.dump({"times_s": times, "bytes": nbytes}, f)


def _job(processes: int, mode: str, root: str) -> dict:
  from sandbox.launcher import free_port
  result = os.path.join(root, f"job_{processes}_{mode}.json")
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={2 // processes}")
  env.pop("JAX_COORDINATOR_ADDRESS", None)
  keep = ["--layers", "--hidden", "--intermediate", "--heads", "--kv_heads", "--vocab",
          "--repeats"]
  args = [f"{k}={getattr(FLAGS, k[2:])}" for k in keep]
  port = free_port()
  procs = [subprocess.Popen(
      [sys.executable, "-m", "experiments.benchmarks.bench_publish", *args, f"--dir={root}",
       f"--worker_processes={processes}", f"--worker_id={i}", f"--worker_port={port}",
       f"--worker_mode={mode}", f"--worker_result={result}"],
      cwd=REPO, env=env)
      for i in range(processes)]
  codes = [p.wait() for p in procs]
  if any(codes):
    raise SystemExit(f"bench_publish: a {processes}-process {mode} job failed: exit {codes}")
  with open(result) as f:
    return json.load(f)


def _disk(root: str, nbytes: int, writers: int, fsync: bool) -> float:
  """Seconds to write `nbytes` split over `writers` files at once (+ fsync)."""
  buf = memoryview(os.urandom(min(CHUNK, max(nbytes, 1))))
  per = nbytes // writers
  paths = [os.path.join(root, f"disk_{i}.bin") for i in range(writers)]

  def write(path):
    with open(path, "wb", buffering=0) as f:
      left = per
      while left > 0:
        left -= f.write(buf[:min(left, len(buf))])
      if fsync:
        os.fsync(f.fileno())

  threads = [threading.Thread(target=write, args=(p,)) for p in paths]
  t0 = time.perf_counter()
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  elapsed = time.perf_counter() - t0
  for p in paths:
    os.remove(p)
  return elapsed


def main(_):
  if FLAGS.worker_processes:
    return worker()
  root = FLAGS.dir or tempfile.mkdtemp(prefix="bench_publish_")
  os.makedirs(root, exist_ok=True)
  load_before = os.getloadavg()
  stamp = results_json.stamp()
  disk_cases = ((1, False), (1, True), (2, True))
  disk_times = {case: [] for case in disk_cases}

  def measure_disk():   # after every job, so that the host's load hits both kinds of row
    for case in disk_cases:
      disk_times[case].append(_disk(root, nbytes, *case))

  one = _job(1, "publish", root)
  nbytes = one["bytes"]
  measure_disk()
  two = _job(2, "publish", root)
  measure_disk()
  serial = _job(2, "serial", root)
  measure_disk()
  rows = [{"row": f"disk write, {writers} writer(s)" + (" + fsync" if fsync else ""),
           "processes": writers, "times_s": disk_times[(writers, fsync)]}
          for writers, fsync in disk_cases]
  rows.append({"row": "publish, 1 process", "processes": 1, "times_s": one["times_s"]})
  rows.append({"row": "publish, 2 processes (each writes its share)", "processes": 2,
               "times_s": two["times_s"]})
  rows.append({"row": "save_hf default, 2 processes (process 0 writes all)", "processes": 2,
               "times_s": serial["times_s"]})
  disk_ref = statistics.median(rows[1]["times_s"])   # 1 writer + fsync
  gb = nbytes / 1e9
  print(f"\n{gb:.3f} GB per export (bfloat16), {FLAGS.repeats} timed runs per export row, "
        f"3 per disk row, median")
  print(f"{'':52s} {'s':>7s} {'GB/s':>7s} {'vs disk+fsync':>14s}")
  for r in rows:
    r["median_s"] = statistics.median(r["times_s"])
    r["gb_per_s"] = gb / r["median_s"]
    r["vs_disk_fsync"] = disk_ref / r["median_s"]
    print(f"{r['row']:52s} {r['median_s']:7.2f} {r['gb_per_s']:7.3f} "
          f"{r['vs_disk_fsync']:13.2f}x")
  load_after = os.getloadavg()
  print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} "
        f"({os.cpu_count()} cores)")
  result = {**stamp, "load_avg_before": load_before, "load_avg_after": load_after,
            "bytes": nbytes, "repeats": FLAGS.repeats, "dir": root,
            "model": {k: getattr(FLAGS, k) for k in ("layers", "hidden", "intermediate",
                                                    "heads", "kv_heads", "vocab")},
            "rows": rows}
  out = FLAGS.out or os.path.join(
      REPO, "experiments", "results", "publish",
      f"{stamp['date'][:10]}_{stamp['commit']}.json")
  results_json.write(out, result)
  if not FLAGS.dir:
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
