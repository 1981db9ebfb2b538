r"""python -m experiments.recipe --config experiments/configs/rstar2_agent_14b.py --config.workdir=/shared/rstar/runs/rstar2_14b --config.model.hf_dir=/shared/rstar/runs/sft/sft/export --config.tokenizer.path=/shared/rstar/runs/sft/sft/export --config.data.train_files="('/shared/rstar/data/dapo_aops_euler.parquet',)" --config.data.eval_files="('/shared/rstar/data/aime24.jsonl',)" --config.sft.data.files="('/shared/rstar/data/sft.jsonl',)" --config.rollout.servers="('http://node4:30000','http://node4:30001')" --config.tools.urls="('http://node0:8321',)" --config.rollout.weight_sync.dir=/shared/rstar/weights

rStar2-Agent-14B: the report's recipe for Qwen3-14B-Base on 64 accelerators.

Numbers are the rStar2-Agent report's unless marked. The command above runs on each
of the layout's trainer hosts (one process each, joined by `config.distributed`, the
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID variables, or SLURM's), with
rollouts on the SGLang servers listed in --config.rollout.servers (rollout.backend is
"sglang": the in-process "jax" backend is refused by a multi-process run) and sandboxes
at --config.tools.urls; every path on storage all nodes share. Nobody types all of that:
`sbatch experiments/slurm/rstar2_14b_sft.sbatch` runs SFT (no servers needed), whose export
`sbatch experiments/slurm/rstar2_14b.sbatch` (SLURM) or
`python -m experiments.launch_cluster --config experiments/configs/rstar2_agent_14b.py:cluster`
(Ray) start the fleet and the RL trainer from (docs/guides/cluster.md).

The layout is stated once, here (LAYOUT, TENSOR, RL_SEQS_PER_SHARD): the recipe's mesh
and micro-batches below follow from it, the `:layout` variant is it as a section (what
`python -m experiments.preflight --config experiments/configs/rstar2_agent_14b.py` checks
and `--print_layout` hands the batch script), `:cluster` is launch_cluster's fleet.

Result and wall time of the run: not measured yet (it has not run on accelerators). Its
preflight (docs/results.md: 2026-11-28, commit 7654b61, a 2-core AMD EPYC host, 9 s of CPU):
the layout fits, XLA:CPU peak per device SFT 20.0 GB, RL 80.6 GB of 172.8 usable.
"""
import ml_collections

from rstar_jax.recipe import sections

# 8 nodes x 8 MI300X: nodes 0-3 train (32 devices), nodes 4-7 serve rollouts (one SGLang
# server per GPU: 32), a sandbox server on each trainer node's CPUs. Why this split and
# not colocated training and rollouts: docs/guides/cluster.md ("The 14B layout").
LAYOUT = dict(accelerator="MI300X", nodes=8, gpus_per_node=8, trainer_nodes=4,
              servers_per_node=8, gpus_per_server=1, sglang_mem_fraction=0.85,
              trainer_mem_fraction=0.9, sandbox_servers_per_node=1, sandbox_children=64)
TENSOR = 4              # tensor axis inside a node; fsdp spans the rest of the trainer devices
RL_SEQS_PER_SHARD = 4   # sequences per micro-batch per fsdp shard in RL (13,312 tokens each)
SFT_SEQS_PER_SHARD = 1  # packed rows of 8,192 per micro-batch per fsdp shard in SFT
MAX_LEN = 13_312        # prompt + 12K response: the servers' context, the longest RL batch
SHARED = "/shared/rstar"   # storage every node reads at the same path


def layout() -> sections.Layout:
  return sections.Layout(**LAYOUT)


def get_config(variant: str = ""):
  if variant == "layout":
    return sections.section(sections.Layout, **LAYOUT)
  if variant == "cluster":
    return _cluster()
  if variant:
    raise ValueError(f"rstar2_agent_14b.py: unknown variant {variant!r}; known: layout, cluster")
  lay = layout()
  fsdp = lay.trainer_devices // TENSOR
  s = sections.section
  c = s(sections.RecipeConfig, seed=0, workdir="/tmp/rstar2_14b",
        compile_cache=True)  # <workdir>/compile_cache: later stages and restarts skip compiles
  c.mesh = s(sections.MeshConfig, enabled=True, data=1, fsdp=fsdp, tensor=TENSOR)
  # model.hf_dir (the Qwen3-14B-Base checkpoint) is given on the command line.
  c.model = s(sections.ModelConfig, preset=None, param_dtype="float32",
              dtype="bfloat16", remat_policy="full", attention_impl="auto")  # cuDNN on NVIDIA, else chunked
  c.tokenizer = s(sections.TokenizerConfig, kind="hf", path=None)
  c.chat = s(sections.ChatConfig)   # the release's texts
  c.data = s(sections.DataConfig, kind="files", integer_only=True, on_error="skip",
             train_files=(), eval_files=())
  c.tools = s(sections.ToolsConfig, urls=(), local_max_children=64, timeout_s=10.0)
  # Rollouts on the layout's SGLang servers (URLs given at launch). engine.max_len is the
  # longest trajectory (prompt + 12K response): the servers' --context-length and the
  # trainer's longest batch. engine.num_slots serves only rollout.backend=jax (one host,
  # checks): its KV cache sits unsharded on one device, 8 x 13,312 x 160 KiB = 17.4 GB;
  # the 64 slots this file had (140 GB) fit no device beside the train state.
  c.rollout = s(sections.RolloutConfig, backend="sglang", servers=(),
                engine=dict(num_slots=8, max_len=MAX_LEN))

  # Non-reasoning cold start: ~222K examples, 3 epochs, lr 5e-6, 4% warm-up, cosine, batch 128.
  # Our batch is 128 packed rows of 8192 tokens, each holding several short examples (the
  # report's 128 are examples): to match it in examples, set rows_per_step to 128 / (examples
  # per row; the SFT log's packing stats give examples and rows).
  c.sft = s(sections.SFTStage, enabled=True, epochs=3.0, seq_len=8192, rows_per_step=128,
            heldout_share=0.01, eval_every=200, checkpoint_every=500,
            data=dict(files=(), num_traces=0),
            optimizer=dict(learning_rate=5e-6, warmup_ratio=0.04, schedule="warmup_cosine",
                           min_lr_ratio=0.0, weight_decay=0.0, grad_clip_norm=1.0),
            step=dict(micro_batches=128 // (fsdp * SFT_SEQS_PER_SHARD), logprob_chunk=1024))

  c.rl = s(sections.RLConfig, prompts_per_step=512, samples_per_prompt=32,
           old_logprobs="sampler", checkpoint_every=10, length_multiple=512, fixed_rows=False,
           downsample=dict(method="roc", group_size=16, positive_selection="sample",
                           drop_equal_reward_groups=False),
           advantage=dict(estimator="grpo", eps=1e-6),
           loss=dict(eps_low=0.2, eps_high=0.28, dual_clip_c=None, aggregation="token-mean",
                     kl_coef=0.0),
           optimizer=dict(learning_rate=1e-6, warmup_steps=20, weight_decay=0.01,
                          grad_clip_norm=1.0),
           # 512 x 16 kept = 8,192 rows of <= 13,312 tokens a step: 256 micro-batches at
           # fsdp 8 (experiments.preflight prints the plan of each stage's shape).
           step=dict(micro_batches=512 * 16 // (fsdp * RL_SEQS_PER_SHARD),
                     logprob_chunk=1024))
  agent = dict(max_turns=10, max_response_tokens=8192, temperature=1.0, top_p=1.0)
  c.stage1 = s(sections.RLStage, num_steps=300, agent=agent, hard_k=8)
  c.stage2 = s(sections.RLStage, num_steps=85, agent=dict(agent, max_response_tokens=12_288),
               hard_k=8)
  # Only problems the policy does not solve 8/8 (17.3K of 42K), optimizer reset, 15 turns.
  c.stage3 = s(sections.RLStage, num_steps=125, hard_only=True, hard_k=8, reset_optimizer=True,
               agent=dict(agent, max_response_tokens=12_288, max_turns=15))
  # The in-run evaluation, within the rollout servers' context (MAX_LEN): 16 samples at
  # the training temperature and stage 3's budgets. It is not the report's protocol
  # (section 5.1: temperature 0.6, 30,720 tokens, 30 turns), which needs servers started
  # with a 32K context: `--config.eval.protocol=report` applies it here, and
  # experiments/configs/eval_rstar2_agent_14b.py (its docstring gives the command) runs
  # the report's whole table on the final export. Every evaluation prints its protocol.
  c.eval = s(sections.EvalStage, after_sft=False, k=16, protocol="config",
             agent=dict(max_turns=15, max_response_tokens=12_288, temperature=1.0, top_p=1.0))
  return c


def _cluster() -> ml_collections.ConfigDict:
  """experiments.launch_cluster's fleet for LAYOUT on a running Ray cluster."""
  lay = layout()
  ckpt = f"{SHARED}/runs/sft/sft/export"   # experiments/slurm/rstar2_14b_sft.sbatch's export
  c = ml_collections.ConfigDict()
  c.cluster = sections.section(
      sections.ClusterConfig, ray_address="auto", placement="SPREAD",
      sandbox_servers=lay.sandbox_servers, sandbox_cpus=16.0,
      sandbox_args=("--max-children", str(lay.sandbox_children)),
      rollout_servers=lay.rollout_servers, rollout_backend="sglang", rollout_hf_dir=ckpt,
      rollout_cpus=4.0, rollout_gpus=float(lay.gpus_per_server),
      rollout_args=sections.sglang_args(lay, MAX_LEN),
      trainer_processes=lay.trainer_nodes, trainer_cpus=32.0,
      trainer_gpus=float(lay.gpus_per_node), trainer_module="experiments.recipe",
      trainer_config="experiments/configs/rstar2_agent_14b.py",
      trainer_args=(f"--config.workdir={SHARED}/runs/rstar2_14b",
                    f"--config.model.hf_dir={ckpt}", f"--config.tokenizer.path={ckpt}",
                    f"--config.rollout.weight_sync.dir={SHARED}/weights",
                    "--stages=stage1,stage2,stage3,eval"),
      log_dir=f"{SHARED}/runs/rstar2_14b/cluster_logs")
  return c
