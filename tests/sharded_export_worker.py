"""One process of tests/test_sharded_export.py (and experiments/benchmarks/bench_publish.py's
layout): a Qwen3 loaded onto the (data 2, fsdp 2, tensor 2) mesh over every device of
the job, then exported by every process at once.

  python tests/sharded_export_worker.py --out DIR --hf_dir REF [--num_processes 2
      --process_id I --port P] [--server URL] [--compile_cache DIR]

Writes into DIR, per process I:
  * gather_I.npz / gather_I.json: `distributed.gather_to` of arrays of known value
    under several shardings, to every process in turn (what each process got back);
  * hf_f32/: `save_hf(parallel=True)` in float32, small shards (several per process);
  * hf_serial/: `save_hf` without parallel (process 0 writes), in float32;
  * sync/step-7/: `DiskWeightSync.publish` in bfloat16, which updates the rollout
    server at --server (process 0 talks to it);
  * opened_I.json: every file this process opened for writing during the exports, as
    Python's own audit hook saw it (not what the export says it did), and what each
    process raised when the last one's writes failed (hf_fail/).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GATHER_CASES = {   # name -> (shape, dtype, partition spec over the mesh axes)
    "across_all": ((16, 6), "float32", (("data", "fsdp", "tensor"), None)),
    "across_processes": ((4, 10), "float32", (None, "data")),
    "within_process": ((6, 4), "float32", ("fsdp", "tensor")),
    "replicated": ((3, 5), "float32", ()),
    "bf16_2d": ((8, 4), "bfloat16", ("data", "tensor")),
}


def case_value(name):
  import ml_dtypes
  import numpy as np
  shape, dtype, _ = GATHER_CASES[name]
  value = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) * 0.25 - 3
  return value.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)


def _wait_healthy(url: str) -> None:
  """Until the server (started beside this job) answers /health; no deadline of its own
  (the test's timeout ends a hang)."""
  import time
  import urllib.request
  while True:
    try:
      with urllib.request.urlopen(url + "/health", timeout=5) as r:
        if r.status == 200:
          return
    except OSError:
      pass
    time.sleep(0.2)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", required=True)
  ap.add_argument("--hf_dir", required=True)
  ap.add_argument("--num_processes", type=int, default=1)
  ap.add_argument("--process_id", type=int, default=0)
  ap.add_argument("--port", type=int, default=0)
  ap.add_argument("--server", default="")
  ap.add_argument("--compile_cache", default="")
  a = ap.parse_args()
  if a.compile_cache:
    from rstar_jax import compile_cache
    compile_cache.enable(a.compile_cache)
  from rstar_jax import distributed
  if a.num_processes > 1:
    distributed.initialize(distributed.DistributedConfig(
        coordinator_address=f"127.0.0.1:{a.port}", num_processes=a.num_processes,
        process_id=a.process_id, initialization_timeout_s=120))
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec

  from rstar_jax import sharding
  from rstar_jax.model import hf_io
  from rstar_jax.rollout import weight_sync

  assert jax.device_count() == 8, jax.devices()
  me = jax.process_index()
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})

  # gather_to: each case to each process in turn.
  got, report = {}, {"lacks_blocks": {}, "none": []}
  for name, (shape, _, spec) in GATHER_CASES.items():
    value = case_value(name)
    sh = NamedSharding(mesh, PartitionSpec(*spec))
    x = jax.make_array_from_callback(shape, sh, lambda idx, v=value: v[idx])
    for writer in range(a.num_processes):
      held = {tuple((s.start, s.stop) for s in idx) for d, idx in
              sh.devices_indices_map(shape).items() if d.process_index == writer}
      every = {tuple((s.start, s.stop) for s in idx)
               for idx in sh.devices_indices_map(shape).values()}
      report["lacks_blocks"][f"{name}/{writer}"] = bool(every - held)
      out = distributed.gather_to(x, writer)
      if out is None:
        report["none"].append(f"{name}/{writer}")
      else:
        got[f"{name}/{writer}"] = out.astype(np.float32)
  np.savez(os.path.join(a.out, f"gather_{me}.npz"), **got)
  with open(os.path.join(a.out, f"gather_{me}.json"), "w") as f:
    json.dump(report, f)

  model = hf_io.load_hf(a.hf_dir, mesh=mesh)
  opened = []
  out_root = os.path.realpath(a.out)

  def audit(event, args):   # every open() / os.open() of Python code in this process
    if event == "open" and isinstance(args[0], (str, bytes)):
      path = os.path.realpath(os.fsdecode(args[0]))
      mode, flags = args[1], args[2]
      writing = (any(c in (mode or "") for c in "wax+") if mode is not None
                 else bool(flags & (os.O_WRONLY | os.O_RDWR)))
      if writing and path.startswith(out_root + os.sep):
        opened.append(os.path.relpath(path, out_root))

  sys.addaudithook(audit)
  returned = hf_io.save_hf(model, os.path.join(a.out, "hf_f32"), dtype="float32",
                           parallel=True, max_shard_bytes=40_000)
  # The default export of the same model (every tensor gathered to every process,
  # process 0 writes one file): the layout a single process writes.
  hf_io.save_hf(model, os.path.join(a.out, "hf_serial"), dtype="float32")
  engines = []
  if a.server and distributed.is_main():
    from rstar_jax.rollout.sglang import engine as sglang_engine
    _wait_healthy(a.server)
    engines = sglang_engine.connect([a.server])
  sync = weight_sync.DiskWeightSync(weight_sync.WeightSyncConfig(dtype="bfloat16"), model,
                                    engines, os.path.join(a.out, "sync"))
  from flax import nnx
  metrics = sync.publish(nnx.state(model), "step-7")
  for e in engines:
    e.stop()
  # A disk that fails on the last process only (full, say): every process must raise,
  # none wait for it in a collective.
  failure = None
  if me == a.num_processes - 1:
    def full(self, name, value):
      raise OSError(28, "No space left on device (injected)", self.path)
    hf_io._StreamedShard.write = full
  try:
    hf_io.save_hf(model, os.path.join(a.out, "hf_fail"), dtype="float32", parallel=True)
  except (OSError, RuntimeError) as e:
    failure = f"{type(e).__name__}: {e}"
  with open(os.path.join(a.out, f"opened_{me}.json"), "w") as f:
    json.dump({"opened": opened, "returned": returned, "metrics": metrics,
               "failure": failure}, f)
  distributed.barrier("sharded export worker done")


if __name__ == "__main__":
  main()
