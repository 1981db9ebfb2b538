"""JaxEngine with `batch_invariant`: a request's tokens and log-probs are the same bits
whatever shares its prefill and decode calls, whichever slot it lands in, and whether
its previous turn's k/v are still cached (docs/guides/reproducibility.md).

The reference is the request run alone on a fresh engine of the same config; every
comparison is of float32 bit patterns, not a tolerance.
"""
import dataclasses

import numpy as np
import pytest

from rstar_jax.model import qwen3
from rstar_jax.model.model_config import Qwen3Config
from rstar_jax.rollout.jax_engine import EngineConfig, GenerationRequest, JaxEngine

CFG = Qwen3Config(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  initializer_range=0.3)
# max_len 128: decode buckets 16 and 32 are in use without the switch (3 x 32 < 128), so
# neighbours of 40-80 tokens would move the target's attention length.
INVARIANT = EngineConfig(num_slots=4, max_len=128, batch_invariant=True)


@pytest.fixture(scope="module")
def model():
  return qwen3.create_model(CFG, seed=0)


def _request(rid, n, new, seed, rng, temperature=1.0, top_p=1.0, top_k=0):
  return GenerationRequest(input_ids=rng.randint(0, 101, n).tolist(), max_new_tokens=new,
                           seed=seed, temperature=temperature, top_p=top_p, top_k=top_k,
                           stop_token_ids=(7,), request_id=rid)


def _targets():
  rng = np.random.RandomState(1)
  return [_request("t0", 20, 30, 0, rng), _request("t1", 9, 25, 1, rng, top_p=0.9),
          _request("t2", 40, 20, 2, rng, temperature=0.7, top_k=20)]


def _neighbours():
  rng = np.random.RandomState(2)
  return [_request(f"n{i}", int(rng.randint(3, 80)), int(rng.randint(10, 40)), 100 + i, rng)
          for i in range(6)]


def _bits(result):
  return list(result.output_ids), np.asarray(result.logprobs, np.float32).view(np.uint32).tolist()


def _alone(model, cfg, request):
  return _bits(JaxEngine(model, cfg).generate_sync([request])[0])


def _by_id(results):
  return {r.request_id: _bits(r) for r in results}


def test_a_request_alone_in_a_full_batch_and_in_another_slot_gives_the_same_bits(model):
  targets, others = _targets(), _neighbours()
  alone = {r.request_id: _alone(model, INVARIANT, r) for r in targets}

  # A full batch (more requests than slots: some queue, slots are refilled mid-run),
  # the targets first, then last: other slots, other prefill and decode company.
  for order in (targets + others, others + targets, others[:4] + targets + others[4:]):
    engine = JaxEngine(model, INVARIANT)
    got = _by_id(engine.generate_sync(order))
    for r in targets:
      assert got[r.request_id] == alone[r.request_id], r.request_id
    assert engine.metrics["decode_calls"] > 0

  # Another slot: three short requests ran first, so the least recently released slot
  # the target takes is not slot 0.
  engine = JaxEngine(model, INVARIANT)
  rng = np.random.RandomState(3)
  engine.generate_sync([_request(f"f{i}", 5, 1, i, rng) for i in range(3)])
  got = engine.generate_sync([targets[0]])
  assert [i for i, s in enumerate(engine.slots) if s.out_ids == got[0].output_ids] != [0]
  assert _bits(got[0]) == alone["t0"]


def test_a_next_turn_gives_the_same_bits_whether_or_not_its_prefix_is_cached(model):
  """Turn 2 of a trajectory right after turn 1 on the same engine (its slot still holds
  turn 1's k/v) and on a fresh engine: the same bits, and nothing was reused."""
  first = _targets()[0]
  engine = JaxEngine(model, INVARIANT)
  out = engine.generate_sync([first])[0]
  second = GenerationRequest(input_ids=list(first.input_ids) + out.output_ids + [3, 4, 5],
                             max_new_tokens=20, seed=9, request_id="turn1")
  warm = engine.generate_sync([second])[0]
  assert warm.reused_prefix_tokens == 0
  assert _bits(warm) == _alone(model, INVARIANT, second)


def test_several_decode_steps_per_call_give_the_same_bits(model):
  """decode_steps > 1 unrolls steps in one call only while no request queues (timing):
  the bits must not depend on how many steps a call ran."""
  reqs = _targets() + _neighbours()
  one = _by_id(JaxEngine(model, INVARIANT).generate_sync(reqs))
  four = _by_id(JaxEngine(model, dataclasses.replace(INVARIANT, decode_steps=4))
                .generate_sync(reqs))
  assert one == four


def test_the_switch_fixes_the_shapes_it_says():
  cfg = EngineConfig(num_slots=16, max_len=512, batch_invariant=True)
  assert cfg.prefill_rows(16) == [1] and cfg.prefill_rows_for(2, 16) is None
  assert all(cfg.decode_attend(n) is None for n in (1, 16, 100, 511))
  assert not cfg.reuses_prefix
  plain = dataclasses.replace(cfg, batch_invariant=False)
  assert plain.prefill_rows(16) == [1, 4, 16] and plain.decode_attend(20) == 32
  assert plain.reuses_prefix
