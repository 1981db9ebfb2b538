"""Config sections mirror their dataclasses: every field reachable, bad input named.

The walk below is generated from the dataclasses themselves: for every field of every
component config inside RecipeConfig it sets a value through the override path
(`--config.<section>.<field>`) and checks that it lands in the built object.
"""
import dataclasses
import json
import os
import subprocess
import sys
import typing

import pytest

from rstar_jax import config_utils
from rstar_jax.recipe import recipe_config, stages

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY = os.path.join(REPO, "experiments/configs/toy.py")
CONFIGS = ["experiments/configs/toy.py", "experiments/configs/toy.py:smoke",
           "experiments/configs/toy.py:first_run",
           "experiments/configs/toy_roc_ablation.py",
           "experiments/configs/toy_async_ablation.py",
           "experiments/configs/rstar2_agent_14b.py"]


def _load(spec=TOY):
  return config_utils._load_config_file(spec)


def _14b():
  c = _load(os.path.join(REPO, "experiments/configs/rstar2_agent_14b.py"))
  c.model.hf_dir, c.tokenizer.path, c.data.train_files = "/m", "/m", ("/d.parquet",)
  c.rollout.servers = ("http://node4:30000",)   # rollout.backend="sglang": URLs at launch
  return c


@pytest.mark.parametrize("spec", CONFIGS)
def test_every_config_builds(spec):
  c = _load(os.path.join(REPO, spec))
  if "14b" in spec:
    c = _14b()
  if "ablation" in spec:
    c.model.hf_dir, c.tokenizer.path = "/sft/export", "/sft/export"
  cfg = recipe_config.build_config(c)
  doc = open(os.path.join(REPO, spec.split(":")[0])).read().split('"""')[1]
  assert doc.startswith("python -m experiments.")   # the docstring opens with the command
  for stage in recipe_config.RL_STAGES:
    assert getattr(cfg, stage).agent.max_response_tokens < cfg.rollout.engine.max_len


def test_14b_config_matches_spec():
  c = recipe_config.build_config(_14b())
  assert (c.rl.loss.eps_low, c.rl.loss.eps_high, c.rl.optimizer.learning_rate,
          c.rl.optimizer.warmup_steps, c.rl.optimizer.weight_decay) == (0.2, 0.28, 1e-6, 20, 0.01)
  assert (c.rl.samples_per_prompt, c.rl.downsample.group_size) == (32, 16)
  assert (c.stage1.agent.max_response_tokens, c.stage2.agent.max_response_tokens,
          c.stage3.agent.max_turns) == (8192, 12288, 15)
  assert c.stage3.hard_only and c.stage3.reset_optimizer and c.stage3.hard_k == 8
  assert c.chat.system_prompt.startswith("A conversation between User and Assistant")


# ---- every field reachable --------------------------------------------------------------
def _leaves(cls, prefix=()):
  """(path, field type) of every non-dataclass field under `cls`."""
  hints = typing.get_type_hints(cls)
  for f in dataclasses.fields(cls):
    tp = hints[f.name]
    if dataclasses.is_dataclass(tp):
      yield from _leaves(tp, prefix + (f.name,))
    else:
      yield prefix + (f.name,), tp, f


def _other_value(tp, current, path):
  """A value of type `tp` different from `current` that validation accepts."""
  name = path[-1]
  inner = config_utils._optional_of(tp)
  base = config_utils._base_type(inner or tp)
  special = {
      "preset": "qwen3-0.6b", "kind": None, "backend": None, "method": "uniform",
      "positive_selection": "topk", "sample_counts": "half_slots", "estimator": "dr_grpo", "aggregation": "seq-mean-token-mean",
      "kl_estimator": "k2", "old_logprobs": "recompute",
      "scheduler_policy": "round_robin", "error_format": "full", "on_error": "skip",
      "param_dtype": "bfloat16", "dtype": "bfloat16", "remat_policy": "full",
      "attention_impl": "chunked", "decode_attention_impl": "pallas",
      "topk_negative_order": "penalty", "levels": (1,),
      "kinds": ("product",), "bug_kinds": ("name",), "urls": ("http://127.0.0.1:1",),
      "servers": ("http://127.0.0.1:30000",),
      "user_template": "Q: {problem}", "number_chunk": 2, "std_ddof": 0,
      "train_files": ("/x.jsonl",), "eval_files": ("/y.jsonl",), "files": ("/s.jsonl",),
      "fsdp": 1, "max_parallel_calls": 2, "stop_at_tool_call": False,
      "dual_clip_c": 3.0, "max_response_len": 100, "total_steps": 10_000,
      "eps_low": 0.1, "min_lr_ratio": 0.5, "bug_share": 0.1, "no_tool_share": 0.1,
      "no_tool_correct_share": 0.25, "heldout_share": 0.1, "top_p": 0.9,
      "tool_schema": {"type": "function", "function": {
          "name": "py", "parameters": {"properties": {"code": {"type": "string"}}}}},
      "rules": {"embed": "tensor"}, "cpu_collectives": "mpi", "pause_mode": "abort",
      "off_policy": "decoupled", "weight_updates": "between_requests", "protocol": "report",
  }
  if path[-2:] == ("weight_sync", "dtype"):
    return "float32"
  if path == ("sft", "step", "fused_head_loss"):
    return None   # refused in SFT: test_the_rl_only_fused_head_is_refused_in_sft
  if name == "schedule":
    return "warmup_cosine" if current == "warmup_constant" else "warmup_constant"
  if name in special and special[name] is not None:
    value = special[name]
    return value if value != current else None
  if name in ("kind", "backend"):
    return None   # enumerations with one other member that needs other fields set
  if base is bool:
    return not current
  if base is int:
    return (current or 0) + 1 if name not in ("num_key_value_heads",) else None
  if base is float:
    return (current or 0.5) * 0.5
  if base is str:
    return (current or "") + "x"
  return None


def test_every_field_is_reachable_by_its_override_path():
  base = _load()
  tried = 0
  skipped = []
  for path, tp, f in _leaves(recipe_config.RecipeConfig):
    node = base
    for p in path:
      node = node[p]
    value = _other_value(tp, node, path)
    if value is None:
      skipped.append(".".join(path))
      continue
    c = _load()
    target = c
    for p in path[:-1]:
      target = target[p]
    if path[0] == "model" and path[-1] == "preset":
      c.model.update(hidden_size=None, intermediate_size=None, num_hidden_layers=None,
                     num_attention_heads=None, num_key_value_heads=None, head_dim=None)
    if path == ("chat", "max_parallel_calls"):
      c.chat.stop_at_tool_call = False   # parallel calls need turns that do not stop at one
    if path == ("model", "hf_dir"):
      c.model.preset = None   # exactly one source of weights
    if path == ("tools", "urls_file"):
      c.tools.urls = ("http://h:1",)     # the file moves the servers given in urls
    if path == ("rollout", "servers_file"):
      c.rollout.update(backend="server", servers=("http://h:2",))
    if path[-1] == "tool_schema" or path[-1] == "rules":
      target[path[-1]] = json.dumps(value) if path[-1] == "tool_schema" else value
    else:
      target[path[-1]] = value
    built = recipe_config.build_config(c)
    got = built
    for p in path:
      got = got[p] if isinstance(got, dict) else getattr(got, p)
    if path[-1] == "rules":
      assert got["embed"] == "tensor"
    else:
      assert got == (tuple(value) if isinstance(value, list) else value), path
    tried += 1
  # Every leaf was either set and found, or is an enumeration tested elsewhere.
  assert tried >= 150, (tried, skipped)
  assert set(skipped) <= {"tokenizer.kind", "data.kind", "tools.backend", "rollout.backend",
                          "model.num_key_value_heads", "sft.step.fused_head_loss"}, skipped


def test_the_rl_only_fused_head_is_refused_in_sft():
  """StepConfig.fused_head_loss is the RL step's lever: SFT's step does not use it, so
  setting it there is refused (a value that validates must also run)."""
  c = _load()
  c.sft.step.fused_head_loss = True
  with pytest.raises(config_utils.ConfigError, match=r"sft.*fused_head_loss=True.*Fix: leave "
                                                     r"sft\.step\.fused_head_loss False"):
    recipe_config.build_config(c)


def test_bad_key_and_bad_type_name_the_field():
  # As a config file might write them (a plain dict; ConfigDict itself type-checks).
  c = _load().to_dict()
  c["rl"]["downsample"]["use_eror_penalty"] = False
  with pytest.raises(config_utils.ConfigError,
                     match=r"config.rl.downsample: unknown key\(s\) \['use_eror_penalty'\]; "
                           r"valid keys: .*use_error_penalty"):
    recipe_config.build_config(c)
  c = _load().to_dict()
  c["stage1"]["agent"]["max_turns"] = "many"
  with pytest.raises(config_utils.ConfigError,
                     match=r"config.stage1.agent.max_turns: expected int, got str 'many'"):
    recipe_config.build_config(c)
  c = _load()
  c.rl.optimizer.learning_rate = -1.0
  with pytest.raises(config_utils.ConfigError,
                     match=r"config.rl.optimizer: OptimizerConfig.learning_rate must be > 0"):
    recipe_config.build_config(c)


def test_mesh_rules_are_config_data():
  c = _load()
  c.mesh.rules.embed = "tensor"
  c.mesh.rules.batch = ""
  rules = dict(recipe_config.build_config(c).mesh.logical_rules())
  assert rules["embed"] == "tensor" and rules["batch"] is None and rules["vocab"] == "tensor"
  c.mesh.rules.embed = "fsdp,nodes"
  with pytest.raises(config_utils.ConfigError, match=r"unknown mesh axes \['nodes'\]"):
    recipe_config.build_config(c)


def test_mesh_that_does_not_fit_the_devices_is_rejected():
  from rstar_jax import sharding
  with pytest.raises(ValueError, match="multiply to 6 but there are 8 devices"):
    sharding.MeshConfig(enabled=True, data=1, fsdp=3, tensor=2).make()


def test_toy_levels_and_kinds_select_the_problems():
  from rstar_jax.data import data_config
  cfg = data_config.DataConfig(kind="toy", toy=data_config.ToyDataConfig(
      levels=(1,), kinds=("product", "modpow"), train_problems=40, eval_problems=8))
  train, evals = data_config.load_problems(cfg, seed=0)
  assert len(train) == 40 and len(evals) == 8
  assert {p.meta["kind"] for p in train} == {"product", "modpow"}
  assert {p.meta["level"] for p in train + evals} == {1}
  with pytest.raises(ValueError, match=r"kinds: unknown \['cube'\]"):
    data_config.ToyDataConfig(kinds=("product", "cube"))
  with pytest.raises(ValueError,
                     match=r"levels must be a non-empty subset of 0\.\.5, got \(0, 6\)"):
    data_config.ToyDataConfig(levels=(0, 6))


def test_chat_protocol_is_an_explicit_section():
  toy = recipe_config.build_config(_load())
  release = recipe_config.build_config(_14b())
  assert toy.chat.system_prompt != release.chat.system_prompt   # chosen, not implied by data.kind
  c = _load()
  c.data.kind = "files"
  c.data.train_files = ("/x.jsonl",)
  assert recipe_config.build_config(c).chat == toy.chat


# ---- the command line -----------------------------------------------------------------
def _cli(*args, module="experiments.recipe", config=("--config", "experiments/configs/toy.py")):
  return subprocess.run([sys.executable, "-m", module, *config, *args], cwd=REPO,
                        capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"))


def test_unknown_override_key_is_named():
  out = _cli("--config.rl.optimizer.learnin_rate=1e-4")
  assert out.returncode != 0
  assert "unknown config key 'learnin_rate' under rl.optimizer" in out.stderr
  assert "learning_rate" in out.stderr   # lists the valid keys


def test_wrong_type_override_is_rejected():
  out = _cli("--config.stage1.num_steps=many")
  assert out.returncode != 0 and "num_steps" in out.stderr


def test_bad_value_fails_at_start_with_one_line(tmp_path):
  # A stage-3 value that only stage 3 reads fails before SFT starts, in one line.
  out = _cli(f"--config.workdir={tmp_path}", "--config.stage3.hard_k=0",
             "--config.rl.optimizer.learning_rate=1e-4")
  assert out.returncode == 2
  assert out.stderr.strip().splitlines()[-1].startswith("config error: config.stage3: RLStage")
  assert "Traceback" not in out.stderr
  assert not os.path.exists(tmp_path / "sft")
  out = _cli(f"--config.workdir={tmp_path}", "--config.rl.optimizer.learning_rate=-1e-4")
  assert out.returncode == 2 and "learning_rate must be > 0" in out.stderr
  assert "Traceback" not in out.stderr


def test_a_workdir_that_is_a_file_or_an_hf_dir_without_a_checkpoint_is_named(tmp_path):
  (tmp_path / "a_file").write_text("")
  out = _cli(f"--config.workdir={tmp_path / 'a_file'}")
  assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
  assert f"config.workdir={tmp_path / 'a_file'}: cannot use it as the run's directory" \
      in out.stderr
  out = _cli(f"--config.workdir={tmp_path / 'run'}", "--config.model.preset=",
             f"--config.model.hf_dir={tmp_path / 'nowhere'}")
  assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
  assert f"config.model.hf_dir={tmp_path / 'nowhere'}: no config.json there" in out.stderr


def test_a_stray_positional_argument_is_refused(tmp_path):
  # e.g. a boolean flag given a value after a space (`--config.sft.enabled False`):
  # False would be ignored and the run would go on with the default.
  out = _cli(f"--config.workdir={tmp_path}", "--config.sft.enabled", "False")
  assert out.returncode == 2, out.stderr[-2000:]
  assert "unexpected argument(s) ['False']: every setting is a flag" in out.stderr
  assert not os.listdir(tmp_path)


@pytest.mark.parametrize("module", ["experiments.recipe", "experiments.train_rl",
                                    "experiments.evaluate", "experiments.train_sft"])
def test_entry_point_without_config_says_how_to_call_it(module):
  out = _cli(module=module, config=())
  assert out.returncode != 0
  assert "--config is required" in out.stderr
  assert f"python -m {module} --config experiments/configs/" in out.stdout + out.stderr


def _apply(c, point):
  """A sweep point's overrides ("a.b.c": value) on a config."""
  for key, value in point.items():
    *parents, leaf = key.split(".")
    node = c
    for p in parents:
      node = node[p]
    node[leaf] = value


def test_roc_ablation_points_build():
  from experiments.configs import toy_roc_ablation as abl
  points = abl.get_sweep()
  assert len(points) == 9 and {p["seed"] for p in points} == {0, 1, 2}
  methods = set()
  for point in points:
    c = _load(os.path.join(REPO, "experiments/configs/toy_roc_ablation.py"))
    c.model.hf_dir, c.tokenizer.path = "/sft/export", "/sft/export"
    _apply(c, point)
    cfg = recipe_config.build_config(c)
    assert not cfg.sft.enabled and cfg.stage1.num_steps > 0 and cfg.model.hf_dir
    drawn = cfg.rl.samples_per_prompt
    kept = min(drawn, cfg.rl.downsample.group_size)
    methods.add((cfg.rl.downsample.method, drawn, kept))
  # RoC and plain GRPO at the same compute (2G drawn, G kept), and G drawn only
  assert methods == {("roc", 8, 4), ("uniform", 8, 4), ("none", 4, 4)}


def test_async_ablation_points_differ_only_in_their_arm_and_seed():
  from experiments.configs import toy_async_ablation as abl
  spec = os.path.join(REPO, "experiments/configs/toy_async_ablation.py")
  built = {}
  for point in abl.get_sweep():
    c = _load(spec)
    c.model.hf_dir, c.tokenizer.path = "/sft/export", "/sft/export"
    _apply(c, point)
    cfg = recipe_config.build_config(c)
    assert not cfg.sft.enabled and cfg.stage1.num_steps == 40 and cfg.stage2.num_steps == 0
    arm = (cfg.rl.async_rollouts.max_staleness, cfg.rl.loss.off_policy,
           cfg.rl.async_rollouts.weight_updates)
    built[arm + (cfg.seed,)] = cfg
  plain = [(k, "behaviour", "between_steps") for k in (0, 1, 2)]
  arms = plain + [(2, "decoupled", "between_steps"), (1, "behaviour", "between_requests")]
  assert sorted(built) == sorted(a + (s,) for a in arms for s in (0, 1, 2))
  # Everything else equal: RoC, the steps, the loss but for the off-policy correction.
  base = built[(0, "behaviour", "between_steps", 0)]
  for cfg in built.values():
    assert cfg.rl.downsample == base.rl.downsample and cfg.rl.old_logprobs == "sampler"
    assert dataclasses.replace(cfg.rl.loss, off_policy="behaviour") == base.rl.loss


def test_toy_sft_rows_hold_every_trace_and_pack_densely(tmp_path):
  """The toy config's SFT rows hold its longest trace (nothing cut from training) and
  pack the traces densely: the reason its seq_len is 320 (rows of 288 were 76% full)."""
  from rstar_jax.sft import packing
  c = _load()
  c.sft.data.num_traces = 2000
  cfg = recipe_config.build_config(c)
  ctx = stages.build_context(cfg, tools=None, workdir=str(tmp_path))
  pairs = stages.sft_pairs(ctx)
  _, stats = packing.pack(pairs, cfg.sft.seq_len)
  assert stats["truncated"] == 0
  assert stats["fill"] > 0.85, stats
  _, at_288 = packing.pack(pairs, 288)   # the check can fail: the old length packs worse
  assert at_288["fill"] < stats["fill"]
