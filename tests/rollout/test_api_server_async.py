"""Asynchronous rollouts (rl.async_rollouts.max_staleness = 1) through a real rollout
server (`python -m rstar_jax.rollout.api_server`): the trainer's worker thread publishes each
version as a checkpoint on disk and moves the server onto it by version, and every
trajectory of step t reports (from the server's replies) the version
max(t - 1, 0) that the schedule says generated it.

Its own server (not the session's `served` ones: this test moves the server's weights).
"""
from __future__ import annotations

import asyncio

from rstar_jax.data import math_problems, toy_task
from rstar_jax.model import hf_io, qwen3
from rstar_jax.model.model_config import Qwen3Config
from rstar_jax.rl import async_rollouts as async_lib
from rstar_jax.rl import roc
from rstar_jax.rl import trainer as rl_trainer
from rstar_jax.rollout import chat
from rstar_jax.rollout.sglang.transport import ClientConfig
from rstar_jax.rollout.agent_loop import AgentConfig
from rstar_jax.rollout.backends import RolloutConfig, build_engine_pool
from rstar_jax.rollout.weight_sync import WeightSyncConfig
from rstar_jax.train.step import StepConfig

from tests.rollout.conftest import ServerProcess

CLIENT = ClientConfig(backoff_s=0.05, backoff_max_s=0.2, retries=2, probe_interval_s=0.2,
                         load_poll_s=0.2)
STEPS = 3


class Tools:
  async def execute(self, calls):
    await asyncio.sleep(0)
    return [{"status": "ok", "stdout": "1\n", "stderr": ""} for _ in calls]


def test_k1_through_a_rollout_server_uses_the_scheduled_versions(tmp_path, toy_tok):
  cfg = Qwen3Config(vocab_size=toy_tok.vocab_size, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=8, initializer_range=0.3, rope_theta=10_000.0)
  tok_dir, model_dir = str(tmp_path / "tokenizer"), str(tmp_path / "m0")
  toy_tok.save(tok_dir)
  hf_io.save_hf(qwen3.create_model(cfg, seed=0), model_dir, dtype="float32",
                tokenizer_dir=tok_dir)
  server = ServerProcess(model_dir, str(tmp_path), "async")
  pool = None
  try:
    server.wait_ready()
    model = qwen3.create_model(cfg, seed=0)
    pool = build_engine_pool(
        RolloutConfig(backend="server", servers=(server.url,), client=CLIENT,
                      weight_sync=WeightSyncConfig(dtype="float32", keep=2)),
        model, workdir=str(tmp_path))
    proto = chat.ChatProtocol(toy_tok, toy_task.toy_chat_config())
    problems = [math_problems.MathProblem(uid=f"p{i}", problem=p.problem, answer=str(p.answer),
                                      source="toy")
                for i, p in enumerate(toy_task.generate_problems(8, seed=0, levels=(1,)))]
    rl = rl_trainer.RLConfig(
        prompts_per_step=2, samples_per_prompt=2, checkpoint_every=10,
        downsample=roc.DownsampleConfig(group_size=2), step=StepConfig(micro_batches=1),
        async_rollouts=async_lib.AsyncRolloutsConfig(max_staleness=1))
    agent = AgentConfig(max_turns=2, max_response_tokens=16)
    t = rl_trainer.RLTrainer(rl, agent, model, toy_tok, proto, problems, engines=pool,
                             tools=Tools(), workdir=str(tmp_path / "stage1"), seed=0)
    seen = {}
    try:
      history = t.run(STEPS, progress=False,
                      on_step=lambda s, m: seen.update({s - 1: list(t.last_trajectories)}))
      names = {s: t.weight_version(s) for s in range(STEPS)}
    finally:
      t.close()
    for step, m in enumerate(history):
      v = max(step - 1, 0)
      assert m["async/behaviour_version"] == v and m["async/stale_dropped_groups"] == 0
      assert m["async/staleness_max"] == step - v <= 1
      # The server's replies name the version: the one published for this step.
      assert {tuple(tr.weight_versions) for tr in seen[step]} == {(names[v],)}, step
    # Versions 0 and 1 were published (2 would be needed by step 3: not in the stage).
    assert pool.weight_sync.version == names[1]
  finally:
    if pool is not None:
      pool.stop()
    server.kill()
