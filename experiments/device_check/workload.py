"""What the device check's sections run on, and where: the model slice and its sizes
(from the command's flags), the mesh over every device, the device's peak bytes, the
matmul peaks the env section measured, the 14B config's attention on this device, the
repository root and the scratch directory shared by the driver and its sections."""
from __future__ import annotations

import os
import tempfile
from typing import Any

from absl import flags

FLAGS = flags.FLAGS


def slice_config(**overrides):
  """The model the sections run: Qwen3-14B's per-layer shapes with --layers layers, as
  the 14B recipe config runs it (fp32 master weights, bf16 compute, full remat,
  chunked attention); the `tiny` preset with --tiny."""
  from rstar_jax.model import model_config
  base = dict(param_dtype="float32", dtype="bfloat16", remat_policy="full",
              attention_impl="chunked", attention_chunk=1024)
  if FLAGS.tiny:
    base.update(attention_chunk=16)
    return model_config.get_preset("tiny", **dict(base, **overrides))
  overrides.setdefault("num_hidden_layers", FLAGS.layers)
  return model_config.get_preset("qwen3-14b", **dict(base, **overrides))


def sizes() -> dict[str, Any]:
  if FLAGS.tiny:
    return dict(numerics_batch=2, numerics_seq=32, train_seqs=[64, 96], train_batch=1,
                logprob_chunk=16, slots=min(FLAGS.slots, 8), prompt=16, new_tokens=8,
                matmul_n=512, bandwidth_mb=64, trajectories=4, think_tokens=8)
  return dict(numerics_batch=2, numerics_seq=1024, train_seqs=[int(s) for s in FLAGS.seq_lens],
              train_batch=1, logprob_chunk=512, slots=FLAGS.slots, prompt=512,
              new_tokens=128, matmul_n=8192, bandwidth_mb=4096, trajectories=16,
              think_tokens=32)


def on_accelerator() -> bool:
  import jax
  return jax.devices()[0].platform != "cpu"


def make_mesh():
  import jax

  from rstar_jax import sharding
  return sharding.make_mesh({"fsdp": len(jax.devices())})


def device_peak_bytes() -> int | None:
  import jax
  stats = jax.devices()[0].memory_stats()
  return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def matmul_peaks(ctx: dict[str, Any], n_dev: int) -> dict[str, float]:
  """GFLOP/s of the whole mesh: measured (env section) and the data sheet's."""
  env = ctx.get("env", {})
  peaks = {}
  if env.get("matmul_peak_gflops"):
    peaks["measured"] = env["matmul_peak_gflops"] * n_dev
  if env.get("data_sheet"):
    peaks["data_sheet"] = env["data_sheet"]["bf16_tflops"] * 1e3 * n_dev
  return peaks


def own_attention() -> str:
  """The 14B config's attention_impl resolved on this device ("auto": "dot_product" on an
  NVIDIA GPU in bf16, "chunked" elsewhere)."""
  from experiments.configs import rstar2_agent_14b
  from rstar_jax.model import qwen3
  return qwen3.resolve_attention_impl(rstar2_agent_14b.get_config().model.attention_impl,
                                      "float32" if FLAGS.tiny else "bfloat16")


def repo_root() -> str:
  """The repository's root (this file is experiments/device_check/workload.py)."""
  return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


_SCRATCH: list[str] = []


def scratch_dir() -> str:
  """--scratch, or a temporary directory made once per driver (its children get it)."""
  if FLAGS.scratch:
    os.makedirs(FLAGS.scratch, exist_ok=True)
    return FLAGS.scratch
  if not _SCRATCH:
    _SCRATCH.append(tempfile.mkdtemp(prefix="device_check_"))
  return _SCRATCH[0]
