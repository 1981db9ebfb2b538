"""The output head and a per-token loss of its log-probs, differentiated in the forward pass.

`qwen3.chunked_logprobs` runs the [H, V] logits matmul of a chunk of positions in the
forward pass, again in the backward (the logits are recomputed, never held for all
positions), and then the two backward matmuls (hidden and projection gradients): four
matmuls of the head's size. When the loss is a sum of per-token terms, each depending on
its own token's log-prob only (the RL objectives: `rl.losses.token_loss`), the gradient
of a chunk's logits is known as soon as its log-probs are:

  z = hx @ W,  lp = z[target] - logsumexp(z),  g = d loss / d lp   (elementwise)
  dz = g * (onehot(target) - softmax(z)),  dhx = dz @ W^T,  dW += hx^T @ dz

so `fused_logprob_loss` computes dhx and dW chunk by chunk in the forward pass (three
matmuls, no recompute, never a [T, V] buffer) and its backward only scales them by the
incoming cotangent (Levanter's and Liger-Kernel's "fused linear cross-entropy", here with
the RL loss in place of cross-entropy). The residuals are dhx (the size of the hidden
states the unfused head keeps) and dW (the size of the projection gradient the unfused
backward makes anyway).

On a mesh the head is vocab-parallel as `qwen3.chunked_logprobs`' mesh path: the
projection split on the vocabulary over (fsdp, tensor) ("head_vocab"), each chunk's
hidden states gathered, the logits and dz sharded on the vocabulary, and dW accumulated
on the projection's own sharding.
"""
from __future__ import annotations

import functools
from typing import Callable, Mapping

import jax
import jax.numpy as jnp

from rstar_jax import sharding
from rstar_jax.model.qwen3 import _chunk_logits, _logprob_entropy, _onehot

# (lp [B, chunk] float32, inputs: {name: [B, chunk]}) -> per-token loss [B, chunk].
TokenLoss = Callable[[jax.Array, Mapping[str, jax.Array]], jax.Array]


def fused_logprob_loss(hidden: jax.Array, unembed: jax.Array, targets: jax.Array,
                       token_loss: TokenLoss, inputs: Mapping[str, jax.Array], *,
                       chunk: int = 512, temperature: float = 1.0,
                       with_entropy: bool = False):
  """(loss, log-probs, entropies): loss = sum over all positions of
  token_loss(log p(targets), inputs); the log-probs and entropies [B, T] carry no
  gradient (entropies are zeros without `with_entropy`).

  hidden [B, T, H] (the final norm's output), unembed [H, V], targets [B, T] int,
  inputs: [B, T] arrays that `token_loss` reads, chunked with the positions (padding
  positions get zeros, so a token_loss that weights by an input gives them nothing).
  token_loss must be elementwise in the log-probs: position (b, t)'s value depends on
  lp[b, t] alone (and on the inputs); its gradient is taken per chunk. Not jitted: call
  inside jit, where `jax.grad` of `loss` runs the three matmuls in the forward pass.
  """
  b, t, h = hidden.shape
  if targets.shape != (b, t):
    raise ValueError(f"targets has shape {targets.shape}, expected {(b, t)} (hidden's "
                     "[batch, time])")
  for name, x in inputs.items():
    if x.shape != (b, t):
      raise ValueError(f"inputs[{name!r}] has shape {x.shape}, expected {(b, t)} "
                       "(hidden's [batch, time])")
  chunk = min(chunk, t)
  pad = (-t) % chunk
  if pad:
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    inputs = {k: jnp.pad(x, ((0, 0), (0, pad))) for k, x in inputs.items()}
  n = hidden.shape[1] // chunk
  # As chunked_logprobs: the division stays outside the hand-written gradient, autodiff
  # carries it (skipped at 1.0: no bf16 rounding).
  if not (isinstance(temperature, (int, float)) and temperature == 1.0):
    hidden = hidden / temperature
  split = lambda x: x.reshape(b, n, chunk, *x.shape[2:]).swapaxes(0, 1)
  on_mesh = sharding.mesh_active()
  if on_mesh:
    unembed = sharding.constrain(unembed, (None, "head_vocab"))
  loss, lp, ent = _fused(split(hidden), unembed, split(targets),
                         {k: split(x) for k, x in inputs.items()}, token_loss, with_entropy,
                         on_mesh)
  unsplit = lambda x: jax.lax.stop_gradient(x).swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
  return loss, unsplit(lp), unsplit(ent)


def _chunk(hx, unembed, tx, aux, token_loss, with_entropy, on_mesh, with_grad):
  """One chunk: (loss, lp, ent) and with_grad also (dhx, dW of this chunk, fp32)."""
  if on_mesh:
    hx = sharding.constrain(hx, ("head_batch", "length", None))
    tx = sharding.constrain(tx, ("head_batch", "length"))
    aux = {k: sharding.constrain(x, ("head_batch", "length")) for k, x in aux.items()}
    z = _chunk_logits(hx, unembed, ("head_batch", "length", "head_vocab"))
  else:
    z = _chunk_logits(hx, unembed)
  lp, ent, lse = _logprob_entropy(z, tx, with_entropy)
  if not with_grad:
    return token_loss(lp, aux).sum(), lp, ent
  per_token, vjp = jax.vjp(lambda x: token_loss(x, aux), lp)
  (g,) = vjp(jnp.ones_like(per_token))   # elementwise: g[b, t] = d loss_bt / d lp_bt
  # As `qwen3._chunk_logprobs_bwd` with g in place of the incoming cotangent.
  dz = (g[..., None] * (_onehot(z, tx) - jnp.exp(z - lse[..., None]))).astype(hx.dtype)
  if on_mesh:
    dz = sharding.constrain(dz, ("head_batch", "length", "head_vocab"))
  dhx = jnp.einsum("btv,hv->bth", dz, unembed).astype(hx.dtype)
  dw = jnp.einsum("bth,btv->hv", hx, dz, preferred_element_type=jnp.float32)
  if on_mesh:
    dw = sharding.constrain(dw, (None, "head_vocab"))
  return per_token.sum(), lp, ent, dhx, dw


def _lp_axes(on_mesh, lp, ent):
  if on_mesh:
    return (sharding.constrain(lp, ("batch", "length")),
            sharding.constrain(ent, ("batch", "length")))
  return lp, ent


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fused(hc, unembed, tc, ic, token_loss, with_entropy, on_mesh):
  """Chunks [n, B, chunk, ...] -> (summed loss, lp [n, B, chunk], ent); without a
  gradient asked for, the loss and log-probs alone (no dhx, no dW)."""
  def one(xs):
    hx, tx, aux = xs
    loss, lp, ent = _chunk(hx, unembed, tx, aux, token_loss, with_entropy, on_mesh,
                           with_grad=False)
    return (loss, *_lp_axes(on_mesh, lp, ent))
  losses, lp, ent = jax.lax.map(one, (hc, tc, ic))
  return losses.sum(), lp, ent


def _fused_fwd(hc, unembed, tc, ic, token_loss, with_entropy, on_mesh):
  def body(dw_acc, xs):
    hx, tx, aux = xs
    loss, lp, ent, dhx, dw = _chunk(hx, unembed, tx, aux, token_loss, with_entropy,
                                    on_mesh, with_grad=True)
    dw_acc = dw_acc + dw
    if on_mesh:
      dw_acc = sharding.constrain(dw_acc, (None, "head_vocab"))
    return dw_acc, (loss, *_lp_axes(on_mesh, lp, ent), dhx)

  # The projection gradient accumulates over chunks in fp32, whatever the compute dtype
  # (the unfused backward's sum over chunks runs in the projection's dtype).
  dw0 = jnp.zeros(unembed.shape, jnp.float32)
  if on_mesh:
    dw0 = sharding.constrain(dw0, (None, "head_vocab"))
  dw, (losses, lp, ent, dhc) = jax.lax.scan(body, dw0, (hc, tc, ic))
  return (losses.sum(), lp, ent), (dhc, dw.astype(unembed.dtype))


def _fused_bwd(token_loss, with_entropy, on_mesh, residuals, cotangents):
  # The log-probs and entropies leave `fused_logprob_loss` through stop_gradient: their
  # cotangents are zeros, and only the loss's scales the gradients made in the forward.
  del token_loss, with_entropy, on_mesh
  dhc, dw = residuals
  ct = cotangents[0]
  return ((ct * dhc).astype(dhc.dtype), (ct * dw).astype(dw.dtype), None, None)


_fused.defvjp(_fused_fwd, _fused_bwd)
