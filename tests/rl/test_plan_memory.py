"""Smoke test of experiments/plan_memory.py on the tiny preset and 8 fake devices."""

import pytest

from experiments import plan_memory as pm

MESH = (("fsdp", 4), ("tensor", 2))


def _case(remat: str, kl_coef: float = 0.0) -> pm.PlanCase:
  # xla attention keeps [T, T] scores per layer for the backward pass unless the layer is
  # rematerialised, so even at T=256 remat="full" needs clearly less temp memory (measured:
  # 5.9 MB versus 12.8 MB). Kept small because each compile costs ~10 s on 2 cores.
  return pm.PlanCase(preset="tiny", mesh=MESH, seq_len=256, micro_batch=2, micro_batches=1,
                     remat_policy=remat, attention_impl="xla", logprob_chunk=256,
                     compute_entropy=False, param_dtype="float32", dtype="float32",
                     kl_coef=kl_coef)


@pytest.fixture(scope="module")
def estimates():
  return {r: pm.plan(_case(r), top_temp=3 if r == "full" else 0) for r in ("none", "full")}


def test_reports_positive_per_device_figures(estimates):
  est = estimates["none"]
  for name in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "state_bytes",
               "peak_bytes"):
    assert getattr(est, name) > 0, name
  assert est.generated_code_bytes >= 0  # the CPU backend reports 0
  # Arguments are this device's shards: the state plus 1/4 of the batch (sharded over fsdp).
  case = est.case
  n, t = case.batch_size, case.seq_len
  batch_bytes = sum(4 * (n if k == "advantages" else n * t) for k in pm.BATCH_DTYPES) // 4
  assert est.argument_bytes == est.state_bytes + batch_bytes
  cfg = case.model_config()
  total_state = 3 * cfg.num_params * 4  # fp32 params + two Adam moments
  assert est.state_bytes < total_state / 2, "state must be sharded, not replicated"
  # The donated state is reused for the new state.
  assert est.alias_bytes >= est.state_bytes - 64
  assert est.peak_bytes == (est.argument_bytes + est.temp_bytes + est.output_bytes
                            - est.alias_bytes)
  row = pm.format_row(est)
  assert row.startswith("f4xt2") and "yes/yes/yes" in row


def test_a_kl_term_adds_the_reference_parameters_and_log_probs(estimates):
  """kl_coef > 0: the reference policy's parameters (one more copy of the params' shards,
  no optimizer state) count in the peak, and its log-probs are one more batch array."""
  base = estimates["full"]
  kl = pm.plan(_case("full", kl_coef=0.1))
  cfg = base.case.model_config()
  params = cfg.num_params * 4 // 8   # fp32, fully sharded over the 8 devices (or close)
  assert 0.9 * params <= kl.reference_bytes <= base.state_bytes / 3 + 64
  assert kl.state_bytes == base.state_bytes and base.reference_bytes == 0
  n, t = base.case.batch_size, base.case.seq_len
  assert kl.argument_bytes == base.argument_bytes + 4 * n * t // 4   # ref_logp's shard
  assert kl.peak_bytes == (kl.argument_bytes + kl.temp_bytes + kl.output_bytes
                           - kl.alias_bytes + kl.reference_bytes)
  with pytest.raises(ValueError, match="kl_coef"):
    _case("full", kl_coef=-1.0)


def test_full_remat_needs_less_temp_than_none(estimates):
  none, full = estimates["none"].temp_bytes, estimates["full"].temp_bytes
  assert full < 0.6 * none, (full, none)
  assert estimates["full"].argument_bytes == estimates["none"].argument_bytes


def test_top_temp_values_come_from_the_buffer_assignment(estimates):
  est = estimates["full"]
  assert len(est.top_temp) == 3 and not estimates["none"].top_temp
  sizes = [size for size, _, _ in est.top_temp]
  assert sizes == sorted(sizes, reverse=True) and 0 < sizes[0] <= est.temp_bytes
  assert all(shape.split("[")[0] in ("f32", "bf16", "s32", "pred") for _, _, shape in est.top_temp)


def test_largest_temp_values_dedupes_shared_offsets():
  dump = "\n".join([
      "allocation 0: size 8, parameter 0, shape |f32[2]| at ShapeIndex {}:",
      " value: <1 p @0> (size=8,offset=0): f32[2]{0}",
      "allocation 1: size 96, preallocated-temp:",
      " value: <2 a.1 @0> (size=64,offset=0): f32[4,4]{1,0}",
      " value: <3 b.2 @0> (size=64,offset=0): f32[16]{0}",
      " value: <4 c.3 @0> (size=32,offset=64): bf16[16]{0}",
      "allocation 2: size 4, constant:",
      " value: <5 k @0> (size=400,offset=0): f32[100]{0}",
  ])
  assert pm.largest_temp_values(dump, 5) == [(64, "a.1", "f32[4,4]"), (32, "c.3", "bf16[16]")]
  with pytest.raises(ValueError, match="preallocated-temp"):
    pm.largest_temp_values("allocation 0: size 8, constant:", 3)


def test_bad_inputs_get_clear_errors():
  with pytest.raises(ValueError, match="bad part 'fsdp'"):
    pm.parse_mesh("fsdp")
  with pytest.raises(ValueError, match="axes are"):
    pm.PlanCase(mesh=(("model", 8),))
  with pytest.raises(ValueError, match="named twice"):
    pm.PlanCase(mesh=(("fsdp", 8), ("fsdp", 8)))
  with pytest.raises(ValueError, match="remat_policy"):
    pm.PlanCase(remat_policy="some")
  with pytest.raises(ValueError, match="needs 64 devices"):
    pm.plan(pm.PlanCase(preset="tiny", mesh=(("fsdp", 64),)))
  assert pm.parse_mesh("fsdp=8, tensor=8") == (("fsdp", 8), ("tensor", 8))


def test_no_involuntary_rematerialisation_on_a_data_fsdp_tensor_mesh():
  """On data x fsdp x tensor meshes GSPMD replicated the embedding
  lookup's output ("involuntary full rematerialization", 2 warnings on this case before
  the lookup read vocab shards). XLA logs it from C++, so the plan runs as a process."""
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  # The suite's 8 fake devices would reach the child (the plan needs 64, and reports a
  # case it cannot build as a FAILED row, not an exit code).
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run(
      [sys.executable, "-m", "experiments.plan_memory", "--config=experiments/configs/plan_memory.py",
       "--config.preset=small", "--config.prompt_len=64", "--config.response_lens=256",
       "--config.meshes=data=4,fsdp=4,tensor=4"],
      cwd=root, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "d4xf4xt4" in out.stdout and "FAILED" not in out.stdout, out.stdout[-3000:]
  assert "Involuntary full rematerialization" not in out.stdout + out.stderr


def test_compile_leaves_out_a_fast_option_this_xla_does_not_know():
  """FAST_COMPILE_OPTIONS only speed the compile: one that this jaxlib's XLA lacks (jax
  0.11 dropped xla_cpu_use_fusion_emitters) is left out; one the caller needs is not."""
  import jax
  import jax.numpy as jnp
  lowered = jax.jit(lambda x: x * 2).lower(jnp.ones(3))
  compiled = pm._compile_dropping_unknown(
      lowered, {"xla_backend_optimization_level": 0, "xla_no_such_option_here": False})
  assert [float(x) for x in compiled(jnp.ones(3))] == [2.0, 2.0, 2.0]
  with pytest.raises(Exception, match="No such compile option: 'xla_no_such_option_here'"):
    pm._compile_dropping_unknown(lowered, {"xla_no_such_option_here": False},
                                          keep=("xla_no_such_option_here",))
