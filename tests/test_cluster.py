"""rstar_jax.recipe.cluster: the launch config's checks, the commands it builds, and stopping a
fleet on a real local Ray (the whole fleet runs an RL stage in tests/test_recipe.py)."""
import ast
import os
import queue as queue_lib

import pytest

from experiments.common import standin_trainers
from rstar_jax.recipe import cluster


def test_config_checks_name_the_field():
  with pytest.raises(ValueError, match="rollout_backend='vllm'"):
    cluster.ClusterConfig(rollout_backend="vllm", rollout_hf_dir="/m")
  with pytest.raises(ValueError, match="rollout_hf_dir"):
    cluster.ClusterConfig(rollout_servers=1)
  with pytest.raises(ValueError, match="sandbox_servers must be >= 0"):
    cluster.ClusterConfig(sandbox_servers=-1, rollout_servers=0)
  with pytest.raises(ValueError, match="trainer_gpus must be >= 0"):
    cluster.ClusterConfig(rollout_servers=0, trainer_gpus=-1)
  cluster.ClusterConfig(rollout_servers=0)   # servers-only fleets need no checkpoint


def test_server_commands():
  cfg = cluster.ClusterConfig(rollout_hf_dir="/ckpt", rollout_args=("--num_slots", "8"),
                              sandbox_args=("--max-children", "64"))
  sb = cluster.server_command("sandbox", cfg, "10.0.0.1", 8321)
  assert sb[1:] == ["-m", "sandbox.server", "--host", "10.0.0.1", "--port", "8321",
                    *(["--allow-weak-isolation"] if "--allow-weak-isolation" in sb else []),
                    "--max-children", "64"]
  ours = cluster.server_command("rollout", cfg, "10.0.0.1", 30000)
  assert ours[1:5] == ["-m", "rstar_jax.rollout.api_server", "--hf_dir", "/ckpt"]
  assert ours[-2:] == ["--num_slots", "8"]
  sg = cluster.server_command("rollout", cluster.ClusterConfig(
      rollout_backend="sglang", rollout_hf_dir="/ckpt"), "h", 30001)
  assert sg[1:] == ["-m", "sglang.launch_server", "--model-path", "/ckpt", "--host", "h",
                    "--port", "30001"]


def test_url_tuples_are_config_literals():
  urls = ["http://a:1", "http://b:2"]
  assert ast.literal_eval(cluster._tuple_text(urls)) == tuple(urls)
  assert ast.literal_eval(cluster._tuple_text(urls[:1])) == ("http://a:1",)


_FAKE_TRAINER = '''
import os, signal, sys, time
mark = os.environ["FAKE_TRAINER_MARK"]
def term(signum, frame):
  open(mark, "a").write("saved on signal %d\\n" % signum)
  sys.exit(0)
signal.signal(signal.SIGTERM, term)
open(mark, "a").write("started HF_HOME=%s args=%s\\n" % (os.environ.get("HF_HOME"), sys.argv[1:]))
while True:
  time.sleep(0.1)
'''


def test_a_stopped_fleet_stops_its_trainer_gracefully_and_forwards_the_environment(
    tmp_path, monkeypatch):
  """On a real local Ray: shutting the fleet down while wait_trainers blocks (launch_cluster's
  Ctrl-C) sends the trainer SIGTERM at once; queued behind wait it took 90 s and then
  killed the trainer unsaved. Variables set in the launching shell reach the trainer
  even where Ray's workers do not inherit them (set here after Ray started)."""
  ray = pytest.importorskip("ray")
  import threading
  import time
  (tmp_path / "fake_trainer.py").write_text(_FAKE_TRAINER)
  mark = tmp_path / "mark"
  ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, runtime_env={
      "env_vars": {"PYTHONPATH": os.pathsep.join([cluster.REPO, str(tmp_path)]),
                   "FAKE_TRAINER_MARK": str(mark)}})
  try:
    monkeypatch.setenv("HF_HOME", "/forwarded/hf")
    fleet = cluster.Cluster(cluster.ClusterConfig(
        sandbox_servers=0, rollout_servers=0, trainer_processes=1, trainer_cpus=1.0,
        trainer_module="fake_trainer", trainer_config="none.py", log_dir=str(tmp_path / "logs")))
    fleet.start_trainers()
    waited = []

    def wait():
      try:
        waited.append(fleet.wait_trainers())
      except Exception as e:  # noqa: BLE001 - the actor killed under the wait: reported
        waited.append(e)
    waiter = threading.Thread(target=wait)
    waiter.start()
    while not mark.exists():   # no deadline: pytest-timeout ends a hang with the stacks
      time.sleep(0.1)
    fleet.shutdown()
    waiter.join()
  finally:
    ray.shutdown()
  text = mark.read_text()
  assert "started HF_HOME=/forwarded/hf" in text and "num_processes=1" in text, text
  # Order of events, not a time: the pending wait returned the trainer's own exit code 0
  # (it saved on SIGTERM and exited while the wait was blocked). Queued behind the wait,
  # the stop would instead have run only after the wait's timeout, when the actor and the
  # unsaved trainer were killed (the wait then fails, or the trainer is no 0).
  assert "saved on signal 15" in text, text
  assert waited == [[0]], waited


def _wait(pred, what: str = ""):
  """Until pred() holds (`what` names it for a reader): no deadline (pytest-timeout ends
  a hang with every stack)."""
  import time
  while not pred():
    time.sleep(0.1)


class _Clock:
  """cluster's `time` module with a monotonic clock the test moves forward: the restart
  window and the hang timeout are then passed by moving the clock, not by sleeping, and a
  burst is a burst however slow the host is."""

  def __init__(self):
    import time
    self._time, self.offset = time, 0.0
    self.sleep, self.perf_counter = time.sleep, time.perf_counter

  def monotonic(self) -> float:
    return self._time.monotonic() + self.offset


def test_a_server_is_restarted_when_it_hangs_and_restarts_far_apart_do_not_add_up(
    tmp_path, monkeypatch):
  """ServerProcess (the body of a fleet's server actor) on a real sandbox server: a
  server that stops answering /health (SIGSTOP) is killed and restarted on its port;
  exits further apart than restart_window_s never exhaust max_restarts (a long run lost
  a server for good after its 3rd crash, however many days apart), while exits in a
  burst still do."""
  pytest.importorskip("ray")
  import signal
  clock = _Clock()
  monkeypatch.setattr(cluster, "time", clock)
  # Windows far longer than anything the host takes: only the clock's moves pass them.
  cfg = cluster.ClusterConfig(rollout_servers=0, sandbox_args=("--max-children", "2"),
                              max_restarts=1, restart_window_s=1000.0, hang_timeout_s=100.0,
                              log_dir=str(tmp_path), startup_timeout_s=1e6)
  env = {}
  if os.environ.get("SANDBOX_ALLOW_WEAK_ISOLATION") == "1":
    env["SANDBOX_ALLOW_WEAK_ISOLATION"] = "1"
  srv = cluster.ServerProcess("sandbox", 0, cfg, env)
  try:
    first = srv.proc.pid
    os.kill(first, signal.SIGSTOP)                 # alive, but answers nothing...
    clock.offset += cfg.hang_timeout_s + 1         # ...for longer than hang_timeout_s
    _wait(lambda: srv.hangs == 1 and srv.proc.pid != first and cluster._healthy(srv.url))
    assert srv.restarts == 1 and not srv.gave_up
    second = srv.proc.pid
    clock.offset += cfg.restart_window_s + 1       # the first restart is now old
    os.kill(second, signal.SIGKILL)                # (before the supervisor probes again)
    _wait(lambda: srv.proc.pid != second)          # the second restart, a window later
    assert srv.restarts == 2 and not srv.gave_up and srv.hangs == 1
    # A second exit within the window (the clock has not moved): given up.
    os.kill(srv.proc.pid, signal.SIGKILL)
    _wait(lambda: bool(srv.gave_up))
    assert "after 1 restart(s) within 1000 s" in srv.gave_up, srv.gave_up
    log = srv.log_tail(20000)
    assert "has not answered /health" in log and "given up" in log, log
  finally:
    srv.stop()


# A stand-in for one process of a 2-process trainer job: 12 steps of a deterministic
# state (a hash chain of the step and the process), checkpointed atomically after every
# step (write, then rename, as orbax does) and resumed from it, with the real trainer's
# "resumed ... at step N" line. Its final state depends only on the steps it ran.
_RESUMING_TRAINER = '''
import hashlib, json, os, sys, time
work = os.environ["FAKE_TRAINER_WORK"]
arg = lambda k, d: next((a.split("=", 1)[1] for a in sys.argv if a.startswith(k + "=")), d)
idx = int(arg("--config.distributed.process_id", "0"))
if os.path.exists(os.path.join(work, "always_fail")):
  sys.exit(int(open(os.path.join(work, "always_fail")).read()))
ckpt = os.path.join(work, "ckpt%d.json" % idx)
step, acc = 0, "start%d" % idx
if os.path.exists(ckpt):
  step, acc = json.load(open(ckpt))
  print("resumed FAKE from %s at step %d" % (ckpt, step), flush=True)
open(os.path.join(work, "pid%d" % idx), "w").write(str(os.getpid()))
while step < 12:
  # Past step 6 only once the test has restarted the job after killing its victim: on a
  # loaded host process 0 (started first) could otherwise finish all 12 steps before
  # process 1 reached step 3, or save step 7 before the supervisor stopped it.
  while step == 6 and not os.path.exists(os.path.join(work, "go")):
    time.sleep(0.05)
  time.sleep(0.15)
  acc = hashlib.sha256(("%s/%d" % (acc, step)).encode()).hexdigest()
  step += 1
  json.dump([step, acc], open(ckpt + ".tmp", "w"))
  os.replace(ckpt + ".tmp", ckpt)
open(os.path.join(work, "final%d" % idx), "w").write(acc)
'''


def _uninterrupted(idx, steps=12):
  import hashlib
  acc = "start%d" % idx
  for step in range(steps):
    acc = hashlib.sha256(("%s/%d" % (acc, step)).encode()).hexdigest()
  return acc


def test_a_killed_trainer_process_restarts_the_whole_job_from_its_checkpoint(tmp_path):
  """On a real local Ray: SIGKILL one process of a 2-process trainer job mid-run; the
  supervisor kills the other, waits the back-off, restarts both, and they resume from
  their checkpoints and finish with the uninterrupted run's result. The restart is logged
  with its cause and resumed step. A job that fails at every start is given up after
  max_restarts; a config error (exit 2) is not restarted at all."""
  ray = pytest.importorskip("ray")
  import signal
  (tmp_path / "fake_trainer.py").write_text(_RESUMING_TRAINER)
  work = tmp_path / "work"
  work.mkdir()
  ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={
      "env_vars": {"PYTHONPATH": os.pathsep.join([cluster.REPO, str(tmp_path)]),
                   "FAKE_TRAINER_WORK": str(work)}})
  cfg = dict(sandbox_servers=0, rollout_servers=0, trainer_processes=2, trainer_cpus=0.5,
             trainer_module="fake_trainer", trainer_config="none.py", max_restarts=2,
             restart_backoff_s=0.2, log_dir=str(tmp_path / "logs"))
  try:
    fleet = cluster.Cluster(cluster.ClusterConfig(**cfg))
    try:
      result = {}

      def kill_second_mid_run():
        _wait(lambda: (work / "ckpt1.json").exists()
              and __import__("json").loads((work / "ckpt1.json").read_text())[0] >= 3,
              "process 1's third step")
        result["pid0"] = int((work / "pid0").read_text())
        os.kill(int((work / "pid1").read_text()), signal.SIGKILL)
        # Past step 6 only after the supervisor has restarted the job: released at the
        # kill, a fast process 0 could save step 7 before the supervisor stopped it.
        pid0 = lambda: (work / "pid0").read_text().strip()
        _wait(lambda: pid0() not in ("", str(result["pid0"])), "process 0's restart")
        (work / "go").write_text("")

      import threading
      killer = threading.Thread(target=kill_second_mid_run)
      killer.start()
      codes = fleet.run_trainers()
      killer.join()
    finally:
      fleet.shutdown()
    assert codes == [0, 0], codes
    assert len(fleet.restarts) == 1, fleet.restarts
    r = fleet.restarts[0]
    assert r["cause"] == "trainer 1 killed by SIGKILL (kill -9, or the kernel's OOM killer)", r
    assert 3 <= r["resumed_step"] <= 6, r
    assert int((work / "pid0").read_text()) != result["pid0"]   # process 0 was restarted too
    for idx in (0, 1):
      assert (work / f"final{idx}").read_text() == _uninterrupted(idx)
    log = (tmp_path / "logs" / "cluster.log").read_text()
    assert "restart 1: trainer 1 killed by SIGKILL" in log, log
    assert f"restart 1 resumed from step {r['resumed_step']}" in log, log

    # Fails at every start: given up after max_restarts, back-off doubling.
    (work / "always_fail").write_text("1")
    fleet = cluster.Cluster(cluster.ClusterConfig(**{**cfg, "trainer_processes": 1}))
    try:
      codes = fleet.run_trainers()
    finally:
      fleet.shutdown()
    assert codes == [1] and [r["backoff_s"] for r in fleet.restarts] == [0.2, 0.4]
    assert "given up after 2 restart(s)" in (tmp_path / "logs" / "cluster.log").read_text()

    (work / "always_fail").write_text("2")
    fleet = cluster.Cluster(cluster.ClusterConfig(**{**cfg, "trainer_processes": 1}))
    try:
      codes = fleet.run_trainers()
    finally:
      fleet.shutdown()
    assert codes == [2] and fleet.restarts == []
  finally:
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("live", [True, False], ids=["live", "restart"])
def test_a_lost_node_s_servers_move_and_the_trainer_follows_their_new_urls(tmp_path, live):
  """A real two-node Ray cluster on this machine (`ray start --head` and a second
  `ray start --address`, in its own process group): the second node has room for one
  sandbox server only. Killing that node's processes (its process group, by id) loses
  the server's actor; the supervisor re-creates it on the head node under a new URL.
  live: the running trainer (real tools client, calling all along) follows the fleet
  file and is never restarted; restart (`live_server_moves=False`): the trainer job is
  restarted with the new URLs. The driver runs in a fresh process, so that no Ray state
  of an earlier test in this process carries over."""
  import json
  out = _on_ray_nodes(tmp_path, _lose_a_server_node, standin_trainers.URL_TRAINER,
                      head_cpus=3, node_cpus=(1,), live=live)
  before, after = out["before"], out["after"]
  assert out["codes"] == [0]
  moved = [i for i in range(2) if before[i] != after[i]]
  assert len(moved) == 1, (before, after)     # the second node held one server
  assert out["healthy"] == [True, True]
  starts = [json.loads(line) for line in out["starts"]]
  calls = [json.loads(line) for line in out["calls"]]
  assert calls and all(c["status"] == "ok" and c["stdout"].strip() == "7" for c in calls), calls
  if live:
    assert starts == [before] and out["restarts"] == [], (starts, out["restarts"])
    assert calls[0]["urls"] == before and calls[-1]["urls"] == after
    assert "the running trainer follows the new URLs" in out["log"], out["log"]
  else:
    assert starts == [before, after], starts
    assert len(out["restarts"]) == 1 and "sandbox server" in out["restarts"][0]["cause"]


@pytest.mark.slow
def test_a_trainer_lost_with_its_node_is_replaced_on_another_and_resumes(tmp_path):
  """Two worker nodes with room for the trainer (2 CPUs each; the head has 1): the node
  that holds the trainer process (found by its process group) is killed mid-run. The
  supervisor sees the trainer's actor lost, re-creates it on the placement group's bundle
  (which Ray re-places on the other node), and the job resumes from its checkpoint and
  ends with the uninterrupted run's result."""
  out = _on_ray_nodes(tmp_path, _lose_the_trainer_s_node, _RESUMING_TRAINER, head_cpus=1,
                      node_cpus=(2, 2))
  assert out["codes"] == [0], out
  assert out["moved_to"] != out["held_by"], out
  assert len(out["restarts"]) == 1, out["restarts"]
  r = out["restarts"][0]
  assert r["cause"] == "trainer 0 lost (its actor or node is gone)", r
  assert 3 <= r["resumed_step"] <= 6, r
  assert out["final"] == _uninterrupted(0)
  assert f"restart 1 resumed from step {r['resumed_step']}" in out["log"], out["log"]


def _lose_the_trainer_s_node(tmp_path, work, nodes) -> dict:
  import json
  import signal
  import threading
  cfg = cluster.ClusterConfig(
      sandbox_servers=0, rollout_servers=0, trainer_processes=1, trainer_cpus=2.0,
      trainer_module="fake_trainer", trainer_config="none.py", restart_backoff_s=0.1,
      log_dir=str(tmp_path / "logs"), startup_timeout_s=120)
  fleet = cluster.Cluster(cfg)
  out = {}
  pid = lambda: (work / "pid0").read_text().strip() if (work / "pid0").exists() else ""
  holder = lambda p: _node_of(int(p), nodes)
  try:
    result = {}
    runner = threading.Thread(target=lambda: result.setdefault(
        "codes", fleet.run_trainers(server_check_s=1.0)))
    runner.start()
    _wait(lambda: (work / "ckpt0.json").exists()
          and json.loads((work / "ckpt0.json").read_text())[0] >= 3, "the third step")
    first = pid()
    out["held_by"] = holder(first)
    os.killpg(nodes[out["held_by"]].pid, signal.SIGKILL)   # the node and all it ran
    _wait(lambda: pid() not in ("", first), "the trainer's start on the other node")
    out["moved_to"] = holder(pid())
    (work / "go").write_text("")                  # past step 6 only after the restart
    runner.join()   # no deadline: a loaded host is slow, not wrong
    out["codes"] = result.get("codes")
    out["restarts"] = fleet.restarts
    out["final"] = (work / "final0").read_text() if (work / "final0").exists() else None
    out["log"] = (tmp_path / "logs" / "cluster.log").read_text()
  finally:
    fleet.shutdown()
  return out


def _node_of(pid: int, nodes) -> int:
  """Which of `nodes` (`ray start --block` processes) runs `pid`: the one among its
  ancestors (node -> raylet -> worker -> the trainer it started)."""
  pids = {n.pid: i for i, n in enumerate(nodes)}
  while pid > 1:
    if pid in pids:
      return pids[pid]
    with open(f"/proc/{pid}/stat") as f:
      pid = int(f.read().rsplit(")", 1)[1].split()[1])
  raise AssertionError("the process runs on none of the worker nodes")


def _on_ray_nodes(tmp_path, scenario, trainer_src: str, *, head_cpus: int,
                  node_cpus: tuple[int, ...], **kwargs) -> dict:
  """`scenario(tmp_path, work, nodes, **kwargs) -> dict` against a real multi-node Ray
  cluster on this machine: `ray start --head` with `head_cpus`, and one `ray start
  --address ... --block` per entry of `node_cpus`, each in its own process group (killed
  by its id, as a lost node). The fake trainer module is `trainer_src`. The driver runs in
  a fresh process, so that no Ray state of an earlier test in this process carries over."""
  pytest.importorskip("ray")
  import multiprocessing
  ctx = multiprocessing.get_context("spawn")
  queue = ctx.Queue()
  proc = ctx.Process(target=_ray_nodes_main, args=(str(tmp_path), queue, scenario,
                                                   trainer_src, head_cpus, node_cpus, kwargs))
  proc.start()
  try:
    # No deadline: until the cluster's process answers or dies (pytest-timeout ends a hang).
    while True:
      try:
        out = queue.get(timeout=1.0)
        break
      except queue_lib.Empty:
        if not proc.is_alive():   # what it put before it ended is already in the pipe
          try:
            out = queue.get(timeout=5.0)
          except queue_lib.Empty:
            out = {"error": f"the cluster's process ended (exit code {proc.exitcode}) unanswered"}
          break
  finally:
    proc.join(60)
    if proc.is_alive():
      proc.kill()
  assert "error" not in out, out.get("error")
  return out


def _ray_nodes_main(tmp: str, queue, scenario, trainer_src, head_cpus, node_cpus,
                    kwargs) -> None:
  import pathlib
  import shutil
  import signal
  import subprocess
  import sys
  import tempfile
  import traceback
  # A local ray.init earlier in the parent turned token authentication on in its
  # environment (inherited here); this cluster runs without, as a local ray.init's own.
  os.environ["RAY_AUTH_MODE"] = "disabled"
  import ray
  tmp_path = pathlib.Path(tmp)
  (tmp_path / "fake_trainer.py").write_text(trainer_src)
  work = tmp_path / "work"
  work.mkdir()
  temp = tempfile.mkdtemp(prefix="r", dir="/tmp")    # short: Ray's socket paths
  port = cluster.free_port()
  ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([cluster.REPO, str(tmp_path)]),
             FAKE_TRAINER_WORK=str(work), FLEET_TRAINER_WORK=str(work),
             RAY_AUTH_MODE="disabled",  # as ray.init's own
             RAY_health_check_period_ms="500",
             RAY_health_check_failure_threshold="4", RAY_health_check_timeout_ms="500")
  env.pop("RAY_ADDRESS", None)
  nodes = []
  out = {}
  try:
    head = subprocess.run([ray_bin, "start", "--head", f"--port={port}",
                           f"--num-cpus={head_cpus}", "--include-dashboard=false",
                           f"--temp-dir={temp}", "--disable-usage-stats"],
                          env=env, capture_output=True, text=True)
    assert head.returncode == 0, head.stderr
    address = f"127.0.0.1:{port}"
    ray.init(address=address, log_to_driver=False, runtime_env={"env_vars": {
        "PYTHONPATH": env["PYTHONPATH"], "FAKE_TRAINER_WORK": str(work),
        "FLEET_TRAINER_WORK": str(work)}})
    for cpus in node_cpus:   # one at a time: two starting at once on 2 busy cores can miss
      nodes.append(subprocess.Popen([ray_bin, "start", f"--address={address}",  # health checks
                                     f"--num-cpus={cpus}", "--block", "--disable-usage-stats"],
                                    env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True))
      _wait(lambda: len([n for n in ray.nodes() if n["Alive"]]) == 1 + len(nodes), "a node")
    out = scenario(tmp_path, work, nodes, **kwargs)
  except BaseException:  # noqa: BLE001 - reported to the test
    out["error"] = traceback.format_exc()
  finally:
    try:
      ray.shutdown()
    finally:
      for node in nodes:
        if node.poll() is None:
          os.killpg(node.pid, signal.SIGKILL)
      _stop_head(temp)
      shutil.rmtree(temp, ignore_errors=True)
      queue.put(out)


def _lose_a_server_node(tmp_path, work, nodes, live: bool) -> dict:
  import json
  import signal
  import threading
  cfg = cluster.ClusterConfig(
      sandbox_servers=2, sandbox_cpus=1.0, rollout_servers=0, trainer_processes=1,
      trainer_cpus=1.0, trainer_module="fake_trainer", trainer_config="none.py",
      restart_backoff_s=0.1, log_dir=str(tmp_path / "logs"), startup_timeout_s=120,
      live_server_moves=live)
  fleet = cluster.Cluster(cfg)
  out = {}
  try:
    out["before"] = list(fleet.sandbox_urls)
    result = {}
    runner = threading.Thread(target=lambda: result.setdefault(
        "codes", fleet.run_trainers(server_check_s=1.0)))
    runner.start()
    _wait(lambda: (work / "starts").exists(), "the trainer's start")
    _wait(lambda: (work / "calls").exists(), "the trainer's first tool call")
    os.killpg(nodes[0].pid, signal.SIGKILL)         # the second node and all it ran
    if live:
      _wait(lambda: fleet.sandbox_urls != out["before"], "the server's move")
      new = json.dumps(fleet.sandbox_urls)
      _wait(lambda: any(f'"urls": {new}' in line
                        for line in (work / "calls").read_text().splitlines()[-3:]),
            "a tool call of the running trainer at the new URLs")
    else:
      _wait(lambda: len((work / "starts").read_text().splitlines()) == 2,
            "the trainer's restart with the moved server")
      _wait(lambda: len((work / "calls").read_text().splitlines()) > 3, "calls")
    (work / "done").write_text("")
    runner.join()   # no deadline: a loaded host is slow, not wrong
    out["after"] = list(fleet.sandbox_urls)
    out["codes"] = result.get("codes")
    out["healthy"] = [cluster._healthy(u) for u in out["after"]]
    out["starts"] = (work / "starts").read_text().splitlines()
    out["calls"] = (work / "calls").read_text().splitlines()
    out["restarts"] = fleet.restarts
    out["log"] = (tmp_path / "logs" / "cluster.log").read_text()
  finally:
    fleet.shutdown()
  return out


def _stop_head(temp):
  """Kills the head node's processes by their ids (those whose command line names this
  cluster's temp dir), never by a broad name: other Ray instances may run here."""
  import signal
  import subprocess
  out = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True,
                       text=True, env=dict(os.environ, COLUMNS="100000")).stdout
  for line in out.splitlines():
    pid, _, args = line.strip().partition(" ")
    if temp in args and int(pid) != os.getpid():
      try:
        os.kill(int(pid), signal.SIGKILL)
      except ProcessLookupError:
        pass


_LOCAL_FLEET = r'''
import json, sys
import ray   # imported first, as experiments.launch_cluster does
from rstar_jax.recipe import cluster
fleet = cluster.Cluster(cluster.ClusterConfig(
    sandbox_servers=2, sandbox_cpus=0.1, rollout_servers=0, trainer_processes=2,
    trainer_cpus=0.1, log_dir=sys.argv[1]))
try:
  print(json.dumps({"urls": fleet.sandbox_urls,
                    "coordinator": ray.get(fleet.trainers[0].address.remote()),
                    "trainer_hosts": ray.get([t.address.remote() for t in fleet.trainers]),
                    "driver": ray.util.get_node_ip_address()}))
finally:
  fleet.shutdown()
  ray.shutdown()
'''


def _host_address() -> str:
  """This host's own (non-loopback) address: the one a local fleet must not use."""
  import socket
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    s.connect(("198.51.100.1", 9))    # no packet is sent; the route picks the interface
    return s.getsockname()[0]


def test_a_local_ray_fleet_puts_every_server_on_loopback(tmp_path):
  """Without ray_address the fleet starts its own Ray (one machine): every server URL and
  the trainer's coordinator are at 127.0.0.1, never at this host's own address, which
  Ray would otherwise turn 127.0.0.1 into (and the servers would be on the network)."""
  pytest.importorskip("ray")
  import json
  import subprocess
  import sys
  env = dict(os.environ, PYTHONPATH=cluster.REPO, SANDBOX_ALLOW_WEAK_ISOLATION="1")
  for var in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
    env.pop(var, None)
  out = subprocess.run([sys.executable, "-c", _LOCAL_FLEET, str(tmp_path / "logs")],
                       cwd=cluster.REPO, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  got = json.loads(out.stdout.strip().splitlines()[-1])
  assert len(got["urls"]) == 2, got
  assert all(u.startswith("http://127.0.0.1:") for u in got["urls"]), got
  assert all(a.startswith("127.0.0.1:") for a in got["trainer_hosts"]), got
  assert got["driver"] == "127.0.0.1", got
  host = _host_address()
  assert host != "127.0.0.1" and host not in json.dumps(got), (host, got)
