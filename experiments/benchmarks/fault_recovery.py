r"""python -m experiments.benchmarks.fault_recovery --out /tmp/fault_recovery.json

What a fault costs on this machine, and how often the 14B run should checkpoint
(docs/guides/fault_tolerance.md). Parts, in one run:

  1. servers: a local Ray fleet of 1 sandbox server and 1 rollout server of ours (a
     random tiny checkpoint); each is SIGKILLed `--repeats` times, interleaved, and
     timed from the kill until /health answers again on the same port (its actor's
     restart loop: detection, a new process, its start-up);
  2. trainer process (supervisor): a 2-process stand-in trainer job under
     `Cluster.run_trainers` (back-off 0); one process SIGKILLed, timed until both
     processes run again (detection, killing the peer, starting both);
  3. trainer process (real): the toy RL stage as 1 trainer process under
     `Cluster.run_trainers` (back-off 0); SIGKILLed after a step, timed until the
     restarted process has restored its checkpoint ("resumed ... at step") and until it
     has logged the step it was in when killed (the work the fault cost);
  4. node: a two-node Ray cluster on this machine (the second node holding one sandbox
     server); the second node's processes SIGKILLed, timed until the running trainer's
     tool call succeeds at the moved server's new URL (the fleet file,
     `live_server_moves`), and, with it off, until the trainer job runs again with that
     URL (Ray's node health check at 500 ms x 4, `server_check_s=1`);
  5. checkpoint cadence: the toy RL stage (`--steps` steps from one SFT export) with
     `rl.checkpoint_every` 1, `--every_n` and never (only the stage's final save),
     interleaved; the step interval is the time between metrics rows (it includes the
     save after a row), its mean over steps 2.. (step 1 compiles), the median of the runs;
  6. the 14B estimate: checkpoint size from the Qwen3-14B parameter count (float32
     parameters and AdamW's two float32 moments), write time at the given bandwidths,
     faults a week at the given rates, the Young/Daly interval sqrt(2 * MTBF * C) and the
     expected time lost a week at a cadence of k steps,
     W(k) = (steps_per_week / k) * C + faults_per_week * k * step_s / 2.

Prints one table and writes the JSON (date, commit, CPU model, `uptime` load before and
after). On a shared 2-core machine the absolute times move with the load: compare the
rows of one run.
"""
import json
import math
import multiprocessing
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from absl import app, flags

from experiments.common import results_json
from experiments.common import standin_trainers

flags.DEFINE_integer("repeats", 3, "kills per server kind and of the stand-in trainer; "
                     "runs per checkpoint cadence", lower_bound=1)
flags.DEFINE_integer("steps", 6, "toy RL steps per cadence run", lower_bound=3)
flags.DEFINE_integer("every_n", 3, "the middle cadence (checkpoint every N steps)", lower_bound=2)
flags.DEFINE_list("parts", ["servers", "trainer", "real_trainer", "node", "cadence", "14b"],
                  "which parts to run")
flags.DEFINE_list("bandwidths_gbps", ["2", "10"], "14B estimate: write bandwidths, GB/s")
flags.DEFINE_list("faults_per_week", ["0.21", "2.1"],
                  "14B estimate: fault rates of the 64-GPU job (0.21: Llama 3's 4.7e-4 per "
                  "GPU-day x 64 GPUs x 7 days; 2.1: ten times that)")
flags.DEFINE_float("step_s", 1190.0, "14B estimate: one RL step (510 steps in a week)")
flags.DEFINE_integer("config_every", 10, "14B estimate: the config's rl.checkpoint_every")
flags.DEFINE_string("out", "/tmp/fault_recovery.json", "JSON output")
FLAGS = flags.FLAGS
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = "experiments/configs/toy.py:smoke"
GB = 1e9


def _machine() -> dict:
  from experiments.common import results_json
  cpu = results_json.cpu_model()
  commit = results_json.commit()
  dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                         capture_output=True, text=True).stdout.strip()
  return {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
          "commit": commit + ("+changes" if dirty else ""), "cpu": cpu,
          "cores": os.cpu_count(), "uptime": _uptime()}


def _uptime() -> str:
  return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _env() -> dict:
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  return env


def _wait(pred, what: str, limit_s: float = 600.0) -> float:
  """Seconds until `pred()` holds (polled every 20 ms); raises after `limit_s`."""
  t0 = time.perf_counter()
  while not pred():
    if time.perf_counter() - t0 > limit_s:
      raise RuntimeError(f"no {what} after {limit_s:.0f} s")
    time.sleep(0.02)
  return time.perf_counter() - t0


def _ray_init(extra_path: str = "", env_vars: dict | None = None):
  import ray
  path = os.pathsep.join(p for p in (REPO, extra_path) if p)
  ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={
      "env_vars": {"XLA_FLAGS": "", "JAX_PLATFORMS": "cpu", "PYTHONPATH": path,
                   **(env_vars or {})}})


# ---- 1. servers -----------------------------------------------------------------------
def part_servers(root: str, repeats: int) -> dict:
  import ray
  from rstar_jax.recipe import cluster
  from rstar_jax.model import model_config, hf_io, qwen3
  # A random tiny checkpoint (as experiments/benchmarks/bench_cluster.py's; that module's flags
  # cannot be imported beside these).
  hf = os.path.join(root, "tiny_hf")
  hf_io.save_hf(qwen3.create_model(model_config.get_preset(
      "tiny", hidden_size=64, intermediate_size=128, head_dim=16, num_hidden_layers=2,
      vocab_size=512), seed=0), hf, dtype="float32")
  _ray_init()
  cfg = cluster.ClusterConfig(sandbox_servers=1, sandbox_cpus=0.5, rollout_servers=1,
                              rollout_cpus=0.5, rollout_hf_dir=hf, trainer_processes=0,
                              rollout_args=("--num_slots", "4", "--max_len", "256"),
                              log_dir=os.path.join(root, "logs_servers"))
  out = {"sandbox": [], "rollout": []}
  try:
    fleet = cluster.Cluster(cfg)
    try:
      for r in range(repeats):
        for role in ("sandbox", "rollout") if r % 2 == 0 else ("rollout", "sandbox"):
          before = fleet.server_info()[role][0]
          os.kill(before["pid"], signal.SIGKILL)
          t0 = time.perf_counter()
          _wait(lambda: fleet.server_info()[role][0]["pid"] != before["pid"]
                and cluster._healthy(before["url"]), f"{role} server back")
          out[role].append(time.perf_counter() - t0)
          print(f"  {role} server SIGKILLed -> healthy on its port: {out[role][-1]:.2f} s")
    finally:
      fleet.shutdown()
  finally:
    ray.shutdown()
  return out


# ---- 2. the supervisor, stand-in trainer ---------------------------------------------
_STANDIN = '''
import os, sys, time
work = os.environ["FAULT_BENCH_WORK"]
arg = lambda k, d: next((a.split("=", 1)[1] for a in sys.argv if a.startswith(k + "=")), d)
idx = int(arg("--config.distributed.process_id", "0"))
open(os.path.join(work, "pid%d.tmp" % idx), "w").write(str(os.getpid()))
os.replace(os.path.join(work, "pid%d.tmp" % idx), os.path.join(work, "pid%d" % idx))
while not os.path.exists(os.path.join(work, "done")):
  time.sleep(0.05)
'''


def part_trainer(root: str, repeats: int) -> list[float]:
  import ray
  from rstar_jax.recipe import cluster
  mod = os.path.join(root, "standin")
  work = os.path.join(root, "standin_work")
  os.makedirs(mod)
  os.makedirs(work)
  with open(os.path.join(mod, "fault_bench_trainer.py"), "w") as f:
    f.write(_STANDIN)
  _ray_init(mod, {"FAULT_BENCH_WORK": work})
  cfg = cluster.ClusterConfig(sandbox_servers=0, rollout_servers=0, trainer_processes=2,
                              trainer_cpus=0.5, trainer_module="fault_bench_trainer",
                              trainer_config="none.py", max_restarts=repeats + 1,
                              restart_backoff_s=0.0, log_dir=os.path.join(root, "logs_trainer"))
  pid = lambda i: (int(open(os.path.join(work, f"pid{i}")).read())
                   if os.path.exists(os.path.join(work, f"pid{i}")) else None)
  out = []
  try:
    fleet = cluster.Cluster(cfg)
    try:
      result = {}
      runner = threading.Thread(target=lambda: result.setdefault("codes", fleet.run_trainers()))
      runner.start()
      _wait(lambda: pid(0) and pid(1), "the stand-in job's start")
      for r in range(repeats):
        old = (pid(0), pid(1))
        os.kill(old[r % 2], signal.SIGKILL)
        t0 = time.perf_counter()
        _wait(lambda: pid(0) not in (None, old[0]) and pid(1) not in (None, old[1]),
              "both processes again")
        out.append(time.perf_counter() - t0)
        print(f"  stand-in trainer process SIGKILLed -> both running again: {out[-1]:.2f} s")
      open(os.path.join(work, "done"), "w").close()
      runner.join()
      if result.get("codes") != [0, 0]:
        raise RuntimeError(f"stand-in job ended {result.get('codes')}")
    finally:
      fleet.shutdown()
  finally:
    ray.shutdown()
  return out


# ---- 3. the supervisor, the real toy trainer ------------------------------------------
def _sft(root: str) -> str:
  """The smoke config's SFT stage (what the RL runs below start from)."""
  d = os.path.join(root, "sft_run")
  t0 = time.perf_counter()
  out = subprocess.run([sys.executable, "-m", "experiments.recipe", "--config", SMOKE,
                        f"--config.workdir={d}", "--stages=sft"], cwd=REPO, env=_env(),
                       capture_output=True, text=True)
  if out.returncode:
    raise RuntimeError("SFT failed:\n" + out.stdout[-2000:] + out.stderr[-2000:])
  print(f"  SFT (smoke config) for the RL runs: {time.perf_counter() - t0:.0f} s")
  return d


def _copy_sft(src: str, dst: str) -> str:
  os.makedirs(dst)
  for name in ("tokenizer", "sft"):
    shutil.copytree(os.path.join(src, name), os.path.join(dst, name))
  os.symlink(os.path.join(src, "compile_cache"), os.path.join(dst, "compile_cache"))
  return dst


def _rows(path: str) -> int:
  try:
    with open(path) as f:
      return sum(1 for line in f if line.strip())
  except OSError:
    return 0


def part_real_trainer(root: str, sft: str, steps: int) -> dict:
  import ray
  from rstar_jax.recipe import cluster
  d = _copy_sft(sft, os.path.join(root, "real_trainer"))
  cfg = cluster.ClusterConfig(
      sandbox_servers=0, rollout_servers=0, trainer_processes=1, trainer_cpus=0.5,
      trainer_config=SMOKE, restart_backoff_s=0.0, log_dir=os.path.join(root, "logs_real"),
      trainer_args=(f"--config.workdir={d}", f"--config.stage1.num_steps={steps}",
                    "--stages=stage1", "--config.rl.checkpoint_every=1"))
  path = os.path.join(d, "stage1", "metrics_rl.jsonl")
  _ray_init()
  try:
    fleet = cluster.Cluster(cfg)
    try:
      result = {}
      runner = threading.Thread(target=lambda: result.setdefault("codes", fleet.run_trainers()))
      runner.start()
      _wait(lambda: _rows(path) >= 2, "step 2's row")
      # Killed right after step 2's row: its checkpoint is being written or done, and
      # step 3 is what the fault interrupts.
      os.kill(ray.get(fleet.trainers[0].pid.remote()), signal.SIGKILL)
      log = os.path.join(root, "logs_real", "cluster.log")
      resumed = _wait(lambda: os.path.exists(log) and "resumed from step" in open(log).read(),
                      "the restarted trainer's resume")
      step = int(open(log).read().split("resumed from step ")[1].split()[0])
      back = _wait(lambda: _rows(path) >= 3, "step 3's row after the restart")
      runner.join()
      if result.get("codes") != [0]:
        raise RuntimeError(f"the toy trainer ended {result.get('codes')}")
    finally:
      fleet.shutdown()
  finally:
    ray.shutdown()
  print(f"  toy trainer SIGKILLed after step 2 -> restored step {step}: {resumed:.1f} s; "
        f"step 3 logged: {back + resumed:.1f} s")
  return {"resumed_s": resumed, "resumed_step": step, "step3_logged_s": resumed + back}


# ---- 4. a lost node -------------------------------------------------------------------
def _node_run(tmp: str, queue, live: bool) -> None:
  """In a fresh process (no Ray state of the parts before): a head node and a second
  node (own process group) with room for one sandbox server; the second node SIGKILLed.
  live: until the running trainer's tool call succeeds at the moved server's new URL
  (the fleet file); else until the trainer job restarted with it."""
  import traceback
  os.environ["RAY_AUTH_MODE"] = "disabled"
  import ray
  from rstar_jax.recipe import cluster
  with open(os.path.join(tmp, "fault_bench_urls.py"), "w") as f:
    f.write(standin_trainers.URL_TRAINER)
  work = os.path.join(tmp, "work")
  os.makedirs(work)
  temp = tempfile.mkdtemp(prefix="r", dir="/tmp")    # short: Ray's socket paths
  port = cluster.free_port()
  ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, tmp]), FLEET_TRAINER_WORK=work,
             RAY_health_check_period_ms="500", RAY_health_check_failure_threshold="4",
             RAY_health_check_timeout_ms="500")
  env.pop("RAY_ADDRESS", None)
  second, out = None, {}
  try:
    head = subprocess.run([ray_bin, "start", "--head", f"--port={port}", "--num-cpus=3",
                           "--include-dashboard=false", f"--temp-dir={temp}",
                           "--disable-usage-stats"], env=env, capture_output=True, text=True)
    if head.returncode:
      raise RuntimeError(head.stderr)
    address = f"127.0.0.1:{port}"
    second = subprocess.Popen([ray_bin, "start", f"--address={address}", "--num-cpus=1",
                               "--block", "--disable-usage-stats"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    ray.init(address=address, log_to_driver=False, runtime_env={"env_vars": {
        "PYTHONPATH": env["PYTHONPATH"], "FLEET_TRAINER_WORK": work}})
    _wait(lambda: len([n for n in ray.nodes() if n["Alive"]]) == 2, "the second node")
    cfg = cluster.ClusterConfig(
        sandbox_servers=2, sandbox_cpus=1.0, rollout_servers=0, trainer_processes=1,
        trainer_cpus=1.0, trainer_module="fault_bench_urls", trainer_config="none.py",
        restart_backoff_s=0.0, log_dir=os.path.join(tmp, "logs"), startup_timeout_s=300,
        live_server_moves=live)
    fleet = cluster.Cluster(cfg)
    starts = os.path.join(work, "starts")
    try:
      runner = threading.Thread(target=lambda: fleet.run_trainers(server_check_s=1.0))
      runner.start()
      calls = os.path.join(work, "calls")
      _wait(lambda: os.path.exists(calls), "the trainer's first tool call")
      before = fleet.sandbox_urls
      os.killpg(second.pid, signal.SIGKILL)           # the second node and all it ran
      t0 = time.perf_counter()
      if live:
        _wait(lambda: fleet.sandbox_urls != before, "the server's move")
        moved = json.dumps({"urls": fleet.sandbox_urls, "status": "ok"})[:-1]
        _wait(lambda: moved in open(calls).read(), "a call at the new URLs")
      else:
        _wait(lambda: len(open(starts).read().splitlines()) == 2, "the restart with new URLs")
      out["recovery_s"] = time.perf_counter() - t0
      open(os.path.join(work, "done"), "w").close()
      runner.join()
      out["restarts"] = [r["cause"] for r in fleet.restarts]
    finally:
      fleet.shutdown()
  except BaseException:  # noqa: BLE001 - reported to the parent
    out["error"] = traceback.format_exc()
  finally:
    try:
      ray.shutdown()
    finally:
      if second is not None and second.poll() is None:
        os.killpg(second.pid, signal.SIGKILL)
      _stop_ray(temp)
      shutil.rmtree(temp, ignore_errors=True)
      queue.put(out)


def _stop_ray(temp: str) -> None:
  """Kills this cluster's head processes by id (their command lines name its temp dir),
  never by a broad name: other Ray instances may run here."""
  out = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True,
                       env=dict(os.environ, COLUMNS="100000")).stdout
  for line in out.splitlines():
    pid, _, args = line.strip().partition(" ")
    if temp in args and int(pid) != os.getpid():
      try:
        os.kill(int(pid), signal.SIGKILL)
      except ProcessLookupError:
        pass


def part_node(root: str, repeats: int, live: bool) -> list[float]:
  ctx = multiprocessing.get_context("spawn")
  out = []
  for r in range(repeats):
    tmp = os.path.join(root, f"node{r}{'live' if live else 'restart'}")
    os.makedirs(tmp)
    queue = ctx.Queue()
    proc = ctx.Process(target=_node_run, args=(tmp, queue, live))
    proc.start()
    res = queue.get()
    proc.join()
    if "error" in res:
      raise RuntimeError(res["error"])
    out.append(res["recovery_s"])
    what = ("the running trainer's call at the new URL" if live else
            f"the trainer job restarted with the new URL ({'; '.join(res['restarts'])})")
    print(f"  node lost (holding a sandbox server) -> {what}: {out[-1]:.2f} s")
  return out


# ---- 5. checkpoint cadence ------------------------------------------------------------
def _cadence_run(root: str, sft: str, every: int, steps: int, tag: str) -> list[float]:
  d = _copy_sft(sft, os.path.join(root, tag))
  path = os.path.join(d, "stage1", "metrics_rl.jsonl")
  log = open(os.path.join(root, f"{tag}.log"), "w")
  proc = subprocess.Popen([sys.executable, "-m", "experiments.recipe", "--config", SMOKE,
                           f"--config.workdir={d}", "--stages=stage1",
                           f"--config.stage1.num_steps={steps}",
                           f"--config.rl.checkpoint_every={every}"],
                          cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                          stderr=log)
  seen, times = 0, []
  while proc.poll() is None or _rows(path) > seen:
    n = _rows(path)
    while seen < n:
      times.append(time.perf_counter())
      seen += 1
    time.sleep(0.02)
  log.close()
  if proc.returncode or seen != steps:
    raise RuntimeError(f"cadence run every={every} failed ({proc.returncode}, {seen} rows):\n"
                       + open(os.path.join(root, f"{tag}.log")).read()[-2000:])
  return [b - a for a, b in zip(times, times[1:])]   # intervals before steps 2..steps


def part_cadence(root: str, sft: str, repeats: int, steps: int, every_n: int) -> dict:
  never = 10 ** 6
  arms = [("every 1", 1), (f"every {every_n}", every_n), ("never (final save only)", never)]
  out = {name: [] for name, _ in arms}
  for r in range(repeats):
    for name, every in arms if r % 2 == 0 else arms[::-1]:
      gaps = _cadence_run(root, sft, every, steps, f"cadence_{every}_{r}")
      # The mean: a save every N steps lengthens one interval in N (a median would skip it).
      out[name].append(statistics.mean(gaps))
      print(f"  {name}: step interval mean {out[name][-1]:.2f} s over steps 2-{steps} "
            f"({', '.join(f'{g:.2f}' for g in gaps)})")
  return out


# ---- 6. the 14B estimate --------------------------------------------------------------
def part_14b() -> dict:
  import jax
  import numpy as np
  from flax import nnx
  from rstar_jax.model import model_config, qwen3
  cfg = model_config.get_preset("qwen3-14b")
  _, state = nnx.split(qwen3.abstract_model(cfg))
  params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(state)))
  ckpt_bytes = params * (4 + 4 + 4)   # float32 parameters, AdamW's mu and nu (float32)
  steps_week = 7 * 24 * 3600 / FLAGS.step_s
  rows = []
  for fpw in (float(x) for x in FLAGS.faults_per_week):
    mtbf_s = 7 * 24 * 3600 / fpw
    for bw in (float(x) for x in FLAGS.bandwidths_gbps):
      c = ckpt_bytes / (bw * GB)
      tau = math.sqrt(2 * mtbf_s * c)
      k = max(1, round(tau / FLAGS.step_s))
      lost = lambda k: steps_week / k * c + fpw * k * FLAGS.step_s / 2
      rows.append({"faults_per_week": fpw, "mtbf_h": mtbf_s / 3600, "bandwidth_gbps": bw,
                   "write_s": c, "young_daly_s": tau, "young_daly_steps": tau / FLAGS.step_s,
                   "cadence_steps": k, "lost_s_week": lost(k),
                   "lost_s_week_config": lost(FLAGS.config_every)})
  return {"params": params, "checkpoint_bytes": ckpt_bytes, "step_s": FLAGS.step_s,
          "steps_per_week": steps_week, "config_every": FLAGS.config_every, "rows": rows}


def _fmt(xs) -> str:
  return ", ".join(f"{x:.2f}" for x in xs) + f" (median {statistics.median(xs):.2f})"


def main(argv):
  del argv
  parts = set(FLAGS.parts)
  unknown = parts - {"servers", "trainer", "real_trainer", "node", "cadence", "14b"}
  if unknown:
    raise app.UsageError(f"--parts: unknown {sorted(unknown)}")
  result = {"benchmark": "fault_recovery", "machine": _machine(), "repeats": FLAGS.repeats,
            "command": " ".join(["python -m experiments.benchmarks.fault_recovery", *sys.argv[1:]])}
  print(f"{result['machine']['date']}, commit {result['machine']['commit']}, "
        f"{result['machine']['cpu']}, {result['machine']['cores']} cores\nbefore: "
        f"{result['machine']['uptime']}")
  root = tempfile.mkdtemp(prefix="fault_recovery_")
  try:
    if "servers" in parts:
      result["servers_s"] = part_servers(root, FLAGS.repeats)
    if "trainer" in parts:
      result["standin_trainer_s"] = part_trainer(root, FLAGS.repeats)
    if "node" in parts:
      result["node_live_s"] = part_node(root, max(1, FLAGS.repeats - 1), live=True)
      result["node_s"] = part_node(root, max(1, FLAGS.repeats - 1), live=False)
    sft = _sft(root) if parts & {"real_trainer", "cadence"} else None
    if "real_trainer" in parts:
      result["real_trainer"] = part_real_trainer(root, sft, steps=4)
    if "cadence" in parts:
      result["cadence_step_s"] = part_cadence(root, sft, FLAGS.repeats, FLAGS.steps,
                                              FLAGS.every_n)
    if "14b" in parts:
      result["estimate_14b"] = part_14b()
  finally:
    shutil.rmtree(root, ignore_errors=True)
  result["uptime_after"] = _uptime()

  lines = ["| fault / setting | figure (s) | how |", "|---|---|---|"]
  if "servers_s" in result:
    lines.append(f"| sandbox server SIGKILLed | {_fmt(result['servers_s']['sandbox'])} | until "
                 "/health answers on its port again |")
    lines.append(f"| rollout server SIGKILLed | {_fmt(result['servers_s']['rollout'])} | same "
                 "(ours, tiny random checkpoint: start-up, not a 14B load) |")
  if "standin_trainer_s" in result:
    lines.append(f"| trainer process SIGKILLed (1 of 2, stand-in) | "
                 f"{_fmt(result['standin_trainer_s'])} | until both run again (supervisor "
                 "only, back-off 0) |")
  if "real_trainer" in result:
    r = result["real_trainer"]
    lines.append(f"| toy trainer SIGKILLed during step 3 | {r['resumed_s']:.2f} / "
                 f"{r['step3_logged_s']:.2f} | until it restored step {r['resumed_step']} / "
                 "until step 3 is logged again |")
  if "node_live_s" in result:
    lines.append(f"| Ray node lost (holding a sandbox server) | {_fmt(result['node_live_s'])} "
                 "| until the running trainer's tool call succeeds at the moved server's URL "
                 "(fleet file; no restart) |")
  if "node_s" in result:
    lines.append(f"| the same, `live_server_moves=False` | {_fmt(result['node_s'])} | "
                 "until the trainer job runs again with the moved server's URL |")
  if "cadence_step_s" in result:
    base = statistics.median(result["cadence_step_s"]["never (final save only)"])
    for name, xs in result["cadence_step_s"].items():
      lines.append(f"| toy RL step, checkpoint {name} | {_fmt(xs)} | step interval, "
                   f"{statistics.median(xs) / base:.2f}x of never |")
  if len(lines) > 2:
    print("\n" + "\n".join(lines))
  if "estimate_14b" in result:
    e = result["estimate_14b"]
    print(f"\nQwen3-14B: {e['params'] / 1e9:.2f} B parameters; checkpoint (float32 params + "
          f"AdamW mu, nu) {e['checkpoint_bytes'] / GB:.0f} GB; one step {e['step_s']:.0f} s "
          f"({e['steps_per_week']:.0f} a week)\n")
    print("| faults / week | MTBF | bandwidth | write C | Young/Daly tau | in steps | "
          f"cadence | lost / week at it | lost / week at every {e['config_every']} |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in e["rows"]:
      print(f"| {r['faults_per_week']:g} | {r['mtbf_h'] / 24:.1f} d | "
            f"{r['bandwidth_gbps']:g} GB/s | {r['write_s']:.0f} s | "
            f"{r['young_daly_s'] / 3600:.2f} h | {r['young_daly_steps']:.1f} | "
            f"{r['cadence_steps']} | {r['lost_s_week'] / 60:.0f} min | "
            f"{r['lost_s_week_config'] / 60:.0f} min |")
  print(f"\nafter: {result['uptime_after']}")
  results_json.write(FLAGS.out, result)


if __name__ == "__main__":
  app.run(main)
