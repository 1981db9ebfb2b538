"""experiments/slurm/rstar2_14b.sbatch run by bash with stand-ins for SLURM's commands.

No SLURM here: `srun`, `scontrol` and `curl` are small scripts on PATH that record what
they were asked and run a fake trainer (or a sleeping "server"). What is real is the
batch script's own logic: the nodes split between roles, the URL tuples handed to the
trainer, the time-limit signal (USR1, `#SBATCH --signal=B:USR1@...`) turned into a
SIGTERM of the trainer, waiting for it to checkpoint, stopping the servers, requeueing.
"""
import os
import signal
import stat
import subprocess
import time

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "experiments", "slurm", "rstar2_14b.sbatch")

_SRUN = r'''#!/bin/bash
# srun [--options] CMD...: the trainer's command runs the fake trainer, any other sleeps.
while [[ $# -gt 0 && $1 == --* ]]; do shift; done
echo $$ >> "$MARK.pids"
if [[ " $* " == *" experiments.recipe "* ]]; then
  exec python "$FAKE_TRAINER" "$@"
fi
exec sleep 300
'''

_SCONTROL = r'''#!/bin/bash
if [[ $1 == show ]]; then for i in 0 1 2 3 4 5 6 7; do echo "node$i"; done; exit 0; fi
echo "scontrol $*" >> "$MARK"
'''

_TRAINER = r'''
import os, signal, sys, time
mark = os.environ["MARK"]
def term(signum, frame):
  open(mark, "a").write("trainer saved on signal %d\n" % signum)
  sys.exit(143)
signal.signal(signal.SIGTERM, term)
open(mark, "a").write("trainer started " + " ".join(sys.argv[1:]) + "\n")
if os.environ.get("FAKE_TRAINER_FINISHES"):
  sys.exit(0)
while True:
  time.sleep(0.05)
'''


def _tool(path, text):
  path.write_text(text)
  path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _launch(tmp_path, curl_status=0, **env):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  _tool(bin_dir / "srun", _SRUN)
  _tool(bin_dir / "scontrol", _SCONTROL)
  _tool(bin_dir / "curl", f"#!/bin/bash\nexit {curl_status}\n")
  (tmp_path / "trainer.py").write_text(_TRAINER)
  mark = tmp_path / "mark"
  mark.write_text("")
  full = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
              MARK=str(mark), FAKE_TRAINER=str(tmp_path / "trainer.py"),
              SHARED=str(tmp_path), REPO=str(tmp_path), SLURM_JOB_ID="4242",
              SLURM_JOB_NODELIST="node[0-7]", SERVERS_PER_NODE="2", **env)
  proc = subprocess.Popen(["bash", SCRIPT], env=full, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  return proc, mark


def _wait_for(mark, text, proc, timeout=30.0):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if text in mark.read_text():
      return
    if proc.poll() is not None:
      break
    time.sleep(0.05)
  proc.kill()
  raise AssertionError(f"no {text!r}; mark: {mark.read_text()}\nscript: {proc.communicate()[0]}")


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


def test_the_time_limit_signal_checkpoints_the_trainer_and_requeues(tmp_path):
  proc, mark = _launch(tmp_path)
  _wait_for(mark, "trainer started", proc)
  started = mark.read_text()
  # 4 trainer nodes with a sandbox each, 4 rollout nodes x 2 servers, in the config.
  sandboxes = "('http://node0:8321','http://node1:8321','http://node2:8321','http://node3:8321',)"
  assert f"--config.tools.urls={sandboxes}" in started, started
  assert "'http://node4:30000','http://node4:30001'," in started
  assert "'http://node7:30001',)" in started
  assert f"--config.workdir={tmp_path}/runs/4242" in started
  assert f"--config.rollout.weight_sync.dir={tmp_path}/weights/4242" in started
  proc.send_signal(signal.SIGUSR1)               # SLURM, 30 minutes before the limit
  out, _ = proc.communicate(timeout=30)
  text = mark.read_text()
  assert "trainer saved on signal 15" in text, (text, out)
  assert "scontrol requeue 4242" in text, (text, out)
  assert proc.returncode == 143, out              # the trainer's own status
  assert "stopping the trainer" in out and "trainer exited 143" in out
  pids = [int(p) for p in (tmp_path / "mark.pids").read_text().split()]
  assert len(pids) == 4 + 8 + 1
  deadline = time.monotonic() + 10
  while any(_alive(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not [p for p in pids if _alive(p)], "servers left running"


def test_a_trainer_that_finishes_is_not_requeued(tmp_path):
  proc, mark = _launch(tmp_path, FAKE_TRAINER_FINISHES="1")
  out, _ = proc.communicate(timeout=30)
  assert proc.returncode == 0, out
  text = mark.read_text()
  assert "trainer started" in text and "requeue" not in text, text


def test_a_server_that_never_answers_fails_the_job(tmp_path):
  proc, mark = _launch(tmp_path, curl_status=7, HEALTH_TIMEOUT="0")   # nothing healthy
  out, _ = proc.communicate(timeout=30)
  assert proc.returncode == 1 and "did not answer /health within 0 s" in out, out
  assert "trainer started" not in mark.read_text()
