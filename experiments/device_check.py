r"""python -m experiments.device_check --out /tmp/device_check

The first thing to run on an accelerator host (one NVIDIA H100 / H200, or an MI300X):
one command, about 8-9 minutes on one H100, that exercises every GPU path of the project
on a slice of Qwen3-14B (its per-layer shapes: hidden 5120, 40 query and 8 KV heads of
128, MLP 17408, vocab 151936; `--layers` of them, 2 by default) and writes
`OUT/device_check.json` and `OUT/device_check.md` (a table of every figure and target).

Sections, each in a process of its own with its own time limit (a crash, an
out-of-memory or a hang in one is recorded with its error and the others still run;
a fresh process also gives each section a clean peak-memory counter):
  env         devices, memory, jax / jaxlib / plugin versions (and every package the
              project imports), the XLA flags and variables in force, missing packages,
              bubblewrap; JAX's own backend against the one wanted; the limits measured
              here (bf16 matmul peak, HBM read bandwidth) beside the data sheet's.
  numerics    the slice in bf16 against the same weights in fp32 at the highest matmul
              precision: logits, token log-probs, the GRPO-RoC loss and the gradient
              (tolerances below), and that bf16 did run (its logits differ from fp32's).
  train_step  the RL trainer's sharded GRPO step (clip-higher loss, AdamW, remat as
              the 14B config sets it) at seq 8192 for each attention implementation
              (chunked, blockwise, dot_product), and 12288 for the 14B config's own
              ("auto": dot_product on NVIDIA, chunked elsewhere); step time, tokens/s,
              MFU against the measured bf16 matmul peak and the data sheet's dense bf16
              peak, with attention FLOPs counted in full (PaLM) and causal-halved
              (MaxText); which kernels the compiled step calls (cuDNN's fused attention
              shows as `__cudnn$fmha...`).
  parts       in one process, on rows with padding: the same step with L and 2L layers
              (per layer: the difference / L), the head with the log-probs alone and the
              optimizer update alone; and packed rows (the segment path): sequences
              packed into one row against each alone.
  memory      one step in a fresh process: the device's peak bytes in use against
              `experiments.plan_memory`'s ahead-of-time plan of the same step made on
              the CPU host (the plan the 14B memory figures come from); the plan
              compiled for this device is reported beside it (equal by construction).
  rollouts    JaxEngine prefill and decode on the slice (bf16 weights, as a rollout
              server holds them) at 64 slots: tokens/s, decode step against the HBM
              roofline; then a short multi-turn run through the agent loop, the
              sandbox server and the tool protocol (the `small` preset with the toy
              tokenizer, scripted tool calls, every one of which must reach the sandbox).
  hf_io       Hugging Face export and load of the slice (bf16 safetensors), GB/s,
              with the loaded weights checked against the exported ones, and the export
              read by transformers (torch, CPU): its logits against ours.
  recipe      the toy recipe's `smoke` variant end to end on this device (SFT, RL,
              evaluation on 64 problems x 2 samples, with the sandbox;
              `--allow-weak-isolation` when bubblewrap is missing, said in the output);
              its final pass@1 and RL reward must show that it learned.

Targets: the TARGETS table below, one place; each check is a pure function of its
figures (`check_*`), so tests plant faults in them. A target that does not apply here
(a GPU target on a CPU) reads n/a, never met.

Tolerances of bf16 against fp32 (same weights, fp32 master copy): bf16 keeps 8
significant bits, a unit roundoff of 2^-8 = 3.9e-3 per rounding. One bf16 product
with fp32 accumulation lands near 1e-3..1e-2 relative error; the slice rounds the
residual stream after every block of its layers and the head, so the logits' relative
L2 error may reach a few of those: tolerance 2e-2. What the loss sees are token
log-probs: their mean |difference| must stay under 0.05 nats, a 5% change of the PPO
ratio, a quarter of the clip range (0.2). The loss (a mean of ratio x advantage) then
moves by at most 0.05 x mean|advantage|, and the gradient's direction must hold
(cosine similarity >= 0.99, norm within 5%).

--tiny runs every section on a CPU at toy sizes in a few minutes (CI runs it): the
figures mean nothing there, the code paths are the same. On a host whose image has jax,
flax, optax and orbax but lacks a few small pure-Python packages, carry them as wheels
(`experiments/fetch_device_wheels.sh` writes them to `.whl/`) and start with
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
  PYTHONPATH=/tmp/site python3 -m experiments.device_check --out $OUT
The env section names every package that is still missing.
"""
from __future__ import annotations

import collections
import dataclasses
import datetime
import functools
import importlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

from absl import app
from absl import flags

SECTIONS = ("env", "numerics", "train_step", "parts", "memory", "rollouts", "hf_io", "recipe")
# Seconds each section may take on one H100 (its own limit; the whole check also stops
# starting sections when --budget_s is spent). With --tiny (a CPU) they are 4x these:
# a loaded 2-core host is slow too.
SECTION_LIMIT_S = {"env": 90, "numerics": 150, "train_step": 300, "parts": 200,
                   "memory": 150, "rollouts": 200, "hf_io": 200, "recipe": 300}
# Python packages the project imports (module name, distribution): the env section
# lists what is missing.
PACKAGES = (("jax", "jax"), ("jaxlib", "jaxlib"), ("flax", "flax"), ("optax", "optax"),
            ("orbax.checkpoint", "orbax-checkpoint"), ("ml_collections", "ml_collections"),
            ("absl", "absl-py"), ("numpy", "numpy"), ("safetensors", "safetensors"),
            ("tokenizers", "tokenizers"), ("sympy", "sympy"), ("math_verify", "math-verify"),
            ("latex2sympy2_extended", "latex2sympy2_extended"),
            ("antlr4", "antlr4-python3-runtime"), ("tensorboardX", "tensorboardX"),
            ("aiohttp", "aiohttp"), ("scipy", "scipy"), ("pyarrow", "pyarrow"),
            ("matplotlib", "matplotlib"), ("tqdm", "tqdm"), ("filelock", "filelock"))
ENV_VARS = ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION",
            "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR", "JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES",
            "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "NCCL_DEBUG", "TF_CPP_MIN_LOG_LEVEL")
# Packages that only the checks' references need (transformers reads the HF export back).
REFERENCE_PACKAGES = (("transformers", "transformers"), ("torch", "torch"))

# Every target a figure of the check is held to, in one table. A target changes only by
# a commit of its own that says why (never in passing with other work): a run is judged
# against what was decided before it ran, not against what it happened to measure.
TARGETS: dict[str, float] = {
    # train_step: model-FLOP utilisation of the data sheet's dense bf16 peak at the first
    # --seq_lens (8192) with the 14B config's own attention. Stated against attention
    # FLOPs counted in full (PaLM's convention, as set on 2026-11-27); the causal-halved
    # MFU (MaxText's) is reported beside it.
    "mfu_data_sheet_min": 0.45,
    # dot_product (cuDNN): blockwise step time / dot_product step time, with cuDNN's
    # fused attention (forward and backward) in the compiled step's HLO.
    "dot_product_speedup_min": 1.0,
    # dot_product against blockwise: first loss, relative difference.
    "attention_loss_rel_diff_max": 2e-2,
    # --levers: a lever's first loss against the same step without it, relative
    # difference. The levers change the order of operations (casts, fused gradients,
    # what remat saves), not the maths: bf16 rounding apart, as across attention kernels.
    "lever_loss_rel_diff_max": 2e-2,
    # rollouts: the decode step's HBM roofline (measured bandwidth) / its measured time.
    "decode_roofline_min": 0.5,
    # rollouts: share of the scripted tool calls (2 per trajectory) that reach the
    # sandbox, and share of those that run with status ok. Every one.
    "scripted_calls_reached_min": 1.0,
    "scripted_calls_ok_min": 1.0,
    # memory: |measured peak / the CPU host's AOT plan (experiments.plan_memory) - 1|.
    "memory_plan_rel_max": 0.15,
    # numerics, bf16 against the fp32 reference at the highest matmul precision (the
    # module docstring says why these).
    "logits_rel_l2_max": 2e-2,
    "logprob_mean_abs_diff_max": 0.05,
    "loss_diff_over_mean_adv_max": 0.05,
    "grad_cosine_min": 0.99,
    "grad_norm_rel_diff_max": 0.05,
    # numerics: bf16 was in fact used. Its logits must differ from fp32's by at least
    # this relative L2: a quarter of bf16's unit roundoff (2^-8), above what TF32-class
    # fp32 matmuls (2^-11) or fp32 itself give.
    "bf16_logits_rel_l2_min": 1e-3,
    # hf_io: logits of the export read by transformers (torch, fp32, CPU) against ours
    # (fp32, highest precision) on the same tokens, relative L2.
    "hf_logits_rel_l2_max": 1e-4,
    # parts: packed rows (the segment path). Hidden states of sequences packed into one
    # row (segments 1..3, positions restarting, padding) against each sequence alone in
    # its own row, relative L2: bf16 compute in both, so a few bf16 roundings apart (the
    # logits' tolerance); segments that see each other differ by O(1).
    "segment_isolation_rel_l2_max": 2e-2,
    # recipe (toy smoke, evaluated on 64 problems x 2 samples): the final pass@1 must
    # show that the run learned. An untrained or broken model answers none; after the
    # smoke SFT ~5% of direct answers are right (experiments/configs/toy.py), and this
    # evaluation gave 0.039 (5 of 128) on a CPU. At least 2 of 128 (P = 1% to miss it
    # by chance at 5%).
    "recipe_pass_at_1_min": 2 / 128,
    # recipe: the RL stage's mean rollout reward (a learning signal: mixed rewards in
    # its groups; 0.047 on a CPU).
    "recipe_rl_reward_min": 1e-9,
}
# The toy recipe's evaluation in the recipe section (before --recipe_overrides): 64
# problems x 2 samples, so that a learned ~5% pass@1 shows (the smoke variant's own 4
# problems x 2 gave 0 of 8 on the CPU and on the H100).
RECIPE_EVAL_OVERRIDES = ("--config.data.toy.eval_problems=64", "--config.eval.k=2")
# cuDNN's fused attention, as a custom call of the compiled step (forward; the backward
# target ends in "Backward"), e.g. __cudnn$fmhaScaleBiasSoftmax.
CUDNN_FMHA_PREFIX = "__cudnn$fmha"


# --- checks: pure functions of the figures, (met, detail) ------------------------------------
# met is True / False, or None where the target does not apply (a GPU target on a CPU).


def check_backend(backend: str, platforms: list[str], want_accelerator: bool
                  ) -> tuple[bool, str]:
  """JAX's own backend (jax.default_backend()) and every device's platform are the
  accelerator's (gpu / cuda / rocm) when one is wanted, the CPU otherwise: a GPU run
  that fell back to the CPU (a missing plugin, JAX_PLATFORMS) fails here."""
  accel = {"gpu", "cuda", "rocm"}
  want = accel if want_accelerator else {"cpu"}
  bad = sorted({p for p in platforms if p not in want})
  if backend not in want:
    return False, f"default backend {backend!r}, wanted {'/'.join(sorted(want))}"
  if not platforms or bad:
    return False, f"device platforms {sorted(set(platforms))}, wanted {'/'.join(sorted(want))}"
  return True, f"{backend}: {len(platforms)} device(s)"


def check_memory_vs_plan(measured: int | None, planned: int | None, plan_error: str = ""
                         ) -> tuple[bool | None, str]:
  """The device's measured peak bytes against the CPU host's ahead-of-time plan of the
  same step (the plan the 14B figures come from), within TARGETS["memory_plan_rel_max"].
  No plan is a failure; a backend that reports no peak (the CPU) makes it n/a."""
  if planned is None:
    return False, f"no CPU-host plan: {plan_error or 'missing'}"[:300]
  if measured is None:
    return None, "the backend reports no peak bytes"
  ratio = measured / planned
  tol = TARGETS["memory_plan_rel_max"]
  return abs(ratio - 1) <= tol, f"measured {measured / 1e9:.3f} GB / planned {planned / 1e9:.3f} GB"


def cudnn_fmha_calls(custom_calls: list[str]) -> tuple[list[str], list[str]]:
  """(forward, backward) cuDNN fused-attention custom-call targets among `custom_calls`."""
  fmha = [c for c in custom_calls if c.startswith(CUDNN_FMHA_PREFIX)]
  return ([c for c in fmha if "Backward" not in c], [c for c in fmha if "Backward" in c])


def check_dot_product_attention(custom_calls: list[str], speedup: float | None
                                ) -> tuple[bool, str]:
  """dot_product attention passes only if cuDNN's fused attention (forward and backward)
  is among the compiled step's custom calls and the step is at least
  TARGETS["dot_product_speedup_min"] x as fast as blockwise: fast XLA attention
  standing in for cuDNN is a failure."""
  fwd, bwd = cudnn_fmha_calls(custom_calls)
  if not fwd or not bwd:
    return False, (f"cuDNN fused attention NOT in the step (forward {fwd or 'none'}, "
                   f"backward {bwd or 'none'})")
  if speedup is None:
    return False, "no speed ratio (a run failed)"
  ok = speedup >= TARGETS["dot_product_speedup_min"]
  return ok, f"{', '.join(fwd + bwd)} in the step; {speedup:.3g}x blockwise"


def check_scripted_calls(expected: int, reached: int, ok: int) -> tuple[bool, str]:
  """Every scripted tool call reaches the sandbox and runs with status ok."""
  detail = f"{reached} of {expected} reached the sandbox, {ok} ran ok"
  met = (expected > 0
         and reached >= TARGETS["scripted_calls_reached_min"] * expected
         and ok >= TARGETS["scripted_calls_ok_min"] * reached)
  return met, detail


def check_bf16_used(logits_rel_l2: float) -> tuple[bool, str]:
  """bf16 compute differs from the fp32 reference by at least
  TARGETS["bf16_logits_rel_l2_min"]: a bf16 result equal to fp32's means bf16 did not
  run."""
  if logits_rel_l2 == 0.0:
    return False, "bf16 logits equal the fp32 reference exactly: bf16 did not run"
  ok = logits_rel_l2 >= TARGETS["bf16_logits_rel_l2_min"]
  return ok, "" if ok else "bf16 logits as close to fp32 as fp32 rounding: bf16 did not run"


def check_hf_logits(rel_l2: float | None, error: str = "") -> tuple[bool, str]:
  """The export read by transformers gives our logits (TARGETS["hf_logits_rel_l2_max"])."""
  if rel_l2 is None:
    return False, (error or "no transformers logits")[:300]
  return rel_l2 <= TARGETS["hf_logits_rel_l2_max"], ""


def check_recipe_learned(eval_final: dict[str, Any] | None, rl_done: dict[str, Any] | None
                         ) -> list[tuple[str, Any, str, bool, str]]:
  """The toy recipe's run learned: (name, value, target, met, detail) per figure.

  - final pass@1 >= TARGETS["recipe_pass_at_1_min"] (a model that learned nothing, or
    a broken pipeline, answers none: pass@1 0.0 with tool error rate 1.0 fails here);
  - the RL stage's mean reward > 0 and its own `no_learning_signal` false.
  The tool error rate is reported beside pass@1 but has no target: the smoke model's own
  tool calls are malformed (it cannot copy numbers into code) on a CPU too (1.0 there);
  the rollouts section's scripted calls check the sandbox."""
  out = []
  if not eval_final:
    out.append(("recipe final pass@1", None, f">= {TARGETS['recipe_pass_at_1_min']:.4g}",
                False, "no eval_final.json"))
  else:
    p = eval_final.get("pass_at_1")
    terr = eval_final.get("tool_error_rate")
    n = eval_final.get("num_samples")
    met = p is not None and p >= TARGETS["recipe_pass_at_1_min"]
    out.append(("recipe final pass@1", p, f">= {TARGETS['recipe_pass_at_1_min']:.4g}", met,
                f"{n} samples; tool error rate {terr} (no target: see check_recipe_learned)"))
  if not rl_done:
    out.append(("recipe RL stage mean reward", None, "> 0", False, "no stage1/DONE.json"))
  else:
    r = rl_done.get("rollout/reward_mean")
    met = (r is not None and r >= TARGETS["recipe_rl_reward_min"]
           and not rl_done.get("no_learning_signal", True))
    out.append(("recipe RL stage mean reward", r, "> 0 with a learning signal", met,
                f"no_learning_signal={rl_done.get('no_learning_signal')}"))
  return out


def check_segment_isolation(rel_l2: float) -> tuple[bool, str]:
  """Packed sequences do not see each other (TARGETS["segment_isolation_rel_l2_max"])."""
  ok = rel_l2 <= TARGETS["segment_isolation_rel_l2_max"]
  return ok, "" if ok else "packed sequences attend across their segments"


def check_at_least(value: float | None, key: str) -> bool | None:
  return None if value is None else value >= TARGETS[key]


def check_at_most(value: float | None, key: str) -> bool | None:
  return None if value is None else value <= TARGETS[key]


def parse_lever(text: str) -> tuple[str, str, Any]:
  """`step.<field>=<value>` or `model.<field>=<value>` -> (where, field, value), the value
  read as a bool, int, float or string; a field the config does not have is refused."""
  import dataclasses as dc
  from rstar_jax.model import model_config
  from rstar_jax.train import step as core
  where, _, rest = text.partition(".")
  field, eq, raw = rest.partition("=")
  known = {"step": {f.name for f in dc.fields(core.StepConfig)},
           "model": {f.name for f in dc.fields(model_config.Qwen3Config)}}
  if where not in known or not eq or field not in known[where]:
    raise ValueError(f"--levers: {text!r} is not step.<field>=<value> or model.<field>=<value> "
                     f"with a field of StepConfig {sorted(known['step'])} or Qwen3Config")
  value: Any = raw
  if raw.lower() in ("true", "false"):
    value = raw.lower() == "true"
  else:
    for kind in (int, float):
      try:
        value = kind(raw)
        break
      except ValueError:
        pass
  return where, field, value


def check_lever(base_loss: float | None, lever_loss: float | None) -> tuple[bool | None, float | None]:
  """(met, relative difference of the lever's first loss from the base step's): a lever
  that did not run, or whose base did not, is not met."""
  if base_loss is None or lever_loss is None:
    return False, None
  rel = abs(lever_loss - base_loss) / max(abs(base_loss), 1e-6)
  return rel <= TARGETS["lever_loss_rel_diff_max"], rel


def _define_flags() -> None:
  """The command's flags, defined when it runs (`__main__`), not on import: the tests
  import the check functions beside other entry points' modules with flags of these
  names (`gpu_smoke` defines --out, --tiny, --steps)."""
  flags.DEFINE_string("out", "", "directory for device_check.json and device_check.md")
  flags.DEFINE_boolean("tiny", False, "every section at toy sizes on a CPU (CI)")
  flags.DEFINE_list("sections", list(SECTIONS), f"sections to run, from {SECTIONS}")
  flags.DEFINE_integer("layers", 2, "decoder layers of the Qwen3-14B slice", lower_bound=1)
  flags.DEFINE_list("seq_lens", ["8192", "12288"],
                    "train-step sequence lengths: the first for every attention "
                    "implementation, the others for the 14B config's own only")
  flags.DEFINE_list("attention_impls", ["chunked", "blockwise", "dot_product"],
                    "attention implementations timed in the train step (the 14B config's "
                    "own, resolved on this device, is added if missing)")
  flags.DEFINE_list("levers", [],
                    "train-step levers, each timed as a case of its own at the first --seq_lens "
                    "with the 14B config's attention, beside the same step without it: "
                    "step.<StepConfig field>=<value> or model.<Qwen3Config field>=<value>, "
                    "e.g. step.fused_head_loss=true,model.remat_policy=save_qkv_attn")
  flags.DEFINE_integer("steps", 3, "timed train steps per case, after the compile step",
                       lower_bound=1)
  flags.DEFINE_integer("slots", 64, "JaxEngine slots in the rollouts section", lower_bound=1)
  flags.DEFINE_float("budget_s", None, "no section starts after this many seconds (default: "
                     "560 on an accelerator, none with --tiny, whose CPU times mean nothing)")
  flags.DEFINE_list("recipe_overrides", [],
                    "extra --config.* arguments for the recipe section (e.g. shorter stages)")
  flags.DEFINE_string("scratch", "", "work directory (default: a temporary one, removed)")
  flags.DEFINE_string("xla_cache", os.path.join(tempfile.gettempdir(), "device_check_xla_cache"),
                      "JAX's persistent compilation cache ('' for none): a re-run on the same "
                      "machine loads its programs instead of compiling them")
  flags.DEFINE_string("inject_failure", "",
                      "test hook: SECTION raises at its start, crash:SECTION exits its process "
                      "at once (to show that the others still run and the failure is recorded)")
  # Internal: the driver runs each section as `--run_section NAME --section_result FILE`.
  flags.DEFINE_string("run_section", "", "internal: run one section in this process")
  flags.DEFINE_string("section_result", "", "internal: where the section writes its JSON")
  flags.DEFINE_string("context", "", "internal: JSON of the sections before (the limits)")


FLAGS = flags.FLAGS


# --- sizes ---------------------------------------------------------------------------------


def slice_config(**overrides):
  """The model the sections run: Qwen3-14B's per-layer shapes with --layers layers, as
  the 14B recipe config runs it (fp32 master weights, bf16 compute, full remat,
  chunked attention); the `tiny` preset with --tiny."""
  from rstar_jax.model import model_config
  base = dict(param_dtype="float32", dtype="bfloat16", remat_policy="full",
              attention_impl="chunked", attention_chunk=1024)
  if FLAGS.tiny:
    base.update(attention_chunk=16)
    return model_config.get_preset("tiny", **dict(base, **overrides))
  overrides.setdefault("num_hidden_layers", FLAGS.layers)
  return model_config.get_preset("qwen3-14b", **dict(base, **overrides))


def sizes() -> dict[str, Any]:
  if FLAGS.tiny:
    return dict(numerics_batch=2, numerics_seq=32, train_seqs=[64, 96], train_batch=1,
                logprob_chunk=16, slots=min(FLAGS.slots, 8), prompt=16, new_tokens=8,
                matmul_n=512, bandwidth_mb=64, trajectories=4, think_tokens=8)
  return dict(numerics_batch=2, numerics_seq=1024, train_seqs=[int(s) for s in FLAGS.seq_lens],
              train_batch=1, logprob_chunk=512, slots=FLAGS.slots, prompt=512,
              new_tokens=128, matmul_n=8192, bandwidth_mb=4096, trajectories=16,
              think_tokens=32)


def _check(name: str, value, target: str, met: bool | None, note: str = "") -> dict[str, Any]:
  """A target: its measured value, the rule, and whether it is met (None: not
  applicable here, e.g. a GPU target on a CPU)."""
  return {"name": name, "value": value, "target": target, "met": met, "note": note}


def _accelerator() -> bool:
  import jax
  return jax.devices()[0].platform != "cpu"


def _mesh():
  import jax

  from rstar_jax import sharding
  return sharding.make_mesh({"fsdp": len(jax.devices())})


def _peak_bytes() -> int | None:
  import jax
  stats = jax.devices()[0].memory_stats()
  return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


# --- sections ------------------------------------------------------------------------------


def section_env(ctx: dict[str, Any]) -> dict[str, Any]:
  del ctx
  from experiments.common import roofline
  from experiments.common import step_timing
  import jax
  out: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(),
                         "hostname": platform.node()}
  missing = []
  for module, dist in PACKAGES:
    try:
      importlib.import_module(module)
    except Exception as e:  # an ImportError, or a package that fails on import
      missing.append({"module": module, "distribution": dist, "error": f"{type(e).__name__}: {e}"})
  out["missing_packages"] = missing
  out["missing_reference_packages"] = []
  for module, dist in REFERENCE_PACKAGES:   # the hf_io check needs them; its check fails
    try:
      importlib.import_module(module)
    except Exception as e:
      out["missing_reference_packages"].append(
          {"module": module, "distribution": dist, "error": f"{type(e).__name__}: {e}"})
  versions = {}
  # Every distribution the project imports (requirements-gpu.txt pins what a run records),
  # and the accelerator stack's.
  wanted = {d.lower().replace("_", "-") for _, d in PACKAGES + REFERENCE_PACKAGES}
  for dist in importlib.metadata.distributions():
    name = dist.metadata["Name"] or ""
    if name.lower().replace("_", "-") in wanted or name.lower().startswith(
        ("jax", "flax", "optax", "orbax", "ml-dtypes", "ml_dtypes", "numpy", "nvidia-",
         "torch")):
      versions[name] = dist.version
  out["versions"] = dict(sorted(versions.items()))
  out["env_vars"] = {k: os.environ.get(k) for k in ENV_VARS}
  out["jax_platforms_config"] = getattr(jax.config, "jax_platforms", None)
  devices = jax.devices()
  out["backend"] = jax.default_backend()
  out["devices"] = []
  for d in devices:
    stats = d.memory_stats() or {}
    out["devices"].append({"id": d.id, "platform": d.platform,
                           "device_kind": getattr(d, "device_kind", ""),
                           "bytes_limit": stats.get("bytes_limit"),
                           "bytes_in_use": stats.get("bytes_in_use")})
  out["bubblewrap"] = shutil.which("bwrap")
  smi = shutil.which("nvidia-smi") or shutil.which("rocm-smi")
  if smi:
    try:
      out["smi"] = subprocess.run([smi], capture_output=True, text=True, timeout=30).stdout[-4000:]
    except (OSError, subprocess.TimeoutExpired) as e:
      out["smi"] = f"{smi} failed: {e}"
  # The limits every later section states its figures against.
  sz = sizes()
  dtype = "bfloat16"
  out["matmul_peak_gflops"] = roofline.matmul_peak_gflops(sz["matmul_n"], dtype, repeats=10)
  out["matmul_peak_dtype_n"] = [dtype, sz["matmul_n"]]
  out["read_bandwidth_gbs"] = roofline.memory_bandwidth_gbs(sz["bandwidth_mb"], repeats=10)
  sheet = step_timing.data_sheet(getattr(devices[0], "device_kind", ""))
  out["data_sheet"] = None if sheet is None else {"bf16_tflops": sheet[0], "hbm_tbs": sheet[1]}
  checks = [_check("packages the project imports are installed", len(missing), "0 missing",
                   not missing, ", ".join(m["distribution"] for m in missing))]
  want_accel = not FLAGS.tiny
  checks.append(_check("JAX backend and device platforms", out["backend"],
                       "gpu / cuda / rocm" if want_accel else "cpu (--tiny)",
                       *check_backend(out["backend"], [d.platform for d in devices], want_accel)))
  out["checks"] = checks
  return out


def _loss_and_grads(graphdef, params, batch, chunk: int):
  """(loss, token log-probs, grads) of the RL trainer's loss on `batch` (one micro-batch)."""
  import jax

  from rstar_jax.rl import losses, train_step as ts

  def loss_fn(p):
    lp = ts.sequence_logprobs(graphdef, p, batch["input_ids"], batch["target_ids"],
                              batch["attention_mask"], chunk=chunk)
    norm = losses.LossNormalizer.from_mask(batch["loss_mask"])
    loss, _ = losses.ppo_loss(lp, batch["old_logp"], batch["advantages"], batch["loss_mask"],
                              config=losses.LossConfig(), normalizer=norm)
    return loss, lp
  (loss, lp), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
  return loss, lp, grads


def section_numerics(ctx: dict[str, Any]) -> dict[str, Any]:
  del ctx
  from flax import nnx
  import jax
  import jax.numpy as jnp
  import numpy as np

  from experiments.common import step_timing
  from rstar_jax.model import qwen3

  sz = sizes()
  cfg32 = slice_config(dtype="float32", remat_policy="none")
  cfg16 = slice_config(remat_policy="none")
  model = qwen3.create_model(cfg32, seed=0)
  graphdef32, params = nnx.split(model)
  graphdef16, _ = nnx.split(qwen3.abstract_model(cfg16))
  del model
  b, t = sz["numerics_batch"], sz["numerics_seq"]
  batch = step_timing.random_batch(cfg32.vocab_size, b, t, row_multiple=1, length_multiple=8)
  # Old log-probs near the policy's own (a ratio near 1, as in training): the fp32
  # policy's log-probs plus noise of 0.1 nats.
  rng = np.random.RandomState(1)
  tokens = jnp.asarray(batch["input_ids"])

  def logits_of(graphdef):
    return np.asarray(qwen3.forward_logits(nnx.merge(graphdef, params), tokens), np.float64)

  # The fp32 reference at the highest matmul precision: a GPU's default lets fp32 matmuls
  # run in TF32 (10-bit mantissa), which is not the reference bf16 is measured against.
  with jax.default_matmul_precision("highest"):
    l32 = logits_of(graphdef32)
  l16 = logits_of(graphdef16)
  rel_l2 = float(np.linalg.norm(l16 - l32) / np.linalg.norm(l32))
  argmax_agree = float(np.mean(l16.argmax(-1) == l32.argmax(-1)))
  with jax.default_matmul_precision("highest"):
    _, lp32, _ = _loss_and_grads(graphdef32, params, batch, sz["logprob_chunk"])
    batch = dict(batch,
                 old_logp=np.asarray(lp32) + 0.1 * rng.randn(*lp32.shape).astype(np.float32))
    loss32, lp32, g32 = _loss_and_grads(graphdef32, params, batch, sz["logprob_chunk"])
  loss16, lp16, g16 = _loss_and_grads(graphdef16, params, batch, sz["logprob_chunk"])
  mask = batch["loss_mask"] > 0
  lp_diff = float(np.abs(np.asarray(lp16) - np.asarray(lp32))[mask].mean())
  adv_scale = float(np.abs(batch["advantages"]).mean())
  loss_diff = abs(float(loss16) - float(loss32))
  flat32 = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(g32)])
  flat16 = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(g16)])
  n32, n16 = np.linalg.norm(flat32), np.linalg.norm(flat16)
  cosine = float(flat32 @ flat16 / (n32 * n16))
  norm_rel = float(abs(n16 - n32) / n32)
  t_ = TARGETS
  checks = [
      _check("logits rel. L2 error, bf16 vs fp32", rel_l2, f"<= {t_['logits_rel_l2_max']:g}",
             check_at_most(rel_l2, "logits_rel_l2_max")),
      _check("bf16 in use: logits rel. L2 vs fp32", rel_l2,
             f">= {t_['bf16_logits_rel_l2_min']:g}", *check_bf16_used(rel_l2)),
      _check("token log-prob mean |diff| (nats)", lp_diff,
             f"<= {t_['logprob_mean_abs_diff_max']:g}",
             check_at_most(lp_diff, "logprob_mean_abs_diff_max")),
      _check("GRPO-RoC loss |diff| / mean|advantage|", loss_diff / adv_scale,
             f"<= {t_['loss_diff_over_mean_adv_max']:g}",
             check_at_most(loss_diff / adv_scale, "loss_diff_over_mean_adv_max")),
      _check("gradient cosine similarity", cosine, f">= {t_['grad_cosine_min']:g}",
             check_at_least(cosine, "grad_cosine_min")),
      _check("gradient norm rel. diff", norm_rel, f"<= {t_['grad_norm_rel_diff_max']:g}",
             check_at_most(norm_rel, "grad_norm_rel_diff_max")),
  ]
  return {"batch": b, "seq": t, "num_params": cfg32.num_params, "fp32_matmul_precision": "highest",
          "logits_rel_l2": rel_l2,
          "logits_argmax_agreement": argmax_agree,
          "logits_max_abs_diff": float(np.abs(l16 - l32).max()),
          "logits_std": float(l32.std()), "logprob_mean_abs_diff": lp_diff,
          "loss_fp32": float(loss32), "loss_bf16": float(loss16), "loss_abs_diff": loss_diff,
          "advantage_mean_abs": adv_scale, "grad_norm_fp32": float(n32),
          "grad_norm_bf16": float(n16), "grad_cosine": cosine, "checks": checks}


def _peaks(ctx: dict[str, Any], n_dev: int) -> dict[str, float]:
  """GFLOP/s of the whole mesh: measured (env section) and the data sheet's."""
  env = ctx.get("env", {})
  peaks = {}
  if env.get("matmul_peak_gflops"):
    peaks["measured"] = env["matmul_peak_gflops"] * n_dev
  if env.get("data_sheet"):
    peaks["data_sheet"] = env["data_sheet"]["bf16_tflops"] * 1e3 * n_dev
  return peaks


def section_train_step(ctx: dict[str, Any]) -> dict[str, Any]:
  from experiments.common import roofline
  from experiments.common import step_timing
  from rstar_jax.train import step as core

  sz = sizes()
  mesh = _mesh()
  n_dev = mesh.devices.size
  peaks = _peaks(ctx, n_dev)
  # The 14B config's attention on this device ("auto": cuDNN's kernel on an NVIDIA GPU,
  # "chunked" elsewhere) gets the MFU target and the longer sequences.
  own = _own_attention()
  impls = list(FLAGS.attention_impls)
  if own not in impls:
    impls.insert(0, own)
  cases = [(impl, sz["train_seqs"][0]) for impl in impls]
  cases += [(own, s) for s in sz["train_seqs"][1:]]
  rows = core.batch_multiple(1, mesh)
  batch_n = max(sz["train_batch"], rows)
  def time_case(run: dict[str, Any], label: str, model_over: dict[str, Any],
                step_over: dict[str, Any] | None) -> dict[str, Any]:
    """One train-step case on the slice: `run` filled with its timing (or its error)."""
    t0 = time.perf_counter()
    try:
      cfg = slice_config(**model_over)
      batch = step_timing.random_batch(cfg.vocab_size, batch_n, run["seq"], row_multiple=rows,
                                       length_multiple=64 if not FLAGS.tiny else 8)
      timing = step_timing.time_train_step(cfg, mesh, batch=batch, steps=FLAGS.steps,
                                           logprob_chunk=sz["logprob_chunk"],
                                           compiled_text=True, step_overrides=step_over)
      run.update(step_timing.as_dict(timing, peaks), ok=True, peak_bytes=_peak_bytes())
      # MFU both ways, labelled: attention FLOPs in full (PaLM; `mfu`, `flops`) and the
      # causal half (MaxText).
      run["flops_causal_attention"] = roofline.train_flops(cfg, timing.batch, timing.seq,
                                                           causal=True)
      run["mfu_both"] = {k: roofline.mfu_both(cfg, timing.batch, timing.seq,
                                              timing.median_s, v)
                         for k, v in peaks.items()}
    except Exception as e:  # e.g. out of memory at 12288: the other cases still count
      run.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
    run["seconds"] = time.perf_counter() - t0
    print(f"train_step {label}: " + (
        f"{1e3 * run['median_s']:.1f} ms, MFU {run['mfu']}" if run["ok"] else run["error"][:300]),
        flush=True)
    return run

  runs = [time_case({"attention_impl": impl, "seq": seq, "batch": batch_n}, f"{impl} seq {seq}",
                    {"attention_impl": impl}, None) for impl, seq in cases]
  # The levers, one case each beside the base case (own attention, first sequence length,
  # the same batch), so a lever's time and loss are compared within one run.
  lever_runs = []
  for text in FLAGS.levers:
    where, field, value = parse_lever(text)
    lever_runs.append(time_case(
        {"lever": text, "attention_impl": own, "seq": sz["train_seqs"][0], "batch": batch_n},
        f"lever {text}",
        dict({"attention_impl": own}, **({field: value} if where == "model" else {})),
        {field: value} if where == "step" else None))
  by = {(r["attention_impl"], r["seq"]): r for r in runs if r["ok"]}
  seq0 = sz["train_seqs"][0]
  accel = _accelerator()
  checks = []
  main = by.get((own, seq0))
  mfu = main["mfu"].get("data_sheet") if main else None
  causal = (main["mfu_both"].get("data_sheet") or {}).get("causal_attention") if main else None
  checks.append(_check(f"MFU of the data sheet's bf16 peak, {own}, seq {seq0} "
                       "(attention FLOPs in full)", mfu,
                       f">= {TARGETS['mfu_data_sheet_min']:g}",
                       check_at_least(mfu, "mfu_data_sheet_min") if accel else None,
                       (f"causal-halved attention FLOPs (MaxText): {_fmt(causal)}" if accel
                        else "CPU: no data sheet peak")))
  dpa, blk = by.get(("dot_product", seq0)), by.get(("blockwise", seq0))
  target = f">= {TARGETS['dot_product_speedup_min']:g}, cuDNN fused attention in the HLO"
  name = "dot_product (cuDNN) speed / blockwise speed"
  if dpa and blk:
    speed = blk["median_s"] / dpa["median_s"]
    scale = max(abs(blk["loss"][0]), 1e-6)
    loss_rel = abs(dpa["loss"][0] - blk["loss"][0]) / scale
    met, detail = check_dot_product_attention(dpa["hlo_custom_calls"], speed)
    # On a CPU there is no cuDNN: the figure is reported, the target does not apply.
    checks.append(_check(name, speed, target, met if accel else None, detail))
    checks.append(_check("dot_product loss vs blockwise, rel. diff", loss_rel,
                         f"<= {TARGETS['attention_loss_rel_diff_max']:g}",
                         check_at_most(loss_rel, "attention_loss_rel_diff_max")))
  elif {"dot_product", "blockwise"} <= set(FLAGS.attention_impls):
    checks.append(_check(name, None, target, False, "a run failed"))
  else:   # not asked for (--attention_impls): nothing to compare
    checks.append(_check(name, None, target, None, "not both in --attention_impls"))
  failed = [f"{r['attention_impl']}@{r['seq']}" for r in runs if not r["ok"]]
  checks.append(_check("train-step cases that ran", len(runs) - len(failed), f"{len(runs)}",
                       not failed, ", ".join(failed)))
  base = by.get((own, seq0))
  for run in lever_runs:
    met, rel = check_lever(base["loss"][0] if base else None,
                           run["loss"][0] if run["ok"] else None)
    note = (run.get("error", "")[:300] if not run["ok"] else "the base case failed" if not base
            else f"step {1e3 * run['median_s']:.1f} ms vs {1e3 * base['median_s']:.1f} ms "
                 f"without it ({base['median_s'] / run['median_s']:.2f}x)"
                 + ("" if accel else "; CPU: timing only"))
    checks.append(_check(f"lever {run['lever']}: first loss vs the step without it, rel. diff",
                         rel, f"<= {TARGETS['lever_loss_rel_diff_max']:g}", met, note))
  return {"num_params": slice_config().num_params, "mesh": dict(mesh.shape), "peaks_gflops": peaks,
          "runs": runs, "lever_runs": lever_runs, "checks": checks}


def _own_attention() -> str:
  """The 14B config's attention_impl resolved on this device ("auto": "dot_product" on an
  NVIDIA GPU in bf16, "chunked" elsewhere)."""
  from experiments.configs import rstar2_agent_14b
  from rstar_jax.model import qwen3
  return qwen3.resolve_attention_impl(rstar2_agent_14b.get_config().model.attention_impl,
                                      "float32" if FLAGS.tiny else "bfloat16")


def padded_batch(vocab_size: int, rows: int, seq: int, seed: int = 0) -> dict[str, Any]:
  """[rows, seq] GRPO batch of random trajectories that do not fill their rows: row i
  holds seq * (3/4 - i / (8 rows)) tokens (a quarter prompt), the rest is padding
  (attention_mask 0), so the mask path of attention (the padding segment, 0) and of the
  loss runs. T is `seq` (a power of two: build_batch rounds the longest row up to it).
  One trajectory per row: the RL step's positions count from the row's start, so it
  packs no second sequence into a row (SFT does)."""
  import numpy as np

  from rstar_jax.rl import batching
  if seq & (seq - 1):
    raise ValueError(f"padded_batch: seq {seq} must be a power of two")
  rng = np.random.RandomState(seed)
  trajs = []
  for i in range(rows):
    n = max(4, int(seq * (0.75 - i / (8 * rows))))
    prompt = n // 4
    resp = n + 1 - prompt
    trajs.append(batching.TokenTrajectory(
        prompt_ids=rng.randint(0, vocab_size, prompt).tolist(),
        response_ids=rng.randint(0, vocab_size, resp).tolist(), response_mask=[1] * resp,
        response_logprobs=(-rng.rand(resp) * 2).tolist()))
  batch = batching.build_batch(trajs, rng.randn(rows).astype(np.float32), row_multiple=rows,
                               length_multiple=8, pow2_lengths=True)
  if batch["input_ids"].shape != (rows, seq):
    raise AssertionError(f"padded_batch: shape {batch['input_ids'].shape} != {(rows, seq)}")
  return batch


def segment_isolation_rel_l2(cfg, seq: int, *, seed: int = 0,
                             merge_segments: bool = False) -> float:
  """Relative L2 distance between the hidden states of three random sequences packed
  into one row of `seq` (segment ids 1, 2, 3, positions restarting at 0, the last
  eighth padding: the segment path of attention, as SFT packs rows) and the same
  sequences each alone in a row of its own (segment 1, then padding).
  merge_segments: test hook, the packed row as one segment (a planted fault)."""
  from flax import nnx
  import jax
  import jax.numpy as jnp
  import numpy as np

  from rstar_jax.model import qwen3
  model = qwen3.create_model(cfg, seed=seed)
  graphdef, state = nnx.split(model)
  del model

  @jax.jit
  def hidden_of(state, tokens, positions, segments):
    h, _ = nnx.merge(graphdef, state)(tokens, positions, segment_ids=segments)
    return h.astype(jnp.float32)

  rng = np.random.RandomState(seed)
  lens = [seq // 2, seq // 4, seq // 8]
  tokens = np.zeros((1, seq), np.int32)
  positions = np.zeros((1, seq), np.int32)
  segments = np.zeros((1, seq), np.int32)
  alone = np.zeros((3, seq), np.int32)
  alone_pos = np.tile(np.arange(seq, dtype=np.int32), (3, 1))
  alone_seg = np.zeros((3, seq), np.int32)
  start = 0
  spans = []
  for i, n in enumerate(lens):
    ids = rng.randint(0, cfg.vocab_size, n)
    tokens[0, start:start + n] = ids
    positions[0, start:start + n] = np.arange(n)
    segments[0, start:start + n] = 1 if merge_segments else i + 1
    alone[i, :n] = ids
    alone_seg[i, :n] = 1
    spans.append((start, n))
    start += n
  packed = np.asarray(hidden_of(state, tokens, positions, segments))
  single = np.asarray(hidden_of(state, alone, alone_pos, alone_seg))
  a = np.concatenate([packed[0, s:s + n] for s, n in spans]).astype(np.float64)
  b = np.concatenate([single[i, :n] for i, (_, n) in enumerate(spans)]).astype(np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def section_parts(ctx: dict[str, Any]) -> dict[str, Any]:
  """What a train step's parts cost, measured in one process: the step of L and of 2L
  layers on the same padded batch (per layer: the difference / L), the output head with
  the log-probs alone (forward + backward) and the optimizer update alone."""
  import gc

  from flax import nnx
  import jax
  import jax.numpy as jnp
  import optax

  from experiments.common import roofline
  from experiments.common import step_timing
  from rstar_jax import optim
  from rstar_jax.model import qwen3
  from rstar_jax.train import step as core

  sz = sizes()
  mesh = _mesh()
  peaks = _peaks(ctx, mesh.devices.size)
  own = _own_attention()
  seq = sz["train_seqs"][0]
  rows = core.batch_multiple(1, mesh)
  layers = slice_config().num_hidden_layers
  batch = padded_batch(slice_config().vocab_size, rows, seq)
  real = int(batch["attention_mask"].sum())
  out: dict[str, Any] = {"attention_impl": own, "rows": rows, "seq": seq,
                         "real_tokens": real, "pad_share": 1 - real / (rows * seq), "steps": {}}
  chunk = min(sz["logprob_chunk"], seq)
  for n in (layers, 2 * layers):
    cfg = slice_config(attention_impl=own, num_hidden_layers=n)
    timing = step_timing.time_train_step(cfg, mesh, batch=batch, steps=FLAGS.steps,
                                         logprob_chunk=chunk)
    out["steps"][str(n)] = {"median_s": timing.median_s, "step_s": timing.step_s,
                            "loss": timing.loss, "compile_s": timing.compile_s,
                            "flops": timing.flops, "flops_causal_attention":
                            roofline.train_flops(cfg, rows, seq, causal=True)}
    del timing
    gc.collect()
  t1, t2 = out["steps"][str(layers)], out["steps"][str(2 * layers)]
  per_layer = (t2["median_s"] - t1["median_s"]) / layers
  out["per_layer_s"] = per_layer
  out["rest_s"] = t1["median_s"] - layers * per_layer   # embedding, head, loss, optimizer
  out["per_layer_mfu"] = {}
  if per_layer > 0:
    for conv, key in (("full_attention", "flops"), ("causal_attention", "flops_causal_attention")):
      flops = (t2[key] - t1[key]) / layers
      out["per_layer_mfu"][conv] = {k: flops / per_layer / 1e9 / v for k, v in peaks.items()}
  # The head and the log-probs alone: the unembedding matmul, log-softmax and gather in
  # chunks, forward and backward, on random final hidden states.
  cfg = slice_config(attention_impl=own, num_hidden_layers=layers)
  model = qwen3.create_model(cfg, seed=0)
  graphdef, params = nnx.split(model)
  del model
  hidden = jax.random.normal(jax.random.PRNGKey(1), (rows, seq, cfg.hidden_size),
                             jnp.dtype(cfg.dtype))
  targets = jnp.asarray(batch["target_ids"])

  def head(p, h):
    return nnx.merge(graphdef, p).token_logprobs(h, targets, chunk=chunk).sum()
  head_grad = jax.jit(jax.value_and_grad(head, argnums=(0, 1)))
  out["head_logprobs_s"] = roofline._median_time(
      lambda: jax.block_until_ready(head_grad(params, hidden)), FLAGS.steps)
  # Dropped (not `del`: the timing lambda above closes over them) so the memory is freed.
  head_grad = hidden = None
  gc.collect()
  # The optimizer alone: the train step's AdamW update (with its clipping) of the L-layer
  # slice's parameters, state donated as in the step.
  tx = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-6, warmup_steps=0))
  holder = [params, tx.init(params)]
  grads = jax.tree.map(lambda x: jnp.full_like(x, 1e-3), params)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def update(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  def run_update():
    holder[0], holder[1] = update(holder[0], holder[1], grads)
    jax.block_until_ready(holder[0])
  out["optimizer_s"] = roofline._median_time(run_update, FLAGS.steps)
  holder = grads = params = None   # freed before the next part (the closures keep the names)
  jax.clear_caches()
  gc.collect()
  # Packed rows: the segment path of the 14B config's attention on this device.
  seg_cfg = slice_config(attention_impl=own, num_hidden_layers=layers, remat_policy="none")
  out["segment_isolation_rel_l2"] = segment_isolation_rel_l2(seg_cfg, seq)
  out["checks"] = [_check(
      f"packed rows, {own}: hidden states of 3 packed sequences vs each alone, rel. L2",
      out["segment_isolation_rel_l2"], f"<= {TARGETS['segment_isolation_rel_l2_max']:g}",
      *check_segment_isolation(out["segment_isolation_rel_l2"])), _check(
      "per-layer step cost, (2L step - L step) / L", per_layer, "> 0",
      (per_layer > 0) if _accelerator() else None,
      f"L = {layers}; head + log-probs {out['head_logprobs_s']:.4g} s, optimizer "
      f"{out['optimizer_s']:.4g} s, rest of the L step {out['rest_s']:.4g} s; "
      f"{out['pad_share']:.0%} padding" + ("" if _accelerator() else "; CPU: timing only"))]
  return out


def section_memory(ctx: dict[str, Any]) -> dict[str, Any]:
  del ctx
  import jax

  from experiments import plan_memory as pm
  from experiments.common import step_timing
  from rstar_jax.train import step as core

  sz = sizes()
  mesh = _mesh()
  cfg = slice_config()
  seq = sz["train_seqs"][0]
  rows = core.batch_multiple(1, mesh)
  case = pm.PlanCase(preset="tiny" if FLAGS.tiny else "qwen3-14b",
                     num_hidden_layers=None if FLAGS.tiny else FLAGS.layers,
                     mesh=(("fsdp", mesh.devices.size),), seq_len=seq, micro_batch=1,
                     micro_batches=1, remat_policy=cfg.remat_policy,
                     attention_impl=cfg.attention_impl, attention_chunk=cfg.attention_chunk,
                     param_dtype=cfg.param_dtype, dtype=cfg.dtype,
                     logprob_chunk=sz["logprob_chunk"], compute_entropy=True)
  assert case.model_config() == cfg, (case.model_config(), cfg)
  out: dict[str, Any] = {"case": {k: v for k, v in vars(case).items()}}
  # The plan for this device (its own compiler) and the one a CPU host makes.
  plans = {}
  for name, devices, options in (("this_device", jax.devices(), None),
                                 ("cpu_host", jax.devices("cpu"), pm.FAST_COMPILE_OPTIONS)):
    try:
      est = pm.plan(case, devices=devices, compiler_options=options)
      plans[name] = {"peak_bytes": est.peak_bytes, "temp_bytes": est.temp_bytes,
                     "argument_bytes": est.argument_bytes, "state_bytes": est.state_bytes,
                     "compile_s": est.compile_seconds}
    except Exception as e:
      plans[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
  out["plans"] = plans
  batch = step_timing.random_batch(cfg.vocab_size, rows, seq, row_multiple=rows,
                                   length_multiple=64 if not FLAGS.tiny else 8)
  timing = step_timing.time_train_step(cfg, mesh, batch=batch, steps=1,
                                       logprob_chunk=sz["logprob_chunk"])
  measured = _peak_bytes()
  out.update(measured_peak_bytes=measured, step_s=timing.median_s)
  for name in ("this_device", "cpu_host"):
    planned = plans[name].get("peak_bytes")
    out[f"measured_over_plan_{name}"] = measured / planned if measured and planned else None
  # The check: the measured peak against the CPU host's plan, the one the 14B memory
  # figures come from (experiments/plan_memory.py on fake CPU devices). The plan for this
  # device is reported beside it, not checked: it is the compiled program's own memory
  # analysis, which the allocator's peak matches by construction (1.0000002 on the H100).
  cpu = plans["cpu_host"]
  met, detail = check_memory_vs_plan(measured, cpu.get("peak_bytes"), cpu.get("error", ""))
  tol = TARGETS["memory_plan_rel_max"]
  out["checks"] = [_check("measured peak / CPU-host AOT plan", out["measured_over_plan_cpu_host"],
                          f"within {1 - tol:.2f}..{1 + tol:.2f}", met, detail)]
  return out


class PlainThinking:
  """The engine a scripted rollout thinks with (`ToolCallingEngine`), less the markup: a
  thinking turn's random tokens that would spell a protocol tag (any token with '<' or
  '>' in its text, and the tokenizer's special tokens) become a plain token, so the
  turn's text is thinking and then exactly one scripted call. A random model samples
  the tags as ordinary tokens, and a turn holding one parsed as a malformed call that
  never reached the sandbox. Other turns pass through unchanged."""

  def __init__(self, inner, tokenizer):
    self.inner = inner
    vocab = tokenizer.vocab_size
    special = set(getattr(tokenizer, "special_ids", None) or ())
    texts = {i: tokenizer.decode([i]) for i in range(vocab)}
    self.banned = {i for i, t in texts.items() if "<" in t or ">" in t or i in special}
    self.filler = next(i for i, t in texts.items()
                       if i not in self.banned and t.strip().isalpha())
    self.replaced = 0

  async def generate(self, request):
    out = await self.inner.generate(request)
    if request.stop_token_ids:   # not a thinking turn (those sample with no stop ids)
      return out
    ids = [self.filler if i in self.banned else i for i in out.output_ids]
    self.replaced += sum(a != b for a, b in zip(ids, out.output_ids))
    return dataclasses.replace(out, output_ids=ids)

  def __getattr__(self, name):
    return getattr(self.inner, name)


def section_rollouts(ctx: dict[str, Any]) -> dict[str, Any]:
  import asyncio

  import jax
  import numpy as np

  from experiments.common.scripted_rollouts import TimedTools, ToolCallingEngine
  from rstar_jax.data import toy_task
  from rstar_jax.model import model_config, qwen3
  from rstar_jax.rollout import chat
  from rstar_jax.rollout.agent_loop import AgentConfig, run_many
  from rstar_jax.rollout.jax_engine import EngineConfig, GenerationRequest, JaxEngine
  from rstar_jax.rollout.scheduler import EnginePool
  from rstar_jax.rollout.sandbox_client import SandboxTools
  from sandbox.launcher import running_server

  sz = sizes()
  env = ctx.get("env", {})
  out: dict[str, Any] = {}
  # (1) prefill and decode of the slice at `slots` slots, weights in bf16 as a rollout
  # server holds them (a decode step reads every weight once: bytes set its time).
  cfg = slice_config(param_dtype="bfloat16", remat_policy="none")
  model = qwen3.create_model(cfg, seed=0)
  slots, p, n = sz["slots"], sz["prompt"], sz["new_tokens"]
  max_len = 1 << (p + n).bit_length()
  ecfg = EngineConfig(num_slots=slots, max_len=max_len, prefill_batch_tokens=slots * p)
  engine = JaxEngine(model, ecfg)
  rng = np.random.RandomState(0)

  def generate(seed):
    reqs = [GenerationRequest(input_ids=rng.randint(0, cfg.vocab_size, p).tolist(),
                              max_new_tokens=n, temperature=1.0, top_p=1.0, top_k=0,
                              seed=seed * 1000 + i) for i in range(slots)]
    before = dict(engine.metrics)
    t = time.perf_counter()
    outs = engine.generate_sync(reqs)
    wall = time.perf_counter() - t
    if sum(len(o.output_ids) for o in outs) != slots * n:
      raise RuntimeError("the engine returned fewer tokens than asked for")
    return wall, {k: engine.metrics[k] - before.get(k, 0) for k in engine.metrics}

  first_wall, _ = generate(0)   # compiles the prefill and decode shapes
  wall, m = generate(1)
  engine.stop()
  decode_step_s = m["decode_s"] / max(m["decode_steps"], 1)
  # Fewest bytes a decode step must read: every weight once (bf16) and the k/v of the
  # filled positions (prompt + half the new tokens on average), across every slot.
  weight_bytes = cfg.num_params * 2 - cfg.vocab_size * cfg.hidden_size * 2  # no embed table
  kv_bytes = (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
              * slots * (p + n // 2))
  step_bytes = weight_bytes + kv_bytes
  bw = env.get("read_bandwidth_gbs")
  roofline_s = step_bytes / (bw * 1e9) if bw else None
  sheet = env.get("data_sheet")
  sheet_s = step_bytes / (sheet["hbm_tbs"] * 1e12) if sheet else None
  out["engine"] = {
      "slots": slots, "prompt": p, "new_tokens": n, "max_len": max_len,
      "num_params": cfg.num_params, "first_run_s": first_wall, "wall_s": wall,
      "prefill_s": m["prefill_s"], "prefill_calls": m["prefill_calls"],
      "prefill_tokens_per_s": slots * p / m["prefill_s"] if m["prefill_s"] else None,
      "decode_s": m["decode_s"], "decode_steps": m["decode_steps"],
      "decode_step_s": decode_step_s, "decode_tokens_per_s": slots / decode_step_s,
      "decode_step_bytes": step_bytes, "read_bandwidth_gbs": bw,
      "roofline_step_s": roofline_s, "roofline_fraction": roofline_s / decode_step_s
      if roofline_s else None,
      "data_sheet_roofline_fraction": sheet_s / decode_step_s if sheet_s else None}
  del engine, model
  checks = []
  frac = out["engine"]["roofline_fraction"]
  checks.append(_check("decode step / HBM roofline (measured bandwidth)", frac,
                       f">= {TARGETS['decode_roofline_min']:g}",
                       check_at_least(frac, "decode_roofline_min") if _accelerator() else None,
                       "" if _accelerator() else "CPU"))
  # (2) multi-turn rollouts through the agent loop, the sandbox and the tool protocol.
  tok = toy_task.train_toy_tokenizer(1024)
  proto = chat.ChatProtocol(tok, toy_task.toy_chat_config())
  small = model_config.get_preset("tiny" if FLAGS.tiny else "small", vocab_size=tok.vocab_size,
                                  dtype="bfloat16")
  engine = JaxEngine(qwen3.create_model(small, seed=1), EngineConfig(num_slots=16, max_len=512))
  k = sz["trajectories"]
  problems = toy_task.generate_problems(k, seed=3)
  uids = [f"p{i}" for i in range(k)]
  calls = {u: tok.encode(chat.assistant_text({"content": "", "tool_calls": [{
      "name": toy_task.TOY_TOOL_NAME, "arguments": {"code": pr.code}}]}))
           for u, pr in zip(uids, problems)}
  calls_per_traj = 2
  thinking = PlainThinking(EnginePool([engine]), tok)
  scripted = ToolCallingEngine(thinking, calls,
                               calls_per_traj=calls_per_traj,
                               think_tokens=sz["think_tokens"], vocab_size=small.vocab_size)
  weak = shutil.which("bwrap") is None
  try:
    with running_server(max_children=4, pool_size=2, allow_weak_isolation=weak) as url:
      tools = TimedTools(SandboxTools(url, timeout_s=30.0))

      async def go():
        try:
          return await run_many(scripted, tools, proto, list(zip(uids, (pr.problem for pr in problems))),
                                AgentConfig(max_turns=4, max_response_tokens=256),
                                seeds=list(range(k)))
        finally:
          await tools.inner.aclose()
      t = time.perf_counter()
      trajs = asyncio.run(go())
      wall = time.perf_counter() - t
  finally:
    engine.stop()
  n_calls = sum(tr.num_tool_calls for tr in trajs)
  n_err = sum(tr.num_tool_errors for tr in trajs)
  statuses = collections.Counter()
  for tr in trajs:
    statuses.update(tr.tool_statuses)
  # Every trajectory's first two calls are scripted (its problem's code: they must
  # run); the random model may write more calls of its own in its free last turn,
  # which may well fail, so only the scripted ones are checked.
  scripted_code = {pr.code for pr in problems}
  scripted = [(c, r) for c, r in tools.records if c.code in scripted_code]
  failed = [(c, r) for c, r in scripted if r.get("status") != "ok"]
  out["agent"] = {"trajectories": len(trajs), "tool_calls": n_calls, "tool_errors": n_err,
                  "tool_statuses": dict(statuses), "scripted_calls": len(scripted),
                  "scripted_failed": len(failed),
                  "think_tokens_replaced": thinking.replaced,
                  # what the sandbox said for the first few failed scripted calls
                  "scripted_failures": [{k: str(v)[:400] for k, v in r.items()}
                                        for _, r in failed[:4]],
                  "wall_s": wall, "weak_isolation": weak,
                  "tool_latency_ms_median": float(np.median(tools.latencies) * 1e3)
                  if tools.latencies else None,
                  "finish_reasons": sorted({tr.finish_reason for tr in trajs})}
  # Every scripted call must reach the sandbox and run: the thinking before it cannot
  # spell the protocol's tags (PlainThinking), which made 5 of 35 calls on the H100
  # (2026-11-27) parse as malformed calls.
  expected = calls_per_traj * k
  checks.append(_check("scripted tool calls that reached the sandbox and ran ok",
                       f"{len(scripted) - len(failed)} of {expected}",
                       "all reach the sandbox, all status ok",
                       *check_scripted_calls(expected, len(scripted), len(scripted) - len(failed))))
  if weak:
    checks[-1]["note"] += "; sandbox with --allow-weak-isolation (no bubblewrap)"
  out["checks"] = checks
  jax.clear_caches()
  return out


def transformers_logits(export_dir: str, tokens) -> Any:
  """Logits of `tokens` [B, T] from the HF export as transformers reads it
  (Qwen3ForCausalLM, torch fp32 on the CPU: the reference does not depend on the
  accelerator)."""
  import numpy as np
  import torch
  import transformers
  hf = transformers.AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
  with torch.no_grad():
    return hf(torch.tensor(np.asarray(tokens))).logits.float().numpy()


def section_hf_io(ctx: dict[str, Any]) -> dict[str, Any]:
  del ctx
  from flax import nnx
  import jax
  import jax.numpy as jnp
  import numpy as np

  from rstar_jax.model import hf_io, qwen3

  cfg = slice_config(remat_policy="none")
  model = qwen3.create_model(cfg, seed=0)
  where = tempfile.mkdtemp(prefix="device_check_hf_", dir=_scratch())
  out: dict[str, Any] = {}
  try:
    t = time.perf_counter()
    hf_io.save_hf(model, where, dtype="bfloat16")
    save_s = time.perf_counter() - t
    nbytes = sum(os.path.getsize(os.path.join(where, f)) for f in os.listdir(where)
                 if f.endswith(".safetensors"))
    t = time.perf_counter()
    # fp32 compute: the loaded model is also the logits' side of the transformers check.
    loaded = hf_io.load_hf(where, mesh=_mesh(), param_dtype="float32", dtype="float32")
    jax.block_until_ready(nnx.split(loaded)[1])
    load_s = time.perf_counter() - t
    # The loaded weights are the exported ones: the originals rounded to bf16.
    import ml_dtypes
    a = nnx.split(model)[1]
    b = nnx.split(loaded)[1]
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      ref = np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32)
      worst = max(worst, float(np.abs(ref - np.asarray(y, np.float32)).max()))
    del model, a
    # The export read by transformers: its logits against ours on the same tokens.
    tokens = np.random.RandomState(2).randint(0, cfg.vocab_size, (2, 16))
    with jax.default_matmul_precision("highest"):
      ours = np.asarray(qwen3.forward_logits(loaded, jnp.asarray(tokens)), np.float64)
    hf_rel, hf_error = None, ""
    t = time.perf_counter()
    try:
      theirs = transformers_logits(where, tokens).astype(np.float64)
      hf_rel = float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))
      out["hf_logits_max_abs_diff"] = float(np.abs(ours - theirs).max())
    except Exception as e:   # transformers or torch missing, or a load that fails
      hf_error = f"{type(e).__name__}: {e}"[:2000]
    out["transformers_s"] = time.perf_counter() - t
  finally:
    shutil.rmtree(where, ignore_errors=True)
  out.update({"bytes": nbytes, "save_s": save_s, "load_s": load_s,
              "save_gbs": nbytes / save_s / 1e9, "load_gbs": nbytes / load_s / 1e9,
              "max_abs_diff_vs_bf16_rounded": worst, "hf_logits_rel_l2": hf_rel,
              "hf_error": hf_error})
  out["checks"] = [
      _check("loaded weights == exported (bf16-rounded) weights", worst, "== 0", worst == 0.0),
      _check("transformers logits of the export vs ours, rel. L2", hf_rel,
             f"<= {TARGETS['hf_logits_rel_l2_max']:g}", *check_hf_logits(hf_rel, hf_error))]
  return out


def section_recipe(ctx: dict[str, Any]) -> dict[str, Any]:
  del ctx
  workdir = tempfile.mkdtemp(prefix="device_check_recipe_", dir=_scratch())
  env = dict(os.environ)
  weak = shutil.which("bwrap") is None
  if weak:
    env["SANDBOX_ALLOW_WEAK_ISOLATION"] = "1"
    print("recipe: bubblewrap is missing: the sandbox runs with --allow-weak-isolation "
          "(rlimits only, no namespaces)", flush=True)
  cmd = [sys.executable, "-m", "experiments.recipe",
         "--config=experiments/configs/toy.py:smoke", f"--config.workdir={workdir}",
         *RECIPE_EVAL_OVERRIDES, *FLAGS.recipe_overrides]
  t = time.perf_counter()
  run = subprocess.run(cmd, cwd=_repo(), env=env, capture_output=True, text=True)
  wall = time.perf_counter() - t
  out: dict[str, Any] = {"command": " ".join(cmd[1:]), "returncode": run.returncode,
                         "wall_s": wall, "weak_isolation": weak}
  final = os.path.join(workdir, "eval_final.json")
  if os.path.exists(final):
    with open(final) as f:
      report = json.load(f)
    out["eval_final"] = {k: v for k, v in report.items() if not isinstance(v, (list, dict))}
  done = os.path.join(workdir, "stage1", "DONE.json")
  if os.path.exists(done):
    with open(done) as f:
      out["rl_stage1"] = json.load(f)
  if run.returncode != 0:
    out["output_tail"] = (run.stdout[-2000:] + "\n" + run.stderr[-3000:])
  shutil.rmtree(workdir, ignore_errors=True)
  out["checks"] = [_check("toy recipe (smoke) exits 0", run.returncode, "0",
                          run.returncode == 0, "weak isolation" if weak else "")]
  out["checks"] += [_check(*c) for c in check_recipe_learned(out.get("eval_final"),
                                                             out.get("rl_stage1"))]
  return out


SECTION_FNS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "env": section_env, "numerics": section_numerics, "train_step": section_train_step,
    "parts": section_parts, "memory": section_memory, "rollouts": section_rollouts,
    "hf_io": section_hf_io, "recipe": section_recipe}
assert tuple(SECTION_FNS) == SECTIONS


# --- driver --------------------------------------------------------------------------------


def _repo() -> str:
  return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_SCRATCH: list[str] = []


def _scratch() -> str:
  """--scratch, or a temporary directory made once per driver (its children get it)."""
  if FLAGS.scratch:
    os.makedirs(FLAGS.scratch, exist_ok=True)
    return FLAGS.scratch
  if not _SCRATCH:
    _SCRATCH.append(tempfile.mkdtemp(prefix="device_check_"))
  return _SCRATCH[0]


def _commit() -> str | None:
  try:
    run = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_repo(),
                         capture_output=True, text=True, timeout=10)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           cwd=_repo(), capture_output=True, text=True, timeout=10).stdout
    return run.stdout.strip() + ("+dirty" if dirty.strip() else "") if run.returncode == 0 else None
  except (OSError, subprocess.TimeoutExpired):
    return None


def _run_one_section(name: str) -> None:
  """Child process: runs section `name`, writes its JSON (figures or the error)."""
  ctx = {}
  if FLAGS.context and os.path.exists(FLAGS.context):
    with open(FLAGS.context) as f:
      ctx = json.load(f)
  from rstar_jax import compile_cache
  if FLAGS.xla_cache:
    compile_cache.enable(FLAGS.xla_cache)
  t = time.perf_counter()
  try:
    if FLAGS.inject_failure == name:
      raise RuntimeError(f"failure injected into section {name!r} (--inject_failure)")
    if FLAGS.inject_failure == f"crash:{name}":   # a process that dies without a word
      os._exit(3)
    result = {"ok": True, **SECTION_FNS[name](ctx)}
  except Exception as e:
    result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:4000],
              "traceback": traceback.format_exc()[-6000:]}
  result["seconds"] = time.perf_counter() - t
  with open(FLAGS.section_result, "w") as f:
    json.dump(result, f, indent=1, default=_json_default)


def _json_default(x):
  try:
    return float(x)
  except (TypeError, ValueError):
    return str(x)


def _forwarded_flags() -> list[str]:
  names = ("tiny", "layers", "seq_lens", "attention_impls", "levers", "steps", "slots",
           "recipe_overrides", "inject_failure", "xla_cache")
  args = []
  for name in names:
    value = FLAGS[name].value
    if isinstance(value, bool):
      args.append(f"--{name}" if value else f"--no{name}")
    elif isinstance(value, list):
      args.append(f"--{name}={','.join(value)}")
    else:
      args.append(f"--{name}={value}")
  return args + [f"--scratch={_scratch()}"]


def run_check() -> dict[str, Any]:
  unknown = [s for s in FLAGS.sections if s not in SECTIONS]
  if unknown:
    raise app.UsageError(f"--sections: unknown {unknown}; known: {list(SECTIONS)}")
  os.makedirs(FLAGS.out, exist_ok=True)
  started = time.perf_counter()
  report: dict[str, Any] = {
      "schema": 1, "benchmark": "device_check",
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "commit": _commit(), "command": " ".join(["python -m experiments.device_check"]
                                               + sys.argv[1:]),
      "tiny": FLAGS.tiny, "load_average": list(os.getloadavg()), "sections": {}}
  budget = FLAGS.budget_s if FLAGS.budget_s is not None else (1e9 if FLAGS.tiny else 560.0)
  context_path = os.path.join(_scratch(), "context.json")
  for name in SECTIONS:
    if name not in FLAGS.sections:
      continue
    left = budget - (time.perf_counter() - started)
    if left <= 5:
      report["sections"][name] = {"ok": False, "skipped": True, "seconds": None,
                                  "wall_s": 0.0,
                                  "error": f"not started: --budget_s {budget:g} spent"}
      continue
    # On a CPU (--tiny) a loaded 2-core host may run several times slower than a quiet
    # one: the limits only catch hangs there.
    limit = min(SECTION_LIMIT_S[name] * (4 if FLAGS.tiny else 1), left)
    result_path = os.path.join(_scratch(), f"section_{name}.json")
    if os.path.exists(result_path):
      os.remove(result_path)
    with open(context_path, "w") as f:
      json.dump({k: v for k, v in report["sections"].items()}, f, default=_json_default)
    cmd = [sys.executable, "-m", "experiments.device_check", f"--run_section={name}",
           f"--section_result={result_path}", f"--context={context_path}",
           *_forwarded_flags()]
    print(f"[device_check] {name}: started (limit {limit:.0f} s)", flush=True)
    t = time.perf_counter()
    try:
      run = subprocess.run(cmd, cwd=_repo(), capture_output=True, text=True, timeout=limit)
      rc, stdout, stderr = run.returncode, run.stdout, run.stderr
    except subprocess.TimeoutExpired as e:
      rc = None
      stdout = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
      stderr = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
    wall = time.perf_counter() - t
    if os.path.exists(result_path):
      with open(result_path) as f:
        result = json.load(f)
    else:   # killed by its limit, a crash (segfault, OOM kill) or a failed import
      why = (f"timed out after {limit:.0f} s" if rc is None
             else f"the section's process exited {rc} without a result")
      result = {"ok": False, "error": why, "seconds": None}
    result["wall_s"] = wall
    if not result["ok"]:
      result["output_tail"] = (stdout[-1500:] + "\n" + stderr[-3000:]).strip()
    report["sections"][name] = result
    print(f"[device_check] {name}: {'ok' if result['ok'] else 'FAILED: ' + result['error'][:300]}"
          f" ({wall:.0f} s)", flush=True)
    if FLAGS.out:   # what has run so far survives a kill of the whole check
      _write_json(report, partial=True)
  report["total_s"] = time.perf_counter() - started
  report["checks"] = [dict(c, section=name) for name, r in report["sections"].items()
                      for c in r.get("checks", [])]
  report["failed_sections"] = [n for n, r in report["sections"].items() if not r["ok"]]
  env = report["sections"].get("env", {})
  report["device"] = (env.get("devices") or [{}])[0].get("device_kind") if env.get("ok") else None
  return report


def _write_json(report: dict[str, Any], *, partial: bool) -> None:
  """Writes OUT/device_check.json atomically; `partial` marks a report still running."""
  path = os.path.join(FLAGS.out, "device_check.json")
  with open(path + ".tmp", "w") as f:
    json.dump(dict(report, partial=partial), f, indent=1, default=_json_default)
  os.replace(path + ".tmp", path)


def _fmt(v) -> str:
  if v is None:
    return "n/a"
  if isinstance(v, bool):
    return str(v)
  if isinstance(v, float):
    return f"{v:.4g}"
  return str(v)


def markdown(report: dict[str, Any]) -> str:
  """The report as a markdown table of sections and targets."""
  lines = [f"# Device check, {report['date']}",
           "", f"- device: {report.get('device')}; commit {report.get('commit')}; "
           f"{'--tiny (CPU sizes)' if report['tiny'] else 'full sizes'}; total "
           f"{report['total_s']:.0f} s", f"- command: `{report['command']}`", "",
           "| section | ok | seconds | error |", "|---|---|---|---|"]
  for name, r in report["sections"].items():
    err = (r.get("error") or "").splitlines()[0][:160] if not r["ok"] else ""
    lines.append(f"| {name} | {'yes' if r['ok'] else 'NO'} | {r.get('wall_s', 0):.0f} | "
                 f"{err.replace('|', '/')} |")
  lines += ["", "| section | check | value | target | met | note |", "|---|---|---|---|---|---|"]
  for c in report["checks"]:
    met = {True: "met", False: "MISSED", None: "n/a"}[c["met"]]
    lines.append(f"| {c['section']} | {c['name']} | {_fmt(c['value'])} | {c['target']} | "
                 f"{met} | {c['note']} |")
  ts = report["sections"].get("train_step", {})
  if ts.get("runs"):
    lines += ["", "MFU: attention FLOPs in full (PaLM) / causal half (MaxText).", "",
              "| attention | seq | step ms | tokens/s | MFU (measured peak) | "
              "MFU (data sheet) | kernels |", "|---|---|---|---|---|---|---|"]
    for r in ts["runs"]:
      if r["ok"]:
        kernels = ", ".join(c for c in r["hlo_custom_calls"] if "cudnn" in c.lower()
                            or "triton" in c.lower()) or "-"
        both = r.get("mfu_both", {})
        mfu = {k: f"{_fmt(r['mfu'].get(k))} / "
                  f"{_fmt((both.get(k) or {}).get('causal_attention'))}"
               for k in ("measured", "data_sheet")}
        lines.append(f"| {r['attention_impl']} | {r['seq']} | {1e3 * r['median_s']:.1f} | "
                     f"{r['tokens_per_s']:,.0f} | {mfu['measured']} | "
                     f"{mfu['data_sheet']} | {kernels} |")
      else:
        lines.append(f"| {r['attention_impl']} | {r['seq']} | failed: "
                     f"{r['error'].splitlines()[0][:120]} | | | | |")
  parts = report["sections"].get("parts", {})
  if parts.get("ok"):
    steps = ", ".join(f"{n} layers {1e3 * v['median_s']:.1f} ms"
                      for n, v in parts["steps"].items())
    lines += ["", f"- parts ({parts['attention_impl']}, {parts['rows']} x {parts['seq']}, "
              f"{parts['pad_share']:.0%} padding, one process): {steps}; per layer "
              f"{1e3 * parts['per_layer_s']:.2f} ms; head + log-probs "
              f"{1e3 * parts['head_logprobs_s']:.2f} ms; optimizer "
              f"{1e3 * parts['optimizer_s']:.2f} ms"]
  return "\n".join(lines) + "\n"


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if FLAGS.run_section:
    _run_one_section(FLAGS.run_section)
    return
  if not FLAGS.out:
    raise app.UsageError("--out DIR is required")
  for text in FLAGS.levers:   # refused now, not after the sections before train_step ran
    try:
      parse_lever(text)
    except ValueError as e:
      raise app.UsageError(str(e)) from None
  scratch_given = bool(FLAGS.scratch)
  try:
    report = run_check()
  finally:
    if not scratch_given:
      shutil.rmtree(_scratch(), ignore_errors=True)
  _write_json(report, partial=False)
  text = markdown(report)
  with open(os.path.join(FLAGS.out, "device_check.md"), "w") as f:
    f.write(text)
  print(text)
  print(f"written: {os.path.join(FLAGS.out, 'device_check.json')} and device_check.md")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
