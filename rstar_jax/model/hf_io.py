"""Hugging Face Qwen3 directories <-> our parameters.

Reading: config.json (transformers-4 spelling `rope_theta`/`torch_dtype`, or
transformers-5 `rope_parameters`/`dtype`) and `model.safetensors` or a sharded
`model.safetensors.index.json`. Every tensor is checked for presence and shape
before anything is loaded. With a mesh, each parameter is built with
`jax.make_array_from_callback`: a device's callback reads only the slice of the
safetensors file that lands on that device, so the full model never sits on one
host (safetensors slices are memory-mapped reads).

Writing: a directory that transformers' `Qwen3ForCausalLM.from_pretrained` (and so
SGLang) loads: config.json with both spellings, safetensors shards plus index.
HF Linear weights are [out, in]; ours are [in, out] with heads split out.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from rstar_jax import distributed, sharding
from rstar_jax.model.model_config import Qwen3Config
from rstar_jax.model.qwen3 import Qwen3, abstract_model

_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


class CheckpointError(ValueError):
  """A HF directory that cannot be read as a Qwen3 checkpoint."""


# ---- config.json -----------------------------------------------------------
def config_from_hf_dict(d: dict[str, Any], where: str = "config.json",
                        **overrides: Any) -> Qwen3Config:
  if not isinstance(d, dict):
    raise CheckpointError(f"{where}: expected a JSON object, got {type(d).__name__}")
  missing = [k for k in _REQUIRED if k not in d]
  if missing:
    raise CheckpointError(f"{where}: missing required field(s) {missing}")
  model_type = d.get("model_type", "qwen3")
  if model_type != "qwen3":
    raise CheckpointError(f"{where}: model_type is {model_type!r}, expected 'qwen3'")
  if d.get("attention_bias", False):
    raise CheckpointError(f"{where}: attention_bias=true is not Qwen3 (no biases supported)")
  if d.get("hidden_act", "silu") != "silu":
    raise CheckpointError(f"{where}: hidden_act={d['hidden_act']!r}; only 'silu' is supported")
  if d.get("use_sliding_window", False):
    raise CheckpointError(f"{where}: use_sliding_window=true is not supported")
  for key in ("rope_parameters", "rope_scaling"):
    if d.get(key) is not None and not isinstance(d[key], dict):
      raise CheckpointError(f"{where}: {key} must be an object or null, got {d[key]!r}")
  rope = d.get("rope_parameters") or {}
  if "rope_theta" in rope:
    theta = rope["rope_theta"]
  elif "rope_theta" in d:
    theta = d["rope_theta"]
  else:
    theta = 10_000.0  # transformers' default when neither spelling is present
  scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                      else None)
  if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
    raise CheckpointError(f"{where}: rope scaling {scaling} is not supported")

  def number(key, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise CheckpointError(f"{where}: {key} must be a number, got {value!r}")
    return float(value)

  def flag(key, default):
    value = d.get(key, default)
    if not isinstance(value, bool):   # "false" would read as True
      raise CheckpointError(f"{where}: {key} must be true or false, got {value!r}")
    return value

  heads = d["num_attention_heads"]
  fields = dict(
      vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
      intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
      num_attention_heads=heads,
      # transformers: a missing key is Qwen3Config's default, 32; only null means "one kv
      # head per query head".
      num_key_value_heads=(d["num_key_value_heads"] if "num_key_value_heads" in d else 32)
      or heads,
      head_dim=d.get("head_dim") or 128,  # HF Qwen3Config default
      rope_theta=number("rope_theta", theta),
      rms_norm_eps=number("rms_norm_eps", d.get("rms_norm_eps", 1e-6)),
      tie_word_embeddings=flag("tie_word_embeddings", False),
      max_position_embeddings=d.get("max_position_embeddings", 32_768),
      initializer_range=number("initializer_range", d.get("initializer_range", 0.02)),
  )
  fields.update(overrides)
  try:
    return Qwen3Config(**fields)
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"{where}: {e}") from e


def load_config(hf_dir: str, **overrides: Any) -> Qwen3Config:
  if not os.path.isdir(hf_dir):
    raise CheckpointError(f"{hf_dir}: " + ("not a directory" if os.path.exists(hf_dir)
                                          else "no such directory") + " (no config.json)")
  path = os.path.join(hf_dir, "config.json")
  if not os.path.exists(path):
    raise CheckpointError(f"{hf_dir}: no config.json")
  with open(path) as f:
    try:
      d = json.load(f)
    except json.JSONDecodeError as e:
      raise CheckpointError(f"{path}: invalid JSON: {e}") from e
  return config_from_hf_dict(d, where=path, **overrides)


def config_to_hf_dict(cfg: Qwen3Config, dtype: str) -> dict[str, Any]:
  # Both spellings, so transformers 4.x (SGLang pins) and 5.x read it.
  return {
      "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
      "num_attention_heads": cfg.num_attention_heads,
      "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
      "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
      "max_position_embeddings": cfg.max_position_embeddings,
      "initializer_range": cfg.initializer_range, "rms_norm_eps": cfg.rms_norm_eps,
      "tie_word_embeddings": cfg.tie_word_embeddings, "use_cache": True,
      "use_sliding_window": False, "sliding_window": None,
      "max_window_layers": cfg.num_hidden_layers,
      "rope_theta": cfg.rope_theta, "rope_scaling": None,
      "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
      "torch_dtype": dtype, "dtype": dtype,
  }


# ---- Parameter table ---------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Spec:
  hf: str        # HF tensor name; "{i}" is the layer index for stacked params
  kind: str      # id | T | T_split_out (q/k/v) | T_split_in (o_proj)
  layered: bool


_TABLE: dict[str, _Spec] = {
    "embed_tokens": _Spec("model.embed_tokens.weight", "id", False),
    "norm": _Spec("model.norm.weight", "id", False),
    "lm_head": _Spec("lm_head.weight", "T", False),
    "layers.input_layernorm": _Spec("model.layers.{i}.input_layernorm.weight", "id", True),
    "layers.post_attention_layernorm": _Spec(
        "model.layers.{i}.post_attention_layernorm.weight", "id", True),
    "layers.q_proj": _Spec("model.layers.{i}.self_attn.q_proj.weight", "T_split_out", True),
    "layers.k_proj": _Spec("model.layers.{i}.self_attn.k_proj.weight", "T_split_out", True),
    "layers.v_proj": _Spec("model.layers.{i}.self_attn.v_proj.weight", "T_split_out", True),
    "layers.o_proj": _Spec("model.layers.{i}.self_attn.o_proj.weight", "T_split_in", True),
    "layers.q_norm": _Spec("model.layers.{i}.self_attn.q_norm.weight", "id", True),
    "layers.k_norm": _Spec("model.layers.{i}.self_attn.k_norm.weight", "id", True),
    "layers.gate_proj": _Spec("model.layers.{i}.mlp.gate_proj.weight", "T", True),
    "layers.up_proj": _Spec("model.layers.{i}.mlp.up_proj.weight", "T", True),
    "layers.down_proj": _Spec("model.layers.{i}.mlp.down_proj.weight", "T", True),
}


def _hf_shape(kind: str, ours: tuple[int, ...]) -> tuple[int, ...]:
  if kind == "id":
    return ours
  if kind == "T":
    return ours[::-1]
  if kind == "T_split_out":  # ours [H, N, D] <- hf [N*D, H]
    return (ours[1] * ours[2], ours[0])
  if kind == "T_split_in":   # ours [N, D, H] <- hf [H, N*D]
    return (ours[2], ours[0] * ours[1])
  raise AssertionError(kind)


def _read_block(sl, kind: str, ours_shape: tuple[int, ...], idx: tuple[slice, ...]):
  """Reads the block `idx` of our layout from a safetensors slice `sl` (HF layout)."""
  idx = tuple(slice(*s.indices(n)) for s, n in zip(idx, ours_shape))
  if kind == "id":
    return sl[idx]
  if kind == "T":
    return sl[idx[::-1]].T
  if kind == "T_split_out":
    hs, ns, ds = idx
    d = ours_shape[2]
    rows = sl[ns.start * d: ns.stop * d, hs]           # [n*D, h]
    block = rows.T.reshape(rows.shape[1], ns.stop - ns.start, d)
    return block[:, :, ds]
  if kind == "T_split_in":
    ns, ds, hs = idx
    d = ours_shape[1]
    cols = sl[hs, ns.start * d: ns.stop * d]           # [h, n*D]
    block = cols.T.reshape(ns.stop - ns.start, d, cols.shape[0])
    return block[:, ds, :]
  raise AssertionError(kind)


def _state_key(path) -> str:
  return ".".join(str(getattr(p, "key", p)) for p in path)


# ---- Reading -------------------------------------------------------------------
class _TensorIndex:
  """Name -> file for a single or sharded safetensors checkpoint; lazy handles.

  Every failure to find or read a tensor is a `CheckpointError` naming the file and the
  tensor (never a raw safetensors error), on the plain and the mesh loading path alike.
  """

  INDEX = "model.safetensors.index.json"

  def __init__(self, hf_dir: str):
    self.dir = hf_dir
    index = os.path.join(hf_dir, self.INDEX)
    single = os.path.join(hf_dir, "model.safetensors")
    self._handles: dict[str, tuple[Any, frozenset[str]]] = {}
    if os.path.exists(index):
      with open(index) as f:
        try:
          weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
          raise CheckpointError(f"{index}: not a safetensors index ({e!r})") from e
      if not isinstance(weight_map, dict) or not all(
          isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names")
      self.weight_map = dict(weight_map)
      missing = [f for f in sorted(set(self.weight_map.values()))
                 if not os.path.isfile(os.path.join(hf_dir, f))]
      if missing:
        example = next(k for k, v in self.weight_map.items() if v == missing[0])
        raise CheckpointError(
            f"{index}: shard file(s) {missing} listed in the index do not exist in {hf_dir} "
            f"(e.g. tensor {example} is mapped to {missing[0]})")
    elif os.path.exists(single):
      self.weight_map = {k: "model.safetensors" for k in self._open("model.safetensors")[1]}
    else:
      raise CheckpointError(
          f"{hf_dir}: neither model.safetensors nor model.safetensors.index.json found")

  def _open(self, fname: str) -> tuple[Any, frozenset[str]]:
    if fname not in self._handles:
      path = os.path.join(self.dir, fname)
      if not os.path.isfile(path):
        raise CheckpointError(f"{path}: shard file does not exist (listed in {self.INDEX})")
      try:
        handle = safe_open(path, framework="np")
        keys = frozenset(handle.keys())
      except Exception as e:  # safetensors raises SafetensorError / OSError on bad files.
        raise CheckpointError(f"{path}: cannot read as safetensors: {e}") from e
      self._handles[fname] = (handle, keys)
    return self._handles[fname]

  def problem(self, name: str) -> str | None:
    """Why tensor `name` cannot be read (None if it can); raises on unreadable shards."""
    if name not in self.weight_map:
      return f"missing tensor {name}"
    fname = self.weight_map[name]
    _, keys = self._open(fname)
    if name not in keys:
      return (f"shard file {os.path.join(self.dir, fname)} lacks tensor {name}, which "
              f"{self.INDEX} maps to it ({len(keys)} tensors in that shard)")
    return None

  def slice(self, name: str):
    reason = self.problem(name)
    if reason is not None:
      raise CheckpointError(f"{self.dir}: {reason}")
    handle, _ = self._open(self.weight_map[name])
    try:
      return handle.get_slice(name)
    except Exception as e:
      raise CheckpointError(f"{os.path.join(self.dir, self.weight_map[name])}: cannot read "
                            f"tensor {name}: {e}") from e


def _expected(cfg: Qwen3Config, abs_state) -> dict[str, tuple[_Spec, tuple[int, ...]]]:
  out = {}
  for path, var in nnx.to_flat_state(abs_state):
    key = _state_key(path)
    if key not in _TABLE:
      raise AssertionError(f"parameter {key} has no HF mapping")
    out[key] = (_TABLE[key], tuple(var.get_value().shape))
  return out


def check_checkpoint(hf_dir: str, cfg: Qwen3Config | None = None) -> Qwen3Config:
  """Verifies every tensor exists with the right shape; raises naming the first bad one."""
  cfg = cfg or load_config(hf_dir)
  tensors = _TensorIndex(hf_dir)
  abs_state = nnx.state(abstract_model(cfg))
  problems = []
  for key, (spec, shape) in _expected(cfg, abs_state).items():
    per_layer = shape[1:] if spec.layered else shape
    want = _hf_shape(spec.kind, per_layer)
    layers = range(cfg.num_hidden_layers) if spec.layered else [None]
    for i in layers:
      name = spec.hf.format(i=i)
      reason = tensors.problem(name)
      if reason is not None:
        problems.append(reason)
        continue
      got = tuple(tensors.slice(name).get_shape())
      if got != want:
        problems.append(f"tensor {name} has shape {list(got)}, expected {list(want)} "
                        f"(from config.json)")
  if problems:
    more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
    raise CheckpointError(f"{hf_dir}: " + "; ".join(problems[:5]) + more)
  return cfg


def load_hf(hf_dir: str, mesh: jax.sharding.Mesh | None = None,
            rules=sharding.DEFAULT_RULES, **config_overrides: Any) -> Qwen3:
  """Loads a HF Qwen3 directory into a `Qwen3`, placed on `mesh` when given.

  `config_overrides` set run-time fields (param_dtype, dtype, remat_policy, ...).
  """
  cfg = load_config(hf_dir, **config_overrides)
  check_checkpoint(hf_dir, cfg)
  tensors = _TensorIndex(hf_dir)
  graphdef, abs_state = nnx.split(abstract_model(cfg))
  np_dtype = _NP_DTYPES[cfg.param_dtype]
  expected = _expected(cfg, abs_state)
  shardings = None if mesh is None else sharding.state_shardings(abs_state, mesh, rules)

  def build(path, var):
    key = _state_key(path)
    spec, shape = expected[key]

    def block(idx: tuple[slice, ...]) -> np.ndarray:
      if not spec.layered:
        return _read_block(tensors.slice(spec.hf), spec.kind, shape, idx).astype(np_dtype)
      layer_sl, rest = idx[0], idx[1:]
      parts = [_read_block(tensors.slice(spec.hf.format(i=i)), spec.kind, shape[1:], rest)
               for i in range(*layer_sl.indices(shape[0]))]
      return np.stack(parts).astype(np_dtype)

    if shardings is None:
      value = jnp.asarray(block(tuple(slice(None) for _ in shape)))
    else:
      target = _lookup(shardings, path).get_value()
      value = jax.make_array_from_callback(shape, target, lambda idx: block(idx))
    return var.replace(value)

  state = jax.tree_util.tree_map_with_path(
      build, abs_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.merge(graphdef, state)


def _lookup(tree, path):
  for p in path:
    tree = tree[getattr(p, "key", p)]
  return tree


# ---- Writing -------------------------------------------------------------------
def _hf_order(cfg: Qwen3Config, model: Qwen3):
  """(hf name, our value, layer index or None, kind) in HF checkpoint order: embedding,
  then every tensor of layer 0, layer 1, ..., then the final norm and the head."""
  flat = {_state_key(p): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  head = [k for k in ("embed_tokens",) if k in flat]
  tail = [k for k in ("norm", "lm_head") if k in flat]
  layered = [k for k in flat if _TABLE[k].layered]
  for k in head:
    yield _TABLE[k].hf, flat[k], None, _TABLE[k].kind
  for i in range(cfg.num_hidden_layers):
    for k in layered:
      yield _TABLE[k].hf.format(i=i), flat[k], i, _TABLE[k].kind
  for k in tail:
    yield _TABLE[k].hf, flat[k], None, _TABLE[k].kind


def _hf_nbytes(var, layer: int | None, dtype: str) -> int:
  """Bytes of one HF tensor (one layer's slice of a stacked parameter), from shapes."""
  shape = tuple(var.get_value().shape)[1 if layer is not None else 0:]
  return int(np.prod(shape)) * np.dtype(_NP_DTYPES[dtype]).itemsize


def _hf_layout(value, *, layer: int | None, kind: str, dtype: str):
  """On the devices: one layer's slice, in HF's layout and dtype (XLA casts and
  transposes far faster than numpy, and only the converted bytes leave the device)."""
  if layer is None:
    return _hf_layout_jit(value, None, kind=kind, dtype=dtype)
  # The layer is an argument, not a constant: one program per kind serves every layer
  # (a constant compiled one per layer and kind, 360 programs for a 40-layer model).
  return _hf_layout_jit(value, np.int32(layer), kind=kind, dtype=dtype)


@functools.partial(jax.jit, static_argnames=("kind", "dtype"))
def _hf_layout_jit(value, layer, *, kind: str, dtype: str):
  if layer is not None:
    value = value[layer]
  value = value.astype(jnp.float32)
  if kind == "T":
    value = value.T
  elif kind == "T_split_out":
    h, n, d = value.shape
    value = value.reshape(h, n * d).T
  elif kind == "T_split_in":
    n, d, h = value.shape
    value = value.reshape(n * d, h).T
  return value.astype(jnp.dtype(_NP_DTYPES[dtype]))


def _hf_value(var, layer: int | None, kind: str, dtype: str) -> np.ndarray:
  """One HF tensor on the host: only this tensor (one layer's slice of a stacked
  parameter) is gathered from the devices."""
  out = _hf_layout(var.get_value(), layer=layer, kind=kind, dtype=dtype)
  return np.ascontiguousarray(distributed.host_value(out))


def iter_hf_tensors(model: Qwen3, dtype: str = "bfloat16"):
  """(HF name, host numpy array) one tensor at a time, layer by layer: what streams a
  sharded model to disk without the whole of it on one host."""
  for name, var, layer, kind in _hf_order(model.cfg, model):
    yield name, _hf_value(var, layer, kind, dtype)


def hf_tensors(model: Qwen3, dtype: str = "bfloat16") -> dict[str, np.ndarray]:
  """Our parameters as HF-named host numpy arrays (all of them at once: small models,
  tests; `save_hf` streams instead)."""
  return dict(iter_hf_tensors(model, dtype))


_WEIGHT_FILE = re.compile(r"model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json")


def save_hf(model: Qwen3, out_dir: str, *, dtype: str = "bfloat16",
            max_shard_bytes: int = 5 * 1024 ** 3, tokenizer_dir: str | None = None,
            chat_template: str | None = None, parallel: bool = False) -> list[str]:
  """Writes a HF Qwen3 directory (config.json + safetensors [+ index]).

  Files are written under temporary names and renamed last, so a crash never
  leaves a directory that looks complete but is not. Multi-process: every process
  calls it, and all return once the directory is complete. By default each tensor is
  gathered to every process by a collective and process 0 writes every file.

  Args:
    parallel: multi-process only (one process writes as without it): every process
      writes its own share of the tensors, balanced by bytes, into its own
      `model-0000k-of-0000n.safetensors` file(s), at the same time as the others; each
      tensor is gathered to its writer alone (`distributed.gather_to`). Process 0
      writes the index, config.json and the tokenizer once every share is on disk.
      `out_dir` must be one directory every process sees (shared storage on a cluster).
      A write that fails on any process raises on every process.
    tokenizer_dir: a tokenizer directory whose files are copied alongside.
    chat_template: a Jinja chat template (e.g. `rollout.chat_template.hf_chat_template(config)`),
      stored as `chat_template` in the exported `tokenizer_config.json`, where
      transformers' `AutoTokenizer` (4.x and 5.x) and SGLang read it. Needs
      `tokenizer_dir`. A `chat_template.jinja` would take precedence in transformers,
      so none is copied, and a stale one in `out_dir` is removed.

  Returns:
    The weight files this process wrote (the others' are theirs).
  """
  if dtype not in _NP_DTYPES:
    raise ValueError(f"save_hf: dtype {dtype!r}; choose from {sorted(_NP_DTYPES)}")
  if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or (
      max_shard_bytes <= 0):
    raise ValueError(f"save_hf: max_shard_bytes must be a positive number of bytes, got "
                     f"{max_shard_bytes!r}")
  if chat_template is not None and not tokenizer_dir:
    raise ValueError("save_hf: chat_template is stored in the exported tokenizer_config.json, "
                     "so it needs tokenizer_dir (the tokenizer exported alongside)")
  if chat_template is not None and (not isinstance(chat_template, str)
                                    or not chat_template.strip()):
    raise ValueError(f"save_hf: chat_template must be a non-empty string, got "
                     f"{chat_template!r:.80}")
  if parallel and distributed.multi_process():
    return _save_parallel(model, out_dir, dtype, max_shard_bytes, tokenizer_dir,
                          chat_template)
  main = distributed.is_main()
  if main:
    os.makedirs(out_dir, exist_ok=True)
  # Shards are planned from shapes, then filled one at a time, so that at most one
  # shard (<= max_shard_bytes) is on the host while it is written.
  plan: list[list[tuple]] = [[]]
  size = total = 0
  for name, var, layer, kind in _hf_order(model.cfg, model):
    nbytes = _hf_nbytes(var, layer, dtype)
    if plan[-1] and size + nbytes > max_shard_bytes:
      plan.append([])
      size = 0
    plan[-1].append((name, var, layer, kind))
    size += nbytes
    total += nbytes
  written = []
  if len(plan) == 1:
    names = ["model.safetensors"]
  else:
    names = [f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors" for k in range(len(plan))]
  weight_map = {}
  failed: BaseException | None = None
  for fname, entries in zip(names, plan):
    # Every process, for the gathers; a write that failed on process 0 (a full disk)
    # is raised after the last gather, so that no process waits in one forever.
    shard = {name: _hf_value(var, layer, kind, dtype) for name, var, layer, kind in entries}
    if not main or failed is not None:
      continue
    tmp = os.path.join(out_dir, fname + ".tmp")
    try:
      save_file(shard, tmp, metadata={"format": "pt"})
    except Exception as e:  # noqa: BLE001 - raised below, on every process
      failed = e
    del shard
    written.append((tmp, os.path.join(out_dir, fname)))
    weight_map.update({name: fname for name, *_ in entries})
  distributed.on_main(
      lambda: _finish_export(out_dir, model.cfg, dtype, total,
                             weight_map if len(plan) > 1 else None, written,
                             tokenizer_dir, chat_template, failed),
      f"save_hf {out_dir}")
  return names if main else []


# ---- Writing from every process ------------------------------------------------------
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
# Converted tensors waiting for the disk, per process: the gathers run ahead of a slower
# disk by at most this much (a bigger tensor still goes, alone).
_WRITE_AHEAD_BYTES = 1 << 30


def plan_shares(sizes: list[int], processes: int, max_shard_bytes: int
                ) -> list[tuple[int, list[int]]]:
  """The files of a parallel export: [(writing process, [tensor positions])], in order.

  `sizes` are the tensors' bytes in HF order. Each process takes one contiguous run of
  them, cut where the running total is nearest k * total / processes (shares differ
  by at most about one tensor); a share above `max_shard_bytes` is cut into several
  files as `save_hf` cuts one. A process left with nothing writes no file. It depends
  only on the sizes and the process count, so every process plans the same files."""
  if processes < 1:
    raise ValueError(f"plan_shares: processes must be >= 1, got {processes}")
  total = sum(sizes)
  prefix = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
  cuts = [0]
  for k in range(1, processes):
    target = total * k / processes
    at = int(np.argmin(np.abs(prefix - target)))
    cuts.append(max(at, cuts[-1]))
  cuts.append(len(sizes))
  files = []
  for process in range(processes):
    share = range(cuts[process], cuts[process + 1])
    current: list[int] = []
    size = 0
    for i in share:
      if current and size + sizes[i] > max_shard_bytes:
        files.append((process, current))
        current, size = [], 0
      current.append(i)
      size += sizes[i]
    if current:
      files.append((process, current))
  return files


class _StreamedShard:
  """One safetensors file written tensor by tensor: the header is known from the
  shapes, so each tensor goes straight to its offset (nothing is held back to build
  the file in memory, as `safetensors.save_file` does)."""

  def __init__(self, path: str, tensors: list[tuple[str, tuple[int, ...]]], dtype: str):
    self.path = path
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    self.offsets: dict[str, tuple[int, int]] = {}
    offset = 0
    itemsize = np.dtype(_NP_DTYPES[dtype]).itemsize
    for name, shape in tensors:
      end = offset + int(np.prod(shape)) * itemsize
      header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape),
                      "data_offsets": [offset, end]}
      self.offsets[name] = (offset, end)
      offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)   # the data starts 8-byte aligned, as safetensors does
    self.head = len(text).to_bytes(8, "little") + text
    self.pending = set(self.offsets)
    self.fd: int | None = None

  def write(self, name: str, value: np.ndarray) -> None:
    begin, end = self.offsets[name]
    data = memoryview(np.ascontiguousarray(value).reshape(-1).view(np.uint8))
    if len(data) != end - begin:
      raise ValueError(f"{self.path}: tensor {name} has {len(data)} bytes, planned "
                       f"{end - begin}")
    if self.fd is None:
      self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
      self._pwrite(memoryview(self.head), 0)
    self._pwrite(data, len(self.head) + begin)
    self.pending.discard(name)

  def _pwrite(self, data: memoryview, offset: int) -> None:
    while len(data):   # Linux writes at most ~2 GiB per call
      n = os.pwrite(self.fd, data, offset)
      data, offset = data[n:], offset + n

  def close(self) -> None:
    if self.fd is not None:
      os.close(self.fd)
      self.fd = None
    if self.pending:
      raise RuntimeError(f"{self.path}: {len(self.pending)} tensor(s) never written, e.g. "
                         f"{sorted(self.pending)[0]}")


class _ShardWriter:
  """A thread that writes this process's tensors while the main thread takes part in
  the next gathers: the processes' disks work at the same time, and a gather waits
  for a process's disk only when that process is `_WRITE_AHEAD_BYTES` behind."""

  def __init__(self, shards: dict[str, _StreamedShard]):
    import threading
    self.shards = shards
    self.error: BaseException | None = None
    self._items: list = []
    self._bytes = 0
    self._cond = threading.Condition()
    self._thread = threading.Thread(target=self._run, name="save_hf writer", daemon=True)
    self._thread.start()

  def put(self, fname: str, name: str, value: np.ndarray) -> None:
    with self._cond:
      self._cond.wait_for(lambda: not self._items or self._bytes < _WRITE_AHEAD_BYTES)
      self._items.append((fname, name, value))
      self._bytes += value.nbytes
      self._cond.notify_all()

  def _run(self) -> None:
    while True:
      with self._cond:
        self._cond.wait_for(lambda: self._items)
        item = self._items[0]
      if item is None:
        return
      fname, name, value = item
      if self.error is None:   # after a failure the rest is dropped, never waited for
        try:
          self.shards[fname].write(name, value)
        except Exception as e:  # noqa: BLE001 - reported by close(), on every process
          self.error = e
      with self._cond:
        self._items.pop(0)
        self._bytes -= value.nbytes
        self._cond.notify_all()

  def close(self) -> BaseException | None:
    """Waits for every write; the first error (None if none)."""
    with self._cond:
      self._items.append(None)
      self._cond.notify_all()
    self._thread.join()
    for shard in self.shards.values():
      try:
        shard.close()
      except Exception as e:  # noqa: BLE001
        self.error = self.error or e
    return self.error


def _save_parallel(model: Qwen3, out_dir: str, dtype: str, max_shard_bytes: int,
                   tokenizer_dir: str | None, chat_template: str | None) -> list[str]:
  """`save_hf(parallel=True)` with more than one process: see there."""
  me, processes = jax.process_index(), jax.process_count()
  entries = list(_hf_order(model.cfg, model))
  sizes = [_hf_nbytes(var, layer, dtype) for _, var, layer, _ in entries]
  files = plan_shares(sizes, processes, max_shard_bytes)
  names = [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))]
  owner, file_of = {}, {}
  for fname, (process, positions) in zip(names, files):
    for i in positions:
      owner[i], file_of[i] = process, fname
  shards, setup_error = {}, None
  try:
    os.makedirs(out_dir, exist_ok=True)   # every process: each writes into it
    for fname, (process, positions) in zip(names, files):
      if process == me:
        shards[fname] = _StreamedShard(
            os.path.join(out_dir, fname + ".tmp"),
            [(entries[i][0], _hf_shape(entries[i][3], _hf_layer_shape(entries[i][1],
                                                                      entries[i][2])))
             for i in positions], dtype)
  except Exception as e:   # said to every process before the first gather, which would wait
    setup_error = e
  distributed.raise_if_any_failed(setup_error, f"save_hf {out_dir}")
  # The gathers go round the processes' shares in turn, so that every writer has work
  # from the start rather than process k's disk waiting for the shares before it.
  shares = [[i for i in range(len(entries)) if owner[i] == p] for p in range(processes)]
  order = [share[k] for k in range(max(map(len, shares), default=0))
           for share in shares if k < len(share)]
  writer = _ShardWriter(shards)
  try:
    for i in order:
      name, var, layer, kind = entries[i]
      value = distributed.gather_to(_hf_layout(var.get_value(), layer=layer, kind=kind,
                                               dtype=dtype), owner[i])
      if value is not None:
        writer.put(file_of[i], name, value)
  except BaseException:
    writer.close()   # the writer thread and its open files end with the failed export
    raise
  distributed.raise_if_any_failed(writer.close(), f"save_hf {out_dir}")
  # Past that collective every share is on disk: process 0 completes the directory.
  weight_map = {entries[i][0]: file_of[i] for i in range(len(entries))}
  written = [(os.path.join(out_dir, f + ".tmp"), os.path.join(out_dir, f)) for f in names]
  distributed.on_main(
      lambda: _finish_export(out_dir, model.cfg, dtype, sum(sizes), weight_map, written,
                             tokenizer_dir, chat_template, None),
      f"save_hf {out_dir}")
  return sorted(shards)


def _hf_layer_shape(var, layer: int | None) -> tuple[int, ...]:
  """Our shape of one HF tensor (one layer's slice of a stacked parameter)."""
  return tuple(var.get_value().shape)[1 if layer is not None else 0:]


def _finish_export(out_dir, cfg, dtype, total, weight_map, written, tokenizer_dir,
                   chat_template, failed) -> None:
  """Process 0: the index (unless `weight_map` is None: one file), config.json and
  tokenizer next to the written shards."""
  if failed is not None:
    raise failed
  if weight_map is not None:
    index = {"metadata": {"total_size": int(total)}, "weight_map": weight_map}
    tmp = os.path.join(out_dir, "model.safetensors.index.json.tmp")
    with open(tmp, "w") as f:
      json.dump(index, f, indent=2)
    written.append((tmp, tmp[:-4]))
  tmp = os.path.join(out_dir, "config.json.tmp")
  with open(tmp, "w") as f:
    json.dump(config_to_hf_dict(cfg, dtype), f, indent=2)
  written.append((tmp, tmp[:-4]))
  # Over an earlier export: its config.json goes first and the new one comes last, so
  # that an export cut off in between has none and no loader takes it for complete.
  # Its weight files that this one does not overwrite (a single file then shards, or
  # the other way round) go too: transformers would read model.safetensors and
  # _TensorIndex the index, each other weights.
  finals = {os.path.basename(final) for _, final in written}
  if os.path.exists(os.path.join(out_dir, "config.json")):
    os.remove(os.path.join(out_dir, "config.json"))
  if tokenizer_dir:
    import shutil
    for fname in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "vocab.json", "merges.txt", "generation_config.json"):
      src = os.path.join(tokenizer_dir, fname)
      if os.path.exists(src):
        shutil.copy(src, os.path.join(out_dir, fname))
    if chat_template is not None:
      _write_chat_template(out_dir, chat_template)
  for fname in sorted(os.listdir(out_dir)):
    if fname not in finals and _WEIGHT_FILE.fullmatch(fname):
      os.remove(os.path.join(out_dir, fname))
  for tmp, final in written:   # config.json last
    os.replace(tmp, final)


def _write_chat_template(out_dir: str, chat_template: str) -> None:
  """Sets `chat_template` in out_dir's tokenizer_config.json (created if absent)."""
  path = os.path.join(out_dir, "tokenizer_config.json")
  config: dict[str, Any] = {}
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      try:
        config = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f"save_hf: cannot add the chat template to {path}: invalid JSON "
                         f"({e})") from e
    if not isinstance(config, dict):
      raise ValueError(f"save_hf: {path} must hold a JSON object, got {type(config).__name__}")
  config["chat_template"] = chat_template
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2, ensure_ascii=False)
  os.replace(path + ".tmp", path)
  stale = os.path.join(out_dir, "chat_template.jinja")  # transformers prefers this file
  if os.path.exists(stale):
    os.remove(stale)
