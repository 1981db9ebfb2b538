"""The GPU attention options against the reference paths, on CPU.

attention_impl="dot_product_lengths": training rows of one sequence plus padding reach
jax.nn.dot_product_attention as sequence lengths (cuDNN's padding-aware kernel on a
GPU; XLA's implementation here), packed rows as the mask. decode_attention_impl=
"pallas": a decode step reads each cache row's filled slots only (the Pallas kernel of
rstar_jax/model/decode_attention.py, in Pallas's interpreter here).
"""
from flax import nnx
import jax
from jax.experimental.pallas.ops.gpu import decode_attention as jax_decode_attention
import jax.numpy as jnp
import numpy as np
import pytest

from rstar_jax.model import decode_attention, qwen3
from rstar_jax.model.model_config import Qwen3Config

CFG = Qwen3Config(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  initializer_range=0.3, rope_theta=10_000.0, attention_impl="xla")


def _tokens(b, t, seed=0, vocab=101):
  return jnp.asarray(np.random.RandomState(seed).randint(0, vocab, size=(b, t)))


def _rl_rows(lengths, t):
  """RL batch rows (rl/batching.py): one sequence from index 0, right padding."""
  mask = (np.arange(t)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)
  positions = np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int32)
  return jnp.asarray(mask), jnp.asarray(positions)


def _packed_rows():
  """SFT packing (sft/packing.py): sequences of 12 and 5 then padding; one of 19."""
  seg = jnp.asarray([[1] * 12 + [2] * 5 + [0] * 2, [1] * 19])
  pos = jnp.asarray([list(range(12)) + list(range(5)) + [0, 0], list(range(19))])
  return seg, pos


# ---- training: sequence lengths instead of a mask ----------------------------------------
def test_single_sequence_lengths_accepts_rl_rows_only():
  seg, pos = _rl_rows([5, 9, 0, 1], 9)
  lengths, ok = qwen3.single_sequence_lengths(seg, pos)
  assert bool(ok)
  # A row of padding only gets length 1: no kernel sees an empty sequence.
  np.testing.assert_array_equal(lengths, [5, 9, 1, 1])
  packed_seg, packed_pos = _packed_rows()
  assert not bool(qwen3.single_sequence_lengths(packed_seg, packed_pos)[1])
  left = jnp.asarray([[0, 0, 1, 1, 1]])   # left padding: not a prefix
  assert not bool(qwen3.single_sequence_lengths(left, jnp.asarray([[0, 0, 0, 1, 2]]))[1])
  shifted = jnp.asarray([[3, 4, 5, 0, 0]])  # positions that do not start at 0
  assert not bool(qwen3.single_sequence_lengths(jnp.asarray([[1, 1, 1, 0, 0]]), shifted)[1])
  other_id = jnp.asarray([[2, 2, 2, 0, 0]])  # one sequence under another id: still one
  assert bool(qwen3.single_sequence_lengths(other_id, jnp.asarray([[0, 1, 2, 0, 0]]))[1])


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
def test_lengths_attention_equals_the_masked_einsum_with_gradients(dtype, atol):
  """The sequence-lengths call against `_attend` with the training mask, on rows of
  lengths 7, 16, 1 and 3 with GQA groups of 3: the outputs at real tokens and the
  gradients of a loss over real tokens (q, k, v). XLA's implementation, the one
  jax.nn.dot_product_attention runs on CPU."""
  b, t, nkv, g, d = 4, 16, 2, 3, 8
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(keys[0], (b, t, nkv * g, d)).astype(dtype)
  k, v = (jax.random.normal(x, (b, t, nkv, d)).astype(dtype) for x in keys[1:3])
  w = jax.random.normal(keys[3], (b, t, nkv * g, d))
  seg, pos = _rl_rows([7, 16, 1, 3], t)
  idx = jnp.arange(t)
  mask = ((seg[:, :, None] == seg[:, None, :]) & (idx[None, :] <= idx[:, None])[None]
          & (seg[:, None, :] != 0))
  lengths, ok = qwen3.single_sequence_lengths(seg, pos)
  assert bool(ok)
  real = np.asarray(seg, bool)

  def loss(fn):
    def f(q, k, v):
      out = fn(q, k, v).astype(jnp.float32)
      return jnp.sum(out * w * seg[:, :, None, None]), out
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))

  (l_ref, o_ref), g_ref = loss(lambda q, k, v: qwen3._attend(q, k, v, mask))(q, k, v)
  (l_got, o_got), g_got = loss(lambda q, k, v: qwen3.dot_product_attention(
      q, k, v, mask, causal=True, implementation="xla", seq_lengths=(lengths, ok)))(q, k, v)
  np.testing.assert_allclose(np.asarray(o_got)[real], np.asarray(o_ref)[real], atol=atol)
  np.testing.assert_allclose(l_got, l_ref, rtol=atol)
  for name, a, c in zip("qkv", g_ref, g_got):
    a, c = np.asarray(a, np.float32), np.asarray(c, np.float32)
    np.testing.assert_allclose(c, a, atol=atol * max(1.0, np.abs(a).max()), err_msg=name)
  # The lengths are what the call obeys: one short changes a real token's output.
  wrong = lengths.at[1].add(-1)
  o_wrong = qwen3.dot_product_attention(q, k, v, mask, causal=True, implementation="xla",
                                        seq_lengths=(wrong, ok))
  assert not np.allclose(np.asarray(o_wrong[1, 15], np.float32),
                         np.asarray(o_ref[1, 15], np.float32), atol=atol)


def _model_loss(cfg, tokens, pos, seg):
  graphdef, state = nnx.split(qwen3.Qwen3(cfg, rngs=nnx.Rngs(params=8)))
  valid = seg != 0

  def fn(state):
    m = nnx.merge(graphdef, state)
    h, _ = m(tokens, pos, seg)
    lp = m.token_logprobs(h[:, :-1], tokens[:, 1:], chunk=5)
    return -(lp * valid[:, 1:]).sum(), m.logits(h)
  return jax.jit(jax.value_and_grad(fn, has_aux=True))(state)


@pytest.mark.parametrize("rows", ["rl", "packed"])
def test_dot_product_lengths_model_matches_xla_in_logits_and_gradients(rows):
  """attention_impl="dot_product_lengths" against "xla": logits at real tokens, loss
  and parameter gradients, on RL rows (lengths 19, 11, an all-padding row: the
  lengths branch) and SFT-packed rows (the mask branch)."""
  if rows == "rl":
    seg, pos = _rl_rows([19, 11, 0], 19)
  else:
    seg, pos = _packed_rows()
  assert bool(qwen3.single_sequence_lengths(seg, pos)[1]) == (rows == "rl")
  tokens = _tokens(seg.shape[0], 19, seed=9)
  (l_ref, logits_ref), g_ref = _model_loss(CFG, tokens, pos, seg)
  (l_got, logits_got), g_got = _model_loss(CFG.replace(attention_impl="dot_product_lengths"),
                                           tokens, pos, seg)
  valid = np.asarray(seg) != 0
  np.testing.assert_allclose(np.asarray(logits_got)[valid], np.asarray(logits_ref)[valid],
                             atol=1e-5)
  np.testing.assert_allclose(l_got, l_ref, rtol=1e-5)
  for (p, a), (_, b) in zip(nnx.to_flat_state(g_ref), nnx.to_flat_state(g_got)):
    np.testing.assert_allclose(b.get_value(), a.get_value(), rtol=1e-5, atol=1e-5,
                               err_msg=str(p))


def test_dot_product_lengths_over_a_cache_is_dot_product():
  assert qwen3.resolve_attention_impl("dot_product_lengths", jnp.bfloat16) == "dot_product_lengths"
  assert qwen3.resolve_attention_impl("dot_product_lengths", jnp.bfloat16,
                                      cached=True) == "dot_product"


# ---- decode: the filled part of each cache row ------------------------------------------
def _dense_decode(q, k, v, lengths):
  """The dense decode step (qwen3._attend_one_query) with slots < length visible."""
  s = k.shape[-1]
  mask = (jnp.arange(s)[None, :] < lengths[:, None])[:, None, :]
  out = qwen3._attend_one_query(q[:, None].astype(jnp.float32), k, v, mask)
  return np.asarray(out[:, 0], np.float32)


def _cache(b, nkv, g, d, s, dtype, seed):
  rs = np.random.RandomState(seed)
  q = jnp.asarray(rs.randn(b, nkv * g, d).astype(np.float32))
  k = jnp.asarray(rs.randn(b, nkv, d, s).astype(np.float32)).astype(dtype)
  v = jnp.asarray(rs.randn(b, nkv, s, d).astype(np.float32)).astype(dtype)
  return q, k, v


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("nkv,g,s", [(2, 3, 64), (1, 5, 37), (2, 1, 256)])
def test_ragged_decode_attention_equals_the_dense_decode(dtype, nkv, g, s):
  """Rows of different lengths (S, one slot, an empty row, one inside the second
  block, ...) over fp32 and bf16 caches, GQA groups of 1, 3 and 5 (Qwen3-14B's
  40 / 8), and a slot count that is no multiple of 16 (padded). Real rows equal the
  dense decode step; the empty row gives zeros. bf16: q is rounded to the cache's
  dtype and probabilities to bf16 before the value product, as on the GPU."""
  lengths = jnp.asarray([s, 1, 0, min(s, 20), s - 3], jnp.int32)
  q, k, v = _cache(5, nkv, g, 16, s, dtype, seed=s + g)
  got = np.asarray(decode_attention.ragged_decode_attention(q, k, v, lengths, block_k=16,
                                                            k_splits=4), np.float32)
  ref = _dense_decode(q, k, v, lengths)
  atol = 1e-5 if dtype == jnp.float32 else 3e-2
  real = np.asarray(lengths) > 0
  np.testing.assert_allclose(got[real], ref[real], atol=atol)
  np.testing.assert_array_equal(got[~real], 0.0)


def test_ragged_decode_attention_equals_jax_pallas_gqa():
  """Against JAX's own Pallas decode kernel (`gqa`, interpreted), which takes keys as
  [B, S, Nkv, D]: the same contract, read from the other layout."""
  b, nkv, g, d, s = 3, 2, 4, 16, 128
  q, k, v = _cache(b, nkv, g, d, s, jnp.float32, seed=3)
  lengths = jnp.asarray([100, 17, 128], jnp.int32)
  got = decode_attention.ragged_decode_attention(q, k, v, lengths, interpret=True)
  ref = jax_decode_attention.gqa(q, k.transpose(0, 3, 1, 2), v.transpose(0, 2, 1, 3),
                                 kv_seq_len=lengths, k_splits=4, block_k=32, interpret=True)
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5)


def test_split_sizes_divide_the_slots():
  for s in (16, 48, 64, 1000 + 8, 4096, 16384):
    splits, block = decode_attention.split_sizes(s)
    split = s // splits
    assert s % splits == 0 and split % 16 == 0 and split % block == 0, (s, splits, block)
    assert 1 <= splits <= 16 and 16 <= block <= 128
  assert decode_attention.split_sizes(4096) == (16, 128)
  with pytest.raises(ValueError, match="num_slots=40 must be a multiple of 16"):
    decode_attention.split_sizes(40)


def test_ragged_decode_attention_names_bad_shapes():
  q, k, v = _cache(2, 2, 3, 16, 32, jnp.float32, seed=0)
  with pytest.raises(ValueError, match="lengths has shape"):
    decode_attention.ragged_decode_attention(q, k, v, jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError, match="want q"):
    decode_attention.ragged_decode_attention(q, k.swapaxes(2, 3), v, jnp.zeros((2,), jnp.int32))


@pytest.mark.parametrize("cache_dtype,size,atol", [(jnp.float32, 32, 1e-5),
                                                   (jnp.bfloat16, 40, 5e-2)])
def test_pallas_decode_steps_match_the_dense_model(cache_dtype, size, atol):
  """decode_attention_impl="pallas" in the model: prefill rows of 4, 7 and 5 tokens,
  then decode steps over a cache of `size` slots read through attend_len 16, with a
  fourth row idle (its position past the cache, as the engine's idle slots): the
  logits of the real rows equal the dense model's, step after step, on an fp32 cache
  of 32 slots (read whole by the kernel) and a bf16 one of 40 (no multiple of 16:
  read through its first 16)."""
  dense = qwen3.create_model(CFG, seed=1)
  fast = qwen3.create_model(CFG.replace(decode_attention_impl="pallas"), seed=1)
  tokens = _tokens(4, 12)
  lengths = np.array([4, 7, 5, 0])
  caches = [m.init_cache(4, size, cache_dtype) for m in (dense, fast)]
  pos = jnp.where(jnp.arange(7)[None] < lengths[:, None], jnp.arange(7)[None], size)
  for i, m in enumerate((dense, fast)):
    _, caches[i] = m(tokens[:, :7], pos, cache=caches[i], attend_len=16)
  cur = lengths.copy()
  for _ in range(4):
    step_pos = jnp.asarray(np.where(np.arange(4) < 3, cur, size))[:, None]
    step_tok = tokens[jnp.arange(4), np.minimum(cur, 11)][:, None]
    out = []
    for i, m in enumerate((dense, fast)):
      hidden, caches[i] = m(step_tok, step_pos, cache=caches[i], attend_len=16)
      out.append(np.asarray(m.logits(hidden))[:, 0])
    assert np.isfinite(out[1]).all()
    np.testing.assert_allclose(out[1][:3], out[0][:3], atol=atol)
    cur += 1
  # The k/v written by later steps come from the other attention's outputs: close, not
  # the same bits.
  for a, b in zip(caches[0]["k"] + caches[0]["v"], caches[1]["k"] + caches[1]["v"]):
    np.testing.assert_allclose(np.asarray(b, np.float32)[:3], np.asarray(a, np.float32)[:3],
                               atol=atol)


def test_pallas_decode_in_the_engine_gives_the_dense_tokens():
  """JaxEngine with decode_attention_impl="pallas": the tokens and log-probs of the
  dense decode (two slots, three requests: a slot is freed and reused)."""
  from rstar_jax.rollout.jax_engine import EngineConfig, GenerationRequest, JaxEngine
  reqs = [GenerationRequest(input_ids=[3 + i, 5, 9, 2], max_new_tokens=10, seed=i,
                            temperature=1.0) for i in range(3)]
  outs = []
  for impl in ("dense", "pallas"):
    model = qwen3.create_model(CFG.replace(decode_attention_impl=impl), seed=12)
    engine = JaxEngine(model, EngineConfig(num_slots=2, max_len=32))
    try:
      outs.append(engine.generate_sync(reqs))
    finally:
      engine.stop()
  for a, b in zip(*outs):
    assert a.output_ids == b.output_ids
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_bad_decode_attention_impl_names_the_field():
  with pytest.raises(ValueError, match=r"decode_attention_impl='flash'; choose from "
                                       r"\('dense', 'pallas'\)"):
    CFG.replace(decode_attention_impl="flash")
