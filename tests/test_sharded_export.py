"""Every trainer process writes its share of an export (`save_hf(parallel=True)`, the
weight sync's `DiskWeightSync.publish`): 2 real JAX processes x 4 CPU devices (loopback
gloo) run tests/sharded_export_worker.py, against references this process computes
alone:

  * `distributed.gather_to` gives the writer the whole array (numpy's value) and the
    others nothing, under shardings that do and do not span the processes;
  * the sharded export equals the single-process export tensor by tensor, its index is
    HF's (every tensor in exactly one file, total_size), transformers loads it with the
    single-process export's logits and ours;
  * each process opened for writing only its own shard files (Python's audit hook);
  * a write failing on one process raises on every process, and leaves no index;
  * our rollout server, updated by the 2-process publish, serves the new weights.
"""
import asyncio
import json
import os
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from rstar_jax.model import hf_io, qwen3
from rstar_jax.model.model_config import Qwen3Config
from sandbox.launcher import free_port
from tests import procs
from tests.model import hf_fixtures
from tests.rollout.conftest import SERVER_BUCKET, SERVER_MAX_LEN, SERVER_SLOTS, ServerProcess
from tests import sharded_export_worker as worker

WORKER = os.path.join(os.path.dirname(__file__), "sharded_export_worker.py")
CFG = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  initializer_range=0.3)
PROCESSES = 2
SHARD = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")


def _run_job(out: str, ref: str, server: str) -> None:
  port = free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=procs.xla_flags(
      f"--xla_force_host_platform_device_count={8 // PROCESSES}"))
  env.pop("JAX_COORDINATOR_ADDRESS", None)
  args = ["--out", out, "--hf_dir", ref, "--server", server, "--num_processes",
          str(PROCESSES), "--port", str(port), "--compile_cache",
          os.path.join(os.path.dirname(out), "cache")]
  workers = [subprocess.Popen([sys.executable, WORKER, *args, "--process_id", str(i)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(PROCESSES)]
  logs = []
  try:
    for p in workers:
      logs.append(p.communicate(timeout=900)[0])
  finally:
    for p in workers:
      p.kill()
  for i, (p, log) in enumerate(zip(workers, logs)):
    assert p.returncode == 0, f"process {i} of {PROCESSES} failed:\n{log[-4000:]}"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
  root = tmp_path_factory.mktemp("sharded_export")
  model = qwen3.create_model(CFG, seed=3)
  ref = {dtype: str(root / f"ref_{dtype}") for dtype in ("float32", "bfloat16")}
  for dtype, path in ref.items():   # the single-process export: the reference
    hf_io.save_hf(model, path, dtype=dtype)
  old = qwen3.create_model(CFG, seed=4)
  hf_io.save_hf(old, str(root / "served0"), dtype="float32")
  server = ServerProcess(str(root / "served0"), str(root), "sharded_export")
  out = root / "job"
  out.mkdir()
  try:
    _run_job(str(out), ref["float32"], server.url)
    yield {"root": root, "out": out, "ref": ref, "model": model, "old": old,
           "server": server}
  finally:
    server.kill()


def _tensors(hf_dir) -> dict[str, np.ndarray]:
  out = {}
  for f in sorted(os.listdir(hf_dir)):
    if f.endswith(".safetensors"):
      part = load_file(os.path.join(hf_dir, f))
      assert not set(part) & set(out), f
      out.update(part)
  return out


def _bits(a: np.ndarray) -> np.ndarray:
  return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def test_gather_to_gives_the_whole_array_to_its_process_alone(job):
  got = [np.load(job["out"] / f"gather_{i}.npz") for i in range(PROCESSES)]
  reports = [json.loads((job["out"] / f"gather_{i}.json").read_text())
             for i in range(PROCESSES)]
  # The mesh's data axis spans the processes: these cases need blocks from the other
  # process, those do not (a gather that moved nothing would pass only the latter).
  for w in range(PROCESSES):
    for name in ("across_all", "across_processes", "bf16_2d"):
      assert reports[0]["lacks_blocks"][f"{name}/{w}"], name
    for name in ("within_process", "replicated"):
      assert not reports[0]["lacks_blocks"][f"{name}/{w}"], name
  for name in worker.GATHER_CASES:
    want = worker.case_value(name).astype(np.float32)
    for w in range(PROCESSES):
      for p in range(PROCESSES):
        key = f"{name}/{w}"
        if p == w:
          np.testing.assert_array_equal(got[p][key], want, err_msg=key)
        else:
          assert key in reports[p]["none"] and key not in got[p].files, (key, p)


def _check_index(hf_dir) -> dict[str, str]:
  files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
  index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
  weight_map = index["weight_map"]
  n = len(files)
  assert n >= PROCESSES
  assert [SHARD.fullmatch(f).groups() for f in files] == [
      (f"{k:05d}", f"{n:05d}") for k in range(1, n + 1)]
  assert sorted(set(weight_map.values())) == files
  total = 0
  for f in files:   # every tensor in exactly one file, the one the index names
    tensors = load_file(os.path.join(hf_dir, f))
    assert sorted(tensors) == sorted(k for k, v in weight_map.items() if v == f), f
    total += sum(t.nbytes for t in tensors.values())
  assert index["metadata"]["total_size"] == total
  assert not [f for f in os.listdir(hf_dir) if f.endswith(".tmp")]
  return weight_map


def test_sharded_exports_equal_the_single_process_export(job):
  for got_dir, dtype in ((job["out"] / "hf_f32", "float32"),
                         (job["out"] / "sync" / "step-7", "bfloat16")):
    ref_dir = job["ref"][dtype]
    weight_map = _check_index(got_dir)
    ref, got = _tensors(ref_dir), _tensors(got_dir)
    assert sorted(weight_map) == sorted(got) == sorted(ref)
    for name, want in ref.items():   # the same values, bit for bit, and dtype
      assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
      np.testing.assert_array_equal(_bits(got[name]), _bits(want), err_msg=name)
    assert (json.loads((got_dir / "config.json").read_text())
            == json.loads(open(os.path.join(ref_dir, "config.json")).read()))
  # float32 in files of at most 40 kB: several per process.
  assert len(os.listdir(job["out"] / "hf_f32")) - 2 > PROCESSES


def test_the_default_export_from_two_processes_is_the_single_process_file(job):
  got, ref = job["out"] / "hf_serial", job["ref"]["float32"]
  assert sorted(os.listdir(got)) == sorted(os.listdir(ref)) == ["config.json",
                                                                 "model.safetensors"]
  for name in os.listdir(ref):
    assert (got / name).read_bytes() == open(os.path.join(ref, name), "rb").read(), name


def test_each_process_opened_only_its_own_shard_files(job):
  opened = [json.loads((job["out"] / f"opened_{i}.json").read_text())
            for i in range(PROCESSES)]
  shards = {}
  for d, prefix in (("hf_f32", "hf_f32"), (os.path.join("sync", "step-7"), "sync/step-7.tmp-")):
    weight_map = json.loads((job["out"] / d / "model.safetensors.index.json").read_text())[
        "weight_map"]
    files = set(weight_map.values())
    sizes = {f: os.path.getsize(job["out"] / d / f) for f in files}
    mine = []
    for i, o in enumerate(opened):
      paths = {p for p in o["opened"] if p.startswith(prefix)}
      names = {os.path.basename(p)[:-len(".tmp")] for p in paths if p.endswith(".tmp")}
      mine.append({n for n in names if SHARD.fullmatch(n)})
    for i in range(PROCESSES):
      assert mine[i], f"process {i} wrote no file of {d}"
      for j in range(i):
        assert not mine[i] & mine[j], (d, i, j)
    assert set().union(*mine) == files, d
    # The shares are balanced by bytes: apart by at most the largest tensor.
    share = [sum(sizes[f] for f in m) for m in mine]
    biggest = max(t.nbytes for t in _tensors(job["out"] / d).values())
    assert max(share) - min(share) <= biggest + 4096, (d, share)
    shards[d] = mine
  assert sorted(shards["hf_f32"][0]) == sorted(opened[0]["returned"])
  assert sorted(shards["hf_f32"][1]) == sorted(opened[1]["returned"])
  # The index and config.json are process 0's alone.
  for name in ("model.safetensors.index.json.tmp", "config.json.tmp"):
    assert any(p.endswith(name) for p in opened[0]["opened"]), name
    assert not any(p.endswith(name) for p in opened[1]["opened"]), name


def test_a_write_failing_on_one_process_raises_on_every_process(job):
  failures = [json.loads((job["out"] / f"opened_{i}.json").read_text())["failure"]
              for i in range(PROCESSES)]
  last = PROCESSES - 1
  assert failures[last].startswith("OSError: [Errno 28] No space left on device (injected)")
  for i in range(last):
    assert failures[i] == (f"RuntimeError: save_hf {job['out'] / 'hf_fail'}: process {last} "
                           f"failed (OSError: [Errno 28] No space left on device (injected): "
                           f"'{job['out'] / 'hf_fail'}/model-00002-of-00002.safetensors.tmp')"
                           ), failures[i]
  # Nothing that looks complete is left: no config.json, no index.
  assert not {"config.json", "model.safetensors.index.json"} & set(
      os.listdir(job["out"] / "hf_fail"))


def test_transformers_loads_the_sharded_export_with_the_same_logits(job):
  transformers = pytest.importorskip("transformers")
  tokens = np.random.RandomState(5).randint(0, CFG.vocab_size, size=(2, 10))
  ours = np.asarray(qwen3.forward_logits(job["model"], jnp.asarray(tokens)))
  sharded = transformers.Qwen3ForCausalLM.from_pretrained(
      str(job["out"] / "hf_f32"), dtype="float32").eval()
  single = transformers.Qwen3ForCausalLM.from_pretrained(
      job["ref"]["float32"], dtype="float32").eval()
  got = hf_fixtures.torch_logits(sharded, tokens)
  np.testing.assert_array_equal(got, hf_fixtures.torch_logits(single, tokens))
  assert np.abs(got - ours).max() <= 1e-4   # torch against XLA: another program
  # Our loader reads the index: the model it builds gives our logits, bit for bit.
  again = hf_io.load_hf(str(job["out"] / "hf_f32"))
  np.testing.assert_array_equal(
      np.asarray(qwen3.forward_logits(again, jnp.asarray(tokens))), ours)


def test_the_rollout_server_serves_the_version_two_processes_published(job):
  from rstar_jax.rollout.sglang import engine as se
  from rstar_jax.rollout.sglang import transport
  from rstar_jax.rollout.engine import GenerationRequest
  from rstar_jax.rollout.jax_engine import EngineConfig, JaxEngine
  metrics = json.loads((job["out"] / "opened_0.json").read_text())["metrics"]
  assert metrics["sync/servers"] == 1.0 and metrics["sync/gb"] > 0
  assert metrics["sync/write_s"] > 0 and metrics["sync/total_s"] >= metrics["sync/write_s"]
  published = str(job["out"] / "sync" / "step-7")
  [eng] = se.connect([job["server"].url], config=transport.ClientConfig(
      backoff_s=0.05, backoff_max_s=0.2, retries=2))
  reqs = [GenerationRequest(input_ids=[5 + i, 9, 40 + i], max_new_tokens=8, seed=i,
                            temperature=1.0, request_id=f"s{i}") for i in range(2)]

  async def gen_all():
    return await asyncio.gather(*(eng.generate(r) for r in reqs))
  try:
    info = eng.get_model_info()
    assert info["weight_version"] == "step-7" and info["model_path"] == published
    served = asyncio.run(gen_all())
  finally:
    eng.stop()
  assert {r.weight_version for r in served} == {"step-7"}
  engine_cfg = EngineConfig(num_slots=SERVER_SLOTS, max_len=SERVER_MAX_LEN,
                            min_prefill_bucket=SERVER_BUCKET)
  refs = {}
  for name, path in (("new", job["ref"]["bfloat16"]), ("old", str(job["root"] / "served0"))):
    local = JaxEngine(hf_io.load_hf(path), engine_cfg, name=name)
    try:
      refs[name] = local.generate_sync(reqs)
    finally:
      local.stop()
  for got, new, old in zip(served, refs["new"], refs["old"]):
    assert got.output_ids == new.output_ids
    np.testing.assert_allclose(got.logprobs, new.logprobs, atol=1e-5, rtol=0)
    assert got.logprobs != old.logprobs
