"""Clip-higher PPO loss: numpy reference, metrics, and micro-batch invariance."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar_jax.rl import losses
from rstar_jax.rl.losses import LossConfig, LossNormalizer

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
MAX_LEN = 16


def _batch(seed=0, b=8, t=12, per_token_adv=False):
  rng = np.random.default_rng(seed)
  old = -rng.uniform(0.05, 3.0, (b, t)).astype(np.float32)
  new = (old + rng.normal(0, 0.35, (b, t))).astype(np.float32)
  lengths = rng.integers(1, t + 1, b)
  lengths[2] = 0                                  # an all-padding row
  mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
  mask[0, 0] = 0.0                                # a hole (e.g. a tool-output token)
  adv = rng.normal(0, 1, (b, t) if per_token_adv else (b,)).astype(np.float32)
  adv[1] = 0.0
  ref = (old + rng.normal(0, 0.2, (b, t))).astype(np.float32)
  ent = rng.uniform(0, 2, (b, t)).astype(np.float32)
  return new, old, adv, mask, ref, ent


# --- plain numpy reference (float64, no jax) --------------------------------------------------

def _np_per_token(new, old, adv, eps_low, eps_high, c):
  a = adv[:, None] if adv.ndim == 1 else adv
  log_ratio = np.clip(new.astype(np.float64) - old, -20, 20)
  ratio = np.exp(log_ratio)
  pg1 = -a * ratio
  pg2 = -a * np.clip(ratio, 1 - eps_low, 1 + eps_high)
  out = np.maximum(pg1, pg2)
  unclipped = pg1 >= pg2
  if c is not None:
    pg3 = -a * c
    dual_active = (a < 0) & (pg3 < out)
    out = np.where(a < 0, np.minimum(out, pg3), out)
  else:
    dual_active = np.zeros_like(out, bool)
  # d out / d new where the unclipped branch is active: d(-a * exp(new - old)) = -a * ratio.
  grad = np.where(unclipped & ~dual_active, -a * ratio, 0.0)
  return out, grad, ratio, log_ratio, a


def _np_weights(mask, mode, max_len):
  """Per-token weight w such that the aggregate is sum(w * values)."""
  m = mask.astype(np.float64)
  n_seq = max((m.sum(1) > 0).sum(), 1)
  if mode == "token-mean":
    return m / max(m.sum(), 1)
  if mode == "seq-mean-token-mean":
    return m / np.maximum(m.sum(1, keepdims=True), 1) / n_seq
  return m / (max_len * n_seq)


def _np_kl(new, ref, estimator):
  d = new.astype(np.float64) - ref
  if estimator == "k1":
    return d
  if estimator == "k2":
    return 0.5 * d ** 2
  return np.clip(np.exp(-d) + d - 1, -10, 10)


# --- value, gradient and metrics against the reference --------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dual_clip_c", [None, 3.0])
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_loss_grad_and_metrics_match_numpy(mode, dual_clip_c, per_token_adv):
  new, old, adv, mask, _, ent = _batch(seed=1, per_token_adv=per_token_adv)
  if dual_clip_c is not None:
    new[3, :4] = old[3, :4] + np.log(5.0)        # ratio 5 > c on a negative-advantage row
    adv[3] = -1.0
  cfg = LossConfig(aggregation=mode, max_response_len=MAX_LEN, dual_clip_c=dual_clip_c)
  # One compilation for value, metrics and gradient (keeps the suite fast).
  fn = jax.jit(jax.value_and_grad(functools.partial(losses.ppo_loss, config=cfg),
                                  has_aux=True))
  (loss, metrics), grad = fn(jnp.asarray(new), old, adv, mask, entropy=ent)

  per_tok, per_grad, ratio, log_ratio, a = _np_per_token(new, old, adv, 0.2, 0.28, dual_clip_c)
  w = _np_weights(mask, mode, MAX_LEN)
  np.testing.assert_allclose(loss, (w * per_tok).sum(), rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(grad, w * per_grad, rtol=2e-5, atol=1e-7)

  m = mask.astype(bool)
  n = m.sum()
  high = ((a > 0) & (ratio > 1.28) & m).sum() / n
  low = ((a < 0) & (ratio < 0.8) & m).sum() / n
  assert high > 0 and low > 0                    # the data exercises both sides
  np.testing.assert_allclose(metrics["clip_frac_high"], high, rtol=1e-6)
  np.testing.assert_allclose(metrics["clip_frac_low"], low, rtol=1e-6)
  dual = ((a < 0) & (ratio > dual_clip_c) & m).sum() / n if dual_clip_c else 0.0
  if dual_clip_c:
    assert dual > 0
  np.testing.assert_allclose(metrics["dual_clip_frac"], dual, rtol=1e-6, atol=0)
  np.testing.assert_allclose(metrics["approx_kl"], (ratio - 1 - log_ratio)[m].mean(), rtol=1e-4)
  np.testing.assert_allclose(metrics["ppo_kl"], (-log_ratio)[m].mean(), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(metrics["ratio_mean"], ratio[m].mean(), rtol=1e-5)
  np.testing.assert_allclose(metrics["entropy"], ent[m].mean(), rtol=1e-5)
  np.testing.assert_allclose(metrics["pg_loss"], loss, rtol=1e-6)
  assert "kl_loss" not in metrics


def test_spec_objective_token_mean():
  # J = 1 / sum|o_i| * sum_i sum_t min(rho A, clip(rho) A); the loss is -J.
  new, old, adv, mask, _, _ = _batch(seed=2)
  rho = np.exp(new.astype(np.float64) - old)
  a = adv[:, None].astype(np.float64)
  j = np.minimum(rho * a, np.clip(rho, 0.8, 1.28) * a)[mask > 0].sum() / mask.sum()
  loss, _ = losses.ppo_loss(new, old, adv, mask)
  np.testing.assert_allclose(loss, -j, rtol=2e-5)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("mode", MODES)
def test_kl_penalty_matches_numpy(estimator, mode):
  new, old, adv, mask, ref, _ = _batch(seed=3)
  cfg = LossConfig(aggregation=mode, max_response_len=MAX_LEN, kl_coef=0.1,
                   kl_estimator=estimator)
  loss, metrics = jax.jit(functools.partial(losses.ppo_loss, config=cfg))(
      new, old, adv, mask, ref_logp=ref)
  w = _np_weights(mask, mode, MAX_LEN)
  per_tok, _, _, _, _ = _np_per_token(new, old, adv, 0.2, 0.28, None)
  kl = (w * _np_kl(new, ref, estimator)).sum()
  np.testing.assert_allclose(metrics["kl_loss"], kl, rtol=2e-5, atol=1e-7)
  np.testing.assert_allclose(loss, (w * per_tok).sum() + 0.1 * kl, rtol=2e-5, atol=1e-6)


def test_clip_thresholds_are_asymmetric():
  # ratio 1.25: inside clip-higher's range (1.28) but outside a symmetric 0.2 clip.
  old = np.zeros((1, 4), np.float32)
  new = np.full((1, 4), np.log(1.25), np.float32)
  mask = np.ones((1, 4), np.float32)
  _, m = losses.ppo_loss(new, old, np.ones(1), mask)
  assert float(m["clip_frac_high"]) == 0.0
  _, m = losses.ppo_loss(new, old, np.ones(1), mask, config=LossConfig(eps_high=0.2))
  assert float(m["clip_frac_high"]) == 1.0
  new = np.full((1, 4), np.log(0.75), np.float32)
  _, m = losses.ppo_loss(new, old, -np.ones(1), mask)
  assert float(m["clip_frac_low"]) == 1.0


# --- micro-batch invariance -----------------------------------------------------------------

def _split_rows(x, bounds, lengths):
  """Micro-batches of rows, each trimmed to its own time length (unequal T)."""
  return [x[s:e, :t] if x.ndim == 2 else x[s:e] for (s, e), t in zip(bounds, lengths)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kl", [False, True])
def test_microbatch_invariance_of_loss_grad_and_metrics(mode, kl):
  new, old, adv, mask, ref, ent = _batch(seed=4, b=9, t=12)
  cfg = LossConfig(aggregation=mode, max_response_len=MAX_LEN, dual_clip_c=3.0,
                   kl_coef=0.05 if kl else 0.0)
  # Eager (not jitted): every micro-batch has its own shape, and compiling each would
  # dominate the suite's time; jit-ability is covered by the other tests.
  fn = jax.value_and_grad(functools.partial(losses.ppo_loss, config=cfg), has_aux=True)

  full_norm = LossNormalizer.from_mask(mask)
  (full_loss, full_metrics), full_grad = fn(jnp.asarray(new), old, adv, mask, ref_logp=ref,
                                            entropy=ent)
  full_metrics.update(losses.logprob_diff_metrics(new, ref, mask))

  bounds = [(0, 2), (2, 3), (3, 7), (7, 9)]
  # Each micro-batch padded only to its own last loss token (plus 0 or 1 column), so the
  # time lengths differ between micro-batches.
  lengths = []
  for k, (s, e) in enumerate(bounds):
    cols = np.flatnonzero(mask[s:e].any(0))
    lengths.append(min(12, (cols[-1] + 1 if cols.size else 1) + k % 2))
  assert len(set(lengths)) > 1
  parts = [_split_rows(x, bounds, lengths) for x in (new, old, adv, mask, ref, ent)]
  norm = LossNormalizer.from_masks(parts[3])
  np.testing.assert_allclose(norm.num_tokens, full_norm.num_tokens)
  np.testing.assert_allclose(norm.num_seqs, full_norm.num_seqs)

  total, acc = 0.0, None
  grads = np.zeros_like(new)
  for k, (x, o, a, m, r, e) in enumerate(zip(*parts)):
    # Trimming must not drop a loss token.
    assert m.sum() == mask[bounds[k][0]:bounds[k][1]].sum()
    (loss_k, metrics_k), g = fn(jnp.asarray(x), o, a, m, normalizer=full_norm, ref_logp=r,
                                entropy=e)
    metrics_k.update(losses.logprob_diff_metrics(x, r, m, full_norm))
    total += loss_k
    acc = losses.accumulate_metrics(acc, metrics_k)
    grads[bounds[k][0]:bounds[k][1], :x.shape[1]] = g
  np.testing.assert_allclose(total, full_loss, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(grads, full_grad, rtol=1e-5, atol=1e-9)
  assert set(acc) == set(full_metrics)
  for key in full_metrics:
    np.testing.assert_allclose(acc[key], full_metrics[key], rtol=1e-5, atol=1e-7, err_msg=key)


def test_per_microbatch_token_mean_is_not_invariant():
  # The pitfall the normaliser exists for (loss scale under accumulation): local token means differ.
  new, old, adv, mask, _, _ = _batch(seed=5)
  full, _ = losses.ppo_loss(new, old, adv, mask)
  local = sum(losses.ppo_loss(new[s:e], old[s:e], adv[s:e], mask[s:e])[0]
              for s, e in ((0, 3), (3, 8)))
  assert abs(float(local) - float(full)) > 1e-3


# --- log-prob gap, validation ----------------------------------------------------------------

def test_logprob_diff_metrics():
  new, old, _, mask, _, _ = _batch(seed=6)
  old[4, 0] = new[4, 0] + 50.0                   # a huge gap outside the mask must not count
  mask[4, 0] = 0.0
  got = jax.jit(losses.logprob_diff_metrics)(new, old, mask)
  d = np.abs(new.astype(np.float64) - old)[mask > 0]
  np.testing.assert_allclose(got["logp_diff_mean_abs"], d.mean(), rtol=1e-5)
  np.testing.assert_allclose(got["logp_diff_max_abs"], d.max(), rtol=1e-6)
  assert "logp_diff_max_abs" in losses.MAX_REDUCED_METRICS


def test_zero_mask_gives_zero_not_nan():
  z = np.zeros((2, 3), np.float32)
  for mode in MODES:
    cfg = LossConfig(aggregation=mode, max_response_len=MAX_LEN)
    loss, metrics = losses.ppo_loss(z, z, np.ones(2), z, config=cfg)
    assert float(loss) == 0.0
    assert all(np.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("kwargs,match", [
    (dict(aggregation="sum"), "known"),
    (dict(aggregation="seq-mean-token-sum-norm", max_response_len=0), "max_response_len"),
    (dict(eps_low=1.0), "eps_low"),
    (dict(dual_clip_c=1.0), "dual_clip_c"),
    (dict(kl_estimator="k9"), "kl_estimator"),
    (dict(kl_coef=-1.0), "kl_coef"),
])
def test_config_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    LossConfig(**kwargs)


def test_input_validation_names_the_tensor():
  x = np.zeros((2, 3), np.float32)
  with pytest.raises(ValueError, match="old_logp"):
    losses.ppo_loss(x, np.zeros((2, 4)), np.ones(2), x)
  with pytest.raises(ValueError, match="advantages"):
    losses.ppo_loss(x, x, np.ones(3), x)
  with pytest.raises(ValueError, match="mask"):
    losses.ppo_loss(x, x, np.ones(2), np.ones((3, 3)))
  with pytest.raises(ValueError, match="ref_logp"):
    losses.ppo_loss(x, x, np.ones(2), x, config=LossConfig(kl_coef=0.1))
  # Valid in a config (the RL trainer fills in the stage's budget), not in a bare call.
  with pytest.raises(ValueError, match="max_response_len must be set"):
    losses.ppo_loss(x, x, np.ones(2), x,
                    config=LossConfig(aggregation="seq-mean-token-sum-norm"))
  with pytest.raises(ValueError, match="differ"):
    losses.accumulate_metrics({"a": 1.0}, {"b": 1.0})


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_and_their_gradients_match_the_formulas(estimator):
  """Schulman's estimators of KL(pi || ref) from samples of pi, written out in numpy
  (p = log pi, r = log ref): k1 = p - r, k2 = (p - r)^2 / 2, k3 = exp(r - p) - (r - p) - 1;
  the gradient of each with respect to p: 1, p - r, 1 - exp(r - p). At p == r all three
  are 0 (the first step of a stage, whose reference is its starting policy)."""
  rng = np.random.default_rng(7)
  p = rng.normal(-2.0, 1.0, (4, 9)).astype(np.float32)
  r = (p + rng.normal(0.0, 0.7, p.shape)).astype(np.float32)
  p64, r64 = p.astype(np.float64), r.astype(np.float64)
  value = {"k1": p64 - r64, "k2": 0.5 * (p64 - r64) ** 2,
           "k3": np.exp(r64 - p64) - (r64 - p64) - 1}[estimator]
  grad = {"k1": np.ones_like(p64), "k2": p64 - r64, "k3": 1 - np.exp(r64 - p64)}[estimator]
  got = losses.kl_penalty(jnp.asarray(p), jnp.asarray(r), estimator)
  np.testing.assert_allclose(got, value, rtol=1e-5, atol=1e-6)
  g = jax.grad(lambda x: losses.kl_penalty(x, jnp.asarray(r), estimator).sum())(jnp.asarray(p))
  np.testing.assert_allclose(g, grad, rtol=1e-5, atol=1e-6)
  assert not np.asarray(losses.kl_penalty(jnp.asarray(p), jnp.asarray(p), estimator)).any()
  if estimator == "k3":   # clamped as verl's low_var_kl: one wild token cannot dominate
    far = losses.kl_penalty(jnp.zeros(2), jnp.array([20.0, -30.0]), "k3")
    np.testing.assert_array_equal(far, [10.0, 10.0])
