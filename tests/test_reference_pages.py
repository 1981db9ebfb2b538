"""The reference pages (docs/reference/) stay what the code says, and the metric table
stays what the code writes.

- Both pages regenerate identically; `--check` names a stale page and exits 1.
- The config page has one row per field of RecipeConfig's tree (walked here on its own),
  each description found by the convention its code uses (checked on dataclasses written
  here), and no field arrives without a description beyond those listed below.
- The metric keys of the paths the recipe tests do not run here (a weight sync through disk,
  the step statistics with tool calls, errors and correct answers, a report over two
  benchmarks) are each in the table, and every entry naming such a path is written by it.
  The smoke recipe's files and the asynchronous runs are checked where those runs are made
  (tests/test_recipe.py, tests/rl/test_async_rollouts.py).
"""
import dataclasses
import os
import re
import types
import typing

import numpy as np

from rstar_jax import metric_table
from rstar_jax.model import model_config
from rstar_jax.recipe import reference
from rstar_jax.recipe import recipe_config
from rstar_jax.rl import losses

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = os.path.join(REPO, "docs", "reference")

# Fields whose code says nothing of them yet, by declaring class. A new field must come
# with a description (a docstring `name: text` entry or a comment); describing one of these
# lets it leave the list.
UNDESCRIBED = {
    "RecipeConfig": {"seed", "workdir"},
    "ModelConfig": {"preset", "hf_dir"},
    "Qwen3Config": {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
                    "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings",
                    "initializer_range", "remat_policy", "attention_impl", "scan_layers"},
    "EngineConfig": {"num_slots", "min_prefill_bucket", "reuse_prefix"},
    "SFTStage": {"enabled"},
    "OptimizerConfig": {"learning_rate", "warmup_steps", "schedule", "weight_decay",
                        "grad_clip_norm", "b1", "b2", "eps"},
    "AgentConfig": {"max_turns", "max_response_tokens", "temperature", "top_p", "top_k"},
    "EvalStage": {"after_sft"},
}


# ---- the pages ---------------------------------------------------------------------------------
def test_the_pages_are_what_the_code_gives():
  stale = reference.stale(PAGES)
  assert not stale, (f"out of date: {stale}; regenerate them with `{reference.COMMAND}` "
                     f"and commit the result")


def test_check_names_a_stale_page_and_write_mends_it(tmp_path, capsys):
  d = str(tmp_path)
  assert reference.main(["--write", "--dir", d]) == 0
  assert reference.main(["--check", "--dir", d]) == 0
  with open(os.path.join(d, "config.md"), "a") as f:
    f.write("\nan edit by hand\n")
  capsys.readouterr()
  assert reference.main(["--check", "--dir", d]) == 1
  err = capsys.readouterr().err
  assert "config.md" in err and "metrics.md" not in err and reference.COMMAND in err
  os.remove(os.path.join(d, "metrics.md"))
  assert reference.main(["--check", "--dir", d]) == 1
  assert "metrics.md" in capsys.readouterr().err
  assert reference.main(["--write", "--dir", d]) == 0
  assert reference.main(["--check", "--dir", d]) == 0


def _leaf_paths(cls, prefix=""):
  """Every leaf field's dotted path, walked with dataclasses and typing alone."""
  hints = typing.get_type_hints(cls)
  out = []
  for f in dataclasses.fields(cls):
    path = f"{prefix}{f.name}"
    if dataclasses.is_dataclass(hints[f.name]):
      out += _leaf_paths(hints[f.name], path + ".")
    else:
      out.append(path)
  return out


def test_the_config_page_has_a_row_for_every_field():
  with open(os.path.join(PAGES, "config.md"), encoding="utf-8") as f:
    rows = re.findall(r"^\| `([\w.]+)` \|", f.read(), re.M)
  expected = _leaf_paths(recipe_config.RecipeConfig)
  assert len(rows) == len(set(rows))
  assert sorted(rows) == sorted(expected), set(rows) ^ set(expected)
  # The tree's defaults: the stages' own, not RecipeConfig's (whose stage1 budget does
  # not fit its engine, so it is never built whole).
  fields = {f"{f.section}.{f.name}".lstrip("."): f for s in reference.sections()
            for f in s.fields}
  assert fields["stage1.num_steps"].default == "10"
  assert fields["stage2.num_steps"].default == fields["stage3.num_steps"].default == "0"
  assert fields["model.preset"].default == "'tiny'"
  assert fields["rl.loss.eps_high"].default == repr(losses.LossConfig().eps_high)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Described:
  """A dataclass that uses every convention.

  Attributes:
    alpha: the first field, whose first sentence is long enough. A second one is left
      to the source.
    beta, gamma: two fields sharing an entry
      that runs over two lines.
    short: short. So the next sentence comes too.
  Not an entry: a line of prose.
  """
  alpha: int = 1
  beta: int = 2
  gamma: int = 3
  short: int = 0
  delta: int = 4  # a trailing comment
  # A comment block above the field,
  # over two lines.
  epsilon: int = 5
  zeta: str = "x" * 80


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Child(_Described):
  eta: int = 7   # declared in the subclass


def test_descriptions_come_from_each_convention():
  d = lambda name: reference.description(_Child, name)
  assert d("alpha") == "the first field, whose first sentence is long enough."
  assert d("beta") == d("gamma") == "two fields sharing an entry that runs over two lines."
  assert d("short") == "short. So the next sentence comes too."
  assert d("delta") == "a trailing comment"
  assert d("epsilon") == "A comment block above the field, over two lines."
  assert d("zeta") == ""
  assert d("eta") == "declared in the subclass"
  # A long default is cut; a short one is its repr.
  secs = list(reference.sections(_Child))
  shown = {f.name: f.default for f in secs[0].fields}
  assert shown["alpha"] == "1" and shown["zeta"].endswith("...") and len(shown["zeta"]) <= 48
  # ModelConfig (made by make_dataclass, no class statement) reads Qwen3Config's comments.
  assert reference.description(model_config.ModelConfig, "dtype") == reference.description(
      model_config.Qwen3Config, "dtype") != ""


def test_no_new_field_arrives_without_a_description():
  new = []
  for s in reference.sections():
    for f in s.fields:
      if not f.description:
        owner = reference._declaring_classes(s.cls, f.name)
        names = {k.__name__ for k in owner}
        if not any(f.name in UNDESCRIBED.get(n, ()) for n in names):
          new.append(f"{(f.section + '.') if f.section else ''}{f.name} "
                     f"({'/'.join(sorted(names))})")
  assert not new, ("fields without a description in the code (give each a docstring "
                   f"`name: text` entry or a comment, then run `{reference.COMMAND}`): {new}")


# ---- the metric table --------------------------------------------------------------------------
def test_the_table_is_well_formed():
  seen = set()
  for m in metric_table.METRICS:
    assert m.file in metric_table.FILES, m
    assert m.unit and m.meaning, m
    assert (m.run in metric_table.RUNS) != bool(m.not_in_ci), m
    assert (m.file, m.name) not in seen, m
    # The metrics page sets a file's rows under their group's title.
    assert m.file == "eval" or (m.name.split("/")[0] if "/" in m.name else
                                "") in metric_table.GROUPS, m
    seen.add((m.file, m.name))
    # No entry's name is matched by another entry: a key has one meaning.
    others = [o.name for o in metric_table.METRICS
              if o is not m and o.file == m.file and o.pattern().fullmatch(m.name)]
    assert not others, (m.name, others)


def test_a_key_without_an_entry_is_named():
  keys = {"rollout/reward_mean", "train/loss", "rollout/brand_new", "step"}
  assert metric_table.unknown(keys, "rl") == ["rollout/brand_new"]
  found = metric_table.problems({"rl": keys}, "weight_sync")
  assert any("'rollout/brand_new'" in p for p in found)
  assert any("'sync/gb'" in p for p in found)      # the run's entries it did not write
  assert metric_table.unknown({"pass_at_k.16", "by_source.aime24.pass_at_k.2"}, "eval") == []
  assert metric_table.unknown({"pass_at_k"}, "eval") == ["pass_at_k"]
  assert metric_table.flat_keys({"a": 1, "p": {"1": 0.5}, "l": [{"u": 1}], "e": {}}) == {
      "a", "p.1", "l[].u"}


def test_a_weight_sync_through_disk_writes_the_sync_entries(tmp_path):
  from flax import nnx
  from rstar_jax.model import qwen3
  from rstar_jax.rollout import weight_sync
  cfg = model_config.Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=24,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, head_dim=8)
  model = qwen3.create_model(cfg)
  sync = weight_sync.DiskWeightSync(weight_sync.WeightSyncConfig(dtype="float32"), model, [],
                                    str(tmp_path / "weight_sync"))
  written = sync.publish(nnx.state(model), "stage1-step1")
  assert written["sync/gb"] > 0 and written["sync/servers"] == 0
  assert metric_table.problems({"rl": written}, "weight_sync") == []


def test_the_step_statistics_write_the_stats_entries():
  from rstar_jax.rl import roc, rollout_collector

  def traj(reward, calls, errors):
    return types.SimpleNamespace(reward=reward, num_tool_calls=calls, num_tool_errors=errors,
                                 truncated=False, model_tokens=10, response_ids=[1] * 12,
                                 num_turns=calls + 1, answer_tags=1)
  # Two groups of four: correct answers with and without tool errors, wrong ones.
  groups = [[traj(1.0, 2, 1), traj(1.0, 1, 0), traj(0.0, 1, 1), traj(0.0, 0, 0)],
            [traj(1.0, 3, 0), traj(0.0, 2, 2), traj(1.0, 1, 1), traj(0.0, 1, 0)]]
  flat = [t for g in groups for t in g]
  keys = set(rollout_collector.metrics(flat))
  keys |= set(rollout_collector.metrics(flat[:6], prefix="kept/"))
  stats = [[rollout_collector.rollout_stats(t) for t in g] for g in groups]
  ds = roc.downsample(stats, roc.DownsampleConfig(group_size=2), np.random.default_rng(0))
  keys |= set(ds.stats)
  assert "rollout/tool_error_rate_correct" in keys and "roc/kept_pos_tool_error_rate" in keys
  assert metric_table.problems({"rl": keys}, "stats") == []


def test_a_report_over_two_benchmarks_writes_the_report_entries():
  from rstar_jax.eval import pass_at_k as eval_metrics
  records = [eval_metrics.SampleRecord(problem_uid=f"p{i}", sample_index=s,
                                       reward=float((i + s) % 2), response_tokens=20,
                                       num_tool_calls=1, num_tool_errors=s % 2, num_turns=2,
                                       truncated=False)
             for i in range(4) for s in range(2)]
  report = eval_metrics.compute_report(records, temperature=1.0, dataset="two",
                                       source_of={"p0": "a", "p1": "a", "p2": "b", "p3": "b"})
  keys = metric_table.flat_keys(report.to_dict())
  assert {"by_source.a.pass_at_1", "by_source.b.pass_at_k.2"} <= keys
  assert metric_table.problems({"eval": keys}, "report") == []
