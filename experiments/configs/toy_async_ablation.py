r"""python -m experiments.sweep --config experiments/configs/toy_async_ablation.py --workdir /tmp/async_ablation --workers 1 --config.model.hf_dir=/tmp/rstar_toy/sft/export --config.tokenizer.path=/tmp/rstar_toy/sft/export

Does asynchrony cost accuracy? The toy task's stage-1 RL under bounded staleness
(`rl.async_rollouts.max_staleness` = k, docs/guides/async_rollouts.md) from one SFT model,
k = 0 (the synchronous loop), 1 and 2, x 3 seeds; the loss is today's (`off_policy="behaviour"`,
the PPO ratio against the sampler's log-probs: verl's one-step off-policy trainer at k = 1).
Result (docs/results.md, "Asynchronous rollouts: what they cost the learning": 2026-11-27,
AMD EPYC family 25, AVX-512, 2 cores shared, load 1-10): final pass@1 k = 0 90.8 +- 1.9%,
k = 1 91.5 +- 2.3%, k = 2 91.9 +- 1.8%: no measurable accuracy cost. Wall time: not recorded.

Set-up as for the RoC ablation (toy_roc_ablation.py, whose config this one starts from: one SFT
export, stage 1 only, 40 steps, then the final evaluation): make the SFT model once with
  python -m experiments.recipe --config experiments/configs/toy.py \
      --config.workdir=/tmp/rstar_toy --stages=sft
then run the sweep above. `results_seeds.csv` holds the final sampled pass@1 and the tool-error
rate among correct trajectories, mean +- std per k; each point's `stage1/metrics_rl.jsonl` logs
the staleness per step (`async/staleness_max`) and the groups dropped past the bound
(`async/stale_dropped_groups`, expected 0 in process).

Points (`get_sweep`), seeds 0-2 each: k = 0, 1, 2 (`rl.async_rollouts.max_staleness`); k = 2
under the decoupled objective (`rl.loss.off_policy=decoupled`, AReaL's); k = 1 with in-flight
weight updates (`rl.async_rollouts.weight_updates=between_requests`). The `:smoke` variant (two
steps a point) tries the sweep end to end.
"""
from experiments.configs import toy_roc_ablation

SEEDS = (0, 1, 2)
STALENESS = (0, 1, 2)


def get_config(variant: str = ""):
  c = toy_roc_ablation.get_config(variant)
  c.workdir = "/tmp/async_ablation/point"
  return c


def get_sweep(variant: str = ""):
  del variant
  points = [{"rl.async_rollouts.max_staleness": k, "seed": seed}
            for k in STALENESS for seed in SEEDS]
  # Two more arms: the staler bound under AReaL's decoupled objective, and k = 1 with
  # in-flight weight updates (later turns on newer weights: not reproducible bit for bit).
  points += [{"rl.async_rollouts.max_staleness": 2, "rl.loss.off_policy": "decoupled",
              "seed": seed} for seed in SEEDS]
  points += [{"rl.async_rollouts.max_staleness": 1,
              "rl.async_rollouts.weight_updates": "between_requests", "seed": seed}
             for seed in SEEDS]
  return points
