r"""python -m experiments.recipe --config experiments/configs/toy.py --config.workdir=/tmp/rstar_toy

The whole rStar2-Agent recipe on a CPU, on the toy arithmetic tool task.

A tiny Qwen3 (vocab from a toy tokenizer trained on the spot) learns the tool-call
format in SFT from traces with deliberate noise (buggy first calls, answers without
the tool), then GRPO-RoC raises its sampled accuracy and cleans its tool use. Every
field can be overridden, e.g. `--config.stage1.num_steps=5 --config.rl.learning_rate=1e-4`.
"""
import ml_collections
from ml_collections import config_dict


def get_config():
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.workdir = "/tmp/rstar_toy"
  # XLA executables in <workdir>/compile_cache: later stages reuse the earlier ones'.
  c.compile_cache = True
  c.mesh = dict(enabled=False, data=1, fsdp=-1, tensor=1)

  # 2 layers x 128 (4 heads of 64, tied embeddings): the task's bottleneck is copying
  # numbers (problem -> code, output -> answer), an induction-head skill that a 2-layer
  # model forms after ~300-400 SFT steps. Head dims 32 / 64 / 128 were compared with the
  # copy probe that experiments/toy_sft_curve.py runs (WORKSPACE.md, "Toy recipe"): 64
  # copies best per second of SFT.
  c.model = dict(preset="small", hf_dir=config_dict.placeholder(str), vocab_size=0,
                 param_dtype="float32", dtype="float32", remat_policy="none",
                 attention_impl="xla",
                 # Architecture fields override the preset (a key set to None keeps it).
                 hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 tie_word_embeddings=True)
  # number_chunk: digits per number token (1 = Qwen's one-digit split).
  c.tokenizer = dict(kind="toy", path=config_dict.placeholder(str), vocab_size=2048,
                     number_chunk=3)
  c.data = dict(kind="toy", toy_levels="1,2", toy_kinds="", toy_train_problems=2000,
                toy_eval_problems=128, train_files="", eval_files="", integer_only=True,
                on_error="raise")
  c.sandbox = dict(urls="", max_children=2, timeout_s=5.0)

  # ~1800 steps of 14 x 288 packed tokens (~7 min on 2 cores). 10,000 distinct traces
  # (not 4,000 seen more often): every number chunk is a rare token, and copying must
  # generalise to chunks it has hardly seen. seq_len 288 holds the longest (bug-fixed)
  # trace at levels 1-2 with ~40% less attention work per token than 512.
  c.sft = dict(enabled=True, files="", num_traces=10000, bug_share=0.2, no_tool_share=0.3,
               epochs=3.9, seq_len=288, rows_per_step=14, micro_batches=1, logprob_chunk=512,
               learning_rate=6e-3, warmup_steps=10, min_lr_ratio=0.1, weight_decay=0.0,
               heldout_share=0.05, eval_every=200, checkpoint_every=300)

  c.engine = dict(num_slots=64, max_len=384)
  # drop_equal_reward_groups: with a sparse reward most groups carry no signal; an
  # update from them alone still moves the weights through Adam's momentum.
  c.rl = dict(prompts_per_step=16, samples_per_prompt=8, group_size=4, downsample="roc",
              positive_selection="sample", drop_equal_reward_groups=True,
              advantage="grpo", advantage_eps=1e-6, eps_low=0.2, eps_high=0.28,
              dual_clip_c=0.0, aggregation="token-mean", kl_coef=0.0,
              learning_rate=3e-4, warmup_steps=3, weight_decay=0.01, grad_clip_norm=1.0,
              micro_batches=1, logprob_chunk=512, old_logprobs="sampler",
              temperature=1.0, top_p=1.0, checkpoint_every=10, length_multiple=64,
              fixed_rows=True, scheduler_policy="kv_capacity")
  c.stage1 = dict(num_steps=30, max_response_tokens=192, max_turns=4, hard_only=False,
                  hard_k=4, hard_pool=0, reset_optimizer=False)
  c.stage2 = dict(num_steps=8, max_response_tokens=256, max_turns=4, hard_only=False,
                  hard_k=4, hard_pool=0, reset_optimizer=False)
  c.stage3 = dict(num_steps=8, max_response_tokens=256, max_turns=6, hard_only=True,
                  hard_k=4, hard_pool=128, reset_optimizer=True)
  c.eval = dict(after_sft=True, k=4, temperature=1.0, top_p=1.0, max_response_tokens=256,
                max_turns=6)
  return c
