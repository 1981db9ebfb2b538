"""The device check's targets and its pass/fail checks: pure functions of the figures.

Every target a figure is held to is in TARGETS, one table; each `check_*` function
judges figures against it and returns (met, detail), met None where the target does
not apply here (a GPU target on a CPU), so the tests plant faults in the figures.
`check_row` is the report's row for one target.
"""
from __future__ import annotations

from typing import Any

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
    # package's docstring, in __main__.py, says why these).
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
# cuDNN's fused attention, as a custom call of the compiled step (forward; the backward
# target ends in "Backward"), e.g. __cudnn$fmhaScaleBiasSoftmax.
CUDNN_FMHA_PREFIX = "__cudnn$fmha"


def check_row(name: str, value, target: str, met: bool | None, note: str = ""
              ) -> dict[str, Any]:
  """A target: its measured value, the rule, and whether it is met (None: not
  applicable here, e.g. a GPU target on a CPU)."""
  return {"name": name, "value": value, "target": target, "met": met, "note": note}


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


def check_lever(base_loss: float | None, lever_loss: float | None
                ) -> tuple[bool | None, float | None]:
  """(met, relative difference of the lever's first loss from the base step's): a lever
  that did not run, or whose base did not, is not met."""
  if base_loss is None or lever_loss is None:
    return False, None
  rel = abs(lever_loss - base_loss) / max(abs(base_loss), 1e-6)
  return rel <= TARGETS["lever_loss_rel_diff_max"], rel
