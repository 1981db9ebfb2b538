r"""python -m experiments.benchmarks.bench_cluster --out /tmp/bench_cluster.json

Scale-out costs on one machine (multi-process JAX, Ray fleets), three parts in one run:
  1. the sharded GRPO step (experiments/gpu_smoke.py) as 2 processes x 4 CPU devices
     (gloo collectives over loopback) against 1 process x 8 devices, interleaved:
     the multi-process overhead on the same 8 devices;
  2. Ray: `ray.init` and the launch of the fleet (sandbox servers + a rollout server
     of ours serving a random tiny checkpoint) until every server answers /health;
  3. tool calls/s through the fleet's sandbox servers at concurrency 32, one server's
     URL against both, interleaved (the trainer's client rotating over them).
On a 2-core machine every process shares the same cores: parts 1 and 3 measure the
cost of the extra processes, not a speed-up (which needs more hosts).
"""
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from experiments.common import results_json
from sandbox.launcher import free_port

flags.DEFINE_integer("repeats", 3, "interleaved repeats of each measurement", lower_bound=1)
flags.DEFINE_integer("steps", 10, "timed train steps per gpu_smoke run", lower_bound=1)
flags.DEFINE_string("smoke_args", "--tiny", "gpu_smoke model flags (e.g. '--preset tiny "
                    "--batch 8 --seq 256')")
flags.DEFINE_string("mesh", "data=1,fsdp=4,tensor=2", "the mesh of both step runs")
flags.DEFINE_integer("calls", 256, "tool calls per throughput measurement")
flags.DEFINE_bool("step_only", False, "part 1 only (e.g. with a larger --smoke_args model)")
flags.DEFINE_string("out", "/tmp/bench_cluster.json", "JSON output")
FLAGS = flags.FLAGS
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SYMPY = "from sympy import symbols, solve\nx = symbols('x')\nprint(solve(x**2 - 5*x + 6, x))"


def _step_ms(processes: int) -> float:
  """Median step time of gpu_smoke as `processes` processes over 8 CPU devices."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // processes}")
  port = free_port()
  outs = [tempfile.mktemp(suffix=".json") for _ in range(processes)]
  base = [sys.executable, "-m", "experiments.gpu_smoke", *FLAGS.smoke_args.split(),
          "--mesh", FLAGS.mesh, "--steps", str(FLAGS.steps)]
  procs = []
  for i in range(processes):
    extra = (["--coordinator_address", f"127.0.0.1:{port}", "--num_processes", str(processes),
              "--process_id", str(i)] if processes > 1 else [])
    procs.append(subprocess.Popen(base + extra + ["--out", outs[i]], cwd=REPO, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  logs = [p.communicate(timeout=900)[0] for p in procs]
  if any(p.returncode for p in procs):
    raise RuntimeError("gpu_smoke failed:\n" + "\n".join(l[-2000:] for l in logs))
  with open(outs[0]) as f:
    return 1e3 * statistics.median(json.load(f)["step_s"])


def _tiny_checkpoint(root: str) -> str:
  from rstar_jax.model import model_config, hf_io, qwen3
  cfg = model_config.get_preset("tiny", hidden_size=64, intermediate_size=128, head_dim=16,
                                num_hidden_layers=2, vocab_size=512)
  path = os.path.join(root, "tiny_hf")
  hf_io.save_hf(qwen3.create_model(cfg, seed=0), path, dtype="float32")
  return path


async def _throughput(urls, n: int) -> float:
  from sandbox.client import SandboxClient
  async with SandboxClient(urls, max_concurrency=32, batch_size=1) as client:
    await client.execute([{"code": SYMPY}] * 32)     # warm
    t = time.perf_counter()
    results = await client.execute([{"code": SYMPY}] * n)
    dt = time.perf_counter() - t
  bad = [r for r in results if r.status != "ok"]
  if bad:
    raise RuntimeError(f"{len(bad)} calls failed, e.g. {bad[0]}")
  return n / dt


def main(argv):
  del argv
  import ray
  from rstar_jax.recipe import cluster
  load0 = os.getloadavg()
  print(f"load average before: {load0}")
  rows = {"1x8": [], "2x4": []}
  for r in range(FLAGS.repeats):
    for key, procs in (("1x8", 1), ("2x4", 2)) if r % 2 == 0 else (("2x4", 2), ("1x8", 1)):
      rows[key].append(_step_ms(procs))
      print(f"  step {key}: {rows[key][-1]:.1f} ms")
  one, two = statistics.median(rows["1x8"]), statistics.median(rows["2x4"])
  if FLAGS.step_only:
    print(f"\nGRPO step ({FLAGS.smoke_args}, mesh {FLAGS.mesh}): 1 process x 8 devices "
          f"{one:.1f} ms, 2 processes x 4 devices {two:.1f} ms ({two / one:.2f}x); load "
          f"average before {load0}, after {os.getloadavg()}")
    results_json.write(FLAGS.out, {"benchmark": "cluster_step", "step_ms": rows,
                                   "step_ratio": two / one, "smoke_args": FLAGS.smoke_args,
                                   "mesh": FLAGS.mesh, "load_average": [load0, os.getloadavg()]})
    return

  root = tempfile.mkdtemp(prefix="bench_cluster_")
  hf = _tiny_checkpoint(root)
  t = time.perf_counter()
  ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
           runtime_env={"env_vars": {"XLA_FLAGS": "", "JAX_PLATFORMS": "cpu",
                                     "PYTHONPATH": REPO}})
  init_s = time.perf_counter() - t
  cfg = cluster.ClusterConfig(sandbox_servers=2, sandbox_cpus=0.5, rollout_servers=1,
                              rollout_cpus=0.5, rollout_hf_dir=hf, trainer_processes=0,
                              rollout_args=("--num_slots", "4", "--max_len", "256"),
                              sandbox_args=("--max-children", "32"),
                              log_dir=os.path.join(root, "logs"))
  fleet = cluster.Cluster(cfg)
  try:
    print(f"ray.init {init_s:.1f} s; fleet (2 sandbox + 1 rollout server) healthy after "
          f"{fleet.launch_s:.1f} s")
    rates = {"1 server": [], "2 servers": []}
    for r in range(FLAGS.repeats):
      order = [("1 server", fleet.sandbox_urls[:1]), ("2 servers", fleet.sandbox_urls)]
      for key, urls in order if r % 2 == 0 else order[::-1]:
        rates[key].append(asyncio.run(_throughput(urls, FLAGS.calls)))
        print(f"  {key}: {rates[key][-1]:.1f} calls/s")
  finally:
    fleet.shutdown()
    ray.shutdown()
  c1, c2 = statistics.median(rates["1 server"]), statistics.median(rates["2 servers"])
  load1 = os.getloadavg()
  print(f"\n| measurement | value |\n|---|---|\n"
        f"| GRPO step, 1 process x 8 devices | {one:.1f} ms |\n"
        f"| GRPO step, 2 processes x 4 devices (gloo) | {two:.1f} ms ({two / one:.2f}x) |\n"
        f"| ray.init | {init_s:.1f} s |\n"
        f"| fleet launch (2 sandbox + 1 rollout server, healthy) | {fleet.launch_s:.1f} s |\n"
        f"| sympy calls/s at c=32, 1 sandbox server | {c1:.1f} |\n"
        f"| sympy calls/s at c=32, 2 sandbox servers | {c2:.1f} ({c2 / c1:.2f}x) |\n"
        f"load average before {load0}, after {load1}; {os.cpu_count()} cores")
  results_json.write(FLAGS.out, {
      "benchmark": "cluster", "step_ms": rows, "step_ratio": two / one, "ray_init_s": init_s,
      "fleet_launch_s": fleet.launch_s, "calls_per_s": rates, "calls_ratio": c2 / c1,
      "smoke_args": FLAGS.smoke_args, "mesh": FLAGS.mesh, "load_average": [load0, load1],
      "cores": os.cpu_count()})


if __name__ == "__main__":
  app.run(main)
