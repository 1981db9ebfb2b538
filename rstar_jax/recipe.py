"""The rStar2-Agent recipe: SFT -> RL stage 1 -> stage 2 -> stage 3 (hard subset) -> eval.

Each stage lives in `<workdir>/<stage>/`: its orbax checkpoints (resume inside the
stage), a Hugging Face export of the final weights (`export/`, what the next stage
and SGLang load) and `DONE.json`. A rerun skips finished stages, so the recipe is
resumable stage by stage and, inside a stage, step by step.

The config (see experiments/configs/toy.py) has sections: model, tokenizer, data,
sandbox, mesh, sft, engine, rl (shared by RL stages), stage1..stage3, eval.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Any

from absl import logging
import numpy as np

from rstar_jax import config_utils, optim
from rstar_jax.data import math_data, toy_task
from rstar_jax.eval import evaluate as eval_lib
from rstar_jax.eval import metrics as eval_metrics
from rstar_jax.model import hf_io, qwen3
from rstar_jax.model import tokenizer as tokenizer_lib
from rstar_jax.rl import advantages as adv_lib
from rstar_jax.rl import losses, roc
from rstar_jax.rl import train_step as ts
from rstar_jax.rl import trainer as rl_trainer
from rstar_jax.rollout import agent_loop, chat, tools as tools_lib
from rstar_jax.rollout.jax_engine import EngineConfig, JaxEngine
from rstar_jax.rollout.scheduler import EnginePool
from rstar_jax.sft import trainer as sft_trainer

RL_STAGES = ("stage1", "stage2", "stage3")


def _csv(s: str) -> list[str]:
  return [x.strip() for x in (s or "").split(",") if x.strip()]


def _done(workdir: str, stage: str) -> dict | None:
  path = os.path.join(workdir, stage, "DONE.json")
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  return None


def _mark_done(workdir: str, stage: str, summary: dict) -> None:
  path = os.path.join(workdir, stage, "DONE.json")
  with open(path + ".tmp", "w") as f:
    json.dump(summary, f, indent=2, default=float)
  os.replace(path + ".tmp", path)


@dataclasses.dataclass
class Context:
  """What the stages share: config, tokenizer, protocol, data, sandbox, mesh."""
  config: Any
  workdir: str
  tokenizer: Any
  proto: chat.ChatProtocol
  train_problems: list
  eval_problems: list
  tools: Any
  mesh: Any


# ---- set-up -------------------------------------------------------------------------
def build_tokenizer(config, workdir: str):
  tc = config.tokenizer
  if tc.kind == "toy":
    path = os.path.join(workdir, "tokenizer")
    if os.path.exists(os.path.join(path, "tokenizer.json")):
      return tokenizer_lib.Tokenizer.from_dir(path)
    tok = toy_task.train_toy_tokenizer(tc.vocab_size, seed=config.seed,
                                       number_chunk=tc.get("number_chunk", 3))
    tok.save(path)
    return tok
  if tc.kind == "hf":
    if not tc.path:
      raise config_utils.ConfigError("config.tokenizer.path must name a HF model directory")
    return tokenizer_lib.Tokenizer.from_dir(tc.path)
  raise config_utils.ConfigError(f"config.tokenizer.kind={tc.kind!r}; choose 'toy' or 'hf'")


def chat_config(config) -> chat.ChatConfig:
  if config.data.kind == "toy":
    return toy_task.toy_chat_config()
  return chat.ChatConfig()


def toy_levels_kinds(config) -> tuple[list[int], list[str] | None]:
  """config.data.toy_levels / toy_kinds (comma lists; no kinds: all of them)."""
  dc = config.data
  try:
    levels = [int(x) for x in _csv(dc.toy_levels)]
  except ValueError as e:
    raise config_utils.ConfigError(f"config.data.toy_levels={dc.toy_levels!r}: {e}") from e
  kinds = _csv(dc.get("toy_kinds", "")) or None
  unknown = sorted(set(kinds or ()) - set(toy_task.kinds()))
  if unknown:
    raise config_utils.ConfigError(f"config.data.toy_kinds: unknown {unknown}; known "
                                   f"{list(toy_task.kinds())}")
  return levels, kinds


def load_problems(config) -> tuple[list, list]:
  dc = config.data
  if dc.kind == "toy":
    levels, kinds = toy_levels_kinds(config)
    train = toy_task.generate_problems(dc.toy_train_problems, seed=config.seed, levels=levels,
                                       kinds=kinds)
    evals = toy_task.generate_problems(dc.toy_eval_problems, seed=config.seed + 10_000,
                                       levels=levels, kinds=kinds)
    as_math = lambda ps, tag: [math_data.MathProblem(uid=f"{tag}{i}", problem=p.problem,
                                                     answer=str(p.answer), source="toy",
                                                     meta={"level": p.level, "kind": p.kind})
                               for i, p in enumerate(ps)]
    return as_math(train, "toy-train-"), as_math(evals, "toy-eval-")
  if dc.kind == "files":
    train = math_data.load_math_problems(_csv(dc.train_files), on_error=dc.on_error).items
    evals = math_data.load_math_problems(_csv(dc.eval_files), on_error=dc.on_error).items
    if dc.integer_only:
      train, dropped = math_data.filter_integer_answers(train)
      logging.info("integer filter dropped %d training problems", len(dropped))
    train, dups = math_data.deduplicate(train)
    logging.info("de-duplication dropped %d training problems", len(dups))
    return list(train), list(evals)
  raise config_utils.ConfigError(f"config.data.kind={dc.kind!r}; choose 'toy' or 'files'")


def model_overrides(config) -> dict[str, Any]:
  keys = ("param_dtype", "dtype", "remat_policy", "attention_impl")
  return {k: config.model[k] for k in keys if config.model.get(k)}


def initial_model(config, tokenizer, mesh):
  mc = config.model
  if mc.get("hf_dir"):
    return hf_io.load_hf(mc.hf_dir, mesh=mesh, **model_overrides(config))
  # Every other key of config.model (hidden_size, num_hidden_layers, ...) overrides the
  # preset; unset placeholders are None and keep the preset's value.
  arch = {k: v for k, v in config_utils.to_dict(mc).items()
          if k not in ("hf_dir", "vocab_size", "preset") and v is not None and v != ""}
  cfg = config_utils.model_config(dict(preset=mc.preset, **arch))
  vocab = mc.vocab_size or tokenizer.vocab_size
  if vocab < tokenizer.vocab_size:
    raise config_utils.ConfigError(f"config.model.vocab_size={vocab} is smaller than the "
                                   f"tokenizer's {tokenizer.vocab_size}")
  cfg = cfg.replace(vocab_size=vocab)
  model = qwen3.create_model(cfg, seed=config.seed)
  if mesh is not None:
    import jax
    from flax import nnx
    from rstar_jax.model import sharding
    g, st = nnx.split(model)
    model = nnx.merge(g, jax.device_put(st, sharding.state_shardings(st, mesh)))
  return model


def load_stage_model(ctx: Context, stage: str):
  return hf_io.load_hf(os.path.join(ctx.workdir, stage, "export"), mesh=ctx.mesh,
                       **model_overrides(ctx.config))


def export(ctx: Context, model, stage: str) -> str:
  path = os.path.join(ctx.workdir, stage, "export")
  hf_io.save_hf(model, path, dtype=model.cfg.param_dtype,
                tokenizer_dir=os.path.join(ctx.workdir, "tokenizer")
                if ctx.config.tokenizer.kind == "toy" else ctx.config.tokenizer.path)
  return path


# ---- stages -------------------------------------------------------------------------
def sft_pairs(ctx: Context) -> list[tuple[list[int], list[int]]]:
  """(ids, loss_mask) of every SFT conversation: toy traces, or config.sft.files."""
  c = ctx.config
  sc = c.sft
  if c.data.kind == "toy" and not _csv(sc.files):
    levels, kinds = toy_levels_kinds(c)
    problems = toy_task.generate_problems(sc.num_traces, seed=c.seed + 20_000,
                                          levels=levels, kinds=kinds)
    traces = toy_task.make_traces(problems, seed=c.seed + 1, config=toy_task.TraceConfig(
        bug_share=sc.bug_share, no_tool_share=sc.no_tool_share), chat_config=ctx.proto.config)
    rendered = [toy_task.render_trace(ctx.proto, t) for t in traces]
  else:
    examples = math_data.load_sft_examples(_csv(sc.files), on_error=c.data.on_error).items
    rendered = [ctx.proto.render_conversation(e.messages) for e in examples]
  return [(r.ids, r.loss_mask) for r in rendered]


def sft_trainer_for(ctx: Context, model, workdir: str) -> sft_trainer.SFTTrainer:
  """The SFT trainer of config.sft (the first heldout_share of the data is held out)."""
  c = ctx.config
  sc = c.sft
  pairs = sft_pairs(ctx)
  n_held = max(1, int(len(pairs) * sc.heldout_share))
  return sft_trainer.SFTTrainer(
      sft_trainer.SFTConfig(seed=c.seed, epochs=sc.epochs, seq_len=sc.seq_len,
                            rows_per_step=sc.rows_per_step, eval_every=sc.eval_every,
                            checkpoint_every=sc.checkpoint_every),
      optim.OptimizerConfig(learning_rate=sc.learning_rate, warmup_steps=sc.warmup_steps,
                            schedule="warmup_cosine", min_lr_ratio=sc.min_lr_ratio,
                            weight_decay=sc.weight_decay, grad_clip_norm=1.0),
      ts.StepConfig(micro_batches=sc.micro_batches, logprob_chunk=sc.logprob_chunk),
      model, pairs[n_held:], pairs[:n_held], workdir, pad_id=ctx.tokenizer.pad_id,
      mesh=ctx.mesh)


def run_sft(ctx: Context, model):
  trainer = sft_trainer_for(ctx, model, os.path.join(ctx.workdir, "sft"))
  trainer.maybe_restore()
  history = trainer.run()
  model = trainer.model()
  trainer.close()
  export(ctx, model, "sft")
  summary = {"steps": trainer.step, "packing": trainer.pack_stats,
             "final_loss": history[-1]["sft/loss"] if history else None,
             "heldout_nll": trainer.heldout_loss()}
  _mark_done(ctx.workdir, "sft", summary)
  return model


def rl_setup(config, stage_cfg) -> rl_trainer.RLSetup:
  r = config.rl
  agent = agent_loop.AgentConfig(max_turns=stage_cfg.max_turns,
                                 max_response_tokens=stage_cfg.max_response_tokens,
                                 temperature=r.temperature, top_p=r.top_p)
  return rl_trainer.RLSetup(
      rl=rl_trainer.RLConfig(seed=config.seed, num_steps=stage_cfg.num_steps,
                             prompts_per_step=r.prompts_per_step,
                             samples_per_prompt=r.samples_per_prompt,
                             old_logprobs=r.old_logprobs, checkpoint_every=r.checkpoint_every,
                             length_multiple=r.length_multiple,
                             fixed_rows=r.fixed_rows,
                             scheduler_policy=r.scheduler_policy),
      agent=agent,
      engine=EngineConfig(num_slots=config.engine.num_slots, max_len=config.engine.max_len),
      downsample=roc.DownsampleConfig(method=r.downsample, group_size=r.group_size,
                                      positive_selection=r.positive_selection,
                                      drop_equal_reward_groups=r.drop_equal_reward_groups),
      advantage=adv_lib.AdvantageConfig(estimator=r.advantage, eps=r.advantage_eps),
      loss=losses.LossConfig(eps_low=r.eps_low, eps_high=r.eps_high,
                             dual_clip_c=r.dual_clip_c or None, aggregation=r.aggregation,
                             max_response_len=stage_cfg.max_response_tokens,
                             kl_coef=r.kl_coef),
      optimizer=optim.OptimizerConfig(learning_rate=r.learning_rate,
                                      warmup_steps=r.warmup_steps,
                                      weight_decay=r.weight_decay,
                                      grad_clip_norm=r.grad_clip_norm),
      step=ts.StepConfig(micro_batches=r.micro_batches, logprob_chunk=r.logprob_chunk,
                         temperature=r.temperature))


def eval_agent_config(config, stage_cfg=None) -> agent_loop.AgentConfig:
  e = config.eval
  budget = stage_cfg.max_response_tokens if stage_cfg is not None else e.max_response_tokens
  turns = stage_cfg.max_turns if stage_cfg is not None else e.max_turns
  return agent_loop.AgentConfig(max_turns=turns, max_response_tokens=budget,
                                temperature=e.temperature, top_p=e.top_p)


def _engine(ctx: Context, model):
  engine = JaxEngine(model, EngineConfig(num_slots=ctx.config.engine.num_slots,
                                         max_len=ctx.config.engine.max_len))
  return engine, EnginePool([engine])


def hard_subset(ctx: Context, model, stage_cfg) -> list:
  """Training problems the current policy does not solve k out of k (SPEC.md sec. 5)."""
  cache = os.path.join(ctx.workdir, "stage3", "hard_subset.json")
  by_uid = {p.uid: p for p in ctx.train_problems}
  if os.path.exists(cache):
    with open(cache) as f:
      return [by_uid[u] for u in json.load(f)["uids"]]
  pool_size = stage_cfg.hard_pool or len(ctx.train_problems)
  pool = ctx.train_problems[:pool_size]
  engine, pool_engine = _engine(ctx, model)
  try:
    trajs = eval_lib.sample_trajectories(
        pool_engine, ctx.tools, ctx.proto, ctx.tokenizer, pool, k=stage_cfg.hard_k,
        agent_cfg=eval_agent_config(ctx.config, stage_cfg), seed=ctx.config.seed + 77,
        desc="stage3 filter")
  finally:
    engine.stop()
  uids = eval_metrics.unsolved_problems(eval_lib.records_from(trajs), k=stage_cfg.hard_k)
  os.makedirs(os.path.dirname(cache), exist_ok=True)
  with open(cache, "w") as f:
    json.dump({"uids": uids, "pool": len(pool), "k": stage_cfg.hard_k}, f)
  logging.info("stage 3: %d of %d problems not solved %d/%d", len(uids), len(pool),
               stage_cfg.hard_k, stage_cfg.hard_k)
  return [by_uid[u] for u in uids]


def run_rl_stage(ctx: Context, stage: str, model, prev_stage: str | None):
  c = ctx.config
  sc = c[stage]
  problems = ctx.train_problems
  if sc.hard_only:
    problems = hard_subset(ctx, model, sc)
    if len(problems) < c.rl.prompts_per_step:
      logging.warning("%s: only %d hard problems; padding the pool with the rest", stage,
                      len(problems))
      extra = [p for p in ctx.train_problems if p not in problems]
      problems = problems + extra[:c.rl.prompts_per_step - len(problems)]
  setup = rl_setup(c, sc)
  trainer = rl_trainer.RLTrainer(setup, model, ctx.tokenizer, ctx.proto, problems, ctx.tools,
                                 os.path.join(ctx.workdir, stage), mesh=ctx.mesh)
  if not trainer.maybe_restore() and prev_stage and not sc.reset_optimizer:
    prev = os.path.join(ctx.workdir, prev_stage, "checkpoints")
    from rstar_jax import checkpoint as ckpt_lib
    if os.path.isdir(prev) and ckpt_lib.Checkpointer(prev).latest_step() is not None:
      state, _ = ckpt_lib.Checkpointer(prev).restore(trainer.state, trainer.shardings)
      trainer.state = ts.TrainState(trainer.state.step, state.params, state.opt_state)
      trainer.engine.update_params(trainer.state.params)
      logging.info("%s: carried the optimizer state over from %s", stage, prev_stage)
  try:
    history = trainer.run()
  finally:
    trainer.close()
  model = trainer.model()
  export(ctx, model, stage)
  last = history[-1] if history else {}
  _mark_done(ctx.workdir, stage, {"steps": trainer.step, "problems": len(problems),
                                  **{k: v for k, v in last.items() if k.startswith("rollout/")}})
  return model


def run_eval(ctx: Context, model, name: str):
  e = ctx.config.eval
  engine, pool = _engine(ctx, model)
  try:
    report, trajs = eval_lib.evaluate(pool, ctx.tools, ctx.proto, ctx.tokenizer,
                                      ctx.eval_problems, k=e.k,
                                      agent_cfg=eval_agent_config(ctx.config),
                                      seed=ctx.config.seed + 99, dataset=name)
  finally:
    engine.stop()
  path = os.path.join(ctx.workdir, f"eval_{name}.json")
  with open(path, "w") as f:
    f.write(report.to_json())
  eval_lib.write_samples(os.path.join(ctx.workdir, f"eval_{name}_samples.jsonl"), trajs,
                         ctx.eval_problems, ctx.tokenizer)
  return report


# ---- orchestration -------------------------------------------------------------------
@contextlib.contextmanager
def sandbox_tools(config):
  urls = _csv(config.sandbox.urls)
  if urls:
    yield tools_lib.SandboxTools(urls, timeout_s=config.sandbox.timeout_s)
    return
  from sandbox.launcher import running_server
  with running_server(max_children=config.sandbox.max_children) as url:
    logging.info("started a sandbox server at %s", url)
    yield tools_lib.SandboxTools([url], timeout_s=config.sandbox.timeout_s)


def build_context(config, tools) -> Context:
  workdir = os.path.abspath(config.workdir)
  os.makedirs(workdir, exist_ok=True)
  mesh = None
  if config.mesh.get("enabled", False):
    mesh = config_utils.mesh_from_config({k: v for k, v in config.mesh.items() if k != "enabled"})
  tok = build_tokenizer(config, workdir)
  proto = chat.ChatProtocol(tok, chat_config(config))
  train, evals = load_problems(config)
  return Context(config, workdir, tok, proto, train, evals, tools, mesh)


def run(config, stages: list[str] | None = None) -> dict[str, Any]:
  """Runs (or resumes) the recipe; returns the evaluation reports by name."""
  stages = stages or ["sft", *RL_STAGES, "eval"]
  reports: dict[str, Any] = {}
  if config.get("compile_cache", False):
    config_utils.enable_compile_cache(os.path.join(os.path.abspath(config.workdir),
                                                   "compile_cache"))
  with sandbox_tools(config) as tools:
    ctx = build_context(config, tools)
    with open(os.path.join(ctx.workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2))
    model, prev = None, None
    order = ["sft", *RL_STAGES]
    for stage in order:
      if stage == "sft" and not config.sft.enabled:
        continue
      if stage in RL_STAGES and config[stage].num_steps <= 0:
        continue
      if _done(ctx.workdir, stage) or stage not in stages:
        if _done(ctx.workdir, stage):
          prev = stage
          model = None
        continue
      if model is None:
        model = load_stage_model(ctx, prev) if prev else initial_model(config, ctx.tokenizer,
                                                                       ctx.mesh)
      if stage == "sft":
        model = run_sft(ctx, model)
        if config.eval.after_sft:
          reports["after_sft"] = run_eval(ctx, model, "after_sft")
          print(reports["after_sft"].to_table())
      else:
        model = run_rl_stage(ctx, stage, model, prev if prev in RL_STAGES else None)
      prev = stage
    if "eval" in stages:
      if model is None:
        model = load_stage_model(ctx, prev) if prev else initial_model(config, ctx.tokenizer,
                                                                       ctx.mesh)
      reports["final"] = run_eval(ctx, model, "final")
      print(reports["final"].to_table())
      sft_report = os.path.join(ctx.workdir, "eval_after_sft.json")
      if os.path.exists(sft_report):
        with open(sft_report) as f:
          before = json.load(f)
        print(f"pass@1 after SFT {100 * before['pass_at_1']:.1f}% -> final "
              f"{100 * reports['final'].pass_at_1:.1f}% (temperature "
              f"{reports['final'].temperature}, k={reports['final'].samples_per_problem})")
    plot = plot_progress(ctx.workdir)
    if plot:
      print(f"plot: {plot}")
  return reports


def plot_progress(workdir: str) -> str | None:
  """PNG of accuracy, tool-error rate inside correct trajectories, response length."""
  from rstar_jax import metrics as metrics_lib
  rows, offset = [], 0
  for stage in RL_STAGES:
    path = os.path.join(workdir, stage, "metrics_rl.jsonl")
    if not os.path.exists(path):
      continue
    stage_rows = metrics_lib.read_jsonl(path)
    for r in stage_rows:
      rows.append({**r, "global_step": r["step"] + offset, "stage": stage})
    offset += max((r["step"] for r in stage_rows), default=0)
  if not rows:
    return None
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  keys = [("rollout/reward_mean", "accuracy (sampled, all rollouts)"),
          ("rollout/tool_error_rate_correct", "tool-error rate in correct trajectories"),
          ("rollout/model_tokens_mean", "response length (model tokens)")]
  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  x = [r["global_step"] for r in rows]
  # Stage boundaries: stage 3 trains on the hard subset only, so its accuracy drops.
  starts = {}
  for r in rows:
    starts.setdefault(r["stage"], r["global_step"] - 0.5)
  for ax, (k, title) in zip(axes, keys):
    y = [float(r.get(k, np.nan)) for r in rows]
    ax.plot(x, y, marker=".")
    for stage, at in starts.items():
      ax.axvline(at, color="gray", linestyle=":", linewidth=1)
      ax.text(at, 1.0, f" {stage}", transform=ax.get_xaxis_transform(), fontsize=8,
              va="top", color="gray")
    ax.set_title(title)
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
  fig.tight_layout()
  path = os.path.join(workdir, "rl_progress.png")
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path
