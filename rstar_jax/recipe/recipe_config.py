"""The recipe's config: one `RecipeConfig` whose sections are the keyword arguments of
the dataclasses they build (model, tokenizer, chat, data, tools, rollout, mesh, sft, rl,
stage1..3, eval, distributed), the stage-specific sections (`SFTStage`, `RLStage`,
`EvalStage`), and `build_config`, which checks all of it before anything runs.
Experiment configs name these through `rstar_jax.recipe.sections`; `stages` runs them.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from rstar_jax import config_utils, distributed, sharding
from rstar_jax.data import data_config
from rstar_jax.eval import eval_runs as eval_lib
from rstar_jax.eval import suite as eval_suite
from rstar_jax.model import model_config
from rstar_jax.recipe import preflight_checks, workdir_state
from rstar_jax.rl import trainer as rl_trainer
from rstar_jax.rollout import agent_loop, backends, chat
from rstar_jax.rollout import sandbox_client as tools_lib
from rstar_jax.sft import trainer as sft_trainer

# The stages in run order: SFT and the RL stages leave a directory each
# (workdir_state.STAGE_DIRS), the final evaluation its report.
RL_STAGES = workdir_state.STAGE_DIRS[1:]
ALL_STAGES = (*workdir_state.STAGE_DIRS, "eval")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTStage(sft_trainer.SFTConfig):
  """`config.sft`: the SFT trainer's config plus whether to run it and on what data."""
  enabled: bool = True
  data: data_config.SFTDataConfig = dataclasses.field(default_factory=data_config.SFTDataConfig)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLStage:
  """`config.stage1..3`: what differs between RL stages (the rest is `config.rl`).

  Attributes:
    num_steps: RL steps of the stage (0 skips it).
    agent: turn and token budget and sampling of the stage's rollouts.
    hard_only: train only on problems the policy does not solve hard_k out of hard_k.
    hard_k: samples per problem for that filter.
    hard_pool: filter the first hard_pool training problems (0: all).
    reset_optimizer: start with fresh Adam moments instead of the previous stage's.
  """
  num_steps: int = 10
  agent: agent_loop.AgentConfig = dataclasses.field(default_factory=agent_loop.AgentConfig)
  hard_only: bool = False
  hard_k: int = 8
  hard_pool: int = 0
  reset_optimizer: bool = False

  def __post_init__(self):
    for name, low in (("num_steps", 0), ("hard_k", 1), ("hard_pool", 0)):
      if getattr(self, name) < low:
        raise ValueError(f"RLStage.{name} must be >= {low}, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalStage(eval_lib.EvalConfig):
  """`config.eval`: the evaluation, and whether to run it after SFT too.

  Attributes:
    protocol: "config": `k` and `agent` as configured. "report": the rStar2-Agent
      report's (arXiv 2508.20722 section 5.1: 16 samples, temperature 0.6, 30,720
      tokens, 30 turns; `eval.suite.PROTOCOLS`), whatever `k` and `agent` say, so that
      the recipe's table can be set beside the report's; the rollout engine must hold
      30,720 tokens past the prompt. "greedy": temperature 0, one sample. Every
      evaluation prints the protocol it used.
  """
  after_sft: bool = True
  protocol: str = "config"

  def __post_init__(self):
    super().__post_init__()
    if self.protocol not in eval_suite.PROTOCOL_NAMES:
      raise ValueError(f"EvalStage.protocol={self.protocol!r}; choose from "
                       f"{eval_suite.PROTOCOL_NAMES}")

  def resolved(self) -> eval_lib.EvalConfig:
    """The settings the evaluation runs with (`protocol` applied)."""
    if self.protocol == "config":
      return self
    return eval_suite.protocol(self.protocol, self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecipeConfig:
  """The whole run. `seed` seeds everything (tokenizer, data, init, rollouts).

  Attributes:
    compile_cache: keep XLA's compiled programs on disk (JAX's persistent cache), so that
      later stages, a resumed run and a rerun load them instead of compiling again.
    compile_cache_dir: where (empty: <workdir>/compile_cache). Several runs may share one
      directory at once, e.g. a sweep's points (`experiments/sweep.py` sets it to
      <sweep dir>/compile_cache): the programs do not depend on the seed or the workdir.
    allow_random_init: let an RL stage or evaluation start from a randomly initialised
      model (no finished earlier stage, no model.hf_dir). Off: refused, since it is
      almost always a mistake (SFT not run, wrong work directory).
    allow_config_change: run with a config that differs from the work directory's
      config.json although stages are finished; the new config is written beside the
      old one (config_<n>.json) with the difference logged.
  """
  seed: int = 0
  workdir: str = "/tmp/rstar_run"
  compile_cache: bool = True
  compile_cache_dir: str = ""
  allow_random_init: bool = False
  allow_config_change: bool = False
  distributed: distributed.DistributedConfig = dataclasses.field(
      default_factory=distributed.DistributedConfig)
  mesh: sharding.MeshConfig = dataclasses.field(default_factory=sharding.MeshConfig)
  model: model_config.ModelConfig = dataclasses.field(
      default_factory=lambda: model_config.ModelConfig(preset="tiny"))
  tokenizer: data_config.TokenizerConfig = dataclasses.field(
      default_factory=data_config.TokenizerConfig)
  chat: chat.ChatConfig = dataclasses.field(default_factory=chat.ChatConfig)
  data: data_config.DataConfig = dataclasses.field(default_factory=data_config.DataConfig)
  tools: tools_lib.ToolsConfig = dataclasses.field(default_factory=tools_lib.ToolsConfig)
  rollout: backends.RolloutConfig = dataclasses.field(default_factory=backends.RolloutConfig)
  sft: SFTStage = dataclasses.field(default_factory=SFTStage)
  rl: rl_trainer.RLConfig = dataclasses.field(default_factory=rl_trainer.RLConfig)
  stage1: RLStage = dataclasses.field(default_factory=RLStage)
  stage2: RLStage = dataclasses.field(default_factory=lambda: RLStage(num_steps=0))
  stage3: RLStage = dataclasses.field(default_factory=lambda: RLStage(num_steps=0))
  eval: EvalStage = dataclasses.field(default_factory=EvalStage)

  def __post_init__(self):
    if not self.workdir:
      raise ValueError("RecipeConfig.workdir must be set")
    max_len = self.rollout.engine.max_len
    for name in RL_STAGES:
      budget = getattr(self, name).agent.max_response_tokens
      if getattr(self, name).num_steps and budget >= max_len:
        raise ValueError(f"{name}.agent.max_response_tokens={budget} does not fit "
                         f"rollout.engine.max_len={max_len} (prompt + response)")
    if self.eval.agent.max_response_tokens >= max_len:
      raise ValueError(f"eval.agent.max_response_tokens={self.eval.agent.max_response_tokens}"
                       f" does not fit rollout.engine.max_len={max_len}")


def build_config(config, stages: Sequence[str] | None = None) -> RecipeConfig:
  """The checked RecipeConfig of a config section (ConfigDict or dict). With `stages`
  (the run's), a run that generates nothing (`generates`) needs no rollout servers: an
  HTTP backend without `rollout.servers` gets NO_SERVERS, which nothing contacts."""
  if isinstance(config, RecipeConfig):
    return config
  if stages is not None:
    rollout = _section(config, "rollout")
    if (rollout.get("backend") in preflight_checks.HTTP_BACKENDS
        and not rollout.get("servers") and not rollout.get("servers_file")
        and not generates(config, stages)):
      config = config_utils.to_dict(config)
      config["rollout"] = dict(config_utils.to_dict(config["rollout"]), servers=NO_SERVERS)
  return config_utils.build(RecipeConfig, config, "config")


# The servers of a run that generates nothing (SFT without its evaluation): a name that
# never resolves (RFC 2606 .invalid). rollout.servers is a launch key, so the RL run that
# follows on the same work directory with the real URLs is not a config change.
NO_SERVERS = ("http://no-rollouts-in-this-run.invalid",)


def _section(config, name: str) -> dict:
  if isinstance(config, RecipeConfig):
    return dataclasses.asdict(getattr(config, name))
  value = config.get(name) if hasattr(config, "get") else None
  return config_utils.to_dict(value) if value is not None else {}


def generates(config, stages: Sequence[str] | None) -> bool:
  """Whether a run of `stages` (None: all) builds rollout engines: an RL stage with
  steps, the final evaluation, or SFT's evaluation (eval.after_sft). `config` is a
  RecipeConfig or its section (ConfigDict or dict; a missing key is the default)."""
  wanted = set(stages or ALL_STAGES)
  if "eval" in wanted:
    return True
  defaults = {f.name: f.default_factory() for f in dataclasses.fields(RecipeConfig)
               if f.name in RL_STAGES}   # stage1 runs by default; stages 2 and 3 do not
  for name in RL_STAGES:
    if name in wanted and _section(config, name).get("num_steps",
                                                      defaults[name].num_steps) > 0:
      return True
  if "sft" in wanted:
    sft, ev = _section(config, "sft"), _section(config, "eval")
    return bool(sft.get("enabled", SFTStage.enabled) and ev.get("after_sft",
                                                                 EvalStage.after_sft))
  return False
