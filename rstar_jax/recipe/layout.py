"""A multi-node run's layout: which devices train, which serve rollouts, which run sandboxes.

A config file states its layout once (the `:layout` variant is a `Layout` section);
the recipe's mesh and micro-batches, the Ray fleet (`sglang_args`) and the SLURM batch
script (`shell_layout`, printed by `experiments.preflight --print_layout`) follow from it.
No JAX: the preflight checks a layout on a CPU host before any accelerator is allocated.
"""
from __future__ import annotations

import dataclasses

from rstar_jax.recipe import preflight_checks as pc

# HBM per device as vendors quote it (MI300X 192 GB, H100 SXM 80 GB, H200 141 GB), compared
# with 1e9-byte GB: below what the runtimes report as total, so "fits" errs on the safe side.
# experiments/plan_memory.py reads it from here (this module imports nothing heavy).
ACCELERATORS: dict[str, float] = {"MI300X": 192.0, "H100": 80.0, "H200": 141.0}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
  """Which devices do what, for one run (the `:layout` variant of a config file).

  Attributes:
    accelerator: a key of ACCELERATORS (its HBM per device, GB = 1e9 bytes).
    nodes / gpus_per_node: the allocation.
    trainer_nodes: the first nodes run the JAX trainer, one process each, all their GPUs
      on the mesh (data x fsdp x tensor must equal trainer_nodes x gpus_per_node).
    servers_per_node / gpus_per_server: SGLang servers on each of the other nodes and
      the GPUs each one holds (its --tp-size).
    sglang_mem_fraction: SGLang's --mem-fraction-static (weights + KV token pool).
    trainer_mem_fraction: XLA_PYTHON_CLIENT_MEM_FRACTION of the trainer processes: the
      share of HBM the plan may use (the rest: collectives' buffers, the runtime).
    sandbox_servers_per_node / sandbox_children: code sandboxes on each trainer node's
      CPU cores (idle while the trainer computes, busy while rollouts run).
  """
  accelerator: str = "MI300X"
  nodes: int = 8
  gpus_per_node: int = 8
  trainer_nodes: int = 4
  servers_per_node: int = 8
  gpus_per_server: int = 1
  sglang_mem_fraction: float = 0.85
  trainer_mem_fraction: float = 0.9
  sandbox_servers_per_node: int = 1
  sandbox_children: int = 64

  def __post_init__(self):
    if self.accelerator not in ACCELERATORS:
      raise ValueError(f"Layout.accelerator={self.accelerator!r}; choose from "
                       f"{sorted(ACCELERATORS)}")
    for name in ("nodes", "gpus_per_node", "trainer_nodes", "gpus_per_server",
                 "sandbox_children"):
      if getattr(self, name) < 1:
        raise ValueError(f"Layout.{name} must be >= 1, got {getattr(self, name)!r}")
    for name in ("servers_per_node", "sandbox_servers_per_node"):
      if getattr(self, name) < 0:
        raise ValueError(f"Layout.{name} must be >= 0, got {getattr(self, name)!r}")
    for name in ("sglang_mem_fraction", "trainer_mem_fraction"):
      if not 0 < getattr(self, name) <= 1:
        raise ValueError(f"Layout.{name} must be in (0, 1], got {getattr(self, name)!r}")
    if self.trainer_nodes > self.nodes:
      raise ValueError(f"Layout.trainer_nodes={self.trainer_nodes} > nodes={self.nodes}")
    if self.servers_per_node * self.gpus_per_server > self.gpus_per_node:
      raise ValueError(f"Layout: servers_per_node x gpus_per_server = "
                       f"{self.servers_per_node * self.gpus_per_server} GPUs > gpus_per_node="
                       f"{self.gpus_per_node}")

  @property
  def hbm_bytes(self) -> float:
    return ACCELERATORS[self.accelerator] * pc.GB

  @property
  def trainer_devices(self) -> int:
    return self.trainer_nodes * self.gpus_per_node

  @property
  def rollout_nodes(self) -> int:
    return self.nodes - self.trainer_nodes

  @property
  def rollout_servers(self) -> int:
    return self.rollout_nodes * self.servers_per_node

  @property
  def sandbox_servers(self) -> int:
    return self.trainer_nodes * self.sandbox_servers_per_node


def sglang_args(layout: Layout, max_len: int) -> tuple[str, ...]:
  """The flags of every SGLang server of the layout (beside model, host and port).
  --context-length caps the trajectories, and so the trainer's batch length, at
  rollout.engine.max_len (the pool's max_len is the servers' context length)."""
  return ("--tp-size", str(layout.gpus_per_server), "--dtype", "bfloat16",
          "--mem-fraction-static", f"{layout.sglang_mem_fraction:g}",
          "--context-length", str(max_len))


def shell_layout(layout: Layout, max_len: int) -> str:
  """The layout as shell assignments (one a line), for the batch script to eval."""
  values = dict(NODES=layout.nodes, GPUS_PER_NODE=layout.gpus_per_node,
                TRAINER_NODES=layout.trainer_nodes, ROLLOUT_NODES=layout.rollout_nodes,
                SERVERS_PER_NODE=layout.servers_per_node,
                GPUS_PER_SERVER=layout.gpus_per_server,
                SANDBOX_PER_NODE=layout.sandbox_servers_per_node,
                SANDBOX_CHILDREN=layout.sandbox_children,
                TRAINER_MEM_FRACTION=f"{layout.trainer_mem_fraction:g}",
                SGLANG_LAYOUT_ARGS="'" + " ".join(sglang_args(layout, max_len)) + "'")
  return "\n".join(f"{k}={v}" for k, v in values.items())
