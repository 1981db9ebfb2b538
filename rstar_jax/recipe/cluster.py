"""Fleets on Ray: sandbox servers, rollout servers and the trainer processes as actors.

Ray places and supervises the processes; it carries no data. Each server actor runs
one server process (`python -m sandbox.server`, `python -m rstar_jax.rollout.api_server`
or SGLang's `sglang.launch_server`) on a port of its node and restarts it on the same
port when it dies, so the URLs handed to the trainer stay valid: the sandbox client's
rotation and the rollout scheduler ride out the gap over HTTP as they do for any
server. The trainer processes are one multi-process JAX job (`config.distributed`
filled in here); process 0 drives the rollouts over the URLs.

Entry point: `python -m experiments.launch_cluster --config experiments/configs/cluster_toy.py`.
Ray is optional (`pip install -r requirements-cluster.txt`); nothing else imports this.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any, Mapping, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROLLOUT_BACKENDS = ("server", "sglang")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterConfig:
  """`config.cluster` of a launch config.

  Attributes:
    ray_address: "" starts a Ray instance in this process (one machine); "auto" or
      "ray://host:10001" joins a running cluster.
    placement: Ray placement-group strategy for all processes (SPREAD, PACK, ...).
    sandbox_servers / sandbox_cpus / sandbox_args: tool-call servers, the CPUs each
      reserves (give a whole node's cores to one server, or K cores each), and extra
      `sandbox.server` flags (e.g. --max-children 32).
    rollout_servers / rollout_backend / rollout_hf_dir / rollout_cpus / rollout_gpus /
      rollout_args: inference servers ("server": ours, "sglang": SGLang) serving the
      HF checkpoint `rollout_hf_dir`, their resources and extra flags.
    trainer_processes / trainer_cpus / trainer_gpus: the JAX job (one process per host).
    trainer_module / trainer_config / trainer_args: what the trainer processes run:
      `python -m <module> --config <config> <args>` plus the URLs and the distributed
      settings made here.
    max_restarts / restart_window_s: a server process, or the trainer job, that fails
      more than `max_restarts` times within `restart_window_s` seconds is given up on (a
      server that keeps crashing at start, a trainer that dies at every step); restarts
      further apart than that never add up, so a week-long run rides out any number of
      faults spread over it.
    restart_backoff_s / restart_backoff_max_s: the wait before restarting the trainer
      job, doubled for each restart already within the window, at most the max (a
      crashing job does not hammer shared storage or the coordinator).
    live_server_moves: a server re-created under a new URL (its node lost) is handed to
      the running trainer: the supervisor rewrites `<log_dir>/fleet.json`
      (`rollout.fleet_file`), which the trainer's clients watch (`tools.urls_file`,
      `rollout.servers_file`), so no step is lost. Keep `log_dir` on storage that
      trainer process 0's node reads. Off: the trainer job restarts with the new URLs.
    hang_timeout_s: a server whose /health has not answered for this long is killed and
      restarted like one that exited (0: never). Keep it above a weight update's
      length: SGLang's /health generates a token, which waits while it loads a checkpoint
      (28 GB at 14B, read by every server at once from shared storage).
    log_dir: every process's log (`<role><i>.log`).
    startup_timeout_s: how long a server may take to answer /health.
    forward_env: variables of the launching shell passed to every server and trainer
      (where set): processes on a cluster that Ray joined do not inherit them.
  """
  ray_address: str = ""
  placement: str = "SPREAD"
  sandbox_servers: int = 1
  sandbox_cpus: float = 1.0
  sandbox_args: tuple[str, ...] = ()
  rollout_servers: int = 1
  rollout_backend: str = "server"
  rollout_hf_dir: str = ""
  rollout_cpus: float = 1.0
  rollout_gpus: float = 0.0
  rollout_args: tuple[str, ...] = ()
  trainer_processes: int = 1
  trainer_cpus: float = 1.0
  trainer_gpus: float = 0.0
  trainer_module: str = "experiments.recipe"
  trainer_config: str = "experiments/configs/toy.py"
  trainer_args: tuple[str, ...] = ()
  max_restarts: int = 3
  restart_window_s: float = 3600.0
  restart_backoff_s: float = 10.0
  restart_backoff_max_s: float = 600.0
  live_server_moves: bool = True
  hang_timeout_s: float = 1800.0
  log_dir: str = "/tmp/rstar_cluster"
  startup_timeout_s: float = 300.0
  forward_env: tuple[str, ...] = ("SANDBOX_ALLOW_WEAK_ISOLATION", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                  "XLA_PYTHON_CLIENT_PREALLOCATE", "HF_HOME", "HF_HUB_OFFLINE",
                                  "RSTAR_COMPILE_CACHE", "NCCL_DEBUG")

  def __post_init__(self):
    if self.rollout_backend not in ROLLOUT_BACKENDS:
      raise ValueError(f"ClusterConfig.rollout_backend={self.rollout_backend!r}; choose from "
                       f"{ROLLOUT_BACKENDS}")
    if self.rollout_servers and not self.rollout_hf_dir:
      raise ValueError("ClusterConfig.rollout_hf_dir: the checkpoint the rollout servers start "
                       "from (the trainer then sends them its weights) must be set")
    for name in ("sandbox_servers", "rollout_servers", "max_restarts"):
      if getattr(self, name) < 0:
        raise ValueError(f"ClusterConfig.{name} must be >= 0, got {getattr(self, name)}")
    if self.trainer_processes < 0:
      raise ValueError(f"ClusterConfig.trainer_processes must be >= 0 (0: servers only), got "
                       f"{self.trainer_processes!r}")
    for name in ("sandbox_cpus", "rollout_cpus", "rollout_gpus", "trainer_cpus",
                 "trainer_gpus", "restart_window_s", "hang_timeout_s", "restart_backoff_s",
                 "restart_backoff_max_s"):
      if getattr(self, name) < 0:
        raise ValueError(f"ClusterConfig.{name} must be >= 0, got {getattr(self, name)}")


LOOPBACK = "127.0.0.1"


def _local_ray_on_loopback() -> None:
  """A Ray started here (no ray_address: one machine) keeps every process, and so every
  server's URL, on 127.0.0.1. On Linux Ray turns 127.0.0.1 (ray.init's _node_ip_address,
  `ray start --node-ip-address`) into the host's outward address unless
  RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (ray._private.services.resolve_ip_for_localhost),
  which would put the servers on the host's network. Ray reads that variable once, when
  it is imported, into ray_constants.ENABLE_RAY_CLUSTER: set both (the variable for the
  processes Ray starts, the constant for a Ray this process imported already). Both stay
  set for the rest of this process: a driver here that later joins a remote cluster would
  report itself at 127.0.0.1 (one process, one Ray)."""
  os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
  from ray._private import ray_constants
  ray_constants.ENABLE_RAY_CLUSTER = False


def free_port(host: str = "") -> int:
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def _die_with_parent() -> None:
  # The server must not outlive its actor (Ray kills actors with SIGKILL).
  import ctypes
  ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG


def _healthy(url: str) -> bool:
  try:
    with urllib.request.urlopen(url + "/health", timeout=2.0) as r:
      return r.status == 200
  except Exception:  # noqa: BLE001 - any failure means "not (yet) healthy"
    return False


def server_command(role: str, cfg: ClusterConfig, host: str, port: int,
                   env: Mapping[str, str] | None = None) -> list[str]:
  """The command line of one server of `role` ("sandbox" or "rollout"); `env` is the
  environment it gets (default: this process's)."""
  py = sys.executable
  env = os.environ if env is None else env
  if role == "sandbox":
    weak = (["--allow-weak-isolation"]
            if env.get("SANDBOX_ALLOW_WEAK_ISOLATION", "") == "1" else [])
    return [py, "-m", "sandbox.server", "--host", host, "--port", str(port), *weak,
            *cfg.sandbox_args]
  if cfg.rollout_backend == "server":
    return [py, "-m", "rstar_jax.rollout.api_server", "--hf_dir", cfg.rollout_hf_dir,
            "--host", host, "--port", str(port), *cfg.rollout_args]
  return [py, "-m", "sglang.launch_server", "--model-path", cfg.rollout_hf_dir,
          "--host", host, "--port", str(port), *cfg.rollout_args]


class ServerProcess:
  """One server process, restarted on the same port when it exits (the body of the
  Ray actor; usable without Ray)."""

  def __init__(self, role: str, index: int, cfg: ClusterConfig, env: dict[str, str]):
    import ray
    self.role, self.index, self.cfg = role, index, cfg
    self.host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    self.port = free_port()
    self.url = f"http://{self.host}:{self.port}"
    self.env = dict(os.environ, **env)
    self.env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, self.env.get("PYTHONPATH"))
                                             if p)
    self.log_path = os.path.join(cfg.log_dir, f"{role}{index}.log")
    self.restarts = 0               # in all; the give-up rule counts recent ones
    self._recent: collections.deque[float] = collections.deque()
    self.hangs = 0
    self.gave_up = ""
    self._stop = threading.Event()
    self._start()
    self._watch = threading.Thread(target=self._supervise, daemon=True)
    self._watch.start()

  def _start(self) -> None:
    os.makedirs(self.cfg.log_dir, exist_ok=True)
    with open(self.log_path, "ab") as log:
      self.proc = subprocess.Popen(server_command(self.role, self.cfg, self.host, self.port,
                                                 self.env),
                                   cwd=REPO, env=self.env, stdin=subprocess.DEVNULL,
                                   stdout=log, stderr=subprocess.STDOUT,
                                   preexec_fn=_die_with_parent)
    deadline = time.monotonic() + self.cfg.startup_timeout_s
    while time.monotonic() < deadline and self.proc.poll() is None:
      if _healthy(self.url):
        return
      time.sleep(0.2)
    code = self.proc.poll()
    why = f"exited {code}" if code is not None else "timed out"
    if code is None:   # not left running unwatched: the supervisor restarts it, or none
      self.proc.kill()
      self.proc.wait()
    raise RuntimeError(f"{self.role} server {self.index} at {self.url} did not become "
                       f"healthy ({why}); log tail:\n{self.log_tail()}")

  def _supervise(self) -> None:
    cfg = self.cfg
    probe_every = min(30.0, cfg.hang_timeout_s / 4)
    answered = next_probe = time.monotonic()
    while not self._stop.wait(0.5):
      now = time.monotonic()
      if self.proc.poll() is None:
        if cfg.hang_timeout_s and now >= next_probe:
          next_probe = now + probe_every
          if _healthy(self.url):
            answered = now
          elif now - answered > cfg.hang_timeout_s:
            self.hangs += 1
            self._note(f"{self.role}{self.index} has not answered /health for "
                       f"{now - answered:.0f} s; killed")
            self.proc.kill()
            try:
              self.proc.wait(60)
            except subprocess.TimeoutExpired:   # unkillable (D state): looked at again
              pass
        continue
      while self._recent and now - self._recent[0] > cfg.restart_window_s:
        self._recent.popleft()
      if len(self._recent) >= cfg.max_restarts:
        why = (f"exited {self.proc.returncode} after {len(self._recent)} restart(s) "
               f"within {cfg.restart_window_s:.0f} s")
        # Logged before it is set: whoever sees gave_up (info(), a test) finds the line.
        self._note(f"{self.role}{self.index}: {why}; given up")
        self.gave_up = why
        return
      self._recent.append(now)
      self.restarts += 1
      self._note(f"{self.role}{self.index} exited {self.proc.returncode}; "
                 f"restart {self.restarts} on the same port")
      try:
        self._start()
      except Exception as e:  # noqa: BLE001 - counted as a failed restart; tried again
        self._note(f"restart failed: {e}")
      answered = next_probe = time.monotonic()

  def _note(self, line: str) -> None:
    with open(self.log_path, "a") as f:
      f.write(f"\n[cluster] {line}\n")

  def info(self) -> dict[str, Any]:
    return {"role": self.role, "index": self.index, "url": self.url, "pid": self.proc.pid,
            "restarts": self.restarts, "hangs": self.hangs, "gave_up": self.gave_up,
            "log": self.log_path}

  def log_tail(self, n: int = 3000) -> str:
    try:
      with open(self.log_path, "rb") as f:
        return f.read()[-n:].decode(errors="replace")
    except OSError:
      return ""

  def stop(self) -> None:
    self._stop.set()
    if self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(10)
      except subprocess.TimeoutExpired:
        self.proc.kill()


class TrainerProcess:
  """One process of the trainer job (the body of its Ray actor)."""

  def __init__(self, index: int, cfg: ClusterConfig):
    import ray
    self.index, self.cfg = index, cfg
    self.host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    self.proc: subprocess.Popen | None = None
    self.log_path = os.path.join(cfg.log_dir, f"trainer{index}.log")

  def address(self) -> str:
    """A coordinator address on this node (asked of process 0 only)."""
    return f"{self.host}:{free_port()}"

  def start(self, args: Sequence[str], env: dict[str, str]) -> None:
    env = dict(os.environ, **env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    os.makedirs(self.cfg.log_dir, exist_ok=True)
    with open(self.log_path, "ab") as log:
      self._log_start = log.tell()
      self.proc = subprocess.Popen(
          [sys.executable, "-m", self.cfg.trainer_module, "--config", self.cfg.trainer_config,
           *args, *self.cfg.trainer_args], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
          stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)

  def wait(self, timeout: float | None = None) -> int | None:
    try:
      return self.proc.wait(timeout)
    except subprocess.TimeoutExpired:
      return None

  def poll(self) -> int | None:
    return None if self.proc is None else self.proc.poll()

  def pid(self) -> int | None:
    return None if self.proc is None else self.proc.pid

  def resumed_step(self) -> int | None:
    """The step this start's trainer said it resumed from (its "resumed ... at step N"
    log line), None until it says so."""
    try:
      with open(self.log_path, "rb") as f:
        f.seek(self._log_start)
        text = f.read().decode(errors="replace")
    except OSError:
      return None
    found = _RESUMED.findall(text)
    return int(found[-1]) if found else None

  def kill(self) -> None:
    """SIGKILL, no save: after a peer of the job died, no collective (a save included)
    can finish, and the job restarts from the latest complete checkpoint anyway."""
    if self.proc is not None and self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait()

  def log_tail(self, n: int = 3000) -> str:
    with open(self.log_path, "rb") as f:
      return f.read()[-n:].decode(errors="replace")

  def stop(self) -> None:
    if self.proc is not None and self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)   # the trainer saves at the step boundary
      try:
        self.proc.wait(60)
      except subprocess.TimeoutExpired:
        self.proc.kill()


# The trainers' resume lines: rl/trainer.py "resumed RL from <dir> at step N", sft/trainer.py
# "resumed SFT at step N".
_RESUMED = re.compile(r"resumed \S+ (?:from \S+ )?at step (\d+)")
USAGE_EXIT = 2     # config_utils.run's exit for a config or usage error: a restart repeats it


def exit_cause(code: int) -> str:
  """An exit status in words (a negative one is the signal that ended the process)."""
  if code < 0:
    try:
      name = signal.Signals(-code).name
    except ValueError:
      name = f"signal {-code}"
    return f"killed by {name}" + (" (kill -9, or the kernel's OOM killer)" if code == -9 else "")
  if code > 128:    # a shell or config_utils.run reporting a signal: 128 + signum
    try:
      return f"exited {code} ({signal.Signals(code - 128).name})"
    except ValueError:
      pass
  return f"exited {code}"


def _tuple_text(items: Sequence[str]) -> str:
  return "(" + "".join(f"'{x}'," for x in items) + ")"


class Cluster:
  """The launched fleet: `sandbox_urls`, `rollout_urls`, the trainer actors."""

  def __init__(self, cfg: ClusterConfig):
    import ray
    from ray.util.placement_group import placement_group
    self.cfg = cfg
    self.env = {k: os.environ[k] for k in cfg.forward_env if k in os.environ}
    t0 = time.perf_counter()
    if not ray.is_initialized():
      # The actors import this module: the checkout must be at the same path on every
      # node (shared storage), as the weight-sync directory must.
      env = {"env_vars": {"PYTHONPATH": os.pathsep.join(
          p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}}
      if cfg.ray_address:
        ray.init(address=cfg.ray_address, log_to_driver=False, runtime_env=env)
      else:
        _local_ray_on_loopback()
        ray.init(include_dashboard=False, log_to_driver=False, runtime_env=env,
                 _node_ip_address=LOOPBACK)
    roles = ([("sandbox", cfg.sandbox_cpus, 0.0)] * cfg.sandbox_servers
             + [("rollout", cfg.rollout_cpus, cfg.rollout_gpus)] * cfg.rollout_servers
             + [("trainer", cfg.trainer_cpus, cfg.trainer_gpus)] * cfg.trainer_processes)
    bundles = [{k: v for k, v in (("CPU", c), ("GPU", g)) if v} or {"CPU": 0.01}
               for _, c, g in roles]
    self.pg = placement_group(bundles, strategy=cfg.placement)
    self.servers: dict[str, list] = {"sandbox": [], "rollout": []}
    self.trainers = []
    self._trainer_opts: list[dict] = []
    self._server_opts: dict[str, list[dict]] = {"sandbox": [], "rollout": []}
    self.restarts: list[dict[str, Any]] = []    # the trainer job's, in order
    try:
      self._launch(roles)
    except BaseException:
      self.shutdown()   # no half-started fleet left holding a cluster's resources
      raise
    self.launch_s = time.perf_counter() - t0

  def _launch(self, roles) -> None:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    cfg = self.cfg
    ray.get(self.pg.ready(), timeout=cfg.startup_timeout_s)
    server_actor = ray.remote(max_restarts=0)(ServerProcess)
    # Two threads: `stop` (SIGTERM, the trainer saves) must run while `wait` blocks;
    # queued behind it, a Ctrl-C waited 90 s and then the trainer was killed unsaved.
    trainer_actor = ray.remote(max_restarts=0, max_concurrency=2)(TrainerProcess)
    counts = {"sandbox": 0, "rollout": 0}
    for b, (role, cpus, gpus) in enumerate(roles):
      opts = dict(num_cpus=0, num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
          placement_group=self.pg, placement_group_bundle_index=b))
      if role == "trainer":
        self._trainer_actor = trainer_actor
        self._trainer_opts.append(opts)
        self.trainers.append(trainer_actor.options(**opts).remote(len(self.trainers), cfg))
      else:
        self._server_actor = server_actor
        self._server_opts[role].append(opts)
        self.servers[role].append(server_actor.options(**opts).remote(role, counts[role], cfg,
                                                                      self.env))
        counts[role] += 1
    self.info = {role: ray.get([a.info.remote() for a in actors])
                 for role, actors in self.servers.items()}
    self._fleet_generation = 0
    if cfg.live_server_moves:
      self._write_fleet()

  @property
  def fleet_file(self) -> str:
    """Where the running trainer reads the servers' current URLs."""
    return os.path.join(self.cfg.log_dir, "fleet.json")

  def _write_fleet(self) -> None:
    from rstar_jax.rollout.fleet_file import write_fleet
    write_fleet(self.fleet_file, {"sandbox": self.sandbox_urls, "rollout": self.rollout_urls},
                self._fleet_generation)

  @property
  def sandbox_urls(self) -> list[str]:
    return [i["url"] for i in self.info["sandbox"]]

  @property
  def rollout_urls(self) -> list[str]:
    return [i["url"] for i in self.info["rollout"]]

  def server_info(self) -> dict[str, list[dict]]:
    import ray
    return {role: ray.get([a.info.remote() for a in actors])
            for role, actors in self.servers.items()}

  def trainer_overrides(self, coordinator: str = "") -> list[str]:
    """The config overrides that point a trainer at the fleet."""
    out = []
    live = self.cfg.live_server_moves
    if self.sandbox_urls:
      out.append(f"--config.tools.urls={_tuple_text(self.sandbox_urls)}")
      if live:
        out.append(f"--config.tools.urls_file={self.fleet_file}")
    if self.rollout_urls:
      out += [f"--config.rollout.backend={self.cfg.rollout_backend}",
              f"--config.rollout.servers={_tuple_text(self.rollout_urls)}"]
      if live:
        out.append(f"--config.rollout.servers_file={self.fleet_file}")
    if coordinator:
      out.append(f"--config.distributed.coordinator_address={coordinator}")
    return out

  def start_trainers(self, env: dict[str, str] | None = None) -> None:
    import ray
    n = len(self.trainers)
    coordinator = ray.get(self.trainers[0].address.remote()) if n > 1 else ""
    for i, actor in enumerate(self.trainers):
      args = self.trainer_overrides(coordinator)
      # Always said, also for one: a trainer on a node that Ray joined from an srun step
      # inherits SLURM's variables, and would otherwise wait for that step's peers.
      args += [f"--config.distributed.num_processes={n}"]
      if n > 1:
        args += [f"--config.distributed.process_id={i}"]
      ray.get(actor.start.remote(args, {**self.env, **(env or {})}))

  def wait_trainers(self, timeout: float | None = None) -> list[int | None]:
    import ray
    return ray.get([a.wait.remote(timeout) for a in self.trainers])

  def replace_lost_servers(self) -> list[str]:
    """Re-creates every server actor that is gone (its node died: a server process that
    merely exits is restarted by its own actor) on the placement group's bundle, which
    Ray re-places on the remaining nodes, and records its new URL (and, with
    `live_server_moves`, rewrites the fleet file the trainer watches). Returns what
    changed."""
    import ray
    changed = []
    for role, actors in self.servers.items():
      for i, actor in enumerate(actors):
        try:
          ray.get(actor.info.remote(), timeout=60)
          continue
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
          pass
        old = self.info[role][i]["url"]
        ray.kill(actor)
        actors[i] = self._server_actor.options(**self._server_opts[role][i]).remote(
            role, i, self.cfg, self.env)
        self.info[role][i] = ray.get(actors[i].info.remote(),
                                     timeout=self.cfg.startup_timeout_s + 600)
        changed.append(f"{role} server {i} lost (its actor or node is gone): was {old}, now "
                       f"{self.info[role][i]['url']}")
        self._note(changed[-1])
    if changed and self.cfg.live_server_moves:
      self._fleet_generation += 1
      self._write_fleet()
      self._note(f"fleet file {self.fleet_file} rewritten (generation "
                 f"{self._fleet_generation}): the running trainer follows the new URLs")
    return changed

  def _poll_trainers(self) -> list[int | str | None]:
    """Each trainer's exit status, None while it runs, "lost" where its actor is gone
    (its node died)."""
    import ray
    out = []
    for a in self.trainers:
      try:
        out.append(ray.get(a.poll.remote(), timeout=60))
      # Also a plain Exception: submitting to an actor that Ray no longer knows raises
      # "Can't find actor" (poll() itself raises nothing).
      except Exception:  # noqa: BLE001
        out.append("lost")
    return out

  def _note(self, line: str) -> None:
    from absl import logging
    logging.warning("[cluster] %s", line)
    os.makedirs(self.cfg.log_dir, exist_ok=True)
    with open(os.path.join(self.cfg.log_dir, "cluster.log"), "a") as f:
      f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")

  def run_trainers(self, timeout: float | None = None, poll_s: float = 0.5,
                   env: dict[str, str] | None = None,
                   server_check_s: float = 10.0) -> list[int | str | None]:
    """Starts the trainer job and supervises it until every process exits 0, or the
    restart budget is spent, or `timeout` seconds pass (then the codes so far, None for
    those still running). A process that dies (any other exit, a signal, an OOM kill, its
    actor or node lost) takes the whole job down: the others are killed (a multi-
    controller JAX job cannot go on without a peer) and, after the back-off, every
    process starts again and resumes from the latest complete checkpoint. Each restart
    is logged (`<log_dir>/cluster.log`) with its cause, and then the step it resumed
    from, and recorded in `self.restarts`. A usage/config error (exit 2) is not
    restarted: it would fail the same way.

    Every `server_check_s` seconds the servers' actors are checked: one gone with its
    node is re-created on the remaining nodes (`replace_lost_servers`) under a new URL,
    which the running trainer takes from the fleet file (`live_server_moves`; without it
    the trainer job is restarted as above with the new URLs)."""
    import ray
    cfg = self.cfg
    deadline = None if not timeout else time.monotonic() + timeout
    recent: collections.deque[float] = collections.deque()
    self.start_trainers(env)
    next_server_check = time.monotonic() + server_check_s
    while True:
      codes = self._poll_trainers()
      moved = []
      if server_check_s and time.monotonic() >= next_server_check:
        moved = self.replace_lost_servers()
        next_server_check = time.monotonic() + server_check_s
        if cfg.live_server_moves:
          moved = []      # handed to the running trainer: nothing to restart for
      if self.restarts and self.restarts[-1]["resumed_step"] is None:
        self._note_resumed()
      if all(c == 0 for c in codes):
        return codes
      failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
      if not failed and not moved:
        if deadline is not None and time.monotonic() > deadline:
          return codes
        time.sleep(poll_s)
        continue
      cause = "; ".join([f"trainer {i} " + ("lost (its actor or node is gone)" if c == "lost"
                                           else exit_cause(c)) for i, c in failed] + moved)
      for i, a in enumerate(self.trainers):
        if codes[i] != "lost":
          try:
            ray.get(a.kill.remote(), timeout=60)
          except Exception:  # noqa: BLE001 - gone meanwhile: replaced below
            codes[i] = "lost"
      if any(c == USAGE_EXIT for _, c in failed):
        self._note(f"trainer job failed: {cause}: a config or usage error, not restarted")
        return codes
      now = time.monotonic()
      while recent and now - recent[0] > cfg.restart_window_s:
        recent.popleft()
      if len(recent) >= cfg.max_restarts:
        self._note(f"trainer job failed: {cause}; given up after {len(recent)} restart(s) "
                   f"within {cfg.restart_window_s:.0f} s")
        return codes
      backoff = min(cfg.restart_backoff_max_s, cfg.restart_backoff_s * 2 ** len(recent))
      recent.append(now)
      self.restarts.append({"cause": cause, "at": time.time(), "backoff_s": backoff,
                            "resumed_step": None})
      self._note(f"trainer job restart {len(self.restarts)}: {cause}; every process "
                 f"stopped; restarting in {backoff:.1f} s from the latest complete checkpoint")
      for i, c in enumerate(codes):
        if c == "lost":     # a new actor on the placement group's (rescheduled) bundle
          ray.kill(self.trainers[i])
          self.trainers[i] = self._trainer_actor.options(**self._trainer_opts[i]).remote(i, cfg)
      time.sleep(backoff)
      self.start_trainers(env)

  def _note_resumed(self) -> None:
    import ray
    try:
      step = ray.get(self.trainers[0].resumed_step.remote(), timeout=60)
    except Exception:  # noqa: BLE001 - the trainer's death is seen by the poll
      return
    if step is not None:
      self.restarts[-1]["resumed_step"] = step
      self._note(f"trainer job restart {len(self.restarts)} resumed from step {step}")

  def trainer_logs(self) -> list[str]:
    import ray
    return ray.get([a.log_tail.remote() for a in self.trainers])

  def shutdown(self) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group
    for actors in (self.trainers, *self.servers.values()):
      try:
        ray.get([a.stop.remote() for a in actors], timeout=90)
      except Exception:  # noqa: BLE001 - an actor already gone; killed below anyway
        pass
      for a in actors:
        ray.kill(a)
    remove_placement_group(self.pg)
