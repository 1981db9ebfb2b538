"""The device check's hf_io and recipe sections: the slice's Hugging Face export and load
(the export read back by transformers, its logits against ours) and the toy recipe's
`smoke` variant end to end on this device (it must show that it learned)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from absl import flags

from experiments.device_check.checks import (TARGETS, check_hf_logits, check_recipe_learned,
                                             check_row)
from experiments.device_check.workload import (make_mesh, repo_root, scratch_dir,
                                               slice_config)

FLAGS = flags.FLAGS

# The toy recipe's evaluation in the recipe section (before --recipe_overrides): 64
# problems x 2 samples, so that a learned ~5% pass@1 shows (the smoke variant's own 4
# problems x 2 gave 0 of 8 on the CPU and on the H100).
RECIPE_EVAL_OVERRIDES = ("--config.data.toy.eval_problems=64", "--config.eval.k=2")


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
  where = tempfile.mkdtemp(prefix="device_check_hf_", dir=scratch_dir())
  out: dict[str, Any] = {}
  try:
    t = time.perf_counter()
    hf_io.save_hf(model, where, dtype="bfloat16")
    save_s = time.perf_counter() - t
    nbytes = sum(os.path.getsize(os.path.join(where, f)) for f in os.listdir(where)
                 if f.endswith(".safetensors"))
    t = time.perf_counter()
    # fp32 compute: the loaded model is also the logits' side of the transformers check.
    loaded = hf_io.load_hf(where, mesh=make_mesh(), param_dtype="float32", dtype="float32")
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
      check_row("loaded weights == exported (bf16-rounded) weights", worst, "== 0", worst == 0.0),
      check_row("transformers logits of the export vs ours, rel. L2", hf_rel,
                f"<= {TARGETS['hf_logits_rel_l2_max']:g}", *check_hf_logits(hf_rel, hf_error))]
  return out


def section_recipe(ctx: dict[str, Any]) -> dict[str, Any]:
  del ctx
  workdir = tempfile.mkdtemp(prefix="device_check_recipe_", dir=scratch_dir())
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
  run = subprocess.run(cmd, cwd=repo_root(), env=env, capture_output=True, text=True)
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
  out["checks"] = [check_row("toy recipe (smoke) exits 0", run.returncode, "0",
                             run.returncode == 0, "weak isolation" if weak else "")]
  out["checks"] += [check_row(*c) for c in check_recipe_learned(out.get("eval_final"),
                                                             out.get("rl_stage1"))]
  return out
