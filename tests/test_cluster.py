"""rstar_jax.cluster: the launch config's checks, the commands it builds, and stopping a
fleet on a real local Ray (the whole fleet runs an RL stage in tests/test_recipe.py)."""
import ast
import os

import pytest

from rstar_jax import cluster


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
  assert ours[1:5] == ["-m", "rstar_jax.rollout.server", "--hf_dir", "/ckpt"]
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


def _wait(pred):
  """Until pred() holds: no deadline (pytest-timeout ends a hang with every stack)."""
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
