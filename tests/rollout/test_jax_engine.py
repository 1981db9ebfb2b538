"""JaxEngine: continuous batching equivalence, log-prob alignment, stops, prefix reuse."""
import asyncio

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar_jax import sharding
from rstar_jax.model import qwen3
from rstar_jax.model.model_config import Qwen3Config
from rstar_jax.rl import train_step as ts
from rstar_jax.rollout import jax_engine, sampling
from rstar_jax.rollout.jax_engine import EngineConfig, GenerationRequest, JaxEngine

CFG = Qwen3Config(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  initializer_range=0.3)


@pytest.fixture(scope="module")
def model():
  return qwen3.create_model(CFG, seed=0)


def _requests(n=10, seed=0):
  rng = np.random.RandomState(seed)
  return [GenerationRequest(
      input_ids=rng.randint(0, 101, rng.randint(3, 20)).tolist(),
      max_new_tokens=int(rng.randint(5, 30)), stop_token_ids=(7, 11), seed=i,
      temperature=[1.0, 0.7, 0.0][i % 3], top_p=0.9 if i % 2 else 1.0,
      top_k=20 if i % 4 == 0 else 0, request_id=str(i)) for i in range(n)]


def test_continuous_batching_equals_one_at_a_time(model):
  reqs = _requests()
  batched = JaxEngine(model, EngineConfig(num_slots=4, max_len=64)).generate_sync(reqs)
  for r, b in zip(reqs, batched):
    alone = JaxEngine(model, EngineConfig(num_slots=1, max_len=64)).generate_sync([r])[0]
    assert alone.output_ids == b.output_ids, r.request_id
    np.testing.assert_allclose(alone.logprobs, b.logprobs, atol=1e-5)
  reasons = {b.finish_reason for b in batched}
  assert reasons == {"stop", "length"}, "workload should exercise both stop kinds"
  for r, b in zip(reqs, batched):
    if b.finish_reason == "stop":
      assert b.output_ids[-1] in r.stop_token_ids
    else:
      assert len(b.output_ids) == r.max_new_tokens


def test_decode_length_buckets_change_nothing_but_the_work(model):
  """Decode attends to a power-of-two prefix of each slot (decode_buckets): the same
  tokens and log-probs as attending to all max_len slots, across bucket changes."""
  reqs = _requests(n=12, seed=3)
  full = JaxEngine(model, EngineConfig(num_slots=4, max_len=96, decode_buckets=False))
  cut = JaxEngine(model, EngineConfig(num_slots=4, max_len=96, min_prefill_bucket=8))
  a, b = full.generate_sync(reqs), cut.generate_sync(reqs)
  for r, x, y in zip(reqs, a, b):
    assert x.output_ids == y.output_ids, r.request_id
    np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
  assert max(len(r.input_ids) + len(x.output_ids) for r, x in zip(reqs, a)) > 16  # crossed buckets



def test_per_layer_weights_change_nothing_and_follow_update_weights(model):
  """The engine's own per-layer copy of the weights gives the tokens of the stacked
  arrays read in place, and `update_weights` replaces it (stale prefixes dropped)."""
  reqs = _requests(n=6, seed=5)
  own = JaxEngine(model, EngineConfig(num_slots=4, max_len=64))
  shared = JaxEngine(model, EngineConfig(num_slots=4, max_len=64, per_layer_weights=False))
  assert isinstance(own.state["layers"]["q_proj"].get_value(), tuple)
  a, b = own.generate_sync(reqs), shared.generate_sync(reqs)
  for r, x, y in zip(reqs, a, b):
    assert x.output_ids == y.output_ids, r.request_id
    np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-6)
  other = qwen3.create_model(CFG, seed=1)
  own.update_weights(nnx.state(other), version="v1")
  fresh = JaxEngine(other, EngineConfig(num_slots=4, max_len=64))
  c, d = own.generate_sync(reqs), fresh.generate_sync(reqs)
  assert [x.output_ids for x in c] != [x.output_ids for x in a]
  for r, x, y in zip(reqs, c, d):
    assert x.output_ids == y.output_ids, r.request_id
    np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-6)
    assert x.weight_version == "v1"

def test_weights_from_a_step_or_a_checkpoint_reuse_the_compiled_programs(model):
  """Weights that are committed to their device (a train step's output, a restored
  checkpoint) and weights that are not (a fresh init) run the same compiled prefill
  and decode: in the recipe every stage's new weights compiled each shape again."""
  engine = JaxEngine(model, EngineConfig(num_slots=2, max_len=32))
  engine.warm_up()
  state = nnx.state(model)
  assert state["embed_tokens"].get_value().committed is False
  engine.update_weights(jax.tree.map(lambda a: jax.device_put(a, jax.devices()[0]), state))
  programs = jax_engine._prefill._cache_size() + jax_engine._decode._cache_size()
  shapes = engine.warm_up()   # every prefill and decode shape, on the new weights
  assert shapes >= 4
  assert jax_engine._prefill._cache_size() + jax_engine._decode._cache_size() == programs


def test_an_engine_on_weights_sharded_over_a_mesh_samples_as_on_one_device(model):
  """The recipe's mesh with the in-process backend: the engine runs on the sharded
  weights (its cache placed by jit) and samples the single-device tokens."""
  reqs = _requests(n=4, seed=11)
  want = JaxEngine(model, EngineConfig(num_slots=4, max_len=64)).generate_sync(reqs)
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  sharded = sharding.shard_model(qwen3.create_model(CFG, seed=0), mesh)
  assert len(nnx.state(sharded)["embed_tokens"].get_value().sharding.device_set) == 8
  got = JaxEngine(sharded, EngineConfig(num_slots=4, max_len=64)).generate_sync(reqs)
  for r, x, y in zip(reqs, got, want):
    assert x.output_ids == y.output_ids, r.request_id
    np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)


def _stop_and_resume_workload(engine):
  """Requests that stop on stop tokens part-way, a second turn extending each (prefix
  reuse on slots whose cache holds discarded steps past the first turn), then more."""
  rng = np.random.RandomState(7)
  first = [GenerationRequest(
      input_ids=rng.randint(0, 101, rng.randint(3, 30)).tolist(),
      max_new_tokens=int(rng.randint(5, 50)), stop_token_ids=(7, 11, 13, 17), continue_ids=(13,),
      seed=i, temperature=[1.0, 0.7, 0.0][i % 3], request_id=f"a{i}") for i in range(12)]
  outs = engine.generate_sync(first[:4])
  second = [GenerationRequest(input_ids=r.input_ids + o.output_ids + [5, 6], max_new_tokens=20,
                              stop_token_ids=(7, 11), seed=100 + k, request_id=f"b{k}")
            for k, (r, o) in enumerate(zip(first, outs))]
  return outs + engine.generate_sync(second) + engine.generate_sync(first[4:])


def test_several_decode_steps_per_call_change_nothing_but_the_calls(model):
  """decode_steps > 1 unrolls that many steps in one call while no request waits for
  a slot (one step a call while one does): the same tokens and log-probs as one step
  a call, with rows stopping part-way through a call (stop tokens, max_new_tokens,
  the cache end at max_len 32), decode length buckets (max_len 96) and second turns
  reusing the prefix of a slot whose cache holds discarded steps."""
  reqs = _requests(n=12, seed=4)
  for case in ("cache end, no queue", "cache end, queue", "buckets, stops, resumes"):
    outs, metrics = {}, {}
    for steps in (1, 3, 5):
      if case.startswith("cache end"):
        eng = JaxEngine(model, EngineConfig(num_slots=4, max_len=32, decode_steps=steps))
        outs[steps] = eng.generate_sync(reqs[:4] if case.endswith("no queue") else reqs)
      else:
        eng = JaxEngine(model, EngineConfig(num_slots=4, max_len=96, min_prefill_bucket=8,
                                            decode_steps=steps))
        assert eng.config.decode_attend(12) == 16  # steps attend to a bucket, not whole slots
        outs[steps] = _stop_and_resume_workload(eng)
      metrics[steps] = eng.metrics
    for steps in (3, 5):
      for x, y in zip(outs[1], outs[steps]):
        assert (x.output_ids, x.finish_reason) == (y.output_ids, y.finish_reason), (case, steps)
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
    m = metrics[5]
    if case == "cache end, no queue":
      assert m["decode_steps"] == 5 * m["decode_calls"]
    elif case == "cache end, queue":  # single steps while the queue lasted, then five a call
      assert m["decode_calls"] < m["decode_steps"] < 5 * m["decode_calls"]
      assert {x.finish_reason for x in outs[1]} == {"stop", "length"}
      assert any(len(r.input_ids) + len(x.output_ids) >= 31 for r, x in zip(reqs, outs[1]))
    else:
      # Rows stopped on a stop token inside a call of 5 (not on its last step), and
      # second turns reused their first turn's slot.
      assert any(x.finish_reason == "stop" and len(x.output_ids) >= 3
                 and (len(x.output_ids) - 1) % 5 for x in outs[1])
      assert m["reused_prefix_tokens"] > 0
  with pytest.raises(ValueError, match="decode_steps"):
    EngineConfig(decode_steps=0)


def test_decode_steps_in_a_device_loop_give_the_tokens_of_single_steps(model):
  """decode_loop: a call's decode_steps run as a lax.fori_loop (one step's program,
  tokens kept on the device between steps, one host sync a call): the tokens and
  finish reasons of one step a call, log-probs within 1e-5 (another program, so not
  necessarily the same rounding), with rows stopping part-way through a call, the cache
  end (max_len 32), length buckets and prefix-reusing second turns (max_len 96)."""
  reqs = _requests(n=12, seed=4)
  for case in ("cache end", "buckets, stops, resumes"):
    outs, metrics = {}, {}
    for steps, loop in ((1, False), (4, True)):
      if case == "cache end":
        eng = JaxEngine(model, EngineConfig(num_slots=4, max_len=32, decode_steps=steps,
                                            decode_loop=loop))
        outs[steps] = eng.generate_sync(reqs[:4])
      else:
        eng = JaxEngine(model, EngineConfig(num_slots=4, max_len=96, min_prefill_bucket=8,
                                            decode_steps=steps, decode_loop=loop))
        outs[steps] = _stop_and_resume_workload(eng)
      metrics[steps] = eng.metrics
    assert metrics[4]["decode_steps"] > metrics[4]["decode_calls"]   # several steps a call
    for x, y in zip(outs[1], outs[4]):
      assert (x.output_ids, x.finish_reason) == (y.output_ids, y.finish_reason), case
      np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)


def test_batched_prefill_equals_one_request_per_call(model):
  """Requests admitted together are prefilled in one call (rows padded to a power of
  4, padding rows write nowhere): the same tokens and log-probs as one call each,
  after a warm-up that ran every shape on padding rows only."""
  reqs = _requests(n=11, seed=5)
  batched = JaxEngine(model, EngineConfig(num_slots=7, max_len=64, prefill_batch_tokens=256))
  cfg = batched.config
  assert cfg.buckets() == [16, 32, 64] and cfg.prefill_rows(16) == [1, 4]  # 16 rows > 7 slots
  assert cfg.prefill_rows_for(3, 16) == 4 and cfg.prefill_rows_for(5, 16) is None
  assert EngineConfig(max_len=100, min_prefill_bucket=24).buckets() == [24, 32, 64, 100]
  batched.warm_up()
  assert all(not np.asarray(c).any() for c in jax.tree.leaves(batched.cache))  # padding only
  compiled = jax_engine._prefill._cache_size(), jax_engine._decode._cache_size()
  a = batched.generate_sync(reqs)
  assert (jax_engine._prefill._cache_size(), jax_engine._decode._cache_size()) == compiled
  b = JaxEngine(model, EngineConfig(num_slots=7, max_len=64,
                                    prefill_batch_tokens=0)).generate_sync(reqs)
  # Several requests per call, and some calls with padding rows.
  assert batched.metrics["prefill_calls"] < len(reqs)
  assert batched.metrics["prefill_padding_rows"] > 0
  for r, x, y in zip(reqs, a, b):
    assert x.output_ids == y.output_ids, r.request_id
    np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)


def test_sampler_logprobs_equal_trainer_logprobs(model):
  reqs = [r for r in _requests(6, seed=1)]
  for r in reqs:
    r.temperature = 1.0
  outs = JaxEngine(model, EngineConfig(num_slots=3, max_len=64)).generate_sync(reqs)
  graphdef, params = nnx.split(model, nnx.Param)
  for r, o in zip(reqs, outs):
    seq = list(r.input_ids) + o.output_ids
    ids = jnp.asarray([seq[:-1]])
    lp = ts.sequence_logprobs(graphdef, params, ids, jnp.asarray([seq[1:]]),
                              jnp.ones_like(ids), chunk=16)[0]
    trainer = np.asarray(lp[len(r.input_ids) - 1:])
    np.testing.assert_allclose(np.asarray(o.logprobs), trainer, atol=1e-5)


def test_resumed_request_reuses_its_prefix(model):
  engine = JaxEngine(model, EngineConfig(num_slots=2, max_len=64))
  first = GenerationRequest(input_ids=[1, 2, 3, 4, 5], max_new_tokens=6, seed=3)
  out1 = engine.generate_sync([first])[0]
  tool = [9, 9, 8]   # "tool output" appended by the agent loop
  cont = GenerationRequest(input_ids=[1, 2, 3, 4, 5] + out1.output_ids + tool,
                           max_new_tokens=5, seed=4)
  out2 = engine.generate_sync([cont])[0]
  assert out2.reused_prefix_tokens == 5 + len(out1.output_ids) - 1
  fresh = JaxEngine(model, EngineConfig(num_slots=2, max_len=64, reuse_prefix=False))
  ref = fresh.generate_sync([cont])[0]
  assert ref.reused_prefix_tokens == 0
  assert ref.output_ids == out2.output_ids
  np.testing.assert_allclose(ref.logprobs, out2.logprobs, atol=1e-5)


def _two_turn_trajectories(engine, n: int, tool_s: float = 0.02):
  """n trajectories of two turns through `engine` (its own thread): turn 1 stops at
  its first token, which is a continue id; the "tool" takes tool_s; turn 2 extends it."""
  everything = tuple(range(CFG.vocab_size))

  async def one(k):
    prompt = [1 + k, 2, 3, 4, 5, 6]
    a = await engine.generate(GenerationRequest(
        input_ids=prompt, max_new_tokens=4, stop_token_ids=everything, continue_ids=everything,
        seed=k, request_id=f"t{k}/turn0"))
    await asyncio.sleep(tool_s)
    b = await engine.generate(GenerationRequest(
        input_ids=prompt + a.output_ids + [9, 9, 8], max_new_tokens=6, seed=100 + k,
        request_id=f"t{k}/turn1"))
    return a, b

  async def main():
    return await asyncio.gather(*(one(k) for k in range(n)))
  try:
    return asyncio.run(main())
  finally:
    engine.stop()


def test_a_held_slot_keeps_its_prefix_for_the_next_turn(model):
  """Trajectories outnumber slots: without a grace period a queued first turn takes the
  slot a trajectory left for its tool call, and the next turn recomputes its prefix;
  with it, every second turn reuses its prefix. Outputs are the same either way."""
  held = _two_turn_trajectories(
      JaxEngine(model, EngineConfig(num_slots=2, max_len=64, prefix_grace_s=5.0)), 4)
  plain = _two_turn_trajectories(
      JaxEngine(model, EngineConfig(num_slots=2, max_len=64, prefix_grace_s=0.0)), 4)
  for (a1, b1), (a2, b2) in zip(held, plain):
    assert (a1.output_ids, b1.output_ids) == (a2.output_ids, b2.output_ids)
    np.testing.assert_allclose(b1.logprobs, b2.logprobs, atol=1e-5)
    assert a1.finish_reason == "stop" and len(a1.output_ids) == 1
  assert [b.reused_prefix_tokens for _, b in held] == [6] * 4   # prompt + the call token, less one
  assert sum(b.reused_prefix_tokens == 0 for _, b in plain) >= 2


def test_async_generate_and_cache_limit(model):
  engine = JaxEngine(model, EngineConfig(num_slots=2, max_len=24))

  async def main():
    reqs = [GenerationRequest(input_ids=[1] * 20, max_new_tokens=50, seed=i) for i in range(3)]
    return await asyncio.gather(*(engine.generate(r) for r in reqs))
  try:
    outs = asyncio.run(main())
  finally:
    engine.stop()
  for o in outs:   # 20 prompt tokens + at most 4 more fit a 24-token slot
    assert o.finish_reason == "length" and len(o.output_ids) == 4
  with pytest.raises(ValueError, match="do not fit"):
    engine.submit(GenerationRequest(input_ids=[1] * 24, max_new_tokens=1))


def test_top_k_and_top_p_filtering():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 3))
  f = sampling.filter_logits(logits, jnp.asarray([1.0, 0.7, 0.85]), jnp.asarray([2, 0, 0]))
  kept = np.asarray(f) > -1e29
  np.testing.assert_array_equal(kept, [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]])
  tok, lp = sampling.sample(logits, jnp.asarray([0, 1, 2]), jnp.asarray([0, 0, 0]),
                            jnp.asarray([0.0, 1.0, 1.0]), jnp.asarray([1.0, 1.0, 1.0]),
                            jnp.asarray([0, 1, 0]))
  assert int(tok[0]) == 0 and int(tok[1]) == 0      # greedy; top-1
  np.testing.assert_allclose(lp[0], np.log(0.5), rtol=1e-5)


def _long(i, n=200):
  return GenerationRequest(input_ids=[1, 2, 3], max_new_tokens=n, seed=i, request_id=f"r{i}")


def test_a_cancelled_caller_frees_its_slot_and_harms_no_other_request(model):
  # A caller's task cancelled (asyncio.wait_for's timeout, asyncio.run tearing down a
  # failed gather) cancels the engine's future; setting a result on it raised in the
  # engine thread, which then failed every other request and died, and later calls hung.
  async def main(eng):
    a, b, c = (asyncio.ensure_future(eng.generate(_long(i))) for i in range(3))
    await asyncio.sleep(0.3)          # a runs in the only slot; b and c wait
    a.cancel()
    b.cancel()
    r = await c   # a hang (what this was) is ended by pytest-timeout
    return r, eng.metrics["cancelled_requests"]

  eng = JaxEngine(model, EngineConfig(num_slots=1, max_len=256))
  r, cancelled = asyncio.run(main(eng))
  alone = JaxEngine(model, EngineConfig(num_slots=1, max_len=256)).generate_sync([_long(2)])[0]
  assert r.output_ids == alone.output_ids and r.finish_reason == "length"
  assert cancelled == 1 and eng.metrics["requests"] == 2   # b was never started
  # A fresh event loop (the next rollout batch) is served by the same engine.
  r2 = asyncio.run(eng.generate(_long(5, 6)))
  assert len(r2.output_ids) == 6 and eng._thread.is_alive()
  eng.stop()


def test_stop_fails_the_requests_it_leaves_unfinished(model):
  eng = JaxEngine(model, EngineConfig(num_slots=1, max_len=256))
  running, queued = eng.submit(_long(0)), eng.submit(_long(1))
  eng.step()
  eng.stop()
  for fut in (running, queued):
    with pytest.raises(RuntimeError, match="stopped with this request unfinished"):
      fut.result(timeout=0)
  assert eng.num_active() == 0 and not eng.queue


def test_a_seed_or_top_k_out_of_int32_is_refused_alone(model):
  eng = JaxEngine(model, EngineConfig(num_slots=2, max_len=64))
  for bad in (dict(seed=2**31), dict(seed=-2**31 - 1), dict(top_k=2**31)):
    with pytest.raises(ValueError, match="seed=|bad sampling params"):
      eng.submit(GenerationRequest(input_ids=[1, 2], max_new_tokens=2, **bad))
  assert eng.generate_sync([_long(0, 3)])[0].finish_reason == "length"


def test_weights_updated_mid_request_label_it_and_drop_its_cache(model):
  # The request's k/v are partly old weights': its next turn must not reuse them, and
  # its result names both versions so that check_weight_versions refuses it.
  new = qwen3.create_model(CFG, seed=1)
  cfg = EngineConfig(num_slots=1, max_len=128, prefix_grace_s=0)
  eng = JaxEngine(model, cfg)
  eng.weight_version = "v0"
  turn1 = GenerationRequest(input_ids=list(range(1, 40)), max_new_tokens=10, seed=3)
  fut = eng.submit(turn1)
  eng.step()
  eng.step()                              # prefill + one decode step on v0
  eng.update_weights(nnx.state(new), version="v1")
  while not fut.done():
    eng.step()
  assert fut.result().weight_version == "v0 -> v1"
  assert eng.slots[0].cached == []
  turn2 = GenerationRequest(input_ids=turn1.input_ids + fut.result().output_ids + [5, 6],
                            max_new_tokens=8, seed=4)
  got = eng.generate_sync([turn2])[0]
  want = JaxEngine(new, cfg).generate_sync([turn2])[0]
  assert got.reused_prefix_tokens == 0 and got.weight_version == "v1"
  assert got.output_ids == want.output_ids
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-6)


def test_a_bf16_kv_cache_decodes_the_fp32_cache_s_greedy_tokens(model):
  """EngineConfig.cache_dtype="bfloat16" on an fp32 model: k/v rounded to bf16 (half
  the cache's bytes, what decode reads per step). Greedy decoding gives the fp32
  cache's tokens except at a near tie: the two may part only at a position whose
  top-2 logit margin (from an independent full forward of the fp32 tokens, no cache)
  is under 2^-3, and before they part the chosen tokens' log-probs agree within 2^-4.
  Measured on one host: all 96 tokens equal, log-probs within 0.015 (the error grows
  along a sequence, as more k/v are rounded)."""
  reqs = [GenerationRequest(input_ids=r.input_ids, max_new_tokens=16, seed=r.seed,
                            temperature=0.0, request_id=r.request_id)
          for r in _requests(n=6, seed=8)]
  fp32 = JaxEngine(model, EngineConfig(num_slots=4, max_len=64)).generate_sync(reqs)
  bf16_engine = JaxEngine(model, EngineConfig(num_slots=4, max_len=64, cache_dtype="bfloat16"))
  assert all(c.dtype == jnp.bfloat16 for c in jax.tree.leaves(bf16_engine.cache))
  bf16 = bf16_engine.generate_sync(reqs)
  compared, worst = 0, 0.0
  for r, x, y in zip(reqs, fp32, bf16):
    assert len(x.output_ids) == len(y.output_ids) == 16
    ids = r.input_ids + x.output_ids
    logits = np.asarray(qwen3.forward_logits(model, jnp.asarray([ids])))[0]
    top2 = np.sort(logits[len(r.input_ids) - 1:len(ids) - 1], axis=-1)[:, -2:]
    margins = top2[:, 1] - top2[:, 0]
    n = next((j for j, (a, b) in enumerate(zip(x.output_ids, y.output_ids)) if a != b), 16)
    if n < 16:
      assert margins[n] < 2 ** -3, (r.request_id, n, margins[n])
    np.testing.assert_allclose(y.logprobs[:n], x.logprobs[:n], atol=2 ** -4)
    worst = max([worst] + [abs(a - b) for a, b in zip(x.logprobs[:n], y.logprobs[:n])])
    compared += n
  assert compared >= len(reqs) * 8, compared   # most tokens were compared
  assert worst > 0   # the cache really was bf16
