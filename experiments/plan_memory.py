r"""Per-device memory of the full GRPO train step, compiled ahead of time, nothing allocated.

  python -m experiments.plan_memory --config=experiments/configs/plan_memory.py

Traces and compiles `rstar_jax.rl.train_step.train_step` (forward, backward, gradient
accumulation over micro-batches, AdamW update) for Qwen3-14B on a (data, fsdp, tensor)
mesh of fake CPU devices, from `jax.ShapeDtypeStruct` inputs that carry their
shardings, and prints XLA's memory analysis of the partitioned (per-device) program next
to the HBM of an MI300X (192 GB), an H100 (80 GB) and an H200 (141 GB).

A run's own shapes (each stage's batch length and micro-batches, its KL reference) and its
rollout, weight-sync and checkpoint figures: `python -m experiments.preflight --config
<the run's config>`, which plans through `plan()` here.

Fake devices. XLA_FLAGS must be set before jax is imported, so the top of this file adds
`--xla_force_host_platform_device_count=64` (and JAX_PLATFORMS=cpu) unless the
environment already names a device count; for a bigger mesh run e.g.
`XLA_FLAGS=--xla_force_host_platform_device_count=128 python -m experiments.plan_memory ...`.

How to read the numbers (all GB = 1e9 bytes, per device):
  args   train state (params, Adam moments, step) + this device's shard of the batch;
  out    the new train state + metrics;
  alias  output buffers that reuse donated argument buffers (the state is donated);
  temp   XLA's buffer assignment of everything else: activations kept for the backward
         pass, the gradient accumulator, all-gathered weights, scratch;
  ref    with kl_coef > 0: the KL term's reference policy, a copy of the parameters (no
         gradient, no optimizer state) that stays on the devices beside the train state
         (rl.reference). Its log-probs are a forward-only program run before the step, whose
         temp memory is below the step's, so the peak is the step's plus this copy;
  peak   args + temp + out - alias (+ ref), the figure to compare with the HBM size. It leaves out
         the runtime's own reserve (NCCL/RCCL buffers, allocator fragmentation, cuBLAS
         workspaces): keep ~10% of HBM (and on GPUs XLA_PYTHON_CLIENT_MEM_FRACTION) spare.

CPU backend, so an upper estimate for bf16 compute. The program is compiled by XLA:CPU,
whose fusion and scheduling differ from the GPU/ROCm backends. Above all, XLA:CPU has no
native bf16 for most ops and upcasts them to f32 (FloatNormalization); in the backward
pass it converts the whole bf16 stash of per-layer activations [layers, batch, T, hidden]
to one f32 copy, twice its size (see `--config.top_temp=8`: the largest temp value is a
`convert` to f32[40, mb, T, 5120]). A GPU slices the bf16 stash in place, so for
remat="full" expect about 4 * layers * mb * T * hidden bytes less temp than printed
(10.9 GB at T=13312, mb=1). Take "fits" as conservative.
"""
from __future__ import annotations

import os

# Run as a script: before jax is imported (here or by rstar_jax), fake the devices of
# the target mesh. Imported (device_check, tests), the importer's devices are used and
# its environment is left alone: its subprocesses must not inherit JAX_PLATFORMS=cpu.
if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=64").strip()

import dataclasses
import functools
import glob
import math
import re
import shutil
import tempfile
import time
from typing import Any, Sequence

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
from ml_collections import config_flags

from rstar_jax import config_utils
from rstar_jax import optim
from rstar_jax.model import model_config
from rstar_jax.model import qwen3
from rstar_jax.recipe.layout import ACCELERATORS  # HBM per device, GB
from rstar_jax import sharding
from rstar_jax.rl import losses
from rstar_jax.rl import train_step as ts
from rstar_jax.train import step as core

GB = 1e9

# Batch arrays of the train step and their dtypes (as rstar_jax.rl.batching builds them).
BATCH_DTYPES: dict[str, Any] = {
    "input_ids": jnp.int32, "target_ids": jnp.int32, "attention_mask": jnp.int32,
    "loss_mask": jnp.float32, "old_logp": jnp.float32, "sampler_logp": jnp.float32,
    "advantages": jnp.float32,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanCase:
  """One train-step configuration to compile.

  Attributes:
    preset: model preset name (`rstar_jax.model.model_config.PRESETS`).
    mesh: sizes of the (data, fsdp, tensor) mesh axes; absent axes are 1.
    seq_len: tokens per sequence, prompt + response (the padded T of the batch).
    micro_batch: sequences per micro-batch per batch shard. The batch is sharded over
      data x fsdp (tensor-parallel devices share their sequences), so a micro-batch
      holds micro_batch * data * fsdp sequences in all.
    micro_batches: gradient-accumulation steps per update. They run under lax.scan,
      so temp memory does not grow with it; only the (small) batch arguments do.
    remat_policy, attention_impl, attention_chunk, param_dtype, dtype: as in Qwen3Config.
    logprob_chunk: positions per chunk of the log-prob / entropy head (StepConfig).
    compute_entropy: whether the step also computes per-token entropy (StepConfig).
    num_hidden_layers: None keeps the preset's; fewer gives a slice of the model with
      its per-layer shapes (device_check compares such a slice with a real step).
    kl_coef: the loss's KL weight (rl.loss.kl_coef); > 0 adds the reference log-probs to
      the batch and the reference parameters to the peak.
  """
  preset: str = "qwen3-14b"
  mesh: tuple[tuple[str, int], ...] = (("fsdp", 64),)
  seq_len: int = 9216
  micro_batch: int = 1
  micro_batches: int = 2
  remat_policy: str = "full"
  attention_impl: str = "chunked"
  attention_chunk: int = 1024
  param_dtype: str = "float32"
  dtype: str = "bfloat16"
  logprob_chunk: int = 512
  compute_entropy: bool = True
  num_hidden_layers: int | None = None
  kl_coef: float = 0.0

  def __post_init__(self):
    if not (isinstance(self.kl_coef, (int, float)) and math.isfinite(self.kl_coef)
            and self.kl_coef >= 0):
      raise ValueError(f"PlanCase.kl_coef must be finite and >= 0, got {self.kl_coef!r}")
    mesh = dict(self.mesh)
    if len(mesh) != len(self.mesh):
      raise ValueError(f"PlanCase.mesh: an axis is named twice in {self.mesh}")
    unknown = set(mesh) - set(sharding.MESH_AXES)
    if unknown:
      raise ValueError(f"PlanCase.mesh: unknown axes {sorted(unknown)}; axes are "
                       f"{sharding.MESH_AXES}")
    if any(not isinstance(v, int) or v <= 0 for v in mesh.values()):
      raise ValueError(f"PlanCase.mesh: sizes must be positive ints, got {mesh}")
    for name in ("seq_len", "micro_batch", "micro_batches", "logprob_chunk"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"PlanCase.{name} must be a positive int, got {value!r}")
    self.model_config()  # validates preset, remat, attention, dtypes with the model's messages

  @property
  def mesh_sizes(self) -> dict[str, int]:
    m = dict(self.mesh)
    return {a: m.get(a, 1) for a in sharding.MESH_AXES}

  @property
  def num_devices(self) -> int:
    return math.prod(self.mesh_sizes.values())

  @property
  def batch_shards(self) -> int:
    return self.mesh_sizes["data"] * self.mesh_sizes["fsdp"]

  @property
  def batch_size(self) -> int:
    return self.micro_batch * self.batch_shards * self.micro_batches

  @property
  def mesh_label(self) -> str:
    return "x".join(f"{a[0]}{n}" for a, n in self.mesh_sizes.items() if n > 1) or "1"

  @property
  def attention_label(self) -> str:
    """'xla', 'dpa', or 'chk1024' / 'blk1024' for query-chunked / blockwise attention."""
    prefix = {"chunked": "chk", "blockwise": "blk"}.get(self.attention_impl)
    if prefix is None:
      return {"dot_product": "dpa"}.get(self.attention_impl, self.attention_impl)
    return f"{prefix}{self.attention_chunk}"

  def model_config(self) -> model_config.Qwen3Config:
    layers = {} if self.num_hidden_layers is None else {
        "num_hidden_layers": self.num_hidden_layers}
    return model_config.get_preset(
        self.preset, remat_policy=self.remat_policy, attention_impl=self.attention_impl,
        attention_chunk=self.attention_chunk, param_dtype=self.param_dtype, dtype=self.dtype,
        **layers)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
  """XLA's memory analysis of one compiled case, bytes per device."""
  case: PlanCase
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  generated_code_bytes: int
  state_bytes: int          # train state alone (params + optimizer), from shapes and shardings
  compile_seconds: float
  # The KL reference's parameters (kl_coef > 0; else 0): a copy of the params' shards.
  reference_bytes: int = 0
  # (bytes, HLO value name, shape) of the largest values in XLA's temp allocation, when
  # asked for (`plan(..., top_temp=n)`); values sharing an offset range are listed once.
  top_temp: tuple[tuple[int, str, str], ...] = ()

  @property
  def peak_bytes(self) -> int:
    return (self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes
            + self.reference_bytes)

  def fits(self, hbm_gb: float) -> bool:
    return self.peak_bytes <= hbm_gb * GB


_TEMP_VALUE = re.compile(
    r"value: <\d+ (?P<name>\S+) [^>]*> \(size=(?P<size>\d+),offset=(?P<offset>\d+)\): "
    r"(?P<shape>\S+?)(?:\{[^}]*\})?$")


def largest_temp_values(buffer_assignment: str, n: int) -> list[tuple[int, str, str]]:
  """The n largest values of the temp allocation in an XLA buffer-assignment dump.

  XLA packs all temporaries into one `preallocated-temp` allocation; each value has a
  size and offset in it. Values that reuse the same bytes (same offset and size) over
  disjoint live ranges are reported once, by the first name.
  """
  lines = buffer_assignment.splitlines()
  start = next((i for i, line in enumerate(lines)
                if line.startswith("allocation") and "preallocated-temp" in line), None)
  if start is None:
    raise ValueError("buffer assignment has no preallocated-temp allocation")
  seen, out = set(), []
  for line in lines[start + 1:]:
    if line.startswith("allocation"):
      break
    m = _TEMP_VALUE.search(line.strip())
    if not m:
      continue
    key = (int(m["offset"]), int(m["size"]))
    if key not in seen:
      seen.add(key)
      out.append((int(m["size"]), m["name"], m["shape"]))
  return sorted(out, key=lambda v: -v[0])[:n]


def _shard_bytes(sds: jax.ShapeDtypeStruct) -> int:
  shape = sds.sharding.shard_shape(sds.shape)
  return math.prod(shape) * jnp.dtype(sds.dtype).itemsize


def batch_dtypes(case: PlanCase) -> dict[str, Any]:
  """The step's batch arrays: with a KL term, the reference log-probs too."""
  return dict(BATCH_DTYPES, **({"ref_logp": jnp.float32} if case.kl_coef > 0 else {}))


def abstract_inputs(case: PlanCase, mesh: jax.sharding.Mesh, tx, rules=sharding.DEFAULT_RULES):
  """(graphdef, abstract TrainState, abstract batch, state shardings, batch shardings).

  Every leaf is a ShapeDtypeStruct that carries its NamedSharding: nothing is allocated.
  """
  model = qwen3.abstract_model(case.model_config())
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  if jax.tree.leaves(rest):
    raise ValueError("model has non-Param state; the train step expects Params only")
  shard = core.state_shardings_for(params, tx, mesh, rules)
  opt_state = jax.eval_shape(tx.init, params)

  def with_sharding(x, s):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

  state = core.TrainState(
      step=jax.ShapeDtypeStruct((), jnp.int32, sharding=shard.step),
      params=jax.tree.map(with_sharding, params, shard.params),
      opt_state=jax.tree.map(with_sharding, opt_state, shard.opt_state))
  n, t = case.batch_size, case.seq_len
  dtypes = batch_dtypes(case)
  batch_shard = {k: sharding.batch_sharding(mesh, 1 if k == "advantages" else 2, rules)
                 for k in dtypes}
  batch = {k: jax.ShapeDtypeStruct((n,) if k == "advantages" else (n, t), dt,
                                   sharding=batch_shard[k])
           for k, dt in dtypes.items()}
  return graphdef, state, batch, shard, batch_shard


# Cheaper CPU code generation. Buffer assignment, and so every figure reported, is decided
# on the HLO before code generation: LLVM level 0 gives byte-identical figures, and the
# legacy (non-MLIR) fusion emitters figures within a few hundred bytes (measured on the 14B
# step, f8xt8, T=13312: temp 19,379,343,312 vs 19,379,343,504 bytes), while compile CPU
# time drops ~2.6x (14.6 s -> 5.6 s there). Pass compiler_options=None for XLA's defaults.
FAST_COMPILE_OPTIONS = {"xla_backend_optimization_level": 0,
                        "xla_cpu_use_fusion_emitters": False}


def _compile_dropping_unknown(lowered, options: dict[str, Any], keep: tuple[str, ...] = ()):
  """Compiles with `options`, leaving out any of the speed-only FAST_COMPILE_OPTIONS that
  this jaxlib's XLA does not know (jax 0.11 has no `xla_cpu_use_fusion_emitters`: seen
  on the H100 image, 2026-11-27); an unknown option in `keep` (the dump options) is an
  error as before."""
  options = dict(options)
  while True:
    try:
      return lowered.compile(compiler_options=options or None)
    except Exception as e:   # jaxlib's JaxRuntimeError: INVALID_ARGUMENT
      m = re.search(r"No such compile option: '([^']+)'", str(e))
      if not m or m.group(1) not in options or m.group(1) in keep:
        raise
      options.pop(m.group(1))


def plan(case: PlanCase, devices: Sequence[jax.Device] | None = None,
         optimizer: optim.OptimizerConfig | None = None,
         loss: losses.LossConfig | None = None,
         rules=sharding.DEFAULT_RULES,
         compiler_options: dict[str, Any] | None = FAST_COMPILE_OPTIONS,
         top_temp: int = 0) -> MemoryEstimate:
  """Lowers and compiles the train step of `case` and returns XLA's per-device memory.

  top_temp > 0 also dumps XLA's buffer assignment (to a temporary directory, removed
  afterwards) and keeps the `top_temp` largest temp values in the result.
  """
  devices = list(devices) if devices is not None else jax.devices()
  if len(devices) < case.num_devices:
    raise ValueError(
        f"mesh {case.mesh_sizes} needs {case.num_devices} devices but only {len(devices)} "
        "exist; set XLA_FLAGS=--xla_force_host_platform_device_count=N before jax is imported")
  mesh = sharding.make_mesh(case.mesh_sizes, devices[:case.num_devices])
  tx = optim.make_optimizer(optimizer or optim.OptimizerConfig())
  loss_cfg = dataclasses.replace(loss or losses.LossConfig(), kl_coef=case.kl_coef)
  step_cfg = core.StepConfig(micro_batches=case.micro_batches, logprob_chunk=case.logprob_chunk,
                             compute_entropy=case.compute_entropy)
  graphdef, state, batch, shard, batch_shard = abstract_inputs(case, mesh, tx, rules)
  fn = functools.partial(ts.train_step, graphdef, tx, loss_cfg, step_cfg, 1.0)
  # The state is donated, as make_train_step does: new params/moments reuse its buffers.
  jitted = jax.jit(fn, in_shardings=(shard, batch_shard), out_shardings=(shard, None),
                   donate_argnums=(0,))
  options = dict(compiler_options or {})
  dump_dir = None
  if top_temp > 0:
    dump_dir = tempfile.mkdtemp(prefix="plan_memory_")
    options.update(xla_dump_to=dump_dir, xla_dump_hlo_pass_re="NONE",
                   xla_dump_hlo_module_re=".*train_step.*")
  try:
    t0 = time.perf_counter()
    with sharding.use_mesh_rules(mesh, rules):
      lowered = jitted.lower(state, batch)
      compiled = _compile_dropping_unknown(lowered, options,
                                           keep=() if compiler_options is None
                                           else tuple(set(options) - set(compiler_options)))
    seconds = time.perf_counter() - t0
    top = ()
    if dump_dir is not None:
      found = glob.glob(os.path.join(
          dump_dir, "*train_step*after_optimizations-buffer-assignment.txt"))
      if not found:
        raise RuntimeError(f"XLA wrote no buffer assignment under {dump_dir}")
      with open(found[0]) as f:
        top = tuple(largest_temp_values(f.read(), top_temp))
  finally:
    if dump_dir is not None:
      shutil.rmtree(dump_dir, ignore_errors=True)
  mem = compiled.memory_analysis()
  if mem is None:
    raise RuntimeError(f"backend {jax.default_backend()!r} gives no memory analysis")
  return MemoryEstimate(
      case=case, argument_bytes=int(mem.argument_size_in_bytes),
      output_bytes=int(mem.output_size_in_bytes), alias_bytes=int(mem.alias_size_in_bytes),
      temp_bytes=int(mem.temp_size_in_bytes),
      generated_code_bytes=int(mem.generated_code_size_in_bytes),
      state_bytes=sum(_shard_bytes(x) for x in jax.tree.leaves(state)),
      compile_seconds=seconds, top_temp=top,
      reference_bytes=(sum(_shard_bytes(x) for x in jax.tree.leaves(state.params))
                       if case.kl_coef > 0 else 0))


def parse_mesh(spec: str) -> tuple[tuple[str, int], ...]:
  """'fsdp=8,tensor=8' -> (('fsdp', 8), ('tensor', 8)), with a clear error on bad input."""
  out = []
  for part in spec.split(","):
    name, sep, size = part.strip().partition("=")
    if not sep or name not in sharding.MESH_AXES or not size.strip().isdigit():
      raise ValueError(f"mesh spec {spec!r}: expected comma-separated axis=size with axes "
                       f"in {sharding.MESH_AXES}, e.g. 'fsdp=8,tensor=8'; bad part {part!r}")
    out.append((name, int(size)))
  return tuple(out)


def cases_from_config(config) -> list[PlanCase]:
  """Cartesian product of the config's lists (see experiments/configs/plan_memory.py)."""
  def ints(name):
    try:
      return [int(x) for x in str(config[name]).split(",") if x.strip()]
    except ValueError:
      raise ValueError(f"config.{name}={config[name]!r}: expected comma-separated ints") from None

  def strs(name):
    return [x.strip() for x in str(config[name]).split(",") if x.strip()]

  meshes = [parse_mesh(m) for m in str(config.meshes).split(";") if m.strip()]
  out = []
  for mesh in meshes:
    for response in ints("response_lens"):
      for mb in ints("micro_batch"):
        for remat in strs("remat_policy"):
          for attn in strs("attention_impl"):
            for chunk in (ints("attention_chunk") if attn in ("chunked", "blockwise")
                          else [1024]):
              for pdt in strs("param_dtype"):
                out.append(PlanCase(
                    preset=config.preset, mesh=mesh, seq_len=config.prompt_len + response,
                    micro_batch=mb, micro_batches=config.micro_batches, remat_policy=remat,
                    attention_impl=attn, attention_chunk=chunk, param_dtype=pdt,
                    dtype=config.dtype, logprob_chunk=config.logprob_chunk,
                    compute_entropy=config.compute_entropy,
                    kl_coef=float(config.get("kl_coef", 0.0))))
  if not out:
    raise ValueError("config selects no case: meshes, response_lens, micro_batch, "
                     "remat_policy, attention_impl and param_dtype must each be non-empty")
  return out


_GB_COLUMNS = ("state", "args", "out", "alias", "temp", "code", "ref", "peak")
HEADER = (f"{'mesh':<9}{'T':>6}{'mb':>4}{'remat':>14}{'attn':>9}{'param':>6}"
          + "".join(f"{c:>9}" for c in _GB_COLUMNS)
          + f"  {'fits MI300X/H100/H200':<22}{'compile s':>9}")


def format_row(est: MemoryEstimate) -> str:
  c = est.case
  fits = "/".join("yes" if est.fits(ACCELERATORS[k]) else "no"
                  for k in ("MI300X", "H100", "H200"))
  pdt = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[c.param_dtype]
  sizes = (est.state_bytes, est.argument_bytes, est.output_bytes, est.alias_bytes,
           est.temp_bytes, est.generated_code_bytes, est.reference_bytes, est.peak_bytes)
  return (f"{c.mesh_label:<9}{c.seq_len:>6}{c.micro_batch:>4}{c.remat_policy:>14}"
          f"{c.attention_label:>9}{pdt:>6}" + "".join(f"{b / GB:9.2f}" for b in sizes)
          + f"  {fits:<22}{est.compile_seconds:>9.0f}")


def main(argv: Sequence[str]) -> None:
  del argv
  config = _CONFIG.value
  try:
    cases = cases_from_config(config)
  except (ValueError, KeyError, TypeError) as e:  # bad mesh, preset, list: one line, no traceback
    raise config_utils.ConfigError(
        str(e.args[0] if isinstance(e, KeyError) and e.args else e)) from None
  c0 = cases[0]
  print(f"{c0.preset}: {c0.model_config().num_params / 1e9:.2f}B params, compute "
        f"{c0.dtype}, {config.micro_batches} micro-batches/step, prompt {config.prompt_len} "
        f"tokens, kl_coef {c0.kl_coef} (ref: the KL reference's parameters), "
        f"{len(jax.devices())} fake {jax.default_backend()} devices; GB = 1e9 bytes "
        "per device; mb = sequences per micro-batch per batch shard (data x fsdp)")
  print(HEADER, flush=True)
  for case in cases:
    try:
      est = plan(case, top_temp=config.top_temp)
    except Exception as e:  # one failing case must not lose the rest of the table
      logging.exception("case %s failed", case)
      print(f"{case.mesh_label:<9}{case.seq_len:>6}{case.micro_batch:>4}"
            f"{case.remat_policy:>14}{case.attention_label:>9}  FAILED: "
            f"{type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
      continue
    print(format_row(est), flush=True)
    for size, name, shape in est.top_temp:
      print(f"    temp {size / GB:7.2f} GB  {shape:<28} {name}")
  print("XLA:CPU figures: an upper estimate for bf16 compute on GPUs (see the module "
        "docstring); 'fits' compares peak with 192/80/141 GB and leaves no runtime reserve.")


if __name__ == "__main__":
  # Defined here, not on import: device_check and the tests import this module as a
  # library beside entry points that define their own --config.
  _CONFIG = config_flags.DEFINE_config_file(
      "config", "experiments/configs/plan_memory.py", "plan_memory config file.")
  config_utils.run(main)
