"""The device check's rollouts section: JaxEngine prefill and decode of the slice against
the HBM roofline, then multi-turn rollouts through the agent loop, the sandbox and the
tool protocol with scripted tool calls (thought in plain tokens: `PlainThinking`)."""
from __future__ import annotations

import collections
import dataclasses
import shutil
import time
from typing import Any

from absl import flags

from experiments.device_check.checks import (TARGETS, check_at_least, check_row,
                                             check_scripted_calls)
from experiments.device_check.workload import on_accelerator, sizes, slice_config

FLAGS = flags.FLAGS


class PlainThinking:
  """The engine a scripted rollout thinks with (`ToolCallingEngine`), less the markup: a
  thinking turn's random tokens that would spell a protocol tag (any token with '<' or
  '>' in its text, and the tokenizer's special tokens) become a plain token, so the
  turn's text is thinking and then exactly one scripted call. A random model samples
  the tags as ordinary tokens, and a turn holding one parsed as a malformed call that
  never reached the sandbox. Other turns pass through unchanged."""

  def __init__(self, inner, tokenizer):
    self.inner = inner
    vocab = tokenizer.vocab_size
    special = set(getattr(tokenizer, "special_ids", None) or ())
    texts = {i: tokenizer.decode([i]) for i in range(vocab)}
    self.banned = {i for i, t in texts.items() if "<" in t or ">" in t or i in special}
    self.filler = next(i for i, t in texts.items()
                       if i not in self.banned and t.strip().isalpha())
    self.replaced = 0

  async def generate(self, request):
    out = await self.inner.generate(request)
    if request.stop_token_ids:   # not a thinking turn (those sample with no stop ids)
      return out
    ids = [self.filler if i in self.banned else i for i in out.output_ids]
    self.replaced += sum(a != b for a, b in zip(ids, out.output_ids))
    return dataclasses.replace(out, output_ids=ids)

  def __getattr__(self, name):
    return getattr(self.inner, name)


def section_rollouts(ctx: dict[str, Any]) -> dict[str, Any]:
  import asyncio

  import jax
  import numpy as np

  from experiments.common.scripted_rollouts import TimedTools, ToolCallingEngine
  from rstar_jax.data import toy_task
  from rstar_jax.model import model_config, qwen3
  from rstar_jax.rollout import chat
  from rstar_jax.rollout.agent_loop import AgentConfig, run_many
  from rstar_jax.rollout.jax_engine import EngineConfig, GenerationRequest, JaxEngine
  from rstar_jax.rollout.scheduler import EnginePool
  from rstar_jax.rollout.sandbox_client import SandboxTools
  from sandbox.launcher import running_server

  sz = sizes()
  env = ctx.get("env", {})
  out: dict[str, Any] = {}
  # (1) prefill and decode of the slice at `slots` slots, weights in bf16 as a rollout
  # server holds them (a decode step reads every weight once: bytes set its time).
  cfg = slice_config(param_dtype="bfloat16", remat_policy="none")
  model = qwen3.create_model(cfg, seed=0)
  slots, p, n = sz["slots"], sz["prompt"], sz["new_tokens"]
  max_len = 1 << (p + n).bit_length()
  ecfg = EngineConfig(num_slots=slots, max_len=max_len, prefill_batch_tokens=slots * p)
  engine = JaxEngine(model, ecfg)
  rng = np.random.RandomState(0)

  def generate(seed):
    reqs = [GenerationRequest(input_ids=rng.randint(0, cfg.vocab_size, p).tolist(),
                              max_new_tokens=n, temperature=1.0, top_p=1.0, top_k=0,
                              seed=seed * 1000 + i) for i in range(slots)]
    before = dict(engine.metrics)
    t = time.perf_counter()
    outs = engine.generate_sync(reqs)
    wall = time.perf_counter() - t
    if sum(len(o.output_ids) for o in outs) != slots * n:
      raise RuntimeError("the engine returned fewer tokens than asked for")
    return wall, {k: engine.metrics[k] - before.get(k, 0) for k in engine.metrics}

  first_wall, _ = generate(0)   # compiles the prefill and decode shapes
  wall, m = generate(1)
  engine.stop()
  decode_step_s = m["decode_s"] / max(m["decode_steps"], 1)
  # Fewest bytes a decode step must read: every weight once (bf16) and the k/v of the
  # filled positions (prompt + half the new tokens on average), across every slot.
  weight_bytes = cfg.num_params * 2 - cfg.vocab_size * cfg.hidden_size * 2  # no embed table
  kv_bytes = (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
              * slots * (p + n // 2))
  step_bytes = weight_bytes + kv_bytes
  bw = env.get("read_bandwidth_gbs")
  roofline_s = step_bytes / (bw * 1e9) if bw else None
  sheet = env.get("data_sheet")
  sheet_s = step_bytes / (sheet["hbm_tbs"] * 1e12) if sheet else None
  out["engine"] = {
      "slots": slots, "prompt": p, "new_tokens": n, "max_len": max_len,
      "num_params": cfg.num_params, "first_run_s": first_wall, "wall_s": wall,
      "prefill_s": m["prefill_s"], "prefill_calls": m["prefill_calls"],
      "prefill_tokens_per_s": slots * p / m["prefill_s"] if m["prefill_s"] else None,
      "decode_s": m["decode_s"], "decode_steps": m["decode_steps"],
      "decode_step_s": decode_step_s, "decode_tokens_per_s": slots / decode_step_s,
      "decode_step_bytes": step_bytes, "read_bandwidth_gbs": bw,
      "roofline_step_s": roofline_s, "roofline_fraction": roofline_s / decode_step_s
      if roofline_s else None,
      "data_sheet_roofline_fraction": sheet_s / decode_step_s if sheet_s else None}
  del engine, model
  checks = []
  frac = out["engine"]["roofline_fraction"]
  checks.append(check_row("decode step / HBM roofline (measured bandwidth)", frac,
                          f">= {TARGETS['decode_roofline_min']:g}",
                          check_at_least(frac, "decode_roofline_min") if on_accelerator() else None,
                          "" if on_accelerator() else "CPU"))
  # (2) multi-turn rollouts through the agent loop, the sandbox and the tool protocol.
  tok = toy_task.train_toy_tokenizer(1024)
  proto = chat.ChatProtocol(tok, toy_task.toy_chat_config())
  small = model_config.get_preset("tiny" if FLAGS.tiny else "small", vocab_size=tok.vocab_size,
                                  dtype="bfloat16")
  engine = JaxEngine(qwen3.create_model(small, seed=1), EngineConfig(num_slots=16, max_len=512))
  k = sz["trajectories"]
  problems = toy_task.generate_problems(k, seed=3)
  uids = [f"p{i}" for i in range(k)]
  calls = {u: tok.encode(chat.assistant_text({"content": "", "tool_calls": [{
      "name": toy_task.TOY_TOOL_NAME, "arguments": {"code": pr.code}}]}))
           for u, pr in zip(uids, problems)}
  calls_per_traj = 2
  thinking = PlainThinking(EnginePool([engine]), tok)
  scripted = ToolCallingEngine(thinking, calls,
                               calls_per_traj=calls_per_traj,
                               think_tokens=sz["think_tokens"], vocab_size=small.vocab_size)
  weak = shutil.which("bwrap") is None
  try:
    with running_server(max_children=4, pool_size=2, allow_weak_isolation=weak) as url:
      tools = TimedTools(SandboxTools(url, timeout_s=30.0))

      async def go():
        try:
          return await run_many(scripted, tools, proto,
                                list(zip(uids, (pr.problem for pr in problems))),
                                AgentConfig(max_turns=4, max_response_tokens=256),
                                seeds=list(range(k)))
        finally:
          await tools.inner.aclose()
      t = time.perf_counter()
      trajs = asyncio.run(go())
      wall = time.perf_counter() - t
  finally:
    engine.stop()
  n_calls = sum(tr.num_tool_calls for tr in trajs)
  n_err = sum(tr.num_tool_errors for tr in trajs)
  statuses = collections.Counter()
  for tr in trajs:
    statuses.update(tr.tool_statuses)
  # Every trajectory's first two calls are scripted (its problem's code: they must
  # run); the random model may write more calls of its own in its free last turn,
  # which may well fail, so only the scripted ones are checked.
  scripted_code = {pr.code for pr in problems}
  scripted = [(c, r) for c, r in tools.records if c.code in scripted_code]
  failed = [(c, r) for c, r in scripted if r.get("status") != "ok"]
  out["agent"] = {"trajectories": len(trajs), "tool_calls": n_calls, "tool_errors": n_err,
                  "tool_statuses": dict(statuses), "scripted_calls": len(scripted),
                  "scripted_failed": len(failed),
                  "think_tokens_replaced": thinking.replaced,
                  # what the sandbox said for the first few failed scripted calls
                  "scripted_failures": [{k: str(v)[:400] for k, v in r.items()}
                                        for _, r in failed[:4]],
                  "wall_s": wall, "weak_isolation": weak,
                  "tool_latency_ms_median": float(np.median(tools.latencies) * 1e3)
                  if tools.latencies else None,
                  "finish_reasons": sorted({tr.finish_reason for tr in trajs})}
  # Every scripted call must reach the sandbox and run: the thinking before it cannot
  # spell the protocol's tags (PlainThinking), which made 5 of 35 calls on the H100
  # (2026-11-27) parse as malformed calls.
  expected = calls_per_traj * k
  checks.append(check_row("scripted tool calls that reached the sandbox and ran ok",
                          f"{len(scripted) - len(failed)} of {expected}",
                          "all reach the sandbox, all status ok",
                          *check_scripted_calls(expected, len(scripted),
                                                len(scripted) - len(failed))))
  if weak:
    checks[-1]["note"] += "; sandbox with --allow-weak-isolation (no bubblewrap)"
  out["checks"] = checks
  jax.clear_caches()
  return out
