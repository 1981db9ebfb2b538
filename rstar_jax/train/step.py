"""The update core that SFT and RL share: train state, micro-batching, one jitted step.

Pure function at the jit boundary: `(TrainState, batch) -> (TrainState, metrics)`,
where TrainState holds plain pytrees (the model's `nnx.Param` state and the optax
state). Micro-batches run under `lax.scan`, each normalised by FULL-batch constants
by the caller's loss, so splitting a batch never changes the loss or the gradient.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from rstar_jax import sharding


class TrainState(NamedTuple):
  step: jax.Array
  params: Any      # nnx.State of nnx.Param
  opt_state: Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepConfig:
  """Attributes:
    micro_batches: gradient-accumulation steps per update (a lax.scan).
    logprob_chunk: positions whose logits exist at once (chunked log-probs).
    compute_entropy: also return the policy's token entropy (RL metrics).
    direct_single_micro_batch: with micro_batches == 1, take the gradient directly:
      no lax.scan and no fp32 zero accumulator (one params-sized fp32 buffer and its
      add fewer). The same bits as the scan with fp32 params; with bf16 params too
      (0 + g is exact in fp32 and bf16 -> fp32 -> bf16 is lossless), but the gradient
      then stays in bf16 until the update instead of passing through an fp32 buffer.
      False (default): the scan even for one micro-batch, as before.
    cast_params_once: cast the floating parameters to the model's compute dtype once
      per step, before the micro-batch scan, and run forward and backward on that copy
      (the layers then cast nothing); the copy's gradient is accumulated in fp32 and
      applied to the master weights. The same casts as each use casting its weight:
      the same loss bit for bit, and the same gradient but for a weight whose
      gradient XLA kept in fp32 past the per-use cast's transpose (on XLA:CPU the MLP's
      gate and up projections, whose hand-written weight-gradient matmul absorbs it);
      from the copy that gradient is a bf16 array, rounded once per micro-batch.
      Nothing changes where the params are already in the compute dtype. False
      (default): each use casts its weight, as before.
    fused_head_loss: the RL step only. Compute the policy loss's gradient with respect
      to the output head's input and weight inside the head's forward pass, a
      `logprob_chunk` of positions at a time (`rstar_jax.model.fused_head`): three
      matmuls of the head's size instead of four (no logits recomputed in the backward)
      and still no [T, vocab] buffer. The same function; sums run in another order, so
      loss and gradients agree with the unfused head within float rounding, not in bits.
      Needs a loss aggregation linear in the per-token losses (every registered one is:
      `rl.losses.LINEAR_AGGREGATIONS`). False (default): the chunked head with its
      recomputing backward, as before.
  """
  micro_batches: int = 1
  logprob_chunk: int = 512
  compute_entropy: bool = True
  direct_single_micro_batch: bool = False
  cast_params_once: bool = False
  fused_head_loss: bool = False

  def __post_init__(self):
    for name in ("micro_batches", "logprob_chunk"):
      if getattr(self, name) <= 0:
        raise ValueError(f"StepConfig.{name} must be >= 1, got {getattr(self, name)!r}")


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


def state_shardings_for(params, tx, mesh, rules=sharding.DEFAULT_RULES) -> TrainState:
  p_shard = sharding.state_shardings(params, mesh, rules)
  o_shard = opt_state_shardings(jax.eval_shape(tx.init, params), p_shard, mesh)
  return TrainState(NamedSharding(mesh, P()), p_shard, o_shard)


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


def split_micro(batch: Mapping[str, jax.Array], n: int) -> dict[str, jax.Array]:
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


def sum_metrics(acc: Mapping[str, jax.Array] | None, new: Mapping[str, jax.Array]
                ) -> dict[str, jax.Array]:
  if acc is None:
    return dict(new)
  return {k: acc[k] + v for k, v in new.items()}


def compute_dtype(graphdef, params):
  """The compute dtype of the model of `graphdef` (`Qwen3Config.dtype`)."""
  return jnp.dtype(nnx.merge(graphdef, params).cfg.dtype)


def accumulate_and_update(tx: optax.GradientTransformation, state: TrainState,
                          micro: dict[str, jax.Array], micro_loss,
                          combine_metrics: Callable = sum_metrics, *,
                          step_cfg: StepConfig | None = None, compute_dtype=None
                          ) -> tuple[TrainState, dict[str, jax.Array]]:
  """Sums loss, gradient and metrics of `micro_loss(params, mb)` over the leading
  micro-batch axis of `micro` (lax.scan: one micro-batch's activations live at a
  time), then applies one optimizer update. `micro_loss` must already be normalised
  by full-batch constants, so the sums are the full-batch values; `combine_metrics`
  merges one micro-batch's metrics into the running total (sum by default).
  `step_cfg` chooses the options of `StepConfig` that act here (None: the defaults);
  `compute_dtype` is the model's, for `cast_params_once`."""
  step_cfg = step_cfg or StepConfig()
  grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
  params = state.params
  if step_cfg.cast_params_once and compute_dtype is not None:
    # One copy per step; autodiff's gradient w.r.t. it is the gradient of the cast's
    # output, which the accumulator below turns to fp32 as the cast's transpose would.
    params = cast_floating(state.params, compute_dtype)
  first_mb = jax.tree.map(lambda x: x[0], micro)
  m_zero = jax.tree.map(jnp.zeros_like,
                        jax.eval_shape(lambda: micro_loss(params, first_mb)[1]))
  if step_cfg.direct_single_micro_batch and jax.tree.leaves(micro)[0].shape[0] == 1:
    # One micro-batch: what the scan below computes, without the scan and the fp32
    # zeros (0 + g and 0 + loss are exact; metrics still merge into the zeros, as a
    # max-reduced metric must).
    (loss, metrics), grads = grad_fn(params, first_mb)
    grads = jax.tree.map(lambda g, p: g.astype(jnp.float32).astype(p.dtype), grads,
                         state.params)
    return _apply(tx, state, grads, combine_metrics(m_zero, metrics), loss)

  def body(carry, mb):
    g_acc, m_acc, l_acc = carry
    (loss, metrics), grads = grad_fn(params, mb)
    g_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), g_acc, grads)
    m_acc = combine_metrics(m_acc, metrics)
    return (g_acc, m_acc, l_acc + loss), None

  # Accumulate in fp32 even with bf16 parameters; cast back for the update.
  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
  (grads, metrics, loss), _ = jax.lax.scan(body, (zeros, m_zero, jnp.zeros(())), micro)
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
  return _apply(tx, state, grads, metrics, loss)


def cast_floating(params, dtype):
  """`params` with every floating leaf in `dtype` (a differentiable cast)."""
  dtype = jnp.dtype(dtype)
  return jax.tree.map(
      lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)


def _apply(tx, state: TrainState, grads, metrics, loss):
  """The optimizer update from the summed gradient; the step's metrics."""
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = dict(metrics, loss=loss, grad_norm=optax.global_norm(grads),
                 update_norm=optax.global_norm(updates))
  return TrainState(state.step + 1, params, opt_state), metrics


def batch_multiple(micro_batches: int, mesh=None) -> int:
  """Rows a batch must be a multiple of: micro-batches x batch shards (data x fsdp)."""
  return micro_batches * (1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"])


def jit_step(fn, mesh=None, rules=sharding.DEFAULT_RULES,
             state_shardings: TrainState | None = None, donate: bool = True):
  """jit `fn(state, batch) -> (state, metrics)`: batch sharded over (data, fsdp),
  activations constrained by the logical rules, new state on `state_shardings`."""
  out = None if state_shardings is None else (state_shardings, None)
  jitted = jax.jit(fn, donate_argnums=(0,) if donate else (), out_shardings=out)

  def run(state: TrainState, batch: dict[str, Any]):
    batch = sharding.place_batch(batch, mesh, rules)
    with sharding.use_mesh_rules(mesh, rules):
      return jitted(sharding.committed(state), batch)

  def lower(state: TrainState, batch: dict[str, Any]):
    """The lowered step for these arguments (`.compile().cost_analysis()`: XLA's FLOPs)."""
    batch = sharding.place_batch(batch, mesh, rules)
    with sharding.use_mesh_rules(mesh, rules):
      return jitted.lower(sharding.committed(state), batch)
  run.lower = lower
  return run


def jit_eval(fn, mesh=None, rules=sharding.DEFAULT_RULES):
  """jit `fn(params, batch)` (no update): the batch placed as in `jit_step`."""
  jitted = jax.jit(fn)

  def run(params, batch: dict[str, Any]):
    batch = sharding.place_batch(batch, mesh, rules)
    with sharding.use_mesh_rules(mesh, rules):
      return jitted(sharding.committed(params), batch)
  return run
