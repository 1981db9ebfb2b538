r"""Synchronous vs bounded-staleness asynchronous rollouts: steps a second on a short toy RL
stage, and the schedule's estimate at the 14B timing shape.

  python -m experiments.benchmarks.async_throughput --steps 6 --staleness 0,1,2 \
      --out /tmp/async_throughput.json
  python -m experiments.benchmarks.async_throughput --engines process,servers --servers 2 --steps 12

Measured: the smoke toy config (random-init tiny model, in-process JaxEngine or, with
`--engines servers`, --servers rollout server processes of ours serving its export with the
weights synced through disk, a tool that answers "1" after --tool_delay_s) runs --steps RL
steps per k in --staleness, each with a fresh trainer on one shared engine pool; the table gives the total, the median seconds a
step after the first two (compiles), and the median rollout and update seconds. On a CPU
host generation and training share the cores, so overlap gains little there: the host's
CPU model, core count and load average are recorded with the numbers.

Estimated (`--estimate_14b`, no model run): `async_rollouts.schedule_times` over the 14B
stage-1 shape of docs/guides/cluster.md (rollout ~850 s, update ~370 s, weight sync ~130 s
a step), the rollout's step-to-step spread taken from the scheduler simulator
(`rollout.simulate`: the makespan of a 1/16 slice of a step's trajectories on 2 engines,
one workload seed per step, scaled so that its mean is 850 s).
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

from absl import app, flags

from experiments.common import results_json

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 6, "RL steps per setting", lower_bound=1)
flags.DEFINE_string("staleness", "0,1,2", "comma-separated max_staleness values")
flags.DEFINE_float("tool_delay_s", 0.0, "seconds each tool call takes")
flags.DEFINE_string("out", "", "JSON output path (default: print only)")
flags.DEFINE_bool("estimate_14b", False, "only the schedule's estimate at the 14B shape")
flags.DEFINE_list("engines", ["process"], "where rollouts are generated, each measured in turn: "
                  "'process' (in-process JaxEngine) and/or 'servers' (--servers rollout server "
                  "processes of ours, weights synced through disk)")
flags.DEFINE_integer("servers", 2, "rollout server processes for --engines=servers", lower_bound=1)

# docs/guides/cluster.md, "One step, estimated" (stage 1 on 64 MI300X).
ROLLOUT_S, UPDATE_S, SYNC_S = 850.0, 370.0, 130.0


def host_info() -> dict:
  from experiments.common import results_json
  from experiments.common import roofline
  return {"cpu_model": results_json.cpu_model(), "cpus": os.cpu_count(), "loadavg_1_5_15": list(os.getloadavg()),
          "matmul_peak_gflops": roofline.matmul_peak_gflops(),
          "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def estimate_14b(steps: int = 12) -> list[dict]:
  from rstar_jax.rl import async_rollouts as async_lib
  from rstar_jax.rollout import simulate
  spans = []
  for s in range(steps):
    # 1/16 of a step (512 x 32 trajectories over 32 servers) on 2 engines: the per-engine
    # load of the real step; long-tailed turns (simulate.unequal_workload).
    r = simulate.simulate(simulate.unequal_workload(1024, seed=s), num_engines=2,
                          policy="kv_capacity", kv_capacity=200_000)
    spans.append(r["makespan_s"])
  scale = ROLLOUT_S / statistics.mean(spans)
  gen = [x * scale + SYNC_S for x in spans]
  train = [UPDATE_S] * steps
  rows = []
  for k in (0, 1, 2):
    t = async_lib.schedule_times(gen, train, k)
    rows.append({"max_staleness": k, **t})
  return rows


def measure(k_values, steps: int, tool_delay_s: float, engines: str = "process",
            servers: int = 2) -> list[dict]:
  """engines: "process" (the in-process JaxEngine of the smoke config) or "servers"
  (`servers` rollout server processes of ours serving the same random-init export, the
  trainer's weights synced to them through disk each step)."""
  import asyncio
  import contextlib
  import dataclasses
  from experiments.configs import toy
  from rstar_jax.model import hf_io
  from rstar_jax.recipe import recipe_config, stages
  from rstar_jax.rl import async_rollouts as async_lib
  from rstar_jax.rl import trainer as rl_trainer
  from rstar_jax.rollout import backends
  from rstar_jax.rollout import api_server as rollout_server

  class Tools:
    async def execute(self, calls):
      if tool_delay_s:
        await asyncio.sleep(tool_delay_s)
      return [{"status": "ok", "stdout": "1\n", "stderr": ""} for _ in calls]

  root = tempfile.mkdtemp(prefix="async_throughput_")
  cfg = recipe_config.build_config(toy.get_config("smoke"))
  ctx = stages.build_context(cfg, Tools(), workdir=root)
  first = stages.initial_model(cfg, ctx.tokenizer, ctx.mesh, ctx.rules)
  stack = contextlib.ExitStack()
  rollout_cfg = cfg.rollout
  if engines == "servers":
    export = os.path.join(root, "export")
    hf_io.save_hf(first, export, dtype=cfg.model.param_dtype)
    urls = stack.enter_context(rollout_server.running_servers(
        export, servers, cfg.rollout.engine, log_dir=os.path.join(root, "logs")))
    rollout_cfg = dataclasses.replace(cfg.rollout, backend="server", servers=tuple(urls))
  elif engines != "process":
    raise ValueError(f"--engines: 'process' or 'servers', got {engines!r}")
  pool = backends.build_engine_pool(rollout_cfg, first, workdir=root, rules=ctx.rules)
  rows = []
  try:
    for k in k_values:
      rl = dataclasses.replace(cfg.rl, checkpoint_every=10_000,
                               async_rollouts=async_lib.AsyncRolloutsConfig(max_staleness=k))
      model = stages.initial_model(cfg, ctx.tokenizer, ctx.mesh, ctx.rules)
      t = rl_trainer.RLTrainer(rl, cfg.stage1.agent, model, ctx.tokenizer, ctx.proto,
                               ctx.train_problems, engines=pool, tools=ctx.tools,
                               workdir=os.path.join(root, f"k{k}"), seed=0, mesh=ctx.mesh,
                               rules=ctx.rules)
      ends = []
      t0 = time.perf_counter()
      try:
        history = t.run(steps, progress=False,
                        on_step=lambda s, m: ends.append(time.perf_counter()))
      finally:
        t.close()
      per_step = [b - a for a, b in zip([t0] + ends[:-1], ends)]
      steady = per_step[2:] or per_step
      rows.append({"engines": engines, "max_staleness": k, "total_s": ends[-1] - t0,
                   "steady_step_s": statistics.median(steady),
                   "rollout_s": statistics.median(m["time/rollout_s"] for m in history[2:] or history),
                   "train_s": statistics.median(m.get("time/train_s", 0.0) for m in history[2:] or history),
                   "per_step_s": per_step})
  finally:
    pool.stop()
    stack.close()
  return rows


def main(argv):
  del argv
  out = {"host": host_info()}     # the load before the runs; "host_after": after them
  if FLAGS.estimate_14b:
    out["estimate_14b"] = estimate_14b()
    print(f"{'k':>2} {'s/step':>8} {'trainer idle':>13} {'rollout idle':>13}   (14B shape, estimated)")
    for r in out["estimate_14b"]:
      print(f"{r['max_staleness']:>2} {r['step_s']:>8.0f} {r['trainer_idle_share']:>13.2f} "
            f"{r['worker_idle_share']:>13.2f}")
  else:
    ks = [int(x) for x in FLAGS.staleness.split(",") if x.strip()]
    out["measured"] = []
    for engines in FLAGS.engines:
      out["measured"] += measure(ks, FLAGS.steps, FLAGS.tool_delay_s, engines, FLAGS.servers)
    print(f"{'engines':>8} {'k':>2} {'total s':>8} {'s/step':>7} {'rollout s':>10} "
          f"{'update s':>9} {'speed-up':>9}")
    for r in out["measured"]:
      base = next(b["steady_step_s"] for b in out["measured"] if b["engines"] == r["engines"])
      print(f"{r['engines']:>8} {r['max_staleness']:>2} {r['total_s']:>8.1f} "
            f"{r['steady_step_s']:>7.2f} {r['rollout_s']:>10.2f} {r['train_s']:>9.2f} "
            f"{base / r['steady_step_s']:>9.2f}")
  out["host_after"] = {"loadavg_1_5_15": list(os.getloadavg())}
  print(json.dumps(out["host"]), json.dumps(out["host_after"]))
  results_json.write(FLAGS.out, out)


if __name__ == "__main__":
  app.run(main)
