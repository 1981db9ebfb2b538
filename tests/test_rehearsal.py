"""The 14B run rehearsed: the unchanged batch script on a real local SLURM.

`experiments.local_slurm` starts Debian's slurmctld and 8 slurmd's (one virtual node
each, 8 fake GPUs each, every daemon and server on 127.0.0.x); the rehearsal overlay
(experiments/configs/rstar2_agent_14b_rehearsal.py) keeps the 14B config's stages,
process layout, mesh and backends with tiny sizes. SFT runs through
`sbatch experiments/slurm/rstar2_14b_sft.sbatch` (4 tasks), then
`sbatch experiments/slurm/rstar2_14b.sbatch` with only its environment variables set
runs RL stages 1-3 and the evaluation. Nothing is mocked: SLURM signals, requeues and
kills for real. The same rehearsal also runs through experiments.launch_cluster on a
real Ray head at 127.0.0.1. All of it runs in CI: ~20-25 minutes on 2 cores, so
tests/conftest.py starts the file first (LONGEST_FILES_FIRST).
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import pytest

from experiments import local_slurm

# A hang guard, not a bound: each requeue restarts the servers and the trainer's four
# processes (~2 min on a busy 2-core host), and a run may be requeued more than once.
REHEARSAL_TIMEOUT = pytest.mark.timeout(1800)

pytestmark = pytest.mark.skipif(
    shutil.which("slurmctld") is None or shutil.which("slurmd") is None or os.geteuid() != 0,
    reason="needs root and Debian's slurmctld, slurmd, slurm-client (.ci/run installs them)")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("slurm"))
  local_slurm.up(d)
  try:
    yield d, str(tmp_path_factory.mktemp("shared"))
  finally:
    local_slurm.down(d)


@pytest.fixture(scope="module")
def straight(cluster):
  return local_slurm.rehearse(*cluster)


def _metrics(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _check_run(r):
  assert r["state"] == "COMPLETED" and r["exit"] == "0:0", r["log"][-5000:]
  for stage, steps in (("stage1", 2), ("stage2", 1), ("stage3", 1)):
    assert os.path.exists(os.path.join(r["workdir"], stage, "DONE.json")), stage
    rows = _metrics(os.path.join(r["workdir"], stage, "metrics_rl.jsonl"))
    assert sorted({row["step"] for row in rows}) == list(range(1, steps + 1)), (stage, rows)
  assert "pass@1" in r["log"] and r["table"]


@REHEARSAL_TIMEOUT   # it bears the module's SFT and uninterrupted rehearsal
def test_the_batch_script_runs_sft_rl_and_eval_on_a_real_slurm(cluster, straight):
  d, shared = cluster
  _check_run(straight)
  assert straight["restarts"] == 0 and "requeue" not in straight["log"]
  assert "[slurm] trainer exited 0" in straight["log"]
  # SFT and RL as the 14B layout's 4 trainer processes, 8 devices each, one mesh of 32.
  sft_log = open(os.path.join(shared, "sft.log")).read()
  for log in (sft_log, straight["log"]):
    assert "process 0 of 4, 8 local / 32 global devices" in log, log[-3000:]
  cfg = json.load(open(os.path.join(straight["workdir"], "config.json")))
  assert cfg["mesh"]["fsdp"] == 8 and cfg["mesh"]["tensor"] == 4
  assert cfg["rollout"]["backend"] == "sglang"
  # Servers at the nodes' names, which are loopback addresses; every one answered.
  servers, sandboxes = cfg["rollout"]["servers"], cfg["tools"]["urls"]
  assert list(servers) == [f"http://node{k}:30000" for k in range(4, 8)], servers
  assert list(sandboxes) == [f"http://node{k}:8321" for k in range(4)], sandboxes
  for url in (*servers, *sandboxes):
    host = re.match(r"http://([^:]+):", url).group(1)
    assert socket.gethostbyname(host).startswith("127.0.0."), url
  logs = os.path.join(straight["workdir"], "logs")
  for k in range(4, 8):
    text = open(os.path.join(logs, f"sglang-node{k}-0.log")).read()
    assert f"127.0.0.{10 + k}:30000" in text, text[-2000:]
  rows = _metrics(os.path.join(straight["workdir"], "stage1", "metrics_rl.jsonl"))
  assert all(row["sync/servers"] == 4.0 for row in rows)


def _same_table(r, straight):
  assert r["table"] == straight["table"], (r["table"], straight["table"])
  for stage in ("stage1", "stage2", "stage3"):
    a = _metrics(os.path.join(straight["workdir"], stage, "metrics_rl.jsonl"))
    b = _metrics(os.path.join(r["workdir"], stage, "metrics_rl.jsonl"))
    b = list({row["step"]: row for row in b}.values())   # a step redone after a kill
    assert [row["step"] for row in b] == [row["step"] for row in a], stage
    for ra, rb in zip(a, b):
      for k, v in ra.items():
        if not k.startswith("time/") and not k.startswith("sync/"):
          assert rb.get(k) == v, (stage, ra["step"], k, v, rb.get(k))


def test_a_config_error_in_the_trainer_ends_the_job_failed_without_a_requeue(cluster):
  """An override the layout check passes but the trainer refuses (exit 2 from every
  task): the job ends FAILED with the trainer's message and is never requeued. srun
  alone said 143: --kill-on-bad-exit SIGTERMs the other tasks as soon as the first
  exits, and the job was requeued MAX_RESTARTS times, failing the same way each time."""
  d, shared = cluster
  local_slurm.sft(d, shared)        # the servers start from its export (done once a module)
  job = local_slurm.submit(d, shared, extra_args="--config.eval.k=0")
  info = local_slurm.wait_job(d, job, timeout=900)
  log = local_slurm._read(os.path.join(shared, f"rstar2-14b-{job}.out"))
  assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "2:0", "0"), \
      (info, log[-5000:])
  assert "config error: config.eval: EvalConfig.k must be >= 1, got 0" in log, log[-5000:]
  assert re.search(r"\[slurm\] trainer exited 2 \(tasks: [0-9 ]*\b2\b", log), log[-5000:]
  assert "exit 2 (a config or usage error): not requeued" in log, log[-5000:]
  assert "requeued in" not in log and "restart 1" not in log, log[-5000:]


@REHEARSAL_TIMEOUT
def test_the_time_limit_signal_checkpoints_requeues_and_resumes_to_the_same_table(
    cluster, straight):
  r = local_slurm.rehearse(*cluster, interrupt="signal")
  _check_run(r)
  log = r["log"]
  assert r["restarts"] >= 1, log[-5000:]
  assert "[slurm] time limit near: stopping the trainer at its next step boundary" in log
  assert "SIGUSR2 received: stopping at the next step boundary" in log
  assert "interrupted: stopped by SIGUSR2" in log and "(checkpoint saved" in log
  assert log.count("[slurm] trainer exited") >= 2
  # Every task stopped on its own (140, which the task reports to srun as 0): none was
  # SIGTERMed by --kill-on-bad-exit while finishing its part of the stop.
  stopped = log.split("[slurm] time limit near", 1)[1].split("[slurm] trainer exited", 1)
  assert "[slurm] trainer exited 140 (tasks: 140)" in log, log[-5000:]
  assert "Terminating StepId" not in stopped[0], stopped[0][-5000:]
  _same_table(r, straight)


@REHEARSAL_TIMEOUT
def test_a_killed_trainer_task_is_requeued_and_resumes_to_the_same_table(cluster, straight):
  r = local_slurm.rehearse(*cluster, interrupt="kill")
  _check_run(r)
  log = r["log"]
  assert r["restarts"] >= 1, log[-5000:]
  assert re.search(r"\[slurm\] trainer failed: exit \d+; restart 1 of at most 3 within "
                   r"3600 s: requeued in 1 s, resuming from .*/stage1/checkpoints/\d+", log), \
      log[-5000:]
  _same_table(r, straight)


def test_the_cluster_comes_down_leaving_nothing_running(cluster, straight):
  d, _ = cluster
  daemons = local_slurm._daemon_pids(d)
  assert len(daemons) == 1 + 8                  # slurmctld and one slurmd a node
  assert local_slurm.down(d) == []
  assert not any(local_slurm._alive(p) for p in daemons)


def _host_address() -> str:
  """This host's own (non-loopback) address: the one a server must never be reached at."""
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    s.connect(("198.51.100.1", 9))    # no packet is sent; the route picks the interface
    return s.getsockname()[0]


def _stop_by_environ(marker: str) -> list[int]:
  """SIGKILLs the processes whose environment holds `marker` (this test's Ray processes,
  renamed `ray::...` ones too); returns those found."""
  want = marker.encode()
  found = []
  for name in os.listdir("/proc"):
    if not name.isdigit() or int(name) == os.getpid():
      continue
    try:
      with open(f"/proc/{name}/environ", "rb") as f:
        if want not in f.read().split(b"\0"):
          continue
      os.kill(int(name), signal.SIGKILL)
      found.append(int(name))
    except (OSError, ProcessLookupError):
      continue
  return found


def _stop_all_by_environ(marker: str, within_s: float = 60.0) -> list[int]:
  """SIGKILLs the marked processes until none is left; returns those still found after
  `within_s`. One sweep is not enough: a process Ray started during the sweep (a worker
  for a task in flight) escapes it, and a killed one is listed until it has exited."""
  import time
  deadline = time.monotonic() + within_s
  while (found := _stop_by_environ(marker)) and time.monotonic() < deadline:
    time.sleep(0.5)
  return found


@REHEARSAL_TIMEOUT
def test_the_same_rehearsal_through_launch_cluster_on_a_local_ray_cluster(cluster, straight,
                                                                         tmp_path):
  """experiments.launch_cluster with the overlay's :cluster fleet (4 sandbox servers, 4 of
  our rollout servers, 4 trainer processes of 8 CPU devices) on a real Ray head whose node
  IP is 127.0.0.1: every server is reached at a loopback address, never this host's own."""
  _, shared = cluster
  temp = tempfile.mkdtemp(prefix="rr", dir="/tmp")     # short: Ray's socket paths
  marker = f"RSTAR_REHEARSAL_RAY={temp}"
  port = local_slurm._free_port("127.0.0.1")
  env = dict(os.environ, PYTHONPATH=local_slurm.REPO, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8",
             # Ray turns 127.0.0.1 into the host's own address unless told this is a
             # one-machine cluster (ray._private.services.resolve_ip_for_localhost).
             RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled",
             # Ray starts its workers at nice 15: beside a busy CI worker the trainer's
             # processes then reach a collective's first use >30 s apart, gloo's deadline.
             RAY_worker_niceness="0",
             RSTAR_REHEARSAL_RAY=temp)
  env.pop("RAY_ADDRESS", None)
  sft = os.path.join(shared, "sft", "sft", "export")
  work = tmp_path / "ray"
  args = (f"--config.workdir={work}", f"--config.model.hf_dir={sft}",
          f"--config.tokenizer.path={sft}", f"--config.rollout.weight_sync.dir={work}/weights",
          f"--config.compile_cache_dir={shared}/compile_cache",
          "--stages=stage1,stage2,stage3,eval")
  ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
  try:
    head = subprocess.run([ray_bin, "start", "--head", "--node-ip-address=127.0.0.1",
                           f"--port={port}", "--num-cpus=4", "--num-gpus=0",
                           "--include-dashboard=false", f"--temp-dir={temp}",
                           "--disable-usage-stats"], env=env, capture_output=True, text=True,
                          timeout=180)
    assert head.returncode == 0, head.stdout + head.stderr
    assert "Local node IP: 127.0.0.1" in head.stdout + head.stderr, head.stdout + head.stderr
    out = subprocess.run(
        [sys.executable, "-m", "experiments.launch_cluster", "--config",
         f"{local_slurm.REHEARSAL}:cluster", f"--config.cluster.ray_address=127.0.0.1:{port}",
         f"--config.cluster.rollout_hf_dir={sft}",
         "--config.cluster.trainer_args=(" + "".join(f"'{a}'," for a in args) + ")",
         f"--config.cluster.log_dir={work}/cluster_logs", "--timeout_s=1500"],
        cwd=local_slurm.REPO, env=env, capture_output=True, text=True, timeout=1800)
  finally:
    left = _stop_all_by_environ(marker)
    shutil.rmtree(temp, ignore_errors=True)
  log = out.stdout + out.stderr
  assert out.returncode == 0, log[-6000:]
  urls = re.findall(r"http://[0-9.]+:\d+", log)
  assert len(set(urls)) >= 8, log[-6000:]            # 4 sandbox + 4 rollout servers
  assert all(u.startswith("http://127.0.0.1:") for u in urls), sorted(set(urls))
  assert _host_address() not in log
  for stage, steps in (("stage1", 2), ("stage2", 1), ("stage3", 1)):
    rows = _metrics(os.path.join(work, stage, "metrics_rl.jsonl"))
    assert sorted({row["step"] for row in rows}) == list(range(1, steps + 1)), stage
  assert local_slurm.final_table(str(work)) == straight["table"]   # as under SLURM
  assert not left, left                             # nothing of the cluster left running
