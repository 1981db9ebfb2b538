"""The JaxEngine's KV cache on a mesh: created sharded (slots over data x fsdp, KV heads
over tensor), kept so by prefill and decode, the one-device engine's tokens, and the
per-device bytes `jax_engine.cache_bytes_per_device` promises.

Meshes use the first 4 of the 8 fake CPU devices (tests/conftest.py).

Tokens are compared exactly and log-probs within LOGP_ATOL = 1e-5. The sharded engine
runs the same model as another program (partial sums added across devices in another
order), so its log-probs differ from the one-device engine's by rounding (~1e-6 here).
A shift of at most d in every log-prob moves each point of a row's CDF by at most d
(sum_i p_i |dlog p_i|) and each greedy logit gap by at most 2d, so a token can differ only
where its draw's decision margin is below 2d. `_margins` recomputes every draw from the
one-device model's logits in float64 (numpy's inverse-CDF draw with the engine's
uniforms; the top-2 logit gap for greedy rows) and the tests require each margin above
MARGIN = 2 x LOGP_ATOL: exact equality is then robust to any CPU's rounding, argmax
ties included. About one draw in a hundred falls within 1e-4 of a boundary with this
101-token vocabulary, so the request seeds are ones whose every margin is above 2e-4.
"""
import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
import numpy as np
import pytest

from rstar_jax import sharding
from rstar_jax.model import qwen3
from rstar_jax.model.model_config import Qwen3Config, get_preset
from rstar_jax.rollout import jax_engine
from rstar_jax.rollout.jax_engine import EngineConfig, GenerationRequest, JaxEngine

CFG = Qwen3Config(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  initializer_range=0.3)
LOGP_ATOL = 1e-5
MARGIN = 2 * LOGP_ATOL   # every draw's distance from its decision boundary (the docstring)


@pytest.fixture(scope="module")
def model():
  return qwen3.create_model(CFG, seed=0)


def _mesh(shape):
  return sharding.make_mesh(shape, devices=jax.devices()[:4])


def _requests(n, seed):
  """Greedy and sampled requests (temperature only: `_margins` models that draw)."""
  rng = np.random.RandomState(seed)
  return [GenerationRequest(
      input_ids=rng.randint(0, 101, rng.randint(3, 20)).tolist(),
      max_new_tokens=int(rng.randint(8, 30)), stop_token_ids=(7,), seed=100 + i,
      temperature=[0.0, 1.0, 0.7][i % 3], request_id=str(i)) for i in range(n)]


def _margins(model, request, output_ids):
  """Each generated token's decision margin under `model`'s logits (teacher-forced, float64):
  greedy, the gap between the top two logits; sampled, the distance of the engine's uniform
  from the edges of the chosen token's CDF interval. Also checks the draw it recomputes
  picks the engine's token (so the margins are of the engine's own draws)."""
  ids = list(request.input_ids) + list(output_ids)
  logits = np.asarray(qwen3.forward_logits(model, jnp.asarray([ids], jnp.int32))[0],
                      np.float64)
  out = []
  for j, tok in enumerate(output_ids):
    z = logits[len(request.input_ids) - 1 + j]
    if request.temperature <= 0:
      top2 = np.sort(z)[-2:]
      assert np.argmax(z) == tok
      out.append(top2[1] - top2[0])
      continue
    p = np.exp((z - z.max()) / request.temperature)
    cdf = np.cumsum(p / p.sum())
    key = jax.random.fold_in(jax.random.PRNGKey(request.seed), j)
    u = float(jax.random.uniform(key))
    assert int(np.searchsorted(cdf, u, side="right")) == tok, (request.request_id, j)
    lo = cdf[tok - 1] if tok else 0.0
    out.append(min(u - lo, cdf[tok] - u))
  return out


def _assert_same_generation(reqs, got, want, reference_model):
  for r, x, y in zip(reqs, got, want):
    assert x.output_ids == y.output_ids, r.request_id
    np.testing.assert_allclose(x.logprobs, y.logprobs, atol=LOGP_ATOL, err_msg=r.request_id)
    assert min(_margins(reference_model, r, y.output_ids)) > MARGIN, r.request_id
  assert {r.temperature > 0 for r in reqs} == {True, False}


def _assert_sharded(engine, mesh, ecfg, rules=sharding.DEFAULT_RULES):
  """Every cache array spans the mesh's devices with the per-device block `cache_specs`
  gives, and each device holds 1/N of the cache: the bytes `cache_bytes_per_device`
  promises (read back from the arrays' addressable shards)."""
  specs = jax_engine.cache_specs(CFG, ecfg, mesh.shape, rules)
  total = 0
  per_device = {d: 0 for d in mesh.devices.flat}
  for name in ("k", "v"):
    want = NamedSharding(mesh, specs[name])
    for x in engine.cache[name]:
      assert len(x.sharding.device_set) == mesh.size
      assert x.sharding.is_equivalent_to(want, x.ndim), (name, x.sharding, want)
      block = want.shard_shape(x.shape)
      for shard in x.addressable_shards:
        assert shard.data.shape == block
        per_device[shard.device] += shard.data.nbytes
      total += x.nbytes
  assert set(per_device.values()) == {jax_engine.cache_bytes_per_device(CFG, ecfg, mesh.shape,
                                                                        rules)}
  return total, per_device


def test_sharded_cache_spans_the_mesh_and_samples_as_one_device(model):
  """fsdp 2 x tensor 2: slots and KV heads both split, each device holding a quarter of
  the cache before and after prefill and decode, and the one-device engine's tokens."""
  reqs = _requests(9, seed=8)
  ecfg = EngineConfig(num_slots=4, max_len=64)
  want = JaxEngine(model, ecfg).generate_sync(reqs)
  mesh = _mesh({"data": 1, "fsdp": 2, "tensor": 2})
  engine = JaxEngine(sharding.shard_model(model, mesh), ecfg)
  total, per_device = _assert_sharded(engine, mesh, ecfg)
  assert set(per_device.values()) == {total // 4}
  assert total == jax_engine.cache_bytes_per_device(CFG, ecfg)  # the whole, one device
  # [4 slots, 2 heads, 8, 64] in blocks of [2, 1, 8, 64] (and v's [2, 1, 64, 8]).
  assert engine.cache["k"][0].addressable_shards[0].data.shape == (2, 1, 8, 64)
  got = engine.generate_sync(reqs)
  _assert_same_generation(reqs, got, want, model)
  _assert_sharded(engine, mesh, ecfg)
  assert engine.stats()["decode_calls"] > 10


def test_data_axis_and_multi_step_decode_loop_keep_the_cache_sharded(model):
  """data 2 x fsdp 2 (slots over both), decode_steps 3 as an on-device loop and length
  buckets: the same tokens; the compiled prefill and decode return the cache in the
  layout it came in (donated: updated in place, alias = the per-device bytes) and hold
  no more than a slice of it besides (no slot gathered whole onto a device)."""
  reqs = _requests(6, seed=7)
  want = JaxEngine(model, EngineConfig(num_slots=8, max_len=256)).generate_sync(reqs)
  ecfg = EngineConfig(num_slots=8, max_len=256, decode_steps=3, decode_loop=True)
  mesh = _mesh({"data": 2, "fsdp": 2, "tensor": 1})
  engine = JaxEngine(sharding.shard_model(model, mesh), ecfg)
  total, _ = _assert_sharded(engine, mesh, ecfg)
  got = engine.generate_sync(reqs)
  _assert_same_generation(reqs, got, want, model)
  _assert_sharded(engine, mesh, ecfg)

  per_device = jax_engine.cache_bytes_per_device(CFG, ecfg, mesh.shape)
  one_layer_k = total // (2 * CFG.num_hidden_layers)   # a whole [slots, heads, D, S] array
  n = ecfg.num_slots
  z, ones = np.zeros(n, np.int32), np.ones(n, np.float32)
  idle = np.full(n, ecfg.max_len, np.int32)
  held = dict(zip(("k", "v"), engine._cache_sharding))
  calls = {
      "decode": jax_engine._decode.lower(
          engine.graphdef, engine.state, engine.cache, z, idle, z, z, ones, ones, z,
          attend_len=None, steps=3, loop=True, cache_sharding=engine._cache_sharding),
      "prefill": jax_engine._prefill.lower(
          engine.graphdef, engine.state, engine.cache, *engine._prefill_arrays(4, 16),
          attend_len=32, cache_sharding=engine._cache_sharding)}
  for what, lowered in calls.items():
    compiled = lowered.compile()
    out_cache = compiled.output_shardings[0]
    for name in ("k", "v"):
      for s in out_cache[name]:
        assert s.is_equivalent_to(held[name], 4), (what, name, s)
    mem = compiled.memory_analysis()
    assert mem.alias_size_in_bytes == per_device, what
    assert mem.temp_size_in_bytes < one_layer_k, (what, mem.temp_size_in_bytes, one_layer_k)


def test_a_layout_the_mesh_does_not_divide_is_refused_naming_the_field(model):
  mesh = _mesh({"data": 1, "fsdp": 4, "tensor": 1})
  sharded = sharding.shard_model(model, mesh)
  with pytest.raises(ValueError, match=r"EngineConfig\.num_slots=6 is not a multiple of 4 "
                                       r"\(mesh axes data=1 x fsdp=4.*set EngineConfig"
                                       r"\.num_slots to a multiple of 4.*mesh\.rules\.cache_batch"):
    JaxEngine(sharded, EngineConfig(num_slots=6, max_len=32))
  mesh = _mesh({"data": 1, "fsdp": 1, "tensor": 4})
  with pytest.raises(ValueError, match=r"Qwen3Config\.num_key_value_heads=2 is not a multiple "
                                       r"of 4 \(mesh axes tensor=4.*mesh\.rules\.cache_kv_heads"):
    JaxEngine(sharding.shard_model(model, mesh), EngineConfig(num_slots=4, max_len=32))
  # The pure function refuses what the engine refuses.
  with pytest.raises(ValueError, match=r"num_key_value_heads=2"):
    jax_engine.cache_bytes_per_device(CFG, EngineConfig(num_slots=4), {"tensor": 4})


def test_the_fix_the_refusal_names_runs(model):
  """Replicating the KV heads over tensor by rule (mesh.rules.cache_kv_heads=''), as the
  refusal suggests: the engine runs, with the one-device engine's tokens, and every device
  holds the whole cache (no other axis is left to split it)."""
  mc = sharding.MeshConfig(enabled=True, data=1, fsdp=1, tensor=4,
                           rules={"cache_kv_heads": ""})
  rules = mc.logical_rules()
  mesh = mc.make(jax.devices()[:4])
  ecfg = EngineConfig(num_slots=4, max_len=32)
  reqs = _requests(3, seed=3)
  want = JaxEngine(model, ecfg).generate_sync(reqs)
  engine = JaxEngine(sharding.shard_model(model, mesh, rules), ecfg, rules=rules)
  got = engine.generate_sync(reqs)
  _assert_same_generation(reqs, got, want, model)
  _, per_device = _assert_sharded(engine, mesh, ecfg, rules)
  assert set(per_device.values()) == {jax_engine.cache_bytes_per_device(CFG, ecfg)}


def test_cache_bytes_per_device_for_qwen3_14b():
  """Pure arithmetic from the config (no device): Qwen3-14B's bf16 K and V are 160 KiB a
  token (40 layers x 8 KV heads x 128 x 2 x 2 bytes); 64 slots x 13,312 tokens."""
  cfg = get_preset("qwen3-14b")
  ecfg = EngineConfig(num_slots=64, max_len=13_312, cache_dtype="bfloat16")
  whole = 64 * 13_312 * 40 * 8 * 128 * 2 * 2
  assert whole == 64 * 13_312 * 160 * 1024
  assert jax_engine.cache_bytes_per_device(cfg, ecfg) == whole
  assert jax_engine.cache_bytes_per_device(cfg, ecfg, {"fsdp": 8}) == whole // 8
  assert jax_engine.cache_bytes_per_device(cfg, ecfg, {"data": 2, "fsdp": 4, "tensor": 8}
                                           ) == whole // 64
  f32 = dataclasses.replace(ecfg, cache_dtype="float32")
  assert jax_engine.cache_bytes_per_device(cfg, f32, {"fsdp": 64}) == 2 * whole // 64
  with pytest.raises(ValueError, match=r"EngineConfig\.num_slots=64 is not a multiple of 128"):
    jax_engine.cache_bytes_per_device(cfg, ecfg, {"fsdp": 128})
  with pytest.raises(ValueError, match=r"mesh_shape: axis sizes must be resolved"):
    jax_engine.cache_bytes_per_device(cfg, ecfg, {"fsdp": -1})
  with pytest.raises(ValueError, match=r"mesh_shape: unknown axes \['pipe'\]"):
    jax_engine.cache_bytes_per_device(cfg, ecfg, {"pipe": 2})


def test_pallas_decode_attention_is_refused_on_a_mesh(model):
  """The Pallas decode kernel is one custom call: over a cache split on a mesh XLA would
  gather the whole cache every step, so the engine refuses it, naming the field."""
  mesh = _mesh({"data": 1, "fsdp": 4, "tensor": 1})
  pallas = qwen3.create_model(dataclasses.replace(CFG, decode_attention_impl="pallas"), seed=0)
  with pytest.raises(ValueError, match=r"decode_attention_impl='pallas'.*fix: "
                                       r"decode_attention_impl='dense' on a mesh"):
    JaxEngine(sharding.shard_model(pallas, mesh), EngineConfig(num_slots=4, max_len=32))


def test_the_preflight_memory_counts_one_device_s_share_of_the_cache():
  """The recipe's start check and experiments.preflight count the cache a device holds:
  the whole on one device, 1/shards of it on a mesh; a misfit names the split."""
  from rstar_jax.recipe import preflight_checks as pc
  cfg = get_preset("qwen3-14b")
  ecfg = EngineConfig(num_slots=64, max_len=13_312, cache_dtype="bfloat16")
  whole = jax_engine.cache_bytes_per_device(cfg, ecfg)
  per = jax_engine.cache_bytes_per_device(cfg, ecfg, {"fsdp": 8})
  one = pc.jax_engine_memory(cfg, num_slots=64, max_len=13_312, device_bytes=80e9)
  split = pc.jax_engine_memory(cfg, num_slots=64, max_len=13_312, device_bytes=80e9,
                               cache_shards=whole // per)
  assert one.kv_bytes == whole and split.kv_bytes == per
  [problem] = pc.rollout_problems(one)
  assert problem.field == "rollout.engine.num_slots" and "139.6 GB)" in str(problem)
  assert pc.rollout_problems(split) == []        # 17.4 GB a device of 72 usable
  small = pc.jax_engine_memory(cfg, num_slots=64, max_len=13_312, device_bytes=16e9,
                               cache_shards=8)
  [problem] = pc.rollout_problems(small)
  assert "17.4 GB a device, split over 8)" in str(problem)
  with pytest.raises(ValueError, match="cache_shards=0"):
    pc.jax_engine_memory(cfg, num_slots=64, max_len=13_312, device_bytes=80e9, cache_shards=0)
