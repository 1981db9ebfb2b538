r"""python -m experiments.preflight --config experiments/configs/rstar2_agent_14b.py

Checks a run's layout on a CPU host before any accelerator is allocated, and says
whether it fits: exit 0, or exit 2 with one line per problem naming the config field,
the number and the fix.

The layout (which devices train, which serve rollouts, which run sandboxes; GPUs per
node; SGLang's memory fraction) is the config file's `:layout` variant (a `Layout`
section; `--layout=<file>:layout --layout.accelerator=H100` overrides a field). The mesh,
the micro-batches, the token budgets and the rollout engine are the recipe config's.
`--print_layout` prints the layout as shell assignments after the cheap checks (no
compile): what experiments/slurm/rstar2_14b.sbatch reads.

What it prints, per device or per server (GB = 1e9 bytes):
  trainer  XLA's memory plan of the train step for each training shape of the run: SFT
           (sft.seq_len, sft.rows_per_step), each RL stage (its response budget; the batch
           length is the power of two above it, capped at rollout.engine.max_len), with the
           config's KL weight and with a KL reference (kl_coef > 0: one more copy of the
           parameters), compiled ahead of time on a fake CPU mesh of the layout's trainer
           devices (experiments/plan_memory.py). XLA:CPU caveats: it upcasts most bf16 ops
           to f32, and with remat="full" converts the bf16 activation stash to one f32 copy
           (4 * layers * mb * T * hidden bytes more than a GPU keeps: the "GPU est."
           column takes it off); its fusion and scheduling are not a GPU's; the runtime's
           own reserve (NCCL/RCCL buffers, fragmentation) is not in it, so the verdict
           compares the CPU peak with HBM x Layout.trainer_mem_fraction. SFT is planned as
           the RL step at SFT's shape (an upper bound: that step carries four more f32
           [N, T] arrays). Attention "auto" is planned as chunked.
  rollout  SGLang: weights (bf16) / tensor-parallel size, and the token pool SGLang
           allocates from its static fraction: (HBM x gpus x mem_fraction - weights) /
           KV bytes per token; its concurrency in full-length trajectories (pool //
           rollout.engine.max_len). JaxEngine (rollout.backend=jax): num_engines x
           num_slots x max_len KV tokens, one device's share of it (the engine splits
           its cache over the mesh: slots over data x fsdp, KV heads over tensor) beside
           that device's train state, against the same usable HBM.
  demand   one step's trajectories (prompts_per_step x samples_per_prompt) at the stage's
           whole response budget (an upper bound) and at --mean_fill of it, over the
           servers at a stated --decode_tokens_per_s each: the generation time a step.
  sync     the bytes the trainer writes and every server reads a step
           (rollout.weight_sync.dtype) and their time at each --storage_gbps.
  ckpt     the orbax checkpoint (params + AdamW's two moments), its write time, and the
           Young/Daly cadence at --faults_per_week and --step_s against rl.checkpoint_every.

Fake devices: run as a script, it sets --xla_force_host_platform_device_count=64 before
jax is imported unless XLA_FLAGS names a count; a bigger trainer mesh needs more.
The estimates of time are from stated rates, not measurements (docs/guides/cluster.md).
"""
from __future__ import annotations

import os

if __name__ == "__main__":   # before jax is imported (here or by rstar_jax), as plan_memory
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=64").strip()

import dataclasses
import math
import sys
from typing import Any, Sequence

from rstar_jax.recipe import layout as layout_lib
from rstar_jax.recipe import preflight_checks as pc   # the pure checks the recipe runs too


# ---- the run's shapes --------------------------------------------------------------------
def _pow2_at_least(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainShape:
  """One training shape of the run: its label, sequence length and rows a step, the
  micro-batch per batch shard it gives, and the field that sets the micro-batches."""
  label: str               # "sft", or the RL stages of this shape ("stage1,2,3")
  seq_len: int
  rows: int
  micro_batches: int
  micro_batch: int          # sequences per micro-batch per batch shard (data x fsdp)
  kl_coef: float
  field: str                # e.g. "rl.step.micro_batches"
  tag: str = ""             # "+KL ref" / "-KL ref": the config's KL choice flipped

  @property
  def name(self) -> str:
    return self.label + (" " + self.tag if self.tag else "")


def rl_batch_len(budget: int, max_len: int, length_multiple: int) -> int:
  """The longest batch of a stage (rl.batching): the power of two above the longest
  trajectory (prompt + response: more than `budget`), capped at the engines' max_len
  rounded to rl.length_multiple (RLTrainer.max_batch_len)."""
  cap = _round_up(max_len, length_multiple)
  return min(max(length_multiple, _pow2_at_least(budget + 1)), cap)


def rl_rows(kept: int, row_multiple: int, pow2_rows: bool) -> int:
  if pow2_rows:
    return row_multiple * _pow2_at_least(-(-kept // row_multiple))
  return _round_up(kept, row_multiple)


def train_shapes(rc, batch_shards: int, kl_probe: float = 1e-3) -> list[TrainShape]:
  """SFT's and each RL stage's train-step shape (deduplicated), from a RecipeConfig-like
  object `rc` (sections as dataclasses) and the mesh's data x fsdp."""
  out: list[TrainShape] = []
  seen = set()

  def add(label, t, rows, mbs, kl, field, tag=""):
    mb = -(-rows // (mbs * batch_shards))
    key = (t, mb, mbs, kl, field)
    if key in seen:
      for i, s in enumerate(out):
        if (s.seq_len, s.micro_batch, s.micro_batches, s.kl_coef, s.field) == key:
          out[i] = dataclasses.replace(s, label=f"{s.label},{label[-1]}")
      return
    seen.add(key)
    out.append(TrainShape(label=label, seq_len=t, rows=rows, micro_batches=mbs,
                          micro_batch=mb, kl_coef=kl, field=field, tag=tag))

  if rc.sft.enabled:
    add("sft", rc.sft.seq_len, rc.sft.rows_per_step, rc.sft.step.micro_batches, 0.0,
        "sft.step.micro_batches")
  rl = rc.rl
  kept = rl.prompts_per_step * min(rl.downsample.group_size, rl.samples_per_prompt)
  rows = rl_rows(kept, rl.step.micro_batches * batch_shards, rl.pow2_rows)
  kls = [rl.loss.kl_coef] + ([kl_probe] if rl.loss.kl_coef == 0 else [0.0])
  for kl in kls:
    tag = "" if kl == rl.loss.kl_coef else ("+KL ref" if kl > 0 else "-KL ref")
    for name in ("stage1", "stage2", "stage3"):
      stage = getattr(rc, name)
      if not stage.num_steps:
        continue
      t = rl_batch_len(stage.agent.max_response_tokens, rc.rollout.engine.max_len,
                       rl.length_multiple)
      add(name, t, rows, rl.step.micro_batches, kl, "rl.step.micro_batches", tag)
  return out


# ---- the report ----------------------------------------------------------------------------
def _gb(x: float) -> str:
  return f"{x / pc.GB:.1f} GB"


def _load_sections(config) -> Any:
  """The sections the preflight reads, built as their dataclasses (the model, tokenizer
  and data sections are not needed: their paths come on the real command line)."""
  from rstar_jax import config_utils as cu
  from rstar_jax import sharding
  from rstar_jax.recipe import recipe_config
  from rstar_jax.rl import trainer as rl_trainer
  from rstar_jax.rollout import backends

  rollout = cu.to_dict(config.rollout)
  if rollout.get("backend") in pc.HTTP_BACKENDS and not rollout.get("servers"):
    # The servers' URLs are made at launch (the batch script, launch_cluster): a stand-in.
    rollout["servers"] = ("http://launch.invalid:30000",)
  built = dict(
      mesh=cu.build(sharding.MeshConfig, config.mesh, "config.mesh"),
      rollout=cu.build(backends.RolloutConfig, rollout, "config.rollout"),
      sft=cu.build(recipe_config.SFTStage, config.sft, "config.sft"),
      rl=cu.build(rl_trainer.RLConfig, config.rl, "config.rl"),
      **{n: cu.build(recipe_config.RLStage, config[n], f"config.{n}")
         for n in recipe_config.RL_STAGES})
  return type("Sections", (), built)()


def model_config_of(config, preset: str):
  """The architecture as the recipe builds it: the config.json of model.hf_dir when it
  holds one, else model.preset (or `preset` when the config names none: model.hf_dir is
  given on the real command line; its config.json is that preset's for Qwen3-14B-Base),
  with every architecture field the config's model section overrides."""
  return pc.model_architecture(config.model, preset)


def cheap_checks(sections, model_cfg,
                 layout: layout_lib.Layout) -> tuple[list[pc.Problem], dict]:
  """Everything but the compile: the mesh against the layout, multi-host rollouts, the
  rollout memory, the micro-batch split. Returns (problems, figures)."""
  problems: list[pc.Problem] = []
  mesh = sections.mesh
  sizes = {"data": mesh.data, "fsdp": mesh.fsdp, "tensor": mesh.tensor}
  n = layout.trainer_devices
  if not mesh.enabled:
    if n > 1:
      problems.append(pc.Problem("mesh.enabled", f"False, but the layout trains on {n} devices "
                              f"({layout.trainer_nodes} nodes x {layout.gpus_per_node}); fix: "
                              "mesh.enabled=True with data x fsdp x tensor = " + str(n)))
    sizes = {"data": 1, "fsdp": 1, "tensor": 1}
  else:
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if -1 in sizes.values():   # the axis that takes the rest (1 if nothing is left)
      sizes = {k: (max(1, n // fixed) if v == -1 else v) for k, v in sizes.items()}
    if math.prod(sizes.values()) != n:
      problems.append(pc.Problem("mesh.fsdp", f"mesh {sizes} is {math.prod(sizes.values())} "
                              f"devices but the layout trains on {n} "
                              f"(layout.trainer_nodes x gpus_per_node); fix: data x fsdp x "
                              f"tensor = {n}"))
    if sizes["tensor"] > layout.gpus_per_node or layout.gpus_per_node % sizes["tensor"]:
      problems.append(pc.Problem("mesh.tensor", f"{sizes['tensor']} does not divide a node's "
                              f"{layout.gpus_per_node} GPUs: tensor-parallel traffic would "
                              "cross nodes; fix: a divisor of gpus_per_node"))
    if model_cfg.num_key_value_heads % sizes["tensor"]:
      problems.append(pc.Problem("mesh.tensor", f"{sizes['tensor']} does not divide the "
                              f"{model_cfg.num_key_value_heads} KV heads"))
  rollout = sections.rollout
  if rollout.backend == "jax" and layout.trainer_nodes > 1:
    problems.append(pc.Problem("rollout.backend", f"'jax' generates in the trainer process; a "
                            f"run of {layout.trainer_nodes} trainer processes refuses it "
                            "(process 0 drives rollouts through servers); fix: "
                            "rollout.backend=sglang with the layout's servers"))
  state_per_device = (pc.checkpoint_bytes(model_cfg, model_cfg.param_dtype)
                      / math.prod(sizes.values()))
  shards = sizes["data"] * sizes["fsdp"]
  shapes = train_shapes(sections, shards)
  # What the trainer keeps on a device while a JaxEngine's cache lives there (the cache
  # is never freed, so it shares the device with the train step): the state and, as a
  # floor of the step's own memory, the bf16 layer inputs that remat keeps for the
  # backward pass of the largest shape. The compiled plan replaces it with the peak.
  stash = max((2 * model_cfg.num_hidden_layers * s.micro_batch * s.seq_len
               * model_cfg.hidden_size for s in shapes), default=0)
  eng = rollout.engine
  if rollout.backend in pc.HTTP_BACKENDS:
    rmem = pc.sglang_server_memory(model_cfg, device_bytes=layout.hbm_bytes,
                                gpus_per_server=layout.gpus_per_server,
                                mem_fraction=layout.sglang_mem_fraction, max_len=eng.max_len)
    servers = layout.rollout_servers
    if servers < 1:
      problems.append(pc.Problem("layout.servers_per_node", "no rollout server in the layout "
                              "(no rollout node or servers_per_node=0)"))
  else:
    # The engine splits its cache over the trainer's mesh, and refuses a layout that
    # does not divide it (rollout/jax_engine.py: cache_specs).
    from rstar_jax.rollout import jax_engine
    cache_shards = 1
    try:
      cache_shards = (jax_engine.cache_bytes_per_device(model_cfg, eng)
                      // jax_engine.cache_bytes_per_device(model_cfg, eng, sizes,
                                                           mesh.logical_rules()))
    except ValueError as e:
      problems.append(pc.Problem("rollout.engine", str(e)))   # the error names the field
    rmem = pc.jax_engine_memory(model_cfg, num_slots=eng.num_slots, max_len=eng.max_len,
                             num_engines=rollout.num_engines,
                             cache_dtype=eng.cache_dtype or model_cfg.dtype,
                             device_bytes=layout.hbm_bytes,
                             usable_fraction=layout.trainer_mem_fraction,
                             resident_bytes=state_per_device + stash,
                             cache_shards=cache_shards)
    servers = rollout.num_engines
  problems += pc.rollout_problems(rmem)
  for s in shapes:
    if s.micro_batches * shards > s.rows:
      problems.append(pc.Problem(s.field, f"{s.micro_batches} micro-batches x {shards} batch "
                              f"shards > {s.rows} rows a step ({s.label}): micro-batches of "
                              f"padding; fix: at most {max(1, s.rows // shards)}"))
  return problems, dict(sizes=sizes, state_per_device=state_per_device, rollout=rmem,
                        servers=servers, shapes=shapes)


def plan_trainer(shapes: Sequence[TrainShape], model_cfg, sizes: dict, preset: str,
                 logprob_chunk: int) -> list[tuple[TrainShape, Any]]:
  """XLA's plan of each shape on fake devices (experiments/plan_memory.plan)."""
  from experiments import plan_memory as pm
  out = []
  mesh = tuple((a, n) for a, n in sizes.items() if n > 1) or (("fsdp", 1),)
  for s in shapes:
    case = pm.PlanCase(preset=preset, mesh=mesh, seq_len=s.seq_len, micro_batch=s.micro_batch,
                       micro_batches=s.micro_batches, remat_policy=model_cfg.remat_policy,
                       attention_impl=model_cfg.attention_impl,
                       attention_chunk=model_cfg.attention_chunk,
                       param_dtype=model_cfg.param_dtype, dtype=model_cfg.dtype,
                       logprob_chunk=logprob_chunk, kl_coef=s.kl_coef)
    out.append((s, pm.plan(case)))
  return out


def gpu_estimate(est, model_cfg) -> float:
  """The CPU peak less the f32 copy of the bf16 activation stash that XLA:CPU makes
  with remat='full' (plan_memory's docstring); other policies: the CPU peak."""
  c = est.case
  if c.remat_policy != "full" or c.dtype != "bfloat16":
    return est.peak_bytes
  return est.peak_bytes - 4 * model_cfg.num_hidden_layers * c.micro_batch * c.seq_len * (
      model_cfg.hidden_size)


def report(sections, model_cfg, layout: layout_lib.Layout, checks: dict, *, plans,
           decode_tps: float, mean_fill: float, storage_gbps: Sequence[float],
           faults_per_week: float, step_s: float) -> tuple[list[str], list[pc.Problem]]:
  """The printed lines and the trainer's problems (from the plans)."""
  lines, problems = [], []
  sizes, rmem, servers = checks["sizes"], checks["rollout"], checks["servers"]
  usable = layout.hbm_bytes * layout.trainer_mem_fraction
  mesh_label = " x ".join(f"{k} {v}" for k, v in sizes.items() if v > 1) or "one device"
  hbm = layout_lib.ACCELERATORS[layout.accelerator]
  lines.append(f"layout: {layout.nodes} nodes x {layout.gpus_per_node} {layout.accelerator} "
               f"({hbm:.0f} GB); trainer {layout.trainer_nodes} "
               f"nodes = {layout.trainer_devices} devices, mesh {mesh_label}; rollout "
               f"{layout.rollout_nodes} nodes x {layout.servers_per_node} SGLang servers x "
               f"{layout.gpus_per_server} GPU = {layout.rollout_servers} servers; sandbox "
               f"{layout.sandbox_servers} servers x {layout.sandbox_children} children on the "
               f"trainer nodes' CPUs")
  p = model_cfg.num_params
  lines.append(f"model: {p / 1e9:.2f}B params; weights "
               f"{_gb(pc.weight_bytes(model_cfg, 'bfloat16'))}"
               f" bf16, {_gb(pc.weight_bytes(model_cfg, 'float32'))} f32; AdamW moments "
               f"{_gb(pc.optimizer_bytes(model_cfg))}; KV {pc.kv_bytes_per_token(model_cfg):,} "
               f"bytes/token bf16; train state {_gb(checks['state_per_device'])}/device")
  # Trainer.
  lines.append(f"trainer (XLA:CPU plan per device; usable {_gb(usable)} = "
               f"{layout.trainer_mem_fraction:g} x HBM):")
  lines.append(f"  {'shape':<20}{'T':>6}{'rows':>6}{'mbs':>5}{'mb':>4}{'kl':>7}{'state':>8}"
               f"{'temp':>8}{'ref':>7}{'peak':>8}{'GPU est.':>9}  fits")
  for s, est in plans:
    ok = est.peak_bytes <= usable
    lines.append(f"  {s.name:<20}{s.seq_len:>6}{s.rows:>6}{s.micro_batches:>5}"
                 f"{s.micro_batch:>4}{s.kl_coef:>7g}{est.state_bytes / pc.GB:>8.1f}"
                 f"{est.temp_bytes / pc.GB:>8.1f}{est.reference_bytes / pc.GB:>7.1f}"
                 f"{est.peak_bytes / pc.GB:>8.1f}{gpu_estimate(est, model_cfg) / pc.GB:>9.1f}  "
                 f"{'yes' if ok else 'NO'}")
    if not ok and not s.tag:
      need = s.micro_batches * _pow2_at_least(math.ceil(est.peak_bytes / usable))
      problems.append(pc.Problem(s.field, f"{s.name}: peak {_gb(est.peak_bytes)} > usable "
                              f"{_gb(usable)} per {layout.accelerator} at {s.micro_batch} "
                              f"sequence(s) of {s.seq_len} per micro-batch per shard; fix: "
                              f"{s.field}={need} or more (fewer sequences per micro-batch)"))
    elif not ok:
      lines.append(f"    ({s.tag} at this shape would not fit: raise {s.field} with it)")
  if not plans:
    lines.append("  (not compiled: --plan=false)")
  # Rollout.
  eng = sections.rollout.engine
  if rmem.backend == "sglang":
    lines.append(f"rollout per SGLang server ({layout.gpus_per_server} x {layout.accelerator}, "
                 f"mem_fraction {layout.sglang_mem_fraction:g}): static {_gb(rmem.usable_bytes)}"
                 f" = weights {_gb(rmem.weight_bytes)} + KV pool {_gb(rmem.kv_bytes)} = "
                 f"{rmem.kv_tokens:,} tokens = {rmem.concurrent} trajectories of max_len "
                 f"{rmem.max_len}; {servers} servers: {servers * rmem.concurrent:,} at once")
  else:
    lines.append(f"rollout JaxEngine x {servers} on one device: KV {eng.num_slots} slots x "
                 f"{eng.max_len} = {_gb(rmem.kv_bytes)} + the trainer's "
                 f"{'peak' if plans else 'state and activation floor'} "
                 f"{_gb(rmem.resident_bytes)}"
                 f" = {_gb(rmem.total_bytes)} of {_gb(rmem.usable_bytes)} usable")
  rl = sections.rl
  trajs = rl.prompts_per_step * rl.samples_per_prompt
  conc = max(1, servers * rmem.concurrent)
  lines.append(f"demand a step: {rl.prompts_per_step} prompts x {rl.samples_per_prompt} = "
               f"{trajs:,} trajectories; at {decode_tps:,.0f} tokens/s per server "
               f"(assumed, not measured):")
  for name in ("stage1", "stage2", "stage3"):
    st = getattr(sections, name)
    if not st.num_steps:
      continue
    budget = st.agent.max_response_tokens
    tokens = trajs * budget
    t_max = tokens / (servers * decode_tps)
    lines.append(f"  {name}: budget {budget:,} -> <= {tokens / 1e6:.0f}M tokens, "
                 f"{math.ceil(trajs / conc)} wave(s) of {min(conc, trajs):,} full-length "
                 f"trajectories; generation <= {t_max:.0f} s, ~{t_max * mean_fill:.0f} s at "
                 f"{mean_fill:g} of the budget")
  # Weight sync and checkpoints.
  wdt = sections.rollout.weight_sync.dtype
  wb = pc.weight_bytes(model_cfg, wdt)
  if rmem.backend == "sglang":
    # Every trainer process writes its share at once (hf_io.save_hf(parallel=True)): the
    # write takes wb / bw when the storage's total bandwidth is the limit, wb / (n * bw) when
    # each trainer node's own link is; every server then reads the whole version.
    n = layout.trainer_nodes
    lines.append(f"weight sync a step: {_gb(wb)} ({wdt}) written by the {n} trainer processes "
                 f"at once (~{_gb(wb / n)} each), read by {servers} servers "
                 f"({_gb(wb * servers)}); write (storage-bound / node-bound) + read at" + ";".join(
                     f" {bw:g} GB/s: {wb / (bw * pc.GB):.0f} / {wb / (n * bw * pc.GB):.0f} s + "
                     f"{wb * servers / (bw * pc.GB):.0f} s"
                     for bw in storage_gbps))
  else:
    lines.append("weight sync a step: none (the in-process engines read the trainer's "
                 "parameters)")
  cb = pc.checkpoint_bytes(model_cfg, model_cfg.param_dtype)
  every = rl.checkpoint_every
  parts = []
  for bw in storage_gbps:
    c = cb / (bw * pc.GB)
    mtbf = 7 * 24 * 3600 / faults_per_week
    tau = math.sqrt(2 * mtbf * c)
    parts.append(f" {bw:g} GB/s: write {c:.0f} s ({c / (every * step_s):.1%} of "
                 f"{every} steps), Young/Daly every {tau / step_s:.1f} steps")
  lines.append(f"checkpoint: {_gb(cb)} (params {model_cfg.param_dtype} + AdamW moments); "
               f"rl.checkpoint_every={every}; at {faults_per_week:g} faults/week and "
               f"{step_s:.0f} s/step:" + ";".join(parts))
  return lines, problems


def load_layout(spec: str) -> layout_lib.Layout:
  from rstar_jax import config_utils as cu
  return cu.build(layout_lib.Layout, cu._load_config_file(spec), "layout")


def main(argv: Sequence[str]) -> None:
  del argv
  from absl import flags
  from rstar_jax import config_utils as cu
  FLAGS = flags.FLAGS
  config = _CONFIG.value
  if _LAYOUT.value is not None:
    layout = cu.build(layout_lib.Layout, _LAYOUT.value, "layout")
  else:
    path = cu._config_path_from_argv(sys.argv, "config").split(":")[0]
    try:
      layout = load_layout(f"{path}:layout")
    except (TypeError, ValueError) as e:   # ConfigError too: no variants, a bad field
      raise cu.ConfigError(f"the layout of --config {path} (its ':layout' variant): {e}; "
                           "give --layout=<file>:<variant> if it is elsewhere") from None
  try:
    sections = _load_sections(config)
    model_cfg = model_config_of(config, FLAGS.preset)
  except (ValueError, KeyError) as e:
    raise cu.ConfigError(str(e)) from None
  problems, checks = cheap_checks(sections, model_cfg, layout)
  if FLAGS.print_layout:
    if problems:
      raise cu.ConfigError("; ".join(map(str, problems)))
    print(layout_lib.shell_layout(layout, sections.rollout.engine.max_len))
    return
  plans = []
  if FLAGS.plan and any(p.field.startswith("mesh.") for p in problems):
    print("trainer plan skipped: the mesh does not match the layout (below)")
  elif FLAGS.plan:
    import jax
    need = math.prod(checks["sizes"].values())
    if len(jax.devices()) < need:
      raise cu.ConfigError(f"the plan needs {need} fake devices, {len(jax.devices())} exist: "
                           f"XLA_FLAGS=--xla_force_host_platform_device_count={need} python -m "
                           "experiments.preflight ...")
    plans = plan_trainer(checks["shapes"], model_cfg, checks["sizes"],
                         config.model.get("preset") or FLAGS.preset,
                         sections.rl.step.logprob_chunk)
  if plans and checks["rollout"].backend == "jax":   # the step's peak, not its floor
    rmem = dataclasses.replace(checks["rollout"],
                               resident_bytes=max(est.peak_bytes for sh, est in plans if not sh.tag))
    checks["rollout"] = rmem
    problems = [p for p in problems if p.field != "rollout.engine.num_slots"]
    problems += pc.rollout_problems(rmem)
  lines, more = report(sections, model_cfg, layout, checks, plans=plans,
                       decode_tps=FLAGS.decode_tokens_per_s, mean_fill=FLAGS.mean_fill,
                       storage_gbps=[float(x) for x in FLAGS.storage_gbps],
                       faults_per_week=FLAGS.faults_per_week, step_s=FLAGS.step_s)
  print("\n".join(lines))
  problems += more
  if problems:
    print("verdict: does not fit")
    for p in problems:
      print(f"  {p}")
    sys.stdout.flush()
    sys.exit(2)
  print("verdict: fits" + ("" if plans else " (trainer not compiled: --plan=false)"))


if __name__ == "__main__":
  from absl import flags
  from ml_collections import config_flags
  from rstar_jax import config_utils

  _CONFIG = config_flags.DEFINE_config_file("config", None, "the recipe config file")
  _LAYOUT = config_flags.DEFINE_config_file(
      "layout", None, "the layout (a Layout section); default: the --config file's :layout")
  flags.DEFINE_bool("print_layout", False, "print the layout as shell assignments (after "
                    "the cheap checks; no compile) and exit")
  flags.DEFINE_bool("plan", True, "compile the train step of every training shape (XLA:CPU)")
  flags.DEFINE_string("preset", "qwen3-14b", "architecture when the config's model.preset "
                      "is unset (model.hf_dir given at launch)")
  flags.DEFINE_float("decode_tokens_per_s", 3000.0, "assumed decode rate of one rollout "
                     "server, tokens/s over its whole batch")
  flags.DEFINE_float("mean_fill", 0.6, "assumed mean share of the response budget a "
                     "trajectory uses")
  flags.DEFINE_list("storage_gbps", ["2", "10"], "shared-storage bandwidths, GB/s")
  flags.DEFINE_float("faults_per_week", 2.1, "assumed faults a week (docs/guides/"
                     "fault_tolerance.md)")
  flags.DEFINE_float("step_s", 1190.0, "assumed seconds a step (510 steps in a week)")
  config_utils.run(main)
