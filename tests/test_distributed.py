"""distributed.resolve: which arguments reach jax.distributed.initialize."""
import pytest

from rstar_jax import distributed as d

_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_JOB_ID",
         "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_STEP_ID", "SLURM_STEP_NODELIST",
         "JAX_COORDINATOR_PORT")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
  for v in _VARS:
    monkeypatch.delenv(v, raising=False)


def test_single_process_needs_nothing():
  assert d.resolve(d.DistributedConfig()) is None
  assert d.initialize() is False


def test_explicit_fields():
  cfg = d.DistributedConfig(coordinator_address="h0:1234", num_processes=4, process_id=0)
  assert d.resolve(cfg) == {"coordinator_address": "h0:1234", "num_processes": 4,
                            "process_id": 0}


def test_a_loopback_coordinator_binds_loopback_only():
  """A job on one host (tests, local clusters) keeps JAX's coordinator off the host's
  network: it binds the loopback address it is reached at, not JAX's default [::]."""
  for address in ("127.0.0.1:1234", "127.0.0.11:9", "[::1]:7", "localhost:5"):
    cfg = d.DistributedConfig(coordinator_address=address, num_processes=2, process_id=1)
    assert d.resolve(cfg)["coordinator_bind_address"] == address
  for address in ("10.0.0.1:1234", "node1:1234"):
    cfg = d.DistributedConfig(coordinator_address=address, num_processes=2, process_id=0)
    assert "coordinator_bind_address" not in d.resolve(cfg)


def test_environment_and_explicit_fields_mix(monkeypatch):
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "h0:9")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  monkeypatch.setenv("JAX_PROCESS_ID", "1")
  assert d.resolve(d.DistributedConfig()) == {"coordinator_address": "h0:9",
                                              "num_processes": 2, "process_id": 1}
  assert d.resolve(d.DistributedConfig(process_id=0))["process_id"] == 0


def test_slurm_is_left_to_jax_inside_an_srun_step_only(monkeypatch):
  monkeypatch.setenv("SLURM_JOB_ID", "77")
  monkeypatch.setenv("SLURM_NTASKS", "8")
  # The batch script's own shell (or salloc, or Ray started there): not an srun step,
  # so one process, not a wait for 7 peers nobody started.
  assert d.resolve(d.DistributedConfig()) is None
  monkeypatch.setenv("SLURM_STEP_ID", "0")
  assert d.resolve(d.DistributedConfig()) == {}
  monkeypatch.setenv("SLURM_NTASKS", "1")
  assert d.resolve(d.DistributedConfig()) is None
  monkeypatch.setenv("SLURM_NTASKS", "8")
  assert d.resolve(d.DistributedConfig(num_processes=1)) is None   # said: one process


def test_a_slurm_whose_first_node_is_loopback_binds_it_only(monkeypatch):
  """Virtual SLURM nodes on one host (the local rehearsal): JAX's coordinator on the
  step's first node binds that node's loopback address, not every address; a real
  node's name is left to JAX."""
  monkeypatch.setenv("SLURM_JOB_ID", "5000")
  monkeypatch.setenv("SLURM_NTASKS", "4")
  monkeypatch.setenv("SLURM_STEP_ID", "0")
  port = 5000 % 4096 + 61440
  monkeypatch.setenv("SLURM_STEP_NODELIST", "localhost,nodeb")
  assert d.resolve(d.DistributedConfig()) == {
      "coordinator_address": f"127.0.0.1:{port}",
      "coordinator_bind_address": f"127.0.0.1:{port}"}
  monkeypatch.setenv("SLURM_STEP_NODELIST", "192.0.2.7,localhost")   # a routable first node
  assert d.resolve(d.DistributedConfig()) == {}
  monkeypatch.setenv("SLURM_STEP_NODELIST", "no-such-node.invalid")
  assert d.resolve(d.DistributedConfig()) == {}


def test_incomplete_or_bad_settings_are_named(monkeypatch):
  with pytest.raises(ValueError, match="num_processes, process_id not given"):
    d.resolve(d.DistributedConfig(coordinator_address="h0:1"))
  monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
  with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='two' is not an integer"):
    d.resolve(d.DistributedConfig())
  with pytest.raises(ValueError, match="process_id 2 is not below num_processes 2"):
    d.DistributedConfig(num_processes=2, process_id=2)
  with pytest.raises(ValueError, match="cpu_collectives"):
    d.DistributedConfig(cpu_collectives="nccl")


def test_one_process_helpers_are_identities():
  obj = {"a": [1, 2]}
  assert d.share_from_main(obj) is obj
  assert d.is_main() and not d.multi_process()
  d.barrier("nothing to wait for")


def test_slurm_script_parses():
  import os
  import subprocess
  path = os.path.join(os.path.dirname(__file__), "..", "experiments", "slurm", "rstar2_14b.sbatch")
  out = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
