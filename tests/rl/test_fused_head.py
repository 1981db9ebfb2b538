"""StepConfig.fused_head_loss: the head's gradient made in its forward pass.

Against independent references: the per-token gradient g(lp) and the whole head's
gradient against numpy formulas written out by hand (float64), and the train step with
the option on against the same step with it off (autodiff through `ppo_loss` and the
chunked head's recomputing backward) for every loss variant, on one device and on a
4-device fsdp x tensor mesh. The two programs sum in different orders, so they agree
within float32 rounding (stated per check), not in bits.
"""
import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rstar_jax import sharding
from rstar_jax.model import fused_head, qwen3
from rstar_jax.model.model_config import Qwen3Config
from rstar_jax.rl import batching, losses, train_step as ts
from rstar_jax.rl import trainer as rl_trainer
from rstar_jax.train import step as core

V = 67   # a vocabulary size no other dimension of these models has (the matmul count)
CFG = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  initializer_range=0.3)


# --- numpy references ---------------------------------------------------------------------

def _np_token_grad(lp, old, adv, w, cfg: losses.LossConfig, ref=None, prox=None):
  """d (sum_t w_t * (l_t + kl_coef * kl_t)) / d lp_t, written out case by case (float64)."""
  lp, old, adv, w = (np.asarray(x, np.float64) for x in (lp, old, adv, w))
  base = old
  bw = np.ones_like(lp)
  if cfg.off_policy != "behaviour":
    log_w = np.clip(np.asarray(prox, np.float64) - old, -cfg.log_ratio_clamp,
                    cfg.log_ratio_clamp)
    bw = np.exp(log_w)
    if cfg.off_policy == "decoupled":
      bw = np.where(bw > cfg.behaviour_weight_cap, 0.0, bw)
    else:
      bw = np.minimum(bw, cfg.behaviour_weight_cap)
    base = np.asarray(prox, np.float64)
  d = lp - base
  r = np.exp(np.clip(d, -cfg.log_ratio_clamp, cfg.log_ratio_clamp))
  inside = np.abs(d) < cfg.log_ratio_clamp
  lo, hi = 1 - cfg.eps_low, 1 + cfg.eps_high
  # max(-A r, -A clip(r)): the unclipped side carries the gradient where it is the larger
  # (r inside the range, or clipped on the side the objective does not cap).
  unclipped_max = (-adv * r) > (-adv * np.clip(r, lo, hi))
  in_range = (r > lo) & (r < hi)
  g_pg = np.where(in_range | unclipped_max, -adv * r, 0.0) * inside
  if cfg.dual_clip_c is not None:
    g_pg = np.where((adv < 0) & (r > cfg.dual_clip_c), 0.0, g_pg)
  g = bw * g_pg
  if cfg.kl_coef > 0:
    dref = np.asarray(ref, np.float64) - lp
    k3 = np.exp(dref) - dref - 1
    assert cfg.kl_estimator == "k3"
    g = g + cfg.kl_coef * np.where(np.abs(k3) < 10, 1.0 - np.exp(dref), 0.0)
  return w * g


def _np_head(hidden, unembed, targets, g):
  """(lp, d/dhidden, d/dunembed) of sum g * lp through the head, in float64."""
  h, wt = np.asarray(hidden, np.float64), np.asarray(unembed, np.float64)
  z = h @ wt
  z = z - z.max(-1, keepdims=True)
  lsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
  lp = np.take_along_axis(lsm, targets[..., None], -1)[..., 0]
  onehot = np.eye(wt.shape[1])[targets]
  dz = g[..., None] * (onehot - np.exp(lsm))
  return lp, dz @ wt.T, np.einsum("bth,btv->hv", h, dz)


def _example(seed=0, b=3, t=29):
  rng = np.random.RandomState(seed)
  old = -rng.rand(b, t).astype(np.float32) * 3
  # new log-probs at ratios on both sides of the clip range, and past the dual clip.
  lp = (old + rng.choice([-0.6, -0.1, 0.05, 0.15, 0.5, 1.4], size=(b, t))).astype(np.float32)
  mask = (rng.rand(b, t) > 0.3).astype(np.float32)
  mask[-1] = 0.0   # a padding row
  adv = np.array([1.3, -0.7, 0.0][:b] + [0.5] * (b - 3), np.float32)
  ref = (lp + rng.randn(b, t) * 0.7).astype(np.float32)
  prox = (old + rng.randn(b, t) * 0.8).astype(np.float32)
  return lp, old, adv, mask, ref, prox


LOSS_VARIANTS = {
    "report": losses.LossConfig(),
    "kl_k3": losses.LossConfig(kl_coef=0.5),
    "dual_clip": losses.LossConfig(dual_clip_c=3.0, eps_low=0.1, eps_high=0.4),
    "seq_mean": losses.LossConfig(aggregation="seq-mean-token-mean", kl_coef=0.1),
    "token_sum_norm": losses.LossConfig(aggregation="seq-mean-token-sum-norm",
                                        max_response_len=40),
    "decoupled": losses.LossConfig(off_policy="decoupled", behaviour_weight_cap=1.5),
    "decoupled_truncated": losses.LossConfig(off_policy="decoupled-truncated",
                                             behaviour_weight_cap=1.5, kl_coef=0.2),
}


@pytest.mark.parametrize("name", sorted(LOSS_VARIANTS))
def test_the_per_token_gradient_is_the_numpy_formula(name):
  cfg = LOSS_VARIANTS[name]
  lp, old, adv, mask, ref, prox = _example()
  norm = losses.LossNormalizer.from_mask(mask)
  inputs = losses.token_loss_inputs(old, adv, mask, config=cfg, normalizer=norm,
                                    ref_logp=ref, prox_logp=prox)
  g = jax.grad(lambda x: losses.token_loss(x, inputs, cfg).sum())(jnp.asarray(lp))
  n_tok = mask.sum()
  if cfg.aggregation == "token-mean":
    w = mask / n_tok
  elif cfg.aggregation == "seq-mean-token-mean":
    w = mask / np.maximum(mask.sum(-1, keepdims=True), 1) / (mask.sum(-1) > 0).sum()
  else:
    w = mask / (cfg.max_response_len * (mask.sum(-1) > 0).sum())
  adv_bt = np.broadcast_to(adv[:, None], lp.shape)
  want = _np_token_grad(lp, old, adv_bt, w, cfg, ref, prox)
  np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=1e-8)
  # The example reaches both branches: tokens the clip (or cap) zeroes, tokens it does not.
  live = (mask > 0) & (adv_bt != 0)
  pg = _np_token_grad(lp, old, adv_bt, w, dataclasses.replace(cfg, kl_coef=0.0), ref, prox)
  assert 0 < np.count_nonzero(pg[live]) < live.sum()
  # The per-token shares sum to ppo_loss's loss.
  total = losses.token_loss(lp, inputs, cfg).sum()
  want_loss, _ = losses.ppo_loss(lp, old, adv, mask, config=cfg, normalizer=norm,
                                 ref_logp=ref, prox_logp=prox)
  np.testing.assert_allclose(float(total), float(want_loss), rtol=1e-5, atol=1e-7)


def test_the_fused_head_s_gradient_is_the_numpy_head_s():
  """The head of hidden states and a projection, with a numpy reference for the chain
  rule: the same log-probs, and d loss / d hidden, d loss / d unembed equal to
  g(lp) * (onehot - softmax) pushed through the projection (float64). 29 positions in
  chunks of 8: the last chunk padded."""
  cfg = LOSS_VARIANTS["kl_k3"]
  rng = np.random.RandomState(1)
  b, t, h = 3, 29, 16
  hidden = rng.randn(b, t, h).astype(np.float32)
  unembed = (rng.randn(h, V) * 0.4).astype(np.float32)
  targets = rng.randint(0, V, (b, t))
  _, old, adv, mask, ref, prox = _example(2, b, t)
  norm = losses.LossNormalizer.from_mask(mask)
  inputs = losses.token_loss_inputs(old, adv, mask, config=cfg, normalizer=norm, ref_logp=ref)
  token_loss = lambda x, a: losses.token_loss(x, a, cfg)

  def loss_of(hid, w):
    loss, lp, ent = fused_head.fused_logprob_loss(hid, w, jnp.asarray(targets), token_loss,
                                                  inputs, chunk=8, with_entropy=True)
    return loss, (lp, ent)

  (loss, (lp, ent)), (dh, dw) = jax.jit(jax.value_and_grad(loss_of, argnums=(0, 1),
                                                           has_aux=True))(hidden, unembed)
  want_lp, _, _ = _np_head(hidden, unembed, targets, np.zeros((b, t)))
  np.testing.assert_allclose(np.asarray(lp), want_lp, rtol=1e-5, atol=1e-5)
  g = _np_token_grad(want_lp, old, np.broadcast_to(adv[:, None], (b, t)),
                     mask / mask.sum(), cfg, ref)
  _, want_dh, want_dw = _np_head(hidden, unembed, targets, g)
  for got, want in ((dh, want_dh), (dw, want_dw)):
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * scale)
  z = hidden.astype(np.float64) @ unembed
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  np.testing.assert_allclose(np.asarray(ent), -(p * np.log(p)).sum(-1), rtol=1e-4, atol=1e-5)
  want_loss, _ = losses.ppo_loss(want_lp.astype(np.float32), old, adv, mask, config=cfg,
                                 ref_logp=ref)
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)


def _head_dots(fn, *args) -> int:
  """dot_general equations of fn's jaxpr (sub-jaxprs included, each loop body once)
  with an operand of the vocabulary's size."""
  from jax.extend import core as jcore

  def subjaxprs(value):
    for v in (value if isinstance(value, (list, tuple)) else [value]):
      if isinstance(v, jcore.ClosedJaxpr):
        yield v.jaxpr
      elif isinstance(v, jcore.Jaxpr):
        yield v

  def walk(jaxpr):
    n = 0
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general" and any(
          V in getattr(v.aval, "shape", ()) for v in eqn.invars):
        n += 1
      for value in eqn.params.values():
        n += sum(walk(sub) for sub in subjaxprs(value))
    return n
  return walk(jax.make_jaxpr(fn)(*args).jaxpr)


def test_the_fused_gradient_runs_three_head_matmuls_where_the_unfused_runs_four():
  cfg = losses.LossConfig()
  rng = np.random.RandomState(3)
  hidden = rng.randn(2, 16, 8).astype(np.float32)
  unembed = rng.randn(8, V).astype(np.float32)
  targets = jnp.asarray(rng.randint(0, V, (2, 16)))
  _, old, adv, mask, _, _ = _example(4, 2, 16)

  def unfused(hid, w):
    lp = qwen3.chunked_logprobs(hid, w, targets, chunk=8)
    return losses.ppo_loss(lp, old, adv, mask, config=cfg)[0]

  def fused(hid, w):
    inputs = losses.token_loss_inputs(old, adv, mask, config=cfg)
    return fused_head.fused_logprob_loss(hid, w, targets,
                                         lambda x, a: losses.token_loss(x, a, cfg),
                                         inputs, chunk=8)[0]

  grad = lambda f: jax.grad(f, argnums=(0, 1))
  assert _head_dots(grad(unfused), hidden, unembed) == 4
  assert _head_dots(grad(fused), hidden, unembed) == 3


# --- the train step, option on vs off -----------------------------------------------------

def _grads_tx():
  """An optimizer whose state after one update is the gradient itself (the update is
  zero): the step's gradients compared leaf by leaf without the parameters' rounding."""
  return optax.GradientTransformation(
      init=lambda p: jax.tree.map(jnp.zeros_like, p),
      update=lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g))


def _batch(n=7, seed=0, with_ref=False, with_prox=False):
  rng = np.random.RandomState(seed)
  trajs = []
  for _ in range(n):
    p = rng.randint(0, V, size=rng.randint(3, 8)).tolist()
    r = rng.randint(0, V, size=rng.randint(2, 20)).tolist()
    mask = (rng.rand(len(r)) > 0.3).astype(int).tolist()   # some "tool" tokens
    lps = (-rng.rand(len(r)) * 3 * np.asarray(mask)).tolist()
    trajs.append(batching.TokenTrajectory(prompt_ids=p, response_ids=r, response_mask=mask,
                                          response_logprobs=lps))
  adv = rng.randn(n).astype(np.float32)
  # 7 rows padded to 8: one all-padding row.
  batch = batching.build_batch(trajs, adv, row_multiple=4, length_multiple=8)
  m = batch["loss_mask"]
  # Old log-probs off the policy's, so that the clip acts on some tokens.
  batch["old_logp"] = (batch["sampler_logp"] + rng.randn(*m.shape).astype(np.float32) * 0.3 * m)
  if with_ref:
    batch["ref_logp"] = (batch["sampler_logp"] + rng.randn(*m.shape) * 0.5 * m).astype(np.float32)
  if with_prox:
    batch["prox_logp"] = (batch["old_logp"] + rng.randn(*m.shape) * 0.4 * m).astype(np.float32)
  return batch


def _step(loss_cfg, batch, *, mesh=None, model_cfg=CFG, temperature=1.0, **step_opts):
  model = qwen3.create_model(model_cfg, seed=3)
  tx = _grads_tx()
  graphdef, state, shard = core.init_train_state(model, tx, mesh)
  step = ts.make_train_step(graphdef, tx, loss_cfg,
                            core.StepConfig(logprob_chunk=8, **step_opts),
                            temperature=temperature, mesh=mesh, state_shardings=shard,
                            donate=False)
  new_state, metrics = step(state, batch)
  grads = {str(p): np.asarray(v.get_value(), np.float32)
           for p, v in nnx.to_flat_state(new_state.opt_state)}
  return jax.device_get(metrics), grads


def _assert_agree(got, want, metric_rtol=1e-5, grad_tol=1e-5):
  (m_got, g_got), (m_want, g_want) = got, want
  assert set(m_got) == set(m_want)
  for k in m_want:
    np.testing.assert_allclose(m_got[k], m_want[k], rtol=metric_rtol, atol=1e-7, err_msg=k)
  assert set(g_got) == set(g_want) and len(g_want) > 5
  for k in g_want:
    # Each leaf within grad_tol of its own largest element.
    scale = max(np.abs(g_want[k]).max(), 1e-30)
    np.testing.assert_allclose(g_got[k], g_want[k], atol=grad_tol * scale, err_msg=k)


STEP_VARIANTS = {
    "report": (LOSS_VARIANTS["report"], {}, {}),
    "kl_k3": (LOSS_VARIANTS["kl_k3"], {"with_ref": True}, {}),
    "kl_k1_no_entropy": (losses.LossConfig(kl_coef=0.3, kl_estimator="k1"),
                         {"with_ref": True}, {"compute_entropy": False}),
    "dual_clip_wide": (LOSS_VARIANTS["dual_clip"], {}, {}),
    "seq_mean": (LOSS_VARIANTS["seq_mean"], {"with_ref": True}, {}),
    "token_sum_norm": (LOSS_VARIANTS["token_sum_norm"], {}, {}),
    "decoupled": (LOSS_VARIANTS["decoupled"], {"with_prox": True}, {}),
    "two_micro_batches": (losses.LossConfig(kl_coef=0.2, kl_estimator="k2"),
                          {"with_ref": True}, {"micro_batches": 2}),
}


@pytest.mark.parametrize("name", sorted(STEP_VARIANTS))
def test_the_fused_step_gives_the_unfused_loss_metrics_and_gradients(name):
  loss_cfg, batch_opts, step_opts = STEP_VARIANTS[name]
  batch = _batch(**batch_opts)
  off = _step(loss_cfg, batch, **step_opts)
  on = _step(loss_cfg, batch, fused_head_loss=True, **step_opts)
  assert off[0]["clip_frac_high"] + off[0]["clip_frac_low"] > 0   # the clip is live
  _assert_agree(on, off)


def test_the_fused_step_at_a_temperature_with_tied_embeddings():
  model_cfg = dataclasses.replace(CFG, tie_word_embeddings=True)
  batch = _batch(seed=5, with_ref=True)
  cfg = losses.LossConfig(kl_coef=0.5)
  off = _step(cfg, batch, model_cfg=model_cfg, temperature=0.7)
  on = _step(cfg, batch, model_cfg=model_cfg, temperature=0.7, fused_head_loss=True)
  _assert_agree(on, off)


def test_the_fused_step_with_bf16_compute_is_as_near_the_fp32_step_as_the_unfused():
  """bf16 compute, fp32 master weights. Both heads round their logits' gradient to bf16
  before the two matmuls, and bf16 rounding through the layers' backward puts every
  gradient ~3% (of its leaf's largest element) off the fp32 step's, differently for the
  two orders of summation; so each is compared with the fp32 step (the reference): the
  fused step's gradients no farther from it on average than 2x the unfused step's
  (measured: 0.028 both), both under 2^-4 on average, none farther than 2^-3; the log-prob metrics as the unfused
  step's within 1e-4 (both compute the log-probs with the same operations)."""
  model_cfg = dataclasses.replace(CFG, dtype="bfloat16")
  batch = _batch(seed=6)
  cfg = losses.LossConfig()
  ref = _step(cfg, batch)
  off = _step(cfg, batch, model_cfg=model_cfg)
  on = _step(cfg, batch, model_cfg=model_cfg, fused_head_loss=True)
  for k in off[0]:
    tol = 2 ** -6 if k == "grad_norm" else 1e-4
    np.testing.assert_allclose(on[0][k], off[0][k], rtol=tol, atol=1e-7, err_msg=k)

  def errors(grads):
    return {k: np.abs(grads[k] - ref[1][k]).max() / np.abs(ref[1][k]).max() for k in ref[1]}
  e_off, e_on = errors(off[1]), errors(on[1])
  assert max(e_on.values()) < 2 ** -3, e_on
  # Absolute bounds on each against the fp32 reference (bf16 rounding's size, any CPU),
  # and the fused no worse than twice the unfused (a margin over either's rounding).
  assert np.mean(list(e_on.values())) < 2 ** -4 and np.mean(list(e_off.values())) < 2 ** -4
  assert np.mean(list(e_on.values())) <= 2 * np.mean(list(e_off.values())), (e_on, e_off)


@pytest.mark.parametrize("mesh_shape", [{"fsdp": 2, "tensor": 2}, {"data": 2, "tensor": 2}])
def test_the_fused_step_on_a_mesh_gives_the_one_device_step(mesh_shape):
  """Vocab-parallel head over 4 devices: the projection split on the vocabulary, each
  chunk's hidden states gathered. On against off on the mesh, and on the mesh against
  one device. The vocabulary (68 here) divides by fsdp x tensor, so the split is real."""
  model_cfg = dataclasses.replace(CFG, vocab_size=68)
  mesh = sharding.make_mesh(mesh_shape, devices=jax.devices()[:4])
  batch = _batch(seed=7, with_ref=True)
  cfg = losses.LossConfig(kl_coef=0.5, dual_clip_c=3.0)
  one = _step(cfg, batch, model_cfg=model_cfg, micro_batches=2)
  off = _step(cfg, batch, model_cfg=model_cfg, micro_batches=2, mesh=mesh)
  on = _step(cfg, batch, model_cfg=model_cfg, micro_batches=2, mesh=mesh,
             fused_head_loss=True)
  _assert_agree(on, off)
  _assert_agree(on, one)


# --- refusals -----------------------------------------------------------------------------

@pytest.fixture
def nonlinear_aggregation():
  """An aggregation whose weights depend on the values (a softmax-weighted mean)."""
  name = "test-softmax-weighted"

  @losses.register_aggregation(name)
  def _agg(values, mask, norm, config):
    del norm, config
    w = jax.nn.softmax(jnp.where(mask > 0, values, -1e30))
    return (w * values * mask).sum()
  yield name
  del losses.AGGREGATIONS[name]


def test_an_aggregation_not_linear_in_the_token_losses_is_refused(nonlinear_aggregation):
  loss_cfg = losses.LossConfig(aggregation=nonlinear_aggregation)
  step_cfg = core.StepConfig(fused_head_loss=True)
  with pytest.raises(ValueError, match=r"RLConfig.step.fused_head_loss .*"
                     r"aggregation='test-softmax-weighted' is not registered as linear"):
    rl_trainer.RLConfig(loss=loss_cfg, step=step_cfg)
  rl_trainer.RLConfig(loss=loss_cfg)   # the unfused head takes it
  model = qwen3.create_model(CFG, seed=0)
  graphdef, _, _ = core.init_train_state(model, optax.sgd(0.1))
  with pytest.raises(ValueError, match="set StepConfig.fused_head_loss=False"):
    ts.make_train_step(graphdef, optax.sgd(0.1), loss_cfg, step_cfg)
  with pytest.raises(ValueError, match="not registered as linear"):
    losses.token_loss_inputs(np.zeros((1, 2)), np.zeros(1), np.ones((1, 2)), config=loss_cfg)


def test_the_fused_head_names_a_misshapen_input():
  with pytest.raises(ValueError, match=r"inputs\['weight'\] has shape \(2, 3\), expected \(2, 4\)"):
    fused_head.fused_logprob_loss(jnp.zeros((2, 4, 8)), jnp.zeros((8, V)),
                                  jnp.zeros((2, 4), jnp.int32), lambda x, a: x,
                                  {"weight": jnp.zeros((2, 3))})
