"""Decode attention over the filled part of each KV-cache row: `decode_attention_impl="pallas"`.

A decode step has one query per row. The dense path (`qwen3._attend_one_query`) reads
the first `attend_len` slots of every row: the engine's length bucket is set by its
LONGEST active row, so a short row, an idle row and the unfilled tail of every row
are read (and masked) all the same. Here each row b reads slots [0, lengths[b]) only,
in the split-K ("flash decoding") scheme of JAX's Pallas GPU kernel
`jax.experimental.pallas.ops.gpu.decode_attention`: the slots are cut into
`k_splits` ranges, one program per (row, KV head, range) computes an unnormalised
partial softmax over blocks of `block_k` slots and stops at the row's length, and a
final pass merges the ranges by their running maxima. A range past a row's length
is skipped whole; a row of length 0 reads nothing and gives zeros.

Why a kernel of our own rather than that module's `gqa`: its kernel loads keys as
[slots, head_dim] blocks, while our cache stores k as [B, Nkv, head_dim, slots]
(qwen3's module docstring: slots innermost, for XLA:CPU's decode). Fed to `gqa`, the
keys would be transposed first, a copy of every row's whole k in every layer and
step: the reading this path exists to avoid. The kernel below is that kernel with
keys loaded as [head_dim, block_k] (q @ k directly instead of q @ k.T); values keep
the layout it expects. Tests compare it with `gqa` and with the dense path.

On CPU the kernel runs in Pallas's interpreter (`interpret=True`, chosen by the
backend): correct, and slow (the grid's programs run one after another, through XLA);
it exists there for the tests. On an NVIDIA GPU it lowers through Triton (not yet
compiled on one: the kernel has run in the interpreter only).

One device per engine: compiled for a GPU the kernel is a custom call, which XLA's
partitioner does not split, so over a cache sharded on a mesh (rows over data x fsdp,
KV heads over tensor) it would gather the whole cache to one program. Rows and KV
heads are independent here, so a `shard_map` over those two axes is the way to run
it sharded; until then keep "dense" on a mesh.
"""
from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

_BLOCK_H = 16    # query heads per program, padded: Triton's dot needs >= 16 rows.
_MIN_BLOCK = 16  # Triton's dot needs >= 16 along the reduced and the output axis.


def interpret_by_default() -> bool:
  """True where the kernel cannot be lowered (no GPU): Pallas's interpreter runs it."""
  return jax.default_backend() != "gpu"


def split_sizes(num_slots: int, block_k: int = 128, k_splits: int = 16) -> tuple[int, int]:
  """(k_splits, block_k) for `num_slots` slots: at most `k_splits` equal ranges of a
  multiple of 16 slots each, blocks of at most `block_k` slots that divide a range.
  num_slots must be a multiple of 16 (`ragged_decode_attention` pads otherwise)."""
  if num_slots % _MIN_BLOCK:
    raise ValueError(f"split_sizes: num_slots={num_slots} must be a multiple of {_MIN_BLOCK}")
  splits = 1
  while (splits * 2 <= k_splits and num_slots % (splits * 2) == 0
         and (num_slots // (splits * 2)) % _MIN_BLOCK == 0):
    splits *= 2
  split = num_slots // splits
  block = _MIN_BLOCK
  while block * 2 <= min(block_k, split) and split % (block * 2) == 0:
    block *= 2
  return splits, block


def _kernel(q_ref, k_ref, v_ref, len_ref, o_ref, l_ref, m_ref, *, scale: float,
            block_k: int, num_heads: int):
  """One (row, KV head, slot range) program. q_ref [BLOCK_H, D] (heads past num_heads
  masked), k_ref [D, split] (keys' layout: slots innermost), v_ref [split, D], len_ref
  the row's length. Writes the range's unnormalised output o, its softmax sum l and
  running max m per head."""
  split = v_ref.shape[0]
  j = pl.program_id(2)
  head_mask = (jnp.arange(_BLOCK_H) < num_heads)[:, None]
  start = j * split
  end = jnp.minimum(start + split, len_ref[()])   # this range's slots below the length

  d = q_ref.shape[-1]
  o = jnp.zeros((_BLOCK_H, d), jnp.float32)
  m = jnp.full((_BLOCK_H,), jnp.finfo(jnp.float32).min, jnp.float32)
  l = jnp.zeros((_BLOCK_H,), jnp.float32)

  def compute(o, m, l):
    q = plgpu.load(q_ref.at[pl.ds(0, _BLOCK_H), :], mask=head_mask)
    offsets = jnp.arange(block_k)

    def body(i, carry):
      o_prev, m_prev, l_prev = carry
      k = k_ref[:, pl.ds(i * block_k, block_k)]              # [D, block_k]
      s = plgpu.dot(q, k).astype(jnp.float32) * scale       # [BLOCK_H, block_k]
      valid = (start + i * block_k + offsets < end)[None, :]
      s = jnp.where(valid, s, 0.7 * jnp.finfo(jnp.float32).min)
      m_next = jnp.maximum(m_prev, s.max(axis=-1))
      correction = jnp.exp(m_prev - m_next)
      p = jnp.exp(s - m_next[:, None])
      v = v_ref[pl.ds(i * block_k, block_k), :]              # [block_k, D]
      o_next = correction[:, None] * o_prev + plgpu.dot(p.astype(v.dtype), v).astype(
          jnp.float32)
      return o_next, m_next, correction * l_prev + p.sum(axis=-1)

    # Blocks of this range that hold slots below the length; none past it are read.
    n = jnp.minimum(pl.cdiv(end - start, block_k), split // block_k)
    return lax.fori_loop(0, n, body, (o, m, l))

  o, m, l = lax.cond(start >= end, lambda: (o, m, l), lambda: compute(o, m, l))
  plgpu.store(o_ref.at[pl.ds(0, _BLOCK_H), :], o.astype(o_ref.dtype), mask=head_mask)
  plgpu.store(l_ref.at[pl.ds(0, _BLOCK_H)], l, mask=head_mask[:, 0])
  plgpu.store(m_ref.at[pl.ds(0, _BLOCK_H)], m, mask=head_mask[:, 0])


@functools.partial(jax.jit, static_argnames=("block_k", "k_splits", "interpret"))
def ragged_decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *,
                            block_k: int = 128, k_splits: int = 16,
                            interpret: bool | None = None) -> jax.Array:
  """Grouped-query attention of one query per row over the first lengths[b] slots.

  q [B, Nq, D]; k [B, Nkv, D, S] and v [B, Nkv, S, D] (the KV cache's layout, any
  float dtype: q is cast to it, scores and sums are fp32); lengths [B] int (values
  past S read S slots; 0: the row reads nothing and gets zeros). Returns [B, Nq, D]
  in q's dtype. S not a multiple of 16 is padded (a copy of the cache: give the
  engine a max_len that is one). block_k / k_splits: the kernel's block of slots and
  number of slot ranges (upper bounds; `split_sizes`). interpret: None chooses by
  backend (`interpret_by_default`).
  """
  b, nq, d = q.shape
  _, nkv, dk, s = k.shape
  if v.shape != (b, nkv, s, d) or dk != d or nq % nkv:
    raise ValueError(f"ragged_decode_attention: q {q.shape}, k {k.shape}, v {v.shape}: want "
                     "q [B, Nq, D], k [B, Nkv, D, S], v [B, Nkv, S, D] with Nq a multiple of Nkv")
  if lengths.shape != (b,):
    raise ValueError(f"ragged_decode_attention: lengths has shape {lengths.shape}, want ({b},)")
  if interpret is None:
    interpret = interpret_by_default()
  pad = (-s) % _MIN_BLOCK
  if pad:
    k = jnp.pad(k, ((0, 0), (0, 0), (0, 0), (0, pad)))
    v = jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0)))
    s += pad
  splits, block = split_sizes(s, block_k, k_splits)
  split = s // splits
  g = nq // nkv
  if g > _BLOCK_H:
    raise ValueError(f"ragged_decode_attention: {g} query heads per KV head; at most "
                     f"{_BLOCK_H} are supported")
  qh = q.reshape(b, nkv, g, d).astype(k.dtype)
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, s)
  kernel = functools.partial(_kernel, scale=d ** -0.5, block_k=block, num_heads=g)
  o, l, m = pl.pallas_call(
      kernel,
      grid=(b, nkv, splits),
      in_specs=[
          pl.BlockSpec((None, None, _BLOCK_H, d), lambda r, h, j: (r, h, 0, 0)),
          pl.BlockSpec((None, None, d, split), lambda r, h, j: (r, h, 0, j)),
          pl.BlockSpec((None, None, split, d), lambda r, h, j: (r, h, j, 0)),
          pl.BlockSpec((None,), lambda r, h, j: (r,)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, _BLOCK_H, d), lambda r, h, j: (r, h, j, 0, 0)),
          pl.BlockSpec((None, None, None, _BLOCK_H), lambda r, h, j: (r, h, j, 0)),
          pl.BlockSpec((None, None, None, _BLOCK_H), lambda r, h, j: (r, h, j, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((b, nkv, splits, g, d), jnp.float32),
          jax.ShapeDtypeStruct((b, nkv, splits, g), jnp.float32),
          jax.ShapeDtypeStruct((b, nkv, splits, g), jnp.float32),
      ],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
      name="ragged_decode_attention",
  )(qh, k, v, lengths)
  # Merge the ranges: rescale each to the overall max. A skipped range has l = 0 and m
  # = float32 min, so it adds nothing; a row with no slot at all has l = 0 everywhere
  # and gets 0 (not 0 / 0).
  m_all = m.max(axis=2, keepdims=True)
  w = jnp.exp(m - m_all)
  l_all = (l * w).sum(axis=2)
  out = (o * w[..., None]).sum(axis=2) / jnp.maximum(l_all, jnp.finfo(jnp.float32).tiny)[..., None]
  return out.reshape(b, nq, d).astype(q.dtype)
