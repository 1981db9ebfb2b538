r"""python -m experiments.local_slurm rehearse --dir /tmp/rstar_slurm

The 14B run rehearsed on one CPU host: experiments/configs/rstar2_agent_14b.py with its
stages (SFT, RL stages 1-3 with stage 3's hard-only filter and optimizer reset, the final
evaluation), its process layout (8 nodes of 8 "GPUs": 4 trainer processes, one a node, a
sandbox server on each trainer node, rollout servers on the other 4), its mesh (fsdp 8 x
tensor 4 over the 32 trainer devices), its dtypes, remat and backends (rollout.backend
"sglang", our SGLang-API server standing in for SGLang), and only the sizes swapped: a
tiny Qwen3 (2 layers x 64, 4 KV heads so that tensor 4 divides them), the toy task's
problems, tokenizer and short chat texts, 1-2 RL steps a stage, a few problems.

Devices are CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8 per trainer
process). One rollout server a rollout node (the 14B layout runs 8, one per GPU): 32 JAX
server processes would not start within minutes on 2 cores; the servers' URLs, the
weight sync and the client are the same.

Variants: "" the batch script's run (RL and evaluation from --config.model.hf_dir, the
SFT export, whose tokenizer it reads: --config.tokenizer.path); "sft" the SFT stage from
a random tiny model with the toy tokenizer trained on the spot; "layout" and "cluster"
as the 14B file's (experiments.preflight, experiments.launch_cluster).

Result (docs/guides/cluster.md, 2026-11-28, a 2-core AMD EPYC VM shared with other test
runs, load 6-12): SFT 61 steps, loss 6.6 -> 0.48, in 5m32s; the uninterrupted `sbatch`
run of stages 1-3 and the final table in 2m59s; a time-limit requeue and a killed trainer
task each ended with the same metrics bit for bit (4m00s, 7m10s).
"""
import ml_collections

from experiments.configs import rstar2_agent_14b as base
from experiments.configs import toy
from rstar_jax.recipe import sections

# The 14B layout with one server per rollout node, each holding the node's 8 devices.
LAYOUT = dict(base.LAYOUT, servers_per_node=1, gpus_per_server=8, sandbox_children=4)
TENSOR = base.TENSOR
MAX_LEN = 320                       # prompt + response (the servers' --context-length)
RL_SEQS_PER_SHARD = 2               # 32 rows a step over 8 fsdp shards: 2 micro-batches
PROMPTS, SAMPLES, KEEP = 8, 8, 4    # 8 prompts x 8 samples, RoC keeps 4 per group
SHARED = "/tmp/rstar_slurm/shared"  # experiments.local_slurm's default --dir's storage


def layout() -> sections.Layout:
  return sections.Layout(**LAYOUT)


def get_config(variant: str = ""):
  if variant == "layout":
    return sections.section(sections.Layout, **LAYOUT)
  if variant == "cluster":
    return _cluster()
  if variant not in ("", "sft"):
    raise ValueError(f"rstar2_agent_14b_rehearsal.py: unknown variant {variant!r}; known: "
                     "sft, layout, cluster")
  c = base.get_config()
  smoke = toy.get_config("smoke")
  lay = layout()
  fsdp = lay.trainer_devices // TENSOR
  # The mesh is the 14B file's (fsdp 8 x tensor 4); only the model shrinks (4 KV heads:
  # tensor 4 divides them). SFT starts from a random one; later runs load the SFT export
  # (--config.model.hf_dir), checked against these sizes.
  c.model.update(preset="tiny" if variant == "sft" else None, hidden_size=64,
                 intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, head_dim=16, tie_word_embeddings=True)
  c.chat = smoke.chat
  c.data = smoke.data
  if variant == "sft":
    c.tokenizer = smoke.tokenizer   # SFT generates nothing: no rollout.servers needed
  else:
    c.tokenizer.kind = "hf"     # the SFT export's (--config.tokenizer.path, given at launch)
  c.tools.update(local_max_children=2, timeout_s=5.0)
  c.rollout.engine.update(num_slots=16, max_len=MAX_LEN)

  c.sft.update(epochs=1.0, seq_len=256, rows_per_step=fsdp, heldout_share=0.05,
               eval_every=10, checkpoint_every=20)
  c.sft.data = smoke.sft.data
  c.sft.optimizer = smoke.sft.optimizer   # ~60 steps: a policy that answers some problems
  c.sft.step.update(micro_batches=1, logprob_chunk=256)

  c.rl.update(prompts_per_step=PROMPTS, samples_per_prompt=SAMPLES, checkpoint_every=1,
              length_multiple=64)
  c.rl.downsample.group_size = KEEP
  c.rl.optimizer.update(learning_rate=smoke.rl.optimizer.learning_rate, warmup_steps=1)
  c.rl.step.update(micro_batches=PROMPTS * KEEP // (fsdp * RL_SEQS_PER_SHARD),
                   logprob_chunk=256)
  c.stage1.update(num_steps=2, hard_k=2)
  c.stage1.agent.update(max_response_tokens=48, max_turns=4)
  c.stage2.update(num_steps=1, hard_k=2)
  c.stage2.agent.update(max_response_tokens=64, max_turns=4)
  c.stage3.update(num_steps=1, hard_k=2, hard_pool=16)
  c.stage3.agent.update(max_response_tokens=64, max_turns=6)
  c.eval.update(k=2)
  c.eval.agent.update(max_response_tokens=48, max_turns=6)
  return c


def _cluster() -> ml_collections.ConfigDict:
  """launch_cluster's fleet for the rehearsal layout on a local Ray cluster started with
  `ray start --head --node-ip-address=127.0.0.1` (docs/guides/cluster.md, "Rehearsal"):
  4 sandbox servers, 4 of our rollout servers (rollout_backend "server": the launcher
  runs sglang.launch_server for "sglang"), 4 trainer processes of 8 CPU devices each,
  starting from the SFT export that `experiments.local_slurm rehearse` leaves in SHARED."""
  c = base.get_config("cluster")
  lay = layout()
  sft = f"{SHARED}/sft/sft/export"
  c.cluster.update(
      ray_address="127.0.0.1:6379", sandbox_servers=lay.sandbox_servers, sandbox_cpus=0.1,
      sandbox_args=("--max-children", str(lay.sandbox_children)),
      rollout_servers=lay.rollout_servers, rollout_backend="server", rollout_hf_dir=sft,
      rollout_cpus=0.1, rollout_gpus=0.0,
      rollout_args=("--num_slots", "16", "--max_len", str(MAX_LEN), "--min_prefill_bucket",
                    "16", "--enable-deterministic-inference"),
      trainer_processes=lay.trainer_nodes, trainer_cpus=0.1, trainer_gpus=0.0,
      trainer_config="experiments/configs/rstar2_agent_14b_rehearsal.py",
      trainer_args=(f"--config.workdir={SHARED}/runs/ray", f"--config.model.hf_dir={sft}",
                    f"--config.tokenizer.path={sft}",
                    f"--config.rollout.weight_sync.dir={SHARED}/weights/ray",
                    f"--config.compile_cache_dir={SHARED}/compile_cache",
                    "--stages=stage1,stage2,stage3,eval"),
      log_dir=f"{SHARED}/runs/ray/cluster_logs", restart_backoff_s=1.0,
      forward_env=(*c.cluster.forward_env, "XLA_FLAGS", "JAX_PLATFORMS"))
  return c
