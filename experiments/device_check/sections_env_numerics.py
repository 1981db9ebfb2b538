"""The device check's env and numerics sections: the host (devices, packages, versions,
XLA flags, JAX's backend, the bf16 matmul peak and HBM bandwidth measured here) and the
slice in bf16 against the same weights in fp32 (logits, log-probs, loss, gradient)."""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from typing import Any

from absl import flags

from experiments.device_check.checks import (TARGETS, check_at_least, check_at_most,
                                             check_backend, check_bf16_used, check_row)
from experiments.device_check.workload import sizes, slice_config

FLAGS = flags.FLAGS

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
            "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR", "JAX_PLATFORMS",
            "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "NCCL_DEBUG",
            "TF_CPP_MIN_LOG_LEVEL")
# Packages that only the checks' references need (transformers reads the HF export back).
REFERENCE_PACKAGES = (("transformers", "transformers"), ("torch", "torch"))


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
  checks = [check_row("packages the project imports are installed", len(missing), "0 missing",
                      not missing, ", ".join(m["distribution"] for m in missing))]
  want_accel = not FLAGS.tiny
  platforms = [d.platform for d in devices]
  checks.append(check_row("JAX backend and device platforms", out["backend"],
                          "gpu / cuda / rocm" if want_accel else "cpu (--tiny)",
                          *check_backend(out["backend"], platforms, want_accel)))
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
      check_row("logits rel. L2 error, bf16 vs fp32", rel_l2, f"<= {t_['logits_rel_l2_max']:g}",
                check_at_most(rel_l2, "logits_rel_l2_max")),
      check_row("bf16 in use: logits rel. L2 vs fp32", rel_l2,
                f">= {t_['bf16_logits_rel_l2_min']:g}", *check_bf16_used(rel_l2)),
      check_row("token log-prob mean |diff| (nats)", lp_diff,
                f"<= {t_['logprob_mean_abs_diff_max']:g}",
                check_at_most(lp_diff, "logprob_mean_abs_diff_max")),
      check_row("GRPO-RoC loss |diff| / mean|advantage|", loss_diff / adv_scale,
                f"<= {t_['loss_diff_over_mean_adv_max']:g}",
                check_at_most(loss_diff / adv_scale, "loss_diff_over_mean_adv_max")),
      check_row("gradient cosine similarity", cosine, f">= {t_['grad_cosine_min']:g}",
                check_at_least(cosine, "grad_cosine_min")),
      check_row("gradient norm rel. diff", norm_rel, f"<= {t_['grad_norm_rel_diff_max']:g}",
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
