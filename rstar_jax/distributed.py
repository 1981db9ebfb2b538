"""Multi-process JAX: start-up from flags, environment or SLURM, and the few
collectives the training loops need beyond the jitted step.

One process per host (or per accelerator), JAX's own multi-controller runtime: every
process runs the same program on its own devices of one global mesh. Process 0 is
the driver: it alone generates rollouts, talks to the rollout and sandbox servers,
writes logs, metrics and the HF exports, and hands each step's batch to the others
(`share_from_main`). Checkpoints are written and read by every process (orbax).

Single-process needs nothing: with no coordinator given (config, JAX_COORDINATOR_ADDRESS
or SLURM with more than one task), `initialize` does nothing.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
from typing import Any, Callable

from absl import logging
import jax
import numpy as np

CPU_COLLECTIVES = ("gloo", "mpi", "none")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
  """`config.distributed`: how this process joins the others (MaxText style).

  Every field left at its default is taken from the environment: JAX_COORDINATOR_ADDRESS,
  JAX_NUM_PROCESSES, JAX_PROCESS_ID; inside an srun step of more than one task JAX
  reads all three from SLURM's variables. num_processes=1 is one process, always.

  Attributes:
    coordinator_address: host:port of process 0's coordinator service.
    num_processes: processes in the job (0: environment).
    process_id: this process's index, 0 .. num_processes - 1 (-1: environment).
    initialization_timeout_s: how long to wait for every process to join.
    cpu_collectives: the CPU backend's cross-process collectives (gloo works
      everywhere; "none" leaves JAX's default, which has none across processes).
  """
  coordinator_address: str = ""
  num_processes: int = 0
  process_id: int = -1
  initialization_timeout_s: int = 300
  cpu_collectives: str = "gloo"

  def __post_init__(self):
    if self.cpu_collectives not in CPU_COLLECTIVES:
      raise ValueError(f"DistributedConfig.cpu_collectives={self.cpu_collectives!r}; choose "
                       f"from {CPU_COLLECTIVES}")
    if self.num_processes < 0:
      raise ValueError(f"DistributedConfig.num_processes must be >= 0 (0: from the "
                       f"environment), got {self.num_processes!r}")
    if self.process_id < -1:
      raise ValueError(f"DistributedConfig.process_id must be >= -1 (-1: from the "
                       f"environment), got {self.process_id!r}")
    if self.num_processes and self.process_id >= self.num_processes:
      raise ValueError(f"DistributedConfig: process_id {self.process_id} is not below "
                       f"num_processes {self.num_processes}")
    if self.initialization_timeout_s <= 0:
      raise ValueError(f"DistributedConfig.initialization_timeout_s must be > 0, got "
                       f"{self.initialization_timeout_s!r}")


def _env_int(name: str) -> int | None:
  text = os.environ.get(name, "").strip()
  if not text:
    return None
  try:
    return int(text)
  except ValueError:
    raise ValueError(f"environment variable {name}={text!r} is not an integer") from None


def _slurm_tasks() -> int:
  """Tasks of the srun step this process belongs to (0: not in one). Outside srun (a
  batch script's own shell, salloc, a Ray worker started there) SLURM_NTASKS is the
  allocation's, and JAX would wait for peers that were never started."""
  if "SLURM_JOB_ID" not in os.environ or "SLURM_STEP_ID" not in os.environ:
    return 0
  return _env_int("SLURM_NTASKS") or _env_int("SLURM_NPROCS") or 0


def _is_loopback(address: str) -> bool:
  """Whether `address` (host:port) names this host's loopback (127.0.0.0/8, ::1, localhost)."""
  import ipaddress
  host = address.rsplit(":", 1)[0].strip("[]")
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False   # a host name: the coordinator must be reachable from other nodes


def resolve(cfg: DistributedConfig) -> dict[str, Any] | None:
  """The arguments of `jax.distributed.initialize`, or None for a single process.

  Explicit fields win over the environment; `{}` means "let JAX detect the cluster"
  (SLURM)."""
  address = cfg.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
  count = cfg.num_processes or _env_int("JAX_NUM_PROCESSES") or 0
  pid = cfg.process_id if cfg.process_id >= 0 else _env_int("JAX_PROCESS_ID")
  if count == 1:   # said to be one process: no coordinator, whatever SLURM says
    return None
  if address or count or pid is not None:
    missing = [name for name, given in (("coordinator_address", bool(address)),
                                        ("num_processes", bool(count)),
                                        ("process_id", pid is not None)) if not given]
    if missing:
      raise ValueError(
          f"distributed: {', '.join(missing)} not given; a multi-process run needs all "
          "three (--config.distributed.* or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / "
          "JAX_PROCESS_ID)")
    if pid >= count:
      raise ValueError(f"distributed: process_id {pid} is not below num_processes {count}")
    if count == 1:
      return None
    args = {"coordinator_address": address, "num_processes": count, "process_id": pid}
    if _is_loopback(address):
      # A job on one host: the coordinator listens there only (JAX binds every address,
      # [::], unless told), so a local run is not reachable from the host's network.
      args["coordinator_bind_address"] = address
    return args
  if _slurm_tasks() > 1:
    return _slurm_loopback_coordinator()
  return None


def _slurm_head_node() -> str | None:
  """The step's first node (where JAX's SLURM detection puts the coordinator), or None
  when it cannot be told."""
  nodes = os.environ.get("SLURM_STEP_NODELIST", "").strip()
  if not nodes:
    return None
  if "[" not in nodes:
    return nodes.split(",", 1)[0]
  import subprocess
  try:   # a compressed list, node[0-3]: SLURM's own expansion
    out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True,
                         text=True, timeout=30)
  except (OSError, subprocess.TimeoutExpired):
    return None
  first = out.stdout.split()
  return first[0] if out.returncode == 0 and first else None


def _slurm_loopback_coordinator() -> dict[str, Any]:
  """`{}` (JAX detects everything from SLURM) unless the step's first node resolves to a
  loopback address: a SLURM whose virtual nodes all live on one host (the local
  rehearsal). There the coordinator is given that address and binds it only, as for
  any loopback coordinator; process count and id are still JAX's to detect."""
  import socket
  head = _slurm_head_node()
  job = _env_int("SLURM_JOB_ID")
  if head is None or job is None:
    return {}
  try:
    address = socket.gethostbyname(head)
  except OSError:
    return {}
  if not _is_loopback(f"{address}:0"):
    return {}
  # JAX's own SLURM port (JAX_COORDINATOR_PORT, else the job id in the top 4,096 ports),
  # so a requeued job (same id) and every task agree on it without talking.
  port = _env_int("JAX_COORDINATOR_PORT") or job % 2**12 + (65535 - 2**12 + 1)
  return {"coordinator_address": f"{address}:{port}",
          "coordinator_bind_address": f"{address}:{port}"}


def initialize(cfg: DistributedConfig | None = None) -> bool:
  """Joins the job's other processes (before any JAX computation). Returns True when
  this is a multi-process run. Safe to call twice."""
  cfg = cfg or DistributedConfig()
  if jax.distributed.is_initialized():
    return jax.process_count() > 1
  args = resolve(cfg)
  if args is None:
    return False
  if cfg.cpu_collectives != "none":
    # Only the CPU client reads it; without it CPU processes cannot reduce across each other.
    jax.config.update("jax_cpu_collectives_implementation", cfg.cpu_collectives)
  jax.distributed.initialize(initialization_timeout=cfg.initialization_timeout_s, **args)
  # The first collective over a group of devices sets up its CPU (gloo) context, which
  # waits at most 30 s for every process: do it now, while the processes are in step,
  # not at the first barrier after process 0 spent longer than that on its own work
  # (starting a sandbox server on a loaded machine did). Later collectives over the
  # same devices wait as long as it takes.
  barrier("rstar_jax.distributed.initialize")
  if jax.process_index() != 0:
    logging.set_verbosity(logging.WARNING)   # one process speaks for the job
  logging.info("distributed: process %d of %d, %d local / %d global devices",
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count())
  return True


def is_main() -> bool:
  return jax.process_index() == 0


def multi_process() -> bool:
  return jax.process_count() > 1


def barrier(name: str) -> None:
  """Every process waits here until all have arrived (no-op for one process)."""
  if multi_process():
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def share_from_main(obj: Any = None) -> Any:
  """Process 0's `obj` on every process (a JAX collective; no-op for one process).

  Any picklable value (a step's batch of numpy arrays, its metrics): its size goes
  first, so the other processes need not know its shape."""
  if not multi_process():
    return obj
  from jax.experimental import multihost_utils
  payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if is_main() else b""
  size = int(multihost_utils.broadcast_one_to_all(np.array(len(payload), np.int64)))
  buf = np.zeros(size, np.uint8)
  if is_main():
    buf[:] = np.frombuffer(payload, np.uint8)
  buf = np.asarray(multihost_utils.broadcast_one_to_all(buf))
  return obj if is_main() else pickle.loads(buf.tobytes())


def on_main(fn: Callable[[], Any], what: str) -> Any:
  """`fn()` run by process 0 alone, its result on every process.

  When it raises, every process raises: process 0 its error, the others a RuntimeError
  naming it. (A process 0 that raised inside its own block while the others waited in
  `share_from_main`, or went on to the next collective, hung the whole job.)"""
  if not multi_process():
    return fn()
  result, error = None, None
  if is_main():
    try:
      result = fn()
    except BaseException as e:  # noqa: BLE001 - an interrupt too: the others must not wait
      error = e
  # A stop on a signal (`interrupt.Interrupted`: an evaluation stopped at a finished
  # trajectory) stops every process the same way, with the same exit status.
  signum = getattr(error, "signum", None) if type(error).__name__ == "Interrupted" else None
  shared = share_from_main(("error", f"{type(error).__name__}: {error}", signum)
                           if error is not None else ("ok", result))
  if error is not None:
    raise error
  if shared[0] == "error":
    if shared[2] is not None:
      from rstar_jax.train import interrupt
      raise interrupt.Interrupted(shared[2], after=f"{what} (process 0: {shared[1]})",
                                  saved="process 0 saved what it finished")
    raise RuntimeError(f"{what}: process 0 failed ({shared[1]})")
  return shared[1]


def host_value(x: jax.Array) -> np.ndarray:
  """The whole of a (possibly multi-process, sharded) array on this host."""
  if multi_process() and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def all_objects(obj: Any) -> list[Any]:
  """Every process's `obj` (picklable), on every process, in process order (a JAX
  collective; `[obj]` for one process)."""
  if not multi_process():
    return [obj]
  from jax.experimental import multihost_utils
  payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.array(payload.size, np.int64)))
  buf = np.zeros(int(sizes.max()), np.uint8)
  buf[:payload.size] = payload
  bufs = np.asarray(multihost_utils.process_allgather(buf))
  return [pickle.loads(b[:int(n)].tobytes()) for b, n in zip(bufs, sizes.reshape(-1))]


def raise_if_any_failed(error: BaseException | None, what: str) -> None:
  """After work every process did on its own (each writing its files): raises on every
  process when any failed, its own error where it failed, a RuntimeError naming the
  failed processes elsewhere; returns on every process when none did. A process that
  raised alone would leave the others waiting in their next collective."""
  failures = [(i, e) for i, e in enumerate(all_objects(
      None if error is None else f"{type(error).__name__}: {error}")) if e is not None]
  if error is not None:
    raise error
  if failures:
    raise RuntimeError(f"{what}: " + "; ".join(f"process {i} failed ({e})"
                                               for i, e in failures))


def gather_to(x: jax.Array, process: int) -> np.ndarray | None:
  """The whole of `x` on process `process` only; None on the others.

  Unlike `host_value` (an all-gather: every process receives every byte), each block of
  `x` that `process` lacks travels once, from one device that holds it to one device
  of `process` (`jax.lax.ppermute` inside a `shard_map`: point to point, over gloo on
  CPU, NCCL on GPU). The other processes' cost is sending their blocks; blocks
  `process` already holds (replicas) do not move at all, and when it holds every
  block no collective runs. Every process must call it, in the same order."""
  if not multi_process():
    return np.asarray(jax.device_get(x))
  me = jax.process_index()
  # Which branch every process takes is decided from facts all of them share (the
  # processes holding x's devices), never from this process's own view: one that took
  # another branch would leave the rest waiting in a collective.
  holders = {d.process_index for d in x.sharding.device_set}
  if len(holders) == 1:   # one process holds all of x (each process its own local value)
    return np.asarray(jax.device_get(x)) if me == process else None
  plan = _gather_plan(x.sharding, tuple(x.shape), process)
  if plan is None:   # `process` holds no device of x: only an all-gather reaches it
    value = host_value(x)
    return value if me == process else None
  devices, local, rounds, block = plan
  shards = {s.device: s.data for s in x.addressable_shards}
  received = None
  if rounds:
    from jax.sharding import NamedSharding, PartitionSpec
    mesh = jax.sharding.Mesh(np.array(devices), ("gather",))
    bufs = []
    for d in devices:
      if d.process_index != me:
        continue
      bufs.append(shards[d].reshape((1, *block)))
    stacked = jax.make_array_from_single_device_arrays(
        (len(devices), *block), NamedSharding(mesh, PartitionSpec("gather")), bufs)
    received = _permuter(mesh, tuple(tuple(p for p, _ in r) for r in rounds))(stacked)
  if me != process:
    return None
  out = np.empty(x.shape, x.dtype)
  for index, device in local:
    out[index] = np.asarray(shards[device])
  if received is not None:
    by_device = {s.device: np.asarray(s.data) for s in received.addressable_shards}
    for r, pairs in enumerate(rounds):
      for (_, dst), index in pairs:
        out[index] = by_device[devices[dst]][r, 0]
  return out


def _gather_plan(sharding, shape: tuple[int, ...], process: int):
  """What `gather_to` moves: (devices in a fixed order, [(index, device of `process`
  holding it)], rounds of [((source position, receiver position), index)], the block
  shape), or None when `process` holds none of the devices. The same on every
  process: it depends only on the sharding, the shape and `process`. (JAX shards
  evenly: every block has one shape.)"""
  devices = sorted(sharding.device_set, key=lambda d: d.id)
  position = {d: i for i, d in enumerate(devices)}
  receivers = [d for d in devices if d.process_index == process]
  if not receivers:
    return None
  holders: dict[tuple, list] = {}   # (start, stop) per dimension -> devices holding it
  for device, index in sharding.devices_indices_map(shape).items():
    key = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))
    holders.setdefault(tuple((s.start, s.stop) for s in key), []).append(device)
  local, remote = [], []
  for key in sorted(holders):
    index = tuple(slice(a, b) for a, b in key)
    held = sorted(holders[key], key=lambda d: d.id)
    mine = [d for d in held if d.process_index == process]
    if mine:
      local.append((index, mine[0]))
    else:
      remote.append((index, held[0]))
  # A round is one ppermute: each receiver takes at most one block (every source is a
  # distinct device, as a device holds one block).
  rounds = []
  for start in range(0, len(remote), len(receivers)):
    chunk = remote[start:start + len(receivers)]
    rounds.append([((position[src], position[dst]), index)
                   for (index, src), dst in zip(chunk, receivers)])
  block = tuple(b - a for a, b in next(iter(holders)))
  return devices, local, rounds, block


_PERMUTERS: dict[Any, Callable] = {}


def _permuter(mesh, rounds: tuple[tuple[tuple[int, int], ...], ...]) -> Callable:
  """jit(shard_map) sending, in round r, each source's block to its receiver; out
  [rounds, devices, *block], where a device that received nothing in a round holds
  zeros there."""
  key = (mesh, rounds)
  if key not in _PERMUTERS:
    from jax.sharding import PartitionSpec

    def move(block):
      return jax.numpy.stack([jax.lax.ppermute(block, "gather", list(perm))
                              for perm in rounds])

    _PERMUTERS[key] = jax.jit(jax.shard_map(
        move, mesh=mesh, in_specs=PartitionSpec("gather"),
        out_specs=PartitionSpec(None, "gather")))
  return _PERMUTERS[key]
