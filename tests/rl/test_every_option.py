"""Every documented value of every enumerated config field runs.

A value that passes config validation must also run: `rl.loss.kl_coef=0.5` validated,
then died at RL step 1 for want of a reference policy. Each case below builds the RL
(or SFT) trainer of the smoke config with ONE field changed and runs one step on the
smoke model (random init, real JaxEngine pool, tools that answer "1").

The values come from the registries and tuples the configs validate against, so a value
added there is covered here without touching this file; `test_the_cases_cover_every_
registered_value` fails if a field's documented values and this file's list part ways.
"""
import dataclasses
import math

import numpy as np
import pytest

from rstar_jax import optim
from rstar_jax.recipe import stages
from rstar_jax.model import model_config
from rstar_jax.model import hf_io
from rstar_jax.rl import advantages as adv_lib
from rstar_jax.rl import async_rollouts as async_lib
from rstar_jax.rl import losses, roc
from rstar_jax.rl import trainer as rl_trainer
from rstar_jax.sft import trainer as sft_trainer


def _replace(obj, path: str, value):
  """dataclasses.replace along a dotted path ("loss.kl_estimator")."""
  head, _, rest = path.partition(".")
  if not rest:
    return dataclasses.replace(obj, **{head: value})
  return dataclasses.replace(obj, **{head: _replace(getattr(obj, head), rest, value)})


# (field of config.rl, value, other fields the value needs). KL estimators need kl_coef > 0.
RL_CASES = (
    [("old_logprobs", v, {}) for v in rl_trainer.OLD_LOGPROBS]
    + [("downsample.method", v, {}) for v in sorted(roc.DOWNSAMPLERS)]
    + [("downsample.positive_selection", v, {}) for v in ("sample", "topk")]
    + [("downsample.sample_counts", v, {}) for v in sorted(roc.SAMPLE_COUNTS)]
    + [("downsample.topk_negative_order", v, {"downsample.positive_selection": "topk"})
       for v in ("rollout", "penalty")]
    + [("downsample." + f, v, {}) for f in ("use_error_penalty", "use_format_penalty",
                                           "drop_equal_reward_groups") for v in (True, False)]
    + [("advantage.estimator", v, {}) for v in sorted(adv_lib.ESTIMATORS)]
    + [("loss.aggregation", v, {}) for v in sorted(losses.AGGREGATIONS)]
    + [("loss.kl_estimator", v, {"loss.kl_coef": 0.5}) for v in sorted(losses.KL_ESTIMATORS)]
    + [("loss.dual_clip_c", v, {}) for v in (None, 3.0)]
    + [("optimizer.schedule", v, {"optimizer.total_steps": 10}) for v in optim.SCHEDULES]
    + [("step.compute_entropy", v, {}) for v in (True, False)]
    + [("step.direct_single_micro_batch", True, {})]   # False: every other case
    + [("step.cast_params_once", True, {})]
    + [("step.fused_head_loss", True, {}), ("step.fused_head_loss", True, {"loss.kl_coef": 0.5})]
    + [("pow2_rows", v, {}) for v in (True, False)]
    + [("fixed_rows", v, {}) for v in (True, False)]
    + [("reference", "<export>", {"loss.kl_coef": 0.5})]
    + [("loss.off_policy", v, {}) for v in sorted(losses.OFF_POLICY)]
    + [("async_rollouts.max_staleness", v, {}) for v in (0, 1, 2)]
    # The pairing the ablation is for: stale rollouts under AReaL's objective.
    + [("loss.off_policy", "decoupled", {"async_rollouts.max_staleness": 1})]
    + [("async_rollouts.weight_updates", v, {"async_rollouts.max_staleness": 1})
       for v in async_lib.WEIGHT_UPDATES]
)
# Fields of config.model that the trainers' programs depend on (both trainers run each).
MODEL_CASES = ([("attention_impl", v) for v in model_config.ATTENTION_IMPLS]
               + [("remat_policy", v) for v in model_config.REMAT_POLICIES]
               + [(f, v) for f in ("dtype", "param_dtype") for v in model_config.DTYPES
                  if v != "float32"])   # float32: the smoke model's, every case above
SFT_CASES = ([("optimizer.schedule", v) for v in optim.SCHEDULES]
             + [("step.direct_single_micro_batch", True), ("step.cast_params_once", True)])


def test_the_cases_cover_every_registered_value():
  covered = {(f, v) for f, v, _ in RL_CASES}
  for field, values in [("advantage.estimator", adv_lib.ESTIMATORS),
                        ("loss.aggregation", losses.AGGREGATIONS),
                        ("loss.kl_estimator", losses.KL_ESTIMATORS),
                        ("downsample.method", roc.DOWNSAMPLERS),
                        ("downsample.sample_counts", roc.SAMPLE_COUNTS),
                        ("optimizer.schedule", optim.SCHEDULES),
                        ("old_logprobs", rl_trainer.OLD_LOGPROBS),
                        ("loss.off_policy", losses.OFF_POLICY),
                        ("async_rollouts.weight_updates", async_lib.WEIGHT_UPDATES)]:
    for v in values:
      assert (field, v) in covered, (field, v)
  assert {v for _, v in MODEL_CASES} | {"float32"} == set(model_config.ATTENTION_IMPLS) | set(
      model_config.REMAT_POLICIES) | set(model_config.DTYPES)


@pytest.fixture(scope="module")
def small(smoke_rl):
  """The smoke config, with fewer and shorter rollouts. Each case builds a trainer, hence
  jits its own step: JAX's persistent cache (as the recipe uses it) loads the programs
  that cases share (most options change only the batch preparation) instead of compiling
  each again; switched off after this module."""
  import jax
  from jax.experimental.compilation_cache import compilation_cache
  from rstar_jax import compile_cache
  cfg, ctx, model, pool, root = smoke_rl
  old = {k: getattr(jax.config, k) for k in (
      "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
      "jax_compilation_cache_max_size")}
  compile_cache.enable(str(root / "compile_cache"), min_compile_time_secs=0.0)
  rl = dataclasses.replace(cfg.rl, prompts_per_step=2, samples_per_prompt=4,
                           downsample=dataclasses.replace(cfg.rl.downsample, group_size=2))
  agent = dataclasses.replace(cfg.stage1.agent, max_response_tokens=24)
  export = str(root / "reference_export")
  hf_io.save_hf(stages.initial_model(cfg, ctx.tokenizer, ctx.mesh, ctx.rules), export,
                dtype=cfg.model.param_dtype)
  yield cfg, ctx, pool, root, rl, agent, export
  for k, v in old.items():
    jax.config.update(k, v)
  compilation_cache.reset_cache()


def _model(cfg, ctx, **model_overrides):
  cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model_overrides))
  return stages.initial_model(cfg, ctx.tokenizer, ctx.mesh, ctx.rules)


def _one_rl_step(small, name, rl, **model_overrides):
  cfg, ctx, pool, root, _, agent, export = small
  reference = None
  if rl.reference != rl_trainer.STAGE_START:
    reference = hf_io.load_hf(export, mesh=ctx.mesh, rules=ctx.rules)
  t = rl_trainer.RLTrainer(rl, agent, _model(cfg, ctx, **model_overrides), ctx.tokenizer,
                           ctx.proto, ctx.train_problems, engines=pool, tools=ctx.tools,
                           workdir=str(root / name), seed=0, mesh=ctx.mesh, rules=ctx.rules,
                           reference=reference)
  try:
    history = t.run(1, progress=False)
  finally:
    t.close()
  assert t.step == 1 and len(history) == 1
  m = history[0]
  if rl.downsample.drop_equal_reward_groups and m["update/skipped"] == 1.0:
    # The random policy's groups all have reward 0: dropped, nothing to update (what
    # the option is for). The step ran and said so.
    assert m["update/zero_advantage"] == 1.0 and "train/loss" not in m
    return m
  assert m["update/skipped"] == 0.0, m
  for k in ("train/loss", "train/grad_norm", "train/pg_loss"):
    assert math.isfinite(m[k]), (k, m[k])
  if rl.loss.kl_coef > 0:
    assert math.isfinite(m["train/kl_loss"]) and m["time/ref_logp_s"] >= 0
  else:
    assert "train/kl_loss" not in m
  return m


@pytest.mark.slow
@pytest.mark.parametrize("field,value,needs", RL_CASES,
                         ids=[f"{f}={v}" + "".join(f",{n}={x}" for n, x in d.items())
                              for f, v, d in RL_CASES])
def test_every_rl_option_runs_a_step(small, field, value, needs):
  _, _, _, _, rl, _, export = small
  for f, v in needs.items():
    rl = _replace(rl, f, v)
  rl = _replace(rl, field, export if value == "<export>" else value)
  name = f"rl_{field}_{value}" + "".join(f"_{n}_{x}" for n, x in needs.items())
  _one_rl_step(small, name.replace("<", "").replace(">", ""), rl)


@pytest.mark.slow
@pytest.mark.parametrize("field,value", MODEL_CASES, ids=[f"{f}={v}" for f, v in MODEL_CASES])
def test_every_model_option_runs_an_rl_and_an_sft_step(small, field, value):
  cfg, ctx, _, root, rl, _, _ = small
  _one_rl_step(small, f"rl_model_{field}_{value}", rl, **{field: value})
  _one_sft_step(cfg, ctx, root / f"sft_model_{field}_{value}", cfg.sft,
                _model(cfg, ctx, **{field: value}))


@pytest.mark.slow
@pytest.mark.parametrize("field,value", SFT_CASES, ids=[f"{f}={v}" for f, v in SFT_CASES])
def test_every_sft_option_runs_a_step(small, field, value):
  cfg, ctx, _, root, _, _, _ = small
  _one_sft_step(cfg, ctx, root / f"sft_{field}_{value}", _replace(cfg.sft, field, value),
                _model(cfg, ctx))


def _one_sft_step(cfg, ctx, workdir, sft, model):
  pairs = stages.sft_pairs(ctx)[:40]
  sft = dataclasses.replace(sft, epochs=0.01, heldout_share=0.0)   # one step
  t = sft_trainer.SFTTrainer(sft, model, pairs, str(workdir), seed=0,
                             pad_id=ctx.tokenizer.pad_id, mesh=ctx.mesh, rules=ctx.rules)
  try:
    history = t.run(progress=False)
  finally:
    t.close()
  assert t.total_steps == 1 and len(history) == 1
  assert np.isfinite(history[0]["sft/loss"]) and history[0]["sft/loss"] > 0


def _independent_kl(graphdef, params, ref_params, arrays, temperature: float) -> float:
  """The token-mean k3 KL(policy || reference) on a batch's model-written tokens, from
  each policy's full logits (not the trainer's chunked log-prob program), in float64."""
  import jax
  from flax import nnx

  def logp(p):
    model = nnx.merge(graphdef, jax.tree.map(np.asarray, p))
    mask = np.asarray(arrays["attention_mask"], np.int32)
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int32)
    hidden, _ = model(np.asarray(arrays["input_ids"]), positions, segment_ids=mask)
    z = np.asarray(model.logits(hidden), np.float64) / temperature
    z = z - z.max(-1, keepdims=True)
    lsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return np.take_along_axis(lsm, np.asarray(arrays["target_ids"])[..., None], -1)[..., 0]

  d = logp(ref_params) - logp(params)
  k3 = np.clip(np.exp(d) - d - 1.0, -10.0, 10.0)
  m = np.asarray(arrays["loss_mask"], np.float64)
  return float((k3 * m).sum() / m.sum())


def test_kl_to_the_reference_is_zero_at_step_1_and_equals_an_independent_computation(small):
  """Not slow: the case where kl_coef > 0 died at the first RL step. The reference is
  the stage's starting policy: at step 1 the policy IS the reference, so the KL is 0
  (up to the two programs' float rounding); after an update it is positive and equals
  k3 computed here from both policies' full logits on the step's own tokens. Nothing
  here depends on how this host rounds (no trajectory's shape is asserted)."""
  import jax
  cfg, ctx, pool, root, rl, agent, _ = small
  # A learning rate that moves the policy well past the KL's float rounding in one step.
  rl = _replace(_replace(rl, "loss.kl_coef", 0.5), "optimizer.learning_rate", 1e-2)
  t = rl_trainer.RLTrainer(rl, agent, _model(cfg, ctx), ctx.tokenizer, ctx.proto,
                           ctx.train_problems, engines=pool, tools=ctx.tools,
                           workdir=str(root / "kl_independent"), seed=0, mesh=ctx.mesh,
                           rules=ctx.rules)
  seen = []
  step_fn = t.train_step

  def spy(state, arrays):   # the parameters before the update, and the step's batch
    seen.append((jax.tree.map(np.array, state.params),
                 {k: np.array(v) for k, v in arrays.items()}))
    return step_fn(state, arrays)
  t.train_step = spy
  ref = jax.tree.map(np.array, t.ref_params)
  try:
    history = t.run(2, progress=False)
  finally:
    t.close()
  assert len(history) == len(seen) == 2 and all(m["update/skipped"] == 0.0 for m in history)
  kl = [m["train/kl_loss"] for m in history]
  assert abs(kl[0]) < 1e-6, kl
  assert kl[1] > 1e-4, kl      # the first update moved the policy off its start
  for (params, arrays), m in zip(seen, history):
    want = _independent_kl(t.graphdef, params, ref, arrays, agent.temperature)
    assert m["train/kl_loss"] == pytest.approx(want, rel=1e-3, abs=1e-7), (kl, want)


def test_a_resumed_stage_has_the_same_reference_and_refuses_another(small):
  """The reference is not saved: a resumed stage derives it again from the weights it
  starts from (the same export), and the checkpoint's fingerprint of it refuses a
  resume against other weights (the export replaced in between)."""
  import jax
  cfg, ctx, pool, root, rl, agent, _ = small
  rl = _replace(rl, "loss.kl_coef", 0.5)

  def trainer(seed):
    c = dataclasses.replace(cfg, seed=seed)
    model = stages.initial_model(c, ctx.tokenizer, ctx.mesh, ctx.rules)
    return rl_trainer.RLTrainer(rl, agent, model, ctx.tokenizer, ctx.proto,
                                ctx.train_problems, engines=pool, tools=ctx.tools,
                                workdir=str(root / "resume_ref"), seed=0, mesh=ctx.mesh,
                                rules=ctx.rules)
  first = trainer(0)
  start = jax.tree.map(np.asarray, first.ref_params)
  first.run(1, progress=False)
  first.close()
  # The jitted step donated the state it started from; the reference shares no buffer
  # with it (reading a donated array would raise) and is unchanged.
  after = jax.tree.map(np.asarray, first.ref_params)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(after)))
  again = trainer(0)
  assert again.maybe_restore() and again.step == 1
  assert all(np.asarray(a).tobytes() == b.tobytes()
             for a, b in zip(jax.tree.leaves(again.ref_params), jax.tree.leaves(start)))
  again.close()
  other = trainer(1)   # other starting weights
  with pytest.raises(ValueError, match="rl.reference: the reference policy differs"):
    other.maybe_restore()
  other.close()
