"""Logit parity with transformers' Qwen3ForCausalLM (torch, CPU, fp32)."""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from rstar_jax.model import hf_io, qwen3
from tests.model import hf_fixtures

transformers = pytest.importorskip("transformers")
TOL = 1e-4


@pytest.mark.parametrize("tied,heads,kv_heads", [
    (False, 4, 2),   # GQA, query/KV ratio 2
    (True, 4, 4),    # MHA, ratio 1, tied embeddings
    (True, 6, 2),    # ratio 3
])
def test_logits_match_transformers(tmp_path, tied, heads, kv_heads):
  hf = hf_fixtures.make_hf_model(str(tmp_path), tie_word_embeddings=tied,
                                 num_attention_heads=heads, num_key_value_heads=kv_heads)
  model = hf_io.load_hf(str(tmp_path))
  assert model.cfg.tie_word_embeddings == tied
  tokens = np.random.RandomState(1).randint(0, 97, size=(2, 13))
  ours = np.asarray(qwen3.forward_logits(model, jnp.asarray(tokens)))
  ref = hf_fixtures.torch_logits(hf, tokens)
  assert np.abs(ours - ref).max() <= TOL


def test_padding_left_and_right(tmp_path):
  hf = hf_fixtures.make_hf_model(str(tmp_path))
  model = hf_io.load_hf(str(tmp_path))
  rng = np.random.RandomState(2)
  tokens = rng.randint(0, 97, size=(3, 11))
  mask = np.ones((3, 11), np.int64)
  mask[0, 8:] = 0    # right padding
  mask[1, :4] = 0    # left padding
  positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
  ref = hf_fixtures.torch_logits(hf, tokens, mask, positions)
  ours = np.asarray(qwen3.forward_logits(model, jnp.asarray(tokens), jnp.asarray(positions),
                                         jnp.asarray(mask)))
  valid = mask.astype(bool)
  assert np.abs(ours[valid] - ref[valid]).max() <= TOL
  # Unpadded row 0 alone must give the same logits as inside the padded batch.
  alone = np.asarray(qwen3.forward_logits(model, jnp.asarray(tokens[:1, :8])))
  assert np.abs(alone[0] - ours[0, :8]).max() <= TOL


def test_packed_segments_equal_separate_sequences(tmp_path):
  hf_fixtures.make_hf_model(str(tmp_path))
  model = hf_io.load_hf(str(tmp_path))
  rng = np.random.RandomState(3)
  a, b = rng.randint(0, 97, size=5), rng.randint(0, 97, size=7)
  packed = np.concatenate([a, b, [0, 0]])[None]
  seg = np.array([[1] * 5 + [2] * 7 + [0, 0]])
  pos = np.array([list(range(5)) + list(range(7)) + [0, 0]])
  out = np.asarray(qwen3.forward_logits(model, jnp.asarray(packed), jnp.asarray(pos),
                                        jnp.asarray(seg)))
  la = np.asarray(qwen3.forward_logits(model, jnp.asarray(a[None])))
  lb = np.asarray(qwen3.forward_logits(model, jnp.asarray(b[None])))
  assert np.abs(out[0, :5] - la[0]).max() <= TOL
  assert np.abs(out[0, 5:12] - lb[0]).max() <= TOL


def test_sharded_index_and_transformers4_config(tmp_path):
  hf = hf_fixtures.make_hf_model(str(tmp_path), max_shard_size="20KB")
  assert os.path.exists(tmp_path / "model.safetensors.index.json")
  hf_fixtures.rewrite_config_transformers4(str(tmp_path))
  cfg = hf_io.load_config(str(tmp_path))
  assert cfg.rope_theta == 10_000.0
  model = hf_io.load_hf(str(tmp_path))
  tokens = np.random.RandomState(4).randint(0, 97, size=(1, 9))
  ours = np.asarray(qwen3.forward_logits(model, jnp.asarray(tokens)))
  assert np.abs(ours - hf_fixtures.torch_logits(hf, tokens)).max() <= TOL


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_jax_to_hf_dir_to_transformers(tmp_path, tied):
  cfg = qwen3.Qwen3Config(vocab_size=89, hidden_size=32, intermediate_size=40,
                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, tie_word_embeddings=tied, rope_theta=5_000.0,
                          initializer_range=0.2)
  model = qwen3.create_model(cfg, seed=7)
  out = str(tmp_path / "export")
  hf_io.save_hf(model, out, dtype="float32", max_shard_bytes=30_000)
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["tie_word_embeddings"] == tied
  hf = transformers.Qwen3ForCausalLM.from_pretrained(out, dtype="float32").eval()
  tokens = np.random.RandomState(5).randint(0, 89, size=(2, 10))
  ours = np.asarray(qwen3.forward_logits(model, jnp.asarray(tokens)))
  assert np.abs(ours - hf_fixtures.torch_logits(hf, tokens)).max() <= TOL
  # And back into JAX: identical parameters.
  again = hf_io.load_hf(out)
  again_logits = np.asarray(qwen3.forward_logits(again, jnp.asarray(tokens)))
  np.testing.assert_array_equal(again_logits, ours)


def test_export_streams_one_layer_slice_and_one_shard_at_a_time(tmp_path, monkeypatch):
  """save_hf gathers one tensor (one layer's slice of a stacked parameter) at a time and
  holds at most one shard on the host: what lets a sharded model be written for weight
  sync without gathering all of it."""
  cfg = qwen3.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=40,
                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, tie_word_embeddings=False)
  model = qwen3.create_model(cfg, seed=1)
  gathered, shards = [], []
  real_value, real_save = hf_io._hf_value, hf_io.save_file

  def value(var, layer, kind, dtype):
    out = real_value(var, layer, kind, dtype)
    gathered.append((layer, out.nbytes, var.get_value().nbytes))
    return out

  def save(tensors, path, metadata=None):
    shards.append(sum(a.nbytes for a in tensors.values()))
    return real_save(tensors, path, metadata=metadata)

  monkeypatch.setattr(hf_io, "_hf_value", value)
  monkeypatch.setattr(hf_io, "save_file", save)
  limit = 12_000
  hf_io.save_hf(model, str(tmp_path / "x"), dtype="float32", max_shard_bytes=limit)
  layered = [g for g in gathered if g[0] is not None]
  assert len(layered) == 11 * 3 and all(got * 3 == whole for _, got, whole in layered)
  biggest = max(got for _, got, _ in gathered)
  assert len(shards) > 3 and all(b <= max(limit, biggest) for b in shards)
  assert sum(shards) == sum(got for _, got, _ in gathered)
  np.testing.assert_array_equal(
      np.asarray(qwen3.forward_logits(hf_io.load_hf(str(tmp_path / "x")), jnp.ones((1, 4), int))),
      np.asarray(qwen3.forward_logits(model, jnp.ones((1, 4), int))))


def test_bf16_export_loads_in_transformers(tmp_path):
  cfg = qwen3.Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=24,
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=8)
  model = qwen3.create_model(cfg)
  hf_io.save_hf(model, str(tmp_path), dtype="bfloat16")
  hf = transformers.Qwen3ForCausalLM.from_pretrained(str(tmp_path))
  assert next(hf.parameters()).dtype.__repr__() == "torch.bfloat16"


@pytest.mark.parametrize("first_shard, second_shard", [(20_000, 10**9), (10**9, 20_000)])
def test_an_export_over_another_with_other_shards_leaves_only_its_own(tmp_path, first_shard,
                                                                       second_shard):
  # A re-export over a single file with shards (or the other way round) kept the old
  # files: transformers read model.safetensors, load_hf the index, each other weights.
  cfg = qwen3.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=40,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8)
  old, new = qwen3.create_model(cfg, seed=1), qwen3.create_model(cfg, seed=2)
  out = str(tmp_path / "export")
  hf_io.save_hf(old, out, dtype="float32", max_shard_bytes=first_shard)
  hf_io.save_hf(new, out, dtype="float32", max_shard_bytes=second_shard)
  single = second_shard > 10**6
  weights = sorted(f for f in os.listdir(out) if f.startswith("model"))
  assert (weights == ["model.safetensors"]) if single else (
      "model.safetensors" not in weights and "model.safetensors.index.json" in weights)
  tokens = np.arange(8)[None]
  want = np.asarray(qwen3.forward_logits(new, jnp.asarray(tokens)))
  np.testing.assert_array_equal(
      np.asarray(qwen3.forward_logits(hf_io.load_hf(out), jnp.asarray(tokens))), want)
  hf = transformers.Qwen3ForCausalLM.from_pretrained(out, dtype="float32").eval()
  assert np.abs(hf_fixtures.torch_logits(hf, tokens) - want).max() <= TOL


@pytest.mark.parametrize("heads", [32, 4])
def test_a_config_without_kv_heads_reads_as_transformers_reads_it(tmp_path, heads):
  """A hand-written config.json without num_key_value_heads: transformers takes its
  default, 32 (null means one per head). We read 32 heads too, or refuse where 32 kv
  heads cannot serve the query heads; before, we silently read `num_attention_heads`."""
  import json
  import transformers
  d = {"model_type": "qwen3", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
       "num_hidden_layers": 1, "num_attention_heads": heads, "head_dim": 8}
  (tmp_path / "config.json").write_text(json.dumps(d))
  theirs = transformers.AutoConfig.from_pretrained(str(tmp_path)).num_key_value_heads
  assert theirs == 32
  if heads == 32:
    assert hf_io.load_config(str(tmp_path)).num_key_value_heads == theirs
  else:
    with pytest.raises(hf_io.CheckpointError, match="num_key_value_heads"):
      hf_io.load_config(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps(dict(d, num_key_value_heads=None)))
  assert hf_io.load_config(str(tmp_path)).num_key_value_heads == heads == (
      transformers.AutoConfig.from_pretrained(str(tmp_path)).num_key_value_heads)
