r"""python -m experiments.evaluate --config experiments/configs/eval_rstar2_agent_14b.py --config.workdir=/runs/eval_rstar2_14b --hf_dir=/models/rStar2-Agent-14B --suite=report --benchmarks=aime24=/data/aime24.parquet,aime25=/data/aime25.parquet,hmmt25=/data/hmmt25.parquet,math500=/data/math500.parquet,gpqa_diamond=/data/gpqa_diamond.csv --config.rollout.servers="('http://127.0.0.1:30000',)"

The report's evaluation table for a released checkpoint (rStar2-Agent-14B) on one GPU
node: generation on SGLang servers that serve --hf_dir themselves, tool calls on a local
sandbox, grading here. docs/guides/evaluation.md walks through it.

config.eval is the report's protocol (rstar_jax/eval/suite.py, PROTOCOLS["report"]:
16 samples, temperature 0.6, top-p 1.0, 30,720 response tokens, 30 turns), so
--protocol=config and --protocol=report run the same; engine.max_len holds prompt and
response for --config.rollout.backend=jax (the in-process engine: slow at 14B, for checks).
config.data and config.tokenizer are not used by --suite: the benchmarks come from
--benchmarks, the tokenizer from --hf_dir.

Result and wall time: not measured yet (it needs a GPU node and the released checkpoint).
"""
from experiments.configs import rstar2_agent_14b
from rstar_jax.recipe import sections


def get_config():
  c = rstar2_agent_14b.get_config()
  s = sections.section
  c.workdir = "/tmp/rstar2_eval"
  c.mesh = s(sections.MeshConfig, enabled=False)
  # The architecture comes from --hf_dir; the preset only makes the section build. What
  # --suite takes from here are the runtime fields (dtypes, attention), for backend jax.
  c.model = s(sections.ModelConfig, preset="qwen3-14b", param_dtype="bfloat16",
              dtype="bfloat16", remat_policy="none", attention_impl="auto")  # cuDNN on NVIDIA, else chunked
  c.tokenizer = s(sections.TokenizerConfig)   # unused: --hf_dir's tokenizer
  c.data = s(sections.DataConfig)             # unused: --benchmarks
  # The sandbox on the node's CPUs: 16 samples x 30 problems run at once with a few
  # calls each; 10 s per call as in training.
  c.tools = s(sections.ToolsConfig, urls=(), local_max_children=16, timeout_s=10.0)
  c.rollout = s(sections.RolloutConfig, backend="sglang",
                servers=("http://127.0.0.1:30000",),
                engine=dict(num_slots=16, max_len=32_768))   # 30,720 + the prompt
  k, agent = sections.PROTOCOLS["report"]
  c.eval = s(sections.EvalStage, after_sft=False, k=k, agent=agent)
  for stage in sections.RL_STAGES:
    getattr(c, stage).num_steps = 0
  c.sft.enabled = False
  return c
