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
    waiter = threading.Thread(target=fleet.wait_trainers)
    waiter.start()
    deadline = time.time() + 60
    while time.time() < deadline and not mark.exists():
      time.sleep(0.1)
    t0 = time.time()
    fleet.shutdown()
    took = time.time() - t0
    waiter.join(30)
  finally:
    ray.shutdown()
  text = mark.read_text()
  assert "started HF_HOME=/forwarded/hf" in text and "num_processes=1" in text, text
  assert "saved on signal 15" in text and took < 30, (text, took)


def _wait(pred, what, timeout=60.0):
  import time
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if pred():
      return
    time.sleep(0.1)
  raise AssertionError(f"timed out waiting for {what}")


def test_a_server_is_restarted_when_it_hangs_and_restarts_far_apart_do_not_add_up(tmp_path):
  """ServerProcess (the body of a fleet's server actor) on a real sandbox server: a
  server that stops answering /health (SIGSTOP) is killed and restarted on its port;
  exits further apart than restart_window_s never exhaust max_restarts (a long run lost
  a server for good after its 3rd crash, however many days apart), while exits in a
  burst still do."""
  pytest.importorskip("ray")
  import signal
  import time
  cfg = cluster.ClusterConfig(rollout_servers=0, sandbox_args=("--max-children", "2"),
                              max_restarts=1, restart_window_s=4.0, hang_timeout_s=2.0,
                              log_dir=str(tmp_path), startup_timeout_s=60.0)
  env = {}
  if os.environ.get("SANDBOX_ALLOW_WEAK_ISOLATION") == "1":
    env["SANDBOX_ALLOW_WEAK_ISOLATION"] = "1"
  srv = cluster.ServerProcess("sandbox", 0, cfg, env)
  try:
    first = srv.proc.pid
    os.kill(first, signal.SIGSTOP)                 # alive, but answers nothing
    _wait(lambda: srv.hangs == 1 and srv.proc.pid != first and cluster._healthy(srv.url),
          "the hung server's restart")
    assert srv.restarts == 1 and not srv.gave_up
    time.sleep(cfg.restart_window_s + 0.5)         # the first restart is now old
    second = srv.proc.pid
    os.kill(second, signal.SIGKILL)
    _wait(lambda: srv.proc.pid != second, "the second restart, a window after the first")
    assert srv.restarts == 2 and not srv.gave_up
    # A second exit within the window: killed while it starts, since the window counts
    # from the exits and a start took over the 4 s window on a loaded host (killed once
    # healthy, that exit came too late to be a burst and the server was restarted).
    os.kill(srv.proc.pid, signal.SIGKILL)
    _wait(lambda: bool(srv.gave_up), "giving up")
    assert "after 1 restart(s) within 4 s" in srv.gave_up, srv.gave_up
    log = srv.log_tail(20000)
    assert "has not answered /health" in log and "given up" in log, log
  finally:
    srv.stop()
