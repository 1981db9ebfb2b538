r"""python -m experiments.local_slurm up --dir /tmp/rstar_slurm

A real SLURM on one host, for rehearsing experiments/slurm/rstar2_14b.sbatch: Debian's
slurmctld and slurmd (22.05; `apt-get install slurmctld slurmd slurm-client`), one
slurmd per virtual node (`slurmd -N node<k>`, multiple-slurmd mode), every daemon on a
loopback address (node<k> is 127.0.0.<10+k>, named in /etc/hosts; the controller is
127.0.0.1), config and state in --dir. Nodes advertise more CPUs and memory than the
host has (SlurmdParameters=config_overrides) and 8 GPUs each, as GRES whose device files
are symlinks to /dev/null, so the batch script's unchanged `#SBATCH --gpus-per-node=8`
is honoured. auth/none and cred/none: anyone on this host can submit as anyone. The
scheduler runs every 2 s and a requeued job may start again after cred_expire (10 s).

  up        write the config, start the daemons, wait until every node is idle; prints
            `export SLURM_CONF=...` for the shell that uses sbatch / srun / scontrol.
  down      cancel every job, stop the daemons by their PIDs, and end any process a job
            of this cluster left behind (found by SLURM_CONF in its environment).
  rehearse  the 14B batch scripts, unchanged, on this cluster with the rehearsal overlay
            (experiments/configs/rstar2_agent_14b_rehearsal.py): SFT by `sbatch
            experiments/slurm/rstar2_14b_sft.sbatch` (4 tasks), then
            `sbatch experiments/slurm/rstar2_14b.sbatch` (RL stages 1-3 and the
            evaluation) with only its environment variables set; waits for the job and
            prints its final table. --interrupt=signal shortens the job's time limit so
            that SLURM's own `--signal=B:USR1@1800` comes mid-stage (checkpoint, requeue,
            resume); --interrupt=kill SIGKILLs a trainer task mid-stage (requeue after the
            script's back-off, resume).
  python    (internal) the batch script's $PYTHON: `-m sglang.launch_server ...` runs our
            SGLang-API server (rstar_jax.rollout.api_server) with the flags translated, and
            `--host 0.0.0.0` becomes the node's loopback address; anything else runs as is.

  python -m experiments.local_slurm rehearse --dir /tmp/rstar_slurm   # after `up`
  python -m experiments.local_slurm down --dir /tmp/rstar_slurm

docs/guides/cluster.md ("Rehearsal") has what it showed.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = os.path.join(REPO, "experiments", "slurm", "rstar2_14b.sbatch")
SFT_SBATCH = os.path.join(REPO, "experiments", "slurm", "rstar2_14b_sft.sbatch")
REHEARSAL = "experiments/configs/rstar2_agent_14b_rehearsal.py"
HOSTS_MARK = "# rstar_jax experiments/local_slurm.py"
NODE_PREFIX = "node"
GPUS = 8
CTL_ADDR = "127.0.0.1"


def node_addr(k: int) -> str:
  return f"127.0.0.{10 + k}"


def _free_port(addr: str) -> int:
  with socket.socket() as s:
    s.bind((addr, 0))
    return s.getsockname()[1]


# ---- the cluster ---------------------------------------------------------------------
def _conf_text(d: str, nodes: int, cpus: int, mem_mb: int, ctl_port: int,
               node_ports: list[int]) -> str:
  names = f"{NODE_PREFIX}[0-{nodes - 1}]"
  lines = [
      "ClusterName=rehearsal",
      f"SlurmctldHost={socket.gethostname()}({CTL_ADDR})",
      f"SlurmctldPort={ctl_port}",
      "SlurmUser=root", "SlurmdUser=root",
      "AuthType=auth/none", "CredType=cred/none",
      "AuthInfo=cred_expire=10",        # a requeued job waits this long before it restarts
      "CommunicationParameters=NoInAddrAny,NoCtldInAddrAny",   # daemons on their own address
      f"StateSaveLocation={d}/state",
      f"SlurmdSpoolDir={d}/spool/%n",
      f"SlurmctldPidFile={d}/slurmctld.pid",
      f"SlurmdPidFile={d}/slurmd-%n.pid",
      f"SlurmctldLogFile={d}/slurmctld.log",
      f"SlurmdLogFile={d}/slurmd-%n.log",
      "SlurmctldDebug=info", "SlurmdDebug=info",
      "ProctrackType=proctrack/pgid", "TaskPlugin=task/none",
      "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
      "MpiDefault=none", "SwitchType=switch/none",
      "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
      "SchedulerType=sched/backfill", "SchedulerParameters=sched_interval=2,bf_interval=2",
      "SlurmdParameters=config_overrides",   # nodes may claim more than the host has
      "GresTypes=gpu", "JobRequeue=1", "ReturnToService=2", "MinJobAge=3600",
      "SlurmdTimeout=300", "SlurmctldTimeout=300", "InactiveLimit=0", "KillWait=30",
      "MessageTimeout=30",
  ]
  for k in range(nodes):
    # The daemons bind the host name's address (NoInAddrAny; 127.0.0.1 here), so each
    # slurmd is 127.0.0.1:<its port>; the node's name is its jobs' address (/etc/hosts).
    lines.append(f"NodeName={NODE_PREFIX}{k} NodeAddr={CTL_ADDR} NodeHostname="
                 f"{NODE_PREFIX}{k} Port={node_ports[k]} CPUs={cpus} RealMemory={mem_mb} "
                 f"Gres=gpu:{GPUS} State=UNKNOWN")
  lines.append(f"PartitionName=main Nodes={names} Default=YES MaxTime=INFINITE State=UP "
               "OverSubscribe=NO")
  return "\n".join(lines) + "\n"


def _hosts(nodes: int) -> None:
  """node<k> -> 127.0.0.<10+k> in /etc/hosts (kept: other clusters may be using them)."""
  with open("/etc/hosts") as f:
    text = f.read()
  add = [f"{node_addr(k)} {NODE_PREFIX}{k} {HOSTS_MARK}" for k in range(nodes)
         if not re.search(rf"^{re.escape(node_addr(k))}\s+{NODE_PREFIX}{k}\b", text, re.M)]
  if add:
    with open("/etc/hosts", "a") as f:
      f.write(("" if text.endswith("\n") else "\n") + "\n".join(add) + "\n")
  for k in range(nodes):
    got = socket.gethostbyname(f"{NODE_PREFIX}{k}")
    if got != node_addr(k):
      raise SystemExit(f"{NODE_PREFIX}{k} resolves to {got}, not {node_addr(k)}: fix /etc/hosts")


def env(d: str) -> dict[str, str]:
  return dict(os.environ, SLURM_CONF=os.path.join(d, "slurm.conf"))


def _run(d: str, *cmd: str, check: bool = True, timeout: float = 60) -> str:
  out = subprocess.run(cmd, env=env(d), capture_output=True, text=True, timeout=timeout)
  if check and out.returncode:
    raise RuntimeError(f"{' '.join(cmd)}: exit {out.returncode}: {out.stderr or out.stdout}")
  return out.stdout


def node_states(d: str) -> dict[str, str]:
  out = _run(d, "sinfo", "-h", "-N", "-o", "%N %T", check=False)
  return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)


def up(d: str, nodes: int = 8, cpus: int = 16, mem_mb: int = 128_000,
       timeout: float = 120) -> None:
  for tool in ("slurmctld", "slurmd", "sbatch"):
    if shutil.which(tool) is None:
      raise SystemExit(f"{tool} not found: apt-get install -y slurmctld slurmd slurm-client")
  if os.path.exists(os.path.join(d, "slurmctld.pid")) and _pids(d):
    raise SystemExit(f"a cluster is already running from {d}: "
                     f"python -m experiments.local_slurm down --dir {d}")
  d = os.path.abspath(d)
  os.makedirs(os.path.join(d, "state"), exist_ok=True)
  os.makedirs(os.path.join(d, "dev"), exist_ok=True)
  _hosts(nodes)
  for g in range(GPUS):   # the GPUs: /dev/null under another name
    link = os.path.join(d, "dev", f"nvidia{g}")
    if not os.path.islink(link):
      os.symlink("/dev/null", link)
  ports = [_free_port(CTL_ADDR) for k in range(nodes)]
  with open(os.path.join(d, "slurm.conf"), "w") as f:
    f.write(_conf_text(d, nodes, cpus, mem_mb, _free_port(CTL_ADDR), ports))
  with open(os.path.join(d, "gres.conf"), "w") as f:
    f.write(f"AutoDetect=off\nNodeName={NODE_PREFIX}[0-{nodes - 1}] Name=gpu "
            f"File={d}/dev/nvidia[0-{GPUS - 1}]\n")
  conf = os.path.join(d, "slurm.conf")
  _run(d, "slurmctld", "-f", conf, "-i")      # -i: ignore state from an earlier run
  for k in range(nodes):
    os.makedirs(os.path.join(d, "spool", f"{NODE_PREFIX}{k}"), exist_ok=True)
    _run(d, "slurmd", "-f", conf, "-N", f"{NODE_PREFIX}{k}")
  deadline = time.monotonic() + timeout
  states = {}
  while time.monotonic() < deadline:
    states = node_states(d)
    if len(states) == nodes and all(s == "idle" for s in states.values()):
      print(f"export SLURM_CONF={conf}   # {nodes} nodes idle")
      return
    time.sleep(1)
  raise SystemExit(f"nodes not idle after {timeout:.0f} s: {states}; see {d}/slurm*.log")


def _read_pid(path: str) -> int | None:
  try:
    with open(path) as f:
      return int(f.read().strip() or 0) or None
  except (FileNotFoundError, ValueError):
    return None


def _daemon_pids(d: str) -> list[int]:
  names = [n for n in os.listdir(d) if n.endswith(".pid")] if os.path.isdir(d) else []
  return [p for p in (_read_pid(os.path.join(d, n)) for n in sorted(names)) if p]


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except (FileNotFoundError, ProcessLookupError, IndexError):
    return False


def _job_pids(d: str) -> list[int]:
  """Processes with this cluster's SLURM_CONF in their environment (what its jobs
  started), besides this process and its ancestors."""
  want = f"SLURM_CONF={os.path.abspath(d)}/slurm.conf".encode()
  mine = {os.getpid()}
  p = os.getppid()
  while p > 1 and p not in mine:
    mine.add(p)
    try:
      with open(f"/proc/{p}/stat") as f:
        p = int(f.read().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ValueError, IndexError):
      break
  found = []
  for name in os.listdir("/proc"):
    if not name.isdigit() or int(name) in mine:
      continue
    try:
      with open(f"/proc/{name}/environ", "rb") as f:
        if want in f.read().split(b"\0"):
          found.append(int(name))
    except OSError:
      continue
  return [p for p in found if _alive(p)]


def _pids(d: str) -> list[int]:
  return [p for p in _daemon_pids(d) if _alive(p)]


def _stop(pids: list[int], wait_s: float) -> list[int]:
  for p in pids:
    try:
      os.kill(p, signal.SIGTERM)
    except ProcessLookupError:
      pass
  deadline = time.monotonic() + wait_s
  while time.monotonic() < deadline and any(_alive(p) for p in pids):
    time.sleep(0.2)
  left = [p for p in pids if _alive(p)]
  for p in left:
    try:
      os.kill(p, signal.SIGKILL)
    except ProcessLookupError:
      pass
  return left


def down(d: str) -> list[int]:
  """Stops everything; returns the PIDs still alive afterwards (none, normally)."""
  d = os.path.abspath(d)
  if os.path.exists(os.path.join(d, "slurm.conf")) and _pids(d):
    _run(d, "scancel", "--full", "--user=root", check=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _run(d, "squeue", "-h", check=False).strip():
      time.sleep(0.5)
  _stop(_job_pids(d), 10)                     # what the jobs left (none, normally)
  _stop(_pids(d), 20)                         # slurmd's, slurmctld
  _stop(_job_pids(d), 5)
  time.sleep(0.5)
  return [p for p in _pids(d) + _job_pids(d) if _alive(p)]


# ---- the batch script's $PYTHON --------------------------------------------------------
SGLANG_DROPPED = {"--tp-size", "--dtype", "--mem-fraction-static"}   # one CPU device each


def translate(argv: list[str], node_address: str, compile_cache: str,
              num_slots: int) -> list[str]:
  """The batch script's python arguments, as run here: SGLang's launch_server becomes
  our server (the same HTTP API) and 0.0.0.0 the node's own loopback address."""
  args = list(argv)
  for i, a in enumerate(args[:-1]):
    if a == "--host" and args[i + 1] == "0.0.0.0":
      args[i + 1] = node_address
  if args[:2] != ["-m", "sglang.launch_server"]:
    return args
  out = ["-m", "rstar_jax.rollout.api_server", "--num_slots", str(num_slots),
         "--min_prefill_bucket", "16", "--compile_cache", compile_cache]
  rest = args[2:]
  i = 0
  names = {"--model-path": "--hf_dir", "--context-length": "--max_len", "--host": "--host",
           "--port": "--port"}
  while i < len(rest):
    a = rest[i]
    if a in names:
      out += [names[a], rest[i + 1]]
      i += 2
    elif a in SGLANG_DROPPED:
      i += 2
    elif a == "--enable-deterministic-inference":
      out.append(a)
      i += 1
    else:
      raise SystemExit(f"local_slurm python: SGLang flag {a!r} has no counterpart in "
                       "rstar_jax.rollout.api_server")
  return out


def python_main(argv: list[str]) -> None:
  node = os.environ.get("SLURMD_NODENAME", "")
  address = socket.gethostbyname(node) if node else CTL_ADDR
  cache = os.environ.get("REHEARSAL_COMPILE_CACHE", os.path.join(REPO, ".compile_cache"))
  args = translate(argv, address, cache, int(os.environ.get("REHEARSAL_NUM_SLOTS", "16")))
  env_ = dict(os.environ)
  if args[:2] == ["-m", "rstar_jax.rollout.api_server"]:
    # One CPU device per server, as one GPU per SGLang server.
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                   env_.get("XLA_FLAGS", "")).strip()
    env_["XLA_FLAGS"] = flags
  os.execve(sys.executable, [sys.executable, *args], env_)


# ---- the rehearsal ---------------------------------------------------------------------
def _shim(d: str) -> str:
  path = os.path.join(d, "bin", "python")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.write(f"#!/bin/bash\nexec {sys.executable} -m experiments.local_slurm python \"$@\"\n")
  os.chmod(path, 0o755)
  return path


def rehearsal_env(d: str, shared: str, extra_args: str = "") -> dict[str, str]:
  """The batch script's documented variables, and the CPU stand-ins for GPUs;
  `extra_args`: more --config overrides in EXTRA_ARGS."""
  e = env(d)
  e.update(SHARED=shared, REPO=REPO, CKPT=os.path.join(shared, "sft", "sft", "export"),
           CONFIG=REHEARSAL, PYTHON=_shim(d), GPU_VAR="CUDA_VISIBLE_DEVICES",
           SGLANG_ARGS="--enable-deterministic-inference", STOP_GRACE="300",
           RESTART_BACKOFF="1", HEALTH_POLL="1",
           JAX_PLATFORMS="cpu", PYTHONPATH=REPO,
           XLA_FLAGS=f"--xla_force_host_platform_device_count={GPUS}",
           REHEARSAL_COMPILE_CACHE=os.path.join(shared, "compile_cache"),
           # one XLA cache for SFT, RL and the servers: a requeued job skips the compiles
           EXTRA_ARGS=f"--config.compile_cache_dir={shared}/compile_cache {extra_args}".strip())
  e.pop("CUDA_VISIBLE_DEVICES", None)
  return e


def sft(d: str, shared: str, timeout: float = 1500) -> float:
  """The SFT stage as on the cluster: `sbatch experiments/slurm/rstar2_14b_sft.sbatch`
  with the overlay's :sft variant (4 tasks, one a trainer node, 8 devices each; its
  export, <shared>/sft/sft/export, is the batch script's CKPT). Its log: <shared>/sft.log."""
  t0 = time.monotonic()
  work = os.path.join(shared, "sft")
  if os.path.exists(os.path.join(work, "sft", "DONE.json")):
    return 0.0
  env = rehearsal_env(d, shared)
  env.update(CONFIG=f"{REHEARSAL}:sft", WORKDIR=work, BASE="")   # BASE empty: a random tiny model
  out = subprocess.run(["sbatch", "--parsable", SFT_SBATCH], env=env, cwd=shared,
                       capture_output=True, text=True, timeout=60)
  if out.returncode:
    raise RuntimeError(f"sbatch: {out.stderr}")
  job = out.stdout.strip().split(";")[0]
  info = wait_job(d, job, timeout)
  log = _read(os.path.join(shared, f"rstar2-14b-sft-{job}.out"))
  with open(os.path.join(shared, "sft.log"), "w") as f:
    f.write(log)
  if info.get("JobState") != "COMPLETED":
    raise RuntimeError(f"SFT job {job}: {info.get('JobState')} exit {info.get('ExitCode')}:\n"
                       f"{log[-4000:]}")
  return time.monotonic() - t0


def job_info(d: str, job: str) -> dict[str, str]:
  out = _run(d, "scontrol", "show", "job", "-o", job, check=False)
  return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def submit(d: str, shared: str, extra_args: str = "") -> str:
  out = subprocess.run(["sbatch", "--parsable", SBATCH],
                       env=rehearsal_env(d, shared, extra_args),
                       cwd=shared, capture_output=True, text=True, timeout=60)
  if out.returncode:
    raise RuntimeError(f"sbatch: {out.stderr}")
  return out.stdout.strip().split(";")[0]


def wait_job(d: str, job: str, timeout: float, on_poll=None) -> dict[str, str]:
  deadline = time.monotonic() + timeout
  info = {}
  while time.monotonic() < deadline:
    info = job_info(d, job)
    if on_poll is not None:
      on_poll(info)
    if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"):
      return info
    time.sleep(1)
  raise TimeoutError(f"job {job} not finished after {timeout:.0f} s: {info.get('JobState')}")


def final_table(workdir: str) -> str:
  with open(os.path.join(workdir, "eval_final.json")) as f:
    report = json.load(f)
  return json.dumps({k: v for k, v in report.items() if "time" not in k}, sort_keys=True)


def rehearse(d: str, shared: str, interrupt: str = "none", timeout: float = 1500) -> dict:
  d, shared = os.path.abspath(d), os.path.abspath(shared)
  os.makedirs(shared, exist_ok=True)
  t0 = time.monotonic()
  sft_s = sft(d, shared)
  job = submit(d, shared)
  workdir = os.path.join(shared, "runs", job)
  out_path = os.path.join(shared, f"rstar2-14b-{job}.out")     # the script's --output
  done = {"acted": False}

  def act(info):
    if done["acted"] and not done.get("restored") and int(info.get("Restarts", "0")) >= 1:
      # Requeued: the limit back to the script's, or the rerun would be signalled too.
      _run(d, "scontrol", "update", f"JobId={job}", "TimeLimit=7-00:00:00", check=False)
      done["restored"] = True
    if done["acted"] or info.get("JobState") != "RUNNING":
      return
    if interrupt == "signal":
      # As stage 1 starts: the signal comes within the controller's next time-limit
      # check (every 30 s), so the trainer stops after a step of stage 1, mid-stage.
      if "weight sync stage1-step0" not in _read(out_path):
        return
      # SLURM's own time-limit signal: the limit moved to 30 min ahead, so the job's
      # --signal=B:USR1@1800 is due at the controller's next time-limit check.
      run_min = _minutes(info.get("RunTime", "0:0"))
      _run(d, "scontrol", "update", f"JobId={job}", f"TimeLimit={run_min + 30}")
    elif interrupt == "kill":
      # Step 1's checkpoint complete (the script's own test of one): kill during step 2.
      if not glob.glob(os.path.join(workdir, "stage1", "checkpoints", "*",
                                    "commit_success.txt")):
        return
      victim = _trainer_task(d, node=f"{NODE_PREFIX}1")
      os.kill(victim, signal.SIGKILL)
      print(f"SIGKILLed trainer task {victim} on {NODE_PREFIX}1", flush=True)
    done["acted"] = True

  info = wait_job(d, job, timeout, act if interrupt != "none" else None)
  log = _read(out_path)
  return dict(job=job, state=info.get("JobState"), exit=info.get("ExitCode"),
              restarts=int(info.get("Restarts", "0")), workdir=workdir, log=log,
              sft_s=sft_s, total_s=time.monotonic() - t0,
              table=final_table(workdir) if info.get("JobState") == "COMPLETED" else None)


def _read(path: str) -> str:
  try:
    with open(path, errors="replace") as f:
      return f.read()
  except FileNotFoundError:
    return ""


def _minutes(runtime: str) -> int:
  days = 0
  if "-" in runtime:
    day, runtime = runtime.split("-", 1)
    days = int(day)
  parts = [int(x) for x in runtime.split(":")]
  while len(parts) < 3:
    parts.insert(0, 0)
  h, m, s = parts
  return days * 1440 + h * 60 + m     # whole minutes run: the limit is due at once


def _trainer_task(d: str, node: str) -> int:
  """The trainer process (experiments.recipe) that SLURM started on `node`."""
  for pid in _job_pids(d):
    try:
      cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
      environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
      continue
    if (b"experiments.recipe" in cmd and b"python" in os.path.basename(cmd[0])
        and f"SLURMD_NODENAME={node}".encode() in environ):
      return pid
  raise RuntimeError(f"no trainer task on {node}")


def main(argv=None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  if argv and argv[0] == "python":
    return python_main(argv[1:])
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("command", choices=("up", "down", "rehearse"))
  p.add_argument("--dir", default="/tmp/rstar_slurm", help="config, state and logs")
  p.add_argument("--nodes", type=int, default=8)
  p.add_argument("--shared", default="", help="the run's storage (default <dir>/shared)")
  p.add_argument("--interrupt", choices=("none", "signal", "kill"), default="none")
  a = p.parse_args(argv)
  if a.command == "up":
    up(a.dir, a.nodes)
  elif a.command == "down":
    left = down(a.dir)
    if left:
      raise SystemExit(f"still running: {left}")
    print("stopped; nothing left running")
  else:
    t0 = time.monotonic()
    r = rehearse(a.dir, a.shared or os.path.join(a.dir, "shared"), a.interrupt)
    print(r["log"])
    print(f"job {r['job']}: {r['state']} exit {r['exit']}, restarts {r['restarts']}, "
          f"SFT {r['sft_s']:.0f} s, total {time.monotonic() - t0:.0f} s")
    print(f"final table: {r['table']}")
    if r["state"] != "COMPLETED":
      raise SystemExit(1)


if __name__ == "__main__":
  main()
