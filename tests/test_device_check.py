"""experiments/device_check/ in its CPU mode (--tiny): every section runs, the report's
schema, and a failing or crashing section is recorded while the others still run; and
each check fails on a fault planted in its inputs (the check functions are pure)."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.device_check import checks
from experiments.device_check import sections_hf_recipe
from experiments.device_check import sections_rollouts
from experiments.device_check import sections_train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ("env", "numerics", "train_step", "parts", "memory", "rollouts", "hf_io", "recipe")
CHECK_KEYS = {"name", "value", "target", "met", "note", "section"}


def _env(tmp_path):
  # Two host devices: the train step runs on a real (fsdp=2) mesh.
  return dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu",
              XLA_FLAGS="--xla_force_host_platform_device_count=2",
              TMPDIR=str(tmp_path))


# Train-step levers the full run times beside the base step (one of each kind).
LEVERS = ("step.cast_params_once=true", "step.fused_head_loss=true",
          "model.remat_policy=save_qkv_attn")


def by_name_of(report):
  return {c["name"]: c for c in report["checks"]}


def _run(tmp_path, *args):
  out = tmp_path / "out"
  run = subprocess.run([sys.executable, "-m", "experiments.device_check", "--tiny",
                        f"--out={out}", f"--xla_cache={tmp_path / 'cache'}", *args],
                       cwd=REPO, env=_env(tmp_path), capture_output=True, text=True,
                       timeout=1500)
  return run, out


@pytest.fixture(scope="module")
def full(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("device_check")
  run, out = _run(tmp, f"--levers={','.join(LEVERS)}")
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  with open(out / "device_check.json") as f:
    return json.load(f), (out / "device_check.md").read_text(), out


def test_every_section_runs_and_no_target_is_missed_on_cpu(full):
  report, _, _ = full
  assert list(report["sections"]) == list(SECTIONS)
  failed = {n: r.get("error") for n, r in report["sections"].items() if not r["ok"]}
  assert not failed, failed
  assert report["failed_sections"] == []
  # Targets that apply on a CPU (numerics, equal losses across attention kernels, the
  # HF round trip, the sandbox's tool calls, the recipe's exit) are met; GPU-only ones
  # say n/a rather than passing.
  missed = [c for c in report["checks"] if c["met"] is False]
  assert not missed, missed
  by_name = {c["name"]: c for c in report["checks"]}
  assert by_name["gradient cosine similarity"]["met"] is True
  assert by_name["dot_product loss vs blockwise, rel. diff"]["met"] is True
  assert by_name["dot_product (cuDNN) speed / blockwise speed"]["met"] is None   # a GPU target
  assert any(c["name"].startswith("MFU") and c["met"] is None for c in report["checks"])
  # The checks that apply on a CPU and can fail there ran and were met.
  for name in ("JAX backend and device platforms", "bf16 in use: logits rel. L2 vs fp32",
               "transformers logits of the export vs ours, rel. L2",
               "scripted tool calls that reached the sandbox and ran ok",
               "recipe final pass@1", "recipe RL stage mean reward"):
    assert by_name[name]["met"] is True, by_name[name]
  # Every lever ran beside the base step and met its loss target.
  for lever in LEVERS:
    check = by_name[f"lever {lever}: first loss vs the step without it, rel. diff"]
    assert check["met"] is True and check["value"] is not None, check
  runs = report["sections"]["train_step"]["lever_runs"]
  assert [r["lever"] for r in runs] == list(LEVERS) and all(r["ok"] for r in runs), runs
  # The memory check is n/a on a CPU (no peak bytes), never met without a measurement.
  assert by_name["measured peak / CPU-host AOT plan"]["met"] is None


def test_report_schema(full):
  report, md, out = full
  assert sorted(os.listdir(out)) == ["device_check.json", "device_check.md"]
  for key in ("schema", "date", "commit", "command", "tiny", "load_average", "sections",
              "total_s", "checks", "failed_sections", "device"):
    assert key in report, key
  assert report["schema"] == 1 and report["tiny"] is True and report["device"] == "cpu"
  for name, r in report["sections"].items():
    assert r["ok"] is True and r["wall_s"] > 0 and r["seconds"] > 0, name
  for c in report["checks"]:
    assert set(c) == CHECK_KEYS, c
    assert c["met"] in (True, False, None)
  env = report["sections"]["env"]
  assert env["backend"] == "cpu" and len(env["devices"]) == 2
  assert env["missing_packages"] == [] and env["matmul_peak_gflops"] > 0
  runs = report["sections"]["train_step"]["runs"]
  assert [(r["attention_impl"], r["seq"]) for r in runs] == [
      ("chunked", 64), ("blockwise", 64), ("dot_product", 64), ("chunked", 96)]
  # The same weights and batch give the same first loss under every attention kernel.
  first = [r["loss"][0] for r in runs if r["seq"] == 64]
  assert max(first) - min(first) <= 2e-2 * max(abs(x) for x in first), first
  # Model FLOPs of the tiny slice by hand: 6 x matmul params + 12 L q S, per token.
  h, i, layers, q, kv, v = 64, 128, 2, 4 * 16, 2 * 16, 512
  params = layers * (2 * h * q + 2 * h * kv + 3 * h * i) + h * v
  for r in runs:
    tokens = r["batch"] * r["seq"]
    assert r["flops"] == (6 * params + 12 * layers * q * r["seq"]) * tokens
    # MaxText's convention: the causal half of the attention FLOPs.
    assert r["flops_causal_attention"] == (6 * params + 6 * layers * q * r["seq"]) * tokens
    measured = report["sections"]["train_step"]["peaks_gflops"]["measured"]
    both = r["mfu_both"]["measured"]
    assert both["full_attention"] == pytest.approx(r["flops"] / r["median_s"] / 1e9 / measured)
    assert both["causal_attention"] == pytest.approx(
        r["flops_causal_attention"] / r["median_s"] / 1e9 / measured)
    assert both["full_attention"] == pytest.approx(r["mfu"]["measured"])
  numerics = report["sections"]["numerics"]
  assert numerics["fp32_matmul_precision"] == "highest"
  parts = report["sections"]["parts"]
  assert sorted(parts["steps"], key=int) == ["2", "4"] and parts["pad_share"] > 0.2
  assert parts["head_logprobs_s"] > 0 and parts["optimizer_s"] > 0
  assert by_name_of(report)["packed rows, chunked: hidden states of 3 packed sequences vs "
                            "each alone, rel. L2"]["met"] is True
  assert parts["per_layer_s"] == pytest.approx(
      (parts["steps"]["4"]["median_s"] - parts["steps"]["2"]["median_s"]) / 2)
  memory = report["sections"]["memory"]
  assert memory["plans"]["cpu_host"]["peak_bytes"] > memory["plans"]["cpu_host"]["state_bytes"]
  agent = report["sections"]["rollouts"]["agent"]
  assert agent["trajectories"] == 4 and agent["tool_calls"] >= 8
  assert agent["scripted_calls"] == 8 and agent["scripted_failed"] == 0
  hf = report["sections"]["hf_io"]
  assert hf["hf_logits_rel_l2"] < checks.TARGETS["hf_logits_rel_l2_max"] and not hf["hf_error"]
  recipe = report["sections"]["recipe"]
  assert recipe["eval_final"]["num_samples"] == 128 and recipe["rl_stage1"]["steps"] == 2
  assert report["sections"]["recipe"]["returncode"] == 0
  for name in SECTIONS:
    assert f"| {name} | yes |" in md


def test_a_failing_and_a_crashing_section_are_recorded_and_the_rest_run(tmp_path):
  run, out = _run(tmp_path, "--sections=env,numerics,hf_io", "--inject_failure=numerics")
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.load(open(out / "device_check.json"))
  assert report["failed_sections"] == ["numerics"]
  assert "injected" in report["sections"]["numerics"]["error"]
  assert "RuntimeError" in report["sections"]["numerics"]["traceback"]
  assert report["sections"]["env"]["ok"] and report["sections"]["hf_io"]["ok"]
  assert "| numerics | NO |" in (out / "device_check.md").read_text()

  run, out = _run(tmp_path, "--sections=numerics,hf_io", "--inject_failure=crash:numerics")
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.load(open(out / "device_check.json"))
  assert report["sections"]["numerics"]["error"] == (
      "the section's process exited 3 without a result")
  assert report["sections"]["hf_io"]["ok"]


def test_unknown_section_is_refused(tmp_path):
  run, _ = _run(tmp_path, "--sections=env,warp_drive")
  assert run.returncode != 0 and "warp_drive" in run.stderr


# --- each check fails on a planted fault -------------------------------------------------


def test_targets_live_in_one_table():
  assert isinstance(checks.TARGETS, dict) and all(
      isinstance(v, (int, float)) for v in checks.TARGETS.values())
  # Every scripted call must reach the sandbox, and every one that does must run.
  assert checks.TARGETS["scripted_calls_reached_min"] == 1.0
  assert checks.TARGETS["scripted_calls_ok_min"] == 1.0


def test_backend_check_fails_on_a_cpu_fallback():
  # JAX's own backend here (the CPU): a run that wanted an accelerator fails.
  devices = jax.devices()
  met, detail = checks.check_backend(jax.default_backend(), [d.platform for d in devices], True)
  assert met is False and "cpu" in detail
  assert checks.check_backend(jax.default_backend(), [d.platform for d in devices], False)[0]
  assert checks.check_backend("gpu", ["gpu"], True)[0] is True
  assert checks.check_backend("gpu", ["gpu", "cpu"], True)[0] is False   # a mixed set
  assert checks.check_backend("gpu", [], True)[0] is False


def test_memory_check_fails_off_the_cpu_host_plan(full):
  report, _, _ = full
  planned = report["sections"]["memory"]["plans"]["cpu_host"]["peak_bytes"]
  assert checks.check_memory_vs_plan(int(planned * 1.10), planned)[0] is True
  assert checks.check_memory_vs_plan(int(planned * 0.90), planned)[0] is True
  assert checks.check_memory_vs_plan(int(planned * 1.20), planned)[0] is False
  assert checks.check_memory_vs_plan(int(planned * 0.80), planned)[0] is False
  # No plan is a failure (the H100's CPU-host plan once failed on a compile option);
  # no measurement is n/a, not a pass.
  met, detail = checks.check_memory_vs_plan(planned, None, "JaxRuntimeError: No such option")
  assert met is False and "No such option" in detail
  assert checks.check_memory_vs_plan(None, planned)[0] is None


def _cpu_dot_product_custom_calls():
  from experiments.common import step_timing
  q = jnp.ones((1, 16, 2, 8), jnp.bfloat16)

  def f(q):
    return jax.nn.dot_product_attention(q, q, q, is_causal=True, implementation="xla").sum()
  text = jax.jit(jax.grad(f)).lower(q).compile().as_text()
  return step_timing._custom_calls(text)


def test_dot_product_check_fails_without_cudnn_in_the_hlo(full):
  report, _, _ = full
  # The real compiled steps on this CPU: XLA's attention, no cuDNN call. However fast,
  # the check fails.
  dpa = [r for r in report["sections"]["train_step"]["runs"]
         if r["attention_impl"] == "dot_product"][0]
  for calls in (dpa["hlo_custom_calls"], _cpu_dot_product_custom_calls()):
    met, detail = checks.check_dot_product_attention(calls, 2.0)
    assert met is False and "NOT in the step" in detail
  # HLO text with cuDNN's forward and backward fused attention (as the H100 step's).
  from experiments.common import step_timing
  text = ('%a = custom-call(...), custom_call_target="__cudnn$fmhaScaleBiasSoftmax"\n'
          '%b = custom-call(...), custom_call_target="__cudnn$fmhaScaleBiasSoftmaxBackward"\n'
          '%c = custom-call(...), custom_call_target="__cublas$gemm"')
  calls = step_timing._custom_calls(text)
  assert checks.check_dot_product_attention(calls, 1.19)[0] is True
  assert checks.check_dot_product_attention(calls, 0.9)[0] is False    # slower than blockwise
  assert checks.check_dot_product_attention(calls, None)[0] is False
  forward_only = [c for c in calls if "Backward" not in c]
  assert checks.check_dot_product_attention(forward_only, 1.19)[0] is False


def test_recipe_check_fails_on_a_run_that_did_not_learn(full):
  report, _, _ = full
  recipe = report["sections"]["recipe"]
  assert all(met for _, _, _, met, _ in checks.check_recipe_learned(recipe["eval_final"],
                                                                    recipe["rl_stage1"]))
  # The H100 run of 2026-11-27: pass@1 0.0, tool error rate 1.0.
  dead = dict(recipe["eval_final"], pass_at_1=0.0, tool_error_rate=1.0)
  rows = checks.check_recipe_learned(dead, recipe["rl_stage1"])
  assert [r[3] for r in rows] == [False, True]
  one = dict(recipe["eval_final"], pass_at_1=1 / 128)   # 1 of 128: below the target
  assert checks.check_recipe_learned(one, recipe["rl_stage1"])[0][3] is False
  flat = dict(recipe["rl_stage1"], **{"rollout/reward_mean": 0.0, "no_learning_signal": True})
  assert [r[3] for r in checks.check_recipe_learned(recipe["eval_final"], flat)] == [True, False]
  assert [r[3] for r in checks.check_recipe_learned(None, None)] == [False, False]


def test_scripted_call_check_fails_unless_every_call_reaches_the_sandbox():
  assert checks.check_scripted_calls(32, 32, 32)[0] is True
  assert checks.check_scripted_calls(32, 30, 30)[0] is False   # the H100's 30 of 32
  assert checks.check_scripted_calls(32, 32, 31)[0] is False   # one failed in the sandbox
  assert checks.check_scripted_calls(0, 0, 0)[0] is False


def test_plain_thinking_leaves_no_protocol_tag():
  import asyncio
  import dataclasses

  from rstar_jax.data import toy_task
  from rstar_jax.rollout.engine import GenerationRequest
  tok = toy_task.train_toy_tokenizer(1024)
  tags = [i for i in range(tok.vocab_size) if "<" in tok.decode([i])]
  assert tags

  class Echo:   # an "engine" that samples every tag
    async def generate(self, request):
      @dataclasses.dataclass
      class Out:
        output_ids: list
      return Out(output_ids=list(tags) + [5])
  plain = sections_rollouts.PlainThinking(Echo(), tok)
  think = asyncio.run(plain.generate(GenerationRequest(input_ids=[1], max_new_tokens=4)))
  assert "<" not in tok.decode(think.output_ids) and plain.replaced == len(tags)
  free = asyncio.run(plain.generate(GenerationRequest(input_ids=[1], max_new_tokens=4,
                                                      stop_token_ids=(2,))))
  assert free.output_ids == list(tags) + [5]   # a turn with stop ids passes unchanged


def test_bf16_check_fails_when_bf16_did_not_run():
  from rstar_jax.model import model_config, qwen3
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, 512, (2, 16)))
  logits = {}
  for dtype in ("float32", "bfloat16"):
    cfg = model_config.get_preset("tiny", param_dtype="float32", dtype=dtype)
    logits[dtype] = np.asarray(qwen3.forward_logits(qwen3.create_model(cfg, seed=0), tokens),
                               np.float64)
  ref = logits["float32"]

  def rel(x):
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))
  # Planted: the "bf16" model computed in fp32 (equal logits) fails; real bf16 passes.
  assert checks.check_bf16_used(rel(logits["float32"]))[0] is False
  assert checks.check_bf16_used(rel(logits["bfloat16"]))[0] is True
  assert checks.check_bf16_used(2.0 ** -11 / 4)[0] is False   # TF32-class, not bf16


def test_hf_check_fails_on_a_corrupted_export(tmp_path):
  """The tiny model's HF export read by transformers matches our logits; the same export
  with one weight corrupted (a layer's MLP down_proj scaled by 1.5; q_proj would not do:
  Qwen3 normalises q per head) fails the check."""
  from safetensors.numpy import load_file, save_file

  from rstar_jax.model import model_config, hf_io, qwen3
  cfg = model_config.get_preset("tiny", param_dtype="float32", dtype="float32")
  model = qwen3.create_model(cfg, seed=0)
  out = str(tmp_path / "export")
  hf_io.save_hf(model, out, dtype="float32")
  tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 12))
  with jax.default_matmul_precision("highest"):
    ours = np.asarray(qwen3.forward_logits(model, jnp.asarray(tokens)), np.float64)

  def rel():
    theirs = sections_hf_recipe.transformers_logits(out, tokens).astype(np.float64)
    return float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))
  assert checks.check_hf_logits(rel())[0] is True
  [path] = [os.path.join(out, f) for f in os.listdir(out) if f.endswith(".safetensors")]
  tensors = load_file(path)
  key = next(k for k in tensors if k.endswith("layers.0.mlp.down_proj.weight"))
  tensors[key] = tensors[key] * 1.5
  save_file(tensors, path, metadata={"format": "pt"})
  met, _ = checks.check_hf_logits(rel())
  assert met is False
  met, detail = checks.check_hf_logits(None, "ModuleNotFoundError: No module named 'transformers'")
  assert met is False and "transformers" in detail


def test_padded_batch_has_padding_in_every_row():
  batch = sections_train.padded_batch(512, 2, 64)
  mask = batch["attention_mask"]
  assert mask.shape == (2, 64)
  assert (mask.sum(1) < 64).all() and (mask.sum(1) > 0).all()
  with pytest.raises(ValueError, match="power of two"):
    sections_train.padded_batch(512, 2, 96)


def test_the_committed_h100_run_judged_by_the_checks():
  """experiments/results/device/2026-11-27_h100.json, judged again: its cuDNN step passes
  the attention check, while the checks that its old forms could not fail now fail on
  it (no CPU-host plan; pass@1 0.0 with tool error rate 1.0)."""
  with open(os.path.join(REPO, "experiments/results/device/2026-11-27_h100.json")) as f:
    report = json.load(f)
  s = report["sections"]
  env = s["env"]
  assert checks.check_backend(env["backend"], [d["platform"] for d in env["devices"]], True)[0]
  runs = {r["attention_impl"]: r for r in s["train_step"]["runs"] if r["seq"] == 8192}
  speed = runs["blockwise"]["median_s"] / runs["dot_product"]["median_s"]
  assert checks.check_dot_product_attention(runs["dot_product"]["hlo_custom_calls"], speed)[0]
  assert not checks.check_dot_product_attention(runs["chunked"]["hlo_custom_calls"], speed)[0]
  memory = s["memory"]
  met, detail = checks.check_memory_vs_plan(memory["measured_peak_bytes"],
                                            memory["plans"]["cpu_host"].get("peak_bytes"),
                                            memory["plans"]["cpu_host"].get("error", ""))
  assert met is False and "xla_cpu_use_fusion_emitters" in detail
  rows = checks.check_recipe_learned(s["recipe"]["eval_final"], None)
  assert rows[0][3] is False and s["recipe"]["eval_final"]["tool_error_rate"] == 1.0
  assert checks.check_bf16_used(s["numerics"]["logits_rel_l2"])[0] is True


def test_segment_check_fails_when_packed_sequences_see_each_other():
  """Three sequences packed into one row against each alone: equal hidden states on this
  CPU; the same row as one segment (planted: the sequences attend across) fails."""
  from rstar_jax.model import model_config
  cfg = model_config.get_preset("tiny", param_dtype="float32", dtype="bfloat16",
                                attention_impl="chunked", attention_chunk=16,
                                remat_policy="none")
  rel_l2 = sections_train.segment_isolation_rel_l2(cfg, 64)
  assert checks.check_segment_isolation(rel_l2)[0] is True
  met, detail = checks.check_segment_isolation(
      sections_train.segment_isolation_rel_l2(cfg, 64, merge_segments=True))
  assert met is False and "across" in detail


def test_lever_flags_are_parsed_or_refused_and_the_lever_check_can_fail():
  assert checks.parse_lever("step.fused_head_loss=true") == ("step", "fused_head_loss", True)
  assert checks.parse_lever("step.micro_batches=4") == ("step", "micro_batches", 4)
  assert checks.parse_lever("model.remat_policy=save_qkv_attn") == ("model", "remat_policy",
                                                                    "save_qkv_attn")
  for bad in ("step.fused_head=true", "optim.lr=1", "step.fused_head_loss"):
    with pytest.raises(ValueError, match="--levers"):
      checks.parse_lever(bad)
  assert checks.check_lever(2.0, 2.0) == (True, 0.0)
  met, rel = checks.check_lever(2.0, 2.2)         # a lever that changes the maths: 10% off
  assert met is False and abs(rel - 0.1) < 1e-12
  assert checks.check_lever(None, 2.0) == (False, None)   # the base case failed
  assert checks.check_lever(2.0, None) == (False, None)   # the lever failed
