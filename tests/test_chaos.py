"""Chaos on a local Ray fleet, compared bit for bit with the same fleet left alone.

The toy RL stage (3 steps) runs under `Cluster.run_trainers` on 2 sandbox servers, 2
rollout servers of ours and 2 trainer processes (one JAX job, params sharded over both),
twice from one SFT stage: once uninterrupted (the reference) and once while a kill
schedule SIGKILLs a sandbox server, a rollout server and a trainer process, each in the
middle of a step:

* the schedule is drawn from a seed new at every run (printed, and in every assertion
  message; `RSTAR_CHAOS_SEED=<seed>` replays it): for each kill, its victim, its step
  and a delay into that step's rollouts (under 60% of the reference's shortest rollout
  phase, counted from the moment a rollout server first reports work for the step);
* the rollout server is killed with generation requests in flight: it is held in place
  (`/pause_generation` mode "in_place", SGLang's API: running requests keep their slots,
  none finishes) while its `/v1/loads` is read, and killed only if that reports running
  or waiting requests; the test asserts the count it read, and that the trainer's client
  moved the lost requests to the other server (its "request ... goes to" log lines);
* the trainer process is killed after the step's rollouts began (a rollout server
  reported work after the previous step's metrics row) and before the step's
  checkpoint: it is stopped (SIGSTOP) while that is checked, then killed; the job must
  resume from the previous step's checkpoint (its "resumed ... at step N" line);
* a server kill drawn for the trainer's step lands in that step redone after the
  trainer's restart, not before the trainer kill (where the job would throw its effect
  away with the step); the test asserts that order;
* a kill whose step ended before it could land that way moves to the next step, with
  no delay (said in the record); a schedule that could not land fails the test.

The servers' actors restart them on their ports, the supervisor restarts the trainer
job from its checkpoint, and the run equals the reference bit for bit: every per-step
metric and the final parameters and Adam moments (from both runs' last orbax
checkpoints; the moments are asserted non-zero). Both runs are one program on one
machine: rollout servers with `--enable-deterministic-inference` (a request's tokens
and log-probs depend on nothing but the request and the weights, whichever server runs
it and whoever shares its batch; the client refuses servers without it), float32
weight syncs, the same 2-process mesh. What may differ, and why:

* wall-clock figures: `time/*`, `sync/write_s`, `sync/update_s`, `sync/total_s`,
  `sync/s_per_gb`;
* `sync/servers`, the number of rollout servers a step's weight sync reached: a server
  still restarting at that moment is skipped and catches up before it rejoins
  (`sglang.engine.update_weights_from_disk`), so it can be 1 instead of 2 in a row at
  or after the rollout kill. It describes the fleet, not the training: the rollouts a
  late server serves carry the version it caught up to, and a step refuses others.

No process of either fleet is left behind. What it needs is made here, no more: the
SFT stage alone, shared by both runs (and their XLA compile cache).
"""
import dataclasses
import json
import os
import random
import re
import signal
import threading
import time
import urllib.request

import pytest

from tests import procs
from tests.test_recipe import REPO, RL_ARGS, SMOKE, _copy_sft, _metrics, _run

SEED_ENV = "RSTAR_CHAOS_SEED"
STEPS = 3    # RL_ARGS: --config.stage1.num_steps=3
# Wall-clock figures: the only values that differ between two runs of one program.
TIMING = ("sync/write_s", "sync/update_s", "sync/total_s", "sync/s_per_gb")
# The fleet's state at a weight sync, not the training's (module docstring).
FLEET_STATE = ("sync/servers",)


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
  """The smoke config's SFT stage, nothing after it (what both fleet runs start from)."""
  workdir = str(tmp_path_factory.mktemp("chaos_sft"))
  _run(workdir, "--stages=sft")
  return workdir


def _cluster_config(d, sft, log_dir):
  from rstar_jax.recipe import cluster
  return cluster.ClusterConfig(
      sandbox_servers=2, sandbox_cpus=0.25, rollout_servers=2, rollout_cpus=0.25,
      rollout_hf_dir=os.path.join(d, "sft", "export"),
      # The in-process engine's shapes (RL_ARGS' 4 slots, the smoke config's 320 tokens),
      # batch-invariant, compiled programs kept beside the SFT stage's for both runs.
      rollout_args=("--num_slots", "4", "--max_len", "320", "--min_prefill_bucket", "16",
                    "--enable-deterministic-inference",
                    "--compile_cache", os.path.join(sft, "compile_cache")),
      trainer_processes=2, trainer_cpus=0.25, trainer_config=SMOKE,
      trainer_args=(f"--config.workdir={d}", *RL_ARGS,
                    "--config.rollout.weight_sync.dtype=float32",
                    "--config.rollout.client.require_deterministic=True",
                    "--config.mesh.enabled=True", "--config.mesh.fsdp=-1"),
      restart_backoff_s=0.0, log_dir=log_dir, startup_timeout_s=600)


def _run_fleet(d, sft, log_dir, chaos=None):
  """Stage 1 of workdir `d` on a fresh local Ray fleet; `chaos(fleet, over)` runs in a
  thread beside it until the trainers end (`over` set). Returns what the assertions read."""
  ray = pytest.importorskip("ray")
  from rstar_jax.recipe import cluster
  t0 = time.perf_counter()
  pids = set()
  from rstar_jax.recipe import cluster as cluster_lib
  cluster_lib._local_ray_on_loopback()   # servers and the coordinator on loopback only
  ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
           _node_ip_address=cluster_lib.LOOPBACK,
           runtime_env={"env_vars": {"XLA_FLAGS": procs.xla_flags(), "JAX_PLATFORMS": "cpu",
                                     "PYTHONPATH": REPO}})
  try:
    fleet = cluster.Cluster(_cluster_config(d, sft, log_dir))
    try:
      for info in fleet.server_info().values():
        pids |= {i["pid"] for i in info}
      over = threading.Event()
      thread = threading.Thread(target=chaos, args=(fleet, over)) if chaos else None
      if thread:
        thread.start()
      try:
        codes = fleet.run_trainers()
      finally:
        over.set()
        if thread:
          thread.join()
      logs = fleet.trainer_logs()
      info = fleet.server_info()
      for i in info.values():
        pids |= {x["pid"] for x in i}
      pids.update(ray.get([t.pid.remote() for t in fleet.trainers]))
    finally:
      fleet.shutdown()
  finally:
    ray.shutdown()
  return dict(codes=codes, logs=logs, info=info, restarts=fleet.restarts, pids=pids,
              wall_s=time.perf_counter() - t0)


@pytest.fixture(scope="module")
def reference(sft_dir, tmp_path_factory):
  """The same fleet, the same flags, nothing killed: the reference run's directory."""
  d = _copy_sft(sft_dir, tmp_path_factory.mktemp("chaos_reference") / "run")
  out = _run_fleet(d, sft_dir, str(tmp_path_factory.mktemp("chaos_reference_logs")))
  assert out["codes"] == [0, 0], "\n".join(log[-3000:] for log in out["logs"])
  assert not out["restarts"], out["restarts"]
  print(f"reference fleet run: {out['wall_s']:.0f} s, load {os.getloadavg()}")
  assert not procs.left_running(out["pids"], wait_s=60), "fleet processes left behind"
  return d


def _final_state(d):
  """The last checkpoint's train state of `d`'s stage 1 as {key path: numpy array}, read
  with orbax into host arrays (it was saved sharded over the two trainer processes'
  devices, which this process does not have)."""
  import jax
  import numpy as np
  import orbax.checkpoint as ocp
  path = os.path.join(d, "stage1", "checkpoints")
  mgr = ocp.CheckpointManager(path)
  try:
    step = mgr.latest_step()
  finally:
    mgr.close()
  item = os.path.join(path, str(step), "state")
  ckptr = ocp.PyTreeCheckpointer()
  tree = ckptr.metadata(item).item_metadata.tree
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  state = ckptr.restore(item, args=ocp.args.PyTreeRestore(restore_args=args))
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(state)}


# ---- the kill schedule --------------------------------------------------------------
@dataclasses.dataclass
class Kill:
  what: str           # "sandbox" | "rollout" | "trainer"
  victim: int         # which of the 2
  step: int           # the step (1..STEPS) it is meant to land in
  delay_s: float      # after that step's rollouts began
  landed: dict = dataclasses.field(default_factory=dict)   # what was seen when it landed


def draw_schedule(seed: int, rollout_s: float) -> list[Kill]:
  """One kill of each kind, each in a step drawn from those that leave it a later step
  to move to (a missed one moves on): the sandbox's and the rollout server's in step 1
  or 2, the trainer's in step 2 (a kill in step 1 would restart it from nothing, not
  from a checkpoint; one in step 3 would have no step to move to; its window, rollouts
  to checkpoint, is wide). The delay is
  under 60% of `rollout_s`, the reference's shortest rollout phase (step 1's includes
  the servers' compiles), so that it falls while rollouts run."""
  rng = random.Random(seed)
  out = []
  for what, steps in (("sandbox", (1, 2)), ("rollout", (1, 2)), ("trainer", (2,))):
    out.append(Kill(what, rng.randrange(2), rng.choice(steps), rng.uniform(0, 0.6) * rollout_s))
  return out


def _rows(path) -> int:
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    return f.read().count("\n")


def _http(url, route, body=None):
  data = None if body is None else json.dumps(body).encode()
  req = urllib.request.Request(url + route, data=data,
                               headers={"Content-Type": "application/json"})
  with urllib.request.urlopen(req, timeout=10) as r:
    return json.loads(r.read() or b"null")


def _work(url) -> int:
  """Generation requests a rollout server holds (running or waiting), 0 if it does not
  answer (down, restarting)."""
  try:
    load = _http(url, "/v1/loads")["loads"][0]
  except OSError:
    return 0
  return load["num_running_reqs"] + load["num_waiting_reqs"]


def _continue(url) -> None:
  try:
    _http(url, "/continue_generation", {})
  except OSError:   # gone meanwhile: it restarts unpaused
    pass


class Chaos:
  """Runs the schedule against a fleet: one thread per kill."""

  def __init__(self, workdir, schedule):
    self.metrics = os.path.join(workdir, "stage1", "metrics_rl.jsonl")
    self.checkpoints = os.path.join(workdir, "stage1", "checkpoints")
    self.schedule = schedule

  def __call__(self, fleet, over):
    threads = [threading.Thread(target=self._one, args=(fleet, over, k)) for k in self.schedule]
    for t in threads:
      t.start()
    for t in threads:
      t.join()

  def _step_began(self, fleet, over, step) -> int | None:
    """Waits until step `step` is running and its rollouts began: the previous step's row
    is written, this one's is not, and a rollout server reports work. Returns that
    server's request count; 0 if the step is past, None if the stage ended."""
    while not over.is_set():
      rows = _rows(self.metrics)
      if rows >= step:
        return 0
      if rows == step - 1:
        for url in fleet.rollout_urls:    # fixed: a server restarts on its port
          n = _work(url)
          if n:
            return n
      over.wait(0.02)
    return None

  def _after_the_trainer(self, fleet, over) -> None:
    """Until the trainer kill has landed and the restarted job has resumed. A server
    killed in the trainer's step before it would have its effect thrown away with the
    step (the job redoes it), and requests a killed trainer left running on a server are
    no one's: a server kill of that step lands in the redone step instead."""
    trainer = next(k for k in self.schedule if k.what == "trainer")
    while not over.is_set() and not (trainer.landed.get("step") and fleet.restarts
                                     and fleet.restarts[-1]["resumed_step"] is not None):
      over.wait(0.05)

  def _one(self, fleet, over, kill):
    step, delay = kill.step, kill.delay_s
    trainer_step = next(k.step for k in self.schedule if k.what == "trainer")
    while step <= STEPS:
      if kill.what != "trainer" and step == trainer_step:
        self._after_the_trainer(fleet, over)
      began = self._step_began(fleet, over, step)
      if began is None:
        return
      if began and not over.wait(delay):
        land = getattr(self, "_" + kill.what)(fleet, over, kill, step)
        if land is not None:
          kill.landed = dict(land, step=step, began_with=began, rows=_rows(self.metrics),
                             t=time.monotonic())
          return
      if over.is_set():
        return
      kill.landed.setdefault("missed", []).append(step)   # moves to the next step, no delay
      step, delay = step + 1, 0.0

  def _sandbox(self, fleet, over, kill, step):
    if _rows(self.metrics) != step - 1:
      return None
    os.kill(fleet.server_info()["sandbox"][kill.victim]["pid"], signal.SIGKILL)
    return {}

  def _rollout(self, fleet, over, kill, step):
    info = fleet.server_info()["rollout"][kill.victim]
    url = info["url"]
    # Until the victim holds requests of this step: held in place, read, killed.
    while not over.is_set() and _rows(self.metrics) == step - 1:
      if _work(url):
        load = None
        try:
          _http(url, "/pause_generation", {"mode": "in_place"})
          load = _http(url, "/v1/loads")["loads"][0]
          if load["num_running_reqs"] + load["num_waiting_reqs"]:
            os.kill(info["pid"], signal.SIGKILL)
            return {"running": load["num_running_reqs"], "waiting": load["num_waiting_reqs"]}
        except OSError:   # it did not answer: looked at again
          pass
        finally:
          if load is None or not load["num_running_reqs"] + load["num_waiting_reqs"]:
            _continue(url)   # nothing held (all finished): let it go on, try again
      over.wait(0.01)
    return None

  def _trainer(self, fleet, over, kill, step):
    import ray
    pid = ray.get(fleet.trainers[kill.victim].pid.remote())
    # Stopped while checked: with one process of the job frozen its collective save of
    # this step cannot complete, so what is seen here holds at the kill.
    os.kill(pid, signal.SIGSTOP)
    saved = os.path.isdir(os.path.join(self.checkpoints, str(step)))
    if saved or _rows(self.metrics) < step - 1:
      os.kill(pid, signal.SIGCONT)
      return None
    os.kill(pid, signal.SIGKILL)    # delivered to a stopped process too
    return {"pid": pid}


def test_a_fleet_under_random_kills_equals_the_uninterrupted_fleet_bit_for_bit(
    sft_dir, reference, tmp_path):
  seed = int(os.environ.get(SEED_ENV) or int.from_bytes(os.urandom(4), "little"))
  ref_rows = _metrics(os.path.join(reference, "stage1", "metrics_rl.jsonl"))
  schedule = draw_schedule(seed, min(r["time/rollout_s"] for r in ref_rows))
  tag = f"[chaos seed {seed}; replay: {SEED_ENV}={seed}]"
  print(f"{tag} schedule: {schedule}")
  d = _copy_sft(sft_dir, tmp_path / "chaos")
  out = _run_fleet(d, sft_dir, str(tmp_path / "logs"), Chaos(d, schedule))
  print(f"{tag} chaos fleet run: {out['wall_s']:.0f} s, load {os.getloadavg()}; "
        f"kills: {schedule}")
  where = f"{tag} kills: {schedule}"
  assert out["codes"] == [0, 0], where + "\n" + "\n".join(log[-3000:] for log in out["logs"])
  # Every kill landed mid-stage; the rollout server's with requests in flight.
  assert all(k.landed.get("step") for k in schedule), where
  sandbox, rollout, trainer = schedule
  assert rollout.landed["running"] + rollout.landed["waiting"] >= 1, where
  # The client saw it: what the killed server held went to the other one (process 0,
  # which drives the rollouts, logs each request it moves to another server).
  with open(os.path.join(tmp_path, "logs", "trainer0.log")) as f:
    other = out["info"]["rollout"][1 - rollout.victim]["url"]
    assert re.search(rf"sglang: request \S+ goes to {re.escape(other)}\b", f.read()), where
  for k in (sandbox, rollout):
    assert [i["restarts"] for i in out["info"][k.what]] == [int(j == k.victim)
                                                           for j in range(2)], (where, out["info"])
  # No server kill's ride-out was thrown away: none landed in the trainer's step before it.
  for k in (sandbox, rollout):
    assert k.landed["step"] != trainer.landed["step"] or k.landed["t"] > trainer.landed["t"], where
  # The trainer's: one restart, from the checkpoint before the step it was killed in.
  assert len(out["restarts"]) == 1, (where, out["restarts"])
  assert "killed by SIGKILL" in out["restarts"][0]["cause"], (where, out["restarts"])
  assert out["restarts"][0]["resumed_step"] == trainer.landed["step"] - 1, (
      where, out["restarts"])
  # Bit for bit: every metric but the wall-clock ones and the fleet's state at a sync.
  rows = _metrics(os.path.join(d, "stage1", "metrics_rl.jsonl"))
  assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == [1, 2, 3], where
  for ra, rb in zip(ref_rows, rows):
    assert set(ra) == set(rb), (where, ra["step"], set(ra) ^ set(rb))
    for key, v in ra.items():
      if key.startswith("time/") or key in TIMING:
        continue
      if key in FLEET_STATE:
        assert v == 2.0 and rb[key] in (1.0, 2.0) and (
            rb[key] == v or ra["step"] >= rollout.landed["step"]), (where, ra["step"], key)
        continue
      assert rb[key] == v or (v != v and rb[key] != rb[key]), (where, ra["step"], key, v,
                                                                rb[key])
  sa, sb = _final_state(reference), _final_state(d)
  assert sa.keys() == sb.keys(), where
  moments = [k for k in sa if "['mu']" in k or "['nu']" in k]
  assert len(moments) >= 2 and all(sa[k].any() for k in moments), "Adam moments are all 0"
  for k in sa:
    assert sa[k].dtype == sb[k].dtype and sa[k].tobytes() == sb[k].tobytes(), (where, k)
  # Ray's workers and the servers they ran end a moment after the shutdown: waited for.
  assert not procs.left_running(out["pids"], wait_s=60), "fleet processes left behind"
