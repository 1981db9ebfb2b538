"""`config.rollout` -> an engine pool: the rollout backends, chosen by name.

The trainer, the evaluation runner and the recipe receive the pool and never build
an engine themselves. A backend is a function `(RolloutConfig, model) -> [Engine]`
registered under its `rollout.backend` name: `jax` (in-process JaxEngines reading the
trainer's parameters), `sglang` (SGLang 0.5.23 servers at `rollout.servers`) and
`server` (our own JAX rollout servers, `python -m rstar_jax.rollout.api_server`, same API).
HTTP engines take new weights from disk: their pool's `update_weights(params, version)`
writes a versioned HF checkpoint under `rollout.weight_sync.dir` and moves every server
onto it (`weight_sync.DiskWeightSync`).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Sequence

from rstar_jax import sharding
from rstar_jax.registry import Registry
from rstar_jax.rollout import scheduler
from rstar_jax.rollout.engine import Engine
from rstar_jax.rollout.jax_engine import EngineConfig, JaxEngine
from rstar_jax.rollout.sglang.transport import ClientConfig
from rstar_jax.rollout.weight_sync import DiskWeightSync, WeightSyncConfig

Backend = Callable[["RolloutConfig", object], Sequence[Engine]]
BACKENDS: Registry = Registry("rollout backend")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
  """Attributes:
    backend: a registered backend name ("jax").
    num_engines: engines behind the scheduler.
    scheduler_policy: how requests are spread over the engines (see scheduler.POLICIES;
      "sticky": a trajectory's turns stay on the engine holding its prefix).
    engine: the JaxEngine's KV slots and cache length (jax backend);
      `engine.batch_invariant` makes its rollouts reproducible bit for bit.
    servers: base URLs of the rollout servers (sglang and server backends), e.g.
      ("http://node1:30000", "http://node2:30000"); one engine per URL.
    weight_sync: how those servers get the trainer's weights (a versioned checkpoint
      on storage they read).
    client: the HTTP client of those servers (time limits, retries, probing, the pause
      mode of weight updates; `sglang.transport.ClientConfig`); `client.require_deterministic`
      refuses servers not running SGLang's deterministic inference.
    servers_file: a fleet file (`rollout.fleet_file`) that a cluster supervisor rewrites
      when a server moves to a new URL (its node lost); watched while the pool runs, and
      server i's engine follows the file's i-th "rollout" URL, catching the server up to
      the latest weights. Empty: the URLs are fixed.
  """
  backend: str = "jax"
  num_engines: int = 1
  scheduler_policy: str = "sticky"
  engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
  servers: tuple[str, ...] = ()
  weight_sync: WeightSyncConfig = dataclasses.field(default_factory=WeightSyncConfig)
  client: ClientConfig = dataclasses.field(default_factory=ClientConfig)
  servers_file: str = ""

  def __post_init__(self):
    BACKENDS.lookup(self.backend)            # raises naming the known backends
    scheduler.POLICIES.lookup(self.scheduler_policy)
    if self.num_engines < 1:
      raise ValueError(f"RolloutConfig.num_engines must be >= 1, got {self.num_engines}")
    if self.backend in _HTTP_BACKENDS and not self.servers:
      raise ValueError(f"RolloutConfig.servers is empty: rollout.backend={self.backend!r} "
                       f"generates on servers given by URL; set rollout.servers to their base "
                       f"URLs (e.g. 'http://host:30000')")
    bad = [u for u in self.servers if not u.startswith(("http://", "https://"))]
    if bad:
      raise ValueError(f"RolloutConfig.servers: not http(s) URLs: {bad}")
    if self.servers_file and self.backend not in _HTTP_BACKENDS:
      raise ValueError(f"RolloutConfig.servers_file is set but rollout.backend="
                       f"{self.backend!r} has no servers to move; use it with 'server' or "
                       f"'sglang'")


@BACKENDS.register("jax")
def _jax_engines(cfg: RolloutConfig, model, *, rules=sharding.DEFAULT_RULES) -> list[Engine]:
  """`rules`: the mesh's logical axis rules (`mesh.rules`), which also place the KV cache
  when the model's weights are spread over a mesh."""
  if model is None:
    raise ValueError("rollout.backend='jax' generates with the trainer's model; none given")
  return [JaxEngine(model, cfg.engine, name=f"jax{i}", rules=rules)
          for i in range(cfg.num_engines)]


_HTTP_BACKENDS = ("sglang", "server")


@BACKENDS.register("sglang")
@BACKENDS.register("server")
def _http_engines(cfg: RolloutConfig, model, *, rules=None) -> list[Engine]:
  """One SGLangEngine per URL in `cfg.servers`, failing over to each other. The model
  is not used to generate; when given, the servers' model is checked against it. `rules`
  is not used: each server places its own cache."""
  del rules
  from rstar_jax.model import hf_io
  from rstar_jax.rollout.sglang import engine as sglang_engine
  expected = None
  if model is not None and hasattr(model, "cfg"):
    expected = hf_io.config_to_hf_dict(model.cfg, model.cfg.param_dtype)
  return sglang_engine.connect(cfg.servers, config=cfg.client, expected_model=expected)


def build_engine_pool(cfg: RolloutConfig, model=None, *, workdir: str | None = None,
                      rules=None) -> scheduler.EnginePool:
  """The engines of `cfg.backend` behind one scheduler. Stop it with `pool.stop()`.

  HTTP backends with a `model` get a DiskWeightSync writing to `cfg.weight_sync.dir`, or
  to `<workdir>/weight_sync` when that is empty. `rules`: the mesh's logical axis rules
  (`config.mesh.logical_rules()`; None: the defaults)."""
  engines = BACKENDS.lookup(cfg.backend)(cfg, model, rules=rules or sharding.DEFAULT_RULES)
  sync = None
  if cfg.backend in _HTTP_BACKENDS and model is not None:
    directory = cfg.weight_sync.dir or (os.path.join(workdir, "weight_sync") if workdir else "")
    if directory:
      sync = DiskWeightSync(cfg.weight_sync, model, engines, directory)
  watcher = None
  if cfg.servers_file:
    from rstar_jax.rollout.fleet_file import FleetWatcher

    def move(urls):
      for engine, url in zip(engines, urls):
        engine.move_to(url)
    watcher = FleetWatcher(cfg.servers_file, "rollout", move, current=cfg.servers)
  return scheduler.EnginePool(engines, policy=cfg.scheduler_policy, weight_sync=sync,
                              watcher=watcher)
