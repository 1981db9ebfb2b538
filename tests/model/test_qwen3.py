"""Qwen3 model behaviour: KV cache, chunked log-probs, sharding, remat, bad checkpoints."""
import json
import os

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar_jax import sharding
from rstar_jax.model import hf_io, qwen3
from rstar_jax.model.model_config import Qwen3Config, get_preset

CFG = Qwen3Config(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  initializer_range=0.3, rope_theta=10_000.0)


def _tokens(b, t, seed=0, vocab=101):
  return jnp.asarray(np.random.RandomState(seed).randint(0, vocab, size=(b, t)))


def test_kv_cache_decode_matches_full_forward():
  model = qwen3.create_model(CFG, seed=1)
  tokens = _tokens(3, 12)
  full = np.asarray(qwen3.forward_logits(model, tokens))
  # Different prompt lengths per row, right-padded prefill, then one token at a time:
  # the continuous-batching pattern of the rollout engine.
  lengths = np.array([4, 7, 5])
  cache = model.init_cache(3, 16)
  pos = jnp.where(jnp.arange(7)[None] < lengths[:, None], jnp.arange(7)[None], 15)
  hidden, cache = model(tokens[:, :7], pos, cache=cache)
  logits = np.asarray(model.logits(hidden))
  for r in range(3):
    np.testing.assert_allclose(logits[r, lengths[r] - 1], full[r, lengths[r] - 1], atol=1e-5)
  cur = lengths.copy()
  for _ in range(4):
    step_tok = tokens[jnp.arange(3), cur][:, None]
    hidden, cache = model(step_tok, jnp.asarray(cur)[:, None], cache=cache)
    step = np.asarray(model.logits(hidden))[:, 0]
    np.testing.assert_allclose(step, full[np.arange(3), cur], atol=1e-5)
    cur += 1


def test_chunked_logprobs_equal_log_softmax_of_full_logits():
  model = qwen3.create_model(CFG, seed=2)
  tokens = _tokens(2, 23, seed=3)
  hidden, _ = model(tokens)
  logits = model.logits(hidden)
  targets = jnp.roll(tokens, -1, axis=1)
  ref_lp = jnp.take_along_axis(jax.nn.log_softmax(logits / 0.7), targets[..., None], -1)[..., 0]
  p = jax.nn.softmax(logits / 0.7)
  ref_ent = -jnp.sum(p * jax.nn.log_softmax(logits / 0.7), -1)
  for chunk in (1, 5, 8, 23, 64):  # 5 and 8 do not divide 23: exercises padding
    lp, ent = model.token_logprobs(hidden, targets, chunk=chunk, temperature=0.7,
                                   return_entropy=True)
    np.testing.assert_allclose(lp, ref_lp, atol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, atol=1e-5)


def _loss_fn(graphdef):
  def loss(state, tokens):
    m = nnx.merge(graphdef, state)
    h, _ = m(tokens)
    return -m.token_logprobs(h[:, :-1], tokens[:, 1:], chunk=8).mean()
  return loss


@pytest.mark.parametrize("mesh_shape", [{"fsdp": 4, "tensor": 2}, {"data": 2, "fsdp": 2, "tensor": 2}])
def test_sharded_forward_and_grads_equal_unsharded(mesh_shape):
  assert jax.device_count() == 8, "conftest should fake 8 CPU devices"
  cfg = CFG.replace(hidden_size=64, intermediate_size=96, num_key_value_heads=2)
  model = qwen3.create_model(cfg, seed=4)
  graphdef, state = nnx.split(model)
  tokens = _tokens(4, 16, seed=5)
  loss = _loss_fn(graphdef)
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss))(state, tokens)

  mesh = sharding.make_mesh(mesh_shape)
  shardings = sharding.state_shardings(state, mesh)
  sharded_state = jax.device_put(state, shardings)
  # The weights really are split: fsdp on embed, tensor on heads.
  q = sharded_state["layers"]["q_proj"].get_value()
  assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
  assert q.addressable_shards[0].data.shape == (2, 64 // mesh.shape["fsdp"], 4 // 2, 8)
  tok = jax.device_put(tokens, sharding.batch_sharding(mesh, 2))
  with sharding.use_mesh_rules(mesh):
    fn = jax.jit(jax.value_and_grad(loss), out_shardings=(None, shardings))
    s_loss, s_grads = fn(sharded_state, tok)
  np.testing.assert_allclose(s_loss, ref_loss, rtol=1e-5)
  for (path, a), (_, b) in zip(nnx.to_flat_state(ref_grads), nnx.to_flat_state(s_grads)):
    np.testing.assert_allclose(np.asarray(b.get_value()), np.asarray(a.get_value()),
                               atol=1e-6, rtol=1e-4, err_msg=str(path))


def test_load_hf_onto_mesh_places_shards(tmp_path):
  from tests.model import hf_fixtures
  hf = hf_fixtures.make_hf_model(str(tmp_path), max_shard_size="30KB")
  mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
  model = hf_io.load_hf(str(tmp_path), mesh=mesh)
  up = model.layers.up_proj.get_value()
  assert up.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
  tokens = np.random.RandomState(0).randint(0, 97, size=(4, 9))
  with sharding.use_mesh_rules(mesh):
    ours = np.asarray(qwen3.forward_logits(model, jnp.asarray(tokens)))
  assert np.abs(ours - hf_fixtures.torch_logits(hf, tokens)).max() <= 1e-4


@pytest.mark.parametrize("policy", ["full", "dots", "dots_no_batch", "qkv_proj"])
def test_remat_policies_keep_gradients(policy):
  model = qwen3.create_model(CFG, seed=6)
  graphdef, state = nnx.split(model)
  tokens = _tokens(2, 10, seed=7)
  ref = jax.jit(jax.grad(_loss_fn(graphdef)))(state, tokens)
  rgraph, rstate = nnx.split(qwen3.Qwen3(CFG.replace(remat_policy=policy), rngs=nnx.Rngs(params=6)))
  got = jax.jit(jax.grad(_loss_fn(rgraph)))(rstate, tokens)
  for (p, a), (_, b) in zip(nnx.to_flat_state(ref), nnx.to_flat_state(got)):
    np.testing.assert_allclose(b.get_value(), a.get_value(), atol=1e-6, err_msg=str(p))


@pytest.mark.parametrize("policy", ["save_qkv_attn", "save_dot_except_mlp"])
def test_named_remat_policies_give_the_loss_and_gradients_of_none(policy):
  """The MaxText-like policies that save some named activations (q/k/v, the attention
  output "context", the output projection) and recompute the rest: loss and gradients
  as without remat, in a scanned and an unrolled stack, under blockwise attention
  (the default) and the plain einsum path. Recomputing runs the same ops on the same
  inputs, so they agree to fp32 rounding, not in bits: XLA fuses a recomputed op
  differently (as for "full" and "qkv_proj"). Measured on one host: each gradient
  leaf within 1.3e-6 of its largest magnitude; the bound here is 1e-5."""
  tokens = _tokens(2, 10, seed=7)
  for change in ({}, {"attention_impl": "xla", "scan_layers": False}):
    base = CFG.replace(**change)
    graphdef, state = nnx.split(qwen3.Qwen3(base, rngs=nnx.Rngs(params=6)))
    ref_loss, ref = jax.jit(jax.value_and_grad(_loss_fn(graphdef)))(state, tokens)
    rgraph, rstate = nnx.split(qwen3.Qwen3(base.replace(remat_policy=policy),
                                           rngs=nnx.Rngs(params=6)))
    loss, got = jax.jit(jax.value_and_grad(_loss_fn(rgraph)))(rstate, tokens)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=str(change))
    for (p, a), (_, b) in zip(nnx.to_flat_state(ref), nnx.to_flat_state(got)):
      a, b = np.asarray(a.get_value()), np.asarray(b.get_value())
      np.testing.assert_allclose(b, a, atol=1e-5 * np.abs(a).max(), err_msg=f"{p} {change}")


def test_chunked_attention_and_unscanned_layers_match():
  base = qwen3.Qwen3(CFG.replace(attention_impl="xla"), rngs=nnx.Rngs(params=8))
  tokens = _tokens(2, 19, seed=9)
  seg = jnp.asarray([[1] * 19, [1] * 12 + [2] * 5 + [0] * 2])
  pos = jnp.asarray([list(range(19)), list(range(12)) + list(range(5)) + [0, 0]])
  ref = np.asarray(qwen3.forward_logits(base, tokens, pos, seg))
  for change in ({"attention_impl": "chunked", "attention_chunk": 4}, {"scan_layers": False},
                 {"attention_impl": "dot_product"}, {"attention_impl": "auto", "attention_chunk": 4},
                 {"attention_impl": "blockwise", "attention_chunk": 4}):
    other = qwen3.Qwen3(CFG.replace(**change), rngs=nnx.Rngs(params=8))
    got = np.asarray(qwen3.forward_logits(other, tokens, pos, seg))
    valid = np.asarray(seg) != 0
    np.testing.assert_allclose(got[valid], ref[valid], atol=1e-5, err_msg=str(change))


def test_dot_product_attention_matches_xla_in_gradients_and_cached_decode():
  """attention_impl="dot_product" (jax.nn.dot_product_attention; cuDNN on a GPU, XLA
  here) against our einsum path: the same gradients, and the same tokens and
  log-probs when an engine decodes through the KV cache."""
  from rstar_jax.rollout.jax_engine import EngineConfig, GenerationRequest, JaxEngine
  graphdef, state = nnx.split(qwen3.Qwen3(CFG, rngs=nnx.Rngs(params=12)))
  dgraph, dstate = nnx.split(qwen3.Qwen3(CFG.replace(attention_impl="dot_product"),
                                         rngs=nnx.Rngs(params=12)))
  tokens = _tokens(2, 16, seed=13)
  ref = jax.jit(jax.grad(_loss_fn(graphdef)))(state, tokens)
  got = jax.jit(jax.grad(_loss_fn(dgraph)))(dstate, tokens)
  for (p, a), (_, b) in zip(nnx.to_flat_state(ref), nnx.to_flat_state(got)):
    np.testing.assert_allclose(b.get_value(), a.get_value(), atol=1e-5, err_msg=str(p))
  reqs = [GenerationRequest(input_ids=[3 + i, 5, 9, 2], max_new_tokens=12, seed=i,
                            temperature=1.0) for i in range(3)]
  outs = []
  for g, st in ((graphdef, state), (dgraph, dstate)):
    engine = JaxEngine(nnx.merge(g, st), EngineConfig(num_slots=2, max_len=32))
    try:
      outs.append(engine.generate_sync(reqs))
    finally:
      engine.stop()
  for a, b in zip(*outs):
    assert a.output_ids == b.output_ids
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_fused_attention_asks_for_cudnn_only_on_an_nvidia_gpu_in_half_precision():
  """jax.nn.dot_product_attention(implementation=None) runs XLA everywhere, so the
  model names cuDNN itself where it can run; on this CPU host: XLA, in any dtype."""
  for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    assert qwen3.fused_attention_backend(dtype) == "xla"
  # The training path's is_causal=True on top of a packed (block-diagonal) mask
  # changes nothing: the mask is already index-causal.
  q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (2, 9, 4, 8)) for i in range(3))
  seg = jnp.asarray([[1] * 9, [1] * 4 + [2] * 3 + [0] * 2])
  idx = jnp.arange(9)
  mask = ((seg[:, :, None] == seg[:, None, :]) & (idx[None, :] <= idx[:, None])[None]
          & (seg[:, None, :] != 0))
  a = qwen3.dot_product_attention(q, k, v, mask, causal=True, implementation="xla")
  b = qwen3.dot_product_attention(q, k, v, mask, causal=False, implementation="xla")
  valid = np.asarray(seg) != 0
  np.testing.assert_allclose(np.asarray(a)[valid], np.asarray(b)[valid], atol=1e-6)


def test_auto_attention_is_cudnn_in_training_only_where_cudnn_runs(monkeypatch):
  """"auto" (the 14B configs'): the fused kernel in training where cuDNN runs it,
  "chunked" over a KV cache and wherever cuDNN does not run (this CPU host)."""
  for dtype in (jnp.float32, jnp.bfloat16):
    assert qwen3.resolve_attention_impl("auto", dtype) == "chunked"
    assert qwen3.resolve_attention_impl("auto", dtype, cached=True) == "chunked"
  for impl in ("xla", "chunked", "blockwise", "dot_product"):
    assert qwen3.resolve_attention_impl(impl, jnp.bfloat16) == impl
  monkeypatch.setattr(qwen3, "fused_attention_backend", lambda dtype: "cudnn")
  assert qwen3.resolve_attention_impl("auto", jnp.bfloat16) == "dot_product"
  assert qwen3.resolve_attention_impl("auto", jnp.bfloat16, cached=True) == "chunked"


def test_bf16_compute_stays_close_to_fp32():
  model = qwen3.create_model(CFG, seed=10)
  tokens = _tokens(2, 16, seed=11)
  ref = np.asarray(qwen3.forward_logits(model, tokens))
  bf = qwen3.Qwen3(CFG.replace(dtype="bfloat16", param_dtype="bfloat16"),
                   rngs=nnx.Rngs(params=10))
  got = np.asarray(qwen3.forward_logits(bf, tokens))
  assert got.dtype == np.float32
  assert np.abs(got - ref).max() < 0.1 * np.abs(ref).max()
  assert np.abs(got - ref).max() > 0  # really ran in lower precision


def test_make_mesh_fill_and_errors():
  mesh = sharding.make_mesh({"fsdp": -1, "tensor": 2})
  assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 2}
  with pytest.raises(ValueError, match="multiply to 6 but there are 8 devices"):
    sharding.make_mesh({"fsdp": 3, "tensor": 2})
  with pytest.raises(ValueError, match="unknown axes"):
    sharding.make_mesh({"fsdp": 8, "pipeline": 1})
  with pytest.raises(ValueError, match="at most one axis may be -1"):
    sharding.make_mesh({"fsdp": -1, "tensor": -1})


def test_presets_match_published_numbers():
  p = get_preset("qwen3-14b")
  assert (p.hidden_size, p.num_hidden_layers, p.num_attention_heads, p.num_key_value_heads,
          p.head_dim, p.intermediate_size, p.vocab_size, p.rope_theta,
          p.tie_word_embeddings) == (5120, 40, 40, 8, 128, 17408, 151936, 1e6, False)
  assert get_preset("qwen3-0.6b").tie_word_embeddings
  assert 14.0e9 < p.num_params < 15.0e9  # Qwen3-14B: 14.8B parameters
  assert 0.55e9 < get_preset("qwen3-0.6b").num_params < 0.65e9
  with pytest.raises(ValueError, match="Unknown model preset"):
    get_preset("qwen3-15b")


# ---- Bad checkpoints ------------------------------------------------------------
def _saved(tmp_path, **kw):
  model = qwen3.create_model(CFG.replace(**kw))
  hf_io.save_hf(model, str(tmp_path), dtype="float32")
  return str(tmp_path)


def test_config_missing_field_is_named(tmp_path):
  d = _saved(tmp_path)
  cfg = json.load(open(os.path.join(d, "config.json")))
  del cfg["hidden_size"]
  json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
  with pytest.raises(hf_io.CheckpointError, match=r"missing required field\(s\) \['hidden_size'\]"):
    hf_io.load_hf(d)


def test_missing_and_misshaped_tensors_are_named(tmp_path):
  from safetensors.numpy import load_file, save_file
  d = _saved(tmp_path)
  path = os.path.join(d, "model.safetensors")
  tensors = load_file(path)
  del tensors["model.layers.1.mlp.up_proj.weight"]
  tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((3, 32), np.float32)
  save_file(tensors, path)
  with pytest.raises(hf_io.CheckpointError) as e:
    hf_io.load_hf(d)
  msg = str(e.value)
  assert "missing tensor model.layers.1.mlp.up_proj.weight" in msg
  assert "model.layers.0.self_attn.k_proj.weight has shape [3, 32], expected [16, 32]" in msg


def test_unsupported_configs_are_rejected(tmp_path):
  d = _saved(tmp_path)
  cfg = json.load(open(os.path.join(d, "config.json")))
  for bad, match in (({"model_type": "llama"}, "expected 'qwen3'"),
                     ({"attention_bias": True}, "attention_bias"),
                     ({"num_key_value_heads": 3}, "multiple of num_key_value_heads")):
    json.dump({**cfg, **bad}, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(hf_io.CheckpointError, match=match):
      hf_io.load_config(d)


def _packed_batch():
  """Two rows: one sequence of 19; sequences of 12 and 5, then 2 padding tokens."""
  tokens = _tokens(2, 19, seed=9)
  seg = jnp.asarray([[1] * 19, [1] * 12 + [2] * 5 + [0] * 2])
  pos = jnp.asarray([list(range(19)), list(range(12)) + list(range(5)) + [0, 0]])
  return tokens, pos, seg


@pytest.mark.parametrize("chunk", [1, 4, 7, 19, 1024])
def test_blockwise_attention_matches_xla_in_logits_and_gradients(chunk):
  """attention_impl="blockwise" (causal query blocks, hand-written backward) against
  the einsum path on packed and padded rows: the same logits at real tokens and the
  same parameter gradients of a loss over real tokens. Chunks 4 and 7 do not divide
  19 (a short last block); 1024 is one block."""
  tokens, pos, seg = _packed_batch()
  valid = seg != 0
  models = {impl: nnx.split(qwen3.Qwen3(CFG.replace(attention_impl=impl, attention_chunk=chunk),
                                        rngs=nnx.Rngs(params=8)))
            for impl in ("xla", "blockwise")}

  def loss(graphdef):
    def fn(state):
      m = nnx.merge(graphdef, state)
      h, _ = m(tokens, pos, seg)
      lp = m.token_logprobs(h[:, :-1], tokens[:, 1:], chunk=5)
      return -(lp * valid[:, 1:]).sum(), m.logits(h)
    return jax.jit(jax.value_and_grad(fn, has_aux=True))

  (l_ref, logits_ref), g_ref = loss(models["xla"][0])(models["xla"][1])
  (l_got, logits_got), g_got = loss(models["blockwise"][0])(models["blockwise"][1])
  np.testing.assert_allclose(np.asarray(logits_got)[np.asarray(valid)],
                             np.asarray(logits_ref)[np.asarray(valid)], atol=1e-5)
  np.testing.assert_allclose(l_got, l_ref, rtol=1e-6)
  for (p, a), (_, b) in zip(nnx.to_flat_state(g_ref), nnx.to_flat_state(g_got)):
    np.testing.assert_allclose(b.get_value(), a.get_value(), rtol=1e-5, atol=1e-5,
                               err_msg=str(p))


def test_cached_attention_matches_the_einsum_path():
  """Attention over the cache's layout (k [B, Nkv, D, S], v [B, Nkv, S, D]) - the
  decode step's multiply-and-reduce (one query) and the prefill's einsums (several) -
  against `_attend` on the sequence-major layout (GQA groups of 3, rows that see
  1..S slots), in fp32 and with a bf16 cache."""
  rs = np.random.RandomState(4)
  b, s, nkv, g, d = 5, 37, 2, 3, 16
  k, v = (jnp.asarray(rs.randn(b, s, nkv, d).astype(np.float32)) for _ in range(2))
  for t in (1, 4):
    q = jnp.asarray(rs.randn(b, t, nkv * g, d).astype(np.float32))
    pos = jnp.asarray([0, 5, 17, 36 - t + 1, 20])[:, None] + jnp.arange(t)
    mask = jnp.arange(s)[None, None, :] <= pos[:, :, None]
    ref = qwen3._attend(q, k, v, mask)
    got = qwen3.cached_attention(q, k.transpose(0, 2, 3, 1), v.swapaxes(1, 2), mask)
    np.testing.assert_allclose(got, ref, atol=1e-6, err_msg=f"t={t}")
  q = q[:, :1]
  mask = mask[:, :1]
  kb, vb = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
  got = qwen3.cached_attention(q, kb.transpose(0, 2, 3, 1), vb.swapaxes(1, 2), mask)
  ref_b = qwen3._attend(q, kb.astype(jnp.float32), vb.astype(jnp.float32), mask)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, ref_b, atol=1e-5)  # accumulates in fp32


def test_blockwise_attention_refuses_a_kv_cache_shape():
  q = jnp.zeros((1, 2, 4, 8))
  kv = jnp.zeros((1, 6, 2, 8))
  with pytest.raises(ValueError, match="as many keys as queries"):
    qwen3.attention(q, kv, kv, jnp.ones((1, 2, 6), bool), impl="blockwise", chunk=4)


def test_swiglu_backward_matches_autodiff():
  """The MLP's hand-written backward against autodiff of the same formula."""
  rs = np.random.RandomState(0)
  h, wg, wu, wd, dy = (jnp.asarray(rs.randn(*s).astype(np.float32)) for s in
                       ((2, 5, 16), (16, 24), (16, 24), (24, 16), (2, 5, 16)))

  def plain(h, wg, wu, wd):
    return jnp.einsum("bti,ih->bth", jax.nn.silu(h @ wg) * (h @ wu), wd)

  out, vjp = jax.vjp(qwen3.swiglu_mlp, h, wg, wu, wd)
  ref_out, ref_vjp = jax.vjp(plain, h, wg, wu, wd)
  np.testing.assert_allclose(out, ref_out, atol=1e-5)
  for a, b in zip(vjp(dy), ref_vjp(dy)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("chunk", [1, 5, 23])
def test_chunked_logprob_gradients_match_autodiff_of_log_softmax(chunk):
  """Gradients of log-probs and entropies (the hand-written backward, per chunk)
  against autodiff of log_softmax over full logits, at temperature 0.7."""
  rs = np.random.RandomState(1)
  hidden = jnp.asarray(rs.randn(2, 23, 16).astype(np.float32))
  unembed = jnp.asarray(rs.randn(16, 37).astype(np.float32) * 0.5)
  targets = jnp.asarray(rs.randint(0, 37, size=(2, 23)))
  w_lp, w_ent = (jnp.asarray(rs.randn(2, 23).astype(np.float32)) for _ in range(2))

  def ours(hidden, unembed):
    lp, ent = qwen3.chunked_logprobs(hidden, unembed, targets, chunk=chunk, temperature=0.7,
                                     return_entropy=True)
    return (lp * w_lp).sum() + (ent * w_ent).sum()

  def ref(hidden, unembed):
    logp = jax.nn.log_softmax(hidden @ unembed / 0.7)
    lp = jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
    ent = -jnp.sum(jnp.exp(logp) * logp, -1)
    return (lp * w_lp).sum() + (ent * w_ent).sum()

  got = jax.grad(ours, argnums=(0, 1))(hidden, unembed)
  want = jax.grad(ref, argnums=(0, 1))(hidden, unembed)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_chunked_logprobs_on_a_mesh_take_autodiff_and_agree():
  """On a mesh the log-probs run under jax.checkpoint autodiff (GSPMD partitions its
  weight gradient with less memory); off a mesh, the hand-written backward. Both give
  the same values and gradients, entropies included."""
  rs = np.random.RandomState(2)
  hidden = jnp.asarray(rs.randn(4, 12, 16).astype(np.float32))
  unembed = jnp.asarray(rs.randn(16, 40).astype(np.float32) * 0.5)
  targets = jnp.asarray(rs.randint(0, 40, size=(4, 12)))
  w = jnp.asarray(rs.randn(2, 4, 12).astype(np.float32))

  def loss(hidden, unembed):
    lp, ent = qwen3.chunked_logprobs(hidden, unembed, targets, chunk=5, temperature=0.7,
                                     return_entropy=True)
    return (lp * w[0]).sum() + (ent * w[1]).sum()

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  ref = fn(hidden, unembed)
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  with sharding.use_mesh_rules(mesh):
    assert sharding.mesh_active()
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(hidden, unembed)
  np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
  # The weight gradient sums 48 rows of terms up to ~10 in fp32: against a float64
  # reference both paths are off by ~1.2e-5 in absolute terms (an AVX2-only host summed
  # the mesh's partial sums in another order; a flat 1e-5 failed there), so the bound
  # scales with the gradient. A wrong backward is off by O(0.1) or more.
  for a, b in zip(got[1], ref[1]):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))
