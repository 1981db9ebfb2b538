"""The one module an experiment config imports: every section dataclass and config helper.

A config file (`experiments/configs/*.py`) writes each section with
`section(Cls, **values)`, naming `Cls` from here:

  from rstar_jax.recipe import sections

  def get_config(variant: str = ""):
    c = sections.section(sections.RecipeConfig, workdir="/tmp/run")
    c.model = sections.section(sections.ModelConfig, preset="small")
    ...

Each name below is imported from the module that defines it, so a config never needs
to know where in the package a dataclass lives, and a new config is written from this
list alone. `tests/test_config_imports.py` holds both sides to it: configs import
nothing else of the package, and every dataclass their sections build is named here.
"""
from rstar_jax.config_utils import as_plain, section
from rstar_jax.data.data_config import DataConfig, SFTDataConfig, TokenizerConfig, ToyDataConfig
from rstar_jax.data.toy_task import TraceConfig, toy_chat_config
from rstar_jax.distributed import DistributedConfig
from rstar_jax.eval.suite import PROTOCOLS
from rstar_jax.model.model_config import ModelConfig
from rstar_jax.optim import OptimizerConfig
from rstar_jax.recipe.cluster import ClusterConfig
from rstar_jax.recipe.layout import Layout, sglang_args
from rstar_jax.recipe.recipe_config import RL_STAGES, EvalStage, RecipeConfig, RLStage, SFTStage
from rstar_jax.rl.advantages import AdvantageConfig
from rstar_jax.rl.async_rollouts import AsyncRolloutsConfig
from rstar_jax.rl.losses import LossConfig
from rstar_jax.rl.roc import DownsampleConfig
from rstar_jax.rl.trainer import RLConfig
from rstar_jax.rollout.agent_loop import AgentConfig
from rstar_jax.rollout.backends import RolloutConfig
from rstar_jax.rollout.chat import ChatConfig
from rstar_jax.rollout.jax_engine import EngineConfig
from rstar_jax.rollout.sandbox_client import ToolsConfig
from rstar_jax.rollout.sglang.transport import ClientConfig
from rstar_jax.rollout.weight_sync import WeightSyncConfig
from rstar_jax.sharding import MeshConfig
from rstar_jax.train.step import StepConfig

__all__ = [
    # Writing a section, and a built dataclass back as the plain values a section takes.
    "section", "as_plain",
    # The recipe's whole tree (config.*) and its stages.
    "RecipeConfig", "SFTStage", "RLStage", "EvalStage", "RL_STAGES",
    # Processes and devices: config.distributed, config.mesh.
    "DistributedConfig", "MeshConfig",
    # The model: config.model.
    "ModelConfig",
    # Data: config.tokenizer, config.data (its toy task), config.sft.data (its traces).
    "TokenizerConfig", "DataConfig", "ToyDataConfig", "SFTDataConfig", "TraceConfig",
    # Chat protocol and tools: config.chat, config.tools; the toy task's short chat texts.
    "ChatConfig", "ToolsConfig", "toy_chat_config",
    # Rollouts: config.rollout (its engine, weight sync, HTTP client), the stages' agents.
    "RolloutConfig", "EngineConfig", "WeightSyncConfig", "ClientConfig", "AgentConfig",
    # Training: config.rl and its sub-sections; optimizer and step are SFT's too.
    "RLConfig", "DownsampleConfig", "AdvantageConfig", "LossConfig", "AsyncRolloutsConfig",
    "OptimizerConfig", "StepConfig",
    # Evaluation: the named protocols' (k, agent), e.g. PROTOCOLS["report"].
    "PROTOCOLS",
    # Multi-node runs: the `:layout` variant, its SGLang server flags, the Ray fleet.
    "Layout", "sglang_args", "ClusterConfig",
]
