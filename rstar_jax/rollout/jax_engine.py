"""JaxEngine: the embedded generation engine (in-process, continuous batching).

A fixed KV cache of `num_slots` sequences x `max_len` tokens. Each iteration of the
engine loop
  1. admits queued requests into free slots, prefilling several in one jitted call
     (rows padded to a power-of-two length bucket, their count to a power of 4, so
     few shapes compile; at most `prefill_batch_tokens` padded tokens a call), and
  2. runs one jitted decode call for every active slot at once: one step, or
     `decode_steps` steps (unrolled, or an on-device loop: `decode_loop`) while no
     request waits for a slot.
A request that finishes (stop token, max_new_tokens, cache full) frees its slot at
once, and the next queued request takes it at the next iteration: a trajectory that
is waiting on a tool call holds no slot and delays no one.

Prefix reuse: a freed slot remembers which token ids its cache holds. A new request
whose input extends that content (the same trajectory resuming after a tool call)
is placed there and prefills only the new tokens. If the slot was taken meanwhile,
the request is prefilled from scratch elsewhere: correct either way.

Batch invariance (`batch_invariant`): the choices above make a call's shapes depend on
the requests that share it, and XLA:CPU rounds a row differently under other shapes, so
a request's log-probs depended on its company and on timing. The switch fixes every
call's shapes by the request alone (whole-slot decode, one request per prefill, no
prefix reuse): docs/guides/reproducibility.md.

On a mesh (the model's weights spread over one) the cache is created sharded, slots over
data x fsdp and KV heads over tensor (the "cache_*" rules of `sharding.DEFAULT_RULES`,
`cache_specs`), and every prefill and decode call returns it in that layout: each device
holds its share only (`cache_bytes_per_device`, which the preflight can call without
devices). A layout the mesh does not divide is refused at construction.

Parameters: `update_weights(state)` swaps what the next step uses. With
`per_layer_weights` (default) the engine keeps its own copy of the layers' weights,
one buffer per layer; otherwise it reads the trainer's arrays in place (no copy).
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import math
import threading
import time
from typing import Mapping, Sequence

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import numpy as np

from rstar_jax import sharding
from rstar_jax.model import qwen3
from rstar_jax.model.model_config import Qwen3Config
from rstar_jax.model.qwen3 import Qwen3
from rstar_jax.rollout import sampling
from rstar_jax.rollout.engine import GenerationRequest, GenerationResult


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  num_slots: int = 8
  max_len: int = 1024          # KV cache length per slot: prompt + everything generated
  min_prefill_bucket: int = 16
  reuse_prefix: bool = True
  cache_dtype: str | None = None  # default: the model's compute dtype
  # Decode attends to the first B slots of the cache only, B the smallest power of two
  # (>= min_prefill_bucket, capped at max_len) above every active position, while B is
  # small enough to pay (`decode_attend`): a step reads the filled part of the slots,
  # not all max_len of each (one compile per B). Prefill calls do the same (a first
  # turn of 64 tokens: 2.5x faster at max_len 512).
  decode_buckets: bool = True
  # A slot whose request ended with one of its `continue_ids` (a tool call) keeps its
  # prefix this long for the trajectory's next turn: queued requests that do not
  # extend it take other free slots, or wait, instead of evicting it while the tool
  # runs. 0 turns it off.
  prefix_grace_s: float = 0.25
  # Requests admitted together are prefilled together: one call carries up to this
  # many padded tokens (rows x length bucket; a longer request goes alone), its rows
  # padded to a power of 4 (few shapes to compile). 0: one request per call. A burst
  # of 64 prompts of 24-64 tokens: 1.7-1.8x faster than one call each at 256 (1024
  # was no faster).
  prefill_batch_tokens: int = 256
  # Tokens each row samples per decode call while no request waits for a slot (one
  # step a call while one does, so a freed slot is refilled at once), as SGLang's
  # num_continuous_decode_steps: the steps are unrolled in one compiled call, so each
  # layer's weights are sliced out of the stacked arrays once for all of them and the
  # host is reached once; the tokens are the same as one step a call. A row that stops
  # part-way wastes the call's remaining steps. Long generations gain (64 slots x 208,
  # `small` preset: 4.95 -> 4.50 ms a step at 4, 4.26 at 8); the toy recipe's short
  # agent turns did not (RL steps no faster, a second compile per bucket), hence 1.
  decode_steps: int = 1
  # How a call's decode_steps run: unrolled (False, default: each layer's weights
  # sliced out of the stacked arrays once for all steps; the program grows with the
  # steps) or as a lax.fori_loop over one step's program (True: one step compiled
  # whatever decode_steps is; tokens, log-probs and the cache stay on the device
  # between steps, and the host is reached once a call either way). The same tokens.
  decode_loop: bool = False
  # The engine keeps each layer's weights in a buffer of its own (a copy of the
  # stacked [L, ...] arrays, made at `update_weights`). XLA:CPU copies a layer's
  # weights out of the stacked arrays on every call (a slice feeds no GEMM in place):
  # ~1.5 ms of a 1-row x 32-token prefill's ~4 at 64 slots x 512 (`small`). False
  # reads the caller's arrays in place: no second copy of the weights in memory.
  per_layer_weights: bool = True
  # Batch-invariant rollouts: a request's tokens and log-probs depend on the request
  # and the weights only, not on which requests share its prefill or decode calls, its
  # slot, or timing. XLA:CPU rounds a row differently when the shapes of the call it
  # runs in change, and three of this engine's choices change them with the company a
  # request keeps: the decode attention length (`decode_attend`: the bucket of the
  # LONGEST active row), the prefill call's rows and padded length (the requests
  # admitted with it), and prefix reuse (whether a trajectory's slot still holds its
  # previous turn when the next arrives: wall-clock, `prefix_grace_s`; k/v computed by
  # decode steps are not the bits a prefill computes). True: decode always reads whole
  # slots (every call the same [num_slots, max_len] shapes), each request is prefilled
  # alone (its own length bucket), and no prefix is reused (every turn is prefilled
  # from its full context). It overrides decode_buckets, prefill_batch_tokens and
  # reuse_prefix. Cost: docs/guides/reproducibility.md.
  batch_invariant: bool = False

  @property
  def reuses_prefix(self) -> bool:
    """Whether freed slots keep their k/v for a request that extends them."""
    return self.reuse_prefix and not self.batch_invariant

  def buckets(self) -> list[int]:
    """Every value `length_bucket` can return, ascending."""
    return sorted({self.length_bucket(1 << k) for k in range(self.max_len.bit_length() + 1)})

  def prefill_rows(self, length: int) -> list[int]:
    """The row counts a prefill call of this length bucket may have (powers of 4, at
    most num_slots; one row when batch_invariant)."""
    out = [1]
    if self.batch_invariant:
      return out
    while out[-1] * 4 * length <= self.prefill_batch_tokens and out[-1] * 4 <= self.num_slots:
      out.append(out[-1] * 4)
    return out

  def prefill_rows_for(self, n: int, length: int) -> int | None:
    """The padded row count of a prefill call of n requests (None: too many)."""
    return next((r for r in self.prefill_rows(length) if r >= n), None)

  def length_bucket(self, n: int) -> int:
    """The power of two >= n (at least min_prefill_bucket, at most max_len): the padded
    length of a prefill of n tokens, and the slots a decode step at length n reads."""
    return min(max(self.min_prefill_bucket, 1 << (n - 1).bit_length()), self.max_len)

  def decode_attend(self, n: int) -> int | None:
    """The slots a decode step at length n reads: its `length_bucket` while that is
    under a third of max_len, else whole slots (None). A prefix of every slot is a
    strided copy on XLA:CPU before the fused multiply-and-reduce reads it (read,
    write, read again), so above ~1/3 reading whole slots is cheaper: one layer at
    64 slots x 208, bucket 128, 0.67 ms sliced vs 0.41 ms whole; x 512, bucket 256,
    1.63 vs 1.21; bucket 128, 0.55 vs 1.16."""
    if not self.decode_buckets or self.batch_invariant:
      return None
    bucket = self.length_bucket(n)
    return bucket if 3 * bucket < self.max_len else None

  def __post_init__(self):
    if self.prefix_grace_s < 0:
      raise ValueError(f"EngineConfig.prefix_grace_s must be >= 0, got {self.prefix_grace_s}")
    if self.prefill_batch_tokens < 0:
      raise ValueError(f"EngineConfig.prefill_batch_tokens must be >= 0, got "
                       f"{self.prefill_batch_tokens}")
    if self.num_slots <= 0 or self.max_len <= 1 or self.min_prefill_bucket <= 0:
      raise ValueError(f"EngineConfig: num_slots, max_len, min_prefill_bucket must be "
                       f"positive (got {self.num_slots}, {self.max_len}, "
                       f"{self.min_prefill_bucket})")
    if not 1 <= self.decode_steps <= 64:
      raise ValueError(f"EngineConfig.decode_steps must be in [1, 64], got {self.decode_steps}")


# ---- The KV cache's layout over a mesh -----------------------------------------------
# qwen3.init_cache's arrays (one of each per layer), by logical axis: the "cache_*" rules
# of sharding.DEFAULT_RULES place them (slots over data x fsdp, KV heads over tensor).
CACHE_AXES: dict[str, tuple[str, ...]] = {
    "k": ("cache_batch", "cache_kv_heads", "cache_head_dim", "cache_length"),
    "v": ("cache_batch", "cache_kv_heads", "cache_length", "cache_head_dim"),
}
# The config field each cache dimension comes from (named by the refusal below).
_CACHE_FIELDS = {"cache_batch": "EngineConfig.num_slots",
                 "cache_kv_heads": "Qwen3Config.num_key_value_heads",
                 "cache_head_dim": "Qwen3Config.head_dim",
                 "cache_length": "EngineConfig.max_len"}


def cache_shapes(model_cfg: Qwen3Config, engine_cfg: EngineConfig) -> dict[str, tuple[int, ...]]:
  """Shapes of one layer's k and v in the engine's cache (`qwen3.init_cache`'s layout;
  the engine checks them against it)."""
  nkv, d = model_cfg.num_key_value_heads, model_cfg.head_dim
  b, s = engine_cfg.num_slots, engine_cfg.max_len
  return {"k": (b, nkv, d, s), "v": (b, nkv, s, d)}


def _mesh_sizes(mesh_shape: Mapping[str, int]) -> dict[str, int]:
  unknown = sorted(set(mesh_shape) - set(sharding.MESH_AXES))
  if unknown:
    raise ValueError(f"mesh_shape: unknown axes {unknown}; axes are {sharding.MESH_AXES}")
  sizes = {a: int(mesh_shape.get(a, 1)) for a in sharding.MESH_AXES}
  bad = {a: n for a, n in sizes.items() if n < 1}
  if bad:
    raise ValueError(f"mesh_shape: axis sizes must be resolved positive numbers, got {bad}; "
                     f"pass the built mesh's shape (sharding.make_mesh(...).shape) for -1")
  return sizes


def cache_specs(model_cfg: Qwen3Config, engine_cfg: EngineConfig,
                mesh_shape: Mapping[str, int], rules=sharding.DEFAULT_RULES
                ) -> dict[str, PartitionSpec]:
  """PartitionSpecs of the cache's k and v arrays on a mesh of `mesh_shape` (axis ->
  size) under logical-axis `rules`.

  Raises ValueError, naming the field, its value and the fix, when the mesh axes a rule
  gives a dimension do not divide it. Refused rather than replicated with a warning (as
  `sharding.fit_spec_to_shape` does for weights): the cache is the engine's largest
  array (Qwen3-14B, 64 slots x 13,312 tokens: ~140 GB in bf16), so falling back would
  multiply what every device holds by the axis size, and a tiny test model never needs
  it (its slot count is ours to choose). Replicating is still possible, by asking for
  it: a rule of "" for that logical axis.
  """
  sizes = _mesh_sizes(mesh_shape)
  shapes = cache_shapes(model_cfg, engine_cfg)
  out = {}
  for name, axes in CACHE_AXES.items():
    spec = sharding.logical_to_spec(axes, rules)
    for logical, dim, entry in zip(axes, shapes[name], spec):
      mesh_axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
      n = math.prod(sizes[a] for a in mesh_axes)
      if dim % n:
        over = " x ".join(f"{a}={sizes[a]}" for a in mesh_axes)
        raise ValueError(
            f"the KV cache cannot be sharded over the mesh: {_CACHE_FIELDS[logical]}={dim} "
            f"is not a multiple of {n} (mesh axes {over}, the rule for {logical!r}); set "
            f"{_CACHE_FIELDS[logical]} to a multiple of {n}, or change the mesh, or set the "
            f"rule mesh.rules.{logical} to axes whose sizes divide {dim} (\"\" keeps the "
            f"whole dimension on every device: {n}x the cache per device)")
    out[name] = spec
  return out


def cache_bytes_per_device(model_cfg: Qwen3Config, engine_cfg: EngineConfig,
                           mesh_shape: Mapping[str, int] | None = None,
                           rules=sharding.DEFAULT_RULES) -> int:
  """Bytes of one JaxEngine's KV cache (k and v of every layer) on each device of a
  mesh of `mesh_shape` (axis -> size, e.g. `{"fsdp": 8, "tensor": 2}` or a Mesh's
  `.shape`; None: one device, the whole cache). Pure: no device is touched. Raises as
  `cache_specs` where the engine would refuse the layout."""
  itemsize = jnp.dtype(engine_cfg.cache_dtype or model_cfg.dtype).itemsize
  shapes = cache_shapes(model_cfg, engine_cfg)
  if mesh_shape is None:
    shards = {name: 1 for name in shapes}
  else:
    sizes = _mesh_sizes(mesh_shape)
    specs = cache_specs(model_cfg, engine_cfg, sizes, rules)
    shards = {name: math.prod(sizes[a] for e in spec if e is not None
                              for a in ((e,) if isinstance(e, str) else e))
              for name, spec in specs.items()}
  return model_cfg.num_hidden_layers * sum(
      math.prod(shape) // shards[name] * itemsize for name, shape in shapes.items())


def _weights_mesh(state) -> Mesh | None:
  """The mesh the weights are spread over (None: one device, or no NamedSharding)."""
  for leaf in jax.tree.leaves(state):
    s = getattr(leaf, "sharding", None)
    if isinstance(s, NamedSharding) and s.mesh.size > 1:
      return s.mesh
  return None


def _constrain_cache(cache, cache_sharding):
  """`cache` held to the engine's (k, v) shardings (None: as it is).

  Given the cache in this layout, GSPMD kept it through every prefill and decode variant
  on 4 CPU devices (fsdp x tensor, data x fsdp, tensor alone); the constraint makes that
  a guarantee instead of an outcome of propagation. Left to choose (the cache passed
  unplaced, as before it was created sharded), GSPMD took the layout from the weights:
  KV heads over tensor, every slot on every device. A returned layout other than the
  donated one would make each call copy the cache instead of updating it in place, and
  compile the next call again for the new layout."""
  if cache_sharding is None:
    return cache
  k_sh, v_sh = cache_sharding
  wsc = jax.lax.with_sharding_constraint
  return {"k": tuple(wsc(c, k_sh) for c in cache["k"]),
          "v": tuple(wsc(c, v_sh) for c in cache["v"])}


@dataclasses.dataclass
class _Slot:
  request: GenerationRequest | None = None
  future: concurrent.futures.Future | None = None
  cached: list[int] = dataclasses.field(default_factory=list)  # ids whose k/v are cached
  next_token: int = 0          # sampled, not yet in the cache
  out_ids: list[int] = dataclasses.field(default_factory=list)
  out_logps: list[float] = dataclasses.field(default_factory=list)
  reused: int = 0
  wait_s: float = 0.0
  released_at: float = 0.0
  held_until: float = 0.0      # kept for its own trajectory's next turn until then
  weights: int = 0             # JaxEngine._weights (update count) its k/v began with
  version: str | None = None   # and that update's weight_version


def settle_future(fut: concurrent.futures.Future, result=None, error: BaseException | None = None):
  """Result or error for a caller that may have cancelled meanwhile (its task timed out
  or was torn down): a cancelled future takes nothing and must not stop the engine."""
  if fut.done():
    return
  try:
    if error is not None:
      fut.set_exception(error)
    else:
      fut.set_result(result)
  except concurrent.futures.InvalidStateError:   # cancelled since the check
    pass


def _layer_tuple(x) -> bool:
  return isinstance(x, tuple)


@jax.jit
def _split_layers(layers):
  return jax.tree.map(tuple, layers)


def _per_layer(state):
  """`state` with each stacked [L, ...] array of the layers as a tuple of L arrays
  (only the layers go through the jitted split: the other arrays are not copied)."""
  out = jax.tree.map(lambda a: a, state)
  out["layers"] = _split_layers(state["layers"])
  return out


def _stacked(state):
  """Inverse of `_per_layer` (identity on a stacked state), inside a jitted call:
  XLA folds the model's slice of layer i out of the stack back to buffer i, so no
  weight is copied."""
  out = jax.tree.map(lambda a: a, state, is_leaf=_layer_tuple)
  out["layers"] = jax.tree.map(lambda t: jnp.stack(t) if _layer_tuple(t) else t,
                               state["layers"], is_leaf=_layer_tuple)
  return out


@functools.partial(jax.jit, static_argnames=("graphdef", "attend_len", "cache_sharding"),
                   donate_argnames=("cache",))
def _prefill(graphdef, state, cache, slots, tokens, positions, last, seeds, temps, top_p, top_k,
             attend_len=None, cache_sharding=None):
  """Prefills row r of `tokens` [P, T] into cache slot slots[r]; samples each row's
  first token from its position last[r]. Only the first `attend_len` positions of
  the rows' slots are read and written back (every real token's position is below
  it). Padding rows name slot num_slots (their reads are zeros, their writes are
  dropped). `cache_sharding`: the cache's (k, v) NamedShardings on a mesh, kept by
  the returned cache (`_constrain_cache`)."""
  model = nnx.merge(graphdef, _stacked(state))
  rows = qwen3.cache_rows(cache, slots, attend_len)
  hidden, rows = model(tokens, positions, cache=rows)
  h_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)
  logits = model.logits(h_last)[:, 0]
  tok, logp = sampling.sample(logits, seeds, jnp.zeros_like(seeds), temps, top_p, top_k)
  cache = _constrain_cache(qwen3.set_cache_rows(cache, slots, rows), cache_sharding)
  return cache, tok, logp


@functools.partial(jax.jit,
                   static_argnames=("graphdef", "attend_len", "steps", "loop", "cache_sharding"),
                   donate_argnames=("cache",))
def _decode(graphdef, state, cache, tokens, positions, seeds, indices, temps, top_p, top_k,
            attend_len=None, steps=1, loop=False, cache_sharding=None):
  """`steps` decode steps: step j feeds row r the token step j - 1 sampled (step 0:
  tokens[r]) at positions[r] + j and draws with index indices[r] + j, so the tokens
  equal `steps` calls of one step. Returns the cache and tokens, log-probs [B, steps].
  Unrolled, not a loop: XLA then slices each layer's weights out of the stacked
  arrays once for all steps (one copy per call instead of per step). Positions past
  the cache end (idle rows, rows past their stop) write nowhere. `loop`: the steps as a
  lax.fori_loop instead (EngineConfig.decode_loop). `cache_sharding`: as `_prefill`'s,
  held after every step."""
  model = nnx.merge(graphdef, _stacked(state))
  if loop and steps > 1:
    return _decode_loop(model, cache, tokens, positions, seeds, indices, temps, top_p, top_k,
                        attend_len, steps, cache_sharding)
  tok, toks, logps = tokens, [], []
  for j in range(steps):
    hidden, cache = model(tok[:, None], (positions + j)[:, None], cache=cache,
                          attend_len=attend_len)
    cache = _constrain_cache(cache, cache_sharding)
    logits = model.logits(hidden)[:, 0]
    tok, logp = sampling.sample(logits, seeds, indices + j, temps, top_p, top_k)
    toks.append(tok)
    logps.append(logp)
  return cache, jnp.stack(toks, 1), jnp.stack(logps, 1)


def _decode_loop(model, cache, tokens, positions, seeds, indices, temps, top_p, top_k,
                 attend_len, steps, cache_sharding=None):
  """`_decode`'s steps in a lax.fori_loop: step j's token and log-prob are written to
  column j of on-device buffers carried with the cache."""
  def body(j, carry):
    cache, tok, toks, logps = carry
    hidden, cache = model(tok[:, None], (positions + j)[:, None], cache=cache,
                          attend_len=attend_len)
    cache = _constrain_cache(cache, cache_sharding)
    logits = model.logits(hidden)[:, 0]
    tok, logp = sampling.sample(logits, seeds, indices + j, temps, top_p, top_k)
    tok = tok.astype(jnp.int32)
    return (cache, tok, toks.at[:, j].set(tok),
            logps.at[:, j].set(logp.astype(jnp.float32)))

  b = tokens.shape[0]
  init = (_constrain_cache(cache, cache_sharding), jnp.asarray(tokens, jnp.int32), jnp.zeros((b, steps), jnp.int32),
          jnp.zeros((b, steps), jnp.float32))
  cache, _, toks, logps = jax.lax.fori_loop(0, steps, body, init)
  return cache, toks, logps


class JaxEngine:
  """Continuous-batching generation over a Qwen3 held in this process."""

  def __init__(self, model: Qwen3, config: EngineConfig, name: str = "jax0", *,
               rules=sharding.DEFAULT_RULES):
    """`rules`: the logical-axis rules (config.mesh.logical_rules()) that place the KV
    cache when the model's weights are spread over a mesh (`cache_specs`)."""
    self.config = config
    self.name = name
    self.graphdef, state = nnx.split(model)
    # Committed: one compiled program per shape whatever made the weights (a fresh
    # init, a restore; `sharding.committed`).
    state = sharding.committed(state)
    self.state = _per_layer(state) if config.per_layer_weights else state
    self.model_cfg = model.cfg
    self.cache, self._cache_sharding = self._init_cache(model, _weights_mesh(state), rules)
    self.slots = [_Slot() for _ in range(config.num_slots)]
    self.queue: collections.deque = collections.deque()
    self._lock = threading.Condition()
    self._thread: threading.Thread | None = None
    self._stop = False
    self.metrics = collections.Counter()
    self._t_start = time.perf_counter()
    self.weight_version: str | None = None
    self._weights = 0   # update_weights calls so far: which weights a slot's k/v came from

  def _init_cache(self, model: Qwen3, mesh: Mesh | None, rules):
    """(cache, its (k, v) shardings or None). On a mesh the cache is created sharded
    (`cache_specs`): each device allocates only its block, never the whole."""
    cfg = self.config
    dtype = cfg.cache_dtype or model.cfg.dtype
    init = lambda: model.init_cache(cfg.num_slots, cfg.max_len, dtype)
    if mesh is None:
      # The cache comes back from every call committed: so must the first call's, or
      # that shape compiles twice.
      return sharding.committed(init()), None
    if getattr(model.cfg, "decode_attention_impl", "dense") == "pallas":
      # The Pallas decode kernel is one custom call XLA cannot split: over a sharded cache
      # it would gather the whole cache to every device at each step.
      raise ValueError("Qwen3Config.decode_attention_impl='pallas' reads the KV cache through "
                       "one kernel call, which a cache split over a mesh "
                       f"({dict(mesh.shape)}) would gather whole at every step; fix: "
                       "decode_attention_impl='dense' on a mesh, or one device per engine")
    specs = cache_specs(model.cfg, cfg, mesh.shape, rules)
    want = cache_shapes(model.cfg, cfg)
    abstract = jax.eval_shape(init)
    for name in CACHE_AXES:
      got = {a.shape for a in abstract[name]}
      if got != {want[name]}:   # qwen3.init_cache's layout changed: CACHE_AXES must follow
        raise RuntimeError(f"qwen3.init_cache's {name} arrays have shapes {sorted(got)}, but "
                           f"jax_engine.CACHE_AXES describes {want[name]}; update CACHE_AXES "
                           f"and cache_shapes to the new layout")
    k_sh, v_sh = NamedSharding(mesh, specs["k"]), NamedSharding(mesh, specs["v"])
    out = {"k": tuple(k_sh for _ in abstract["k"]), "v": tuple(v_sh for _ in abstract["v"])}
    return jax.jit(init, out_shardings=out)(), (k_sh, v_sh)

  # ---- Public API ------------------------------------------------------------
  @property
  def max_len(self) -> int:
    return self.config.max_len

  def update_weights(self, state, version: str | None = None) -> None:
    """Uses `state` (an nnx State of the same graph) from the next step on; results
    generated from then on carry `version` (unchanged when None)."""
    state = sharding.committed(state)
    if self.config.per_layer_weights:
      state = _per_layer(state)
    with self._lock:
      self.state = state
      self._weights += 1
      if version is not None:
        self.weight_version = str(version)
      # Cached k/v were computed with the old weights: never reuse them. A running
      # request's are dropped when it ends, and its result names both versions.
      for s in self.slots:
        if s.request is None:
          s.cached, s.held_until = [], 0.0

  def _weights_now(self):
    """(state, update count, version), read together: an update may land at any time."""
    with self._lock:
      return self.state, self._weights, self.weight_version

  def submit(self, request: GenerationRequest) -> concurrent.futures.Future:
    request.validate(self.config.max_len)
    fut: concurrent.futures.Future = concurrent.futures.Future()
    with self._lock:
      self.queue.append((request, fut, time.perf_counter()))
      self._lock.notify()
    return fut

  async def generate(self, request: GenerationRequest) -> GenerationResult:
    import asyncio
    self.start()
    return await asyncio.wrap_future(self.submit(request))

  def generate_sync(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    """Runs the loop in this thread until all `requests` are done (tests, notebooks)."""
    futs = [self.submit(r) for r in requests]
    while not all(f.done() for f in futs):
      self.step()
      if not self.num_active():
        with self._lock:
          wait = self._held_wait()
        if wait:
          time.sleep(wait)
    return [f.result() for f in futs]

  def start(self) -> None:
    if self._thread is None or not self._thread.is_alive():
      self._stop = False
      self._thread = threading.Thread(target=self._loop, name=f"{self.name}-loop", daemon=True)
      self._thread.start()

  def stop(self) -> None:
    """Ends the loop thread; requests still queued or running fail (never left waiting)."""
    with self._lock:
      self._stop = True
      self._lock.notify()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    self._fail_all(RuntimeError(f"engine {self.name} stopped with this request unfinished"))

  def _fail_all(self, error: BaseException) -> None:
    with self._lock:
      for s in self.slots:
        if s.future is not None:
          settle_future(s.future, error=error)
        s.request, s.future, s.cached = None, None, []
      while self.queue:
        settle_future(self.queue.popleft()[1], error=error)

  def free_kv_tokens(self) -> int:
    """KV capacity in tokens not promised to running or queued requests."""
    with self._lock:
      cap = self.config.max_len
      free = sum(cap if s.request is None else cap - len(s.cached) - 1 for s in self.slots)
      queued = sum(min(cap, len(r.input_ids) + r.max_new_tokens) for r, _, _ in self.queue)
      return free - queued

  def num_active(self) -> int:
    return sum(s.request is not None for s in self.slots)

  def stats(self) -> dict[str, float]:
    m = dict(self.metrics)
    elapsed = time.perf_counter() - self._t_start
    m["elapsed_s"] = elapsed
    steps = max(m.get("decode_steps", 0), 1)
    m["slot_utilisation"] = m.get("active_slot_steps", 0) / (steps * self.config.num_slots)
    m["busy_fraction"] = m.get("busy_s", 0.0) / max(elapsed, 1e-9)
    return m

  # ---- Engine loop -----------------------------------------------------------
  def _loop(self):
    while True:
      with self._lock:
        while not self._stop and self.num_active() == 0 and (
            not self.queue or (held := self._held_wait()) is not None):
          # Nothing to run: no request, or the queued ones wait for held slots.
          self._lock.wait(held if self.queue else None)
        if self._stop:
          return
      try:
        self.step()
      except Exception as e:  # never strand waiters: fail every pending future loudly
        self._fail_all(e)
        raise

  def step(self) -> None:
    t0 = time.perf_counter()
    self._admit()
    if self.num_active():
      self._decode_step()
    self.metrics["busy_s"] += time.perf_counter() - t0

  def _held_wait(self) -> float | None:
    """Seconds until the first held slot frees up, when every queued request can only
    wait for one (None: one can be admitted now, or nothing is held)."""
    if not self.queue or self._next_admissible() is not None:
      return None
    now = time.perf_counter()
    held = [s.held_until - now for s in self.slots if s.request is None and s.held_until > now]
    return max(min(held), 1e-3) if held else None

  def _pick_slot(self, ids: Sequence[int]) -> tuple[int, int] | None:
    free = [i for i, s in enumerate(self.slots) if s.request is None]
    if not free:
      return None
    best, best_len = None, -1
    if self.config.reuses_prefix:
      for i in free:
        c = self.slots[i].cached
        if c and len(c) < len(ids) and list(ids[:len(c)]) == c and len(c) > best_len:
          best, best_len = i, len(c)
    if best is None:  # least recently released, so recent slots keep their prefix longer
      now = time.perf_counter()
      open_ = [i for i in free if self.slots[i].held_until <= now]
      if not open_:
        return None   # every free slot waits for its trajectory's next turn
      best = min(open_, key=lambda i: self.slots[i].released_at)
      best_len = 0
    return best, best_len

  def _next_admissible(self) -> tuple[int, tuple[int, int]] | None:
    """(queue index, slot pick) of the first queued request that can start now: the
    head, unless only held slots are free; then the first that continues one of them."""
    pick = self._pick_slot(self.queue[0][0].input_ids)
    if pick is not None:
      return 0, pick
    now = time.perf_counter()
    held = [s.cached for s in self.slots
            if s.request is None and s.held_until > now and s.cached]
    if not held:
      return None
    for k, (req, _, _) in enumerate(self.queue):
      ids = req.input_ids
      # Cheap checks first: the queue can be long and prefixes hundreds of tokens.
      if any(len(c) < len(ids) and ids[len(c) - 1] == c[-1] and ids[0] == c[0]
             for c in held):
        pick = self._pick_slot(ids)
        if pick is not None:
          return k, pick
    return None

  def _admit(self) -> None:
    admitted = []  # slot indices, taken now so that the next pick sees them busy
    with self._lock:
      if any(fut.cancelled() for _, fut, _ in self.queue):   # callers gone: never start
        self.queue = collections.deque(q for q in self.queue if not q[1].cancelled())
      while self.queue:
        found = self._next_admissible()
        if found is None:
          break
        k, (i, reuse) = found
        req, fut, t_sub = self.queue[k]
        del self.queue[k]
        s = self.slots[i]
        s.request, s.future, s.cached, s.held_until = req, fut, list(req.input_ids), 0.0
        s.out_ids, s.out_logps, s.reused = [], [], reuse
        s.wait_s = time.perf_counter() - t_sub
        admitted.append(i)
    # Calls of similar length buckets: sorted, then cut where the padded batch would
    # exceed prefill_batch_tokens.
    bucket = lambda i: self.config.length_bucket(len(self.slots[i].cached) - self.slots[i].reused)
    admitted.sort(key=bucket)
    groups: list[list[int]] = []
    for i in admitted:
      if not groups or self.config.prefill_rows_for(len(groups[-1]) + 1, bucket(i)) is None:
        groups.append([])
      groups[-1].append(i)
    for k, group in enumerate(groups):
      try:
        self._prefill_group(group, bucket(group[-1]))
      except BaseException as e:
        # The slots of this and later groups hold no k/v: never decode them.
        with self._lock:
          for i in [i for g in groups[k:] for i in g]:
            s = self.slots[i]
            if s.future is not None:
              settle_future(s.future, error=e)
            s.request, s.future, s.cached = None, None, []
        raise

  def _prefill_arrays(self, rows: int, length: int) -> tuple[np.ndarray, ...]:
    """A prefill call's inputs, every row padding: no slot, writes nowhere."""
    return (np.full(rows, self.config.num_slots, np.int32), np.zeros((rows, length), np.int32),
            np.full((rows, length), self.config.max_len, np.int32), np.zeros(rows, np.int32),
            np.zeros(rows, np.int32), np.ones(rows, np.float32), np.ones(rows, np.float32),
            np.zeros(rows, np.int32))

  def warm_up(self) -> int:
    """Compiles every prefill shape (`EngineConfig.prefill_rows` x length buckets) and
    every decode bucket by running them on padding rows (the cache is unchanged).
    Call it while nothing runs; returns the number of shapes."""
    n = 0
    for length in self.config.buckets():
      attends = [a for a in self.config.buckets() if a >= length]
      for rows in self.config.prefill_rows(length):
        for attend in attends if self.config.decode_buckets else [None]:
          self.cache, tok, _ = _prefill(self.graphdef, self.state, self.cache,
                                        *self._prefill_arrays(rows, length),
                                        attend_len=attend, cache_sharding=self._cache_sharding)
          n += 1
    jax.block_until_ready(tok)
    slots = self.config.num_slots
    idle = np.full(slots, self.config.max_len, np.int32)
    # numpy, as `_decode_step` passes them: jax arrays would be another cache entry.
    z, ones = np.zeros(slots, np.int32), np.ones(slots, np.float32)
    for attend in sorted({self.config.decode_attend(b) for b in self.config.buckets()},
                         key=lambda a: a or 0):
      for steps in sorted({1, self.config.decode_steps}):
        self.cache, tok, _ = _decode(self.graphdef, self.state, self.cache, z, idle,
                                     z, z, ones, ones, z, attend_len=attend, steps=steps,
                                     loop=self.config.decode_loop,
                                     cache_sharding=self._cache_sharding)
        n += 1
    jax.block_until_ready(tok)
    return n

  def _prefill_group(self, group: list[int], length: int) -> None:
    """Prefills the admitted slots `group` (ascending length buckets, the last = length)."""
    rows = self.config.prefill_rows_for(len(group), length)
    slots, toks, pos, last, seeds, temps, top_p, top_k = self._prefill_arrays(rows, length)
    for r, i in enumerate(group):
      s = self.slots[i]
      new = s.cached[s.reused:]
      slots[r], last[r] = i, len(new) - 1
      toks[r, :len(new)] = new
      pos[r] = s.reused + np.arange(length, dtype=np.int32)
      req = s.request
      seeds[r], temps[r], top_p[r], top_k[r] = req.seed, req.temperature, req.top_p, req.top_k
      self.metrics["prefill_tokens"] += len(new)
      self.metrics["reused_prefix_tokens"] += s.reused
      self.metrics["requests"] += 1
    attend = None
    if self.config.decode_buckets:  # every row's positions stay below it
      attend = self.config.length_bucket(max(self.slots[i].reused for i in group) + length)
    state, weights, version = self._weights_now()
    for i in group:
      self.slots[i].weights, self.slots[i].version = weights, version
    t0 = time.perf_counter()
    self.cache, tok, logp = _prefill(
        self.graphdef, state, self.cache, slots, toks, pos, last, seeds, temps, top_p,
        top_k, attend_len=attend, cache_sharding=self._cache_sharding)
    tok, logp = np.asarray(tok), np.asarray(logp)  # waits for the device
    self.metrics["prefill_s"] += time.perf_counter() - t0
    self.metrics["prefill_calls"] += 1
    self.metrics["prefill_padded_tokens"] += rows * length
    self.metrics["prefill_padding_rows"] += rows - len(group)
    for r, i in enumerate(group):
      self._accept(i, int(tok[r]), float(logp[r]), weights, version)

  def _accept(self, i: int, tok: int, logp: float, weights: int, version: str | None) -> None:
    """Takes token `tok` sampled for slot i with weights (`weights`, `version`)."""
    s = self.slots[i]
    req = s.request
    s.out_ids.append(tok)
    s.out_logps.append(logp)
    s.next_token = tok
    self.metrics["generated_tokens"] += 1
    reason = None
    if tok in req.stop_token_ids:
      reason = "stop"
    elif len(s.out_ids) >= req.max_new_tokens or len(s.cached) + 1 >= self.config.max_len:
      reason = "length"
    if reason is None and not s.future.cancelled():
      return
    mixed = s.weights != weights   # weights updated while it ran
    result = GenerationResult(
        request_id=req.request_id, output_ids=s.out_ids, logprobs=s.out_logps,
        finish_reason=reason or "abort", prompt_tokens=len(req.input_ids),
        reused_prefix_tokens=s.reused, queue_wait_s=s.wait_s,
        # Both versions, as SGLang's spans would show them: check_weight_versions refuses it.
        weight_version=f"{s.version} -> {version}" if mixed else version)
    with self._lock:
      fut = self._release(s, hold=reason is not None and tok in req.continue_ids)
    if reason is None:
      self.metrics["cancelled_requests"] += 1
    settle_future(fut, result)

  def _release(self, s: _Slot, hold: bool = False) -> concurrent.futures.Future:
    """Frees slot `s` (the caller holds the lock); returns its request's future. Its k/v
    stay for prefix reuse unless weights other than the current ones made any of them;
    `hold` keeps the slot for its trajectory's next turn (prefix_grace_s)."""
    fut = s.future
    s.request, s.future = None, None
    s.released_at = time.perf_counter()
    if s.weights != self._weights:   # updated since its prefill (counts only grow)
      s.cached, s.held_until = [], 0.0
    elif hold and self.config.reuses_prefix and self.config.prefix_grace_s > 0:
      s.held_until = s.released_at + self.config.prefix_grace_s
      self.metrics["held_slots"] += 1
    return fut

  def _decode_step(self) -> None:
    n = self.config.num_slots
    toks = np.zeros(n, np.int32)
    pos = np.full(n, self.config.max_len, np.int32)  # idle slots write nowhere
    seeds = np.zeros(n, np.int32)
    idx = np.zeros(n, np.int32)
    temps = np.ones(n, np.float32)
    top_p = np.ones(n, np.float32)
    top_k = np.zeros(n, np.int32)
    active = []
    for i, s in enumerate(self.slots):
      if s.request is None:
        continue
      active.append(i)
      toks[i], pos[i] = s.next_token, len(s.cached)
      seeds[i], idx[i] = s.request.seed, len(s.out_ids)
      temps[i], top_p[i], top_k[i] = s.request.temperature, s.request.top_p, s.request.top_k
    # While requests wait for a slot, one step: a row that ends frees its slot at once.
    steps = 1 if self.queue else self.config.decode_steps
    # The last step's positions are read too (a row past max_len writes nowhere).
    attend = (self.config.decode_attend(int(max(pos[i] for i in active)) + steps)
              if active else None)
    state, weights, version = self._weights_now()
    t0 = time.perf_counter()
    self.cache, out_tok, out_logp = _decode(
        # numpy in: jit moves them in its C++ path (jnp.asarray dispatched an op each,
        # ~0.4 ms of host time per step at 64 slots).
        self.graphdef, state, self.cache, toks, pos, seeds, idx, temps, top_p, top_k,
        attend_len=attend, steps=steps, loop=self.config.decode_loop,
        cache_sharding=self._cache_sharding)
    out_tok, out_logp = np.asarray(out_tok).tolist(), np.asarray(out_logp).tolist()
    self.metrics["decode_s"] += time.perf_counter() - t0
    self.metrics["decode_calls"] += 1
    self.metrics["decode_steps"] += steps
    kept = 0
    for i in active:
      s = self.slots[i]
      req, fed = s.request, int(toks[i])
      for j in range(steps):  # until the row's request ends; later steps are discarded
        s.cached.append(fed)
        kept += 1
        fed = out_tok[i][j]
        self._accept(i, fed, out_logp[i][j], weights, version)
        if s.request is not req:
          break
    self.metrics["active_slot_steps"] += kept
