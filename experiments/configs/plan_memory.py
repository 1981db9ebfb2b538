r"""python -m experiments.plan_memory --config=experiments/configs/plan_memory.py

Ahead-of-time memory plan of the Qwen3-14B GRPO train step on fake-device meshes: by
default the 14B layout's trainer mesh (fsdp 8 x tensor 4 on 32 devices,
experiments/configs/rstar2_agent_14b.py) and fsdp 8 x tensor 8 (all 64 devices training,
as a colocated layout would). Result (docs/results.md: 2026-11-24, commit efa4ed3, with
--config.micro_batch=1,2, on a 2-core CPU host; the figures do not depend on its speed):
fsdp 64 20.04 GB per device (8K tokens, mb 1), fsdp 8 x tensor 8 16.59 GB. Every case
of the Cartesian product of the list fields below is compiled, one at a time (3-10 s each
on a 2-core machine, measured; the default 4 cases take ~35 s). For the 14B config's own
shapes per stage (micro-batches, KL reference, the batch length capped at
rollout.engine.max_len) run
`python -m experiments.preflight --config experiments/configs/rstar2_agent_14b.py`. E.g.

  python -m experiments.plan_memory --config=experiments/configs/plan_memory.py \
    --config.meshes="fsdp=8,tensor=8" --config.response_lens=12288 \
    --config.micro_batch=1,2,4 --config.remat_policy=full,dots_no_batch

Fields:
  meshes: ';'-separated meshes, each comma-separated axis=size over (data, fsdp, tensor).
  response_lens: comma-separated response budgets; a sequence is prompt_len + response.
  micro_batch: comma-separated sequences per micro-batch per batch shard (data x fsdp).
  remat_policy: comma-separated, from none, full, dots, dots_no_batch, qkv_proj.
  attention_impl: comma-separated, from xla (full [T, T] scores), chunked, blockwise.
  attention_chunk: comma-separated query-block lengths, used with chunked and blockwise.
  param_dtype: comma-separated master-weight dtypes (float32 = fp32 master weights).
  dtype: compute dtype of the matmuls.
  micro_batches: gradient-accumulation steps (a lax.scan: temp memory does not grow).
  kl_coef: rl.loss.kl_coef; > 0 adds the KL reference's parameters (a copy of the params'
    shards, no optimizer state) to each row's peak, and its log-probs to the batch.
  top_temp: if > 0, list this many of the largest temp buffers under each row (from XLA's
    buffer-assignment dump) to see what dominates.
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.preset = "qwen3-14b"
  c.meshes = "fsdp=8,tensor=4;fsdp=8,tensor=8"
  c.prompt_len = 1024
  c.response_lens = "8192,12288"
  c.micro_batch = "1"
  c.remat_policy = "full"
  c.attention_impl = "chunked"
  c.param_dtype = "float32"
  c.dtype = "bfloat16"
  c.micro_batches = 2
  c.attention_chunk = "1024"
  c.logprob_chunk = 512
  c.compute_entropy = True
  c.kl_coef = 0.0
  c.top_temp = 0
  return c
