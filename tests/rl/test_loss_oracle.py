"""rstar_jax.rl.losses against an oracle written from the papers' formulas, token by token.

The oracle is plain Python floats (float64), one token at a time, in the papers' form,
not the vectorised code's:

  rStar2-Agent (arXiv 2508.20722), GRPO-RoC objective, and DAPO (arXiv 2503.14476), eq. 8:
    J = 1 / sum_i |o_i| * sum_i sum_t min(r_it * A_it, clip(r_it, 1 - eps_low, 1 + eps_high) * A_it)
    r_it = pi_theta(o_it | ...) / pi_old(o_it | ...),   the loss is -J ("token-mean").
  Dual clip (Ye et al. 2019, as verl): for A < 0 the objective is max(that min, c * A).
  The log-ratio is clamped to [-20, 20] before exp (verl's safeguard; LossConfig's default).
  GRPO's original sample-level mean ("seq-mean-token-mean"): 1/G sum_i 1/|o_i| sum_t;
  Dr. GRPO's "seq-mean-token-sum-norm": sum_i sum_t / (T_max * G) (this codebase's G).
  KL(pi || ref) per token, Schulman's estimators with x = pi_ref / pi:
    k1 = -log x,  k2 = (log x)^2 / 2,  k3 = x - 1 - log x  (verl clamps k3 to [-10, 10]).

Each case of `LossConfig` the module offers (every aggregation, clip on both sides, the
dual clip, every KL estimator, the clamp) is compared with the oracle, value and gradient
(the oracle's gradient by central differences).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar_jax.rl import losses
from rstar_jax.rl.losses import LossConfig, LossNormalizer

T_MAX = 7   # the batch's time length; the sum-norm mode's max_response_len


# ---- the oracle ----------------------------------------------------------------------------

def token_objective(logp_new: float, logp_old: float, a: float, *, eps_low: float,
                    eps_high: float, dual_c: float | None, clamp: float = 20.0) -> float:
  """The clipped surrogate J of one token (to maximise)."""
  log_r = min(clamp, max(-clamp, logp_new - logp_old))
  r = math.exp(log_r)
  r_clipped = min(1.0 + eps_high, max(1.0 - eps_low, r))
  j = min(r * a, r_clipped * a)
  if dual_c is not None and a < 0:
    j = max(j, dual_c * a)
  return j


def kl_token(logp: float, ref: float, estimator: str) -> float:
  log_x = ref - logp                 # x = pi_ref / pi
  if estimator == "k1":
    return -log_x
  if estimator == "k2":
    return 0.5 * log_x * log_x
  k3 = math.exp(log_x) - 1.0 - log_x
  return min(10.0, max(-10.0, k3))


def token_terms(logp_new, logp_old, a, ref, cfg: LossConfig) -> tuple[float, float]:
  """The loss of one token in two parts: -J and kl_coef * KL (kept apart so that a
  difference quotient of the small one is not lost in the rounding of a clamped e^20)."""
  pg = -token_objective(logp_new, logp_old, a, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                        dual_c=cfg.dual_clip_c, clamp=cfg.log_ratio_clamp)
  kl = cfg.kl_coef * kl_token(logp_new, ref, cfg.kl_estimator) if cfg.kl_coef else 0.0
  return pg, kl


def token_weights(mask, cfg: LossConfig) -> dict[tuple[int, int], float]:
  """The weight of each response token in the aggregate (the loss is linear in the token
  terms): 1 / sum_i |o_i|, 1 / (G |o_i|) or 1 / (T_max G); an all-padding row is no
  sequence."""
  lengths = {i: sum(1 for m in row if m) for i, row in enumerate(mask)}
  seqs = [i for i, n in lengths.items() if n]
  g = len(seqs)
  weights = {}
  for i in seqs:
    for t, m in enumerate(mask[i]):
      if not m:
        continue
      if cfg.aggregation == "token-mean":
        weights[i, t] = 1.0 / sum(lengths.values())
      elif cfg.aggregation == "seq-mean-token-mean":
        weights[i, t] = 1.0 / (g * lengths[i])
      elif cfg.aggregation == "seq-mean-token-sum-norm":
        weights[i, t] = 1.0 / (cfg.max_response_len * g)
      else:
        raise AssertionError(f"the oracle has no formula for {cfg.aggregation}")
  return weights


def _args(new, old, adv, ref, i, t):
  a = adv[i] if np.ndim(adv[i]) == 0 else adv[i][t]
  return float(new[i][t]), float(old[i][t]), float(a), None if ref is None else float(ref[i][t])


def oracle_loss(new, old, adv, mask, cfg: LossConfig, ref=None) -> float:
  return math.fsum(w * part for (i, t), w in token_weights(mask, cfg).items()
                   for part in token_terms(*_args(new, old, adv, ref, i, t), cfg))


def oracle_grad(new, old, adv, mask, cfg, ref=None, h=1e-6) -> np.ndarray:
  """d loss / d new_logp: each token's weight times its term's central difference (a
  masked token has none)."""
  g = np.zeros(np.shape(new))
  for (i, t), w in token_weights(mask, cfg).items():
    x, o, a, r = _args(new, old, adv, ref, i, t)
    up, down = token_terms(x + h, o, a, r, cfg), token_terms(x - h, o, a, r, cfg)
    g[i, t] = w * sum(u - d for u, d in zip(up, down)) / (2 * h)
  return g


# ---- the batch --------------------------------------------------------------------------------

def batch(per_token_adv: bool):
  """Log-ratios chosen to land in every branch: inside the clip range, above 1 + eps_high
  and below 1 - eps_low for both signs of A, above the dual-clip bound c = 3, and past the
  clamp; reference gaps past k3's clip (exp(3) - 4 > 10)."""
  rng = np.random.default_rng(7)
  old = -rng.uniform(0.1, 3.0, (4, T_MAX))
  d = np.array([[0.05, -0.1, 0.5, -0.5, 1.5, 0.0, 0.2],
                [0.4, -0.4, 1.2, -1.2, 0.1, 30.0, -30.0],
                [0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3],       # all padding below
                [-0.05, 0.15, 2.0, -2.0, 0.25, -0.25, 0.7]])
  new = old + d
  mask = np.ones((4, T_MAX))
  mask[2] = 0.0
  mask[0, 1] = 0.0                   # a tool-output token inside a response
  mask[3, 5:] = 0.0                  # a shorter response
  if per_token_adv:
    adv = rng.choice([-1.3, -0.4, 0.6, 1.1], size=(4, T_MAX))
  else:
    adv = np.array([0.9, -1.1, 0.5, -0.7])
  ref = new + np.array([[0.3, -0.3, 3.0, -3.0, 0.0, 1.0, -1.0]] * 4)
  return new, old, adv, mask, ref


def jax_loss(new, old, adv, mask, cfg, ref=None):
  f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
  loss_fn = lambda n: losses.ppo_loss(n, f32(old), f32(adv), f32(mask), config=cfg,
                                      ref_logp=f32(ref))[0]
  value, grad = jax.value_and_grad(loss_fn)(f32(new))
  return float(value), np.asarray(grad, np.float64)


CONFIGS = {
    "token-mean": LossConfig(),
    "token-mean-symmetric": LossConfig(eps_low=0.2, eps_high=0.2),
    "token-mean-dual-clip": LossConfig(dual_clip_c=3.0),
    "seq-mean-token-mean": LossConfig(aggregation="seq-mean-token-mean", dual_clip_c=3.0),
    "seq-mean-token-sum-norm": LossConfig(aggregation="seq-mean-token-sum-norm",
                                          max_response_len=T_MAX),
    "kl-k1": LossConfig(kl_coef=0.1, kl_estimator="k1"),
    "kl-k2": LossConfig(kl_coef=0.1, kl_estimator="k2", aggregation="seq-mean-token-mean"),
    "kl-k3": LossConfig(kl_coef=0.1, kl_estimator="k3", dual_clip_c=3.0,
                        aggregation="seq-mean-token-sum-norm", max_response_len=T_MAX),
    "clamp-5": LossConfig(log_ratio_clamp=5.0, dual_clip_c=3.0),
}


def test_the_oracle_covers_every_option_the_module_offers():
  assert set(losses.AGGREGATIONS) <= {c.aggregation for c in CONFIGS.values()}
  assert set(losses.KL_ESTIMATORS) <= {c.kl_estimator for c in CONFIGS.values() if c.kl_coef}


@pytest.mark.parametrize("per_token_adv", [False, True], ids=["seq-adv", "token-adv"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_loss_and_gradient_match_the_papers_formulas(name, per_token_adv):
  cfg = CONFIGS[name]
  new, old, adv, mask, ref = batch(per_token_adv)
  ref = ref if cfg.kl_coef else None
  value, grad = jax_loss(new, old, adv, mask, cfg, ref)
  # float32 inputs: the oracle gets the same rounded values.
  r32 = lambda x: None if x is None else np.asarray(x, np.float32).astype(np.float64)
  new, old, adv, ref = r32(new), r32(old), r32(adv), r32(ref)
  expected = oracle_loss(new, old, adv, mask, cfg, ref)
  assert value == pytest.approx(expected, rel=1e-5, abs=1e-6)
  # At a kink of min / clip the difference quotient is the mean of the two sides: the
  # batch puts no token within h of one, so every entry is a one-sided derivative.
  np.testing.assert_allclose(grad, oracle_grad(new, old, adv, mask, cfg, ref),
                             rtol=2e-4, atol=2e-6)


def test_a_wild_token_is_clamped_not_overflowed():
  """|new - old| = 50 on a negative-advantage token: exp(20), not exp(50) (which is still
  finite in float32, so only the value tells the clamp is there)."""
  new = np.array([[-1.0, 49.0, -2.0]])
  old = np.array([[-1.5, -1.0, -2.1]])
  mask = np.ones((1, 3))
  cfg = LossConfig()
  for a in (-0.5, 0.5):
    adv = np.array([a])
    value, grad = jax_loss(new, old, adv, mask, cfg)
    assert value == pytest.approx(oracle_loss(new, old, adv, mask, cfg), rel=1e-5)
    assert math.isfinite(value) and grad[0, 1] == 0.0   # clamped: no gradient through it
  assert oracle_loss(new, old, np.array([-0.5]), mask, cfg) == pytest.approx(
      (0.5 * math.exp(0.5) + 0.5 * math.exp(20) + 0.5 * math.exp(0.1)) / 3, rel=1e-12)
  # The other way (-50): the metrics see log(r) = -20, not -50.
  _, metrics = losses.ppo_loss(jnp.asarray([[-51.0]]), jnp.asarray([[-1.0]]),
                               jnp.asarray([1.0]), jnp.ones((1, 1)))
  assert float(metrics["ppo_kl"]) == pytest.approx(20.0)
  assert float(metrics["approx_kl"]) == pytest.approx(math.exp(-20) - 1 + 20, rel=1e-6)


def test_metrics_match_their_definitions():
  """Token averages over the mask: clip fractions per side, the dual-clip fraction,
  k3 of KL(old || new), k1 (ppo_kl), the mean ratio, the entropy."""
  new, old, adv, mask, _ = batch(per_token_adv=True)
  ent = np.linspace(0.1, 2.0, new.size).reshape(new.shape)
  cfg = LossConfig(dual_clip_c=3.0)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  _, m = losses.ppo_loss(f32(new), f32(old), f32(adv), f32(mask), config=cfg,
                         entropy=f32(ent))
  new, old, adv = (np.asarray(x, np.float32).astype(np.float64) for x in (new, old, adv))
  toks = [(i, t) for i in range(4) for t in range(T_MAX) if mask[i, t]]
  counts = dict(high=0, low=0, dual=0)
  sums = dict(approx_kl=0.0, ppo_kl=0.0, ratio=0.0, ent=0.0)
  for i, t in toks:
    log_r = min(20.0, max(-20.0, new[i, t] - old[i, t]))
    r, a = math.exp(log_r), adv[i, t]
    counts["high"] += a > 0 and r > 1.28
    counts["low"] += a < 0 and r < 0.8
    counts["dual"] += a < 0 and r > 3.0
    sums["approx_kl"] += r - 1 - log_r
    sums["ppo_kl"] += -log_r
    sums["ratio"] += r
    sums["ent"] += ent[i, t]
  n = len(toks)
  assert min(counts.values()) >= 1   # the batch reaches every branch
  assert float(m["clip_frac_high"]) == pytest.approx(counts["high"] / n)
  assert float(m["clip_frac_low"]) == pytest.approx(counts["low"] / n)
  assert float(m["dual_clip_frac"]) == pytest.approx(counts["dual"] / n)
  assert float(m["approx_kl"]) == pytest.approx(sums["approx_kl"] / n, rel=1e-5)
  assert float(m["ppo_kl"]) == pytest.approx(sums["ppo_kl"] / n, rel=1e-5, abs=1e-6)
  assert float(m["ratio_mean"]) == pytest.approx(sums["ratio"] / n, rel=1e-5)
  assert float(m["entropy"]) == pytest.approx(sums["ent"] / n, rel=1e-5)


@pytest.mark.parametrize("name", ["token-mean", "seq-mean-token-mean", "kl-k3"])
def test_micro_batches_sum_to_the_oracle(name):
  """Split into micro-batches of 1 and 3 rows with the full batch's normaliser."""
  cfg = CONFIGS[name]
  new, old, adv, mask, ref = batch(per_token_adv=False)
  ref = ref if cfg.kl_coef else None
  norm = LossNormalizer.from_mask(jnp.asarray(mask, jnp.float32))
  total = 0.0
  for rows in (slice(0, 1), slice(1, 4)):
    total += float(losses.ppo_loss(
        jnp.asarray(new[rows], jnp.float32), jnp.asarray(old[rows], jnp.float32),
        jnp.asarray(adv[rows], jnp.float32), jnp.asarray(mask[rows], jnp.float32),
        config=cfg, normalizer=norm,
        ref_logp=None if ref is None else jnp.asarray(ref[rows], jnp.float32))[0])
  r32 = lambda x: None if x is None else np.asarray(x, np.float32).astype(np.float64)
  assert total == pytest.approx(oracle_loss(r32(new), r32(old), r32(adv), mask, cfg, r32(ref)),
                                rel=1e-5, abs=1e-6)


def test_no_gradient_flows_into_old_or_reference_logprobs():
  """old_logp and ref_logp are constants of the loss (the docstring's "no gradient"). A
  caller that computes old_logp from the same parameters inside the differentiated
  function (one on-policy update: old = new) still gets the policy gradient
  -A * d logp / token count; without the stop-gradient the ratio would be exp(0)
  everywhere and the gradient zero."""
  new = jnp.asarray([[-1.0, -2.0, -0.5]])
  adv = jnp.asarray([0.7])
  mask = jnp.ones((1, 3))
  cfg = LossConfig(kl_coef=0.1)
  ref = jnp.asarray([[-1.2, -1.7, -0.4]])
  g_old, g_ref = jax.grad(lambda o, r: losses.ppo_loss(new, o, adv, mask, config=cfg,
                                                       ref_logp=r)[0], argnums=(0, 1))(new, ref)
  assert np.all(np.asarray(g_old) == 0) and np.all(np.asarray(g_ref) == 0)
  on_policy = jax.grad(lambda n: losses.ppo_loss(n, n, adv, mask)[0])(new)
  np.testing.assert_allclose(np.asarray(on_policy), -0.7 / 3 * np.ones((1, 3)), rtol=1e-6)
