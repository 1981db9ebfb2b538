r"""python -m experiments.recipe --config experiments/configs/toy.py --config.workdir=/tmp/rstar_toy

The whole rStar2-Agent recipe on a CPU, on the toy arithmetic tool task.

A tiny Qwen3 (vocab from a toy tokenizer trained on the spot) learns the tool-call
format in SFT from traces with deliberate noise (buggy first calls, answers without
the tool), then GRPO-RoC raises its sampled accuracy and cleans its tool use.

Every section is the dataclass it builds, field for field, so every field can be
overridden, e.g. `--config.stage1.num_steps=5 --config.rl.optimizer.learning_rate=1e-4
--config.rl.downsample.use_error_penalty=False --config.chat.reopen_reason=False`.

Variants (`--config experiments/configs/toy.py:VARIANT`):
  first_run  the README's first run: the smoke's model and pipeline on level-0 problems
          (two-digit operands), 405 SFT steps, 20 RL steps, evaluations after SFT and at
          the end on 64 problems x 4. Result (2026-11-28, a quiet 2-core AMD EPYC family
          26, AVX-512 host): reward 0.43 over RL steps 1-5 -> 0.55 over 16-20 as the share
          of answers without a tool call falls 0.44 -> 0.24; pass@1 45.7% after SFT ->
          59.8% final; 78-79 s wall.
  smoke   a 2-layer x 64 model, 162 SFT steps and 2 RL steps whose rollouts call the tool
          and run the calls in the sandbox: the whole pipeline, what tests/test_recipe.py
          and most tests that run the recipe use. Result (2026-11-28, a quiet 2-core AMD
          EPYC family 26, AVX-512 host, load 0.1-1.7): tool error rate 0.20 / 0.32 at
          0.78 / 0.73 calls a trajectory, reward 0.062 / 0.047 (chance: the operands are
          not copied yet), final pass@1 0.0% (4 problems x 2); 43-49 s wall, 68-76 s CPU.

Result of the full config (README, docs/results.md): pass@1 at temperature 1.0 from 55-65%
after SFT to 81-91% final over the CPU kinds measured; 15m44s on a quiet 2-core Intel Xeon
(AVX-512) host.
"""
from rstar_jax.recipe import sections


def get_config(variant: str = ""):
  if variant not in ("", "smoke", "first_run"):
    raise ValueError(f"toy.py: unknown variant {variant!r}; known: smoke, first_run")
  s = sections.section
  c = s(sections.RecipeConfig, seed=0, workdir="/tmp/rstar_toy",
        # XLA executables in <workdir>/compile_cache: later stages reuse the earlier ones'.
        compile_cache=True)

  # 2 layers x 128 (4 heads of 64, tied embeddings): the task's bottleneck is copying
  # numbers (problem -> code, output -> answer), an induction-head skill that a 2-layer
  # model forms after ~300-400 SFT steps. Head dims 32 / 64 / 128 were compared with the
  # copy probe that experiments/toy_sft_curve.py runs (docs/guides/toy_recipe.md): 64
  # copies best per second of SFT. vocab_size stays None: the tokenizer's.
  c.model = s(sections.ModelConfig, preset="small", hidden_size=128,
              intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
              param_dtype="float32", dtype="float32", remat_policy="none",
              attention_impl="blockwise", attention_chunk=32)
  # number_chunk: digits per number token (1 = Qwen's one-digit split).
  c.tokenizer = s(sections.TokenizerConfig, kind="toy", vocab_size=2048, number_chunk=3)
  # The release's protocol with short texts (58 system tokens instead of 597) and no
  # run time in tool responses (reproducible rollouts).
  c.chat = s(sections.ChatConfig, **sections.as_plain(sections.toy_chat_config()))
  c.data = s(sections.DataConfig, kind="toy",
             toy=dict(levels=(1, 2), kinds=(), train_problems=2000, eval_problems=128))
  c.tools = s(sections.ToolsConfig, local_max_children=2, timeout_s=5.0)
  # batch_invariant: a trajectory's tokens and log-probs do not depend on what shares
  # the engine with it or when, so two runs of this config give the same bits
  # (docs/guides/reproducibility.md: what it costs).
  c.rollout = s(sections.RolloutConfig, backend="jax", scheduler_policy="sticky",
                engine=dict(num_slots=64, max_len=384, batch_invariant=True))

  # ~2000 steps of 12 x 320 packed tokens (~9.5 min on a 2-core host whose matmul peak is
  # ~210 GFLOP/s; 7 epochs took 18m51s end to end there). 10,000 distinct traces
  # (not 4,000 seen more often): every number chunk is a rare token, and copying must
  # generalise to chunks it has hardly seen. The traces run up to 258 tokens (median 150):
  # rows of 320 pack them 92% full, rows of 288 only 76% (two median traces do not
  # fit), so 320 trains 1.2x the tokens per second of 288 and holds the longest trace.
  c.sft = s(sections.SFTStage, enabled=True, epochs=5.0, seq_len=320, rows_per_step=12,
            heldout_share=0.05, eval_every=200, checkpoint_every=300,
            data=dict(num_traces=10000, traces=dict(bug_share=0.2, no_tool_share=0.3)),
            optimizer=dict(learning_rate=6e-3, warmup_steps=10, schedule="warmup_cosine",
                           min_lr_ratio=0.1, weight_decay=0.0, grad_clip_norm=1.0),
            step=dict(micro_batches=1, logprob_chunk=512))

  # drop_equal_reward_groups: with a sparse reward most groups carry no signal; an
  # update from them alone still moves the weights through Adam's momentum.
  c.rl = s(sections.RLConfig, prompts_per_step=16, samples_per_prompt=8,
           old_logprobs="sampler", checkpoint_every=10, length_multiple=64, fixed_rows=True,
           downsample=dict(method="roc", group_size=4, positive_selection="sample",
                           drop_equal_reward_groups=True),
           advantage=dict(estimator="grpo", eps=1e-6),
           loss=dict(eps_low=0.2, eps_high=0.28, dual_clip_c=None, aggregation="token-mean",
                     kl_coef=0.0),
           optimizer=dict(learning_rate=3e-4, warmup_steps=3, weight_decay=0.01,
                          grad_clip_norm=1.0),
           step=dict(micro_batches=1, logprob_chunk=512))
  agent = dict(max_turns=4, max_response_tokens=192, temperature=1.0, top_p=1.0)
  c.stage1 = s(sections.RLStage, num_steps=40, agent=agent, hard_k=4)
  c.stage2 = s(sections.RLStage, num_steps=8, agent=dict(agent, max_response_tokens=256),
               hard_k=4)
  # Stage 3: only problems the policy does not solve 4/4 (of the first 128), fresh Adam.
  c.stage3 = s(sections.RLStage, num_steps=8, hard_only=True, hard_k=4, hard_pool=128,
               reset_optimizer=True, agent=dict(agent, max_response_tokens=256, max_turns=6))
  c.eval = s(sections.EvalStage, after_sft=True, k=4,
             agent=dict(max_turns=6, max_response_tokens=256, temperature=1.0, top_p=1.0))

  if variant:   # smoke, and first_run on top of it
    # The smoke (and first_run's base), ~45 s: SFT teaches the tiny model the tool-call
    # format, so its RL rollouts make calls that the sandbox runs (tool error rate ~0.2-0.3,
    # against 1.0 when 48 response tokens cut every call off and 60 SFT steps on 75% no-tool
    # traces left them malformed). Head dim 64 instead of 16: after ~160 SFT steps the calls
    # are well-formed JSON with runnable code. What ~160 SFT steps do not teach is copying
    # the operands into the code (the full toy's 2 x 128 model needs ~300-400 steps:
    # docs/guides/toy_recipe.md), so the code computes the wrong product and the reward
    # stays at chance: digit sums of level-1 products (3 x 3 digits) take few values (27 is
    # 13% of problems), ~5% of answers are right either way. 8 prompts x 8 samples then give
    # each RL step groups with mixed rewards, hence non-zero advantages, gradients and Adam
    # moments (the exact-resume tests check those).
    c.model.update(preset="tiny", hidden_size=64, intermediate_size=128, head_dim=64)
    c.data.toy.update(train_problems=64, eval_problems=4, kinds=("digit_sum",), levels=(1,))
    # ~160 steps of 8 rows of 320 tokens (two traces a row).
    c.sft.update(epochs=1.0, rows_per_step=8, seq_len=320, eval_every=40)
    c.sft.data.num_traces = 3000
    c.sft.data.traces.update(bug_share=0.0, no_tool_share=0.25, no_tool_correct_share=1.0)
    c.rl.update(prompts_per_step=8, samples_per_prompt=8, checkpoint_every=1)
    c.rl.downsample.update(group_size=4, drop_equal_reward_groups=False)
    c.rollout.engine.update(num_slots=8, max_len=320)
    c.stage1.update(num_steps=2)
    # A call and its answer take ~60 model tokens, with the tool's output ~80.
    c.stage1.agent.max_response_tokens = 96
    c.stage2.num_steps = 0
    c.stage3.num_steps = 0
    c.eval.update(k=2, after_sft=False)
    c.eval.agent.max_response_tokens = 96
  if variant == "first_run":
    # The smoke's pipeline on level-0 problems (two-digit operands: 90 number tokens,
    # each copied into code ~120 times in 2.5 epochs of ~2,140 tool traces, against the
    # smoke's 900 three-digit ones, ~5 times each), which the same tiny model learns to
    # copy after ~270-320 SFT steps at a constant 3e-3
    # (experiments/toy_sft_curve.py: code p_copy 0.07 at step 270, 0.48 at 324, 0.78 at
    # 378). 405 steps end past that, with the tool path mostly right, and SFT leaves
    # about half of the answers without a call (guesses, right at chance): what RL
    # visibly raises in 20 steps is the share of calls, and the reward with it. Constant
    # 3e-3, not the toy's cosine 6e-3: over 2 epochs the cosine's decay left code p_copy
    # at 0.01, and a constant 6e-3 or 4e-3 reached only 0.16 or 0.07 by step 324.
    c.data.toy.levels = (0,)
    c.data.toy.eval_problems = 64
    c.sft.epochs = 2.5
    c.sft.optimizer.update(schedule="warmup_constant", learning_rate=3e-3)
    c.rl.checkpoint_every = 10
    c.stage1.num_steps = 20
    c.eval.update(k=4, after_sft=True)
  return c
