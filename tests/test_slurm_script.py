"""experiments/slurm/rstar2_14b.sbatch run by bash with stand-ins for SLURM's commands.

No SLURM here: `srun`, `scontrol` and `curl` are small scripts on PATH that record what
they were asked and run a fake trainer (or a sleeping "server"). What is real is the
batch script's own logic and the layout it asks the config for (`experiments.preflight
--print_layout`, run for real on the 14B config): the nodes split between roles, the
servers' flags, the URL tuples handed to the trainer, the time-limit signal (USR1, `#SBATCH --signal=B:USR1@...`) turned into a
SIGTERM of the trainer, waiting for it to checkpoint, stopping the servers, requeueing.
"""
import os
import signal
import stat
import subprocess
import sys
import time

from tests import procs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "experiments", "slurm", "rstar2_14b.sbatch")

_SRUN = r'''#!/bin/bash
# srun [--options] CMD...: the trainer's command runs the fake trainer, any other sleeps.
# Signals as srun handles them (SchedMD's srun, _forward_signal): SIGTERM and SIGHUP
# kill the tasks with SIGKILL, other signals are passed on. The handlers are set before
# the task starts (a TERM right after launch left a task running, holding our stdout).
opts=()
while [[ $# -gt 0 && $1 == --* ]]; do opts+=("$1"); shift; done
echo $$ >> "$MARK.pids"
trap 'kill -KILL $(jobs -p) 2>/dev/null; exit 137' TERM HUP
trap 'kill -USR2 $(jobs -p) 2>/dev/null' USR2
if [[ " $* " == *" experiments.recipe "* ]]; then
  echo "trainer step ${opts[*]}" >> "$MARK"
  python "$FAKE_TRAINER" "$@" &
else
  line="server ${opts[*]} $*"
  printf '%s\n' "${line//$'\n'/ }" >> "$MARK.servers"   # one write: servers start at once
  sleep 300 &
fi
child=$!
rc=0
while kill -0 $child 2>/dev/null; do wait $child; rc=$?; done
exit $rc
'''

_SCONTROL = r'''#!/bin/bash
if [[ $1 == show ]]; then for i in 0 1 2 3 4 5 6 7; do echo "node$i"; done; exit 0; fi
echo "scontrol $*" >> "$MARK"
'''

_TRAINER = r'''
import os, signal, sys, time
mark = os.environ["MARK"]
def stop(signum, frame):   # what rstar_jax.train.interrupt does, at once here
  open(mark, "a").write("trainer saved on signal %d\\n" % signum)
  sys.exit(128 + signum)
for s in (signal.SIGTERM, signal.SIGUSR2):
  signal.signal(s, signal.SIG_IGN if os.environ.get("FAKE_TRAINER_STUBBORN") else stop)
open(mark, "a").write("trainer started " + " ".join(sys.argv[1:]) + "\\n")
if os.environ.get("FAKE_TRAINER_FINISHES"):
  sys.exit(0)
if os.environ.get("FAKE_TRAINER_CRASHES"):   # a task died; srun reports its status
  sys.exit(int(os.environ["FAKE_TRAINER_CRASHES"]))
while True:
  time.sleep(0.05)
'''


def _tool(path, text):
  path.write_text(text)
  path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _launch(tmp_path, curl_status=0, **env):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir(parents=True)
  _tool(bin_dir / "srun", _SRUN)
  _tool(bin_dir / "scontrol", _SCONTROL)
  # curl's exit status: MARK.curl's content when it exists (a test changes it), else 0.
  (tmp_path / "mark.curl").write_text(str(curl_status))
  _tool(bin_dir / "curl", '#!/bin/bash\nexit $(cat "$MARK.curl")\n')
  (tmp_path / "trainer.py").write_text(_TRAINER)
  mark = tmp_path / "mark"
  mark.write_text("")
  full = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
              MARK=str(mark), FAKE_TRAINER=str(tmp_path / "trainer.py"),
              SHARED=str(tmp_path), REPO=REPO, SLURM_JOB_ID="4242",
              SLURM_JOB_NODELIST="node[0-7]", HEALTH_POLL="0.1", PYTHON=sys.executable)
  full.pop("XLA_FLAGS", None)   # the suite's fake devices are not the preflight's business
  full.update(env)      # SHARED too: requeues of one job share its run directory
  proc = subprocess.Popen(["bash", SCRIPT], env=full, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
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


def test_the_time_limit_signal_checkpoints_the_trainer_and_requeues(tmp_path):
  proc, mark = _launch(tmp_path)
  _wait_for(mark, "trainer started", proc)
  started = mark.read_text()
  # The 14B config's layout: 4 trainer nodes with a sandbox each, 4 rollout nodes x 8
  # SGLang servers; the mesh is the config's, not the script's.
  sandboxes = "('http://node0:8321','http://node1:8321','http://node2:8321','http://node3:8321',)"
  assert f"--config.tools.urls={sandboxes}" in started, started
  assert "'http://node4:30000','http://node4:30001'," in started
  assert "'http://node7:30007',)" in started and "node8" not in started
  assert "--config.mesh" not in started
  trainer_opts = started.split("trainer step", 1)[1].splitlines()[0]
  assert "--nodelist=node0,node1,node2,node3" in trainer_opts, trainer_opts
  # One task a trainer node: without --ntasks the job's SLURM_NTASKS (8, one a node of the
  # allocation) won over --ntasks-per-node on a real SLURM (tests/test_rehearsal.py).
  assert "--ntasks=4" in trainer_opts.split(), trainer_opts
  servers = (tmp_path / "mark.servers").read_text().splitlines()
  sglang = [line for line in servers if "sglang.launch_server" in line]
  assert len(sglang) == 32 and any("HIP_VISIBLE_DEVICES=7 " in line for line in sglang)
  assert all("--tp-size 1 --dtype bfloat16 --mem-fraction-static 0.85 --context-length 13312"
             in line for line in sglang), sglang[0]
  assert sum("--max-children 64" in line for line in servers) == 4
  assert f"--config.workdir={tmp_path}/runs/4242" in started
  assert f"--config.rollout.weight_sync.dir={tmp_path}/weights/4242" in started
  proc.send_signal(signal.SIGUSR1)               # SLURM, 30 minutes before the limit
  out, _ = proc.communicate(timeout=30)
  text = mark.read_text()
  # SIGUSR2 through srun: a SIGTERM to srun would have SIGKILLed the trainer unsaved.
  assert "trainer saved on signal 12" in text, (text, out)
  assert "scontrol requeue 4242" in text, (text, out)
  assert proc.returncode == 140, out              # the trainer's own status
  assert "stopping the trainer" in out and "trainer exited 140" in out
  pids = [int(p) for p in (tmp_path / "mark.pids").read_text().split()]
  assert len(pids) == 4 + 32 + 1
  assert not procs.left_running(pids, wait_s=10), "servers left running"


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


def test_a_trainer_that_does_not_stop_is_requeued_after_the_grace(tmp_path):
  """A trainer busy past STOP_GRACE (a long evaluation: it resumes from its journal) is
  requeued anyway, before SLURM's hard limit, which would end the job unrequeued."""
  proc, mark = _launch(tmp_path, FAKE_TRAINER_STUBBORN="1", STOP_GRACE="1")
  try:
    _wait_for(mark, "trainer started", proc)
    proc.send_signal(signal.SIGUSR1)
    _wait_for(mark, "scontrol requeue 4242", proc)
    assert "trainer saved" not in mark.read_text()
  finally:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)


def test_the_limit_before_the_trainer_starts_requeues_without_it(tmp_path):
  """USR1 while the servers still start: requeued, no trainer started (the signal's
  default action had killed the batch shell, with nothing requeued)."""
  proc, mark = _launch(tmp_path, curl_status=7)    # no server healthy yet
  time.sleep(1.0)
  proc.send_signal(signal.SIGUSR1)
  time.sleep(0.5)
  (tmp_path / "mark.curl").write_text("0")        # now they are
  out, _ = proc.communicate(timeout=30)
  text = mark.read_text()
  assert proc.returncode == 0 and "scontrol requeue 4242" in text, (text, out)
  assert "trainer started" not in text


def _checkpoints(tmp_path):
  """Two complete orbax steps and a torn one (no commit file) in the run's stage dir."""
  ckpts = tmp_path / "runs" / "4242" / "stage2" / "checkpoints"
  for step in ("40", "50"):
    (ckpts / step).mkdir(parents=True)
    (ckpts / step / "commit_success.txt").write_text("ok")
    time.sleep(0.05)     # distinct modification times: 50 is the newest
  (ckpts / "60").mkdir()
  return ckpts


def test_a_failed_trainer_is_requeued_with_back_off_until_the_budget_is_spent(tmp_path):
  """A trainer task that dies ends its whole srun step (--kill-on-bad-exit) and the job
  is requeued, the cause and the checkpoint it resumes from logged; failures are counted
  in the run's directory across requeues, and the one past MAX_RESTARTS within the
  window ends the job."""
  ckpts = _checkpoints(tmp_path)
  runs = []
  for attempt in range(3):          # what SLURM does: the same script, the same job id
    proc, mark = _launch(tmp_path / f"a{attempt}", FAKE_TRAINER_CRASHES="137", MAX_RESTARTS="2",
                         RESTART_BACKOFF="0", SHARED=str(tmp_path))
    out, _ = proc.communicate(timeout=30)
    runs.append((proc.returncode, out, mark.read_text()))
  for code, out, text in runs:
    assert code == 137, out
    assert "--kill-on-bad-exit=1" in text.split("trainer step", 1)[1].splitlines()[0], text
  for i in (0, 1):
    code, out, text = runs[i]
    assert "scontrol requeue 4242" in text, (text, out)
    assert (f"trainer failed: exit 137; restart {i + 1} of at most 2 within 3600 s: requeued "
            f"in 0 s, resuming from {ckpts}/50") in out, out
  code, out, text = runs[2]
  assert "requeue" not in text and "given up after 2 restart(s) within 3600 s" in out, out
  assert len((tmp_path / "runs" / "4242" / "logs" / "restarts").read_text().split()) == 2


def test_failures_far_apart_do_not_add_up_and_a_config_error_is_not_requeued(tmp_path):
  logs = tmp_path / "runs" / "4242" / "logs"
  logs.mkdir(parents=True)
  (logs / "restarts").write_text(f"{int(time.time()) - 7200}\n")   # two hours ago
  proc, mark = _launch(tmp_path / "a", FAKE_TRAINER_CRASHES="1", MAX_RESTARTS="1",
                       RESTART_BACKOFF="0", SHARED=str(tmp_path))
  out, _ = proc.communicate(timeout=30)
  assert "scontrol requeue 4242" in mark.read_text(), out
  assert "restart 1 of at most 1" in out and "resuming from none (starts afresh)" in out, out
  proc, mark = _launch(tmp_path / "b", FAKE_TRAINER_CRASHES="2", RESTART_BACKOFF="0",
                       SHARED=str(tmp_path))
  out, _ = proc.communicate(timeout=30)
  assert proc.returncode == 2 and "requeue" not in mark.read_text(), out
  assert "exit 2 (a config or usage error): not requeued" in out, out


def test_a_layout_the_preflight_refuses_starts_nothing(tmp_path):
  """The layout comes from the config through `experiments.preflight --print_layout`; one
  it refuses (here the in-process rollout backend, which a multi-process trainer cannot
  use) ends the job with exit 2 before any server starts, not requeued."""
  proc, mark = _launch(tmp_path, EXTRA_ARGS="--config.rollout.backend=jax")
  out, _ = proc.communicate(timeout=60)
  assert proc.returncode == 2, out
  assert "rollout.backend: 'jax'" in out and "not started, not requeued" in out, out
  assert mark.read_text() == "" and not (tmp_path / "mark.pids").exists()


def test_the_sft_script_trains_on_the_layout_s_trainer_nodes_without_servers(tmp_path):
  """experiments/slurm/rstar2_14b_sft.sbatch: the 14B config's SFT on its 4 trainer
  nodes (one task each, from the layout the preflight prints), from BASE, with no
  rollout or sandbox server and no rollout.servers; its export is the RL script's CKPT."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  _tool(bin_dir / "srun", _SRUN)
  _tool(bin_dir / "scontrol", _SCONTROL)
  (tmp_path / "trainer.py").write_text(_TRAINER)
  mark = tmp_path / "mark"
  mark.write_text("")
  env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", MARK=str(mark),
             FAKE_TRAINER=str(tmp_path / "trainer.py"), FAKE_TRAINER_FINISHES="1",
             SHARED=str(tmp_path), REPO=REPO, SLURM_JOB_ID="77",
             SLURM_JOB_NODELIST="node[0-3]", PYTHON=sys.executable, BASE="/ckpt/base")
  env.pop("XLA_FLAGS", None)
  out = subprocess.run(["bash", os.path.join(REPO, "experiments", "slurm",
                                             "rstar2_14b_sft.sbatch")],
                       env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stdout + out.stderr
  text = mark.read_text()
  opts = text.split("trainer step", 1)[1].splitlines()[0].split()
  assert "--ntasks=4" in opts and "--nodelist=node0,node1,node2,node3" in opts, opts
  assert "--kill-on-bad-exit=1" in opts and "--gpus-per-node=8" in opts, opts
  started = text.split("trainer started", 1)[1].splitlines()[0]
  assert "--stages=sft" in started and f"--config.workdir={tmp_path}/runs/sft" in started
  assert "--config.model.hf_dir=/ckpt/base" in started, started
  assert "rollout.servers" not in started and "tools.urls" not in started, started
  assert not (tmp_path / "mark.servers").exists()         # no server of any kind
  assert f"its export is {tmp_path}/runs/sft/sft/export" in out.stdout, out.stdout
  # The RL script's CKPT by default: this export.
  script = open(SCRIPT).read()
  assert "CKPT=${CKPT:-$SHARED/runs/sft/sft/export}" in script
