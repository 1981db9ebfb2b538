"""SFT update: token-mean negative log-likelihood on assistant tokens of packed rows.

Batch ([N, T]): input_ids, target_ids, segment_ids (0 = padding), positions,
loss_mask (1 where target_ids is an assistant token). The mean is over the loss
tokens of the FULL batch, whatever the micro-batching.
"""
from __future__ import annotations

import functools

from flax import nnx
import jax
import jax.numpy as jnp

from rstar_jax import sharding
from rstar_jax.train import step as ts

SFT_KEYS = ("input_ids", "target_ids", "segment_ids", "positions", "loss_mask")


def _nll_sum(graphdef, params, mb, chunk):
  model = nnx.merge(graphdef, params)
  hidden, _ = model(mb["input_ids"], mb["positions"], segment_ids=mb["segment_ids"])
  lp = model.token_logprobs(hidden, mb["target_ids"], chunk=chunk)
  return -(lp * mb["loss_mask"]).sum()


def sft_step(graphdef, tx, step_cfg: ts.StepConfig, state: ts.TrainState, batch):
  num_tokens = jnp.maximum(batch["loss_mask"].sum(), 1.0)
  micro = ts.split_micro(batch, step_cfg.micro_batches)

  def micro_loss(params, mb):
    nll = _nll_sum(graphdef, params, mb, step_cfg.logprob_chunk) / num_tokens
    return nll, {"nll": nll}

  new_state, metrics = ts.accumulate_and_update(
      tx, state, micro, micro_loss, step_cfg=step_cfg,
      compute_dtype=(ts.compute_dtype(graphdef, state.params) if step_cfg.cast_params_once
                     else None))
  return new_state, dict(metrics, tokens=num_tokens)


def make_sft_step(graphdef, tx, step_cfg: ts.StepConfig, mesh=None,
                  rules=sharding.DEFAULT_RULES, state_shardings=None, donate=True):
  fn = functools.partial(sft_step, graphdef, tx, step_cfg)
  return ts.jit_step(fn, mesh, rules, state_shardings, donate)


def make_eval_fn(graphdef, step_cfg: ts.StepConfig, mesh=None, rules=sharding.DEFAULT_RULES):
  """(params, batch) -> (summed NLL, loss tokens): held-out loss without an update."""
  def fn(params, batch):
    micro = ts.split_micro(batch, step_cfg.micro_batches)
    sums = jax.lax.map(lambda mb: _nll_sum(graphdef, params, mb, step_cfg.logprob_chunk),
                       micro)
    return sums.sum(), batch["loss_mask"].sum()
  return ts.jit_eval(fn, mesh, rules)
