"""The sweep (rstar_jax/recipe/sweep_*.py, experiments/sweep.py).

Child runs are a tiny fake module written into tmp_path (absl + config_flags, like the
real entry points): it writes eval_final.json and RL metrics from its overrides, or
fails when `fail=True`. One real two-point sweep of the smoke recipe is marked slow.
"""
import csv
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import ml_collections
import numpy as np
import pytest

from rstar_jax.recipe import sweep_overrides, sweep_points, sweep_results, sweep_runner
from tests import procs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAKE_CONFIG = '''
import ml_collections

def get_config(variant=""):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.workdir = ""
  c.lr = 0.1
  c.method = "a"
  c.fail = False
  c.write_report = True
  c.nested = ml_collections.ConfigDict(dict(x=1, name="n"))
  if variant == "big":
    c.lr = 1.0
  elif variant:
    raise ValueError(variant)
  return c
'''

FAKE_SWEEP = '''
def get_sweep(variant=""):
  lr = 1.0 if variant == "big" else 0.1
  return [{"method": "a"}, {"method": "b", "lr": lr * 2}]
'''

FAKE_CHILD = '''
import json, os, sys
from absl import app
from ml_collections import config_flags

_C = config_flags.DEFINE_config_file("config")

def main(argv):
  c = _C.value
  os.makedirs(c.workdir, exist_ok=True)
  with open(os.path.join(c.workdir, "runs.txt"), "a") as f:
    f.write("run\\n")
  print(f"child: method={c.method} lr={c.lr} seed={c.seed} x={c.nested.x}")
  if c.fail:
    print("child: deliberate failure", file=sys.stderr)
    sys.exit(3)
  os.makedirs(os.path.join(c.workdir, "stage1"), exist_ok=True)
  with open(os.path.join(c.workdir, "stage1", "metrics_rl.jsonl"), "w") as f:
    for step in (1, 2):
      f.write(json.dumps({"step": step, "rollout/reward_mean": step * c.lr,
                          "rollout/model_tokens_mean": 50.0 + step}) + "\\n")
  if c.write_report:
    report = {"pass_at_1": c.lr + c.seed / 10, "pass_at_k": {"1": c.lr, "4": 0.9},
              "tool_error_rate_correct": None if c.method == "b" else 0.25 + c.seed / 100,
              "mean_response_tokens": 100.0 + c.seed + c.nested.x,
              "share_no_tool_call": 0.5, "per_problem": []}
    with open(os.path.join(c.workdir, "eval_final.json"), "w") as f:
      json.dump(report, f)

if __name__ == "__main__":
  app.run(main)
'''


@pytest.fixture
def fake(tmp_path):
  """(config path, config-with-get_sweep path, env with the fake child importable)."""
  mod = tmp_path / "mods"
  mod.mkdir()
  (mod / "fake_child.py").write_text(FAKE_CHILD)
  cfg = tmp_path / "fake_cfg.py"
  cfg.write_text(FAKE_CONFIG)
  cfg_sweep = tmp_path / "fake_cfg_sweep.py"
  cfg_sweep.write_text(FAKE_CONFIG + FAKE_SWEEP)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(mod), REPO]))
  return str(cfg), str(cfg_sweep), env


def _sweep_cli(env, *args, check=True):
  # No timeout: a loaded machine is slow, not wrong; pytest-timeout ends a hang (and
  # subprocess.run kills the child as the exception passes).
  out = subprocess.run([sys.executable, "-m", "experiments.sweep", *args], cwd=REPO, env=env,
                       capture_output=True, text=True)
  if check:
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return out


# ---- naming, axes, loading, validation --------------------------------------------------
def test_point_names_sorted_readable_and_safe():
  assert sweep_points.point_name({"seed": 1, "rl.downsample.method": "uniform"}) == \
      "rl.downsample.method=uniform,seed=1"
  assert sweep_points.point_name({}) == "base"
  assert sweep_points.point_name({"a": 3e-4, "b": True, "c": None}) == "a=0.0003,b=True,c=None"
  assert sweep_points.point_name({"t": (1, 2)}) == "t=(1,2)"
  # Unsafe characters are replaced, and a hash keeps distinct values distinct.
  n1 = sweep_points.point_name({"model.hf_dir": "/a/b"})
  n2 = sweep_points.point_name({"model.hf_dir": "_a_b"})
  n3 = sweep_points.point_name({"model.hf_dir": "/a b"})
  assert "/" not in n1 and " " not in n3 and n1.startswith("model.hf_dir=_a_b~")
  assert len({n1, n2, n3}) == 3
  # Deterministic and bounded.
  long = {f"k{i}": "v" * 20 for i in range(20)}
  assert sweep_points.point_name(long) == sweep_points.point_name(
      dict(reversed(list(long.items()))))
  assert len(sweep_points.point_name(long)) <= sweep_points.MAX_NAME


def test_axes_parse_and_product():
  cfg = ml_collections.ConfigDict(dict(a=1, s="x", f=0.5, t=(1, 2)))
  assert sweep_overrides.parse_axis("a=1,2,3", cfg) == ("a", [1, 2, 3])
  # A str field keeps "1" as text; tuples survive the comma split.
  assert sweep_overrides.parse_axis("s=1,roc", cfg) == ("s", ["1", "roc"])
  assert sweep_overrides.parse_axis("config.t=(1,2),(3,4)", cfg) == ("t", [(1, 2), (3, 4)])
  assert sweep_overrides.parse_axis("f=1e-4,True", cfg) == ("f", [1e-4, True])
  for bad in ("a", "=1", "a=", "a=1,,2"):
    with pytest.raises(sweep_points.SweepError):
      sweep_overrides.parse_axis(bad, cfg)
  pts = sweep_overrides.product([("a", [1, 2]), ("seed", [0, 1, 2])])
  assert pts == [{"a": 1, "seed": 0}, {"a": 1, "seed": 1}, {"a": 1, "seed": 2},
                 {"a": 2, "seed": 0}, {"a": 2, "seed": 1}, {"a": 2, "seed": 2}]
  assert sweep_overrides.product([]) == [{}]
  with pytest.raises(sweep_points.SweepError, match="twice"):
    sweep_overrides.product([("a", [1]), ("a", [2])])
  assert sweep_overrides.cross([{"m": "a"}, {"m": "b"}], [{"seed": 0}, {"seed": 1}]) == [
      {"m": "a", "seed": 0}, {"m": "a", "seed": 1}, {"m": "b", "seed": 0},
      {"m": "b", "seed": 1}]
  with pytest.raises(sweep_points.SweepError, match="both"):
    sweep_overrides.cross([{"m": "a"}], [{"m": "b"}])


def test_get_sweep_loading(fake, tmp_path):
  cfg, cfg_sweep, _ = fake
  assert sweep_overrides.load_sweep(cfg) is None
  assert sweep_overrides.load_sweep(cfg_sweep) == [{"method": "a"}, {"method": "b", "lr": 0.2}]
  assert sweep_overrides.load_sweep(cfg_sweep + ":big") == [{"method": "a"},
                                                             {"method": "b", "lr": 2.0}]
  bad = tmp_path / "bad.py"
  bad.write_text("def get_config():\n  return {}\ndef get_sweep():\n  return [{'a': 1}, 3]\n")
  with pytest.raises(sweep_points.SweepError, match=r"get_sweep\(\)\[1\]"):
    sweep_overrides.load_sweep(str(bad))
  with pytest.raises(sweep_points.SweepError, match="no such config file"):
    sweep_overrides.load_sweep(str(tmp_path / "missing.py"))


def test_validate_names_valid_keys_and_types(fake):
  config = sweep_overrides.load_config(fake[0])
  # An int for a float field is fine.
  sweep_overrides.validate([{"lr": 1, "nested.x": 2, "seed": 3}], config)
  with pytest.raises(sweep_points.SweepError, match=r"unknown config key 'y' under nested; known "
                     r"keys there: \['name', 'x'\]"):
    sweep_overrides.validate([{"nested.y": 1}], config)
  with pytest.raises(sweep_points.SweepError, match="known keys there: .*'method'"):
    sweep_overrides.validate([{"methd": "a"}], config)
  with pytest.raises(sweep_points.SweepError, match="does not fit"):
    sweep_overrides.validate([{"nested.x": "abc"}], config)
  with pytest.raises(sweep_points.SweepError, match="section, not a field"):
    sweep_overrides.validate([{"nested": 1}], config)
  with pytest.raises(sweep_points.SweepError, match="set by the sweep itself"):
    sweep_overrides.validate([{"workdir": "/x"}], config)
  with pytest.raises(sweep_points.SweepError, match="are the same"):
    sweep_overrides.validate([{"lr": 0.5}, {"lr": 0.5}], config)


def test_numpy_values_become_python_and_values_must_read_back(fake, tmp_path):
  """A point's values reach it as flag text: np.float64 (np.logspace's) is written as a
  plain number, and a value its flag would read back as something else (a bool for a
  float field: the config casts it, the flag parser refuses "True") stops the sweep."""
  config = sweep_overrides.load_config(fake[0])
  cfg = tmp_path / "np_cfg.py"
  cfg.write_text(FAKE_CONFIG + "import numpy as np\ndef get_sweep():\n"
                 "  return [{'lr': v, 'nested.x': np.int64(i)} "
                 "for i, v in enumerate(np.logspace(-4, -3, 2))]\n")
  points = sweep_overrides.load_sweep(str(cfg))
  assert [type(p["lr"]) for p in points] == [float, float]
  assert [type(p["nested.x"]) for p in points] == [int, int]
  assert sweep_points.format_value(np.float64(1e-4)) == "0.0001"
  assert sweep_points.format_value((np.int64(1), np.float32(0.5))) == "(1, 0.5)"
  assert sweep_points.point_name({"lr": np.float64(1e-4)}) == "lr=0.0001"
  sweep_overrides.validate(points + [{"lr": np.float64(3e-4)}], config)
  with pytest.raises(sweep_points.SweepError,
                     match=r"lr=True is a bool, but the field is of type float"):
    sweep_overrides.validate([{"lr": True}], config)
  with pytest.raises(sweep_points.SweepError,
                     match=r"nested.x=False is a bool, but the field is of type int"):
    sweep_overrides.validate([{"nested.x": False}], config)
  sweep_overrides.validate([{"fail": True}], config)   # a bool field takes a bool
  # A field the config takes anything for, but whose flag the child's parser refuses.
  loose = ml_collections.ConfigDict({"seed": 0, "opt": None})
  with pytest.raises(sweep_points.SweepError, match=r"opt=1 reaches the point as --config.opt=1, "
                     "which its flag parser refuses"):
    sweep_overrides.validate([{"opt": 1}], loose)


def test_shared_overrides_and_child_args_leave_the_point_alone(fake, tmp_path):
  """A base --config.workdir (given out of habit) or one in --child_arg would send every
  point into one directory (absl keeps the last value): refused, and the point's own
  directory is the last argument anyway."""
  points = [{"lr": 0.1, "seed": 0}, {"lr": 0.2, "seed": 0}]
  p = sweep_points.make_points(points, str(tmp_path))[0]
  argv = sweep_points.command(p, module="m", config_spec="c.py", base_overrides={"nested.x": 2},
                              extra_args=["--stages=sft"])
  assert argv[-1] == f"--config.workdir={p.workdir}"
  assert [a for a in argv if "workdir" in a] == [argv[-1]]
  # Through the entry point: nothing runs, no shared directory appears.
  cfg, _, env = fake
  args = ["--config", cfg, "--workdir", str(tmp_path / "sw"), "--seeds", "0,1", "--module",
          "fake_child"]
  out = _sweep_cli(env, *args, f"--config.workdir={tmp_path}/shared", check=False)
  assert out.returncode == 2 and "config error: --config.workdir=... is set by the sweep " \
      "itself" in out.stderr, out.stderr
  out = _sweep_cli(env, *args, f"--child_arg=--config.workdir={tmp_path}/shared", check=False)
  assert out.returncode == 2 and "config.workdir is set by the sweep itself" in out.stderr
  assert not (tmp_path / "shared").exists() and not (tmp_path / "sw").exists()
  sweep_overrides.check_shared({"nested.x": 2}, ["--stages=sft", "--config.method=b"], points)
  with pytest.raises(sweep_points.SweepError, match=r"--config.workdir=... is set by the sweep"):
    sweep_overrides.check_shared({"workdir": "/shared"}, [], points)
  with pytest.raises(sweep_points.SweepError, match="both swept and set"):
    sweep_overrides.check_shared({"seed": 1}, [], points)
  for arg in ("--config.workdir=/x", "-config.workdir", "--config.workdir"):
    with pytest.raises(sweep_points.SweepError, match=r"config.workdir is set by the sweep itself"):
      sweep_overrides.check_shared({}, [arg], points)
  with pytest.raises(sweep_points.SweepError,
                     match=r"--child_arg '--config.seed=3': config.seed is swept"):
    sweep_overrides.check_shared({}, ["--config.seed=3"], points)
  with pytest.raises(sweep_points.SweepError, match="passes its own --config"):
    sweep_overrides.check_shared({}, ["--config=other.py"], points)


def test_roc_ablation_smoke_variant_is_a_smoke_run_at_its_own_group_size():
  """The ablation keeps the smoke variant's few RL steps, and g_only draws the variant's
  G (what roc and uniform keep of their 2G), not the full variant's 4."""
  from experiments.configs import toy
  spec = os.path.join(REPO, "experiments/configs/toy_roc_ablation.py")
  for variant in ("", "smoke"):
    config = sweep_overrides.load_config(f"{spec}:{variant}" if variant else spec)
    points = sweep_overrides.load_sweep(f"{spec}:{variant}" if variant else spec)
    group = config.rl.downsample.group_size
    assert config.stage1.num_steps == (40 if not variant else
                                       toy.get_config(variant).stage1.num_steps)
    drawn = {p["rl.downsample.method"]: p.get("rl.samples_per_prompt",
                                              config.rl.samples_per_prompt) for p in points}
    assert drawn == {"roc": 2 * group, "uniform": 2 * group, "none": group}, (variant, drawn)
  assert sweep_overrides.load_config(spec + ":smoke").stage1.num_steps < 40


# ---- running, skipping, failures --------------------------------------------------------
def test_run_skip_and_failure(fake, tmp_path):
  cfg, _, env = fake
  root = tmp_path / "sw"
  points = sweep_points.make_points([{"method": "a", "seed": 0}, {"method": "a", "seed": 1},
                                     {"fail": True}], str(root))
  argv_of = lambda p: sweep_points.command(p, module="fake_child", config_spec=cfg,
                                           base_overrides={"nested.x": 5}, python=sys.executable)
  lines = []
  out = sweep_runner.run_points(points, argv_of, workers=2, env=env, cwd=REPO, log=lines.append)
  assert [o.status for o in out] == ["done", "done", "failed"]
  assert out[2].returncode == 3
  log = open(points[2].log).read()
  assert "deliberate failure" in log and "--config.fail=True" in log
  assert any("FAILED fail=True" in l and points[2].log in l for l in lines)
  # The base override and the point's overrides reached the child.
  assert "x=5" in open(points[0].log).read() and "seed=1" in open(points[1].log).read()
  assert os.path.exists(os.path.join(points[0].workdir, sweep_points.DONE_MARKER))
  assert not os.path.exists(os.path.join(points[2].workdir, sweep_points.DONE_MARKER))
  # Rerun: finished points are skipped, the failed one runs again.
  lines = []
  out = sweep_runner.run_points(points, argv_of, workers=1, env=env, cwd=REPO, log=lines.append)
  assert [o.status for o in out] == ["skipped", "skipped", "failed"]
  runs = lambda p: open(os.path.join(p.workdir, "runs.txt")).read().count("run")
  assert [runs(p) for p in points] == [1, 1, 2]
  assert any("skipped" in l and points[0].name in l for l in lines)


def test_a_point_stopped_by_ctrl_c_is_interrupted_not_failed(tmp_path):
  """A child that saved and exited 130 (or died of SIGINT) resumes on a rerun: the
  sweep says so instead of reporting a failure with exit status 130."""
  points = sweep_points.make_points([{"a": 1}, {"a": 2}, {"a": 3}, {"a": 4}], str(tmp_path))
  codes = {points[0].name: "sys.exit(130)", points[1].name: "sys.exit(3)",
           points[2].name: "os.kill(os.getpid(), signal.SIGINT)",
           points[3].name: "sys.exit(143)"}   # saved after a SIGTERM (a preemption)
  argv_of = lambda p: [sys.executable, "-c",
                       "import os, signal, sys\nsignal.signal(signal.SIGINT, signal.SIG_DFL)\n"
                       + codes[p.name]]
  lines = []
  out = sweep_runner.run_points(points, argv_of, workers=1, log=lines.append)
  assert [o.status for o in out] == ["interrupted", "failed", "interrupted", "interrupted"]
  assert any("interrupted a=1" in l and "a rerun resumes it" in l for l in lines), lines
  assert any("FAILED a=2: exit status 3" in l for l in lines), lines
  assert not any("FAILED a=1" in l or "FAILED a=3" in l for l in lines), lines


# ---- signals: Ctrl-C, SIGTERM, a background start, a killed sweep ----------------------
# A stand-in for the recipe that stops the way it does: the real `StopRequests` and
# `config_utils.run` (a signal -> checkpoint at the step boundary, exit 128 + signal),
# stepping while its `hold` file exists, resuming from its checkpoint on a rerun.
STOPPABLE_CONFIG = """
import ml_collections

def get_config():
  return ml_collections.ConfigDict(dict(seed=0, workdir="", steps=3, hold=""))
"""

STOPPABLE_CHILD = """
import json, os, time
from ml_collections import config_flags
from rstar_jax import config_utils
from rstar_jax.train import interrupt

_C = config_flags.DEFINE_config_file("config")

def main(argv):
  c = _C.value
  os.makedirs(c.workdir, exist_ok=True)
  ckpt = os.path.join(c.workdir, "ckpt.json")
  step = json.load(open(ckpt))["step"] if os.path.exists(ckpt) else 0
  with open(os.path.join(c.workdir, "runs.txt"), "a") as f:
    f.write(f"from step {step}\\n")
  with interrupt.StopRequests() as stop:
    with open(os.path.join(c.workdir, "pid"), "w") as f:
      f.write(str(os.getpid()))
    while step < c.steps or os.path.exists(c.hold):
      if stop.requested:
        with open(ckpt, "w") as f:
          json.dump({"step": step}, f)
        raise interrupt.Interrupted(stop.signum, step)
      time.sleep(0.02)
      step += 1
  with open(os.path.join(c.workdir, "eval_final.json"), "w") as f:
    json.dump({"pass_at_1": 0.5 + c.seed / 10}, f)

if __name__ == "__main__":
  config_utils.run(main)
"""


@pytest.fixture
def stoppable(tmp_path):
  """(sweep arguments of a 3-point sweep run 2 at once, env, hold file, sweep root)."""
  mods = tmp_path / "mods"
  mods.mkdir()
  (mods / "stoppable_child.py").write_text(STOPPABLE_CHILD)
  cfg = tmp_path / "stoppable_cfg.py"
  cfg.write_text(STOPPABLE_CONFIG)
  hold = tmp_path / "hold"
  hold.write_text("")
  root = tmp_path / "sw"
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(mods), REPO]))
  args = ["-m", "experiments.sweep", "--config", str(cfg), "--workdir", str(root),
          "--seeds", "0,1,2", "--workers", "2", "--module", "stoppable_child",
          f"--config.hold={hold}"]
  return args, env, hold, root


def _wait_for(cond, what):
  """Polls until cond() holds (`what` names it for a reader of a hang's stack). No
  deadline: a loaded machine is slow, not wrong; pytest-timeout ends a hang with every
  thread's stack."""
  while not cond():
    time.sleep(0.05)


def _running_points(root, n=2):
  """The pids of the n points that are running (inside their StopRequests)."""
  pids = {}

  def seen():
    for d in root.iterdir() if root.exists() else ():
      if (d / "pid").exists() and (d / "pid").read_text():
        pids[d.name] = int((d / "pid").read_text())
    return len(pids) >= n
  _wait_for(seen, f"{n} running points")
  return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups, /proc")
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "background-sigint"])
def test_a_signal_stops_the_running_points_writes_tables_and_a_rerun_resumes(stoppable, how):
  """Ctrl-C at a terminal (SIGINT to the sweep's process group), SIGTERM to its PID (a
  scheduler), SIGINT to a sweep started in the background by a script (SIGINT ignored
  from the start): each running point gets the signal once, saves and exits 128 +
  signal; the queued point does not start; the tables are written; no point process
  is left; the same command again resumes the stopped points from their checkpoints."""
  args, env, hold, root = stoppable
  signum = signal.SIGTERM if how == "sigterm" else signal.SIGINT
  out_path, err_path = root.parent / "sweep.out", root.parent / "sweep.err"
  if how == "background-sigint":
    # The premise: a non-interactive shell's background job starts with SIGINT ignored.
    ign = subprocess.run(["bash", "-c", "grep SigIgn /proc/self/status & wait"],
                         capture_output=True, text=True).stdout
    assert int(ign.split()[1], 16) & (1 << (signal.SIGINT - 1)), ign
    shell = subprocess.Popen(
        ["bash", "-c", f'{shlex.join([sys.executable, *args])} >{out_path} 2>{err_path} & '
                       'echo $!; wait $!'], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    pid = int(shell.stdout.readline())
    pids = _running_points(root)
    os.kill(pid, signum)
    shell.stdout.close()
    rc = shell.wait()   # `wait $!` gives the sweep's exit status
  else:
    with open(out_path, "w") as out, open(err_path, "w") as err:
      # Its own process group, as a terminal's foreground job: Ctrl-C signals the group.
      proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=out,
                              stderr=err, process_group=0)
      pids = _running_points(root)
      if how == "ctrl-c":
        os.killpg(proc.pid, signum)
      else:
        os.kill(proc.pid, signum)
      rc = proc.wait()
  stdout, stderr = out_path.read_text(), err_path.read_text()
  name = signal.Signals(signum).name
  assert rc == 128 + signum, stdout + stderr
  assert f"[sweep] {name} received: sent to the 2 running point(s)" in stdout, stdout
  assert f"sweep stopped by {name}" in stderr and "Ctrl-C again" not in stdout + stderr
  assert not any(procs.alive(p) for p in pids.values())
  manifest = {p["name"]: p for p in json.load(open(root / "sweep.json"))["points"]}
  stopped = sorted(pids)
  queued = sorted(set(manifest) - set(pids))
  assert len(stopped) == 2 and len(queued) == 1
  for n in stopped:
    # Exactly one signal reached each point: it saved and exited 128 + signal (a second
    # SIGINT would have aborted it without a checkpoint).
    assert manifest[n]["status"] == "interrupted", manifest[n]
    assert manifest[n]["returncode"] == 128 + signum, manifest[n]
    assert json.load(open(root / n / "ckpt.json"))["step"] > 0
    assert f"stopped by {name}" in open(root / n / "sweep.log").read()
  assert manifest[queued[0]]["status"] == "not started"
  assert not (root / queued[0] / "runs.txt").exists()
  rows = {r["point"]: r for r in csv.DictReader(open(root / "results.csv"))}
  assert {rows[n]["status"] for n in stopped} == {"interrupted"}
  assert "## Mean ± std over seeds" in stdout and (root / "results.md").exists()
  # The same command again, nothing held: the stopped points resume, the queued one runs.
  hold.unlink()
  out = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                       text=True)
  assert out.returncode == 0, out.stdout + out.stderr
  for n in stopped:
    runs = open(root / n / "runs.txt").read().splitlines()
    assert runs[0] == "from step 0" and runs[1] != "from step 0" and len(runs) == 2, runs
  assert open(root / queued[0] / "runs.txt").read().splitlines() == ["from step 0"]
  assert {r["status"] for r in csv.DictReader(open(root / "results.csv"))} == {"finished"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")
def test_a_killed_sweep_leaves_no_orphan(stoppable):
  """SIGKILL to the sweep (an OOM kill): its points get SIGTERM from the kernel
  (PR_SET_PDEATHSIG), save and exit instead of running on without a parent."""
  args, env, hold, root = stoppable
  proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  pids = _running_points(root)
  proc.kill()
  proc.wait()
  _wait_for(lambda: not any(procs.alive(p) for p in pids.values()), "the points to stop")
  for n in pids:
    assert json.load(open(root / n / "ckpt.json"))["step"] > 0
    assert "stopped by SIGTERM" in open(root / n / "sweep.log").read()


def test_done_marker_or_eval_final_counts_as_finished(tmp_path):
  p = sweep_points.make_points([{"a": 1}], str(tmp_path))[0]
  assert sweep_points.finished(p) is None
  os.makedirs(p.workdir)
  open(os.path.join(p.workdir, sweep_points.DONE_MARKER), "w").write("{}")
  assert sweep_points.finished(p).endswith(sweep_points.DONE_MARKER)
  q = sweep_points.make_points([{"a": 2}], str(tmp_path))[0]
  os.makedirs(q.workdir)
  open(os.path.join(q.workdir, "eval_final.json"), "w").write("{}")
  assert sweep_points.finished(q).endswith("eval_final.json")


# ---- tables ---------------------------------------------------------------------------
def _write_point(p, report=None, metrics=None):
  os.makedirs(p.workdir, exist_ok=True)
  if report is not None:
    with open(os.path.join(p.workdir, "eval_final.json"), "w") as f:
      json.dump(report, f)
  if metrics is not None:
    os.makedirs(os.path.join(p.workdir, "stage2"))
    with open(os.path.join(p.workdir, "stage2", "metrics_rl.jsonl"), "w") as f:
      f.write("".join(json.dumps(r) + "\n" for r in metrics) + '{"step": 9, "trunc')


def test_tables_mean_std_over_seeds(tmp_path):
  pts = sweep_points.make_points([{"m": "roc", "seed": s} for s in (0, 1, 2)] +
                                 [{"m": "uniform", "seed": s} for s in (0, 1, 2)], str(tmp_path))
  acc = {("roc", 0): 0.5, ("roc", 1): 0.6, ("roc", 2): 0.7, ("uniform", 0): 0.2,
         ("uniform", 1): 0.4}
  for p in pts:
    key = (p.overrides["m"], p.overrides["seed"])
    if key in acc:
      # No correct trajectory in 4 of 5 runs: the rate is missing (null), not 0.
      terc = 0.25 if key == ("roc", 1) else None
      _write_point(p, {"pass_at_1": acc[key], "tool_error_rate_correct": terc,
                       "mean_response_tokens": 10.0 * p.overrides["seed"],
                       "pass_at_k": {"1": acc[key], "4": 1.0}},
                   metrics=[{"step": 1, "rollout/reward_mean": 0.1},
                            {"step": 2, "rollout/reward_mean": 0.3}])
  rows, cols = sweep_results.result_rows(pts)
  assert cols[:4] == ["point", "status", "m", "seed"]
  assert rows[0]["pass_at_1"] == 0.5 and rows[0]["pass_at_4"] == 1.0
  assert rows[0]["last_rl/reward_mean"] == 0.3 and rows[0]["last_rl/stage"] == "stage2"
  assert rows[5]["status"] == "missing" and rows[5]["pass_at_1"] is None
  md = sweep_results.write_tables(str(tmp_path), pts)
  grouped = list(csv.DictReader(open(tmp_path / "results_seeds.csv")))
  assert [g["group"] for g in grouped] == ["m=roc", "m=uniform"]
  assert [g["n"] for g in grouped] == ["3", "2"]
  assert [g["left out"] for g in grouped] == ["", "2 (missing)"]
  assert float(grouped[0]["pass_at_1_mean"]) == pytest.approx(0.6)
  assert float(grouped[0]["pass_at_1_std"]) == pytest.approx(np.std([0.5, 0.6, 0.7], ddof=1))
  assert float(grouped[1]["pass_at_1_mean"]) == pytest.approx(0.3)
  assert float(grouped[1]["mean_response_tokens_std"]) == pytest.approx(
      np.std([0.0, 10.0], ddof=1))
  # Missing values are skipped, never averaged in as 0; the cell says over how many.
  assert float(grouped[0]["tool_error_rate_correct_mean"]) == 0.25
  assert grouped[0]["tool_error_rate_correct_std"] == ""
  assert grouped[1]["tool_error_rate_correct_mean"] == ""   # all None: no number invented
  per_point = list(csv.DictReader(open(tmp_path / "results.csv")))
  assert len(per_point) == 6 and per_point[1]["pass_at_1"] == "0.6"
  assert "| m=roc | roc | 0 1 2 | 3 |  | 0.6 ± 0.1 | 0.25 (n=1) |" in md, md
  assert "| m=uniform | uniform | 0 1 2 | 2 | 2 (missing) | 0.3 ± 0.1414 (n=2) | n/a |" in md, md
  # Per point: a null is "n/a" in the table, blank in the CSV.
  assert "| m=roc,seed=0 | finished | roc | 0 | 0.5 | n/a |" in md, md
  assert "| m=uniform,seed=2 | missing | uniform | 2 | n/a | n/a |" in md, md
  assert "0.3 ± 0.1414 (n=2)" in md
  assert md == open(tmp_path / "results.md").read()


def test_seed_table_counts_only_finished_points(tmp_path):
  """An interrupted seed's last RL row (an early step) and a failed rerun's old
  eval_final.json are not averaged with the finished seeds; the table says who is left out."""
  pts = sweep_points.make_points([{"m": "roc", "seed": s} for s in (0, 1, 2)] +
                                 [{"m": "u", "seed": s} for s in (0, 1)], str(tmp_path))
  for p in pts:
    last = 5 if p.overrides == {"m": "roc", "seed": 2} else 40
    os.makedirs(os.path.join(p.workdir, "stage1"))
    with open(os.path.join(p.workdir, "stage1", "metrics_rl.jsonl"), "w") as f:
      f.write("".join(json.dumps({"step": s, "rollout/reward_mean": s / 40}) + "\n"
                      for s in range(1, last + 1)))
    if last == 40:
      with open(os.path.join(p.workdir, "eval_final.json"), "w") as f:
        json.dump({"pass_at_1": 0.8 if p.overrides["m"] == "roc" else 0.1 * p.overrides["seed"]},
                  f)
  outs = [sweep_points.Outcome(pts[0], "skipped"), sweep_points.Outcome(pts[1], "done"),
          sweep_points.Outcome(pts[2], "interrupted"), sweep_points.Outcome(pts[3], "failed"),
          sweep_points.Outcome(pts[4], "failed")]
  md = sweep_results.write_tables(str(tmp_path), pts, outs)
  grouped = {g["group"]: g for g in csv.DictReader(open(tmp_path / "results_seeds.csv"))}
  roc, u = grouped["m=roc"], grouped["m=u"]
  assert float(roc["last_rl/reward_mean_mean"]) == pytest.approx(1.0)   # not with 5/40
  assert float(roc["last_rl/step_mean"]) == pytest.approx(40)
  assert u["pass_at_1_mean"] == "" and u["last_rl/reward_mean_mean"] == ""
  assert roc["n"] == "2" and roc["left out"] == "2 (interrupted)"
  assert u["n"] == "0" and u["left out"] == "0 (failed), 1 (failed)"
  assert "| m=roc | roc | 0 1 2 | 2 | 2 (interrupted) | 0.8 ± 0 (n=2) |" in md, md
  assert "| m=u | u | 0 1 | 0 | 0 (failed), 1 (failed) | n/a |" in md, md


def test_without_outcomes_a_point_finished_with_another_command_is_stale(tmp_path):
  """What a notebook sees (points from sweep.json, no outcomes): a point whose done
  marker holds another command than the manifest's has results of other settings."""
  root = str(tmp_path / "sw")
  pts = sweep_points.make_points([{"seed": s} for s in (0, 1, 2)], root)
  now = lambda p: ["python", "-m", "child", "--config", "c.py", "--config.lr=0.7",
                   f"--config.seed={p.overrides['seed']}", f"--config.workdir={p.workdir}"]
  for p in pts[:2]:
    os.makedirs(p.workdir)
    with open(os.path.join(p.workdir, "eval_final.json"), "w") as f:
      json.dump({"pass_at_1": 0.5 + 0.1 * p.overrides["seed"]}, f)
    argv = now(p)
    if p.overrides["seed"] == 1:   # finished with lr=0.5; a rerun with 0.7 failed
      argv = [a.replace("lr=0.7", "lr=0.5") for a in argv]
    else:   # the same command in another order, the config path absolute: the same
      argv = argv[:4] + [os.path.abspath("c.py")] + argv[5:][::-1]
    with open(os.path.join(p.workdir, sweep_points.DONE_MARKER), "w") as f:
      json.dump({"command": argv}, f)
  sweep_points.write_manifest(root, pts, now)
  loaded = sweep_points.load_points(root)
  assert [bool(sweep_points.finished(p)) for p in loaded] == [True, False, False]
  rows, cols = sweep_results.result_rows(loaded)
  grouped, _ = sweep_results.seed_rows(loaded, rows, ["pass_at_1"])
  assert grouped[0]["n"] == 1 and grouped[0]["pass_at_1_mean"] == pytest.approx(0.5)
  assert [r["status"] for r in rows] == ["finished", "stale", "missing"]
  assert grouped[0]["left out"] == "1 (stale), 2 (missing)"
  assert loaded == pts and loaded[0].command == tuple(now(pts[0]))


def test_manifest_and_tables_are_written_whole_or_not_at_all(tmp_path):
  """Notebooks read sweep.json while a sweep rewrites it: a write that dies midway leaves
  the previous file whole, and no temporary file behind."""
  class Unprintable:
    def __str__(self):
      raise RuntimeError("no text")
  pts = sweep_points.make_points([{"seed": 0}, {"seed": 1}], str(tmp_path))
  sweep_points.write_manifest(str(tmp_path), pts, lambda p: ["python", "-m", "x"])
  bad = [sweep_points.Point(pts[0].name, {"seed": Unprintable()}, pts[0].workdir)]
  with pytest.raises(RuntimeError, match="no text"):
    sweep_points.write_manifest(str(tmp_path), bad, lambda p: ["python", "-m", "x"])
  assert sweep_points.load_points(str(tmp_path)) == pts
  sweep_results.write_tables(str(tmp_path), pts)
  assert sorted(f for f in os.listdir(tmp_path) if os.path.isfile(tmp_path / f)) == \
      ["results.csv", "results.md", "results_seeds.csv", "sweep.json"]


def test_curves_per_step_across_stages_and_over_seeds(tmp_path):
  pts = sweep_points.make_points([{"m": "roc", "seed": s} for s in (0, 1, 2)] +
                                 [{"m": "u", "seed": 0}],
                                 str(tmp_path))
  reward = {0: [0.1, 0.2, 0.4], 1: [0.3, 0.4], 2: [0.2, None, 0.6]}
  for p in pts[:3]:
    r = reward[p.overrides["seed"]]
    stage1, stage3 = r[:1], r[1:]   # stage 2 missing: steps continue across stages
    for stage, vals, first in (("stage1", stage1, 1), ("stage3", stage3, 1)):
      os.makedirs(os.path.join(p.workdir, stage))
      with open(os.path.join(p.workdir, stage, "metrics_rl.jsonl"), "w") as f:
        for i, v in enumerate(vals):
          f.write(json.dumps({"step": first + i, **({} if v is None else
                                                    {"rollout/reward_mean": v})}) + "\n")
        f.write('{"step": 7, "rollo')   # a killed run's torn line is left out
  c = sweep_results.point_curves(pts[0], ["rollout/reward_mean", "absent"])
  assert c["step"].tolist() == [1, 2, 3] and c["stage"].tolist() == [0, 2, 2]
  np.testing.assert_allclose(c["rollout/reward_mean"], [0.1, 0.2, 0.4])
  assert np.isnan(c["absent"]).all()
  g = sweep_results.seed_curves(pts, "rollout/reward_mean")
  assert set(g) == {"m=roc", "m=u"}
  roc = g["m=roc"]
  assert roc["step"].tolist() == [1, 2, 3] and roc["n"].tolist() == [3, 2, 2]
  table = [[0.1, 0.2, 0.4], [0.3, 0.4, np.nan], [0.2, np.nan, 0.6]]
  for j in range(3):
    col = [row[j] for row in table if not np.isnan(row[j])]
    assert roc["mean"][j] == pytest.approx(np.mean(col))
    assert roc["std"][j] == pytest.approx(np.std(col, ddof=1))
  assert g["m=u"]["step"].size == 0   # a point that has not run yet: an empty curve
  # The manifest the sweep writes is what a notebook reads the points from.
  sweep_points.write_manifest(str(tmp_path), pts, lambda p: ["x"])
  assert sweep_points.load_points(str(tmp_path)) == pts
  with pytest.raises(sweep_points.SweepError, match="no sweep manifest"):
    sweep_points.load_points(str(tmp_path / "nowhere"))


# ---- the command line -------------------------------------------------------------------
def test_cli_print_only(fake, tmp_path):
  cfg, cfg_sweep, env = fake
  root = tmp_path / "sw"
  out = _sweep_cli(env, "--config", cfg_sweep + ":big", "--workdir", str(root), "--seeds",
                   "0,1", "--sweep", "nested.x=1,2", "--config.nested.name=zz",
                   "--module", "fake_child", "--print_only")
  cmds = out.stdout.strip().splitlines()
  assert len(cmds) == 2 * 2 * 2
  assert cmds[0].startswith(f"python -m fake_child --config {cfg_sweep}:big ")
  assert cmds[0].endswith(f" --config.workdir={root}/method=a,nested.x=1,seed=0")
  assert all("--config.nested.name=zz" in c for c in cmds)
  assert "--config.lr=2.0 --config.nested.x=2 --config.seed=1" in cmds[-1]
  assert not root.exists() or not any(root.iterdir())   # nothing ran
  # A finished point is left out of the commands.
  done = root / "method=a,nested.x=1,seed=0"
  done.mkdir(parents=True)
  (done / "eval_final.json").write_text("{}")
  out = _sweep_cli(env, "--config", cfg_sweep + ":big", "--workdir", str(root), "--seeds",
                   "0,1", "--sweep", "nested.x=1,2", "--module", "fake_child", "--print_only")
  assert len(out.stdout.strip().splitlines()) == 7 and "finished" in out.stderr


def test_cli_runs_reports_failure_and_tables(fake, tmp_path):
  cfg, _, env = fake
  root = tmp_path / "sw"
  args = ["--config", cfg, "--workdir", str(root), "--sweep", "method=a,b", "--sweep",
          "fail=False,True", "--seeds", "0,1", "--module", "fake_child", "--workers", "3"]
  out = _sweep_cli(env, *args, check=False)
  assert out.returncode == 1, out.stdout + out.stderr
  assert "4 point(s) failed" in out.stderr
  assert f"{root}/fail=True,method=a,seed=0/sweep.log" in out.stderr
  assert "## Mean ± std over seeds" in out.stdout
  rows = list(csv.DictReader(open(root / "results.csv")))
  assert [r["status"] for r in rows].count("failed") == 4
  grouped = {g["group"]: g for g in csv.DictReader(open(root / "results_seeds.csv"))}
  assert float(grouped["fail=False,method=a"]["pass_at_1_mean"]) == pytest.approx(0.15)
  assert grouped["fail=True,method=b"]["n"] == "0"
  manifest = json.load(open(root / "sweep.json"))
  assert len(manifest["points"]) == 8 and {p["status"] for p in manifest["points"]} == \
      {"done", "failed"}
  # Rerun: the 4 good points are skipped (their runs.txt holds one run).
  out = _sweep_cli(env, *args, check=False)
  assert out.stdout.count("finished before") == 5   # plan line + 4 skip lines
  assert open(root / "fail=False,method=b,seed=1" / "runs.txt").read().count("run") == 1
  assert open(root / "fail=True,method=b,seed=1" / "runs.txt").read().count("run") == 2


def test_a_point_finished_with_another_command_runs_again(fake, tmp_path):
  """Rerun with other --config overrides: the sweep does not report the old results as
  the new ones; the point runs again (a recipe then resumes or refuses the change)."""
  cfg, _, env = fake
  root = tmp_path / "sw"
  args = ["--config", cfg, "--workdir", str(root), "--seeds", "0", "--module", "fake_child"]
  _sweep_cli(env, *args, "--config.lr=0.5")
  out = _sweep_cli(env, *args, "--config.lr=0.5")
  assert "seed=0: finished before" in out.stdout and "skipped" in out.stdout
  out = _sweep_cli(env, *args, "--config.lr=0.7")
  assert "seed=0: finished before with another command (now also --config.lr=0.7; no longer " \
         "--config.lr=0.5); running it again" in out.stdout, out.stdout
  assert open(root / "seed=0" / "runs.txt").read().count("run") == 2
  rows = list(csv.DictReader(open(root / "results.csv")))
  assert float(rows[0]["pass_at_1"]) == pytest.approx(0.7)
  # --print_only lists it again too; the same command again is finished.
  assert "seed=0" in _sweep_cli(env, *args, "--config.lr=0.5", "--print_only").stdout
  assert not _sweep_cli(env, *args, "--config.lr=0.7", "--print_only").stdout.strip()


def test_a_failed_rerun_with_another_command_reports_no_old_results(fake, tmp_path):
  cfg, _, env = fake
  root = tmp_path / "sw"
  args = ["--config", cfg, "--workdir", str(root), "--seeds", "0,1", "--module", "fake_child"]
  _sweep_cli(env, *args, "--config.lr=0.5")
  out = _sweep_cli(env, *args, "--config.lr=0.7", "--config.fail=True", check=False)
  assert out.returncode == 1, out.stdout + out.stderr
  grouped = list(csv.DictReader(open(root / "results_seeds.csv")))
  assert len(grouped) == 1 and grouped[0]["n"] == "0"
  assert grouped[0]["pass_at_1_mean"] == "" and grouped[0]["pass_at_1_std"] == ""
  assert grouped[0]["left out"] == "0 (failed), 1 (failed)"
  assert "| base | 0 1 | 0 | 0 (failed), 1 (failed) | n/a |" in out.stdout, out.stdout


def test_the_same_command_in_another_order_is_not_a_change(fake, tmp_path):
  """Overrides in another order, or the config path relative instead of absolute: the
  points are finished, not run again."""
  cfg, _, env = fake
  root = tmp_path / "sw"
  args = ["--workdir", str(root), "--seeds", "0", "--module", "fake_child"]
  _sweep_cli(env, "--config", os.path.relpath(cfg, REPO), *args, "--config.lr=0.5",
             "--config.nested.x=2", "--child_arg=--verbosity=0",
             "--child_arg=--stderrthreshold=fatal")
  out = _sweep_cli(env, "--config", cfg, *args, "--config.nested.x=2", "--config.lr=0.5",
                   "--child_arg=--stderrthreshold=fatal", "--child_arg=--verbosity=0")
  assert "seed=0: finished before" in out.stdout and "another command" not in out.stdout
  assert open(root / "seed=0" / "runs.txt").read().count("run") == 1
  p = sweep_points.make_points([{"seed": 0}], str(root))[0]
  before = json.load(open(os.path.join(p.workdir, sweep_points.DONE_MARKER)))["command"]
  # Another interpreter; a key given twice (absl keeps the last value).
  assert sweep_points.changed_command(p, ["/other/python", *before[1:5], "--config.lr=0.1",
                                          *before[5:]]) is None
  assert sweep_points.changed_command(p, [*before, "--config.lr=0.6"]) == \
      "now also --config.lr=0.6; no longer --config.lr=0.5"
  assert "now also -m other" in sweep_points.changed_command(p, [before[0], "-m", "other",
                                                                  *before[3:]])


def test_points_share_one_compile_cache_when_the_config_has_one(fake, tmp_path):
  _, _, env = fake
  cfg = tmp_path / "fake_cfg_cache.py"
  cfg.write_text(FAKE_CONFIG.replace("  c.fail = False\n",
                                     "  c.fail = False\n  c.compile_cache_dir = ''\n"))
  root = tmp_path / "sw"
  args = ["--config", str(cfg), "--workdir", str(root), "--seeds", "0,1", "--module",
          "fake_child", "--print_only"]
  cmds = _sweep_cli(env, *args).stdout.strip().splitlines()
  assert len(cmds) == 2
  assert all(f"--config.compile_cache_dir={root}/compile_cache" in c for c in cmds), cmds
  # One given on the command line is every point's.
  cmds = _sweep_cli(env, *args, "--config.compile_cache_dir=/elsewhere").stdout.splitlines()
  assert all("--config.compile_cache_dir=/elsewhere" in c and "sw/compile_cache" not in c
             for c in cmds), cmds
  # Swept, or a config without the field (the fake's own): nothing added.
  config = sweep_overrides.load_config(str(cfg))
  assert sweep_overrides.shared_overrides(config, {}, [{"compile_cache_dir": "a"}], str(root)) == {}
  cmds = _sweep_cli(env, *args[:1], fake[0], *args[2:]).stdout.splitlines()
  assert len(cmds) == 2 and not any("compile_cache_dir" in c for c in cmds), cmds


def test_cli_bad_key_names_valid_ones(fake, tmp_path):
  cfg, _, env = fake
  out = _sweep_cli(env, "--config", cfg, "--workdir", str(tmp_path), "--sweep", "nested.z=1",
                   "--print_only", check=False)
  assert out.returncode == 2
  assert "config error: sweep key 'nested.z': unknown config key 'z' under nested; " \
         "known keys there: ['name', 'x']" in out.stderr
  out = _sweep_cli(env, "--config", cfg, "--workdir", str(tmp_path), "--sweep", "lr=1",
                   "--config.lr=2", "--print_only", check=False)
  assert out.returncode == 2 and "both swept and set" in out.stderr


def test_bad_values_stop_the_recipe_sweep_before_any_point_runs(tmp_path):
  """Each point's RecipeConfig is built up front: a value its dataclasses refuse, or a
  None that cannot travel as a flag, names the point and runs nothing."""
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  args = ["--config", "experiments/configs/toy.py:smoke", "--workdir", str(tmp_path / "sw")]
  out = _sweep_cli(env, *args, "--sweep", "rl.downsample.method=roc,bogus", check=False)
  assert out.returncode == 2, out.stdout + out.stderr
  assert "sweep point 1 (rl.downsample.method=bogus): config.rl.downsample: " \
         "DownsampleConfig.method: unknown down-sampler 'bogus'" in out.stderr
  out = _sweep_cli(env, *args, "--sweep", "rl.loss.dual_clip_c=None", check=False)
  assert out.returncode == 2 and "dual_clip_c=None cannot be passed on the command line" \
      in out.stderr
  assert not (tmp_path / "sw").exists()
  # Other entry points (no builder known): only keys and types are checked.
  config = ml_collections.ConfigDict({"seed": 0, "n": 1})
  sweep_overrides.validate([{"n": -1}], config)
  with pytest.raises(sweep_points.SweepError, match=r"sweep point 0 \(n=-1\): n must be >= 0"):
    sweep_overrides.validate([{"n": -1}], config, build=_positive_n)


def _positive_n(config):
  if config.n < 0:
    raise ValueError("n must be >= 0")


@pytest.mark.slow
def test_real_recipe_two_points(tmp_path):
  """Two points of the smoke recipe (1 RL step) through the real entry point."""
  env = procs.cpu_env(PYTHONPATH=REPO)
  root = tmp_path / "sw"
  args = ["--config", "experiments/configs/toy.py:smoke", "--workdir", str(root),
          "--sweep", "rl.downsample.method=roc,uniform", "--config.stage1.num_steps=1",
          "--workers", "2"]
  out = _sweep_cli(env, *args)
  rows = list(csv.DictReader(open(root / "results.csv")))
  assert [r["point"] for r in rows] == ["rl.downsample.method=roc",
                                        "rl.downsample.method=uniform"]
  for r in rows:
    assert r["status"] == "finished" and 0.0 <= float(r["pass_at_1"]) <= 1.0
    assert r["last_rl/step"] == "1"
  cfg = json.load(open(root / "rl.downsample.method=uniform" / "config.json"))
  assert cfg["rl"]["downsample"]["method"] == "uniform" and cfg["stage1"]["num_steps"] == 1
  out = _sweep_cli(env, *args)
  assert out.stdout.count("finished before") == 3


def test_seed_table_without_a_seed_axis_names_the_points_left_out(tmp_path):
  pts = sweep_points.make_points([{"m": "roc"}, {"m": "u"}], str(tmp_path))
  _write_point(pts[0], {"pass_at_1": 0.5})
  md = sweep_results.write_tables(str(tmp_path), pts,
                                  [sweep_points.Outcome(pts[0], "done"),
                                   sweep_points.Outcome(pts[1], "not started")])
  assert "| m=roc | roc |  | 1 |  | 0.5 |" in md, md
  assert "| m=u | u |  | 0 | m=u (not started) | n/a |" in md, md
  assert "None" not in md


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups")
def test_real_recipe_point_stopped_by_sigterm_resumes(tmp_path):
  """A scheduler's SIGTERM to a sweep of the smoke recipe mid-SFT: the point saves and
  exits 143, the queued point does not start, and the rerun resumes SFT where it stopped."""
  env = procs.cpu_env(PYTHONPATH=REPO)
  root = tmp_path / "sw"
  args = [sys.executable, "-m", "experiments.sweep", "--config",
          "experiments/configs/toy.py:smoke", "--workdir", str(root), "--sweep",
          "rl.downsample.method=roc,uniform", "--config.stage1.num_steps=1"]
  rows = root / "rl.downsample.method=roc" / "sft" / "metrics_sft.jsonl"
  with open(tmp_path / "out", "w") as out:
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    _wait_for(lambda: rows.exists() and len(rows.read_text().splitlines()) >= 2,
              "two SFT steps")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait() == 128 + signal.SIGTERM, (tmp_path / "out").read_text()
  points = {p["name"]: p for p in json.load(open(root / "sweep.json"))["points"]}
  assert points["rl.downsample.method=roc"]["status"] == "interrupted"
  assert points["rl.downsample.method=roc"]["returncode"] == 128 + signal.SIGTERM
  assert points["rl.downsample.method=uniform"]["status"] == "not started"
  log = open(root / "rl.downsample.method=roc" / "sweep.log").read()
  step = int(log.split("interrupted: stopped by SIGTERM after step ")[1].split()[0])
  out = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  log = open(root / "rl.downsample.method=roc" / "sweep.log").read()
  assert f"resumed SFT at step {step}" in log
  assert {r["status"] for r in csv.DictReader(open(root / "results.csv"))} == {"finished"}


def test_tables_say_which_stages_had_no_learning_signal(tmp_path):
  """A stage whose groups were all-correct or all-wrong trained on zero advantages; its
  DONE.json says so, and the tables carry it: per point the stages, per seed group how
  many seeds. A point with no finished RL stage has no entry (n/a), never "none"."""
  pts = sweep_points.make_points([{"seed": 0}, {"seed": 1}, {"seed": 2}], str(tmp_path))
  for p, flags_ in zip(pts, ({"stage1": False, "stage2": True}, {"stage1": False}, None)):
    os.makedirs(p.workdir, exist_ok=True)
    with open(os.path.join(p.workdir, "eval_final.json"), "w") as f:
      json.dump({"pass_at_1": 0.25}, f)
    for stage, flag in (flags_ or {}).items():
      os.makedirs(os.path.join(p.workdir, stage))
      with open(os.path.join(p.workdir, stage, "DONE.json"), "w") as f:
        json.dump({"steps": 3, "no_learning_signal": flag}, f)
  outcomes = [sweep_points.Outcome(p, "done", 0, 1.0) for p in pts]
  rows, cols = sweep_results.result_rows(pts, outcomes)
  assert [r.get(sweep_results.NO_SIGNAL_KEY) for r in rows] == ["stage2", "none", None]
  md = sweep_results.write_tables(str(tmp_path), pts, outcomes)
  assert "| stage2 |" in md and "| none |" in md
  grouped, gcols = sweep_results.seed_rows(
      pts, rows, [c for c in cols if c not in ("point", "status", "seed")])
  assert "no signal" in gcols and sweep_results.NO_SIGNAL_KEY not in gcols
  assert grouped[0]["no signal"] == "1 of 2" and grouped[0]["n"] == 3
