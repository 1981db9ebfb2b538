"""Bounded-staleness asynchronous rollouts (rl.async_rollouts.max_staleness = k).

Runs a tiny RL stage of the smoke config with batch-invariant rollouts (bits that do
not depend on timing) and a reward that is a fixed function of the sampled text (so the
steps carry gradients), under k = 1:
  - step t trains on rollouts of the policy after max(t - 1, 0) updates, exactly: the
    trajectories record that version, and their sampler log-probs are that policy's
    (recomputed from the parameters captured after each step), not the current one's;
  - no batch holds a trajectory older than the bound;
  - a stage stopped by SIGTERM and resumed takes its pending rollouts back and ends with
    the uninterrupted run's metrics and parameters, bit for bit; without the pending
    file it regenerates them with the resumed parameters (the documented fallback).
Plus the pure parts: the schedule, the staleness filter, the config's refusals.
"""
import dataclasses
import os
import signal

import jax
import numpy as np
import pytest

from experiments.configs import toy
from rstar_jax.recipe import recipe_config, stages
from rstar_jax.rl import async_rollouts as async_lib
from rstar_jax.rl import batching, rollout_collector
from rstar_jax.rl import train_step as ts
from rstar_jax.rl import trainer as rl_trainer
from rstar_jax.rollout import agent_loop, backends
from rstar_jax.train import interrupt

STEPS = 3


class Tools:
  async def execute(self, calls):
    return [{"status": "ok", "stdout": "1\n", "stderr": ""} for _ in calls]


def _parity_reward(text, answer, truncated=False):
  return float(len(text) % 2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("async_rl")
  c = toy.get_config("smoke")
  c.rollout.engine.batch_invariant = True
  c.rollout.engine.update(num_slots=8, max_len=320)
  c.rl.update(prompts_per_step=4, samples_per_prompt=4)
  c.rl.downsample.update(group_size=2)
  c.stage1.agent.max_response_tokens = 32
  cfg = recipe_config.build_config(c)
  tools = Tools()
  ctx = stages.build_context(cfg, tools, workdir=str(root))
  model = stages.initial_model(cfg, ctx.tokenizer, ctx.mesh, ctx.rules)
  pool = backends.build_engine_pool(cfg.rollout, model, workdir=str(root))
  yield cfg, ctx, pool, root
  pool.stop()


@pytest.fixture(autouse=True)
def parity_reward(monkeypatch):
  monkeypatch.setattr(rollout_collector.rewards, "compute_reward", _parity_reward)


def _trainer(setup, name, k, **loss):
  cfg, ctx, pool, root = setup
  rl = dataclasses.replace(
      cfg.rl, async_rollouts=async_lib.AsyncRolloutsConfig(max_staleness=k),
      loss=dataclasses.replace(cfg.rl.loss, **loss))
  model = stages.initial_model(cfg, ctx.tokenizer, ctx.mesh, ctx.rules)
  return rl_trainer.RLTrainer(rl, cfg.stage1.agent, model, ctx.tokenizer, ctx.proto,
                              ctx.train_problems, engines=pool, tools=ctx.tools,
                              workdir=str(root / name), seed=0, mesh=ctx.mesh,
                              rules=ctx.rules)


def _params(t):
  return [np.asarray(x) for x in jax.tree.leaves(t.params())]


def _same_bits(a_hist, b_hist, a_params, b_params):
  assert len(a_hist) == len(b_hist)
  for ma, mb in zip(a_hist, b_hist):
    ma, mb = ({k: v for k, v in m.items() if not k.startswith("time/")} for m in (ma, mb))
    assert ma.keys() == mb.keys()
    for k in ma:
      assert np.float64(ma[k]).tobytes() == np.float64(mb[k]).tobytes(), (k, ma[k], mb[k])
  assert all(x.tobytes() == y.tobytes() for x, y in zip(a_params, b_params))


@pytest.fixture(scope="module")
def uninterrupted(setup):
  """k = 1, STEPS steps: (history, final params, params after each step, each step's
  trajectories, trainer's version names by step)."""
  mp = pytest.MonkeyPatch()
  mp.setattr(rollout_collector.rewards, "compute_reward", _parity_reward)
  t = _trainer(setup, "k1", 1)
  after = {0: jax.tree.map(np.asarray, t.params())}
  trajs = {}

  def on_step(step, m):
    after[step] = jax.tree.map(np.asarray, t.params())
    trajs[step - 1] = list(t.last_trajectories)
  try:
    history = t.run(STEPS, progress=False, on_step=on_step)
    names = {s: t.weight_version(s) for s in range(STEPS + 1)}
  finally:
    t.close()
    mp.undo()
  return history, _params(t), after, trajs, names, t


def test_the_pipeline_at_k0_gives_the_synchronous_loop_bit_for_bit(setup):
  """k = 0 runs the synchronous loop (the trainer never builds a pipeline; that it equals
  the loop before this change, metrics and parameters, was checked against main). Here
  the asynchronous machinery itself is run at k = 0 (v(s) = s: generation in the worker
  thread, batches drawn at submission, the engines moved by the worker): the same bits
  as the synchronous loop, so the pipeline changes nothing but the schedule."""
  sync = _trainer(setup, "k0_sync", 0)
  try:
    s_hist = sync.run(STEPS, progress=False)
    assert sync._pipeline is None
  finally:
    sync.close()
  piped = _trainer(setup, "k0_piped", 0)
  piped.run_step = piped._run_step_async
  try:
    p_hist = piped.run(STEPS, progress=False)
  finally:
    piped.close()
  assert all(not k.startswith("async/") for m in s_hist for k in m)
  assert [m["async/staleness_max"] for m in p_hist] == [0.0] * STEPS
  p_hist = [{k: v for k, v in m.items() if not k.startswith("async/")} for m in p_hist]
  _same_bits(s_hist, p_hist, _params(sync), _params(piped))


def test_each_step_trains_on_the_scheduled_version_within_the_bound(uninterrupted):
  history, _, _, trajs, names, _ = uninterrupted
  assert any(m["train/grad_norm"] > 0 for m in history), "no gradient: nothing was tested"
  for step, m in enumerate(history):
    v = async_lib.behaviour_version(step, 1, 0)
    assert v == max(step - 1, 0)
    assert m["async/behaviour_version"] == v
    assert m["async/staleness_max"] <= 1 and m["async/staleness_mean"] == step - v
    assert m["async/stale_dropped_groups"] == 0
    assert {tuple(tr.weight_versions) for tr in trajs[step]} == {(names[v],)}


def test_recorded_versions_are_the_weights_that_sampled(setup, uninterrupted):
  """Step 2's trajectories say version 1: their sampler log-probs are the log-probs of
  the parameters after step 1 (up to float rounding between engine and trainer), and
  measurably not those of the parameters after step 2 (the ones step 2 updates)."""
  cfg, _, _, _ = setup
  _, _, after, trajs, names, t = uninterrupted
  assert {tuple(tr.weight_versions) for tr in trajs[2]} == {(names[1],)}
  arrays = batching.build_batch([rollout_collector.token_trajectory(tr) for tr in trajs[2]],
                                np.zeros(len(trajs[2]), np.float32), length_multiple=64)
  fn = ts.make_logprob_fn(t.graphdef, dataclasses.replace(cfg.rl.step, micro_batches=1),
                          temperature=cfg.stage1.agent.temperature)
  mask = arrays["loss_mask"] > 0

  def gap(params):
    lp = np.asarray(fn(params, arrays["input_ids"], arrays["target_ids"],
                       arrays["attention_mask"]))
    return float(np.max(np.abs(lp - arrays["old_logp"])[mask]))
  own, newer, older = gap(after[1]), gap(after[2]), gap(after[0])
  assert own < 1e-4, own
  assert newer > 10 * own and older > 10 * own, (own, newer, older)


def test_a_sigterm_and_resume_take_the_pending_rollouts_back_bit_for_bit(setup, uninterrupted):
  a_hist, a_params, *_ = uninterrupted
  t = _trainer(setup, "k1_stop", 1)

  def stop_after_step_1(step, m):
    if step == 1:
      os.kill(os.getpid(), signal.SIGTERM)
  with pytest.raises(interrupt.Interrupted, match="after step 1"):
    t.run(STEPS, progress=False, on_step=stop_after_step_1)
  t.close()
  # Step 1's rollouts (version 0) were pending at the stop: saved with the checkpoint.
  pending, _ = async_lib.load_pending(str(setup[3] / "k1_stop" / "async_pending"), 1, 1)
  assert [(p.step, p.version_step) for p in pending] == [(1, 0)]
  again = _trainer(setup, "k1_stop", 1)
  assert again.maybe_restore() and again.step == 1
  assert sorted(again._pipeline.pending) == [1]
  try:
    history = again.run(STEPS, progress=False)
  finally:
    again.close()
  _same_bits(a_hist[1:], history, a_params, _params(again))


def test_without_the_pending_file_the_resume_regenerates_with_its_own_weights(setup):
  t = _trainer(setup, "k1_lost", 1)
  t.run(1, progress=False)     # a run cut at the stage's end submits nothing past it
  t.close()
  pend = str(setup[3] / "k1_lost" / "async_pending")
  assert not os.path.exists(async_lib.pending_path(pend, 1)) or not async_lib.load_pending(
      pend, 1, 1)[0]
  again = _trainer(setup, "k1_lost", 1)
  assert again.maybe_restore() and again.step == 1
  try:
    history = again.run(STEPS, progress=False)
  finally:
    again.close()
  # t0 = 1: steps 1 and 2 are generated with version 1 (the rule), step 2 one version old.
  assert [m["async/behaviour_version"] for m in history] == [1.0, 1.0]
  assert [m["async/staleness_max"] for m in history] == [0.0, 1.0]


def test_the_decoupled_objective_runs_under_k1_and_logs_its_weights(setup):
  t = _trainer(setup, "k1_decoupled", 1, off_policy="decoupled")
  try:
    history = t.run(2, progress=False)
  finally:
    t.close()
  m = history[1]      # step 1: generated by version 0, trained from version 1
  assert m["async/staleness_max"] == 1
  for k in ("train/behav_weight_mean", "train/behav_weight_max",
            "train/behav_log_weight_abs", "train/behav_capped_frac"):
    assert np.isfinite(m[k]), k
  assert m["train/behav_log_weight_abs"] > 0     # the proximal policy moved off the sampler
  assert history[0]["train/behav_log_weight_abs"] < 1e-4   # step 0: it is the sampler's


def test_in_flight_updates_keep_the_bound_and_never_split_a_generation_call(setup):
  """weight_updates='between_requests' on the tiny stage under k = 1: every turn names
  one version (none spans an update: no "a -> b"), each turn's version is recorded next
  to its token span, and every trajectory is within the bound of its step. Which turns
  get the newer version depends on timing here: the deterministic check of the hand-over
  is the next test."""
  cfg, ctx, pool, root = setup
  rl = dataclasses.replace(cfg.rl, async_rollouts=async_lib.AsyncRolloutsConfig(
      max_staleness=1, weight_updates="between_requests"))
  model = stages.initial_model(cfg, ctx.tokenizer, ctx.mesh, ctx.rules)
  t = rl_trainer.RLTrainer(rl, cfg.stage1.agent, model, ctx.tokenizer, ctx.proto,
                           ctx.train_problems, engines=pool, tools=ctx.tools,
                           workdir=str(root / "k1_in_flight"), seed=0, mesh=ctx.mesh,
                           rules=ctx.rules)
  seen = {}
  try:
    history = t.run(STEPS, progress=False,
                    on_step=lambda step, m: seen.setdefault(step - 1, list(t.last_trajectories)))
    names = {t.weight_version(s): s for s in range(STEPS + 1)}
  finally:
    t.close()
  for step, m in enumerate(history):
    assert m["async/stale_dropped_groups"] == 0 and m["async/staleness_max"] <= 1
    assert m["async/multi_version_share"] == np.mean(
        [len(tr.weight_versions) > 1 for tr in seen[step]])
    for tr in seen[step]:
      assert len(tr.turn_versions) == len(tr.turns) >= 1
      assert all(v in names for v in tr.turn_versions), tr.turn_versions   # no "a -> b"
      assert tr.weight_versions == list(dict.fromkeys(tr.turn_versions))
      ages = [step - names[v] for v in tr.turn_versions]
      assert all(0 <= a <= 1 for a in ages) and ages == sorted(ages, reverse=True)


class _HeldEngine:
  """One engine whose calls wait until the test releases them; records the version at
  the start and at the end of each call."""
  name, max_len = "held", 1 << 12

  def __init__(self):
    import threading
    self.version, self.calls, self.release = "v0", [], {}
    self._lock = threading.Lock()

  async def generate(self, request):
    import asyncio
    import threading
    from rstar_jax.rollout.engine import GenerationResult
    with self._lock:
      gate = self.release.setdefault(request.request_id, threading.Event())
    start = self.version
    while not gate.is_set():
      await asyncio.sleep(0.005)
    self.calls.append((request.request_id, start, self.version))
    return GenerationResult(request.request_id, [5], [-0.1], "stop", len(request.input_ids), 0,
                            0.0, weight_version=start)

  def update_weights(self, params, version=None):
    self.version = version

  def free_kv_tokens(self):
    return 1 << 20

  def num_active(self):
    return 0


def test_an_in_flight_update_waits_for_the_call_in_flight_and_reaches_the_next_turn():
  """The hand-over, deterministic: a two-turn collection of step 1 (submitted with v0)
  is inside its first call when the trainer publishes v1. The update waits for that call
  to end (the engine still holds v0 meanwhile), then moves the engine, and the second
  turn, issued after, runs on v1: turn versions [v0, v1], no call saw the version change
  inside it."""
  import asyncio
  import threading
  import time
  from rstar_jax.rollout.engine import GenerationRequest
  from rstar_jax.rollout.scheduler import EnginePool
  engine = _HeldEngine()
  pool = EnginePool([engine], policy="kv_capacity")
  second_turn = threading.Event()

  def collect(batch, step):
    async def two_turns():
      first = await pool.generate(GenerationRequest(input_ids=[1], max_new_tokens=1,
                                                    request_id="turn0"))
      while not second_turn.is_set():
        await asyncio.sleep(0.005)
      second = await pool.generate(GenerationRequest(input_ids=[1, 5], max_new_tokens=1,
                                                     request_id="turn1"))
      return [first.weight_version, second.weight_version]
    return asyncio.run(two_turns())

  pipe = async_lib.RolloutPipeline(pool, collect, in_flight=True)
  try:
    pipe.submit(1, None, "params0", "v0", 0, {}, {})
    while "turn0" not in engine.release:          # the first turn is in flight
      time.sleep(0.005)
    pipe.publish("params1", "v1", 1)
    time.sleep(0.3)
    assert engine.version == "v0" and not pipe.published[-1].done()   # held for the call
    engine.release["turn0"].set()
    pipe.published[-1].result()
    assert engine.version == "v1"
    engine.release["turn1"] = threading.Event()
    engine.release["turn1"].set()
    second_turn.set()
    _, versions, _, _ = pipe.take(1)
    assert versions == ["v0", "v1"]
    assert engine.calls == [("turn0", "v0", "v0"), ("turn1", "v1", "v1")]
    # Never back to an older version: step 2's submission with v0 keeps v1.
    pipe.publish("params0", "v0", 0)
    pipe.published[-1].result()
    assert engine.version == "v1"
  finally:
    pipe.close()


# ---- the pure parts ------------------------------------------------------------------

def _traj(versions):
  return agent_loop.Trajectory(uid="p#0", prompt_ids=[1], weight_versions=list(versions))


def test_the_staleness_filter_drops_whole_groups_beyond_the_bound_or_unknown():
  steps = {"v3": 3, "v4": 4, "v5": 5}
  groups = [[_traj(["v4"]), _traj(["v5"])],          # ages 1, 0: kept
            [_traj(["v3"]), _traj(["v5"])],          # age 2 > 1: dropped whole
            [_traj(["v4", "v5"])],                   # oldest counts: age 1, kept
            [_traj(["elsewhere"])],                  # unknown version: dropped
            [_traj([])]]                             # none reported: the scheduled one
  kept, ages, dropped = async_lib.staleness_filter(groups, 5, 1, steps, scheduled=4)
  assert dropped == 2 and len(kept) == 3 and ages == [1, 0, 1, 1]


def test_the_schedule_is_a_function_of_the_step_bound_and_start():
  assert [async_lib.behaviour_version(s, 2, 0) for s in range(5)] == [0, 0, 0, 1, 2]
  assert [async_lib.behaviour_version(s, 2, 3) for s in range(3, 7)] == [3, 3, 3, 4]
  assert [async_lib.behaviour_version(s, 0, 0) for s in range(3)] == [0, 1, 2]


def test_the_config_refuses_what_would_not_correct_staleness():
  with pytest.raises(ValueError, match="max_staleness"):
    async_lib.AsyncRolloutsConfig(max_staleness=-1)
  with pytest.raises(ValueError, match="between_requests"):
    async_lib.AsyncRolloutsConfig(max_staleness=1, weight_updates="mid_call")
  base = rl_trainer.RLConfig()
  with pytest.raises(ValueError, match="recompute"):
    dataclasses.replace(base, old_logprobs="recompute",
                        async_rollouts=async_lib.AsyncRolloutsConfig(max_staleness=1))
  with pytest.raises(ValueError, match="sampler"):
    dataclasses.replace(base, old_logprobs="recompute",
                        loss=dataclasses.replace(base.loss, off_policy="decoupled"))


def test_schedule_times_overlaps_the_slower_side_with_the_faster():
  """Worked by hand: generation 10 s, update 4 s a step, 5 steps. k = 0: 5 x 14 = 70 s.
  k = 1: the worker runs steps 0 and 1 on version 0 back to back (0-20 s), step 2 needs
  version 1 (update 0 ends at 14 s) and starts when the worker is free at 20 s: the
  worker is never idle after the start, so 5 x 10 s + the last update 4 s = 54 s."""
  assert async_lib.schedule_times([10] * 5, [4] * 5, 0)["total_s"] == 70.0
  assert async_lib.schedule_times([10] * 5, [4] * 5, 1)["total_s"] == 54.0
  # Update-bound: the same by symmetry (generation 4 s first, then 5 updates of 10 s).
  assert async_lib.schedule_times([4] * 5, [10] * 5, 1)["total_s"] == 54.0
  # A bound of 2 absorbs one slow generation that a bound of 1 waits for.
  gen, train = [5, 5, 5, 12, 5, 5], [6] * 6
  assert (async_lib.schedule_times(gen, train, 2)["total_s"]
          < async_lib.schedule_times(gen, train, 1)["total_s"])


def test_every_key_the_async_runs_write_is_in_the_metric_table(setup, uninterrupted):
  """The k = 1 runs' metrics files against rstar_jax/metric_table.py: a key with no entry
  fails by its name, and so does an entry naming these runs that their files do not hold.
  The decoupled run is the one the decoupled test above made (made here when that test
  was not selected)."""
  import json
  from rstar_jax import metric_table
  root = setup[3]

  def keys(name):
    with open(os.path.join(root, name, "metrics_rl.jsonl")) as f:
      return metric_table.row_keys(json.loads(line) for line in f if line.strip())
  assert metric_table.problems({"rl": keys("k1")}, "async") == []
  if not os.path.exists(os.path.join(root, "k1_decoupled", "metrics_rl.jsonl")):
    t = _trainer(setup, "k1_decoupled", 1, off_policy="decoupled")
    try:
      t.run(2, progress=False)
    finally:
      t.close()
  assert metric_table.problems({"rl": keys("k1_decoupled")}, "decoupled") == []
