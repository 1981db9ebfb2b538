"""Mesh construction and logical-axis sharding rules.

Parameters and activations are annotated with *logical* axis names ("embed",
"mlp", "batch", ...). A rules table maps each logical name to mesh axes of the
`(data, fsdp, tensor)` mesh, as in MaxText. Changing the parallelism is a change of
rules or mesh shape, never of model code.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Iterable, Mapping, Sequence

from absl import logging
import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
import numpy as np

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes. FSDP shards the model dimension of every weight;
# tensor parallelism splits heads, MLP width and vocab (Megatron layout), so each
# layer needs one all-reduce per attention and per MLP block.
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    # Parameters.
    ("layers", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    # Activations.
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    # The JaxEngine's KV cache (per layer k [slots, kv heads, head_dim, length], v [slots,
    # kv heads, length, head_dim]): slots over the batch axes, heads as the k/v weights,
    # so a decode step's attention reads only its own device's slots and heads. The
    # engine refuses a layout these do not divide (jax_engine.cache_specs).
    ("cache_batch", ("data", "fsdp")),
    ("cache_kv_heads", "tensor"),
    ("cache_head_dim", None),
    ("cache_length", None),
    # The log-prob head (`qwen3.chunked_logprobs` on a mesh): vocab-parallel.
    ("head_batch", "data"),
    ("head_vocab", ("fsdp", "tensor")),
)


def make_mesh(shape: dict[str, int] | Sequence[int],
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the (data, fsdp, tensor) mesh; one size may be -1 to fill the rest."""
  if isinstance(shape, dict):
    unknown = set(shape) - set(MESH_AXES)
    if unknown:
      raise ValueError(f"mesh: unknown axes {sorted(unknown)}; axes are {MESH_AXES}")
    sizes = [int(shape.get(a, 1)) for a in MESH_AXES]
  else:
    sizes = [int(s) for s in shape]
    if len(sizes) != len(MESH_AXES):
      raise ValueError(f"mesh: expected {len(MESH_AXES)} sizes for {MESH_AXES}, got {sizes}")
  devices = list(devices) if devices is not None else jax.devices()
  n = len(devices)
  if sum(s == -1 for s in sizes) > 1:
    raise ValueError(f"mesh: at most one axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
  if any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"mesh: sizes must be positive or -1, got {dict(zip(MESH_AXES, sizes))}")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if n % known:
      raise ValueError(f"mesh: {n} devices do not divide by the fixed axes "
                       f"{dict(zip(MESH_AXES, sizes))} (product {known})")
    sizes[sizes.index(-1)] = n // known
  if math.prod(sizes) != n:
    raise ValueError(
        f"mesh: axes {dict(zip(MESH_AXES, sizes))} multiply to {math.prod(sizes)} but "
        f"there are {n} devices; make them match or use -1 for one axis")
  dev_array = np.asarray(devices).reshape(sizes)
  return Mesh(dev_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(axes: Iterable[str | None], rules=DEFAULT_RULES) -> P:
  table = dict(rules)
  out, used = [], set()
  for name in axes:
    if name is None:
      out.append(None)
      continue
    if name not in table:
      raise KeyError(f"logical axis {name!r} has no sharding rule; rules cover {sorted(table)}")
    mesh_axes = table[name]
    if mesh_axes is None:
      out.append(None)
      continue
    mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
    # A mesh axis may shard only one dimension of an array.
    mesh_axes = tuple(a for a in mesh_axes if a not in used)
    used.update(mesh_axes)
    out.append(mesh_axes[0] if len(mesh_axes) == 1 else (mesh_axes or None))
  return P(*out)


def fit_spec_to_shape(spec: P, shape: Sequence[int], mesh: Mesh, what: str = "") -> P:
  """Drops mesh axes from dimensions they do not divide (replicates them instead).

  Tiny test models and odd vocabularies would otherwise fail to shard; we log it
  so a real run never silently replicates a large weight.
  """
  out = []
  for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    if entry is None:
      out.append(None)
      continue
    axes = (entry,) if isinstance(entry, str) else tuple(entry)
    kept = []
    for a in axes:
      if dim % (math.prod(mesh.shape[k] for k in kept) * mesh.shape[a]) == 0:
        kept.append(a)
      else:
        logging.log_first_n(logging.WARNING, "%s: dim %d not divisible by mesh axis %r "
                            "(size %d); replicating over it", 20, what, dim, a, mesh.shape[a])
    out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return P(*out)


def named_sharding(mesh: Mesh, axes: Sequence[str | None], shape: Sequence[int],
                   rules=DEFAULT_RULES, what: str = "") -> NamedSharding:
  spec = fit_spec_to_shape(logical_to_spec(axes, rules), shape, mesh, what)
  return NamedSharding(mesh, spec)


def _is_variable(x) -> bool:
  from flax import nnx
  return isinstance(x, nnx.Variable)


def state_shardings(state, mesh: Mesh, rules=DEFAULT_RULES):
  """NamedSharding for every Variable of an nnx State, from its `logical_axes`.

  Returns a pytree with the same structure as `state` (Variables whose value is a
  NamedSharding), usable as `out_shardings` / `in_shardings` of jax.jit.
  """
  def one(path, var):
    axes = var.get_metadata().get("logical_axes")
    shape = var.get_value().shape
    name = jax.tree_util.keystr(path)
    if axes is None:
      axes = (None,) * len(shape)
    if len(axes) != len(shape):
      raise ValueError(f"{name}: logical_axes {axes} do not match shape {shape}")
    return var.replace(named_sharding(mesh, axes, shape, rules, what=name))
  return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_variable)


# ---- Activation constraints (active only inside `use_mesh_rules`). ----
_CTX: contextvars.ContextVar[tuple[Mesh, Any] | None] = contextvars.ContextVar(
    "rstar_mesh_rules", default=None)


@contextlib.contextmanager
def use_mesh_rules(mesh: Mesh | None, rules=DEFAULT_RULES):
  """Enables `constrain` inside the block (typically around tracing a jitted step)."""
  token = _CTX.set(None if mesh is None else (mesh, rules))
  try:
    yield
  finally:
    _CTX.reset(token)


def mesh_active() -> bool:
  """Whether code runs inside `use_mesh_rules` with a mesh (activations get sharded)."""
  return _CTX.get() is not None


def logical_size(name: str) -> int:
  """How many shards the active mesh's rules give logical axis `name` (1 off a mesh)."""
  ctx = _CTX.get()
  if ctx is None:
    return 1
  mesh, rules = ctx
  entry = logical_to_spec((name,), rules)[0]
  axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
  return math.prod(mesh.shape[a] for a in axes)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """with_sharding_constraint by logical axes; a no-op without an active mesh."""
  ctx = _CTX.get()
  if ctx is None:
    return x
  mesh, rules = ctx
  spec = fit_spec_to_shape(logical_to_spec(axes, rules), x.shape, mesh, what="activation")
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def batch_sharding(mesh: Mesh, ndim: int, rules=DEFAULT_RULES) -> NamedSharding:
  """Sharding of a [batch, ...] input array: batch over data (and fsdp)."""
  return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), rules))


def place_batch(batch: Mapping[str, Any], mesh: Mesh | None, rules=DEFAULT_RULES
                ) -> dict[str, Any]:
  """Puts every [batch, ...] array of `batch` on the mesh (rows over data x fsdp);
  without a mesh, returns the arrays as they are."""
  if mesh is None:
    return dict(batch)
  return {k: jax.device_put(v, batch_sharding(mesh, np.ndim(v), rules))
          for k, v in batch.items()}


def committed(tree):
  """`tree` with every uncommitted jax.Array committed to the device it is on (no copy:
  the new array shares the buffer, so donating it deletes the original too); committed
  arrays and other leaves as they are. For single-device state: arrays on a mesh are
  committed already.

  Why: jit compiles one program per pattern of committed arguments (a committed one
  carries a sharding annotation into the HLO), and whether an array is committed
  depends on where it came from: a fresh init is not, a checkpoint restore is, a
  step's output is when any input was, and a later recipe stage mixes them (params
  carried over, a fresh step counter or optimizer). Without this the toy recipe
  compiled its train-step shapes again in stages 2 and 3 (one XLA:CPU compile ~10 s)
  and every engine shape again for stage 2's weights, and the persistent compile
  cache could not match them."""
  def commit(a):
    if isinstance(a, jax.Array) and not a.committed:
      return jax.device_put(a, a.sharding)
    return a
  return jax.tree.map(commit, tree)


def shard_model(model, mesh: Mesh | None, rules=DEFAULT_RULES):
  """The model with every parameter placed by its logical axes (unchanged without a mesh)."""
  if mesh is None:
    return model
  from flax import nnx
  graphdef, state = nnx.split(model)
  return nnx.merge(graphdef, jax.device_put(state, state_shardings(state, mesh, rules)))


# ---- config.mesh ------------------------------------------------------------------------
def _rule_text(mesh_axes) -> str:
  if mesh_axes is None:
    return ""
  return mesh_axes if isinstance(mesh_axes, str) else ",".join(mesh_axes)


def _rule_value(text: str):
  axes = tuple(a.strip() for a in text.split(",") if a.strip())
  return None if not axes else axes[0] if len(axes) == 1 else axes


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
  """`config.mesh`: the (data, fsdp, tensor) device mesh and the logical-axis rules.

  Attributes:
    enabled: False runs on one device without a mesh (the CPU default).
    data, fsdp, tensor: axis sizes; one of them may be -1 (all remaining devices).
    rules: logical axis -> mesh axes as text ("" replicated, "tensor", "data,fsdp").
      Entries given here replace those of DEFAULT_RULES; the rest keep theirs.
  """
  enabled: bool = False
  data: int = 1
  fsdp: int = -1
  tensor: int = 1
  rules: Mapping[str, str] = dataclasses.field(
      default_factory=lambda: {name: _rule_text(a) for name, a in DEFAULT_RULES})

  def __post_init__(self):
    known = dict(DEFAULT_RULES)
    unknown = sorted(set(self.rules) - set(known))
    if unknown:
      raise ValueError(f"MeshConfig.rules: unknown logical axes {unknown}; known: "
                       f"{sorted(known)}")
    for name, text in self.rules.items():
      if not isinstance(text, str):
        raise ValueError(f"MeshConfig.rules.{name} must be a string of mesh axes "
                         f"(e.g. 'fsdp' or 'data,fsdp' or '' to replicate), got {text!r}")
      bad = [a for a in text.replace(" ", "").split(",") if a and a not in MESH_AXES]
      if bad:
        raise ValueError(f"MeshConfig.rules.{name}={text!r}: unknown mesh axes {bad}; "
                         f"axes are {MESH_AXES}")

  def logical_rules(self) -> tuple[tuple[str, Any], ...]:
    table = dict(DEFAULT_RULES)
    table.update({name: _rule_value(text) for name, text in self.rules.items()})
    return tuple(table.items())

  def make(self, devices: Sequence[jax.Device] | None = None) -> Mesh | None:
    if not self.enabled:
      return None
    return make_mesh({"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}, devices)
