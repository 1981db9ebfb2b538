"""Broken sharded HF checkpoints: errors name the shard file and the tensor (no raw safetensors errors)."""
import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from rstar_jax import sharding
from rstar_jax.model import hf_io, qwen3
from rstar_jax.model.model_config import Qwen3Config

CFG = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8)
INDEX = "model.safetensors.index.json"
VICTIM = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def _intact(tmp_path_factory) -> str:
  """A tiny checkpoint written by save_hf as several shards plus an index (built once)."""
  out = str(tmp_path_factory.mktemp("intact") / "ckpt")
  hf_io.save_hf(qwen3.create_model(CFG), out, dtype="float32", max_shard_bytes=4_000)
  with open(os.path.join(out, INDEX)) as f:
    assert len(set(json.load(f)["weight_map"].values())) > 2  # really sharded
  hf_io.load_hf(out)  # loads while intact
  return out


@pytest.fixture
def ckpt(_intact, tmp_path) -> str:
  """A private copy of the intact checkpoint, for a test to break."""
  return shutil.copytree(_intact, str(tmp_path / "ckpt"))


def _weight_map(d):
  with open(os.path.join(d, INDEX)) as f:
    return json.load(f)["weight_map"]


def _drop_from_shard(d) -> str:
  """Removes VICTIM from its shard file (the index still lists it there); returns the shard."""
  shard = _weight_map(d)[VICTIM]
  path = os.path.join(d, shard)
  tensors = load_file(path)
  del tensors[VICTIM]
  if not tensors:  # keep the shard a valid safetensors file
    tensors["unrelated.weight"] = np.zeros(1, np.float32)
  save_file(tensors, path, metadata={"format": "pt"})
  return shard


def test_index_lists_tensor_its_shard_lacks(ckpt):
  d = ckpt
  shard = _drop_from_shard(d)
  for call in (lambda: hf_io.load_hf(d), lambda: hf_io.check_checkpoint(d)):
    with pytest.raises(hf_io.CheckpointError) as e:
      call()
    msg = str(e.value)
    assert f"shard file {os.path.join(d, shard)} lacks tensor {VICTIM}" in msg
    assert INDEX in msg


def test_index_remapped_to_wrong_shard_is_named(ckpt):
  d = ckpt
  weight_map = _weight_map(d)
  other = next(f for f in sorted(set(weight_map.values())) if f != weight_map[VICTIM])
  weight_map[VICTIM] = other
  with open(os.path.join(d, INDEX), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  with pytest.raises(hf_io.CheckpointError, match=f"{other} lacks tensor {VICTIM}"):
    hf_io.load_hf(d)


def test_mesh_path_names_shard_and_tensor(ckpt, monkeypatch):
  # The mesh path reads through make_array_from_callback / get_slice; skip the up-front
  # check so that the callback itself meets the broken shard.
  d = ckpt
  shard = _drop_from_shard(d)
  monkeypatch.setattr(hf_io, "check_checkpoint", lambda *a, **k: None)
  mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
  with pytest.raises(hf_io.CheckpointError) as e:
    hf_io.load_hf(d, mesh=mesh)
  assert f"shard file {os.path.join(d, shard)} lacks tensor {VICTIM}" in str(e.value)


def test_missing_shard_file_is_named(ckpt):
  d = ckpt
  shard = _weight_map(d)[VICTIM]
  os.remove(os.path.join(d, shard))
  with pytest.raises(hf_io.CheckpointError) as e:
    hf_io.load_hf(d)
  msg = str(e.value)
  assert f"shard file(s) ['{shard}'] listed in the index do not exist" in msg
  assert INDEX in msg and "tensor model." in msg


def test_corrupt_shard_file_is_named(ckpt):
  d = ckpt
  shard = _weight_map(d)[VICTIM]
  with open(os.path.join(d, shard), "wb") as f:
    f.write(b"not a safetensors file")
  with pytest.raises(hf_io.CheckpointError,
                     match=f"{shard}: cannot read as safetensors"):
    hf_io.load_hf(d)


def test_index_without_weight_map_is_named(ckpt):
  d = ckpt
  with open(os.path.join(d, INDEX), "w") as f:
    json.dump({"weight_map": ["not", "a", "dict"]}, f)
  with pytest.raises(hf_io.CheckpointError, match="'weight_map' must map tensor names"):
    hf_io.load_hf(d)


@pytest.mark.parametrize("edit, message", [
    ({"rope_theta": None, "rope_parameters": None}, "rope_theta must be a number, got None"),
    ({"rms_norm_eps": "1e-6x"}, "rms_norm_eps must be a number, got '1e-6x'"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
    ({"rope_parameters": [1]}, r"rope_parameters must be an object or null, got \[1\]"),
    ({"rope_scaling": "yarn"}, "rope_scaling must be an object or null, got 'yarn'"),
])
def test_config_json_fields_of_the_wrong_type_are_named(edit, message):
  """A wrong-typed config.json field names the file and the field (it was a bare
  TypeError / ValueError, and "false" silently tied the embeddings)."""
  d = dict(hf_io.config_to_hf_dict(CFG, "float32"), **edit)
  with pytest.raises(hf_io.CheckpointError, match="my/config.json: " + message):
    hf_io.config_from_hf_dict(d, where="my/config.json")
  with pytest.raises(hf_io.CheckpointError, match="expected a JSON object, got list"):
    hf_io.config_from_hf_dict([d], where="my/config.json")
  assert hf_io.config_from_hf_dict(hf_io.config_to_hf_dict(CFG, "float32")) == CFG
