r"""python -m experiments.recipe --config experiments/configs/rstar2_agent_14b.py --config.workdir=/ckpt/rstar2_14b --config.model.hf_dir=/models/Qwen3-14B-Base --config.tokenizer.path=/models/Qwen3-14B-Base --config.data.train_files=/data/dapo_aops_euler.parquet --config.data.eval_files=/data/aime24.jsonl --config.sft.files=/data/sft.jsonl

rStar2-Agent-14B: the report's recipe for Qwen3-14B-Base on 64 accelerators.

Numbers are SPEC.md's (the report's) unless marked. Multi-host launch: start the
same command on every host after `jax.distributed.initialize()` (not wired yet; see
WORKSPACE.md), with sandbox servers listed in --config.sandbox.urls.
"""
import ml_collections
from ml_collections import config_dict


def get_config():
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.workdir = "/tmp/rstar2_14b"
  c.compile_cache = True  # <workdir>/compile_cache: later stages and restarts skip compiles
  # 64 devices: FSDP across all of them; see experiments/plan_memory.py for the fit.
  c.mesh = dict(enabled=True, data=1, fsdp=-1, tensor=1)

  c.model = dict(preset=config_dict.placeholder(str), hf_dir=config_dict.placeholder(str),
                 vocab_size=0, param_dtype="float32", dtype="bfloat16",
                 remat_policy="full", attention_impl="chunked")
  c.tokenizer = dict(kind="hf", path=config_dict.placeholder(str), vocab_size=0)
  c.data = dict(kind="files", toy_levels="", toy_kinds="", toy_train_problems=0, toy_eval_problems=0,
                train_files="", eval_files="", integer_only=True, on_error="skip")
  c.sandbox = dict(urls="", max_children=64, timeout_s=10.0)

  # Non-reasoning cold start: ~222K examples, 3 epochs, lr 5e-6, 4% warm-up, cosine, batch 128.
  c.sft = dict(enabled=True, files="", num_traces=0, bug_share=0.0, no_tool_share=0.0,
               epochs=3.0, seq_len=8192, rows_per_step=128, micro_batches=16,
               logprob_chunk=1024, learning_rate=5e-6, warmup_steps=200, min_lr_ratio=0.0,
               weight_decay=0.0, heldout_share=0.01, eval_every=200, checkpoint_every=500)

  c.engine = dict(num_slots=64, max_len=13_312)   # 12K responses + prompt
  c.rl = dict(prompts_per_step=512, samples_per_prompt=32, group_size=16, downsample="roc",
              positive_selection="sample", drop_equal_reward_groups=False,
              advantage="grpo", advantage_eps=1e-6, eps_low=0.2, eps_high=0.28,
              dual_clip_c=0.0, aggregation="token-mean", kl_coef=0.0,
              learning_rate=1e-6, warmup_steps=20, weight_decay=0.01, grad_clip_norm=1.0,
              micro_batches=128, logprob_chunk=1024, old_logprobs="sampler",
              temperature=1.0, top_p=1.0, checkpoint_every=10, length_multiple=512,
              fixed_rows=False, scheduler_policy="kv_capacity")
  c.stage1 = dict(num_steps=300, max_response_tokens=8192, max_turns=10, hard_only=False,
                  hard_k=8, hard_pool=0, reset_optimizer=False)
  c.stage2 = dict(num_steps=85, max_response_tokens=12_288, max_turns=10, hard_only=False,
                  hard_k=8, hard_pool=0, reset_optimizer=False)
  # Only problems the policy does not solve 8/8 (17.3K of 42K), optimizer reset, 15 turns.
  c.stage3 = dict(num_steps=125, max_response_tokens=12_288, max_turns=15, hard_only=True,
                  hard_k=8, hard_pool=0, reset_optimizer=True)
  # pass@1 averaged over 16 samples. The eval temperature is not stated in SPEC.md;
  # 1.0 (the training temperature) is our choice, and every report prints it.
  c.eval = dict(after_sft=False, k=16, temperature=1.0, top_p=1.0,
                max_response_tokens=12_288, max_turns=15)
  return c
