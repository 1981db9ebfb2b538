"""The pieces of the parallel export that need no second process: the byte-balanced
plan of who writes which tensors (against a brute-force search over every contiguous
split), and the streamed safetensors file (read back by safetensors itself)."""
import itertools

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from rstar_jax.model import hf_io


def _best_max_share(sizes, processes):
  """The smallest possible largest share over every contiguous split (brute force)."""
  n = len(sizes)
  best = None
  for cuts in itertools.combinations_with_replacement(range(n + 1), processes - 1):
    edges = [0, *cuts, n]
    worst = max(sum(sizes[a:b]) for a, b in zip(edges, edges[1:]))
    best = worst if best is None else min(best, worst)
  return best


@pytest.mark.parametrize("seed", range(12))
def test_plan_covers_every_tensor_once_in_order_and_balances_the_shares(seed):
  rng = np.random.RandomState(seed)
  sizes = [int(s) for s in rng.randint(1, 100, size=rng.randint(1, 9))]
  processes = int(rng.randint(1, 4))
  limit = int(rng.choice([10, 60, 10_000]))
  files = hf_io.plan_shares(sizes, processes, limit)
  flat = [i for _, positions in files for i in positions]
  assert flat == list(range(len(sizes)))                  # each once, in HF order
  owners = [p for p, _ in files]
  assert owners == sorted(owners) and set(owners) <= set(range(processes))
  for _, positions in files:   # a file over the limit holds one tensor alone
    assert sum(sizes[i] for i in positions) <= limit or len(positions) == 1
  share = [sum(sizes[i] for p, pos in files if p == q for i in pos) for q in range(processes)]
  assert max(share) <= _best_max_share(sizes, processes) + max(sizes)
  assert files == hf_io.plan_shares(list(sizes), processes, limit)   # deterministic


def test_one_process_plans_the_files_save_hf_writes():
  sizes = [40, 10, 10, 30, 5, 25]
  assert hf_io.plan_shares(sizes, 1, 50) == [(0, [0, 1]), (0, [2, 3, 4]), (0, [5])]


def test_plan_refuses_no_processes():
  with pytest.raises(ValueError, match="processes must be >= 1, got 0"):
    hf_io.plan_shares([1, 2], 0, 10)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_streamed_shard_is_a_safetensors_file_in_any_write_order(tmp_path, dtype):
  rng = np.random.RandomState(0)
  np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16,
              "float16": np.float16}[dtype]
  tensors = {"a.weight": rng.randn(3, 5), "b.weight": rng.randn(7), "c.weight": rng.randn(2, 2, 3)}
  tensors = {k: v.astype(np_dtype) for k, v in tensors.items()}
  path = str(tmp_path / "model-00001-of-00001.safetensors")
  shard = hf_io._StreamedShard(path, [(k, v.shape) for k, v in tensors.items()], dtype)
  for name in ("c.weight", "a.weight", "b.weight"):   # not the header's order
    shard.write(name, tensors[name])
  shard.close()
  back = load_file(path)
  assert sorted(back) == sorted(tensors)
  for k, v in tensors.items():
    assert back[k].dtype == v.dtype and back[k].shape == v.shape
    np.testing.assert_array_equal(back[k].view(np.uint8), v.view(np.uint8))
  with safe_open(path, framework="np") as f:
    assert f.metadata() == {"format": "pt"}   # transformers checks it


def test_streamed_shard_refuses_a_tensor_of_other_size_and_reports_missing_ones(tmp_path):
  shard = hf_io._StreamedShard(str(tmp_path / "x.safetensors"),
                               [("a", (2, 3)), ("b", (4,))], "float32")
  with pytest.raises(ValueError, match=r"tensor a has 16 bytes, planned 24"):
    shard.write("a", np.zeros((2, 2), np.float32))
  shard.write("a", np.zeros((2, 3), np.float32))
  with pytest.raises(RuntimeError, match=r"1 tensor\(s\) never written, e.g. b"):
    shard.close()
