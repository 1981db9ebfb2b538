"""Causal attention in query blocks with a hand-written backward (flash attention's
algorithm, unfused): `attention_impl="blockwise"`.

Why, on CPU: the "xla" path saves the [B, N, T, T] probabilities of every layer for
the backward pass (inside the layer scan that is one zero-filled [L, B, N, T, T]
buffer written layer by layer) and spends most of its time in layout copies and
masked selects over those probabilities, not in matmuls. Here
* query block [a, e) attends keys [0, e) only: a training mask (packed segments,
  causal within each) never lets index i see index j > i, so the upper triangle is
  skipped, not computed and masked;
* the forward pass keeps only the output and each row's log-sum-exp; the backward
  recomputes each block's probabilities from them (exp(s - lse)), so no [T, T]
  tensor outlives its block;
* heads are laid out [B, Nkv, group, T, D] once per call, so every matmul is a plain
  batched GEMM over (B, Nkv) without per-einsum transposes.

Only for masks without a KV cache (training, scoring). The mask must be lower
triangular in index (the decoder's training mask always is). A query row with no
visible key (padding) gets the mean of the values of keys [0, e) instead of all
keys: such rows are never read by a real token.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_NEG_INF = -1e30  # as qwen3: finite, so a fully masked row stays finite.


def _blocks(t: int, size: int) -> list[tuple[int, int]]:
  return [(a, min(a + size, t)) for a in range(0, t, size)]


def _by_kv_head(x: jax.Array, num_kv: int) -> jax.Array:
  """[B, T, N, D] -> [B, Nkv, N / Nkv, T, D]."""
  b, t, n, d = x.shape
  return x.reshape(b, t, num_kv, n // num_kv, d).transpose(0, 2, 3, 1, 4)


def _scores(qb, kh, mask, a, e, scale):
  s = jnp.einsum("bkgqd,bksd->bkgqs", qb, kh[:, :, :e],
                 preferred_element_type=jnp.float32) * scale
  return jnp.where(mask[:, None, None, a:e, :e], s, _NEG_INF)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                        block: int) -> jax.Array:
  """q [B, T, Nq, D], k / v [B, T, Nkv, D], mask [B, T, T] bool -> [B, T, Nq, D]."""
  return _forward(q, k, v, mask, block)[0]


def _forward(q, k, v, mask, block):
  b, t, nq, d = q.shape
  if k.shape[1] != t:
    raise ValueError(f"blockwise attention needs as many keys as queries (no cache), got "
                     f"{t} queries and {k.shape[1]} keys")
  scale = d ** -0.5
  qh = _by_kv_head(q, k.shape[2])
  kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Nkv, T, D]
  outs, lses = [], []
  for a, e in _blocks(t, block):
    s = _scores(qh[:, :, :, a:e], kh, mask, a, e, scale)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(v.dtype), vh[:, :, :e],
                   preferred_element_type=jnp.float32) / l
    outs.append(o.astype(q.dtype))
    lses.append((m + jnp.log(l))[..., 0])
  oh = jnp.concatenate(outs, axis=3)
  out = oh.transpose(0, 3, 1, 2, 4).reshape(b, t, nq, d)
  return out, (qh, kh, vh, mask, oh, jnp.concatenate(lses, axis=3))


def _backward(block, residuals, g):
  qh, kh, vh, mask, oh, lse = residuals
  b, nkv, group, t, d = qh.shape
  scale = d ** -0.5
  f32 = jnp.float32
  gh = _by_kv_head(g, nkv)
  # Row-wise sum of dO * O: the softmax backward's correction term, once for all blocks.
  delta = jnp.sum(gh.astype(f32) * oh.astype(f32), axis=-1)
  dk = jnp.zeros(kh.shape, f32)
  dv = jnp.zeros(vh.shape, f32)
  dqs = []
  for a, e in _blocks(t, block):
    qb, gb = qh[:, :, :, a:e], gh[:, :, :, a:e]
    p = jnp.exp(_scores(qb, kh, mask, a, e, scale) - lse[:, :, :, a:e, None])
    dv = dv.at[:, :, :e].add(jnp.einsum("bkgqs,bkgqd->bksd", p, gb, preferred_element_type=f32))
    dp = jnp.einsum("bkgqd,bksd->bkgqs", gb, vh[:, :, :e], preferred_element_type=f32)
    ds = p * (dp - delta[:, :, :, a:e, None]) * scale
    dqs.append(jnp.einsum("bkgqs,bksd->bkgqd", ds, kh[:, :, :e], preferred_element_type=f32))
    dk = dk.at[:, :, :e].add(jnp.einsum("bkgqs,bkgqd->bksd", ds, qb, preferred_element_type=f32))
  dq = jnp.concatenate(dqs, axis=3).transpose(0, 3, 1, 2, 4).reshape(b, t, nkv * group, d)
  return (dq.astype(qh.dtype), dk.transpose(0, 2, 1, 3).astype(kh.dtype),
          dv.transpose(0, 2, 1, 3).astype(vh.dtype), None)


blockwise_attention.defvjp(_forward, _backward)
