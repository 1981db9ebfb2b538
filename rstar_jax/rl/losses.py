"""Clip-higher PPO objective of GRPO-RoC (rStar2-Agent report): pure, jit-able jax.numpy.

Per token (to MINIMISE; rho = exp(logp_new - logp_old), A the advantage):
  l = max(-A * rho, -A * clip(rho, 1 - eps_low, 1 + eps_high))
  dual clip (optional, verl's, c > 1): where A < 0, l = min(l, -A * c)
  + kl_coef * KL(new || ref) per token (optional, ablations; off by default)

Micro-batch invariance. A loss is an aggregate over the WHOLE batch; a caller that splits
the batch into micro-batches (gradient accumulation) computes a `LossNormalizer` once from
the full batch's loss mask (`LossNormalizer.from_mask(full_mask)`) and passes it to every
micro-batch call. Every aggregation is then a sum over sequences divided by a full-batch
constant, so the micro-batch losses, their gradients, and every metric not listed in
`MAX_REDUCED_METRICS` SUM exactly to the full-batch values (`accumulate_metrics` does the
sum / max). Without a normaliser the call's own mask is used (the batch is the full batch).

Aggregations (registry `AGGREGATIONS`, picked by `LossConfig.aggregation`):
  token-mean:              sum_{i,t} l_it / (mask tokens in the full batch)      (the report)
  seq-mean-token-mean:     sum_i mean_t l_it / (sequences in the full batch)
  seq-mean-token-sum-norm: sum_{i,t} l_it / (max_response_len * sequences)   (Dr. GRPO)
A "sequence" is a row with at least one mask token, so all-padding rows (added to even out
micro-batches) change nothing. verl's seq-mean-token-sum-norm divides by T only; the extra
1 / sequences here is a constant that keeps the scale comparable with the other modes.

Metrics (token averages over the mask of the full batch):
  pg_loss, kl_loss: the two terms of the loss, in the chosen aggregation;
  clip_frac_high: A > 0 and rho > 1 + eps_high (the clip zeroes the gradient);
  clip_frac_low:  A < 0 and rho < 1 - eps_low;
  dual_clip_frac: A < 0 and rho > c (0 without dual clip);
  approx_kl: KL(old || new) by Schulman's k3 estimator, mean of rho - 1 - log rho (samples
    come from the old policy; unbiased and >= 0); ppo_kl: k1, mean of log(old / new) (what
    verl logs as ppo_kl); ratio_mean: mean rho; entropy: mean of the given per-token entropy.
`logprob_diff_metrics` gives the sampler-vs-trainer log-prob gap (mean abs, max abs).

Per-token form (for a fused head, `rstar_jax.model.fused_head`). Every registered
aggregation is a weighted sum of the per-token values with weights fixed by the mask and the
normaliser (`LINEAR_AGGREGATIONS`), and the per-token loss (clip, dual clip, behaviour
weight, KL) depends on the token's own new log-prob only; so
  loss = sum_{i,t} token_loss(new_logp_it) = sum_{i,t} w_it * (l_it + kl_coef * kl_it)
and d loss / d new_logp_it depends on new_logp_it alone. `token_loss_inputs` builds the
[B, T] arrays (w included) and `token_loss` gives each token's share. An aggregation whose
weights depend on the values (registered without linear=True) has no such form: the fused
head refuses it (`require_token_linear`).

Off-policy corrections (registry `OFF_POLICY`, picked by `LossConfig.off_policy`; what
they are for: bounded-staleness asynchronous rollouts, docs/guides/async_rollouts.md):
  behaviour:  the objective above with old = the behaviour policy (the sampler that
    generated the tokens, or its recomputation: RLConfig.old_logprobs). Under stale
    rollouts the ratio's clip range is then centred on a policy k updates old.
  decoupled:  AReaL's decoupled PPO objective (Fu et al. 2025, "AReaL: A Large-Scale
    Asynchronous Reinforcement Learning System for Language Reasoning", arXiv 2505.24298,
    the staleness-aware "decoupled PPO objective"; in their code
    realhf/impl/model/utils/ppo_functional.py), with prox = the trainer's parameters before
    this update (their "proximal policy") and behav = the sampler:
      rho = exp(logp_new - logp_prox)               clipped as above (trust region
                                                    around prox, not around behav)
      w   = exp(logp_prox - logp_behav)             behaviour importance weight, no grad
      l   = w * max(-A * rho, -A * clip(rho, ...))  (dual clip on the max as above)
    tokens with w > behaviour_weight_cap are dropped from the loss (w := 0; their count
    stays in the denominator), as AReaL's `behav_imp_weight_cap` filters them.
  decoupled-truncated: the same with w := min(w, behaviour_weight_cap) instead of
    dropping (truncated importance sampling, as verl's TIS caps its rollout weights).
  Extra metrics (decoupled modes): behav_weight_mean (token mean of w before the cap),
  behav_weight_max (max over tokens), behav_log_weight_abs (token mean of |log w|: the
  spread), behav_capped_frac (share of tokens with w > cap).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp

from rstar_jax.registry import Registry

__all__ = [
    "LossConfig",
    "LossNormalizer",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "MAX_REDUCED_METRICS",
    "LINEAR_AGGREGATIONS",
    "register_aggregation",
    "get_aggregation",
    "aggregate",
    "require_token_linear",
    "token_weights",
    "token_loss_inputs",
    "token_loss",
    "kl_penalty",
    "OFF_POLICY",
    "ppo_loss",
    "logprob_diff_metrics",
    "accumulate_metrics",
]

Array = jax.Array

# Metrics that combine across micro-batches by max; every other one by sum.
MAX_REDUCED_METRICS = frozenset({"logp_diff_max_abs", "behav_weight_max"})


class LossNormalizer(NamedTuple):
  """Full-batch denominators (a pytree: pass it through jit like any array).

  Attributes:
    num_tokens: loss-mask tokens in the full batch.
    num_seqs: rows of the full batch with at least one loss-mask token.
  """
  num_tokens: Array
  num_seqs: Array

  @classmethod
  def from_mask(cls, mask: Array) -> "LossNormalizer":
    """From the loss mask [B, T] of the FULL batch (all micro-batches)."""
    m = jnp.asarray(mask, jnp.float32)
    if m.ndim != 2:
      raise ValueError(f"loss mask must be [batch, time], got shape {m.shape}")
    return cls(num_tokens=m.sum(), num_seqs=(m.sum(-1) > 0).sum().astype(jnp.float32))

  @classmethod
  def from_masks(cls, masks) -> "LossNormalizer":
    """From the masks of all micro-batches (their time lengths may differ)."""
    parts = [cls.from_mask(m) for m in masks]
    return cls(num_tokens=sum(p.num_tokens for p in parts),
               num_seqs=sum(p.num_seqs for p in parts))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
  """Attributes:
    eps_low, eps_high: the asymmetric ("clip-higher") PPO range, 1 - eps_low .. 1 + eps_high.
    dual_clip_c: None (report) or c > 1, e.g. 3 (release / verl), bound on negative-A tokens.
    aggregation: a registered aggregation (see the module docstring).
    max_response_len: the constant of seq-mean-token-sum-norm; None: the RL trainer sets
      it to the stage's response budget (agent.max_response_tokens). A direct caller of
      `ppo_loss` with that aggregation must set it.
    kl_coef: weight of KL(new || ref); 0 (default: the report uses no KL) means no reference needed.
      The RL trainer's reference is `RLConfig.reference` (by default the stage's
      starting policy), its log-probs computed before each update.
    kl_estimator: Schulman's per-token estimators of KL(new || ref) from samples of the
      policy, with d = logp_ref - logp_new: "k1" = -d (unbiased, high variance, can be
      negative), "k2" = d^2 / 2 (biased, low variance), "k3" = exp(d) - d - 1 (unbiased,
      >= 0, low variance; clamped to [-10, 10] as verl's low_var_kl).
    log_ratio_clamp: |log rho| is clamped here before exp, as verl does, so one wild token
      cannot overflow.
    off_policy: a registered off-policy correction (see the module docstring):
      "behaviour" (the ratio against the sampler's log-probs: today's objective),
      "decoupled" (AReaL's), "decoupled-truncated". The decoupled ones need the
      proximal log-probs (`prox_logp`: the RL trainer computes them, one forward).
    behaviour_weight_cap: > 1, the bound on the decoupled objectives' behaviour
      importance weight (AReaL's behav_imp_weight_cap; 5 in their examples).
  """
  eps_low: float = 0.2
  eps_high: float = 0.28
  dual_clip_c: float | None = None
  aggregation: str = "token-mean"
  max_response_len: int | None = None
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  log_ratio_clamp: float = 20.0
  off_policy: str = "behaviour"
  behaviour_weight_cap: float = 5.0

  def __post_init__(self):
    if not 0 <= self.eps_low < 1:
      raise ValueError(f"LossConfig.eps_low must be in [0, 1), got {self.eps_low}")
    if not (self.eps_high >= 0 and math.isfinite(self.eps_high)):
      raise ValueError(f"LossConfig.eps_high must be finite and >= 0, got {self.eps_high}")
    if self.dual_clip_c is not None and not (self.dual_clip_c > 1 and
                                             math.isfinite(self.dual_clip_c)):
      raise ValueError(f"LossConfig.dual_clip_c must be None or > 1, got {self.dual_clip_c}")
    get_aggregation(self.aggregation)
    # None validated, then refused at the first loss (`_seq_mean_token_sum_norm`) if no
    # one filled it in: `--config.rl.loss.aggregation=seq-mean-token-sum-norm` alone was
    # refused here although the RL trainer supplies the stage's budget.
    if self.max_response_len is not None and not (
        isinstance(self.max_response_len, int) and self.max_response_len > 0):
      raise ValueError("LossConfig.max_response_len must be None or a positive int, got "
                       f"{self.max_response_len!r}")
    if not (self.kl_coef >= 0 and math.isfinite(self.kl_coef)):
      raise ValueError(f"LossConfig.kl_coef must be finite and >= 0, got {self.kl_coef}")
    if self.kl_estimator not in KL_ESTIMATORS:
      raise ValueError(f"LossConfig.kl_estimator: unknown {self.kl_estimator!r}; known: "
                       f"{sorted(KL_ESTIMATORS)}")
    if not self.log_ratio_clamp > 0:
      raise ValueError(f"LossConfig.log_ratio_clamp must be > 0, got {self.log_ratio_clamp}")
    OFF_POLICY.lookup(self.off_policy)
    if not (self.behaviour_weight_cap > 1 and math.isfinite(self.behaviour_weight_cap)):
      raise ValueError("LossConfig.behaviour_weight_cap must be finite and > 1, got "
                       f"{self.behaviour_weight_cap}")

  @property
  def needs_proximal(self) -> bool:
    """Whether the loss takes the proximal policy's log-probs (`prox_logp`)."""
    return self.off_policy != "behaviour"


# --- aggregations -------------------------------------------------------------------------

Aggregation = Callable[[Array, Array, LossNormalizer, LossConfig], Array]
AGGREGATIONS: Registry = Registry("loss aggregation")
get_aggregation = AGGREGATIONS.lookup
# Aggregations that are sum_{i,t} w_it * values_it with w fixed by the mask and the
# normaliser (not by the values): the ones a fused head loss can take (module docstring).
LINEAR_AGGREGATIONS: set[str] = set()


def register_aggregation(name: str, *, linear: bool = False):
  """Registers an aggregation under `name`. linear=True declares it a weighted sum of
  the per-token values whose weights do not depend on the values (what
  `StepConfig.fused_head_loss` needs); a wrong declaration gives wrong gradients there."""
  deco = AGGREGATIONS.register(name)

  def wrap(fn):
    fn = deco(fn)
    if linear:
      LINEAR_AGGREGATIONS.add(name)
    return fn
  return wrap


@register_aggregation("token-mean", linear=True)
def _token_mean(values, mask, norm, config):
  del config
  return (values * mask).sum() / jnp.maximum(norm.num_tokens, 1.0)


@register_aggregation("seq-mean-token-mean", linear=True)
def _seq_mean_token_mean(values, mask, norm, config):
  del config
  per_seq = (values * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0)
  return per_seq.sum() / jnp.maximum(norm.num_seqs, 1.0)


@register_aggregation("seq-mean-token-sum-norm", linear=True)
def _seq_mean_token_sum_norm(values, mask, norm, config):
  if config.max_response_len is None:
    raise ValueError("LossConfig.max_response_len must be set for seq-mean-token-sum-norm "
                     "(the RL trainer sets it to the stage's response budget)")
  return (values * mask).sum() / (config.max_response_len * jnp.maximum(norm.num_seqs, 1.0))


def aggregate(values: Array, mask: Array, normalizer: LossNormalizer,
              config: LossConfig) -> Array:
  """This micro-batch's share of the full-batch aggregate of per-token `values`."""
  return get_aggregation(config.aggregation)(values, mask, normalizer, config)


def require_token_linear(config: LossConfig, what: str = "StepConfig.fused_head_loss") -> None:
  """Raises unless `config`'s aggregation is in `LINEAR_AGGREGATIONS`."""
  if config.aggregation not in LINEAR_AGGREGATIONS:
    raise ValueError(
        f"{what} needs a loss whose gradient per token depends on that token's log-prob "
        f"alone, but LossConfig.aggregation={config.aggregation!r} is not registered as "
        f"linear in the per-token losses (linear: {sorted(LINEAR_AGGREGATIONS)}); use one "
        "of those, register the aggregation with linear=True if its weights do not depend "
        f"on the values, or set {what}=False")


def token_weights(mask: Array, normalizer: LossNormalizer, config: LossConfig) -> Array:
  """[B, T] float32: each token's weight w in the aggregate, sum_{i,t} w_it * values_it
  (the aggregation's gradient with respect to the values; exact for a linear one)."""
  require_token_linear(config)
  m = jnp.asarray(mask, jnp.float32)
  return jax.grad(lambda v: aggregate(v, m, normalizer, config))(jnp.zeros_like(m))


# --- KL to a reference ----------------------------------------------------------------------

def _k1(logp, ref_logp):
  return logp - ref_logp


def _k2(logp, ref_logp):
  return 0.5 * jnp.square(logp - ref_logp)


def _k3(logp, ref_logp):
  d = ref_logp - logp
  return jnp.clip(jnp.exp(d) - d - 1.0, -10.0, 10.0)


KL_ESTIMATORS: dict[str, Callable[[Array, Array], Array]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_penalty(logp: Array, ref_logp: Array, estimator: str = "k3") -> Array:
  """Per-token estimate of KL(pi || ref) from samples of pi (Schulman's k1 / k2 / k3)."""
  try:
    fn = KL_ESTIMATORS[estimator]
  except KeyError:
    raise ValueError(f"unknown KL estimator {estimator!r}; known: "
                     f"{sorted(KL_ESTIMATORS)}") from None
  return fn(logp, ref_logp)


# --- off-policy corrections -----------------------------------------------------------------

# name -> (log w [B, T] float32, cap) -> (the weight multiplied into the per-token loss, the
# tokens the cap acted on); None: no behaviour weight (the ratio is against the sampler).
OFF_POLICY: Registry = Registry("off-policy correction")
OFF_POLICY["behaviour"] = None


@OFF_POLICY.register("decoupled")
def _dropped_beyond_cap(log_w, cap):
  w = jnp.exp(log_w)
  capped = w > cap
  return jnp.where(capped, 0.0, w), capped


@OFF_POLICY.register("decoupled-truncated")
def _truncated_at_cap(log_w, cap):
  w = jnp.exp(log_w)
  return jnp.minimum(w, cap), w > cap


# --- the loss -------------------------------------------------------------------------------

def _check_shape(name: str, x: Array, shape: tuple[int, ...]) -> None:
  if tuple(x.shape) != tuple(shape):
    raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)} "
                     "(like new_logp)")


def _token_mean_metric(values: Array, mask: Array, norm: LossNormalizer) -> Array:
  return (values * mask).sum() / jnp.maximum(norm.num_tokens, 1.0)


class _Inputs(NamedTuple):
  old: Array                    # float32, no gradient: the ratio's denominator (behaviour)
  advantages: Array             # float32 [B, 1] or [B, T]
  mask: Array                   # float32 [B, T]
  ref: Array | None             # float32, no gradient; only with kl_coef > 0
  prox: Array | None            # float32, no gradient; only with a decoupled correction


def _inputs(shape, old_logp, advantages, mask, config, ref_logp, prox_logp) -> _Inputs:
  """The loss's inputs besides the new log-probs, checked against `shape` and in float32."""
  _check_shape("old_logp", old_logp, shape)
  _check_shape("mask", mask, shape)
  advantages = jnp.asarray(advantages, jnp.float32)
  if advantages.ndim == 1:
    _check_shape("advantages", advantages, shape[:1])
    advantages = advantages[:, None]
  else:
    _check_shape("advantages", advantages, shape)
  m = jnp.asarray(mask, jnp.float32)
  old_f = jax.lax.stop_gradient(jnp.asarray(old_logp, jnp.float32))
  prox_f = ref_f = None
  if OFF_POLICY.lookup(config.off_policy) is not None:
    if prox_logp is None:
      raise ValueError(f"prox_logp is required by LossConfig.off_policy={config.off_policy!r}")
    _check_shape("prox_logp", prox_logp, shape)
    prox_f = jax.lax.stop_gradient(jnp.asarray(prox_logp, jnp.float32))
  if config.kl_coef > 0:
    if ref_logp is None:
      raise ValueError("ref_logp is required when LossConfig.kl_coef > 0")
    _check_shape("ref_logp", ref_logp, shape)
    ref_f = jax.lax.stop_gradient(jnp.asarray(ref_logp, jnp.float32))
  return _Inputs(old_f, advantages, m, ref_f, prox_f)


class _Terms(NamedTuple):
  per_token: Array              # the clipped policy-gradient loss (times the behaviour weight)
  kl: Array | None              # the KL estimate per token (kl_coef > 0)
  log_ratio: Array
  ratio: Array
  neg_adv: Array
  dual: Array
  behav: tuple[Array, Array, Array] | None   # (log w, w after the cap, capped)


def _token_terms(new_f: Array, x: _Inputs, config: LossConfig) -> _Terms:
  """The per-token quantities of the loss; each token's from its own log-probs only."""
  old_f = x.old
  advantages = x.advantages
  correction = OFF_POLICY.lookup(config.off_policy)
  behav = None
  if correction is not None:
    # The behaviour weight's log is clamped as the ratio's is: a token the sampler
    # found far less likely than the proximal policy must not overflow before the cap.
    log_w = jnp.clip(x.prox - old_f, -config.log_ratio_clamp, config.log_ratio_clamp)
    weight, capped = correction(log_w, config.behaviour_weight_cap)
    behav = (log_w, weight, capped)
    old_f = x.prox            # the trust region is around the proximal policy
  log_ratio = jnp.clip(new_f - old_f, -config.log_ratio_clamp, config.log_ratio_clamp)
  ratio = jnp.exp(log_ratio)
  lo, hi = 1.0 - config.eps_low, 1.0 + config.eps_high
  pg_unclipped = -advantages * ratio
  pg_clipped = -advantages * jnp.clip(ratio, lo, hi)
  per_token = jnp.maximum(pg_unclipped, pg_clipped)
  neg_adv = advantages < 0
  if config.dual_clip_c is not None:
    per_token = jnp.where(neg_adv, jnp.minimum(per_token, -advantages * config.dual_clip_c),
                          per_token)
    dual = neg_adv & (ratio > config.dual_clip_c)
  else:
    dual = jnp.zeros(new_f.shape, bool)
  if behav is not None:
    per_token = behav[1] * per_token
  kl = None
  if config.kl_coef > 0:
    kl = kl_penalty(new_f, x.ref, config.kl_estimator)
  return _Terms(per_token, kl, log_ratio, ratio, neg_adv, dual, behav)


def ppo_loss(new_logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
             config: LossConfig = LossConfig(), normalizer: LossNormalizer | None = None,
             ref_logp: Array | None = None, entropy: Array | None = None,
             prox_logp: Array | None = None) -> tuple[Array, dict[str, Array]]:
  """Clip-higher PPO loss of a (micro-)batch and its metrics.

  Args:
    new_logp: [B, T] log-probs of the sampled tokens under the policy being trained.
    old_logp: [B, T] log-probs under the policy that sampled (or recomputed), no gradient.
    advantages: [B] per sequence or [B, T] per token.
    mask: [B, T] loss mask (1 on model-written response tokens; 0 on prompt, tool output,
      padding).
    config: see `LossConfig` (static under jit: close over it).
    normalizer: the FULL batch's `LossNormalizer` when this is one micro-batch of it.
    ref_logp: [B, T] reference log-probs, required when `config.kl_coef > 0`.
    entropy: optional [B, T] per-token entropy, only reported.
    prox_logp: [B, T] log-probs under the proximal policy (the parameters before this
      update), required by the decoupled corrections (`config.off_policy`); then
      `old_logp` is the behaviour policy's (the sampler's).

  Returns:
    (loss, metrics): scalars; summed over micro-batches (metrics in `MAX_REDUCED_METRICS`
    by max) they equal the full-batch values.
  """
  new_logp = jnp.asarray(new_logp)
  if new_logp.ndim != 2:
    raise ValueError(f"new_logp must be [batch, time], got shape {new_logp.shape}")
  shape = new_logp.shape
  x = _inputs(shape, old_logp, advantages, mask, config, ref_logp, prox_logp)
  m = x.mask
  if normalizer is None:
    normalizer = LossNormalizer.from_mask(m)

  terms = _token_terms(new_logp.astype(jnp.float32), x, config)
  advantages, ratio, log_ratio = x.advantages, terms.ratio, terms.log_ratio
  lo, hi = 1.0 - config.eps_low, 1.0 + config.eps_high
  pg_loss = aggregate(terms.per_token, m, normalizer, config)
  loss = pg_loss
  metrics = {"pg_loss": pg_loss}
  if terms.kl is not None:
    kl_loss = aggregate(terms.kl, m, normalizer, config)
    loss = loss + config.kl_coef * kl_loss
    metrics["kl_loss"] = kl_loss

  def tm(v):
    return _token_mean_metric(jax.lax.stop_gradient(v).astype(jnp.float32), m, normalizer)

  metrics.update(
      clip_frac_high=tm((advantages > 0) & (ratio > hi)),
      clip_frac_low=tm(terms.neg_adv & (ratio < lo)),
      dual_clip_frac=tm(terms.dual),
      approx_kl=tm(ratio - 1.0 - log_ratio),
      ppo_kl=tm(-log_ratio),
      ratio_mean=tm(ratio),
  )
  if entropy is not None:
    _check_shape("entropy", entropy, shape)
    metrics["entropy"] = tm(jnp.asarray(entropy))
  if terms.behav is not None:
    log_w, _, capped = terms.behav
    metrics.update(
        behav_weight_mean=tm(jnp.exp(log_w)),
        behav_weight_max=jnp.max(jnp.where(m > 0, jnp.exp(log_w), 0.0), initial=0.0),
        behav_log_weight_abs=tm(jnp.abs(log_w)),
        behav_capped_frac=tm(capped),
    )
  return loss, metrics


def token_loss_inputs(old_logp: Array, advantages: Array, mask: Array, *,
                      config: LossConfig, normalizer: LossNormalizer | None = None,
                      ref_logp: Array | None = None, prox_logp: Array | None = None
                      ) -> dict[str, Array]:
  """The [B, T] float32 arrays that, with the new log-probs, give each token's share of
  `ppo_loss`'s loss (`token_loss`): old_logp, advantages (broadcast over time), weight
  (`token_weights`), and ref_logp / prox_logp where the config needs them. Arguments
  as `ppo_loss`'s, checked the same way; refuses an aggregation not in
  `LINEAR_AGGREGATIONS`."""
  require_token_linear(config)
  mask = jnp.asarray(mask)
  if mask.ndim != 2:
    raise ValueError(f"mask must be [batch, time], got shape {mask.shape}")
  x = _inputs(mask.shape, old_logp, advantages, mask, config, ref_logp, prox_logp)
  if normalizer is None:
    normalizer = LossNormalizer.from_mask(x.mask)
  out = {"old_logp": x.old, "advantages": jnp.broadcast_to(x.advantages, mask.shape),
         "weight": token_weights(x.mask, normalizer, config)}
  if x.ref is not None:
    out["ref_logp"] = x.ref
  if x.prox is not None:
    out["prox_logp"] = x.prox
  return out


def token_loss(new_logp: Array, inputs: Mapping[str, Array], config: LossConfig) -> Array:
  """Each token's share of `ppo_loss`'s loss, w * (l + kl_coef * kl), from the new log-probs
  and `token_loss_inputs` (any matching shape: a chunk of positions of them). Elementwise:
  token (i, t)'s value depends on new_logp[i, t] alone, and the shares sum to the loss."""
  x = _Inputs(old=inputs["old_logp"], advantages=inputs["advantages"],
              mask=inputs["weight"], ref=inputs.get("ref_logp"), prox=inputs.get("prox_logp"))
  terms = _token_terms(jnp.asarray(new_logp).astype(jnp.float32), x, config)
  out = terms.per_token
  if terms.kl is not None:
    out = out + config.kl_coef * terms.kl
  return inputs["weight"] * out


def logprob_diff_metrics(trainer_logp: Array, sampler_logp: Array, mask: Array,
                         normalizer: LossNormalizer | None = None) -> dict[str, Array]:
  """Sampler-vs-trainer log-prob gap over the mask (the two disagree through precision and kernels).

  Returns logp_diff_mean_abs (token mean over the full batch, sums over micro-batches) and
  logp_diff_max_abs (combine micro-batches by max).
  """
  trainer_logp = jnp.asarray(trainer_logp, jnp.float32)
  if trainer_logp.ndim != 2:
    raise ValueError(f"trainer_logp must be [batch, time], got shape {trainer_logp.shape}")
  _check_shape("sampler_logp", sampler_logp, trainer_logp.shape)
  _check_shape("mask", mask, trainer_logp.shape)
  m = jnp.asarray(mask, jnp.float32)
  if normalizer is None:
    normalizer = LossNormalizer.from_mask(m)
  diff = jax.lax.stop_gradient(jnp.abs(trainer_logp - jnp.asarray(sampler_logp, jnp.float32)))
  return {
      "logp_diff_mean_abs": _token_mean_metric(diff, m, normalizer),
      "logp_diff_max_abs": jnp.max(jnp.where(m > 0, diff, 0.0), initial=0.0),
  }


def accumulate_metrics(acc: Mapping[str, Array] | None, new: Mapping[str, Array]
                       ) -> dict[str, Array]:
  """Combines one micro-batch's metrics into the running total (sum; max for some keys)."""
  if acc is None:
    return dict(new)
  if set(acc) != set(new):
    raise ValueError(f"metric keys differ between micro-batches: {sorted(acc)} vs "
                     f"{sorted(new)}")
  return {k: (jnp.maximum(acc[k], v) if k in MAX_REDUCED_METRICS else acc[k] + v)
          for k, v in new.items()}
