r"""python -m experiments.sweep --config experiments/configs/toy_roc_ablation.py --workdir /tmp/roc_ablation --config.model.hf_dir=/tmp/rstar_toy/sft/export --config.tokenizer.path=/tmp/rstar_toy/sft/export

The RoC ablation on the toy task (the report's Fig. 4 at toy scale): from one SFT model,
RL with GRPO-RoC against plain GRPO at the same compute, x 3 seeds.

First make the SFT model once (the toy recipe's SFT stage, ~8 min on 2 cores):
  python -m experiments.recipe --config experiments/configs/toy.py \
      --config.workdir=/tmp/rstar_toy --stages=sft
then run the sweep above (`--workers 2` on a machine with 4+ cores). Every point starts
from that export (`model.hf_dir`, `tokenizer.kind="hf"`, SFT off) and runs stage 1 + the
final evaluation; per RL step its `stage1/metrics_rl.jsonl` logs the tool-error rate among
correct trajectories (`rollout/tool_error_rate_correct`), the reward (sampled pass@1 of the
step's problems) and the response length. `results.md` holds the final evaluation per point
and mean +- std over the seeds.

Points (`get_sweep`):
  roc       GRPO-RoC: 2G rollouts, G kept by RoC (the report's counts).
  uniform   plain GRPO at the same compute: 2G rollouts, G kept uniformly at random.
  g_only    plain GRPO with G rollouts (half the sampling compute).
G is the variant's `rl.downsample.group_size`: 4 (also in the `:smoke` variant, toy.py's
smoke run, to try the sweep end to end).

Result (docs/results.md, "RoC ablation": 2026-11-28, commit 7d8416c, a 2-core AMD EPYC
family 26 AVX-512 host, from the README main job's SFT export, 3 seeds an arm): tool errors
in correct trajectories RoC 3.8 +- 2.8%, uniform 18.1 +- 1.7%, half-compute GRPO
13.0 +- 1.0%; pass@1 90.8 / 90.4 / 91.6% (within the spread). 1h59m for the 9 runs of 40
RL steps and an evaluation each, loaded (load 2-24): an upper bound. Artifacts:
experiments/results/roc_ablation_epyc-f26-avx512_2026-11-28/.
"""

from experiments.configs import toy

SEEDS = (0, 1, 2)


def get_config(variant: str = ""):
  # Not toy.py's first_run: its level-0 problems are not what the SFT export was trained on.
  if variant not in ("", "smoke"):
    raise ValueError(f"toy_roc_ablation.py: unknown variant {variant!r}; known: smoke")
  c = toy.get_config(variant)
  c.workdir = "/tmp/roc_ablation/point"
  # One SFT model for every point: the sweep passes its export on the command line.
  c.model.update(preset=None, hidden_size=None, intermediate_size=None, num_hidden_layers=None,
                 num_attention_heads=None, num_key_value_heads=None, head_dim=None,
                 tie_word_embeddings=None)
  c.tokenizer.kind = "hf"
  c.sft.enabled = False
  # What matters to the effect is the RL stage; stage 2's longer budget and the stage-3
  # hard subset are the recipe's, not the ablation's. Stage 1 runs 40 steps instead
  # (the smoke variant keeps its own few: a smoke run).
  if variant != "smoke":
    c.stage1.num_steps = 40
  c.stage2.num_steps = 0
  c.stage3.num_steps = 0
  c.eval.after_sft = False
  return c


def get_sweep(variant: str = ""):
  # The config draws 2G rollouts per prompt and keeps G; g_only draws G, the variant's G
  # (a fixed 4 would be the smoke variant's 2G: the same compute as the other arms).
  group = get_config(variant).rl.downsample.group_size
  arms = {
      "roc": {"rl.downsample.method": "roc"},
      "uniform": {"rl.downsample.method": "uniform"},
      "g_only": {"rl.downsample.method": "none", "rl.samples_per_prompt": group},
  }
  return [dict(arm, seed=seed) for arm in arms.values() for seed in SEEDS]
