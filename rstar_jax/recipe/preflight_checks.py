"""The cheap, pure part of the launch checks: bytes from shapes and the rollout memory.

No JAX: what a config's model and rollout engines need, in bytes, and why a layout does
not fit (`Problem`: the field, the numbers, the fix). `experiments.preflight` prints them
for a whole layout before any accelerator is allocated; the recipe
(`stages.check_rollout_memory`) runs `check_rollout_memory` at start, before it builds
the engines or loads weights, so a cache that cannot fit ends the run with exit 2 in
seconds instead of an out-of-memory error after the model has loaded.
"""
from __future__ import annotations

import dataclasses
from typing import Any

GB = 1e9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
HTTP_BACKENDS = ("sglang", "server")


def model_architecture(model: Any, default_preset: str = ""):
  """The Qwen3Config the recipe builds from `model` (a `config.model` section: a
  ModelConfig, a ConfigDict or a dict): the checkpoint's config.json when `hf_dir` holds
  one, else the preset (`default_preset` when the section names none: its hf_dir is
  given at launch) with every architecture field the section sets. Reads no weights."""
  import os
  from rstar_jax.model import model_config

  def get(name):
    if isinstance(model, dict) or hasattr(model, "keys"):
      return model.get(name)
    return getattr(model, name, None)

  fields = [f.name for f in dataclasses.fields(model_config.Qwen3Config)]
  overrides = {k: get(k) for k in fields if get(k) is not None}
  # "auto" picks a kernel by platform; its memory is chunked attention's.
  if overrides.get("attention_impl") == "auto":
    overrides["attention_impl"] = "chunked"
  hf_dir = get("hf_dir")
  if hf_dir and os.path.isfile(os.path.join(hf_dir, "config.json")):
    from rstar_jax.model import hf_io   # reads config.json only
    runtime = {k: v for k, v in overrides.items() if k in model_config.RUNTIME_FIELDS}
    return hf_io.load_config(hf_dir, **runtime)
  preset = get("preset") or default_preset
  if not preset:
    raise ValueError("config.model: neither `preset` nor an `hf_dir` with a config.json; "
                     "the architecture is unknown")
  return model_config.get_preset(preset, **overrides)


def kv_bytes_per_token(cfg, dtype: str = "bfloat16") -> int:
  """K and V of every layer for one token: 2 x layers x kv heads x head dim x bytes."""
  return (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
          * DTYPE_BYTES[dtype])


def weight_bytes(cfg, dtype: str) -> int:
  return cfg.num_params * DTYPE_BYTES[dtype]


def optimizer_bytes(cfg) -> int:
  """AdamW's two float32 moments (optax keeps them in the params' dtype: float32 here)."""
  return 2 * cfg.num_params * 4


def checkpoint_bytes(cfg, param_dtype: str = "float32") -> int:
  """The orbax train state: parameters and AdamW's moments (the step counter aside)."""
  return weight_bytes(cfg, param_dtype) + optimizer_bytes(cfg)


@dataclasses.dataclass(frozen=True)
class Problem:
  """One reason a layout does not fit: the field to change, what is wrong, the fix."""
  field: str
  message: str

  def __str__(self) -> str:
    return f"{self.field}: {self.message}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutMemory:
  """Memory of one rollout server (SGLang) or of the device holding the JaxEngines."""
  backend: str
  device_bytes: float        # HBM of the server's GPUs (all of them) or the one device
  usable_bytes: float        # what the server / the trainer process may allocate
  weight_bytes: float        # weights held for generation (0: the trainer's, shared)
  resident_bytes: float      # other memory on that device (the train state: jax backend)
  kv_bytes: float            # the KV cache / token pool (this device's share of it)
  kv_tokens: int             # tokens it holds
  max_len: int               # tokens one trajectory may reach
  kv_shards: int = 1         # devices the JaxEngine's cache is split over

  @property
  def concurrent(self) -> int:
    """Full-length trajectories the cache holds at once."""
    return self.kv_tokens // self.max_len

  @property
  def total_bytes(self) -> float:
    return self.weight_bytes + self.resident_bytes + self.kv_bytes


def jax_engine_memory(cfg, *, num_slots: int, max_len: int, num_engines: int = 1,
                      cache_dtype: str = "bfloat16", device_bytes: float,
                      usable_fraction: float = 0.9, resident_bytes: float = 0.0,
                      weight_bytes_held: float = 0.0, cache_shards: int = 1) -> RolloutMemory:
  """The JaxEngines' KV caches on one device: [num_slots, max_len] per layer for K and V,
  each engine its own, split over `cache_shards` devices (on a mesh the engine creates it
  sharded: `rollout.jax_engine.cache_bytes_per_device`; 1: one device holds it whole).
  The engines read the trainer's parameters: `resident_bytes` is what the trainer keeps
  on that device."""
  if cache_shards < 1:
    raise ValueError(f"jax_engine_memory: cache_shards={cache_shards!r} must be >= 1")
  tokens = num_engines * num_slots * max_len
  return RolloutMemory(backend="jax", device_bytes=device_bytes,
                       usable_bytes=device_bytes * usable_fraction,
                       weight_bytes=weight_bytes_held, resident_bytes=resident_bytes,
                       kv_bytes=tokens * kv_bytes_per_token(cfg, cache_dtype) / cache_shards,
                       kv_tokens=tokens, max_len=max_len, kv_shards=cache_shards)


def sglang_server_memory(cfg, *, device_bytes: float, gpus_per_server: int = 1,
                         mem_fraction: float = 0.85, max_len: int,
                         weight_dtype: str = "bfloat16", kv_dtype: str = "bfloat16"
                         ) -> RolloutMemory:
  """One SGLang server: it allocates mem_fraction of its GPUs' memory for the weights
  and a KV token pool, and the pool is what is left of that after the weights (SGLang
  measures the free memory at start; HBM x fraction is the nominal figure)."""
  total = device_bytes * gpus_per_server
  static = total * mem_fraction
  weights = weight_bytes(cfg, weight_dtype)
  kv = max(0.0, static - weights)
  return RolloutMemory(backend="sglang", device_bytes=total, usable_bytes=static,
                       weight_bytes=weights, resident_bytes=0.0, kv_bytes=kv,
                       kv_tokens=int(kv // kv_bytes_per_token(cfg, kv_dtype)),
                       max_len=max_len)


def rollout_problems(mem: RolloutMemory, *, backend: str = "") -> list[Problem]:
  """Why a rollout memory does not fit, naming the field and the fix ([] if it fits)."""
  out = []
  per_slot = mem.kv_bytes / max(1, mem.kv_tokens) * mem.max_len
  if mem.backend == "jax":
    if mem.total_bytes > mem.usable_bytes:
      room = mem.usable_bytes - mem.weight_bytes - mem.resident_bytes
      fit = max(0, int(room // per_slot)) if per_slot else 0
      out.append(Problem(
          "rollout.engine.num_slots",
          f"the JaxEngine KV cache ({mem.kv_tokens:,} tokens: {mem.kv_bytes / GB:.1f} GB"
          + (f" a device, split over {mem.kv_shards}" if mem.kv_shards > 1 else "") + ") "
          f"and {(mem.weight_bytes + mem.resident_bytes) / GB:.1f} GB of the trainer's "
          f"on one device need {mem.total_bytes / GB:.1f} GB > "
          f"{mem.usable_bytes / GB:.1f} GB usable of {mem.device_bytes / GB:.0f}; fix: "
          + (f"at most {fit} slot(s) of rollout.engine.max_len={mem.max_len} in all"
             if fit else "no slot of this max_len fits")
          + ", or rollout.backend=sglang (servers on GPUs of their own)"))
  else:
    if mem.weight_bytes >= mem.usable_bytes:
      out.append(Problem(
          "layout.gpus_per_server",
          f"SGLang weights {mem.weight_bytes / GB:.1f} GB do not fit its static memory "
          f"{mem.usable_bytes / GB:.1f} GB; fix: more GPUs per server (--tp-size) or a "
          f"higher layout.sglang_mem_fraction"))
    elif mem.concurrent < 1:
      out.append(Problem(
          "layout.sglang_mem_fraction",
          f"SGLang's token pool holds {mem.kv_tokens:,} tokens < one trajectory of "
          f"rollout.engine.max_len={mem.max_len}; fix: raise sglang_mem_fraction, add "
          f"GPUs per server, or lower rollout.engine.max_len"))
  return out


def check_rollout_memory(model_cfg, rollout_cfg, *, device_bytes: float,
                         usable_fraction: float = 0.9, sglang_mem_fraction: float = 0.85,
                         gpus_per_server: int = 1, trainer_resident_bytes: float = 0.0,
                         cache_shards: int = 1) -> list[Problem]:
  """The rollout-memory check from a Qwen3Config and a RolloutConfig, cheap and pure:
  what the recipe runs at start with the local device's memory (for the jax backend,
  `trainer_resident_bytes` = the train state on device 0), and experiments.preflight
  with the layout's."""
  if rollout_cfg.backend in HTTP_BACKENDS:
    mem = sglang_server_memory(model_cfg, device_bytes=device_bytes,
                               gpus_per_server=gpus_per_server,
                               mem_fraction=sglang_mem_fraction,
                               max_len=rollout_cfg.engine.max_len)
  else:
    eng = rollout_cfg.engine
    mem = jax_engine_memory(model_cfg, num_slots=eng.num_slots, max_len=eng.max_len,
                            num_engines=rollout_cfg.num_engines,
                            cache_dtype=eng.cache_dtype or model_cfg.dtype,
                            device_bytes=device_bytes, usable_fraction=usable_fraction,
                            resident_bytes=trainer_resident_bytes, cache_shards=cache_shards)
  return rollout_problems(mem)
