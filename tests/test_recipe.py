"""End to end: a minimal recipe run, and RL killed mid-run then resumed.

Everything is real: the toy tokenizer is trained here, the sandbox server is a
subprocess, SFT and RL run the same code as the CPU recipe, with tiny sizes.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
from tests import procs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = "experiments/configs/toy.py:smoke"   # tiny sizes: the whole pipeline in about a minute


def _run(workdir, *extra, module="experiments.recipe", wait=True, check=True, config=SMOKE):
  cmd = [sys.executable, "-m", module, "--config", config, f"--config.workdir={workdir}",
         *extra]
  env = procs.cpu_env(PYTHONPATH=REPO)  # one CPU device, as on a laptop
  if not wait:
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
  out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  if check:
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout + out.stderr
  return out


def _metrics(path):
  with open(path) as f:
    return [json.loads(l) for l in f if l.strip()]


@pytest.fixture(scope="module")
def recipe_dir(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("recipe"))
  log = _run(workdir, "--config.stage1.num_steps=2")
  return workdir, log


def test_two_step_recipe_end_to_end(recipe_dir):
  workdir, log = recipe_dir
  for stage in ("sft", "stage1"):
    assert os.path.exists(os.path.join(workdir, stage, "DONE.json")), stage
    assert os.path.exists(os.path.join(workdir, stage, "export", "config.json")), stage
  rows = _metrics(os.path.join(workdir, "stage1", "metrics_rl.jsonl"))
  assert [r["step"] for r in rows] == [1, 2]
  assert all("train/loss" in r and "rollout/reward_mean" in r for r in rows)
  report = json.load(open(os.path.join(workdir, "eval_final.json")))
  assert report["temperature"] == 1.0 and report["samples_per_problem"] == 2
  samples = _metrics(os.path.join(workdir, "eval_final_samples.jsonl"))
  assert len(samples) == 4 * 2   # 4 eval problems x k=2, one line each
  assert {s["uid"].rpartition("#")[0] for s in samples} == {f"toy-eval-{i}" for i in range(4)}
  assert all(s["problem"].startswith("What is") and s["answer"] and s["reward"] in (0.0, 1.0)
             and s["response"] for s in samples)
  assert os.listdir(os.path.join(workdir, "compile_cache"))   # persistent XLA cache in use
  assert "temperature 1.0" in log and "pass@1" in log
  assert os.path.getsize(os.path.join(workdir, "rl_progress.png")) > 1000
  sft = _metrics(os.path.join(workdir, "sft", "metrics_sft.jsonl"))
  assert sft[-1]["sft/loss"] < sft[0]["sft/loss"]   # SFT learns something
  # The export renders our protocol through transformers' chat template.
  import transformers
  from rstar_jax.recipe import recipe_config
  from rstar_jax.model import tokenizer as tokenizer_lib
  from rstar_jax.rollout import chat
  export = os.path.join(workdir, "stage1", "export")
  hf_tok = transformers.AutoTokenizer.from_pretrained(export)
  text = hf_tok.apply_chat_template([{"role": "user", "content": "What is 12*34?"}],
                                    tokenize=False, add_generation_prompt=True)
  cfg = recipe_config.build_config(json.load(open(os.path.join(workdir, "config.json"))))
  proto = chat.ChatProtocol(tokenizer_lib.Tokenizer.from_dir(export), cfg.chat)
  assert hf_tok.encode(text, add_special_tokens=False) == proto.prompt_ids("What is 12*34?")


def test_rerun_skips_finished_stages(recipe_dir):
  workdir, _ = recipe_dir
  log = _run(workdir, "--config.stage1.num_steps=2", "--stages=sft,stage1")
  assert "SFT:" not in log and "RL:" not in log   # no progress bars: nothing re-ran
  assert "sft: already done" in log and "stage1: already done" in log
  assert "nothing to do" in log


def test_an_after_sft_evaluation_cut_off_runs_on_resume(recipe_dir, tmp_path):
  """SFT is marked done before its evaluation: a run stopped in between (or killed
  during it) evaluates the finished SFT model on the next run, without training again."""
  d = _copy_sft(recipe_dir[0], tmp_path / "run")   # SFT done, its evaluation not
  args = ("--config.eval.after_sft=True", "--stages=sft")
  log = _run(d, *args)
  assert "sft: already done, its evaluation (config.eval.after_sft) is not: evaluating it" in log
  assert "SFT:" not in log   # no progress bar: not trained again
  report = json.load(open(os.path.join(d, "eval_after_sft.json")))
  assert 0.0 <= report["pass_at_1"] <= 1.0 and report["samples_per_problem"] == 2
  assert "nothing to do" in _run(d, *args)


def test_resolved_config_is_written_and_a_changed_one_refused(recipe_dir):
  workdir, log = recipe_dir
  with open(os.path.join(workdir, "config.json")) as f:
    saved = json.load(f)
  assert saved["rl"]["downsample"]["use_error_penalty"] is True   # every field, resolved
  assert saved["stage1"]["num_steps"] == 2 and saved["rl"]["downsample"]["use_format_penalty"]
  # Printed: what differs from the config file (the full config is in config.json).
  assert (f"config: {SMOKE} with 1 change(s) (in full: {workdir}/config.json):\n"
          f"  workdir: '/tmp/rstar_toy' -> '{workdir}'\n") in log, log[:2000]
  assert '"use_format_penalty"' not in log
  out = _run(workdir, "--config.stage1.num_steps=2", "--config.rl.optimizer.learning_rate=1e-3",
             "--stages=sft", check=False)
  assert out.returncode == 2
  assert "made with another config; changed: rl.optimizer.learning_rate: 0.0003 -> 0.001" \
      in out.stderr
  assert json.load(open(os.path.join(workdir, "config.json"))) == saved   # never overwritten
  log = _run(workdir, "--config.stage1.num_steps=2", "--config.rl.optimizer.learning_rate=1e-3",
             "--stages=sft", "--config.allow_config_change=True")
  # The file it wrote, and the change from the config file.
  assert f"(in full: {os.path.join(workdir, 'config_1.json')}):" in log
  assert "  rl.optimizer.learning_rate: 0.0003 -> 0.001\n" in log
  beside = json.load(open(os.path.join(workdir, "config_1.json")))
  assert beside["rl"]["optimizer"]["learning_rate"] == 1e-3
  assert json.load(open(os.path.join(workdir, "config.json"))) == saved
  os.remove(os.path.join(workdir, "config_1.json"))


def test_launch_settings_are_not_a_config_change(tmp_path):
  """Process 1 of a multi-process run reads the config.json process 0 has just written
  (process_id 0): that is the same run, not a changed config. (The two-process test
  hung when process 1 refused it and left process 0 waiting at the barrier.)"""
  import dataclasses
  from experiments.configs import toy
  from rstar_jax import config_utils
  from rstar_jax.recipe import recipe_config, workdir_state
  c = toy.get_config("smoke")
  c.workdir = str(tmp_path)
  cfg = recipe_config.build_config(c)
  workdir_state.check_workdir(cfg)
  os.makedirs(tmp_path / "sft")
  (tmp_path / "sft" / "DONE.json").write_text(json.dumps({"steps": 1}))
  launch = dataclasses.replace(cfg.distributed, process_id=1, num_processes=2,
                               coordinator_address="127.0.0.1:1234")
  workdir_state.check_workdir(dataclasses.replace(cfg, distributed=launch))
  # Where compiled programs are kept is not the run's config either (a sweep shares one).
  workdir_state.check_workdir(
      dataclasses.replace(cfg, compile_cache_dir=str(tmp_path / "shared")))
  # Nor a fleet's addresses, new at every launch or requeue, nor moving the RL stages
  # from in-process engines to servers (experiments/configs/cluster_toy.py's flow).
  fleet = dataclasses.replace(
      cfg, tools=dataclasses.replace(cfg.tools, urls=("http://node9:8321",)),
      rollout=dataclasses.replace(cfg.rollout, backend="server",
                                  servers=("http://node9:30000",)))
  workdir_state.check_workdir(fleet)
  # Nor how often it saves and how many it keeps (freeing disk mid-run), nor the HTTP
  # client's waits.
  workdir_state.check_workdir(dataclasses.replace(
      cfg, rl=dataclasses.replace(cfg.rl, checkpoint_every=7, keep_checkpoints=1),
      sft=dataclasses.replace(cfg.sft, checkpoint_every=9, keep_checkpoints=1),
      rollout=dataclasses.replace(cfg.rollout, client=dataclasses.replace(
          cfg.rollout.client, no_server_wait_s=5.0))))
  with pytest.raises(config_utils.ConfigError, match="seed: 0 -> 1"):
    workdir_state.check_workdir(dataclasses.replace(cfg, seed=cfg.seed + 1))
  # A changed config goes beside the old one once, not once per rerun.
  changed = dataclasses.replace(cfg, seed=cfg.seed + 1, allow_config_change=True)
  assert workdir_state.check_workdir(changed)[1] == str(tmp_path / "config_1.json")
  assert workdir_state.check_workdir(changed)[1] == str(tmp_path / "config_1.json")
  assert sorted(p.name for p in tmp_path.glob("config*.json")) == ["config.json",
                                                                   "config_1.json"]
  with pytest.raises(config_utils.ConfigError, match=r"rollout\.engine\.num_slots"):
    workdir_state.check_workdir(dataclasses.replace(cfg, rollout=dataclasses.replace(
        cfg.rollout, engine=dataclasses.replace(cfg.rollout.engine, num_slots=3))))


def test_a_changed_config_is_refused_while_a_stage_can_resume(tmp_path):
  """A stage with a checkpoint resumes from it: another config would continue it with
  other settings (or fail to restore it), so it is refused as for a finished stage."""
  import dataclasses
  from experiments.configs import toy
  from rstar_jax import config_utils
  from rstar_jax.recipe import recipe_config, workdir_state
  c = toy.get_config("smoke")
  c.workdir = str(tmp_path)
  cfg = recipe_config.build_config(c)
  workdir_state.check_workdir(cfg)
  workdir_state.check_workdir(dataclasses.replace(cfg, seed=1))   # nothing started: replaced
  assert json.load(open(tmp_path / "config.json"))["seed"] == 1
  workdir_state.check_workdir(cfg)
  os.makedirs(tmp_path / "sft" / "checkpoints" / "3")
  with pytest.raises(config_utils.ConfigError,
                     match=r"stages \['sft'\] \(finished or resumable\).*seed: 0 -> 1"):
    workdir_state.check_workdir(dataclasses.replace(cfg, seed=1))
  assert json.load(open(tmp_path / "config.json"))["seed"] == 0


def test_an_evaluation_with_other_results_keeps_the_previous_report(tmp_path):
  """Re-evaluating with another eval.k (or another model) must not lose the old report."""
  from rstar_jax.recipe import stages
  path, samples = str(tmp_path / "eval_final.json"), str(tmp_path / "eval_final_samples.jsonl")
  stages._keep_previous_report(path, samples, '{"k": 2}')   # nothing there yet
  assert os.listdir(tmp_path) == []
  (tmp_path / "eval_final.json").write_text('{"k": 2}')
  (tmp_path / "eval_final_samples.jsonl").write_text("old samples\n")
  stages._keep_previous_report(path, samples, '{"k": 2}')   # the same report: replaced
  assert sorted(os.listdir(tmp_path)) == ["eval_final.json", "eval_final_samples.jsonl"]
  for n in (1, 2):
    stages._keep_previous_report(path, samples, '{"k": 8}')
    assert json.load(open(tmp_path / f"eval_final_{n}.json")) == {"k": 2}
    assert (tmp_path / f"eval_final_{n}_samples.jsonl").read_text() == "old samples\n"
    assert not os.path.exists(path) and not os.path.exists(samples)
    (tmp_path / "eval_final.json").write_text('{"k": 2}')
    (tmp_path / "eval_final_samples.jsonl").write_text("old samples\n")


def test_rl_without_sft_refuses_a_random_model(tmp_path):
  out = _run(tmp_path, module="experiments.train_rl", check=False)
  assert out.returncode == 2
  assert "would start from a randomly initialised model" in out.stderr
  assert "allow_random_init" in out.stderr and "Traceback" not in out.stderr
  assert not os.path.exists(tmp_path / "stage1" / "checkpoints")


def test_evaluate_hf_dir_uses_the_exports_tokenizer(recipe_dir, tmp_path):
  workdir, _ = recipe_dir
  export = os.path.join(workdir, "stage1", "export")
  # Another seed would train another toy tokenizer; the export's own must be used.
  _run(tmp_path, "--config.seed=5", f"--hf_dir={export}", module="experiments.evaluate")
  report = json.load(open(tmp_path / "eval_hf_dir.json"))
  assert report["model_source"] == export and report["seed"] == 5
  assert not os.path.exists(tmp_path / "tokenizer")   # none trained
  samples = _metrics(tmp_path / "eval_hf_dir_samples.jsonl")
  from rstar_jax.model import tokenizer as tokenizer_lib
  tok = tokenizer_lib.Tokenizer.from_dir(export)
  assert all(s["response"] == tok.decode(tok.encode(s["response"])) for s in samples[:2])


RL_ARGS = ("--config.stage1.num_steps=3", "--stages=stage1",
           "--config.rollout.engine.num_slots=4")


def _share_compile_cache(src, dst):
  """Points dst's XLA cache at src's: the runs compile the same programs, and each
  compiled them afresh (6-7 s of a 15-20 s RL run). Runs may share a cache (the
  recipe's `compile_cache_dir`), and what a run computes does not depend on it."""
  os.symlink(os.path.join(src, "compile_cache"), os.path.join(dst, "compile_cache"))


def _copy_sft(src, dst):
  os.makedirs(dst)
  shutil.copytree(os.path.join(src, "tokenizer"), os.path.join(dst, "tokenizer"))
  shutil.copytree(os.path.join(src, "sft"), os.path.join(dst, "sft"))
  _share_compile_cache(src, dst)
  return str(dst)


@pytest.fixture(scope="module")
def straight_run(recipe_dir, tmp_path_factory):
  """Stage 1 run uninterrupted from the shared SFT result: the reference (its directory)."""
  d = _copy_sft(recipe_dir[0], tmp_path_factory.mktemp("straight") / "run")
  _run(d, *RL_ARGS)
  return d


@pytest.fixture(scope="module")
def straight_rl(straight_run):
  """The uninterrupted run's metrics rows, one per step."""
  rows = _metrics(os.path.join(straight_run, "stage1", "metrics_rl.jsonl"))
  # The smoke run learns: some step has rewards that differ within a group, so the
  # comparisons below see real gradients and Adam moments, not zeros. Which steps do is
  # the sampled trajectories' affair, and those differ between CPU kinds' rounding.
  assert any(r["update/zero_advantage"] == 0.0 and r["train/grad_norm"] > 0 for r in rows), rows
  return rows


def _final_state(d):
  """The last checkpoint's train state of `d`'s stage 1 as {key path: numpy array}."""
  import jax
  import numpy as np
  import orbax.checkpoint as ocp
  mgr = ocp.CheckpointManager(os.path.join(d, "stage1", "checkpoints"))
  try:
    out = mgr.restore(mgr.latest_step(), args=ocp.args.Composite(
        state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
  finally:
    mgr.close()
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(out.state)}


def _assert_identical_runs(straight_dir, d):
  """Bit for bit: every per-step metric (wall-clock times aside) and the final
  parameters and Adam moments, which must be non-zero for the check to mean anything."""
  a = _metrics(os.path.join(straight_dir, "stage1", "metrics_rl.jsonl"))
  b = _metrics(os.path.join(d, "stage1", "metrics_rl.jsonl"))
  assert [r["step"] for r in b] == [r["step"] for r in a] == [1, 2, 3]
  for ra, rb in zip(a, b):
    assert set(ra) == set(rb), (ra["step"], set(ra) ^ set(rb))
    for k, v in ra.items():
      if not k.startswith("time/"):   # wall-clock figures differ, nothing else may
        assert rb[k] == v or (v != v and rb[k] != rb[k]), (ra["step"], k, v, rb[k])
  sa, sb = _final_state(straight_dir), _final_state(d)
  assert sa.keys() == sb.keys()
  moments = [k for k in sa if "['mu']" in k or "['nu']" in k]
  assert len(moments) >= 2 and all(sa[k].any() for k in moments), "Adam moments are all 0"
  for k in sa:
    assert sa[k].dtype == sb[k].dtype and sa[k].tobytes() == sb[k].tobytes(), k


def _synced_steps(d):
  """The weight-sync directory's versions, without the launch's mark (`-3fa9c1`)."""
  names = sorted(os.listdir(os.path.join(d, "weight_sync")))
  assert all(re.fullmatch(r"stage\d-step\d+-[0-9a-f]{6}", n) for n in names), names
  return [n.rsplit("-", 1)[0] for n in names]


def test_rl_stage_on_two_rollout_servers_matches_in_process(recipe_dir, straight_rl, tmp_path):
  """rollout.backend=server: stage 1 generates on two `rstar_jax.rollout.api_server`
  processes, which get the trainer's weights through disk after every update (float32
  checkpoints, so nothing is rounded); the metrics equal the in-process run's."""
  from tests.rollout.conftest import ServerProcess
  d = _copy_sft(recipe_dir[0], tmp_path / "served")
  export = os.path.join(d, "sft", "export")
  servers = [ServerProcess(export, str(tmp_path), name, num_slots=4, max_len=320, bucket=16,
                           one_device=True) for name in ("s1", "s2")]
  try:
    for s in servers:
      s.wait_ready()
    urls = ",".join(f"'{s.url}'" for s in servers)
    log = _run(d, *RL_ARGS, "--config.rollout.backend=server",
               f"--config.rollout.servers=({urls},)", "--config.rollout.weight_sync.dtype=float32")
  finally:
    for s in servers:
      s.kill()
  rows = _metrics(os.path.join(d, "stage1", "metrics_rl.jsonl"))
  _assert_same_metrics(straight_rl, rows)
  assert all(r["sync/servers"] == 2.0 and r["sync/gb"] > 0 for r in rows)
  # The checkpoints of the last two versions stay on disk; the servers say they got them.
  assert _synced_steps(d) == ["stage1-step2", "stage1-step3"]
  served_logs = "".join(open(s.log_path).read() for s in servers)
  assert "stage1-step3" in served_logs, served_logs[-2000:]
  assert "config error" not in log


# Back in CI: its intermittent hang was process 1 refusing the config.json process 0
# had just written (process_id 0 -> 1 read as a changed config) and leaving process 0
# at the tokenizer barrier; see test_launch_settings_are_not_a_config_change.
def test_rl_stage_as_two_trainer_processes_matches_one(recipe_dir, straight_rl, tmp_path):
  """Multi-process JAX: stage 1 as two trainer processes of one job (one CPU
  device each, the params sharded fsdp=2 over both, gloo collectives). Process 0
  generates on the rollout server and hands every step's batch to process 1; the
  metrics equal the single-process in-process run's, and only process 0 writes them."""
  from tests.rollout.conftest import ServerProcess, free_port
  d = _copy_sft(recipe_dir[0], tmp_path / "two_proc")
  server = ServerProcess(os.path.join(d, "sft", "export"), str(tmp_path), "s", num_slots=4,
                         max_len=320, bucket=16, one_device=True)
  port = free_port()
  try:
    server.wait_ready()
    procs = [_run(d, *RL_ARGS, "--config.rollout.backend=server",
                  f"--config.rollout.servers=('{server.url}',)",
                  "--config.rollout.weight_sync.dtype=float32",
                  "--config.mesh.enabled=True", "--config.mesh.fsdp=-1",
                  f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                  "--config.distributed.num_processes=2",
                  f"--config.distributed.process_id={i}", wait=False) for i in range(2)]
    logs = []
    try:
      for p in procs:
        logs.append(p.communicate(timeout=500)[0])
    except subprocess.TimeoutExpired:
      for p in procs:
        p.kill()
      logs = [p.communicate()[0] for p in procs]   # what each wrote before the kill
      raise AssertionError("timed out:\n" + "\n".join(
          f"process {i}:\n{log[-4000:]}" for i, log in enumerate(logs))) from None
    finally:
      for p in procs:
        p.kill()
  finally:
    server.kill()
  if any(p.returncode for p in procs):   # both tails: one process's failure shows in the other
    raise AssertionError("\n".join(f"process {i} exited {p.returncode}:\n{log[-4000:]}"
                                   for i, (p, log) in enumerate(zip(procs, logs))))
  assert "process 0 of 2, 1 local / 2 global devices" in logs[0]
  assert "RL:" in logs[0] and "RL:" not in logs[1]     # one progress bar, process 0's
  rows = _metrics(os.path.join(d, "stage1", "metrics_rl.jsonl"))
  _assert_same_metrics(straight_rl, rows)              # written once per step
  assert os.path.exists(os.path.join(d, "stage1", "DONE.json"))
  assert _synced_steps(d) == ["stage1-step2", "stage1-step3"]


def test_rl_stage_on_a_ray_fleet_survives_a_killed_sandbox_server(recipe_dir, straight_rl,
                                                                  tmp_path):
  """A real local Ray cluster (2 CPUs) launches 2 sandbox servers, 1 rollout
  server and the trainer as actors; one sandbox server is SIGKILLed after the first
  step. Its actor restarts it on the same URL, the calls it held run again elsewhere,
  and the stage's metrics equal the in-process run's: no call lost."""
  import ray
  from rstar_jax.recipe import cluster
  d = _copy_sft(recipe_dir[0], tmp_path / "fleet")
  cfg = cluster.ClusterConfig(
      sandbox_servers=2, sandbox_cpus=0.5, rollout_servers=1, rollout_cpus=0.5,
      rollout_hf_dir=os.path.join(d, "sft", "export"),
      rollout_args=("--num_slots", "4", "--max_len", "320", "--min_prefill_bucket", "16"),
      trainer_processes=1, trainer_cpus=0.5, trainer_config=SMOKE,
      trainer_args=(f"--config.workdir={d}", *RL_ARGS,
                    "--config.rollout.weight_sync.dtype=float32"),
      log_dir=str(tmp_path / "logs"), startup_timeout_s=240)
  # One CPU device per process, as the in-process reference ran.
  ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
           runtime_env={"env_vars": {"XLA_FLAGS": procs.xla_flags(), "JAX_PLATFORMS": "cpu",
                                     "PYTHONPATH": REPO}})
  fleet = None
  try:
    fleet = cluster.Cluster(cfg)
    assert len(fleet.sandbox_urls) == 2 and len(fleet.rollout_urls) == 1
    victim = fleet.info["sandbox"][0]
    fleet.start_trainers()
    path = os.path.join(d, "stage1", "metrics_rl.jsonl")
    deadline = time.time() + 400
    while time.time() < deadline and not (os.path.exists(path) and _metrics(path)):
      assert fleet.wait_trainers(timeout=0.2) == [None], fleet.trainer_logs()[0]
    # The smoke policy writes few well-formed tool calls, so the test also sends a batch
    # of its own through the fleet's sandbox URLs (the client the trainer uses) and
    # kills the victim while it runs some of them, mid-stage.
    from sandbox.client import SyncSandboxClient
    from sandbox.launcher import health
    calls = [{"code": f"import time\ntime.sleep(0.3)\nprint({i})", "timeout": 30}
             for i in range(24)]
    got = []
    client = SyncSandboxClient(fleet.sandbox_urls, batch_size=2, max_concurrency=8,
                               backoff_s=0.2, rerun_lost=True)
    worker = threading.Thread(target=lambda: got.extend(client.execute(calls)))
    worker.start()
    deadline = time.time() + 60
    while time.time() < deadline and not (health(victim["url"], 1.0) or {}).get("running"):
      time.sleep(0.01)
    os.kill(victim["pid"], signal.SIGKILL)
    worker.join(120)
    client.close()
    assert [(r.status, r.stdout) for r in got] == [("ok", f"{i}\n") for i in range(24)]
    assert {r.server for r in got} <= set(fleet.sandbox_urls)
    codes = fleet.wait_trainers(timeout=400)
    assert codes == [0], fleet.trainer_logs()[0]
    deadline = time.time() + 60
    while time.time() < deadline and not _healthy_again(fleet, victim):
      time.sleep(0.2)
    after = fleet.server_info()["sandbox"][0]
    assert after["restarts"] == 1 and after["url"] == victim["url"]
    assert after["pid"] != victim["pid"]
  finally:
    if fleet is not None:
      fleet.shutdown()
    ray.shutdown()
  rows = _metrics(os.path.join(d, "stage1", "metrics_rl.jsonl"))
  _assert_same_metrics(straight_rl, rows)
  assert all(r["sync/servers"] == 1.0 for r in rows)


def _healthy_again(fleet, victim) -> bool:
  from sandbox.launcher import health
  info = fleet.server_info()["sandbox"][0]
  return info["pid"] != victim["pid"] and (health(victim["url"], 1.0) or {}).get("pid") == info["pid"]


def _assert_same_metrics(a, b):
  """Across topologies (servers, two trainer processes with sharded parameters): the same
  steps up to float rounding of the trainer's reductions, which another sharding orders
  differently. Runs on ONE topology (a resume) must match bit for bit instead: see
  `_assert_identical_runs`.

  rel 1e-5 (~80 float32 ulps): a reduction over the whole model summed in another order
  differs by a few ulps per level of its tree; `train/grad_norm` came out 1.1e-6 apart
  (9 ulps) under another CPU rounding (docs/testing.md), where 1e-6 was one host's
  margin. A step that differed in substance (one sampled token, one trajectory, one
  missed update) moves these metrics by orders of magnitude more."""
  assert [r["step"] for r in b] == [1, 2, 3]
  bad = []
  for ra, rb in zip(a, b):
    for k, v in ra.items():
      if k.startswith("time/"):
        continue   # wall-clock figures differ, everything else must not
      if isinstance(v, float):
        # The sampler-vs-trainer log-prob gap is itself rounding-sized (~1e-6): a few
        # ulps of log-probs of -10..-20, not a relative quantity.
        tol = dict(abs=1e-5) if "logp_diff" in k else dict(rel=1e-5, abs=1e-7)
        if rb[k] != pytest.approx(v, **tol):
          bad.append((ra["step"], k, v, rb[k]))
      elif rb[k] != v:
        bad.append((ra["step"], k, v, rb[k]))
  assert not bad, bad


def _signal_after(workdir, sig, rows: int, delay: float):
  """Starts stage 1, sends `sig` `delay` s after `rows` steps are logged; returns the proc."""
  proc = _run(workdir, *RL_ARGS, wait=False)
  path = os.path.join(workdir, "stage1", "metrics_rl.jsonl")
  deadline = time.time() + 400
  while time.time() < deadline and proc.poll() is None:
    if os.path.exists(path) and len(_metrics(path)) >= rows:
      break
    time.sleep(0.05)
  time.sleep(delay)
  assert proc.poll() is None, "run ended before the signal:\n" + proc.stdout.read()[-3000:]
  proc.send_signal(sig)
  proc.wait(timeout=400)
  return proc


def test_rl_killed_and_resumed_matches_uninterrupted(recipe_dir, straight_run, straight_rl,
                                                     tmp_path):
  # kill -9 once two steps are done: the periodic checkpoint is all that survives.
  d = _copy_sft(recipe_dir[0], tmp_path / "killed")
  _signal_after(d, signal.SIGKILL, rows=2, delay=0.0)
  assert not os.path.exists(os.path.join(d, "stage1", "DONE.json"))
  _run(d, *RL_ARGS)
  _assert_identical_runs(straight_run, d)


def _complete_rows(path) -> int:
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    return f.read().count("\n")


def _signal_mid_run(workdir, sig, fraction: float, step_s: float):
  """Starts stage 1 (3 steps) and sends `sig` `fraction` of a step into step 2, while
  the process is frozen (SIGSTOP) and step 2 is seen unfinished: the signal lands
  before the last step by construction, not by luck. `step_s`: how long step 2 took
  in the uninterrupted run (the delay scales with the host). Returns None, the run
  killed, when step 2 had ended by then (this run's step 2 was faster than the
  reference's, or this process was not scheduled in time): the caller starts again."""
  proc = _run(workdir, *RL_ARGS, wait=False)
  path = os.path.join(workdir, "stage1", "metrics_rl.jsonl")
  while proc.poll() is None and _complete_rows(path) < 1:
    time.sleep(0.005)
  time.sleep(fraction * step_s)
  proc.send_signal(signal.SIGSTOP)
  try:
    assert proc.poll() is None, "run ended before the signal:\n" + proc.stdout.read()[-3000:]
    if _complete_rows(path) != 1:     # step 2 ended: this signal would miss its point
      proc.send_signal(signal.SIGKILL)
      proc.wait()
      return None
    proc.send_signal(sig)
  finally:
    if proc.poll() is None:
      proc.send_signal(signal.SIGCONT)
  proc.wait()
  return proc


def _retried(start, attempts: int = 4):
  """`start(attempt)` until it returns a run whose signal landed where meant; each
  attempt from a fresh copy, the wait shortened. Fails if none did."""
  for attempt in range(attempts):
    proc = start(attempt)
    if proc is not None:
      return proc
  raise AssertionError(f"the signal missed its point in {attempts} attempts")


# Several points of step 2: right after step 1 is logged (step 2's rollouts are
# starting), and a third and two thirds into it (rollouts or the update).
@pytest.mark.parametrize("sig,fraction", [(signal.SIGINT, 0.0), (signal.SIGTERM, 0.33),
                                          (signal.SIGINT, 0.67)])
def test_rl_interrupted_and_resumed_matches_uninterrupted(recipe_dir, straight_run, straight_rl,
                                                          tmp_path, sig, fraction):
  step_s = straight_rl[1]["time/rollout_s"] + straight_rl[1]["time/train_s"]
  dirs = []

  def start(attempt):
    dirs.append(_copy_sft(recipe_dir[0], tmp_path / f"interrupted{attempt}"))
    return _signal_mid_run(dirs[-1], sig, fraction / 2 ** attempt, step_s)
  proc = _retried(start)
  d = dirs[-1]
  out = proc.stdout.read()
  logged = _metrics(os.path.join(d, "stage1", "metrics_rl.jsonl"))
  # The step in flight was finished and saved with ITS data position, then it stopped
  # (the loop may not have begun step 2 yet, e.g. while saving step 1: it stops there).
  assert proc.returncode == 128 + sig, out[-3000:]
  assert len(logged) in (1, 2), out[-3000:]
  assert f"interrupted: stopped by {signal.Signals(sig).name} after step {len(logged)}" in out
  assert not os.path.exists(os.path.join(d, "stage1", "DONE.json"))
  from rstar_jax import checkpoint as ckpt_lib
  ckpt = ckpt_lib.Checkpointer(os.path.join(d, "stage1", "checkpoints"))
  assert ckpt.latest_step() == len(logged)
  ckpt.close()
  _run(d, *RL_ARGS)
  _assert_identical_runs(straight_run, d)


KL_ARGS = ("--config.rl.loss.kl_coef=0.5", "--config.rl.loss.kl_estimator=k3")


@pytest.fixture(scope="module")
def straight_kl(recipe_dir, tmp_path_factory):
  d = _copy_sft(recipe_dir[0], tmp_path_factory.mktemp("straight_kl") / "run")
  _run(d, *RL_ARGS, *KL_ARGS)
  return d


def test_kl_to_the_stage_start_is_zero_at_step_1_and_positive_after(straight_kl, straight_rl):
  """kl_coef > 0 through the recipe: the reference is the stage's starting policy (the
  SFT export), so the KL is 0 before the first update and positive after it. Whether it
  grows from one step to the next is not a property of a correct implementation (a
  noisy step can move the policy back toward its start, and does on some CPU kinds'
  rounding); its value is checked against an independent computation in
  tests/rl/test_every_option.py."""
  rows = _metrics(os.path.join(straight_kl, "stage1", "metrics_rl.jsonl"))
  kl = [r["train/kl_loss"] for r in rows]
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert abs(kl[0]) < 1e-6 and kl[1] > 1e-6 and kl[2] > 1e-6, kl
  assert all(r["time/ref_logp_s"] >= 0 for r in rows)
  # The first step's rollouts and policy-gradient loss are the KL-free run's (the
  # same policy sampled them); the KL term then changes the update.
  assert rows[0]["rollout/reward_mean"] == straight_rl[0]["rollout/reward_mean"]
  assert rows[0]["train/pg_loss"] == pytest.approx(straight_rl[0]["train/pg_loss"], rel=1e-6)
  assert "train/kl_loss" not in straight_rl[0]


@pytest.mark.slow
def test_kl_run_killed_and_resumed_matches_uninterrupted(recipe_dir, straight_kl, tmp_path):
  """The resumed stage derives its reference again from the export it started from: the
  same reference, so the same steps, bit for bit."""
  d = _copy_sft(recipe_dir[0], tmp_path / "killed_kl")
  proc = _run(d, *RL_ARGS, *KL_ARGS, wait=False)
  path = os.path.join(d, "stage1", "metrics_rl.jsonl")
  deadline = time.time() + 400
  while time.time() < deadline and proc.poll() is None and not (
      os.path.exists(path) and len(_metrics(path)) >= 2):
    time.sleep(0.05)
  assert proc.poll() is None, proc.stdout.read()[-3000:]
  proc.kill()
  proc.wait(timeout=60)
  _run(d, *RL_ARGS, *KL_ARGS)
  _assert_identical_runs(straight_kl, d)


def test_a_stage_without_learning_signal_says_so(tmp_path):
  """A random policy solves nothing: reward 0 in every group, zero advantage at every
  step. The stage warns once and records it in DONE.json."""
  out = _run(tmp_path, "--config.stage1.num_steps=2", "--stages=stage1",
             "--config.allow_random_init=True", "--config.rl.prompts_per_step=2",
             "--config.rl.samples_per_prompt=4", "--config.rl.downsample.group_size=2",
             "--config.stage1.agent.max_response_tokens=16")
  assert out.count("NO LEARNING SIGNAL") == 1, out[-3000:]
  done = json.load(open(tmp_path / "stage1" / "DONE.json"))
  assert done["no_learning_signal"] is True
  rows = _metrics(tmp_path / "stage1" / "metrics_rl.jsonl")
  assert [r["update/zero_advantage"] for r in rows] == [1.0, 1.0]
  assert all(r["train/grad_norm"] == 0.0 for r in rows)


def test_the_smoke_run_has_a_learning_signal(recipe_dir):
  done = json.load(open(os.path.join(recipe_dir[0], "stage1", "DONE.json")))
  assert done["no_learning_signal"] is False
  assert "NO LEARNING SIGNAL" not in recipe_dir[1]


def test_the_smoke_run_exercises_the_sandbox(recipe_dir):
  """The first run a reader makes shows tool calls that run: in every RL step most
  trajectories call the tool and most calls run (measured: 0.73-0.78 calls a trajectory,
  20-32% errors; before, every call was cut off or malformed: error rate 1.0). The
  reward is not asserted: the smoke's short SFT does not teach copying the operands into the
  code, so it stays at chance (experiments/configs/toy.py, the smoke variant)."""
  rows = _metrics(os.path.join(recipe_dir[0], "stage1", "metrics_rl.jsonl"))
  for r in rows:
    assert r["rollout/tool_calls_per_traj"] > 0.25, r
    assert r["rollout/tool_error_rate"] < 0.6, r


def test_the_hard_subset_is_reused_only_when_made_with_the_same_settings(tmp_path, monkeypatch):
  """The stage-3 filter's cache was reused whatever made it (another hard_k, pool,
  seed or model), shared by every stage, and written in place (a torn file failed
  every later run)."""
  import types
  from rstar_jax.recipe import recipe_config, stages
  from rstar_jax.data.math_problems import MathProblem
  from rstar_jax.rollout.agent_loop import AgentConfig
  problems = [MathProblem(f"p{i}", "q", "1", "t") for i in range(6)]
  ctx = types.SimpleNamespace(
      workdir=str(tmp_path), train_problems=problems, engines_for=lambda *a, **k: None,
      config=types.SimpleNamespace(seed=0, model=types.SimpleNamespace(hf_dir="")))
  calls = []

  def fake_unsolved(ctx, engines, stage_cfg, cache, made_with):
    calls.append(stage_cfg.hard_k)
    uids = [p.uid for p in problems[:stage_cfg.hard_k]]
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    with open(cache, "w") as f:
      json.dump({"uids": uids, "made_with": made_with}, f)
    return uids
  monkeypatch.setattr(stages, "_unsolved", fake_unsolved)
  stage = lambda k: recipe_config.RLStage(num_steps=1, hard_only=True, hard_k=k,
                                          agent=AgentConfig())
  assert len(stages.hard_subset(ctx, None, "stage3", stage(2))) == 2
  assert len(stages.hard_subset(ctx, None, "stage3", stage(2))) == 2 and calls == [2]  # reused
  assert len(stages.hard_subset(ctx, None, "stage3", stage(3))) == 3 and calls == [2, 3]
  assert len(stages.hard_subset(ctx, None, "stage2", stage(3))) == 3 and calls == [2, 3, 3]
  assert os.path.exists(tmp_path / "stage2" / "hard_subset.json")   # a file per stage
  (tmp_path / "stage3" / "hard_subset.json").write_text('{"uids": ["p0"')   # torn
  assert len(stages.hard_subset(ctx, None, "stage3", stage(3))) == 3 and calls == [2, 3, 3, 3]
  os.makedirs(tmp_path / "stage2", exist_ok=True)
  (tmp_path / "stage2" / "DONE.json").write_text('{"steps": 4}')   # another model now
  stages.hard_subset(ctx, None, "stage3", stage(3))
  assert calls == [2, 3, 3, 3, 3]


# Stage 3 on its hard subset (the filter: 16 problems x 2 = 32 rollouts), one RL step,
# then the final evaluation (4 problems x 8 = 32 trajectories), from the shared SFT.
HARD_EVAL_ARGS = ("--stages=stage3,eval", "--config.stage3.num_steps=1",
                  "--config.stage3.hard_only=True", "--config.stage3.hard_k=2",
                  "--config.stage3.hard_pool=16", "--config.stage3.agent.max_response_tokens=48",
                  "--config.rl.prompts_per_step=2", "--config.eval.k=16",
                  "--config.rollout.engine.num_slots=4")


def _signal_once_journaled(workdir, journal, sig, total, lines=2):
  """Runs the stage-3-and-eval recipe; sends `sig` once `journal` holds `lines` lines
  (its header and finished trajectories). Returns (return code, output, journaled
  trajectories after the stop).

  The signal must land while work remains, whatever the trajectories look like: a
  policy that writes short, broken answers (as the smoke run's does under another CPU
  rounding) evaluated 32 trajectories in 0.1 s, before a 50 ms poll saw the third line.
  So the first finished trajectory triggers it, polled every 5 ms, and there are 64.
  `total`: the trajectories of the whole work. Returns None (the run killed) when the
  work was over before the signal could land: the caller starts again from a copy."""
  proc = _run(workdir, *HARD_EVAL_ARGS, wait=False)
  while proc.poll() is None:
    if os.path.exists(journal) and len(open(journal).read().splitlines()) >= lines:
      # Frozen while it is checked that work remains (the journal short of its whole
      # count and the stage's result unwritten), then signalled.
      proc.send_signal(signal.SIGSTOP)
      done = (len(open(journal).read().splitlines()) - 1 >= total
              or os.path.exists(journal.replace(".journal.jsonl", ".json")))
      if done:   # the work ended before this poll ran (a loaded host): start again
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return None
      proc.send_signal(sig)
      proc.send_signal(signal.SIGCONT)
      break
    time.sleep(0.005)
  out = proc.communicate(timeout=500)[0]
  kept = len(_metrics(journal)) - 1 if os.path.exists(journal) else None
  return proc.returncode, out, kept


def test_a_signal_stops_the_filter_and_the_evaluation_and_reruns_resume_to_the_same_result(
    recipe_dir, tmp_path):
  """SIGTERM in the stage-3 filter, SIGINT in the final evaluation: each run stops at a
  finished trajectory (the journal holds part of the work, nothing is reported), and the
  reruns resume from the journals to what an uninterrupted run gives, file for file."""
  whole = _copy_sft(recipe_dir[0], tmp_path / "whole")
  _run(whole, *HARD_EVAL_ARGS)
  dirs = []

  def start(attempt):
    dirs.append(_copy_sft(recipe_dir[0], tmp_path / f"cut{attempt}"))
    hard = os.path.join(dirs[-1], "stage3", "hard_subset.json")
    return _signal_once_journaled(dirs[-1], hard[:-len(".json")] + ".journal.jsonl",
                                  signal.SIGTERM, total=32)
  code, out, kept = _retried(start)
  d = dirs[-1]
  hard = os.path.join(d, "stage3", "hard_subset.json")
  assert code == 128 + signal.SIGTERM, out[-3000:]
  assert "stopped by SIGTERM after" in out and "trajectories of stage3 filter" in out, out[-3000:]
  assert "run the same command again to resume" in out
  assert 0 < kept < 32 and not os.path.exists(hard)
  assert not os.path.exists(os.path.join(d, "stage3", "checkpoints"))   # stopped before RL
  journal = os.path.join(d, "eval_final.journal.jsonl")
  result = _signal_once_journaled(d, journal, signal.SIGINT, total=64)
  assert result is not None, "the final evaluation was over before its signal"
  code, out, kept_eval = result
  assert code == 128 + signal.SIGINT, out[-3000:]
  assert f"{kept} of 32 trajectories from" in out   # the filter resumed from its journal
  assert "trajectories of final" in out and os.path.exists(os.path.join(d, "stage3", "DONE.json"))
  assert 0 < kept_eval < 64 and not os.path.exists(os.path.join(d, "eval_final.json"))
  out = _run(d, *HARD_EVAL_ARGS)
  assert f"{kept_eval} of 64 trajectories from" in out and "stage3: already done" in out
  assert not os.path.exists(journal)
  assert json.load(open(hard)) == json.load(open(os.path.join(whole, "stage3", "hard_subset.json")))
  assert json.load(open(hard))["uids"]   # a subset to train on: the step below ran on it
  a = _metrics(os.path.join(whole, "stage3", "metrics_rl.jsonl"))
  b = _metrics(os.path.join(d, "stage3", "metrics_rl.jsonl"))
  strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]
  assert strip(a) == strip(b) and len(a) == 1
  assert (json.load(open(os.path.join(whole, "eval_final.json")))
          == json.load(open(os.path.join(d, "eval_final.json"))))
  assert (_metrics(os.path.join(whole, "eval_final_samples.jsonl"))
          == _metrics(os.path.join(d, "eval_final_samples.jsonl")))


def test_the_final_evaluation_can_use_the_report_s_protocol_and_says_so(recipe_dir, tmp_path):
  """config.eval.protocol='report': the report's section 5.1 settings replace k and the
  agent's, the run prints the protocol it used, the report JSON carries them, and an
  engine shorter than the protocol's budget is named (its trajectories would end as
  truncated)."""
  d = _copy_sft(recipe_dir[0], tmp_path / "report_protocol")
  out = _run(d, "--stages=eval", "--config.eval.protocol=report")
  assert ("evaluation final: protocol 'report' (16 samples per problem, temperature 0.6, "
          "30720 tokens, 30 turns)") in out, out[-3000:]
  assert "fewer than the protocol's 30720 response tokens" in out, out[-3000:]
  report = json.load(open(os.path.join(d, "eval_final.json")))
  assert report["temperature"] == 0.6 and report["samples_per_problem"] == 16
  from rstar_jax.recipe import recipe_config
  with pytest.raises(ValueError, match="EvalStage.protocol='paper'"):
    recipe_config.EvalStage(protocol="paper")


def test_unknown_stages_and_missing_data_files_are_refused_before_anything_is_written(tmp_path):
  from experiments.configs import toy
  from rstar_jax import config_utils
  from rstar_jax.recipe import stages
  c = toy.get_config("smoke")
  c.workdir = str(tmp_path / "run")
  with pytest.raises(config_utils.ConfigError, match=r"stages: unknown \['bogus'\]"):
    stages.run(c, stages=["bogus"])
  c.data.kind, c.data.eval_files = "files", (str(tmp_path / "nope.jsonl"),)
  with pytest.raises(config_utils.ConfigError, match=r"config.data.eval_files: no such file"):
    stages.run(c)
  assert not os.path.exists(tmp_path / "run")   # no workdir, no config.json
  c = toy.get_config("smoke")
  c.workdir = str(tmp_path / "afile")
  (tmp_path / "afile").write_text("")
  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(config_utils.ConfigError, match="cannot use it as the run's directory"):
    stages.evaluate_hf_dir(c, str(tmp_path))   # was a bare FileExistsError


def test_config_files_without_variants_or_get_config_are_config_errors(tmp_path):
  from rstar_jax import config_utils
  plain = tmp_path / "plain.py"
  plain.write_text("import ml_collections\ndef get_config():\n  return ml_collections.ConfigDict()\n")
  with pytest.raises(config_utils.ConfigError, match="has no variants.*drop ':smoke'"):
    config_utils._load_config_file(f"{plain}:smoke")
  assert config_utils._load_config_file(str(plain)).to_dict() == {}
  (tmp_path / "empty.py").write_text("x = 1\n")
  with pytest.raises(config_utils.ConfigError, match="defines no get_config"):
    config_utils._load_config_file(str(tmp_path / "empty.py"))
  (tmp_path / "broken.py").write_text("import not_a_module_here\n")
  with pytest.raises(config_utils.ConfigError, match="cannot import it"):
    config_utils._load_config_file(str(tmp_path / "broken.py"))


def test_one_run_per_workdir_summaries_on_resume_and_no_silent_fresh_optimizer(recipe_dir,
                                                                                tmp_path):
  """Resume edges, on a copy of the smoke run: (1) a second run on a workdir in use is
  refused (two ran side by side, mixing metrics rows and checkpoints); a finished
  evaluation is not run again (hours at 14B); (2) a stage
  resumed at its last step writes DONE.json with its final rollout stats (they were
  empty: no step ran here); (3) a stage whose predecessor trained but left no checkpoint
  is refused instead of starting with a fresh Adam without a word."""
  from rstar_jax.recipe import workdir_state
  d = str(tmp_path / "copy")
  shutil.copytree(recipe_dir[0], d, ignore=shutil.ignore_patterns("compile_cache"))
  _share_compile_cache(recipe_dir[0], d)
  with workdir_state.workdir_lock(d):
    out = _run(d, "--config.stage1.num_steps=2", "--stages=stage1", check=False)
  assert out.returncode == 2 and f"{d} is in use by pid {os.getpid()}" in out.stderr, out.stderr

  # The final evaluation, done with this model and these settings: not run again.
  report = open(os.path.join(d, "eval_final.json")).read()
  log = _run(d, "--config.stage1.num_steps=2", "--stages=eval")
  assert "eval final: already evaluated with this model and these settings" in log, log[-3000:]
  assert open(os.path.join(d, "eval_final.json")).read() == report
  assert not os.path.exists(os.path.join(d, "eval_final_1.json"))

  done = os.path.join(d, "stage1", "DONE.json")
  before = json.load(open(done))
  os.remove(done)
  _run(d, "--config.stage1.num_steps=2", "--stages=stage1")
  after = json.load(open(done))
  assert after == before and any(k.startswith("rollout/") for k in after), after

  shutil.rmtree(os.path.join(d, "stage1", "checkpoints"))
  out = _run(d, "--config.stage1.num_steps=2", "--config.stage2.num_steps=1",
             "--config.allow_config_change=True", "--stages=stage2", check=False)
  assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
  assert "holds no checkpoint to carry its optimizer state" in out.stderr
  assert "--config.stage2.reset_optimizer=True" in out.stderr
  assert not os.path.exists(os.path.join(d, "stage1", "checkpoints"))   # not made empty


def test_every_key_the_smoke_run_writes_is_in_the_metric_table(recipe_dir):
  """The smoke recipe's metrics files and its evaluation report against
  rstar_jax/metric_table.py: a key with no entry fails by its name, and so does an entry
  that names this run but none of its files holds (docs/reference/metrics.md is made from
  the table)."""
  from rstar_jax import metric_table
  workdir = recipe_dir[0]
  keys = {
      "sft": metric_table.row_keys(_metrics(os.path.join(workdir, "sft", "metrics_sft.jsonl"))),
      "rl": metric_table.row_keys(_metrics(os.path.join(workdir, "stage1", "metrics_rl.jsonl"))),
      "eval": metric_table.flat_keys(json.load(open(os.path.join(workdir, "eval_final.json")))),
  }
  assert all(keys.values()), keys
  assert metric_table.problems(keys, "recipe") == []


def test_every_key_the_kl_run_writes_is_in_the_metric_table(straight_kl):
  from rstar_jax import metric_table
  rows = _metrics(os.path.join(straight_kl, "stage1", "metrics_rl.jsonl"))
  assert metric_table.problems({"rl": metric_table.row_keys(rows)}, "kl") == []
