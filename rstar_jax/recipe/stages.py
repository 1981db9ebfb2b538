"""The rStar2-Agent recipe: SFT -> RL stage 1 -> stage 2 -> stage 3 (hard subset) -> eval.

The whole config is one `recipe_config.RecipeConfig` (each section the keyword arguments
of the dataclass it builds), checked by `recipe_config.build_config` before anything runs.

Each stage lives in `<workdir>/<stage>/`: its orbax checkpoints (resume inside the
stage), a Hugging Face export of the final weights (`export/`, what the next stage
and SGLang load) and `DONE.json`. A rerun skips finished stages, so the recipe is
resumable stage by stage and, inside a stage, step by step. The resolved config is
`<workdir>/config.json`; a rerun with a different config is refused while stages it
produced are finished (see `workdir_state.check_workdir`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
from typing import Any, Sequence

from absl import logging
from flax import nnx

from rstar_jax import checkpoint, compile_cache, config_utils, distributed, sharding
from rstar_jax import jsonl
from rstar_jax.analysis import progress as progress_plot
from rstar_jax.data import data_config
from rstar_jax.eval import eval_runs as eval_lib
from rstar_jax.eval import pass_at_k as eval_metrics
from rstar_jax.model import model_config
from rstar_jax.model import hf_io, qwen3
from rstar_jax.recipe import preflight_checks, recipe_config, workdir_state
from rstar_jax.rl import rollout_collector
from rstar_jax.rl import trainer as rl_trainer
from rstar_jax.rollout import backends, chat, chat_template
from rstar_jax.rollout import sandbox_client as tools_lib
from rstar_jax.sft import trainer as sft_trainer
from rstar_jax.train import interrupt

# Seed-stream salts of the evaluation-style runs (see rl.rollout_collector).
EVAL_SALT, FILTER_SALT = 99, 77


# ---- set-up -------------------------------------------------------------------------
@dataclasses.dataclass
class Context:
  """What the stages share: config, tokenizer, protocol, data, tools, engines, mesh."""
  config: recipe_config.RecipeConfig
  workdir: str
  tokenizer: Any
  proto: chat.ChatProtocol
  train_problems: list
  eval_problems: list
  tools: Any
  mesh: Any
  rules: Any
  engines: Any = None      # built from the first model that needs rollouts

  def engines_for(self, model, version: str | None = None, *, sync: bool = True):
    """The engine pool, generating with `model`'s parameters (named `version`; HTTP
    servers get them as a checkpoint under rollout.weight_sync.dir). sync=False: the
    caller (an RL trainer) moves the engines onto its own parameters."""
    if self.engines is None:
      self.engines = backends.build_engine_pool(self.config.rollout, model,
                                                workdir=self.workdir, rules=self.rules)
    if sync:
      self.engines.update_weights(nnx.state(model), version)
    return self.engines


def initial_model(cfg: recipe_config.RecipeConfig, tokenizer, mesh, rules=sharding.DEFAULT_RULES):
  """config.model: a HF checkpoint, or a preset (random init) sized to the tokenizer."""
  mc = cfg.model
  overrides = model_config.overrides_of(mc)
  if mc.hf_dir:
    fixed = {k: v for k, v in overrides.items() if k not in model_config.RUNTIME_FIELDS}
    ckpt = hf_io.load_config(mc.hf_dir)
    changed = {k: (getattr(ckpt, k), v) for k, v in fixed.items() if getattr(ckpt, k) != v}
    if changed:
      raise config_utils.ConfigError(
          f"config.model: {mc.hf_dir} is a checkpoint; its architecture cannot be changed "
          f"({', '.join(f'{k}: {a} -> {b}' for k, (a, b) in changed.items())})")
    runtime = {k: v for k, v in overrides.items() if k in model_config.RUNTIME_FIELDS}
    return hf_io.load_hf(mc.hf_dir, mesh=mesh, rules=rules, **runtime)
  overrides.setdefault("vocab_size", tokenizer.vocab_size)
  if overrides["vocab_size"] < tokenizer.vocab_size:
    raise config_utils.ConfigError(f"config.model.vocab_size={overrides['vocab_size']} is "
                                   f"smaller than the tokenizer's {tokenizer.vocab_size}")
  try:
    qcfg = model_config.get_preset(mc.preset, **overrides)
  except ValueError as e:
    raise config_utils.ConfigError(f"config.model: {e}") from e
  return sharding.shard_model(qwen3.create_model(qcfg, seed=cfg.seed), mesh, rules)


def runtime_overrides(cfg: recipe_config.RecipeConfig) -> dict[str, Any]:
  overrides = model_config.overrides_of(cfg.model)
  return {k: v for k, v in overrides.items() if k in model_config.RUNTIME_FIELDS}


def load_stage_model(ctx: Context, stage: str):
  return hf_io.load_hf(os.path.join(ctx.workdir, stage, "export"), mesh=ctx.mesh,
                       rules=ctx.rules, **runtime_overrides(ctx.config))


def tokenizer_dir(ctx: Context) -> str:
  cfg = ctx.config.tokenizer
  return os.path.join(ctx.workdir, "tokenizer") if cfg.kind == "toy" else cfg.path


def export(ctx: Context, model, stage: str) -> str:
  path = os.path.join(ctx.workdir, stage, "export")
  # The chat template makes `AutoTokenizer(...).apply_chat_template` render our protocol.
  # Every trainer process writes its share of the tensors (one process: one file as before).
  hf_io.save_hf(model, path, dtype=model.cfg.param_dtype, tokenizer_dir=tokenizer_dir(ctx),
                chat_template=chat_template.hf_chat_template(ctx.config.chat), parallel=True)
  return path


def build_context(cfg: recipe_config.RecipeConfig, tools, workdir: str | None = None, tokenizer=None
                  ) -> Context:
  workdir = workdir or os.path.abspath(cfg.workdir)
  mesh, rules = cfg.mesh.make(), cfg.mesh.logical_rules()
  if tokenizer is None and distributed.is_main():   # a toy tokenizer is trained once
    tokenizer = data_config.build_tokenizer(cfg.tokenizer, workdir, seed=cfg.seed)
  distributed.barrier("tokenizer")
  tok = tokenizer or data_config.build_tokenizer(cfg.tokenizer, workdir, seed=cfg.seed)
  proto = chat.ChatProtocol(tok, cfg.chat)
  train, evals = data_config.load_problems(cfg.data, seed=cfg.seed)
  return Context(cfg, workdir, tok, proto, train, evals, tools, mesh, rules)


# ---- stages -------------------------------------------------------------------------
def sft_pairs(ctx: Context) -> list[tuple[list[int], list[int]]]:
  c = ctx.config
  return data_config.sft_conversations(c.sft.data, c.data, ctx.proto, seed=c.seed,
                                       on_error=c.data.on_error)


def sft_trainer_for(ctx: Context, model, workdir: str) -> sft_trainer.SFTTrainer:
  """The SFT trainer of config.sft (the first heldout_share of the data is held out)."""
  return sft_trainer.SFTTrainer(ctx.config.sft, model, sft_pairs(ctx), workdir,
                                seed=ctx.config.seed, pad_id=ctx.tokenizer.pad_id,
                                mesh=ctx.mesh, rules=ctx.rules)


def run_sft(ctx: Context, model):
  trainer = sft_trainer_for(ctx, model, os.path.join(ctx.workdir, "sft"))
  try:
    trainer.maybe_restore()
    history = trainer.run()
    model = trainer.model()
  finally:
    trainer.close()
  export(ctx, model, "sft")
  last = history[-1] if history else _last_row(os.path.join(ctx.workdir, "sft", "metrics_sft.jsonl"))
  summary = {"steps": trainer.step, "packing": trainer.pack_stats,
             "final_loss": last.get("sft/loss"),
             "heldout_nll": trainer.heldout_loss()}
  workdir_state.mark_done(ctx.workdir, "sft", summary)
  return model


def hard_subset(ctx: Context, model, stage: str, stage_cfg: recipe_config.RLStage) -> list:
  """Training problems the current policy does not solve k out of k (the
  rStar2-Agent report's stage 3, "Multi-Stage RL Training": 8 of 8).

  Kept in <workdir>/<stage>/hard_subset.json with what made it (k, pool, seed, agent
  settings, the model it was filtered with): a resumed stage reuses it, anything else
  filters again."""
  cache = os.path.join(ctx.workdir, stage, "hard_subset.json")
  by_uid = {p.uid: p for p in ctx.train_problems}
  # Through JSON once, so that it compares equal to what the cache file reads back.
  made_with = json.loads(json.dumps({
      "k": stage_cfg.hard_k, "pool": stage_cfg.hard_pool or len(ctx.train_problems),
      "seed": ctx.config.seed, "agent": dataclasses.asdict(stage_cfg.agent),
      "model": _model_made(ctx, stage)}, default=str))

  def reusable() -> list[str] | None:
    cached = _read_json(cache)
    if cached and cached.get("made_with") == made_with and all(
        u in by_uid for u in cached.get("uids", ())):
      return cached["uids"]
    if cached is not None:
      logging.warning("%s: %s was made with other settings or data; filtering again",
                      stage, cache)
    return None

  uids = distributed.on_main(reusable, f"{stage}: reading {cache}")
  if uids is not None:
    return [by_uid[u] for u in uids]
  engines = ctx.engines_for(model, f"{stage}-filter")   # every process: a collective export
  uids = distributed.on_main(lambda: _unsolved(ctx, engines, stage_cfg, cache, made_with),
                             f"{stage}: filtering the hard subset")
  return [by_uid[u] for u in uids]


def _last_row(path: str) -> dict:
  """The last whole row of a stage's metrics file ({} if none)."""
  try:
    return jsonl.last_jsonl_row(path) or {}
  except OSError:
    return {}


def _read_json(path: str) -> dict | None:
  """The JSON object at `path`; None if there is none or it is torn."""
  try:
    with open(path) as f:
      obj = json.load(f)
  except (OSError, ValueError):
    return None
  return obj if isinstance(obj, dict) else None


def _unsolved(ctx: Context, engines, stage_cfg: recipe_config.RLStage, cache: str,
              made_with: dict) -> list[str]:
  pool = ctx.train_problems[:stage_cfg.hard_pool or len(ctx.train_problems)]
  # Resumable (8 rollouts of every training problem: many hours at 14B); a signal stops
  # it at the next finished rollout.
  journal = cache[:-len(".json")] + ".journal.jsonl"
  groups = rollout_collector.collect(engines, ctx.tools, ctx.proto, ctx.tokenizer, pool,
                                     k=stage_cfg.hard_k, agent=stage_cfg.agent,
                            stream=(ctx.config.seed, rollout_collector.EVAL, FILTER_SALT),
                            progress=True, desc="stage3 filter", journal=journal,
                            journal_key=made_with)
  rollout_collector.raise_if_failed([t for g in groups for t in g], "stage-3 filter")
  records = eval_lib.records_from([t for g in groups for t in g])
  uids = eval_metrics.unsolved_problems(records, k=stage_cfg.hard_k)
  os.makedirs(os.path.dirname(cache), exist_ok=True)
  with open(cache + ".tmp", "w") as f:
    json.dump({"uids": uids, "pool": len(pool), "k": stage_cfg.hard_k, "made_with": made_with}, f)
  os.replace(cache + ".tmp", cache)
  os.remove(journal)   # the cache is what it was for (it holds every rollout: large)
  logging.info("stage 3: %d of %d problems not solved %d/%d", len(uids), len(pool),
               stage_cfg.hard_k, stage_cfg.hard_k)
  return uids


def run_rl_stage(ctx: Context, stage: str, model, prev_stage: str | None):
  c = ctx.config
  sc: recipe_config.RLStage = getattr(c, stage)
  problems = ctx.train_problems
  if sc.hard_only:
    problems = hard_subset(ctx, model, stage, sc)
    if len(problems) < c.rl.prompts_per_step:
      logging.warning("%s: only %d hard problems; padding the pool with the rest", stage,
                      len(problems))
      extra = [p for p in ctx.train_problems if p not in problems]
      problems = problems + extra[:c.rl.prompts_per_step - len(problems)]
  engines = ctx.engines_for(model, sync=False)
  reference = None    # rl.reference="stage_start": the trainer keeps `model`'s parameters
  if c.rl.loss.kl_coef > 0 and c.rl.reference != rl_trainer.STAGE_START:
    reference = hf_io.load_hf(c.rl.reference, mesh=ctx.mesh, rules=ctx.rules,
                              **runtime_overrides(c))
  trainer = rl_trainer.RLTrainer(c.rl, sc.agent, model, ctx.tokenizer, ctx.proto, problems,
                                 engines=engines, tools=ctx.tools,
                                 workdir=os.path.join(ctx.workdir, stage), seed=c.seed,
                                 mesh=ctx.mesh, rules=ctx.rules, reference=reference)
  del reference
  try:
    if not trainer.maybe_restore() and prev_stage and not sc.reset_optimizer:
      ckpts = os.path.join(ctx.workdir, prev_stage, "checkpoints")
      if trainer.carry_over_from(ckpts):
        logging.info("%s: carried the optimizer state over from %s", stage, prev_stage)
      elif (workdir_state.stage_done(ctx.workdir, prev_stage) or {}).get("steps"):
        # Said, not skipped: a fresh Adam (warm-up again) is another run than the recipe's.
        raise config_utils.ConfigError(
            f"{stage}: {prev_stage} trained, but {ckpts} holds no checkpoint to carry its "
            f"optimizer state (Adam moments) over from (removed to save space?); put it back, "
            f"or set --config.{stage}.reset_optimizer=True to start with a fresh optimizer")
    history = trainer.run(sc.num_steps)
    model = trainer.model()
  finally:
    trainer.close()
  export(ctx, model, stage)
  # Resumed at its last step, the stage ran none here: its last metrics row says how it ended.
  rows_path = os.path.join(ctx.workdir, stage, "metrics_rl.jsonl")
  last = history[-1] if history else _last_row(rows_path)
  no_signal = distributed.is_main() and _no_learning_signal(stage, rows_path)
  workdir_state.mark_done(ctx.workdir, stage,
                          {"steps": trainer.step, "problems": len(problems),
                           "no_learning_signal": no_signal,
                           **{k: v for k, v in last.items() if k.startswith("rollout/")}})
  return model


def _no_learning_signal(stage: str, rows_path: str) -> bool:
  """Warns (once per stage) if no step of the stage had a non-zero advantage."""
  try:
    rows = jsonl.read_jsonl(rows_path)
  except OSError:
    return False
  if not rl_trainer.no_learning_signal(rows):
    return False
  logging.warning(
      "\n%s\n%s: NO LEARNING SIGNAL. Every one of its %d RL steps had zero advantage on "
      "every trajectory (each group's rewards were all equal: mean reward %.3f), so the "
      "policy gradient was 0 throughout and the stage learned nothing from its rewards. "
      "Usually the policy solves no problem (SFT too short, a budget too small for an "
      "answer) or all of them; see %s. Recorded as no_learning_signal in its DONE.json.\n%s",
      "!" * 88, stage, len(rows),
      sum(r.get("rollout/reward_mean", 0.0) for r in rows) / max(len(rows), 1), rows_path,
      "!" * 88)
  return True


def run_eval(ctx: Context, model, name: str, *, source: str = ""):
  # Done before with this model and these settings: its report, not hours of rollouts
  # again (nor a weight sync).
  done = distributed.on_main(lambda: _finished_eval(ctx, name, source),
                             f"reading eval_{name}.json")
  if done is not None:
    return done
  engines = ctx.engines_for(model, f"eval-{name}")   # every process: a collective export
  return distributed.on_main(lambda: _evaluate(ctx, engines, name, source),
                             f"evaluation {name}")


def _eval_key(ctx: Context, name: str, source: str) -> dict:
  """What decides an evaluation's result: the model (its stage, steps and export files),
  the eval settings, the seed, the tool timeout."""
  made = _model_made(ctx)
  weights = source or (os.path.join(ctx.workdir, made[0], "export") if made[0] else "")
  # Of the tools, what a result depends on (not where the servers are, nor how many).
  tools = [ctx.config.tools.backend, ctx.config.tools.timeout_s]
  key = {"name": name, "source": source, "model": made, "weights": checkpoint.files_stamp(weights),
         "seed": ctx.config.seed, "eval": dataclasses.asdict(ctx.config.eval), "tools": tools}
  return json.loads(json.dumps(key, default=str))


def _finished_eval(ctx: Context, name: str, source: str):
  path = os.path.join(ctx.workdir, f"eval_{name}.json")
  made = _read_json(path[:-len(".json")] + ".made_with.json")
  if (made is None or made != _eval_key(ctx, name, source)
      or not os.path.exists(path[:-len(".json")] + "_samples.jsonl")):
    return None
  print(f"eval {name}: already evaluated with this model and these settings ({path})")
  with open(path) as f:
    return eval_metrics.EvalReport.from_json(f.read())


def _model_made(ctx: Context, before: str | None = None) -> list:
  """What names the model a stage starts from: the last finished stage before `before`
  (all of them: None), its step count, the starting checkpoint."""
  prev = workdir_state.last_done(ctx.workdir, before or "")
  steps = (workdir_state.stage_done(ctx.workdir, prev) or {}).get("steps") if prev else None
  return [prev, steps, ctx.config.model.hf_dir]


def _evaluate(ctx: Context, engines, name: str, source: str):
  e = ctx.config.eval.resolved()
  print(f"evaluation {name}: protocol {ctx.config.eval.protocol!r} ({e.k} samples per "
        f"problem, temperature {e.agent.temperature}, {e.agent.max_response_tokens} tokens, "
        f"{e.agent.max_turns} turns)", flush=True)
  room = getattr(engines, "max_len", 0) or 0
  if room and room < e.agent.max_response_tokens:
    # The agent loop ends a trajectory that fills the engine as truncated: the table
    # would not be the protocol's. Said, not refused (a budget no answer reaches is common).
    logging.warning("evaluation %s: the rollout engine holds %d tokens (prompt + response), "
                    "fewer than the protocol's %d response tokens: longer trajectories end "
                    "as truncated", name, room, e.agent.max_response_tokens)
  # An evaluation killed part-way, or stopped by a signal at a trajectory's end, resumes
  # from its journal if the model and the settings are the ones it was written with
  # (hours at 14B).
  journal = os.path.join(ctx.workdir, f"eval_{name}.journal.jsonl")
  key = _eval_key(ctx, name, source)
  report, trajs = eval_lib.evaluate(engines, ctx.tools, ctx.proto,
                                    ctx.tokenizer, ctx.eval_problems, e,
                                    stream=(ctx.config.seed, rollout_collector.EVAL, EVAL_SALT),
                                    dataset=name, model_source=source or name,
                                    seed=ctx.config.seed, journal=journal, journal_key=key)
  path = os.path.join(ctx.workdir, f"eval_{name}.json")
  samples = os.path.join(ctx.workdir, f"eval_{name}_samples.jsonl")
  text = report.to_json()
  _keep_previous_report(path, samples, text)
  with open(path + ".tmp", "w") as f:
    f.write(text)
  os.replace(path + ".tmp", path)
  eval_lib.write_samples(samples, trajs, ctx.eval_problems, ctx.tokenizer)
  made_with = path[:-len(".json")] + ".made_with.json"
  with open(made_with + ".tmp", "w") as f:
    json.dump(key, f)
  os.replace(made_with + ".tmp", made_with)
  os.remove(journal)   # the samples hold what it held
  return report


def _keep_previous_report(path: str, samples: str, text: str) -> None:
  """A report already at `path` that says something else (another eval.k, another model
  after allow_config_change) is moved to <name>_<n>.json with its samples, not lost."""
  if not os.path.exists(path):
    return
  with open(path) as f:
    if f.read() == text:
      return
  stem = path[:-len(".json")]
  n = 1
  while os.path.exists(f"{stem}_{n}.json"):
    n += 1
  os.replace(path, f"{stem}_{n}.json")
  if os.path.exists(samples):
    os.replace(samples, f"{stem}_{n}_samples.jsonl")
  logging.warning("%s differed from this evaluation's report: kept as %s_%d.json", path, stem, n)


# ---- orchestration -------------------------------------------------------------------
def _check_stages(stages: Sequence[str] | None) -> list[str]:
  wanted = list(stages or recipe_config.ALL_STAGES)
  unknown = sorted(set(wanted) - set(recipe_config.ALL_STAGES))
  if unknown:
    raise config_utils.ConfigError(
        f"stages: unknown {unknown}; known {list(recipe_config.ALL_STAGES)}")
  return wanted


def plan(cfg: recipe_config.RecipeConfig, workdir: str, stages: Sequence[str] | None) -> list[str]:
  """The stages this run will execute, in order; says which are done or skipped."""
  wanted = _check_stages(stages)
  todo = []
  for stage in recipe_config.ALL_STAGES:
    if stage not in wanted:
      continue
    if stage == "sft" and not cfg.sft.enabled:
      print("sft: disabled (config.sft.enabled=False)")
    elif stage in recipe_config.RL_STAGES and getattr(cfg, stage).num_steps <= 0:
      print(f"{stage}: 0 steps, skipped")
    elif (stage == "sft" and workdir_state.stage_done(workdir, stage) and cfg.eval.after_sft
          and not os.path.exists(os.path.join(workdir, "eval_after_sft.json"))):
      # SFT is marked done before its evaluation runs: a run stopped in between resumes here.
      print("sft: already done, its evaluation (config.eval.after_sft) is not: evaluating it")
      todo.append(stage)
    elif stage != "eval" and workdir_state.stage_done(workdir, stage):
      print(f"{stage}: already done ({os.path.join(workdir, stage, 'DONE.json')}), skipped")
    else:
      todo.append(stage)
  if "eval" in todo or ("sft" in todo and cfg.eval.after_sft):
    _check_eval_data(cfg, "the eval stage" if "eval" in todo else "config.eval.after_sft")
  first_model_stage = next((s for s in todo if s != "sft"), None)
  if first_model_stage and "sft" not in todo and not cfg.model.hf_dir \
      and not cfg.allow_random_init \
      and not workdir_state.last_done(workdir, first_model_stage):
    raise config_utils.ConfigError(
        f"{first_model_stage} would start from a randomly initialised model: no earlier stage "
        f"is finished in {workdir} and config.model.hf_dir is not set. Run SFT first "
        "(--stages=sft or the whole recipe), point --config.workdir at a run that has it, "
        "or pass --config.allow_random_init=True if that is what you want")
  if not todo:
    print(f"nothing to do: every requested stage is finished in {workdir}")
  return todo


def _check_eval_data(cfg: recipe_config.RecipeConfig, why: str) -> None:
  # Said now: without problems the evaluation fails after the stages before it have run
  # (and after every rerun's SFT evaluation, so RL is never reached).
  if cfg.data.kind == "files" and not cfg.data.eval_files:
    raise config_utils.ConfigError(
        f"this run evaluates ({why}) but config.data.eval_files is empty: name evaluation "
        "files, or leave the evaluation out (--stages without eval, "
        "--config.eval.after_sft=False)")
  if cfg.data.kind == "toy" and cfg.data.toy.eval_problems == 0:
    raise config_utils.ConfigError(
        f"this run evaluates ({why}) but config.data.toy.eval_problems is 0")


def start_distributed(cfg: recipe_config.RecipeConfig) -> None:
  """Joins the job's other processes (config.distributed, JAX_* env, SLURM), if any."""
  if distributed.initialize(cfg.distributed) and cfg.rollout.backend == "jax":
    raise config_utils.ConfigError(
        "a multi-process run generates on rollout servers: set --config.rollout.backend="
        "server or sglang with --config.rollout.servers (the in-process 'jax' engine would "
        "need the whole model on process 0)")


def local_device_memory() -> tuple[float, float, str]:
  """(bytes, usable share, what) of this process's first device: an accelerator's
  allocator limit (XLA_PYTHON_CLIENT_MEM_FRACTION already applied: all of it usable), or,
  on a CPU, the host's memory, 0.9 of it usable (the OS and the rest of the process)."""
  import jax
  dev = jax.local_devices()[0]
  stats = dev.memory_stats() or {}
  if stats.get("bytes_limit"):
    return float(stats["bytes_limit"]), 1.0, f"{dev.device_kind}'s allocator limit"
  ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
  return ram, 0.9, "the host's memory (CPU devices)"


def check_rollout_memory(cfg: recipe_config.RecipeConfig) -> None:
  """The cheap part of `experiments.preflight`, run at start: the in-process engines'
  KV cache (rollout.backend="jax": on this process's first device beside the train
  state, or its share of each device on a mesh) against that device's memory (on a CPU
  every device's share in the host's memory), from the config's architecture alone
  (model.hf_dir's config.json, or the preset with its overrides): a cache that cannot
  fit is a ConfigError naming the field, the bytes and the fix, before any weights
  load or engine is built. Rollout servers hold their own caches (not checked here:
  `python -m experiments.preflight` checks a layout's)."""
  if cfg.rollout.backend != "jax":
    return
  from rstar_jax.rollout import jax_engine
  arch = preflight_checks.model_architecture(cfg.model)
  device_bytes, usable, what = local_device_memory()
  # The train state's share of this device (parameters and AdamW's moments over the
  # mesh): a floor of what the trainer keeps beside the cache.
  mesh = cfg.mesh.make() if cfg.mesh.enabled else None
  import jax
  # CPU devices share the host's memory: all of the state and the cache land there.
  host_shared = jax.local_devices()[0].platform == "cpu"
  devices = mesh.size if mesh is not None and not host_shared else 1
  resident = preflight_checks.checkpoint_bytes(arch, arch.param_dtype) / max(1, devices)
  # On a mesh the engine splits its cache over it (slots over data x fsdp, KV heads over
  # tensor) and refuses a layout that does not divide it: said here, before any weights.
  shards = 1
  if mesh is not None and mesh.size > 1:
    try:
      whole = jax_engine.cache_bytes_per_device(arch, cfg.rollout.engine)
      split = whole // jax_engine.cache_bytes_per_device(
          arch, cfg.rollout.engine, dict(mesh.shape), cfg.mesh.logical_rules())
    except ValueError as e:
      raise config_utils.ConfigError(f"rollout.engine on mesh {dict(mesh.shape)}: {e}") from e
    shards = 1 if host_shared else split
  problems = preflight_checks.check_rollout_memory(
      arch, cfg.rollout, device_bytes=device_bytes, usable_fraction=usable,
      trainer_resident_bytes=resident, cache_shards=shards)
  if problems:
    raise config_utils.ConfigError(
        "; ".join(map(str, problems)) + f" (device memory: {what}, "
        f"{device_bytes / preflight_checks.GB:.1f} GB; the trainer's state "
        f"{resident / preflight_checks.GB:.1f} GB of it; python -m experiments.preflight "
        "checks a layout before launch)")


def _tools(cfg: recipe_config.RecipeConfig):
  """The tool executor; tools run where rollouts are generated, on process 0."""
  if distributed.is_main():
    return tools_lib.build_tools(cfg.tools)
  return contextlib.nullcontext(None)


def _check_files(cfg: recipe_config.RecipeConfig) -> None:
  """Data files named in the config exist: said now, not after the sandbox has started
  and the model (14B) has loaded."""
  named = [("data.train_files", cfg.data.train_files), ("data.eval_files", cfg.data.eval_files),
           ("sft.data.files", cfg.sft.data.files)]
  for key, files in named:
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
      raise config_utils.ConfigError(f"config.{key}: no such file(s) {missing}")
  ref = cfg.rl.reference
  if (cfg.rl.loss.kl_coef > 0 and ref != rl_trainer.STAGE_START
      and not os.path.isfile(os.path.join(ref, "config.json"))):
    what = "no config.json there" if os.path.isdir(ref) else "no such directory"
    raise config_utils.ConfigError(
        f"config.rl.reference={ref!r}: {what} (a Hugging Face export directory, or "
        f"{rl_trainer.STAGE_START!r} for the stage's starting policy, is expected)")


def run(config, stages: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs (or resumes) the recipe; returns the evaluation reports by name."""
  _check_stages(stages)   # before the workdir and config.json are written
  cfg = recipe_config.build_config(config, stages or recipe_config.ALL_STAGES)
  _check_files(cfg)
  hf_dir = cfg.model.hf_dir
  if hf_dir and not os.path.isfile(os.path.join(hf_dir, "config.json")):
    # Said now, not after the sandbox and engines have started.
    raise config_utils.ConfigError(f"config.model.hf_dir={hf_dir}: no config.json there (a "
                                   "Hugging Face checkpoint directory is expected)")
  start_distributed(cfg)
  if recipe_config.generates(cfg, stages):
    check_rollout_memory(cfg)
  if distributed.is_main():   # a sandbox that cannot start here: said before any work
    tools_lib.check_local_sandbox(cfg.tools)
  with workdir_state.workdir_lock(workdir_state.make_workdir(cfg.workdir)):
    return _run_locked(cfg, stages)


def _file_defaults() -> tuple[str, dict] | None:
  """(spec, resolved plain config) of the entry point's config file before its command
  line's overrides, for the printed config diff; None without one, or when the file's
  own values do not build (then the overrides are what makes it valid)."""
  file_config = config_utils.file_config()
  if file_config is None:
    return None
  spec, config = file_config
  try:
    return spec, json.loads(workdir_state.resolved_json(recipe_config.build_config(config)))
  except (TypeError, ValueError):
    return None


def _run_locked(cfg: recipe_config.RecipeConfig, stages: Sequence[str] | None) -> dict[str, Any]:
  workdir, config_path = workdir_state.check_workdir(cfg)
  if distributed.is_main():
    print(config_utils.summary(json.loads(workdir_state.resolved_json(cfg)), config_path,
                               _file_defaults()))
  todo = plan(cfg, workdir, stages)
  reports: dict[str, Any] = {}
  if not todo:
    return reports
  if cfg.compile_cache:
    compile_cache.enable(cfg.compile_cache_dir or os.path.join(workdir, "compile_cache"))
  # Held to the end, tear-down included: a signal that lands after the last step still
  # lets the stage in flight finish and the servers stop in order.
  with interrupt.StopRequests() as stop, _tools(cfg) as tools:
    ctx = build_context(cfg, tools, workdir)
    try:
      reports = _run_stages(cfg, ctx, workdir, todo, stop)
    finally:
      if ctx.engines is not None:
        ctx.engines.stop()
    plot = (progress_plot.plot_rl_progress(workdir, recipe_config.RL_STAGES)
            if distributed.is_main() else None)
    if plot:
      print(f"plot: {plot}")
    if stop.requested:
      print(f"{signal.Signals(stop.signum).name} received after the last requested stage: all finished")
  return reports


def _run_stages(cfg: recipe_config.RecipeConfig, ctx: Context, workdir: str, todo: list[str],
                stop: interrupt.StopRequests):
  """The stages in `todo`; a signal stops the run after the stage in flight, or, in an
  evaluation or the stage-3 filter (hours at 14B), at its next finished trajectory: the
  journaled collection raises `interrupt.Interrupted` (see `rl.rollout_collector.collect`), and
  the same command resumes from the journal to the uninterrupted result."""
  reports: dict[str, Any] = {}
  model = None

  # Process 0's view decides for all (as in the trainers): DONE.json is written by
  # process 0 alone, so another process could read the file system before it lands
  # and skip the optimizer carry-over; a signal may reach one process only.
  def check_stop(done: str):
    if distributed.share_from_main(stop.requested) and done != todo[-1]:
      raise interrupt.Interrupted(stop.signum or signal.SIGTERM, after=f"stage {done}")

  def last_done(before: str) -> str | None:
    return distributed.on_main(lambda: workdir_state.last_done(workdir, before),
                               "reading DONE.json")

  for stage in todo:
    if stage == "eval":
      continue
    # See `plan`.
    sft_eval_only = stage == "sft" and bool(workdir_state.stage_done(workdir, "sft"))
    if sft_eval_only:
      model = load_stage_model(ctx, "sft")
    prev = last_done(stage)
    if model is None:
      model = load_stage_model(ctx, prev) if prev else initial_model(cfg, ctx.tokenizer,
                                                                     ctx.mesh, ctx.rules)
    if stage == "sft":
      if not sft_eval_only:
        model = run_sft(ctx, model)
      if cfg.eval.after_sft:
        check_stop(stage)
        reports["after_sft"] = run_eval(ctx, model, "after_sft")
        if distributed.is_main():
          print(reports["after_sft"].to_table())
    else:
      model = run_rl_stage(ctx, stage, model, prev if prev in recipe_config.RL_STAGES else None)
    check_stop(stage)
  if "eval" in todo:
    if model is None:
      prev = last_done("eval")
      model = load_stage_model(ctx, prev) if prev else initial_model(
          cfg, ctx.tokenizer, ctx.mesh, ctx.rules)
    reports["final"] = run_eval(ctx, model, "final")
    if distributed.is_main():
      print(reports["final"].to_table())
    _print_gain(workdir, reports["final"])
  return reports


def _print_gain(workdir: str, final) -> None:
  if not distributed.is_main():
    return
  sft_report = os.path.join(workdir, "eval_after_sft.json")
  if os.path.exists(sft_report):
    with open(sft_report) as f:
      before = json.load(f)
    print(f"pass@1 after SFT {100 * before['pass_at_1']:.1f}% -> final "
          f"{100 * final.pass_at_1:.1f}% (temperature {final.temperature}, "
          f"k={final.samples_per_problem})")


def evaluate_hf_dir(config, hf_dir: str):
  """Evaluates a HF export with the tokenizer saved beside its weights (the one it was
  trained with); the report records the directory and seed (<workdir>/eval_hf_dir.json)."""
  from rstar_jax.model import tokenizer as tokenizer_lib
  cfg = recipe_config.build_config(config)
  start_distributed(cfg)
  if not os.path.exists(os.path.join(hf_dir, "config.json")):
    raise config_utils.ConfigError(f"--hf_dir {hf_dir}: no config.json (not a HF export)")
  _check_files(cfg)
  _check_eval_data(cfg, "--hf_dir")
  if distributed.is_main():
    tools_lib.check_local_sandbox(cfg.tools)
  workdir = workdir_state.make_workdir(cfg.workdir)
  if os.path.exists(os.path.join(hf_dir, "tokenizer.json")):
    tok = tokenizer_lib.Tokenizer.from_dir(hf_dir)
  elif cfg.tokenizer.kind == "hf":
    tok = data_config.build_tokenizer(cfg.tokenizer, cfg.workdir, seed=cfg.seed)
  else:
    raise config_utils.ConfigError(
        f"--hf_dir {hf_dir} has no tokenizer.json, and config.tokenizer.kind='toy' would "
        "train a new tokenizer that does not match it; set --config.tokenizer.kind=hf "
        "--config.tokenizer.path=DIR")
  with workdir_state.workdir_lock(workdir), _tools(cfg) as tools:
    ctx = build_context(cfg, tools, workdir, tokenizer=tok)
    model = hf_io.load_hf(hf_dir, mesh=ctx.mesh, rules=ctx.rules, **runtime_overrides(cfg))
    try:
      return run_eval(ctx, model, "hf_dir", source=hf_dir)
    finally:
      if ctx.engines is not None:
        ctx.engines.stop()
