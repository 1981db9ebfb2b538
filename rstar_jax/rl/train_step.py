"""The GRPO-RoC policy update: the clip-higher loss on the shared update core.

`rstar_jax.train.step` holds the state, micro-batching and jit; this module adds the
policy's log-probs and the PPO loss (with `StepConfig.fused_head_loss`, the two through
one fused head: `rstar_jax.model.fused_head`). Each micro-batch is normalised by the FULL
batch's token count (`LossNormalizer`), so splitting a batch never changes the loss
or the gradient (a per-micro-batch token mean would change the loss scale with the
micro-batch count).

Batch layout (all [N, T] unless noted; N = micro_batches x micro_batch_size):
  input_ids       tokens fed to the model (prompt + response, right-padded)
  target_ids      input_ids shifted left by one (the token each position predicts)
  attention_mask  1 on real tokens, 0 on padding
  loss_mask       1 where the target is a model-written response token
  old_logp        log-probs of target_ids under the behaviour policy
  sampler_logp    what the sampler reported (equal to old_logp unless recomputed)
  advantages      [N] per sequence
  ref_logp        optional, only when the loss has kl_coef > 0
  prox_logp       optional, only with a decoupled off-policy correction: log-probs under
                  the parameters before this update (the proximal policy)
"""
from __future__ import annotations

import functools

from flax import nnx
import jax
import jax.numpy as jnp
import optax

from rstar_jax import sharding
from rstar_jax.model import fused_head
from rstar_jax.rl import losses
from rstar_jax.train.step import StepConfig, TrainState, jit_eval, jit_step, split_micro
from rstar_jax.train import step as core

BATCH_KEYS = ("input_ids", "target_ids", "attention_mask", "loss_mask", "old_logp",
              "sampler_logp", "advantages")


def _positions(attention_mask):
  return jnp.maximum(jnp.cumsum(attention_mask, axis=-1) - 1, 0).astype(jnp.int32)


def _hidden(graphdef, params, input_ids, attention_mask):
  model = nnx.merge(graphdef, params)
  mask = attention_mask.astype(jnp.int32)
  hidden, _ = model(input_ids, _positions(mask), segment_ids=mask)
  return model, hidden


def sequence_logprobs(graphdef, params, input_ids, target_ids, attention_mask, *, chunk: int,
                      temperature: float = 1.0, return_entropy: bool = False):
  model, hidden = _hidden(graphdef, params, input_ids, attention_mask)
  return model.token_logprobs(hidden, target_ids, chunk=chunk, temperature=temperature,
                              return_entropy=return_entropy)


def fused_head_loss(graphdef, params, mb, loss_cfg: losses.LossConfig,
                    normalizer: losses.LossNormalizer, *, chunk: int, temperature: float = 1.0,
                    return_entropy: bool = False):
  """(loss, log-probs, entropies or None) of micro-batch `mb` through the fused head
  (`StepConfig.fused_head_loss`): the loss is `ppo_loss`'s sum of per-token shares, its
  gradient made in the head's forward pass; the log-probs carry no gradient."""
  model, hidden = _hidden(graphdef, params, mb["input_ids"], mb["attention_mask"])
  inputs = losses.token_loss_inputs(mb["old_logp"], mb["advantages"], mb["loss_mask"],
                                    config=loss_cfg, normalizer=normalizer,
                                    ref_logp=mb.get("ref_logp"),
                                    prox_logp=mb.get("prox_logp"))
  w = model.unembedding().astype(jnp.dtype(model.cfg.dtype))
  loss, lp, ent = fused_head.fused_logprob_loss(
      hidden, w, mb["target_ids"], functools.partial(losses.token_loss, config=loss_cfg),
      inputs, chunk=chunk, temperature=temperature, with_entropy=return_entropy)
  return loss, lp, (ent if return_entropy else None)


def train_step(graphdef, tx: optax.GradientTransformation, loss_cfg: losses.LossConfig,
               step_cfg: StepConfig, temperature: float, state: TrainState,
               batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer update from a full batch (call through `make_train_step`)."""
  norm = losses.LossNormalizer.from_mask(batch["loss_mask"])
  micro = split_micro(batch, step_cfg.micro_batches)

  def micro_loss(params, mb):
    fused = None
    if step_cfg.fused_head_loss:
      fused, lp, ent = fused_head_loss(graphdef, params, mb, loss_cfg, norm,
                                       chunk=step_cfg.logprob_chunk, temperature=temperature,
                                       return_entropy=step_cfg.compute_entropy)
    else:
      out = sequence_logprobs(graphdef, params, mb["input_ids"], mb["target_ids"],
                              mb["attention_mask"], chunk=step_cfg.logprob_chunk,
                              temperature=temperature,
                              return_entropy=step_cfg.compute_entropy)
      lp, ent = out if step_cfg.compute_entropy else (out, None)
    loss, metrics = losses.ppo_loss(lp, mb["old_logp"], mb["advantages"], mb["loss_mask"],
                                    config=loss_cfg, normalizer=norm,
                                    ref_logp=mb.get("ref_logp"), entropy=ent,
                                    prox_logp=mb.get("prox_logp"))
    if fused is not None:
      # The value and metrics as the unfused step's (ppo_loss of the log-probs, which carry
      # no gradient here); the gradient the fused head's. fused - fused is exactly 0.
      loss = loss + (fused - jax.lax.stop_gradient(fused))
    metrics.update(losses.logprob_diff_metrics(lp, mb["sampler_logp"], mb["loss_mask"], norm))
    return loss, metrics

  new_state, metrics = core.accumulate_and_update(
      tx, state, micro, micro_loss, losses.accumulate_metrics, step_cfg=step_cfg,
      compute_dtype=(core.compute_dtype(graphdef, state.params) if step_cfg.cast_params_once
                     else None))
  metrics.update(tokens=norm.num_tokens, sequences=norm.num_seqs)
  return new_state, metrics


def make_train_step(graphdef, tx, loss_cfg: losses.LossConfig, step_cfg: StepConfig,
                    temperature: float = 1.0, mesh: jax.sharding.Mesh | None = None, rules=sharding.DEFAULT_RULES,
                    state_shardings: TrainState | None = None, donate: bool = True):
  """The jitted step. With a mesh: activations follow the logical rules, the batch is
  sharded over (data, fsdp), and the new state keeps `state_shardings`."""
  if step_cfg.fused_head_loss:
    losses.require_token_linear(loss_cfg)
  fn = functools.partial(train_step, graphdef, tx, loss_cfg, step_cfg, temperature)
  return jit_step(fn, mesh, rules, state_shardings, donate)


def make_logprob_fn(graphdef, step_cfg: StepConfig, temperature: float = 1.0, mesh=None,
                    rules=sharding.DEFAULT_RULES):
  """Jitted [N, T] log-probs of target_ids (old / reference log-probs, in micro-batches)."""
  def fn(params, batch):
    micro = split_micro(batch, step_cfg.micro_batches)
    out = jax.lax.map(lambda mb: sequence_logprobs(
        graphdef, params, mb["i"], mb["t"], mb["a"], chunk=step_cfg.logprob_chunk,
        temperature=temperature), micro)
    return out.swapaxes(0, 1).reshape(batch["i"].shape)   # undo the strided split
  jitted = jit_eval(fn, mesh, rules)

  def run(params, input_ids, target_ids, attention_mask):
    return jitted(params, dict(i=input_ids, t=target_ids, a=attention_mask))
  return run
