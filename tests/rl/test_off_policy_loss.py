"""The off-policy corrections of the PPO loss (losses.OFF_POLICY) against a numpy
reference written from the formulas, one token at a time (float64 loops, no jax):

  decoupled (AReaL, Fu et al. 2025, arXiv 2505.24298):
    rho = exp(new - prox), w = exp(prox - behav)
    l   = w' * max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))   (dual clip on A < 0)
    w'  = 0 if w > cap else w            (decoupled: AReaL drops the token)
    w'  = min(w, cap)                    (decoupled-truncated)
  token-mean aggregation: sum over mask tokens / mask tokens.
"""
import math

import jax
import numpy as np
import pytest

from rstar_jax.rl import losses
from rstar_jax.rl.losses import LossConfig, LossNormalizer


def _batch(seed=0, b=6, t=10):
  rng = np.random.default_rng(seed)
  behav = -rng.uniform(0.05, 3.0, (b, t)).astype(np.float32)
  prox = (behav + rng.normal(0, 0.6, (b, t))).astype(np.float32)   # some w beyond the cap
  prox[0, :3] = behav[0, :3] + np.log(8.0)                          # w = 8 > 5
  new = (prox + rng.normal(0, 0.3, (b, t))).astype(np.float32)
  lengths = rng.integers(1, t + 1, b)
  mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
  mask[0, :3] = 1.0
  adv = rng.normal(0, 1, (b,)).astype(np.float32)
  return new, behav, prox, adv, mask


def _reference(new, behav, prox, adv, mask, mode, eps_low, eps_high, cap, dual_c):
  """(loss, d loss / d new, metrics) by loops over tokens."""
  b, t = new.shape
  n_tok = sum(mask[i, j] > 0 for i in range(b) for j in range(t))
  loss, grad = 0.0, np.zeros((b, t))
  w_sum = w_max = logw_abs = capped = clip_high = clip_low = 0.0
  for i in range(b):
    a = float(adv[i])
    for j in range(t):
      if mask[i, j] == 0:
        continue
      rho = math.exp(float(new[i, j]) - float(prox[i, j]))
      w = math.exp(float(prox[i, j]) - float(behav[i, j]))
      if mode == "decoupled":
        w_used = 0.0 if w > cap else w
      else:
        w_used = min(w, cap)
      unclipped = -a * rho
      clipped = -a * min(max(rho, 1 - eps_low), 1 + eps_high)
      l = max(unclipped, clipped)
      # The unclipped branch carries the gradient (d(-a rho)/d new = -a rho), unless the
      # clipped one is strictly larger (ties: both equal, the max's gradient goes to the
      # first, the unclipped one, as jnp.maximum does).
      g = -a * rho if unclipped >= clipped else 0.0
      if dual_c is not None and a < 0 and -a * dual_c < l:
        l, g = -a * dual_c, 0.0
      loss += w_used * l / n_tok
      grad[i, j] = w_used * g / n_tok
      w_sum += w
      w_max = max(w_max, w)
      logw_abs += abs(math.log(w))
      capped += w > cap
      clip_high += a > 0 and rho > 1 + eps_high
      clip_low += a < 0 and rho < 1 - eps_low
  metrics = dict(behav_weight_mean=w_sum / n_tok, behav_weight_max=w_max,
                 behav_log_weight_abs=logw_abs / n_tok, behav_capped_frac=capped / n_tok,
                 clip_frac_high=clip_high / n_tok, clip_frac_low=clip_low / n_tok)
  return loss, grad, metrics


@pytest.mark.parametrize("mode", ["decoupled", "decoupled-truncated"])
@pytest.mark.parametrize("dual_c", [None, 3.0])
def test_decoupled_loss_gradient_and_metrics_match_the_per_token_reference(mode, dual_c):
  new, behav, prox, adv, mask = _batch(seed=3)
  cfg = LossConfig(off_policy=mode, behaviour_weight_cap=5.0, dual_clip_c=dual_c)
  fn = jax.jit(jax.value_and_grad(
      lambda n: losses.ppo_loss(n, behav, adv, mask, config=cfg, prox_logp=prox),
      has_aux=True))
  (loss, m), g = fn(new)
  ref_loss, ref_grad, ref_m = _reference(new, behav, prox, adv, mask, mode, cfg.eps_low,
                                         cfg.eps_high, cfg.behaviour_weight_cap, dual_c)
  assert ref_m["behav_capped_frac"] > 0      # the cap acted: both rules were exercised
  np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(g), ref_grad, rtol=1e-4, atol=1e-7)
  for k, v in ref_m.items():
    np.testing.assert_allclose(float(m[k]), v, rtol=1e-5, atol=1e-7, err_msg=k)


def test_the_modes_differ_only_on_capped_tokens():
  new, behav, prox, adv, mask = _batch(seed=4)
  out = {mode: losses.ppo_loss(new, behav, adv, mask, prox_logp=prox,
                               config=LossConfig(off_policy=mode))[0]
         for mode in ("decoupled", "decoupled-truncated")}
  assert float(out["decoupled"]) != float(out["decoupled-truncated"])
  # Without a token beyond the cap the two are the same objective.
  prox2 = behav + np.clip(prox - behav, -1.0, 1.0)    # w <= e < 5
  a = losses.ppo_loss(new, behav, adv, mask, prox_logp=prox2,
                      config=LossConfig(off_policy="decoupled"))[0]
  b = losses.ppo_loss(new, behav, adv, mask, prox_logp=prox2,
                      config=LossConfig(off_policy="decoupled-truncated"))[0]
  assert float(a) == float(b)


def test_decoupled_with_prox_equal_to_behaviour_is_the_behaviour_objective():
  """w = 1 everywhere: the decoupled loss is today's loss against the sampler."""
  new, behav, _, adv, mask = _batch(seed=5)
  plain, pm = losses.ppo_loss(new, behav, adv, mask)
  dec, dm = losses.ppo_loss(new, behav, adv, mask, prox_logp=behav,
                            config=LossConfig(off_policy="decoupled"))
  assert float(plain) == float(dec)
  assert float(dm["behav_weight_mean"]) == 1.0 and float(dm["behav_capped_frac"]) == 0.0
  assert set(dm) - set(pm) == {"behav_weight_mean", "behav_weight_max",
                               "behav_log_weight_abs", "behav_capped_frac"}


def test_micro_batches_sum_to_the_full_batch():
  new, behav, prox, adv, mask = _batch(seed=6)
  cfg = LossConfig(off_policy="decoupled")
  full, fm = losses.ppo_loss(new, behav, adv, mask, config=cfg, prox_logp=prox)
  norm = LossNormalizer.from_mask(mask)
  acc, total = None, 0.0
  for s in (slice(0, 2), slice(2, 6)):
    part, pm = losses.ppo_loss(new[s], behav[s], adv[s], mask[s], config=cfg,
                               normalizer=norm, prox_logp=prox[s])
    total += float(part)
    acc = losses.accumulate_metrics(acc, pm)
  np.testing.assert_allclose(total, float(full), rtol=1e-6)
  for k in fm:
    np.testing.assert_allclose(float(acc[k]), float(fm[k]), rtol=1e-5, err_msg=k)


def test_config_refuses_bad_values_and_the_loss_a_missing_prox():
  with pytest.raises(ValueError, match="off-policy correction"):
    LossConfig(off_policy="nope")
  with pytest.raises(ValueError, match="behaviour_weight_cap"):
    LossConfig(behaviour_weight_cap=1.0)
  new, behav, _, adv, mask = _batch()
  with pytest.raises(ValueError, match="prox_logp is required"):
    losses.ppo_loss(new, behav, adv, mask, config=LossConfig(off_policy="decoupled"))
  assert not LossConfig().needs_proximal and LossConfig(off_policy="decoupled").needs_proximal

