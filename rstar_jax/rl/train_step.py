"""The GRPO-RoC policy update: one jitted, sharded step with gradient accumulation.

Pure function at the jit boundary: `(TrainState, batch) -> (TrainState, metrics)`,
where TrainState holds plain pytrees (the model's `nnx.Param` state and the optax
state). Micro-batches run under `lax.scan`, each normalised by the FULL batch's
token count (`LossNormalizer`), so splitting a batch never changes the loss or the
gradient (SPEC.md section 8).

Batch layout (all [N, T] unless noted; N = micro_batches x micro_batch_size):
  input_ids       tokens fed to the model (prompt + response, right-padded)
  target_ids      input_ids shifted left by one (the token each position predicts)
  attention_mask  1 on real tokens, 0 on padding
  loss_mask       1 where the target is a model-written response token
  old_logp        log-probs of target_ids under the behaviour policy
  sampler_logp    what the sampler reported (equal to old_logp unless recomputed)
  advantages      [N] per sequence
  ref_logp        optional, only when the loss has kl_coef > 0
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from rstar_jax.model import sharding
from rstar_jax.rl import losses

BATCH_KEYS = ("input_ids", "target_ids", "attention_mask", "loss_mask", "old_logp",
              "sampler_logp", "advantages")


class TrainState(NamedTuple):
  step: jax.Array
  params: Any      # nnx.State of nnx.Param
  opt_state: Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepConfig:
  micro_batches: int = 1
  logprob_chunk: int = 512
  compute_entropy: bool = True
  temperature: float = 1.0   # log-probs are of softmax(logits / T), as the sampler's

  def __post_init__(self):
    if self.micro_batches <= 0 or self.logprob_chunk <= 0 or self.temperature <= 0:
      raise ValueError(f"StepConfig: micro_batches, logprob_chunk, temperature must be > 0 "
                       f"(got {self.micro_batches}, {self.logprob_chunk}, {self.temperature})")


def opt_state_shardings(abstract_opt_state, param_shardings, mesh):
  """Optimizer-state shardings: each moment leaf takes its parameter's sharding.

  optax moments (mu, nu) are trees of the params' structure nested in optax
  containers; a leaf's key path therefore ends with its parameter's key path.
  Scalars (counts) are replicated.
  """
  by_key = {jax.tree_util.keystr(p): s
            for p, s in jax.tree_util.tree_leaves_with_path(param_shardings)}
  replicated = NamedSharding(mesh, P())

  def one(path, x):
    ks = jax.tree_util.keystr(path)
    match = max((k for k in by_key if ks.endswith(k)), key=len, default=None)
    if match is not None:
      return by_key[match]
    return replicated
  return jax.tree_util.tree_map_with_path(one, abstract_opt_state)


def init_train_state(model, tx: optax.GradientTransformation, mesh=None,
                     rules=sharding.DEFAULT_RULES):
  """Splits the model and creates the optimizer state.

  Returns (graphdef, TrainState, shardings), where `shardings` is a TrainState of
  NamedShardings (None without a mesh): params by their logical axes, optimizer
  moments like their params.
  """
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  if jax.tree.leaves(rest):
    raise ValueError("model has non-Param state; the train step expects Params only")
  if mesh is None:
    opt_state = jax.jit(tx.init)(params)
    return graphdef, TrainState(jnp.zeros((), jnp.int32), params, opt_state), None
  shardings = state_shardings_for(params, tx, mesh, rules)
  params = jax.device_put(params, shardings.params)
  opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(params)
  step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
  return graphdef, TrainState(step, params, opt_state), shardings


def state_shardings_for(params, tx, mesh, rules=sharding.DEFAULT_RULES) -> TrainState:
  p_shard = sharding.state_shardings(params, mesh, rules)
  o_shard = opt_state_shardings(jax.eval_shape(tx.init, params), p_shard, mesh)
  return TrainState(NamedSharding(mesh, P()), p_shard, o_shard)


def _positions(attention_mask):
  return jnp.maximum(jnp.cumsum(attention_mask, axis=-1) - 1, 0).astype(jnp.int32)


def sequence_logprobs(graphdef, params, input_ids, target_ids, attention_mask, *, chunk: int,
                      temperature: float = 1.0, return_entropy: bool = False):
  model = nnx.merge(graphdef, params)
  mask = attention_mask.astype(jnp.int32)
  hidden, _ = model(input_ids, _positions(mask), segment_ids=mask)
  return model.token_logprobs(hidden, target_ids, chunk=chunk, temperature=temperature,
                              return_entropy=return_entropy)


def split_micro(batch: dict[str, jax.Array], n: int) -> dict[str, jax.Array]:
  """[N, ...] -> [n, N/n, ...], micro-batch i = rows i, i+n, i+2n, ... (strided).

  Strided, not contiguous: the batch is sharded over (data, fsdp) in contiguous row
  blocks, so every micro-batch then has rows on every shard and nothing moves
  between devices (a contiguous split put each micro-batch on a few shards only).
  """
  def split(x):
    if x.shape[0] % n:
      raise ValueError(f"batch of {x.shape[0]} rows does not split into {n} micro-batches")
    return x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)
  return {k: split(v) for k, v in batch.items()}


def train_step(graphdef, tx: optax.GradientTransformation, loss_cfg: losses.LossConfig,
               step_cfg: StepConfig, state: TrainState, batch: dict[str, jax.Array]
               ) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer update from a full batch (call through `make_train_step`)."""
  norm = losses.LossNormalizer.from_mask(batch["loss_mask"])
  micro = split_micro(batch, step_cfg.micro_batches)

  def micro_loss(params, mb):
    out = sequence_logprobs(graphdef, params, mb["input_ids"], mb["target_ids"],
                            mb["attention_mask"], chunk=step_cfg.logprob_chunk,
                            temperature=step_cfg.temperature,
                            return_entropy=step_cfg.compute_entropy)
    lp, ent = out if step_cfg.compute_entropy else (out, None)
    loss, metrics = losses.ppo_loss(lp, mb["old_logp"], mb["advantages"], mb["loss_mask"],
                                    config=loss_cfg, normalizer=norm,
                                    ref_logp=mb.get("ref_logp"), entropy=ent)
    metrics.update(losses.logprob_diff_metrics(lp, mb["sampler_logp"], mb["loss_mask"], norm))
    return loss, metrics

  new_state, metrics = accumulate_and_update(tx, state, micro, micro_loss)
  metrics.update(tokens=norm.num_tokens, sequences=norm.num_seqs)
  return new_state, metrics


def accumulate_and_update(tx: optax.GradientTransformation, state: TrainState,
                          micro: dict[str, jax.Array], micro_loss
                          ) -> tuple[TrainState, dict[str, jax.Array]]:
  """Sums loss, gradient and metrics of `micro_loss(params, mb)` over the leading
  micro-batch axis of `micro` (lax.scan: one micro-batch's activations live at a
  time), then applies one optimizer update. `micro_loss` must already be normalised
  by full-batch constants, so the sums are the full-batch values."""
  grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

  def body(carry, mb):
    g_acc, m_acc, l_acc = carry
    (loss, metrics), grads = grad_fn(state.params, mb)
    g_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), g_acc, grads)
    m_acc = losses.accumulate_metrics(m_acc, metrics)
    return (g_acc, m_acc, l_acc + loss), None

  # Accumulate in fp32 even with bf16 parameters; cast back for the update.
  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
  first_mb = jax.tree.map(lambda x: x[0], micro)
  m_zero = jax.tree.map(jnp.zeros_like,
                        jax.eval_shape(lambda: micro_loss(state.params, first_mb)[1]))
  (grads, metrics, loss), _ = jax.lax.scan(body, (zeros, m_zero, jnp.zeros(())), micro)
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = dict(metrics, loss=loss, grad_norm=optax.global_norm(grads),
                 update_norm=optax.global_norm(updates))
  return TrainState(state.step + 1, params, opt_state), metrics


def make_train_step(graphdef, tx, loss_cfg: losses.LossConfig, step_cfg: StepConfig,
                    mesh: jax.sharding.Mesh | None = None, rules=sharding.DEFAULT_RULES,
                    state_shardings: TrainState | None = None, donate: bool = True):
  """The jitted step. With a mesh: activations follow the logical rules, the batch is
  sharded over (data, fsdp), and the new state keeps `state_shardings`."""
  fn = functools.partial(train_step, graphdef, tx, loss_cfg, step_cfg)
  return jit_step(fn, mesh, rules, state_shardings, donate)


def jit_step(fn, mesh=None, rules=sharding.DEFAULT_RULES,
             state_shardings: TrainState | None = None, donate: bool = True):
  """jit `fn(state, batch) -> (state, metrics)`: batch sharded over (data, fsdp),
  activations constrained by the logical rules, new state on `state_shardings`."""
  out = None if state_shardings is None else (state_shardings, None)
  jitted = jax.jit(fn, donate_argnums=(0,) if donate else (), out_shardings=out)

  def run(state: TrainState, batch: dict[str, Any]):
    if mesh is not None:
      batch = {k: jax.device_put(v, sharding.batch_sharding(mesh, jnp.ndim(v), rules))
               for k, v in batch.items()}
    with sharding.use_mesh_rules(mesh, rules):
      return jitted(state, batch)
  return run


def make_logprob_fn(graphdef, step_cfg: StepConfig, mesh=None, rules=sharding.DEFAULT_RULES):
  """Jitted [N, T] log-probs of target_ids (old / reference log-probs, in micro-batches)."""
  @jax.jit
  def fn(params, input_ids, target_ids, attention_mask):
    micro = split_micro(dict(i=input_ids, t=target_ids, a=attention_mask),
                         step_cfg.micro_batches)
    out = jax.lax.map(lambda mb: sequence_logprobs(
        graphdef, params, mb["i"], mb["t"], mb["a"], chunk=step_cfg.logprob_chunk,
        temperature=step_cfg.temperature), micro)
    return out.swapaxes(0, 1).reshape(input_ids.shape)   # undo the strided split

  def run(params, input_ids, target_ids, attention_mask):
    args = (input_ids, target_ids, attention_mask)
    if mesh is not None:
      args = tuple(jax.device_put(a, sharding.batch_sharding(mesh, 2, rules)) for a in args)
    with sharding.use_mesh_rules(mesh, rules):
      return fn(params, *args)
  return run
