r"""python -m experiments.recipe --config experiments/configs/rstar2_agent_14b.py --config.workdir=/ckpt/rstar2_14b --config.model.hf_dir=/models/Qwen3-14B-Base --config.tokenizer.path=/models/Qwen3-14B-Base --config.data.train_files="('/data/dapo_aops_euler.parquet',)" --config.data.eval_files="('/data/aime24.jsonl',)" --config.sft.data.files="('/data/sft.jsonl',)"

rStar2-Agent-14B: the report's recipe for Qwen3-14B-Base on 64 accelerators.

Numbers are the rStar2-Agent report's unless marked. Multi-host: the same command on
every trainer host, one process each, joined by `config.distributed` (coordinator
address, process count and id; or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID; under SLURM nothing), with rollouts on SGLang servers
(`--config.rollout.backend=sglang --config.rollout.servers=...`) and sandbox servers in
--config.tools.urls. `experiments/slurm/rstar2_14b.sbatch` and
`python -m experiments.launch_cluster` start the whole fleet (docs/guides/cluster.md).
"""
from rstar_jax import config_utils as cu
from rstar_jax.recipe import stages as recipe


def get_config():
  s = cu.section
  c = s(recipe.RecipeConfig, seed=0, workdir="/tmp/rstar2_14b",
        compile_cache=True)  # <workdir>/compile_cache: later stages and restarts skip compiles
  # 64 devices: FSDP across all of them; see experiments/plan_memory.py for the fit
  # (fsdp=8 tensor=8 fits more per device: --config.mesh.fsdp=8 --config.mesh.tensor=8).
  c.mesh = s(recipe.sharding.MeshConfig, enabled=True, data=1, fsdp=-1, tensor=1)
  # model.hf_dir (the Qwen3-14B-Base checkpoint) is given on the command line.
  c.model = s(recipe.model_config.ModelConfig, preset=None, param_dtype="float32",
              dtype="bfloat16", remat_policy="full", attention_impl="auto")  # cuDNN on NVIDIA, else chunked
  c.tokenizer = s(recipe.sources.TokenizerConfig, kind="hf", path=None)
  c.chat = s(recipe.chat.ChatConfig)   # the release's texts
  c.data = s(recipe.sources.DataConfig, kind="files", integer_only=True, on_error="skip",
             train_files=(), eval_files=())
  c.tools = s(recipe.tools_lib.ToolsConfig, urls=(), local_max_children=64, timeout_s=10.0)
  c.rollout = s(recipe.backends.RolloutConfig, backend="jax",
                engine=dict(num_slots=64, max_len=13_312))   # 12K responses + prompt

  # Non-reasoning cold start: ~222K examples, 3 epochs, lr 5e-6, 4% warm-up, cosine, batch 128.
  # Our batch is 128 packed rows of 8192 tokens, each holding several short examples (the
  # report's 128 are examples): to match it in examples, set rows_per_step to 128 / (examples
  # per row; the SFT log's packing stats give examples and rows).
  c.sft = s(recipe.SFTStage, enabled=True, epochs=3.0, seq_len=8192, rows_per_step=128,
            heldout_share=0.01, eval_every=200, checkpoint_every=500,
            data=dict(files=(), num_traces=0),
            optimizer=dict(learning_rate=5e-6, warmup_ratio=0.04, schedule="warmup_cosine",
                           min_lr_ratio=0.0, weight_decay=0.0, grad_clip_norm=1.0),
            step=dict(micro_batches=16, logprob_chunk=1024))

  c.rl = s(recipe.rl_trainer.RLConfig, prompts_per_step=512, samples_per_prompt=32,
           old_logprobs="sampler", checkpoint_every=10, length_multiple=512, fixed_rows=False,
           downsample=dict(method="roc", group_size=16, positive_selection="sample",
                           drop_equal_reward_groups=False),
           advantage=dict(estimator="grpo", eps=1e-6),
           loss=dict(eps_low=0.2, eps_high=0.28, dual_clip_c=None, aggregation="token-mean",
                     kl_coef=0.0),
           optimizer=dict(learning_rate=1e-6, warmup_steps=20, weight_decay=0.01,
                          grad_clip_norm=1.0),
           step=dict(micro_batches=128, logprob_chunk=1024))
  agent = dict(max_turns=10, max_response_tokens=8192, temperature=1.0, top_p=1.0)
  c.stage1 = s(recipe.RLStage, num_steps=300, agent=agent, hard_k=8)
  c.stage2 = s(recipe.RLStage, num_steps=85, agent=dict(agent, max_response_tokens=12_288),
               hard_k=8)
  # Only problems the policy does not solve 8/8 (17.3K of 42K), optimizer reset, 15 turns.
  c.stage3 = s(recipe.RLStage, num_steps=125, hard_only=True, hard_k=8, reset_optimizer=True,
               agent=dict(agent, max_response_tokens=12_288, max_turns=15))
  # pass@1 averaged over 16 samples. The eval temperature is not stated in the report;
  # 1.0 (the training temperature) is our choice, and every report prints it.
  c.eval = s(recipe.EvalStage, after_sft=False, k=16,
             agent=dict(max_turns=15, max_response_tokens=12_288, temperature=1.0, top_p=1.0))
  return c
