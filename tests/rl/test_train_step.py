"""The jitted GRPO train step: micro-batch invariance, sharding, batching alignment."""
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rstar_jax import optim
from rstar_jax import sharding
from rstar_jax.model import qwen3
from rstar_jax.model.model_config import Qwen3Config
from rstar_jax.rl import batching, losses, train_step as ts
from rstar_jax.train import step as core

CFG = Qwen3Config(vocab_size=67, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  initializer_range=0.3)


def _trajs(n, seed=0):
  rng = np.random.RandomState(seed)
  out = []
  for _ in range(n):
    p = rng.randint(0, 67, size=rng.randint(3, 8)).tolist()
    r = rng.randint(0, 67, size=rng.randint(2, 20)).tolist()
    mask = (rng.rand(len(r)) > 0.3).astype(int).tolist()   # some "tool" tokens
    lps = (-rng.rand(len(r)) * 3 * np.asarray(mask)).tolist()
    out.append(batching.TokenTrajectory(prompt_ids=p, response_ids=r, response_mask=mask,
                                        response_logprobs=lps))
  return out


def _batch(n=8, seed=0):
  trajs = _trajs(n, seed)
  adv = np.random.RandomState(seed + 1).randn(n).astype(np.float32)
  return batching.build_batch(trajs, adv, length_multiple=8)


def _run(micro, tx, mesh=None, batch=None, loss_cfg=losses.LossConfig(), cfg=CFG, **step_opts):
  model = qwen3.create_model(cfg, seed=3)
  graphdef, state, shard = core.init_train_state(model, tx, mesh)
  step = ts.make_train_step(graphdef, tx, loss_cfg,
                            core.StepConfig(micro_batches=micro, logprob_chunk=8, **step_opts),
                            mesh=mesh, state_shardings=shard, donate=False)
  new_state, metrics = step(state, batch if batch is not None else _batch())
  return state, new_state, jax.device_get(metrics)


def _flat(params):
  return {str(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(params)}


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_do_not_change_loss_or_gradient(aggregation):
  cfg = losses.LossConfig(aggregation=aggregation)
  tx = optax.sgd(1.0)   # the update IS the gradient, so params compare gradients exactly
  batch = _batch()
  # Make old != new so the clip is active on some tokens.
  batch["old_logp"] = batch["sampler_logp"] + np.random.RandomState(2).randn(
      *batch["old_logp"].shape).astype(np.float32) * 0.3 * batch["loss_mask"]
  _, one, m1 = _run(1, tx, batch=batch, loss_cfg=cfg)
  _, four, m4 = _run(4, tx, batch=batch, loss_cfg=cfg)
  np.testing.assert_allclose(m4["loss"], m1["loss"], rtol=1e-5)
  np.testing.assert_allclose(m4["grad_norm"], m1["grad_norm"], rtol=1e-5)
  for k in ("clip_frac_high", "clip_frac_low", "entropy", "logp_diff_mean_abs"):
    np.testing.assert_allclose(m4[k], m1[k], rtol=1e-5, atol=1e-7, err_msg=k)
  assert m1["clip_frac_high"] + m1["clip_frac_low"] > 0
  a, b = _flat(one.params), _flat(four.params)
  for k in a:
    np.testing.assert_allclose(b[k], a[k], atol=1e-6, err_msg=k)


def _assert_same_bits(got, want):
  assert set(got) == set(want)
  for k in want:
    a, b = np.asarray(want[k]), np.asarray(got[k])
    assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), k


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_one_micro_batch_without_the_accumulator_is_the_same_step_bit_for_bit(param_dtype):
  """StepConfig.direct_single_micro_batch: one micro-batch's gradient taken directly (no
  lax.scan, no fp32 zeros) is the scan's update bit for bit: 0 + g in fp32 is exact, and
  a bf16 gradient survives bf16 -> fp32 -> bf16 unchanged. Adam, so every parameter
  and every moment is compared; and the metrics, max-reduced ones included."""
  cfg = CFG.replace(param_dtype=param_dtype, dtype=param_dtype)
  tx = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-3, warmup_steps=0))
  batch = _batch(seed=11)
  _, ref, m_ref = _run(1, tx, batch=batch, cfg=cfg)
  _, got, m_got = _run(1, tx, batch=batch, cfg=cfg, direct_single_micro_batch=True)
  _assert_same_bits(m_got, m_ref)
  _assert_same_bits(_flat(got.params), _flat(ref.params))
  for a, b in zip(jax.tree.leaves(ref.opt_state), jax.tree.leaves(got.opt_state)):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  # With more than one micro-batch the option changes nothing (the scan runs).
  _, two, m_two = _run(2, tx, batch=batch, cfg=cfg)
  _, two_opt, m_two_opt = _run(2, tx, batch=batch, cfg=cfg, direct_single_micro_batch=True)
  _assert_same_bits(m_two_opt, m_two)
  _assert_same_bits(_flat(two_opt.params), _flat(two.params))


def test_params_cast_once_per_step_give_the_per_use_casts_loss_and_gradient():
  """StepConfig.cast_params_once: fp32 master weights, bf16 compute; one bf16 copy of
  the params per step instead of a cast at every use. The same casts: the forward's
  loss and metrics, and the gradient of every weight but two, are the same bits (tied
  embeddings included). The two are the MLP's gate and up projections: in the per-use
  path XLA folds the cast's transpose (bf16 -> fp32) into the hand-written backward's
  weight-gradient matmul and so never rounds that gradient to bf16; from the bf16 copy
  it is a bf16 array, rounded once per micro-batch. Bound: 2^-7 of the leaf's largest
  element (measured on one host: 3.3e-3 with two micro-batches, 2.8e-3 with one)."""
  tx = optax.sgd(1.0)   # the update IS the gradient
  batch = _batch(seed=13)
  bf16 = CFG.replace(dtype="bfloat16")
  forward = ("loss", "pg_loss", "approx_kl", "clip_frac_high", "clip_frac_low", "entropy",
             "logp_diff_mean_abs")
  rounded = ("('layers', 'gate_proj')", "('layers', 'up_proj')")
  for micro, cfg, opts in ((2, bf16, {}), (1, bf16, {"direct_single_micro_batch": True}),
                           (1, bf16.replace(tie_word_embeddings=True), {})):
    start, ref, m_ref = _run(micro, tx, batch=batch, cfg=cfg, **opts)
    _, got, m_got = _run(micro, tx, batch=batch, cfg=cfg, cast_params_once=True, **opts)
    assert ref.params["layers"]["q_proj"].get_value().dtype == np.float32
    _assert_same_bits({k: m_got[k] for k in forward if k in m_ref},
                      {k: m_ref[k] for k in forward if k in m_ref})
    s0, a, b = _flat(start.params), _flat(ref.params), _flat(got.params)
    assert set(rounded) <= set(a)
    _assert_same_bits({k: b[k] for k in a if k not in rounded},
                      {k: a[k] for k in a if k not in rounded})
    for k in rounded:
      g_ref, g_got = s0[k] - a[k], s0[k] - b[k]
      np.testing.assert_allclose(g_got, g_ref, atol=2 ** -7 * np.abs(g_ref).max(),
                                 err_msg=f"{k} {opts}")


def test_loss_matches_direct_ppo_on_model_logprobs():
  tx = optax.sgd(0.0)
  batch = _batch(seed=5)
  state, _, metrics = _run(2, tx, batch=batch)
  model = qwen3.create_model(CFG, seed=3)
  graphdef, params = nnx.split(model, nnx.Param)
  lp = ts.sequence_logprobs(graphdef, params, jnp.asarray(batch["input_ids"]),
                            jnp.asarray(batch["target_ids"]),
                            jnp.asarray(batch["attention_mask"]), chunk=8)
  want, _ = losses.ppo_loss(lp, batch["old_logp"], batch["advantages"], batch["loss_mask"])
  np.testing.assert_allclose(metrics["loss"], want, rtol=1e-5)


def test_sharded_step_equals_unsharded():
  tx = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-3, warmup_steps=0,
                                                  eps=1e-3))
  batch = _batch(n=8, seed=7)
  _, ref, m_ref = _run(2, tx, batch=batch)
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  _, got, m_got = _run(2, tx, mesh=mesh, batch=batch)
  q = got.params["layers"]["q_proj"].get_value()
  assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
  mu = got.opt_state[1][0].mu["layers"]["q_proj"].get_value()
  assert mu.sharding.spec == q.sharding.spec, "Adam moments must follow their params"
  for k in ("loss", "grad_norm", "entropy", "clip_frac_high"):
    np.testing.assert_allclose(m_got[k], m_ref[k], rtol=1e-5, atol=1e-7, err_msg=k)
  a, b = _flat(ref.params), _flat(got.params)
  for k in a:
    np.testing.assert_allclose(b[k], a[k], atol=1e-6, err_msg=k)


def test_build_batch_aligns_targets_masks_and_logprobs():
  t = batching.TokenTrajectory(prompt_ids=[1, 2, 3], response_ids=[4, 5, 6, 7],
                               response_mask=[1, 0, 0, 1], response_logprobs=[-1, 0, 0, -2])
  b = batching.build_batch([t], [0.5], row_multiple=2, length_multiple=8)
  assert b["input_ids"].shape == (2, 8)
  np.testing.assert_array_equal(b["input_ids"][0, :6], [1, 2, 3, 4, 5, 6])
  np.testing.assert_array_equal(b["target_ids"][0, :6], [2, 3, 4, 5, 6, 7])
  # Target 4 (index 2) and 7 (index 5) are the model's tokens.
  np.testing.assert_array_equal(b["loss_mask"][0, :6], [0, 0, 1, 0, 0, 1])
  np.testing.assert_array_equal(b["sampler_logp"][0, :6], [0, 0, -1, 0, 0, -2])
  assert b["loss_mask"][1].sum() == 0 and b["advantages"][1] == 0   # padding row
  with pytest.raises(ValueError, match="equal lengths"):
    batching.TokenTrajectory(prompt_ids=[1], response_ids=[2], response_mask=[1, 1],
                             response_logprobs=[0])


def test_build_batch_pow2_rows_pads_counts_to_few_shapes():
  t = batching.TokenTrajectory(prompt_ids=[1, 2], response_ids=[3, 4], response_mask=[1, 1],
                               response_logprobs=[-1, -1])
  rows = {k: batching.build_batch([t] * k, [1.0] * k, row_multiple=2, pow2_rows=True)
          for k in (1, 2, 3, 5, 9, 16, 17)}
  assert {k: b["input_ids"].shape[0] for k, b in rows.items()} == {
      1: 2, 2: 2, 3: 4, 5: 8, 9: 16, 16: 16, 17: 32}
  b = rows[5]
  assert b["loss_mask"][:5].sum() == 10 and b["loss_mask"][5:].sum() == 0
  assert (b["advantages"][5:] == 0).all()


def test_build_batch_fixed_rows_pads_every_batch_to_one_row_count():
  def traj(n):
    return batching.TokenTrajectory(prompt_ids=[1, 2], response_ids=[3] * n,
                                    response_mask=[1] * n, response_logprobs=[-1.0] * n)
  shapes = {batching.build_batch([traj(n)] * k, [1.0] * k, row_multiple=2, fixed_rows=8,
                                 length_multiple=16, max_len=48)["input_ids"].shape
            for k, n in ((1, 2), (3, 40), (8, 46))}
  assert shapes == {(8, 16), (8, 48)}   # lengths bucketed (16, 64 capped at max_len)
  b = batching.build_batch([traj(5)] * 3, [1.0] * 3, fixed_rows=8)
  assert b["loss_mask"].sum() == 15 and b["loss_mask"][3:].sum() == 0
  with pytest.raises(ValueError, match="do not fit fixed_rows=8"):
    batching.build_batch([traj(2)] * 9, [1.0] * 9, fixed_rows=8)
  with pytest.raises(ValueError, match="multiple of 3"):
    batching.build_batch([traj(2)], [1.0], fixed_rows=8, row_multiple=3)


def test_warmup_constant_schedule():
  sched = optim.make_schedule(optim.OptimizerConfig(learning_rate=1e-6, warmup_steps=20))
  assert np.isclose(sched(0), 1e-6 / 20) and np.isclose(sched(19), 1e-6)
  assert np.isclose(sched(500), 1e-6)
  with pytest.raises(ValueError, match="total_steps"):
    optim.make_schedule(optim.OptimizerConfig(schedule="warmup_cosine"))
  with pytest.raises(ValueError, match="total_steps"):
    optim.OptimizerConfig(schedule="warmup_cosine", warmup_steps=10, total_steps=5)
  cos = optim.make_schedule(optim.OptimizerConfig(learning_rate=1.0, warmup_steps=2,
                                                  schedule="warmup_cosine", total_steps=12))
  assert np.isclose(cos(0), 0.5) and np.isclose(cos(2), 1.0) and cos(11) < 0.05


def test_logprob_fn_returns_rows_in_order():
  model = qwen3.create_model(CFG, seed=3)
  graphdef, params = nnx.split(model, nnx.Param)
  b = _batch(n=8, seed=9)
  fn = ts.make_logprob_fn(graphdef, core.StepConfig(micro_batches=4, logprob_chunk=8))
  got = np.asarray(fn(params, b["input_ids"], b["target_ids"], b["attention_mask"]))
  want = np.asarray(ts.sequence_logprobs(graphdef, params, jnp.asarray(b["input_ids"]),
                                         jnp.asarray(b["target_ids"]),
                                         jnp.asarray(b["attention_mask"]), chunk=8))
  np.testing.assert_allclose(got, want, atol=1e-5)


def _compiles(caplog, name: str) -> int:
  return sum(f"Compiling jit({name})" in r.getMessage() for r in caplog.records)


def test_one_program_per_shape_whatever_made_the_state(caplog):
  """A fresh state (uncommitted arrays), its step's output, a restored state
  (committed) and a later stage's mix (restored params, a fresh step counter and
  optimizer) run one compiled step. The mix compiled a second program before: in the
  toy recipe ~10 s for every shape, again in every stage."""
  tx = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-3, warmup_steps=0))
  model = qwen3.create_model(CFG, seed=3)
  graphdef, fresh, _ = core.init_train_state(model, tx)
  step = ts.make_train_step(graphdef, tx, losses.LossConfig(),
                            core.StepConfig(logprob_chunk=8), donate=False)
  batch = _batch()
  restored = jax.tree.map(lambda a: jax.device_put(a, jax.devices()[0]), fresh)
  mixed = core.TrainState(fresh.step, restored.params, tx.init(fresh.params))
  assert not fresh.step.committed and restored.params["embed_tokens"].get_value().committed
  with jax.log_compiles(True):
    out, _ = step(fresh, batch)
    step(out, batch)
    step(restored, batch)
    _, m_mixed = step(mixed, batch)
  assert _compiles(caplog, "train_step") == 1
  _, m_fresh = step(fresh, batch)   # and the same numbers
  np.testing.assert_array_equal(m_mixed["loss"], m_fresh["loss"])
