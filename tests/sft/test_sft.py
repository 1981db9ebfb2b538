"""SFT: packing keeps conversations apart, masks cover assistant tokens, step invariance."""
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rstar_jax.model import qwen3
from rstar_jax.model.model_config import Qwen3Config
from rstar_jax.sft import packing
from rstar_jax.sft import train_step as sft_ts
from rstar_jax.train import step as core

CFG = Qwen3Config(vocab_size=53, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  initializer_range=0.3)


def _examples(n, seed=0):
  rng = np.random.RandomState(seed)
  out = []
  for _ in range(n):
    L = rng.randint(4, 30)
    ids = rng.randint(1, 53, size=L).tolist()
    mask = [0] * 3 + (rng.rand(L - 3) > 0.4).astype(int).tolist()
    out.append((ids, mask))
  return out


def test_packing_places_every_token_once_with_shifted_masks():
  ex = _examples(20)
  rows, stats = packing.pack(ex, 64)
  assert stats["examples"] == 20 and stats["truncated"] == 0
  # Every (input, target, mask) triple of every example appears in exactly one segment.
  found = []
  for r in range(stats["rows"]):
    seg = rows["segment_ids"][r]
    for s in set(seg[seg > 0].tolist()):
      sel = seg == s
      found.append((rows["input_ids"][r][sel].tolist(), rows["target_ids"][r][sel].tolist(),
                    rows["loss_mask"][r][sel].tolist(), rows["positions"][r][sel].tolist()))
  want = [(ids[:-1], ids[1:], [float(m) for m in mask[1:]], list(range(len(ids) - 1)))
          for ids, mask in ex]
  assert sorted(found) == sorted(want)
  assert stats["rows"] < 20  # it really packed


def test_packing_truncates_and_reports_overlong():
  rows, stats = packing.pack([([1] * 100, [1] * 100), ([2] * 5, [1] * 5)], 32)
  assert stats["truncated"] == 1
  assert rows["segment_ids"].max() >= 1
  with pytest.raises(ValueError, match="mask entries"):
    packing.pack([([1, 2, 3], [1, 1])], 8)


def test_packing_is_first_fit_decreasing():
  # The reference: each conversation, longest first, into the first row with room.
  rng = np.random.RandomState(0)
  for n, seq_len in [(1, 16), (40, 64), (700, 128)]:
    lens = np.clip(rng.lognormal(np.log(seq_len / 6), 1.0, n).astype(int), 2, seq_len + 4)
    ex = [(list(range(L)), [1] * L) for L in lens]
    want, free = [], []
    for i in sorted(range(n), key=lambda i: -lens[i]):
      need = min(lens[i], seq_len + 1) - 1
      r = next((r for r, f in enumerate(free) if f >= need), len(free))
      if r == len(free):
        want.append([])
        free.append(seq_len)
      want[r].append(i)
      free[r] -= need
    rows, stats = packing.pack(ex, seq_len)
    assert stats["rows"] == len(want)
    for r, members in enumerate(want):   # segments in conversation order within a row
      seg = rows["segment_ids"][r]
      assert [int((seg == k).sum()) for k in range(1, seg.max() + 1)] == \
          [min(lens[i], seq_len + 1) - 1 for i in sorted(members)]


def test_packed_loss_equals_unpacked_loss():
  ex = _examples(6, seed=3)
  model = qwen3.create_model(CFG, seed=1)
  graphdef, params = nnx.split(model, nnx.Param)
  rows, _ = packing.pack(ex, 64)
  packed = sft_ts._nll_sum(graphdef, params, {k: jnp.asarray(v) for k, v in rows.items()}, 16)
  total = 0.0
  for ids, mask in ex:
    one, _ = packing.pack([(ids, mask)], len(ids) - 1)
    total += sft_ts._nll_sum(graphdef, params, {k: jnp.asarray(v) for k, v in one.items()}, 16)
  np.testing.assert_allclose(packed, total, rtol=1e-5)


def test_sft_step_micro_batch_invariant():
  ex = _examples(24, seed=5)
  rows, stats = packing.pack(ex, 32)
  n = stats["rows"] - stats["rows"] % 4
  batch = {k: v[:n] for k, v in rows.items()}
  out = {}
  for micro in (1, 4):
    model = qwen3.create_model(CFG, seed=2)
    tx = optax.sgd(1.0)
    graphdef, state, _ = core.init_train_state(model, tx)
    step = sft_ts.make_sft_step(graphdef, tx, core.StepConfig(micro_batches=micro,
                                                              logprob_chunk=16), donate=False)
    new, m = step(state, batch)
    out[micro] = (jax.device_get(m), new.params)
  np.testing.assert_allclose(out[4][0]["loss"], out[1][0]["loss"], rtol=1e-5)
  for (p, a), (_, b) in zip(nnx.to_flat_state(out[1][1]), nnx.to_flat_state(out[4][1])):
    np.testing.assert_allclose(b.get_value(), a.get_value(), atol=1e-6, err_msg=str(p))
