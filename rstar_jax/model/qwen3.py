"""Qwen3 decoder in Flax NNX, numerically the same function as HF `Qwen3ForCausalLM`.

Layout choices:
* Layer weights are stored stacked, with a leading "layers" axis, and applied with
  `jax.lax.scan` over the split layer state: compile time does not grow with depth,
  and rematerialisation is one `jax.checkpoint` with a policy around the scan body.
* Projection kernels are stored [in, heads, head_dim] / [heads, head_dim, out]
  (HF stores Linear weights [out, in]); `hf_io` converts.
* One attention path serves training (packed segments, padding), prefill and decode:
  with a KV cache, each token's k/v are scattered to cache slot = its position, and
  a query attends to cache slots <= its position. Slots past a sequence's current
  length may hold stale values; they are never attended, so slots need no clearing
  between requests.
* The KV cache is one buffer per layer, v [B, Nkv, S, D] and k [B, Nkv, D, S] (keys
  last), and cached calls (prefill, decode) unroll the layers instead of scanning
  them. Slicing a layer out of a stacked [L, ...] cache in the scan carry copied it
  every step on XLA:CPU, and the sequence-major layout made attention transpose it:
  together 4x the decode step's attention time. With the slots innermost in k, a
  decode step's q.k reduces over rows of k (streaming along the slots) instead of
  within each 128-byte key: 4x faster alone, 0.41 -> 0.25 ms for one layer's
  attention at 64 slots x 208.
* Two attention options for NVIDIA GPUs, tested on CPU against the paths above:
  attention_impl "dot_product_lengths" hands cuDNN the lengths of training rows that
  hold one sequence each, instead of a mask (`dot_product_attention`), and
  decode_attention_impl "pallas" makes a decode step read only the filled slots of
  each cache row (`decode_attention`).
"""
from __future__ import annotations

import functools
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from rstar_jax import sharding
from rstar_jax.model import blockwise_attention
from rstar_jax.model import decode_attention
from rstar_jax.model.model_config import Qwen3Config

Cache = dict[str, tuple[jax.Array, ...]]  # {"k": L x [B, Nkv, D, S], "v": L x [B, Nkv, S, D]}
_NEG_INF = -1e30  # finite, so a fully masked (padding) row gives a uniform softmax, not NaN.


def _param(rngs: nnx.Rngs, shape, axes, cfg: Qwen3Config, init: str = "normal"):
  dtype = jnp.dtype(cfg.param_dtype)
  if init == "ones":
    value = jnp.ones(shape, dtype)
  else:
    value = (cfg.initializer_range * jax.random.normal(rngs.params(), shape, jnp.float32)
             ).astype(dtype)
  return nnx.Param(value, logical_axes=tuple(axes))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  # As HF: normalise in fp32, cast back to the input dtype, then scale.
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return xf.astype(x.dtype) * weight.astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding in HF's rotate-half layout. x [B, T, N, D], positions [B, T]."""
  d = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
  cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :]
  sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :]
  x1, x2 = x[..., : d // 2], x[..., d // 2:]
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


def _attend(q, k, v, mask, cache_layout: bool = False):
  """Grouped-query attention. q [B,T,Nq,D], k/v [B,S,Nkv,D] (with `cache_layout`
  the KV cache's: k [B,Nkv,D,S], v [B,Nkv,S,D]), mask [B,T,S] bool."""
  b, t, nq, d = q.shape
  if cache_layout:
    return _attend_cache_layout(q, k, v, mask)
  nkv = k.shape[2]
  q = q.reshape(b, t, nkv, nq // nkv, d)
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
  scores = scores * (d ** -0.5)
  scores = jnp.where(mask[:, None, None, :, :], scores, _NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
  return out.reshape(b, t, nq, d)


def _attend_cache_layout(q, k, v, mask):
  """`_attend` for several queries per row over the cache's layout (prefill).

  Rows and KV heads are folded into one batch axis, a group's queries into the
  matrix rows: XLA:CPU runs a dot with two batch axes (B, Nkv) on its own slow
  emitter, one with a single batch axis as a library GEMM. One layer at 4 rows x 32
  queries x 512 slots: 1.2 -> 0.64 ms.
  """
  b, t, nq, d = q.shape
  nkv, s = k.shape[1], k.shape[3]
  g = nq // nkv
  qx = q.reshape(b, t, nkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b * nkv, g * t, d)
  scores = jnp.einsum("xqd,xds->xqs", qx, k.reshape(b * nkv, d, s),
                      preferred_element_type=jnp.float32).reshape(b, nkv, g, t, s)
  scores = scores * (d ** -0.5)
  scores = jnp.where(mask[:, None, None, :, :], scores, _NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b * nkv, g * t, s)
  out = jnp.einsum("xqs,xsd->xqd", probs, v.reshape(b * nkv, s, d))
  return out.reshape(b, nkv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, nq, d)


def _attend_one_query(q, k, v, mask):
  """`_attend` for one query per row (a decode step) on the cache's layout (k [B, Nkv,
  D, S], v [B, Nkv, S, D]), as multiply-and-reduce.

  For one query the two einsums are batched matrix-vector products, which XLA:CPU
  ran at a third of the memory bandwidth; this form is one fused pass over k and one
  over v. Accumulates in fp32 whatever the cache dtype.
  """
  b, _, nq, d = q.shape
  nkv = k.shape[1]
  f32 = jnp.float32
  qf = q.reshape(b, nkv, nq // nkv, d, 1).astype(f32)
  scores = (qf * k[:, :, None].astype(f32)).sum(-2) * (d ** -0.5)  # [B, Nkv, G, S]
  scores = jnp.where(mask[:, :, None, :], scores, _NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1)
  out = (probs[..., None] * v[:, :, None].astype(f32)).sum(-2)  # [B, Nkv, G, D]
  return out.reshape(b, 1, nq, d).astype(q.dtype)


def resolve_attention_impl(impl: str, dtype, *, cached: bool = False) -> str:
  """attention_impl "auto": in training (no KV cache), cuDNN's fused kernel
  ("dot_product") where it exists (an NVIDIA GPU in bf16 / fp16), else "chunked" (CPU,
  ROCm, fp32). On one H100 the fused kernel ran a Qwen3-14B layer's training step ~3.4x
  faster than "chunked" at 8192 tokens (derived from two runs, experiments/results/device/
  2026-11-27_h100.json and 2026-11-27_h100_4layers.json); the two compute the same function. Over a KV cache
  (prefill and decode) "auto" is "chunked": the path the device check measured for
  the engine; cuDNN over a cache has not run on a GPU yet. "dot_product_lengths"
  over a cache is "dot_product" (a cache row's filled length is its query's
  position, not a run of segment ids). Any other value is returned as it is."""
  if impl != "auto":
    return "dot_product" if cached and impl == "dot_product_lengths" else impl
  if cached:
    return "chunked"
  return "dot_product" if fused_attention_backend(dtype) == "cudnn" else "chunked"


def cached_attention(q, k, v, mask, impl: str = "xla", chunk: int = 1024):
  """Attention of new tokens over one layer's KV cache, k [B, Nkv, D, S] and v [B, Nkv,
  S, D] (prefill and decode)."""
  impl = resolve_attention_impl(impl, q.dtype, cached=True)
  if impl == "dot_product":
    return attention(q, k.transpose(0, 3, 1, 2), v.swapaxes(1, 2), mask, impl, chunk)
  if q.shape[1] == 1:
    return _attend_one_query(q, k, v, mask)
  # Keys are cache slots, not the queries' own sequence: "blockwise" does not apply.
  return attention(q, k, v, mask, "xla" if impl == "blockwise" else impl, chunk,
                   cache_layout=True)


def fused_attention_backend(dtype) -> str:
  """The `implementation` of `jax.nn.dot_product_attention` for attention_impl
  "dot_product": "cudnn" on an NVIDIA GPU in bf16 / fp16 (cuDNN's flash-attention
  kernel: no [T, S] scores per head in memory), else "xla".

  Named explicitly because `implementation=None` runs XLA's attention everywhere
  (jax 0.10: "defaults to XLA for now"), which materialises the scores of every head:
  at T = 8192 that is what "chunked" exists to avoid. ROCm has no cuDNN: there the
  XLA path runs (use "chunked" or "blockwise" on MI300X)."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return "xla"
  try:
    device = jax.devices()[0]
    cuda = device.platform == "gpu" and "cuda" in str(device.client.platform_version).lower()
  except Exception:  # no backend attribute to tell: the portable path
    return "xla"
  return "cudnn" if cuda else "xla"


def single_sequence_lengths(segment_ids: jax.Array, positions: jax.Array
                            ) -> tuple[jax.Array, jax.Array]:
  """(lengths [B] int32, ok: bool scalar) of training rows [B, T].

  ok: every row is ONE sequence from index 0 (one nonzero segment id) with positions
  0, 1, ... on it, then padding (id 0): the RL batch's rows (rl/batching.py). Then the
  training mask is exactly "causal, keys and queries below the row's length", which
  cuDNN takes as sequence lengths instead of a [B, T, S] mask. A row of padding only
  has length 1, not 0: its one "token" attends itself (its outputs are never read),
  so no kernel meets an empty sequence."""
  t = segment_ids.shape[1]
  idx = jnp.arange(t, dtype=jnp.int32)[None, :]
  filled = segment_ids != 0
  lengths = filled.sum(axis=1, dtype=jnp.int32)
  ok = (jnp.all(filled == (idx < lengths[:, None]))
        & jnp.all(jnp.where(filled, segment_ids == segment_ids[:, :1], True))
        & jnp.all(jnp.where(filled, positions == idx, True)))
  return jnp.maximum(lengths, 1), ok


def dot_product_attention(q, k, v, mask, causal: bool = False,
                          implementation: str | None = None, seq_lengths=None):
  """`jax.nn.dot_product_attention` with our boolean mask [B, T, S].

  causal: the mask is a subset of the index-causal one (training: queries and keys
  are the same positions), so the kernel may skip the upper triangle as well; the
  mask (padding, packed segments) still applies, as a bias inside the fused kernel.
  implementation: None chooses with `fused_attention_backend`.
  seq_lengths: optional (lengths [B], ok) from `single_sequence_lengths`, with
  causal=True: where ok (at run time), the kernel gets the rows' lengths instead of
  the mask, and cuDNN runs its padding-aware causal kernel (no [B, T, S] bias read);
  otherwise (packed rows) the mask, as without. The two agree on every real token;
  padding queries differ (zeros here, the mean of the values there), and no real
  token reads them.
  """
  impl = implementation or fused_attention_backend(q.dtype)
  scale = q.shape[-1] ** -0.5

  def with_mask():
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None, :, :], scale=scale,
                                        is_causal=causal, implementation=impl)
  if seq_lengths is None:
    return with_mask()
  if not causal:
    raise ValueError("dot_product_attention: seq_lengths describe causal training rows; "
                     "call it with causal=True")
  lengths, ok = seq_lengths

  def with_lengths():
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                        query_seq_lengths=lengths,
                                        key_value_seq_lengths=lengths, implementation=impl)
  # Decided per batch at run time: the program serves RL rows and packed SFT rows alike.
  return jax.lax.cond(ok, with_lengths, with_mask)


def attention(q, k, v, mask, impl: str = "xla", chunk: int = 1024, cache_layout: bool = False,
              causal: bool = False, seq_lengths=None):
  """Dispatches to full, query-chunked, blockwise or fused attention (same result).

  "chunked" materialises scores for `chunk` queries at a time and recomputes them
  in the backward pass, so a 12K-token sequence never holds [T, T] scores per head.
  "dot_product" is `jax.nn.dot_product_attention`, asked for cuDNN's fused kernel on
  an NVIDIA GPU in bf16 / fp16 and XLA's otherwise (`fused_attention_backend`; CPU,
  where it is tested against "xla"). "auto" is "dot_product" where cuDNN runs it,
  else "chunked" (`resolve_attention_impl`). "blockwise" (`blockwise_attention`) skips
  the causal upper triangle in query blocks of `chunk` and saves no probabilities for
  the backward pass; it needs a training mask (no cache). causal: see
  `dot_product_attention` (the training path sets it; the cache path does not).
  "dot_product_lengths" is "dot_product" given `seq_lengths` (from
  `single_sequence_lengths`): rows of one sequence plus padding reach the kernel as
  lengths, not as a mask.
  """
  impl = resolve_attention_impl(impl, q.dtype)
  if impl == "blockwise":
    return blockwise_attention.blockwise_attention(q, k, v, mask, chunk)
  if impl in ("dot_product", "dot_product_lengths"):
    return dot_product_attention(q, k, v, mask, causal=causal,
                                 seq_lengths=seq_lengths if impl == "dot_product_lengths" else None)
  t = q.shape[1]
  if impl == "xla" or t <= chunk:
    return _attend(q, k, v, mask, cache_layout)
  pad = (-t) % chunk
  qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
  mp = jnp.pad(mask, ((0, 0), (0, pad), (0, 0)))
  n = qp.shape[1] // chunk
  qc = qp.reshape(q.shape[0], n, chunk, *q.shape[2:]).swapaxes(0, 1)
  mc = mp.reshape(mask.shape[0], n, chunk, mask.shape[2]).swapaxes(0, 1)
  step = jax.checkpoint(lambda qm: _attend(qm[0], k, v, qm[1], cache_layout))
  out = jax.lax.map(step, (qc, mc))  # [n, B, chunk, Nq, D]
  out = out.swapaxes(0, 1).reshape(q.shape[0], n * chunk, *q.shape[2:])
  return out[:, :t]


@jax.custom_vjp
def swiglu_mlp(h, w_gate, w_up, w_down):
  """down(silu(h @ gate) * (h @ up)), with a hand-written backward.

  Autodiff's backward of this block spent more time on CPU transposing the
  [tokens, intermediate] gradients for the weight-gradient matmuls than in the
  matmuls; these einsums let XLA pick layouts without copies (1.5x for the block).
  """
  return _swiglu_fwd(h, w_gate, w_up, w_down)[0]


def _swiglu_fwd(h, w_gate, w_up, w_down):
  g = jnp.einsum("bth,hi->bti", h, w_gate)
  u = jnp.einsum("bth,hi->bti", h, w_up)
  m = sharding.constrain(jax.nn.silu(g) * u, ("batch", "length", "act_mlp"))
  return jnp.einsum("bti,ih->bth", m, w_down), (h, g, u, w_gate, w_up, w_down)


def _swiglu_bwd(residuals, dy):
  h, g, u, w_gate, w_up, w_down = residuals
  dt = g.dtype
  gf, uf = g.astype(jnp.float32), u.astype(jnp.float32)
  sig = jax.nn.sigmoid(gf)
  act = gf * sig
  dm = jnp.einsum("bth,ih->bti", dy, w_down).astype(jnp.float32)
  du = (dm * act).astype(dt)
  dg = (dm * uf * sig * (1 + gf * (1 - sig))).astype(dt)
  dg = sharding.constrain(dg, ("batch", "length", "act_mlp"))
  du = sharding.constrain(du, ("batch", "length", "act_mlp"))
  dh = jnp.einsum("bti,hi->bth", dg, w_gate) + jnp.einsum("bti,hi->bth", du, w_up)
  # Weight gradients contract over tokens; transposing the narrow [tokens, hidden]
  # side explicitly keeps XLA from transposing the 3x wider [tokens, intermediate] one.
  ht = h.reshape(-1, h.shape[-1]).T
  dyt = dy.reshape(-1, dy.shape[-1]).T
  flat = lambda a: a.reshape(-1, a.shape[-1])
  d_gate = sharding.constrain(ht @ flat(dg), ("embed", "mlp"))   # the weights' own sharding
  d_up = sharding.constrain(ht @ flat(du), ("embed", "mlp"))
  d_down = sharding.constrain((dyt @ flat((act * uf).astype(dt))).T, ("mlp", "embed"))
  return (dh.astype(h.dtype), d_gate.astype(w_gate.dtype), d_up.astype(w_up.dtype),
          d_down.astype(w_down.dtype))


swiglu_mlp.defvjp(_swiglu_fwd, _swiglu_bwd)


class DecoderLayer(nnx.Module):
  """One Qwen3 block; built with a leading axis of `num_stacked` layers."""

  def __init__(self, cfg: Qwen3Config, num_stacked: int, *, rngs: nnx.Rngs):
    L, h, i = (num_stacked,), cfg.hidden_size, cfg.intermediate_size
    nq, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    la = ("layers",)
    self.input_layernorm = _param(rngs, L + (h,), la + ("norm",), cfg, "ones")
    self.q_proj = _param(rngs, L + (h, nq, d), la + ("embed", "q_heads", "head_dim"), cfg)
    self.k_proj = _param(rngs, L + (h, nkv, d), la + ("embed", "kv_heads", "head_dim"), cfg)
    self.v_proj = _param(rngs, L + (h, nkv, d), la + ("embed", "kv_heads", "head_dim"), cfg)
    self.o_proj = _param(rngs, L + (nq, d, h), la + ("q_heads", "head_dim", "embed"), cfg)
    self.q_norm = _param(rngs, L + (d,), la + ("norm",), cfg, "ones")
    self.k_norm = _param(rngs, L + (d,), la + ("norm",), cfg, "ones")
    self.post_attention_layernorm = _param(rngs, L + (h,), la + ("norm",), cfg, "ones")
    self.gate_proj = _param(rngs, L + (h, i), la + ("embed", "mlp"), cfg)
    self.up_proj = _param(rngs, L + (h, i), la + ("embed", "mlp"), cfg)
    self.down_proj = _param(rngs, L + (i, h), la + ("mlp", "embed"), cfg)

  def __call__(self, x, positions, mask, cfg: Qwen3Config, kv=None, write_index=None,
               seq_lengths=None):
    """Applies ONE layer (called on a per-layer slice of the stacked state).

    kv: optional (k_cache [B, Nkv, D, S], v_cache [B, Nkv, S, D]) of this layer; k/v of the new
    tokens are written at `write_index` [B, T] and attention runs over the first
    mask.shape[-1] slots of the cache. seq_lengths: training rows' lengths for
    attention_impl "dot_product_lengths" (`single_sequence_lengths`).
    """
    dt = jnp.dtype(cfg.dtype)
    cn = checkpoint_name
    w = lambda p: p[...].astype(dt)
    h = rms_norm(x, self.input_layernorm[...], cfg.rms_norm_eps)
    q = cn(jnp.einsum("bth,hnd->btnd", h, w(self.q_proj)), "query_proj")
    k = cn(jnp.einsum("bth,hnd->btnd", h, w(self.k_proj)), "key_proj")
    v = cn(jnp.einsum("bth,hnd->btnd", h, w(self.v_proj)), "value_proj")
    q = sharding.constrain(q, ("batch", "length", "act_heads", None))
    k = sharding.constrain(k, ("batch", "length", "act_kv_heads", None))
    q = rope(rms_norm(q, self.q_norm[...], cfg.rms_norm_eps), positions, cfg.rope_theta)
    k = rope(rms_norm(k, self.k_norm[...], cfg.rms_norm_eps), positions, cfg.rope_theta)
    new_kv = None
    if kv is None:
      a = attention(q, k, v, mask, cfg.attention_impl, cfg.attention_chunk, causal=True,
                    seq_lengths=seq_lengths)
    else:
      k_cache, v_cache = kv
      b_idx = jnp.arange(x.shape[0])[:, None]
      # In place (the caller donates the cache). mode="drop": padded tokens may carry
      # positions past the cache end.
      k_cache = k_cache.at[b_idx, :, :, write_index].set(k.astype(k_cache.dtype), mode="drop")
      v_cache = v_cache.at[b_idx, :, write_index].set(v.astype(v_cache.dtype), mode="drop")
      new_kv = (k_cache, v_cache)
      # The first mask.shape[-1] slots only (the caller's length bucket: a decode
      # step need not read the unfilled end of every slot).
      n = mask.shape[-1]
      if cfg.decode_attention_impl == "pallas" and q.shape[1] == 1:
        a = _ragged_decode(q, k_cache, v_cache, write_index[:, 0], n)
      else:
        a = cached_attention(q, k_cache[..., :n].astype(dt), v_cache[:, :, :n].astype(dt),
                             mask, cfg.attention_impl, cfg.attention_chunk)
    a = cn(a, "context")   # the attention output, before the output projection
    a = cn(jnp.einsum("btnd,ndh->bth", a, w(self.o_proj)), "out_proj")
    x = x + a
    x = sharding.constrain(x, ("batch", "length", "act_embed"))
    h = rms_norm(x, self.post_attention_layernorm[...], cfg.rms_norm_eps)
    x = x + cn(swiglu_mlp(h, w(self.gate_proj), w(self.up_proj), w(self.down_proj)), "mlp_out")
    x = sharding.constrain(x, ("batch", "length", "act_embed"))
    return x, new_kv


def _ragged_decode(q, k_cache, v_cache, position, n):
  """A decode step's attention with decode_attention_impl="pallas": row b reads its
  filled slots [0, position[b]] only (at most the first n, as the dense path's mask),
  from the whole cache in place: a slice or a dtype cast of the cache would be a copy
  of every row's n slots, the reading this path saves. A position past the cache
  (an idle row) reads nothing and gives zeros; the dense path's garbage there is
  never read either. The kernel needs a multiple of 16 slots: a cache of another
  size is read through its first n slots when n is one (the engine's power-of-two
  buckets: a copy of those n slots of each row, not of the padded whole), else padded
  (a copy of the whole: give such an engine a max_len that is a multiple of 16)."""
  size = k_cache.shape[-1]
  lengths = jnp.where(position < size, jnp.minimum(position + 1, n), 0)
  if size % 16 and n % 16 == 0:
    k_cache, v_cache = k_cache[..., :n], v_cache[:, :, :n]
  return decode_attention.ragged_decode_attention(q[:, 0], k_cache, v_cache, lengths)[:, None]


def _remat_policy(name: str):
  cp = jax.checkpoint_policies
  return {
      "full": None,  # save nothing, recompute the whole block
      "dots": cp.checkpoint_dots,
      "dots_no_batch": cp.dots_with_no_batch_dims_saveable,
      "qkv_proj": cp.save_only_these_names("query_proj", "key_proj", "value_proj",
                                           "out_proj", "mlp_out"),
      # MaxText's save_dot_with_context_except_mlp: the attention half's dots and the
      # attention output are kept, the MLP (the widest activations) is recomputed.
      "save_qkv_attn": cp.save_only_these_names("query_proj", "key_proj", "value_proj",
                                                "context", "out_proj"),
      # MaxText's save_dot_except_mlp: the projections' outputs only; the attention
      # itself and the MLP are recomputed.
      "save_dot_except_mlp": cp.save_only_these_names("query_proj", "key_proj", "value_proj",
                                                      "out_proj"),
  }[name]


class Qwen3(nnx.Module):
  """Qwen3 causal LM. `__call__` returns final hidden states; see `logits`, `token_logprobs`."""

  def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed_tokens = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg)
    self.layers = DecoderLayer(cfg, cfg.num_hidden_layers, rngs=rngs)
    self.norm = _param(rngs, (cfg.hidden_size,), ("norm",), cfg, "ones")
    if not cfg.tie_word_embeddings:
      self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg)

  # --- Forward -------------------------------------------------------------
  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None, cache: Cache | None = None,
               attend_len: int | None = None) -> tuple[jax.Array, Cache | None]:
    """Runs the decoder.

    Without `cache` (training, scoring): `segment_ids` [B, T] (0 = padding, equal
    ids = one packed sequence) and `positions` [B, T] (restart at 0 per segment)
    define a block-diagonal causal mask. With `cache` (prefill / decode): the tokens
    are written into the cache at `positions` and attend to slots <= their position,
    among the first `attend_len` slots when given (static; every position must be
    below it).
    Returns (hidden [B, T, H] after the final norm, updated cache or None).
    """
    cfg = self.cfg
    b, t = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    seq_lengths = None
    if cache is None:
      if segment_ids is None:
        segment_ids = jnp.ones((b, t), jnp.int32)
      same = segment_ids[:, :, None] == segment_ids[:, None, :]
      causal = positions[:, None, :] <= positions[:, :, None]
      idx = jnp.arange(t)
      order = idx[None, :] <= idx[:, None]  # guards packed rows with repeated positions
      mask = same & causal & order[None] & (segment_ids[:, None, :] != 0)
      if cfg.attention_impl == "dot_product_lengths":
        seq_lengths = single_sequence_lengths(segment_ids, positions)
    else:
      size = cache["v"][0].shape[2]
      slots = jnp.arange(size if attend_len is None else min(attend_len, size))
      mask = slots[None, None, :] <= positions[:, :, None]
    table = self.embed_tokens[...].astype(jnp.dtype(cfg.dtype))
    if sharding.logical_size("vocab") > 1:
      # Looked up from vocab shards, the rows land batch-sharded directly: from the
      # parameter's own (vocab x embed) layout on a data x fsdp x tensor mesh, GSPMD
      # fell back to replicating the lookup's output ("involuntary full
      # rematerialization"). Not on an fsdp-only mesh (vocab unsplit), where the
      # lookup's backward would then build a full-table gradient.
      table = sharding.constrain(table, ("head_vocab", None))
    x = table[tokens]
    x = sharding.constrain(x, ("batch", "length", "act_embed"))

    graphdef, layer_state = nnx.split(self.layers)
    new_cache = None
    if cache is not None:
      # Inference: layers unrolled, each with its own cache buffer (module docstring).
      ks, vs = [], []
      for i, kv in enumerate(zip(cache["k"], cache["v"])):
        layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], layer_state))
        x, (k_i, v_i) = layer(x, positions, mask, cfg, kv=kv, write_index=positions)
        ks.append(k_i)
        vs.append(v_i)
      new_cache = {"k": tuple(ks), "v": tuple(vs)}
    else:
      def body(x, state):
        return nnx.merge(graphdef, state)(x, positions, mask, cfg,
                                          seq_lengths=seq_lengths)[0], None

      if cfg.remat_policy != "none":
        body = jax.checkpoint(body, policy=_remat_policy(cfg.remat_policy),
                              prevent_cse=not cfg.scan_layers)
      if cfg.scan_layers:
        x, _ = jax.lax.scan(body, x, layer_state)
      else:
        for i in range(cfg.num_hidden_layers):
          x, _ = body(x, jax.tree.map(lambda a: a[i], layer_state))
    x = rms_norm(x, self.norm[...], cfg.rms_norm_eps)
    return x, new_cache

  # --- Heads ---------------------------------------------------------------
  def unembedding(self) -> jax.Array:
    """[H, V] output projection (the transposed embedding when tied)."""
    if self.cfg.tie_word_embeddings:
      return self.embed_tokens[...].T
    return self.lm_head[...]

  def logits(self, hidden: jax.Array) -> jax.Array:
    w = self.unembedding().astype(jnp.dtype(self.cfg.dtype))
    out = jnp.einsum("bth,hv->btv", hidden, w, preferred_element_type=jnp.float32)
    return sharding.constrain(out, ("batch", "length", "act_vocab"))

  def token_logprobs(self, hidden: jax.Array, targets: jax.Array, *, chunk: int = 512,
                     temperature: float = 1.0, return_entropy: bool = False):
    """log p(targets) per token, chunked over the sequence (see `chunked_logprobs`)."""
    w = self.unembedding().astype(jnp.dtype(self.cfg.dtype))
    return chunked_logprobs(hidden, w, targets, chunk=chunk, temperature=temperature,
                            return_entropy=return_entropy)

  # --- KV cache ------------------------------------------------------------
  def init_cache(self, batch: int, max_len: int, dtype: Any | None = None) -> Cache:
    """Zeros: per layer, k [batch, kv_heads, head_dim, max_len] and v [batch, kv_heads,
    max_len, head_dim] (module docstring)."""
    cfg = self.cfg
    nkv, d = cfg.num_key_value_heads, cfg.head_dim
    dt = jnp.dtype(dtype or cfg.dtype)
    zeros = lambda shape: tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_hidden_layers))
    return {"k": zeros((batch, nkv, d, max_len)), "v": zeros((batch, nkv, max_len, d))}


def cache_rows(cache: Cache, slots: jax.Array, n: int | None = None) -> Cache:
  """The first n positions (default: all) of cache rows `slots` (a copy; slots past
  the batch read zeros): a cache of len(slots) rows to run a call on."""
  n = n or cache["v"][0].shape[2]
  return {"k": tuple(c.at[slots, :, :, :n].get(mode="fill", fill_value=0) for c in cache["k"]),
          "v": tuple(c.at[slots, :, :n].get(mode="fill", fill_value=0) for c in cache["v"])}


def set_cache_rows(cache: Cache, slots: jax.Array, rows: Cache) -> Cache:
  """`cache` with `rows` (from `cache_rows`, n positions each) written back at `slots`
  (slots past the batch are dropped)."""
  n = rows["v"][0].shape[2]
  return {"k": tuple(c.at[slots, :, :, :n].set(r, mode="drop")
                     for c, r in zip(cache["k"], rows["k"])),
          "v": tuple(c.at[slots, :, :n].set(r, mode="drop")
                     for c, r in zip(cache["v"], rows["v"]))}


def chunked_logprobs(hidden: jax.Array, unembed: jax.Array, targets: jax.Array, *,
                     chunk: int = 512, temperature: float = 1.0,
                     return_entropy: bool = False):
  """Per-token log-probs (and entropies) of `targets` without [B, T, V] logits.

  Logits exist for `chunk` positions at a time and are recomputed in the backward
  pass (`_chunk_logprobs`, or jax.checkpoint on a mesh), so peak memory is
  O(B * chunk * V) instead of O(B * T * V): at 12K tokens x 151,936 vocab the full
  fp32 logits alone are 7.3 GB per sequence.
  """
  b, t, h = hidden.shape
  chunk = min(chunk, t)
  pad = (-t) % chunk
  if pad:
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
  n = hidden.shape[1] // chunk
  # logits / temperature == (hidden / temperature) @ unembed: the division stays outside
  # the hand-written backward, and autodiff carries it (skipped at 1.0: no bf16 rounding).
  if not (isinstance(temperature, (int, float)) and temperature == 1.0):
    hidden = hidden / temperature
  hc = hidden.reshape(b, n, chunk, h).swapaxes(0, 1)
  tc = targets.reshape(b, n, chunk).swapaxes(0, 1)
  if sharding.mesh_active():
    # On a mesh, GSPMD partitions autodiff's output-projection gradient with less
    # memory than the hand-written one's (Qwen3-14B plan, fsdp 64: 22.4 vs 29.0 GB
    # per device); without one (CPU, one device) the hand-written backward is faster.
    # Vocab-parallel: the projection is split on the vocabulary over fsdp x tensor,
    # and each chunk's hidden states are gathered instead (a chunk of tokens is far
    # smaller than the [H, V] projection an fsdp mesh would otherwise gather).
    unembed = sharding.constrain(unembed, (None, "head_vocab"))
    one = jax.checkpoint(functools.partial(_autodiff_chunk_logprobs, unembed=unembed,
                                           with_entropy=return_entropy))
  else:
    one = lambda a: _chunk_logprobs(a[0], unembed, a[1], return_entropy)
  lp, ent = jax.lax.map(one, (hc, tc))
  lp = lp.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
  if not return_entropy:
    return lp
  return lp, ent.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]


def _chunk_logits(hx, unembed, axes=("batch", "length", "act_vocab")):
  logits = jnp.einsum("bth,hv->btv", hx, unembed, preferred_element_type=jnp.float32)
  return sharding.constrain(logits, axes)


def _onehot(z, tx):
  return jnp.arange(z.shape[-1])[None, None, :] == tx[..., None]


def _logprob_entropy(z, tx, with_entropy):
  """(log p(tx), entropy or zeros, log-sum-exp) from logits z [B, chunk, V]."""
  lse = jax.nn.logsumexp(z, axis=-1)
  # A masked sum, not take_along_axis, whose backward is a scatter into [B, chunk, V].
  lp = jnp.sum(jnp.where(_onehot(z, tx), z, 0.0), axis=-1) - lse
  if not with_entropy:
    return lp, jnp.zeros_like(lp), lse
  return lp, lse - jnp.sum(jnp.exp(z - lse[..., None]) * z, axis=-1), lse


def _autodiff_chunk_logprobs(args, *, unembed, with_entropy):
  """`_chunk_logprobs` for autodiff (under jax.checkpoint: logits recomputed)."""
  hx, tx = args
  hx = sharding.constrain(hx, ("head_batch", "length", None))
  tx = sharding.constrain(tx, ("head_batch", "length"))
  z = _chunk_logits(hx, unembed, ("head_batch", "length", "head_vocab"))
  lp, ent, _ = _logprob_entropy(z, tx, with_entropy)
  return (sharding.constrain(lp, ("batch", "length")),
          sharding.constrain(ent, ("batch", "length")))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _chunk_logprobs(hx, unembed, tx, with_entropy):
  """(log p(tx), entropy or zeros) of one chunk; the backward recomputes the logits.

  Written by hand rather than as jax.checkpoint around autodiff: the generic
  backward scatters into [B, chunk, V] for the picked logit and transposes it, which
  cost more than the matmuls on CPU. Here dlogits is one fused elementwise pass:
  g_lp * (onehot - p) [- g_ent * p * (z - E_p[z]) with entropies].
  """
  return _chunk_logprobs_fwd(hx, unembed, tx, with_entropy)[0]


def _chunk_logprobs_fwd(hx, unembed, tx, with_entropy):
  lp, ent, lse = _logprob_entropy(_chunk_logits(hx, unembed), tx, with_entropy)
  return (lp, ent), (hx, unembed, tx, lse)


def _chunk_logprobs_bwd(with_entropy, residuals, g):
  hx, unembed, tx, lse = residuals
  g_lp, g_ent = g
  z = _chunk_logits(hx, unembed)
  p = jnp.exp(z - lse[..., None])
  dz = g_lp[..., None] * (_onehot(z, tx) - p)
  if with_entropy:  # without, dz is one pass over z: no [B, chunk, V] buffer besides z and dz
    mean_z = jnp.sum(p * z, axis=-1, keepdims=True)
    dz = dz - g_ent[..., None] * p * (z - mean_z)
  dz = dz.astype(hx.dtype)
  dw = jnp.einsum("bth,btv->hv", hx, dz)
  return (jnp.einsum("btv,hv->bth", dz, unembed).astype(hx.dtype), dw.astype(unembed.dtype),
          None)


_chunk_logprobs.defvjp(_chunk_logprobs_fwd, _chunk_logprobs_bwd)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _forward_logits(graphdef, state, tokens, positions, segment_ids):
  model = nnx.merge(graphdef, state)
  hidden, _ = model(tokens, positions, segment_ids)
  return model.logits(hidden)


def forward_logits(model: Qwen3, tokens, positions=None, segment_ids=None) -> jax.Array:
  """Jitted full-logits forward (tests, small models)."""
  graphdef, state = nnx.split(model)
  b, t = tokens.shape
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  if segment_ids is None:
    segment_ids = jnp.ones((b, t), jnp.int32)
  return _forward_logits(graphdef, state, tokens, positions, segment_ids)


def create_model(cfg: Qwen3Config, seed: int = 0) -> Qwen3:
  """Randomly initialised model. Initialisation runs as ONE jitted function: eagerly,
  every parameter's random op compiled on its own (~10 s for a tiny model on CPU)."""
  graphdef, _ = nnx.split(abstract_model(cfg))

  @jax.jit
  def init(key):
    return nnx.split(Qwen3(cfg, rngs=nnx.Rngs(params=key)))[1]
  return nnx.merge(graphdef, init(jax.random.key(seed)))


def abstract_model(cfg: Qwen3Config) -> Qwen3:
  """The model with ShapeDtypeStruct leaves: shapes and metadata, nothing allocated."""
  return nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(params=0)))
