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

Targets: the TARGETS table in `experiments/device_check/checks.py`, one place; each
check is a pure function of its figures (`check_*` there), so tests plant faults in
them. A target that does not apply here (a GPU target on a CPU) reads n/a, never met.

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

The package (experiments/device_check/): `checks` the targets and the pure checks,
`workload` the slice, its sizes and the scratch directory, `sections_env_numerics`,
`sections_train` (train_step, parts, memory), `sections_rollouts` and
`sections_hf_recipe` (hf_io, recipe) the sections, `runner` the driver that runs each
section in a process of its own (`python -m experiments.device_check --run_section
NAME`), `report` the JSON and markdown, and this `__main__` the flags and the command.
"""
from __future__ import annotations

import os
import shutil
import tempfile

from absl import app
from absl import flags

from experiments.device_check.checks import parse_lever
from experiments.device_check.report import markdown, write_json
from experiments.device_check.runner import SECTIONS, run_check, run_one_section
from experiments.device_check.workload import scratch_dir

FLAGS = flags.FLAGS


def _define_flags() -> None:
  """The command's flags, defined when it runs (this `__main__`), not on import: the tests
  import the package's other modules beside other entry points' modules with flags of
  these names (`gpu_smoke` defines --out, --tiny, --steps); those modules read the
  values through absl's FLAGS."""
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


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if FLAGS.run_section:
    run_one_section(FLAGS.run_section)
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
      shutil.rmtree(scratch_dir(), ignore_errors=True)
  write_json(report, partial=False)
  text = markdown(report)
  with open(os.path.join(FLAGS.out, "device_check.md"), "w") as f:
    f.write(text)
  print(text)
  print(f"written: {os.path.join(FLAGS.out, 'device_check.json')} and device_check.md")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
