r"""python -m experiments.gpu_smoke --preset qwen3-0.6b --batch 8 --seq 1024

The train step alone, on any preset and any mesh of one or many hosts (the whole
device check of one host is `experiments/device_check/`): lists the devices
JAX sees, builds a mesh over all of them (`--mesh`, fsdp over every device by default),
runs the sharded GRPO train step (the RL trainer's own step: policy-gradient loss,
AdamW update) of a Qwen3 on a random batch, and prints tokens/s and model FLOPs
utilisation: the model's FLOPs (6N + attention per token) over the step time, against the peak
(`--peak_tflops` per device, or the dense matmul peak measured here in the same run),
and on a known accelerator also against its data sheet's dense bf16 peak.

  --tiny   a 2-layer x 64 model, batch 4 x 64 tokens, float32: runs on a CPU in
           seconds (CI runs it this way).

Compute dtype is bfloat16 on accelerators (parameters and optimizer state stay float32),
float32 on CPU. Exit status 0 with a finite loss is the smoke test passing.
"""
import os
import sys

from absl import app
from absl import flags

from experiments.common import results_json
from experiments.common import roofline
from experiments.common import step_timing

flags.DEFINE_string("preset", "qwen3-0.6b", "model preset (rstar_jax.model.model_config.PRESETS)")
flags.DEFINE_integer("batch", 8, "trajectories per step")
flags.DEFINE_integer("seq", 1024, "tokens per trajectory (prompt + response)")
flags.DEFINE_integer("steps", 5, "timed steps (after one compile step)", lower_bound=1)
flags.DEFINE_integer("micro_batches", 1, "gradient-accumulation steps per update",
                     lower_bound=1)
flags.DEFINE_string("mesh", "fsdp=-1", "mesh axes, e.g. 'fsdp=-1' or 'data=2,fsdp=4,tensor=1'")
flags.DEFINE_float("peak_tflops", 0.0, "per-device dense peak for MFU (0: measure a matmul)")
flags.DEFINE_string("remat", "", "override the model's remat_policy (e.g. full)")
flags.DEFINE_boolean("tiny", False, "CPU-sized model and batch (CI)")
flags.DEFINE_string("out", "", "JSON output (default: print only)")
flags.DEFINE_string("coordinator_address", "", "multi-host: process 0's host:port (or "
                    "JAX_COORDINATOR_ADDRESS; SLURM is detected)")
flags.DEFINE_integer("num_processes", 0, "multi-host: processes (or JAX_NUM_PROCESSES)")
flags.DEFINE_integer("process_id", -1, "multi-host: this process (or JAX_PROCESS_ID)")
FLAGS = flags.FLAGS


def _mesh_shape(spec: str) -> dict[str, int]:
  out = {}
  for part in filter(None, (p.strip() for p in spec.split(","))):
    key, sep, value = part.partition("=")
    if not sep:
      raise ValueError(f"--mesh {spec!r}: expected axis=size pairs, got {part!r}")
    try:
      out[key.strip()] = int(value)
    except ValueError:
      raise ValueError(f"--mesh {spec!r}: the size of {key.strip()!r} must be an integer, "
                       f"got {value!r}") from None
  return out


def main(argv):
  if len(argv) > 1:
    sys.exit(f"unexpected arguments {argv[1:]}")
  from rstar_jax import distributed
  distributed.initialize(distributed.DistributedConfig(
      coordinator_address=FLAGS.coordinator_address, num_processes=FLAGS.num_processes,
      process_id=FLAGS.process_id))
  import jax

  from rstar_jax import sharding
  from rstar_jax.model import model_config
  from rstar_jax.train import step as core

  devices = jax.devices()
  accel = devices[0].platform != "cpu"
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.process_count()} "
        f"process(es), {len(devices)} device(s):")
  for d in devices[:16]:
    print(f"  {d.id}: {d.platform} {getattr(d, 'device_kind', '')}")
  if FLAGS.tiny:
    cfg = model_config.get_preset("tiny", hidden_size=64, intermediate_size=128, head_dim=16,
                                  num_hidden_layers=2, vocab_size=512)
    batch_n, seq = 4, 64
  else:
    batch_n, seq = FLAGS.batch, FLAGS.seq
  dtype = "bfloat16" if accel else "float32"
  overrides = {"dtype": dtype, "param_dtype": "float32"}
  if FLAGS.remat:
    overrides["remat_policy"] = FLAGS.remat
  try:   # a bad --preset / --remat / --mesh is one line, not a traceback
    if not FLAGS.tiny:
      cfg = model_config.get_preset(FLAGS.preset)
    cfg = cfg.replace(**overrides)
    mesh = sharding.make_mesh(_mesh_shape(FLAGS.mesh))
  except (ValueError, KeyError) as e:
    sys.exit(f"gpu_smoke: {e}")
  rows = core.batch_multiple(FLAGS.micro_batches, mesh)
  if batch_n % rows:
    sys.exit(f"--batch {batch_n} must be a multiple of {rows} (micro-batches x data x fsdp)")
  print(f"model: {FLAGS.preset if not FLAGS.tiny else 'tiny'} {cfg.num_hidden_layers} layers, "
        f"hidden {cfg.hidden_size}, {cfg.num_params / 1e6:.1f}M params, compute {dtype}; mesh "
        f"{dict(mesh.shape)}; batch {batch_n} x {seq} tokens, {FLAGS.micro_batches} micro-batch(es)")

  batch = step_timing.random_batch(cfg.vocab_size, batch_n, seq, row_multiple=rows,
                                   length_multiple=64 if not FLAGS.tiny else 8)
  try:
    timing = step_timing.time_train_step(cfg, mesh, batch=batch, steps=FLAGS.steps,
                                         micro_batches=FLAGS.micro_batches)
  except FloatingPointError as e:
    sys.exit(str(e))
  tokens = batch_n * timing.seq
  n_dev = mesh.devices.size
  sheet = step_timing.data_sheet(getattr(devices[0], "device_kind", ""))
  if FLAGS.peak_tflops:
    peak, peak_src = FLAGS.peak_tflops * 1e3 * n_dev, f"--peak_tflops x {n_dev}"
  elif accel:
    peak = roofline.matmul_peak_gflops(4096, dtype) * n_dev
    peak_src = f"measured {dtype} matmul x {n_dev} device(s)"
  else:   # host devices share the machine's cores: its peak is the whole machine's
    peak, peak_src = roofline.matmul_peak_gflops(1024, dtype), f"measured {dtype} matmul"
  peaks = {peak_src: peak}
  if sheet and accel:
    peaks[f"data sheet {sheet[0]:g} TFLOP/s x {n_dev}"] = sheet[0] * 1e3 * n_dev
  result = step_timing.as_dict(timing, peaks)
  # MFU both ways, labelled: attention FLOPs in full (PaLM; `mfu`) and causal-halved
  # (MaxText).
  result["flops_causal_attention"] = roofline.train_flops(cfg, batch_n, timing.seq, causal=True)
  result["mfu_both"] = {k: roofline.mfu_both(cfg, batch_n, timing.seq, timing.median_s, v)
                        for k, v in peaks.items()}
  achieved, med = result["achieved_gflops"], timing.median_s
  print(f"compile + first step {timing.compile_s:.1f} s; loss {timing.loss[0]:.4f} -> "
        f"{timing.loss[1]:.4f}")
  print(f"step {1e3 * med:.1f} ms (median of {FLAGS.steps}), {tokens / med:,.0f} tokens/s; "
        f"model {timing.flops / 1e12:.4f} TFLOP per step -> {achieved:,.1f} GFLOP/s; "
        + "; ".join(f"MFU {100 * v:.1f}% (attention FLOPs in full) / "
                    f"{100 * result['mfu_both'][k]['causal_attention']:.1f}% (causal half) "
                    f"of {k} ({peaks[k]:,.0f} GFLOP/s)" for k, v in result["mfu"].items()))
  if not distributed.is_main():
    return
  results_json.write(FLAGS.out, dict(
      result, benchmark="gpu_smoke", backend=jax.default_backend(),
      devices=[f"{d.platform} {getattr(d, 'device_kind', '')}" for d in devices],
      model={"preset": "tiny" if FLAGS.tiny else FLAGS.preset, "num_params": cfg.num_params,
             "dtype": dtype}, mesh=dict(mesh.shape), peaks_gflops=peaks,
      load_average=os.getloadavg()))


if __name__ == "__main__":
  app.run(main)
