"""Every metric name a run writes: its meaning, unit and file, as one table of data.

`docs/reference/metrics.md` is generated from `METRICS` (`python -m rstar_jax.recipe.reference
--write`), and the tests hold the table to what runs really write: every key of the smoke
recipe's files, the asynchronous and weight-sync paths must match an entry (`unknown`), and
every entry names the test run that writes it (`Metric.run`, one of `RUNS`) or says why no
test run does (`Metric.not_in_ci`). A key that does not fit the table fails those tests by
its name, so a new metric arrives with its line here.

A name with a variable part writes it as `<what>` (`pass_at_k.<k>`). Keys of a JSON report
are flattened: nested objects joined by ".", list items as "[]" (`flat_keys`).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Mapping

# The files, by the short name `Metric.file` uses: (path under the work directory, what
# writes it and when).
FILES: dict[str, tuple[str, str]] = {
    "sft": ("<workdir>/sft/metrics_sft.jsonl",
            "the SFT trainer (`sft/trainer.py`): one JSON object per step; TensorBoard gets the "
            "same scalars under `<workdir>/sft/tb/sft`"),
    "rl": ("<workdir>/<stage>/metrics_rl.jsonl",
           "the RL trainer (`rl/trainer.py`), one file per stage (stage1..stage3): one JSON object "
           "per step; TensorBoard gets the same scalars under `<workdir>/<stage>/tb/rl`"),
    "eval": ("<workdir>/eval_<name>.json",
             "the evaluation (`eval/pass_at_k.py`, `EvalReport`): one JSON report per evaluation "
             "(`eval_after_sft.json`, `eval_final.json`; `experiments/evaluate.py` writes "
             "`eval_hf_dir.json` and, for a benchmark suite, `suite/<benchmark>.json`)"),
}

# The test runs that write the keys, by the short name `Metric.run` uses. Each one's test
# checks that its files hold every entry that names it.
RUNS: dict[str, str] = {
    "recipe": "tests/test_recipe.py: the smoke recipe (SFT, two RL steps, the final evaluation)",
    "kl": "tests/test_recipe.py: the smoke RL stage with a KL term to the stage's start",
    "async": "tests/rl/test_async_rollouts.py: an RL stage under max_staleness 1",
    "decoupled": "tests/rl/test_async_rollouts.py: the same under the decoupled objective",
    "weight_sync": "tests/test_reference_pages.py: a weight sync through disk",
    "stats": ("tests/test_reference_pages.py: the step statistics (`rl/rollout_collector.py`, "
              "`rl/roc.py`) of trajectories with tool calls, errors and correct answers"),
    "report": "tests/test_reference_pages.py: an evaluation report over two benchmarks",
}


# The groups of a file's keys, by the part of the name before "/" ("" for a key without
# one): (title, what the group's keys are computed over, or "").
GROUPS: dict[str, tuple[str, str]] = {
    "": ("Row", ""),
    "sft": ("SFT step", ""),
    "rollout": ("Rollouts of the step", "Over every trajectory the step generated, less the "
                "groups dropped whole: a trajectory the engine failed twice "
                "(`rollout/failed_groups`) or, asynchronous, beyond the staleness bound "
                "(`async/stale_dropped_groups`)."),
    "kept": ("The trajectories RoC kept", "The same statistics over the trajectories "
             "Resample-on-Correct kept for the update (`rl.downsample`)."),
    "roc": ("Resample-on-Correct", "What the down-sampler (`rl/roc.py`) did: \"all_\" over "
            "every generated trajectory, \"kept_\" over the kept ones; penalties are the "
            "report's p_err and p_format."),
    "update": ("The update", ""),
    "train": ("The train step", "From the loss (`rl/losses.py`) and the update "
              "(`train/step.py`): token means are over every loss token of the full batch, "
              "micro-batches summed."),
    "time": ("Wall-clock", ""),
    "async": ("Asynchronous rollouts", "Written under `rl.async_rollouts.max_staleness` >= 1 "
              "([asynchronous rollouts](../guides/async_rollouts.md))."),
    "sync": ("Weight sync to rollout servers", "The latest sync through disk "
             "(`rollout/weight_sync.py`); none in process."),
}


@dataclasses.dataclass(frozen=True)
class Metric:
  """One key of a metrics file.

  Attributes:
    name: the key; `<what>` marks a variable part.
    file: where it is written, a key of FILES.
    unit: what its number counts ("fraction" is in [0, 1]; "flag" is 0 or 1).
    meaning: what it is.
    when: when it is written, if not in every row ("" : always).
    run: the test run that writes it, a key of RUNS; "" with `not_in_ci` set.
    not_in_ci: why no test run writes it (only with run "").
  """
  name: str
  file: str
  unit: str
  meaning: str
  when: str = ""
  run: str = "recipe"
  not_in_ci: str = ""

  def pattern(self) -> re.Pattern:
    parts = re.split(r"<[^<>]+>", self.name)
    return re.compile(".+".join(re.escape(p) for p in parts))


# A rate or mean over nothing (no tool call, no correct trajectory) is left out of a row,
# never 0 (rollout/stats.py): these entries say so.
_MISSING = "left out when there is nothing to count"

# The rollout statistics of a step (`rl/rollout_collector.metrics`): (name, unit, meaning, when,
# run).
_ROLLOUT = (
    ("reward_mean", "fraction", "mean outcome reward; rewards are 0/1, so the share answered "
     "correctly", "", "recipe"),
    ("tool_calls_per_traj", "calls", "tool calls per trajectory", "", "recipe"),
    ("tool_error_rate", "fraction", "tool calls that failed (error, timeout, unparseable) / "
     "tool calls", f"{_MISSING} (no tool call)", "stats"),
    ("tool_error_rate_correct", "fraction", "the same inside correct trajectories: what "
     "Resample-on-Correct lowers", f"{_MISSING} (no call in a correct trajectory)", "stats"),
    ("no_tool_share", "fraction", "trajectories without a tool call", "", "recipe"),
    ("truncated_share", "fraction", "trajectories cut by the token or turn budget (reward 0)",
     "", "recipe"),
    ("model_tokens_mean", "tokens", "model-written tokens per trajectory (tool output not "
     "counted)", "", "recipe"),
    ("response_tokens_mean", "tokens", "response tokens per trajectory, tool output included "
     "(what the budget counts)", "", "recipe"),
    ("turns_mean", "turns", "assistant turns per trajectory", "", "recipe"),
)

_ROC = (
    ("groups", "groups", "prompt groups down-sampled this step", "", "recipe"),
    ("groups_dropped", "groups", "groups of which nothing was kept "
     "(`rl.downsample.drop_equal_reward_groups`)", "", "recipe"),
    ("kept", "trajectories", "trajectories kept for the update (G of 2G per group)", "",
     "recipe"),
    ("kept_positives", "trajectories", "kept trajectories with reward 1", "", "recipe"),
    ("kept_negatives", "trajectories", "kept trajectories with reward 0", "", "recipe"),
    ("all_positives", "trajectories", "generated trajectories with reward 1", "", "recipe"),
    ("all_negatives", "trajectories", "generated trajectories with reward 0", "", "recipe"),
    ("kept_pos_penalty_mean", "penalty", "mean RoC penalty (p_err + p_format, as "
     "`rl.downsample` enables them) of the kept positives", f"{_MISSING} (no positive)",
     "stats"),
    ("all_pos_penalty_mean", "penalty", "the same over every generated positive",
     f"{_MISSING} (no positive)", "stats"),
    ("kept_pos_err_penalty_mean", "penalty", "mean p_err (share of erroring tool calls, 0.5 "
     "with no call) of the kept positives", f"{_MISSING} (no positive)", "stats"),
    ("kept_pos_format_penalty_mean", "penalty", "mean p_format (answer-tag penalty) of the "
     "kept positives", f"{_MISSING} (no positive)", "stats"),
    ("all_pos_err_penalty_mean", "penalty", "mean p_err of every generated positive",
     f"{_MISSING} (no positive)", "stats"),
    ("all_pos_format_penalty_mean", "penalty", "mean p_format of every generated positive",
     f"{_MISSING} (no positive)", "stats"),
    ("kept_pos_tool_error_rate", "fraction", "erroring tool calls / tool calls in the kept "
     "positives", f"{_MISSING} (no call)", "stats"),
    ("all_pos_tool_error_rate", "fraction", "the same in every generated positive",
     f"{_MISSING} (no call)", "stats"),
    ("all_tool_error_rate", "fraction", "erroring tool calls / tool calls over every "
     "generated trajectory, dropped groups included", f"{_MISSING} (no call)", "stats"),
)

_TOKEN_MEAN = "token mean over the batch's loss tokens"
_DECOUPLED = "`rl.loss.off_policy` decoupled or decoupled-truncated"
_ASYNC = "`rl.async_rollouts.max_staleness` >= 1"
_SERVERS = ("weights synced through disk (rollout servers: `rollout.backend` server or "
            "sglang); the latest sync's")

_SFT = (
    Metric("step", "sft", "steps", "the step count after this row's update (1 for the first)"),
    Metric("sft/loss", "sft", "nats/token", "the loss minimised: token-mean negative "
           "log-likelihood of the step's batch over its loss tokens"),
    Metric("sft/nll", "sft", "nats/token", "the negative log-likelihood term of `sft/loss` "
           "(SFT's loss has no other term, so the two are equal)"),
    Metric("sft/grad_norm", "sft", "L2 norm", "global norm of the gradient, before clipping "
           "(`sft.optimizer.grad_clip_norm`)"),
    Metric("sft/update_norm", "sft", "L2 norm", "global norm of the parameter update applied"),
    Metric("sft/tokens", "sft", "tokens", "loss tokens in the step's batch"),
    Metric("sft/learning_rate", "sft", "learning rate", "the learning rate of this update"),
    Metric("sft/heldout_nll", "sft", "nats/token", "token-mean negative log-likelihood of the "
           "held-out conversations (`sft.heldout_share`)",
           "every `sft.eval_every` steps and at the last step"),
)

_RL = (
    Metric("step", "rl", "steps", "the step count after this row's step (1 for the first)"),
    *(Metric(f"rollout/{n}", "rl", u, f"{m} (the step's trajectories)", w, r)
      for n, u, m, w, r in _ROLLOUT),
    Metric("rollout/failed_groups", "rl", "groups", "groups dropped because the engine failed "
           "one of their trajectories twice"),
    *(Metric(f"kept/{n}", "rl", u, f"{m} (the trajectories RoC kept)", w, r)
      for n, u, m, w, r in _ROLLOUT),
    *(Metric(f"roc/{n}", "rl", u, m, w, r) for n, u, m, w, r in _ROC),
    Metric("update/skipped", "rl", "flag", "1 when the step made no update (every group "
           "dropped), else 0"),
    Metric("update/zero_advantage", "rl", "flag", "1 when no trajectory of the step has a "
           "non-zero advantage, so the policy gradient is 0 (a stage of only such steps is "
           "recorded as no_learning_signal in its DONE.json)"),
    Metric("train/loss", "rl", "loss", "the loss minimised: `train/pg_loss` plus "
           "`rl.loss.kl_coef` x `train/kl_loss`, in `rl.loss.aggregation`"),
    Metric("train/pg_loss", "rl", "loss", "the clip-higher PPO policy-gradient term"),
    Metric("train/kl_loss", "rl", "nats", "the KL penalty to the reference policy "
           "(`rl.loss.kl_estimator`), aggregated as the loss", "`rl.loss.kl_coef` > 0", "kl"),
    Metric("train/clip_frac_high", "rl", "fraction", f"tokens with A > 0 and ratio > 1 + "
           f"eps_high (clipped: no gradient), {_TOKEN_MEAN}"),
    Metric("train/clip_frac_low", "rl", "fraction", f"tokens with A < 0 and ratio < "
           f"1 - eps_low, {_TOKEN_MEAN}"),
    Metric("train/dual_clip_frac", "rl", "fraction", f"tokens with A < 0 and ratio > "
           f"`rl.loss.dual_clip_c` (0 without dual clip), {_TOKEN_MEAN}"),
    Metric("train/approx_kl", "rl", "nats", f"KL(old or proximal policy || new) by the k3 "
           f"estimator, mean of ratio - 1 - log ratio, {_TOKEN_MEAN}"),
    Metric("train/ppo_kl", "rl", "nats", f"the k1 estimate, mean of log(old / new), "
           f"{_TOKEN_MEAN}"),
    Metric("train/ratio_mean", "rl", "ratio", f"the PPO ratio pi_theta / pi_old (pi_prox "
           f"under a decoupled objective), {_TOKEN_MEAN}"),
    Metric("train/entropy", "rl", "nats", f"the policy's entropy at each loss token, "
           f"{_TOKEN_MEAN}", "`rl.step.compute_entropy`"),
    Metric("train/logp_diff_mean_abs", "rl", "nats", f"abs(trainer log-prob - sampler "
           f"log-prob) of the sampled tokens (kernels, precision and, under asynchrony, "
           f"staleness), {_TOKEN_MEAN}"),
    Metric("train/logp_diff_max_abs", "rl", "nats", "the same, the largest over the loss "
           "tokens"),
    Metric("train/behav_weight_mean", "rl", "ratio", f"the behaviour importance weight w = "
           f"pi_prox / pi_behav (before the cap), {_TOKEN_MEAN}", _DECOUPLED, "decoupled"),
    Metric("train/behav_weight_max", "rl", "ratio", "the same, the largest over the loss "
           "tokens", _DECOUPLED, "decoupled"),
    Metric("train/behav_log_weight_abs", "rl", "nats", f"abs(log w): the weights' spread "
           f"around 1, {_TOKEN_MEAN}", _DECOUPLED, "decoupled"),
    Metric("train/behav_capped_frac", "rl", "fraction", f"tokens with w > "
           f"`rl.loss.behaviour_weight_cap` (dropped, or truncated), {_TOKEN_MEAN}",
           _DECOUPLED, "decoupled"),
    Metric("train/grad_norm", "rl", "L2 norm", "global norm of the gradient, before clipping "
           "(`rl.optimizer.grad_clip_norm`)"),
    Metric("train/update_norm", "rl", "L2 norm", "global norm of the parameter update applied"),
    Metric("train/tokens", "rl", "tokens", "loss tokens (model-written response tokens) in the "
           "batch"),
    Metric("train/sequences", "rl", "trajectories", "batch rows with at least one loss token"),
    Metric("train/learning_rate", "rl", "learning rate", "the learning rate of this update"),
    Metric("time/rollout_s", "rl", "seconds", "generating the step's rollouts, tool calls "
           "included (asynchronous: the worker's seconds, its weight sync included)"),
    Metric("time/rollout_tokens_per_s", "rl", "tokens/s", "model-written tokens of the step's "
           "trajectories / `time/rollout_s`"),
    Metric("time/train_s", "rl", "seconds", "the update: recomputed, proximal and reference "
           "log-probs and the train step (the weight sync not included)"),
    Metric("time/ref_logp_s", "rl", "seconds", "the reference policy's log-probs of the batch",
           "`rl.loss.kl_coef` > 0", "kl"),
    Metric("time/rollout_wait_s", "rl", "seconds", "how long the trainer waited for the "
           "step's rollouts", _ASYNC, "async"),
    Metric("async/behaviour_version", "rl", "updates", "v(t): the update count of the weights "
           "that generated this step's rollouts", _ASYNC, "async"),
    Metric("async/staleness_mean", "rl", "updates", "the step minus the oldest version of each "
           "kept trajectory, mean", f"{_ASYNC}; {_MISSING}", "async"),
    Metric("async/staleness_max", "rl", "updates", "the same, largest", f"{_ASYNC}; {_MISSING}",
           "async"),
    Metric("async/stale_dropped_groups", "rl", "groups", "groups dropped for a trajectory "
           "beyond the staleness bound or of an unpublished version", _ASYNC, "async"),
    Metric("async/multi_version_share", "rl", "fraction", "trajectories whose turns came from "
           "more than one weight version (`rl.async_rollouts.weight_updates` "
           "between_requests)", f"{_ASYNC}; {_MISSING}", "async"),
    Metric("sync/write_s", "rl", "seconds", "writing the Hugging Face checkpoint the servers "
           "load", _SERVERS, "weight_sync"),
    Metric("sync/update_s", "rl", "seconds", "the servers loading it", _SERVERS, "weight_sync"),
    Metric("sync/total_s", "rl", "seconds", "the whole weight sync", _SERVERS, "weight_sync"),
    Metric("sync/gb", "rl", "GB", "size of the checkpoint written (1e9 bytes)", _SERVERS,
           "weight_sync"),
    Metric("sync/servers", "rl", "servers", "servers moved onto the new weights", _SERVERS,
           "weight_sync"),
    Metric("sync/s_per_gb", "rl", "s/GB", "`sync/total_s` / `sync/gb`", _SERVERS,
           "weight_sync"),
)

_PER_PROBLEM = (
    ("uid", "text", "the problem's uid"),
    ("num_samples", "samples", "samples of the problem"),
    ("num_correct", "samples", "correct samples"),
    ("mean_reward", "fraction", "mean reward of its samples"),
    ("mean_response_tokens", "tokens", "mean response tokens of its samples"),
    ("tool_calls", "calls", "tool calls over its samples"),
    ("tool_errors", "calls", "failed tool calls over its samples"),
    ("truncated", "samples", "truncated samples"),
)

_NULL = "null when there is nothing to count"

_EVAL = (
    Metric("temperature", "eval", "setting", "sampling temperature of every sample (0: greedy)"),
    Metric("top_p", "eval", "setting", "nucleus sampling threshold"),
    Metric("greedy", "eval", "flag", "true when temperature is 0"),
    Metric("dataset", "eval", "text", "the evaluation's name"),
    Metric("model_source", "eval", "text", "what was scored (a stage, an export directory)"),
    Metric("seed", "eval", "setting", "the run's seed"),
    Metric("samples_per_problem", "eval", "samples", "k: samples per problem"),
    Metric("num_problems", "eval", "problems", "problems evaluated"),
    Metric("num_samples", "eval", "samples", "trajectories sampled"),
    Metric("pass_at_1", "eval", "fraction", "pass@1: mean reward over samples and problems"),
    Metric("pass_at_k.<k>", "eval", "fraction", "pass@k, the unbiased estimate from the k "
           "samples of each problem, for k = 1, 2, 4, ... up to samples_per_problem"),
    Metric("mean_response_tokens", "eval", "tokens", "response tokens per sample, tool output "
           "included"),
    Metric("mean_response_tokens_correct", "eval", "tokens", "the same over correct samples",
           _NULL),
    Metric("mean_turns", "eval", "turns", "assistant turns per sample"),
    Metric("tool_calls_per_trajectory", "eval", "calls", "tool calls per sample"),
    Metric("tool_error_rate", "eval", "fraction", "failed tool calls / tool calls", _NULL),
    Metric("tool_error_rate_correct", "eval", "fraction", "the same inside correct samples",
           _NULL),
    Metric("share_no_tool_call", "eval", "fraction", "samples without a tool call"),
    Metric("share_truncated", "eval", "fraction", "samples cut by the token or turn budget"),
    *(Metric(f"per_problem[].{n}", "eval", u, f"per problem: {m}") for n, u, m in _PER_PROBLEM),
    Metric("by_source.<source>.num_problems", "eval", "problems", "problems of one benchmark "
           "(the problems' `source`)", "problems from more than one benchmark", "report"),
    Metric("by_source.<source>.pass_at_1", "eval", "fraction", "pass@1 of that benchmark",
           "problems from more than one benchmark", "report"),
    Metric("by_source.<source>.pass_at_k.<k>", "eval", "fraction", "pass@k of that benchmark",
           "problems from more than one benchmark", "report"),
)

METRICS: tuple[Metric, ...] = (*_SFT, *_RL, *_EVAL)


def entry(key: str, file: str) -> Metric | None:
  """The table's entry for `key` of `file` (a key of FILES), or None."""
  return next((m for m in METRICS if m.file == file and m.pattern().fullmatch(key)), None)


def unknown(keys: Iterable[str], file: str) -> list[str]:
  """The keys of `file` that no entry describes, sorted."""
  return sorted({k for k in keys if entry(k, file) is None})


def entries_of(keys: Iterable[str], file: str) -> set[str]:
  """The names of the entries that `keys` of `file` match."""
  return {m.name for k in keys if (m := entry(k, file)) is not None}


def flat_keys(obj: Any, prefix: str = "") -> set[str]:
  """The keys of a JSON object as the table names them: nested objects joined by ".", a
  list's items as "[]". An empty nested object or list contributes nothing."""
  if isinstance(obj, Mapping):
    out = set()
    for k, v in obj.items():
      name = f"{prefix}.{k}" if prefix else str(k)
      out |= flat_keys(v, name) if isinstance(v, (Mapping, list)) else {name}
    return out
  if isinstance(obj, list):
    return set().union(*(flat_keys(v, f"{prefix}[]") if isinstance(v, (Mapping, list))
                         else {f"{prefix}[]"} for v in obj)) if obj else set()
  return {prefix}


def row_keys(rows: Iterable[Mapping[str, Any]]) -> set[str]:
  """Every key of a metrics file's rows (JSONL: one flat object per step)."""
  return {k for r in rows for k in r}


def problems(keys_by_file: Mapping[str, Iterable[str]], run: str) -> list[str]:
  """What a test run's files say against the table, one line each: a key no entry
  describes (by name), and an entry naming `run` whose key none of the files holds.
  `keys_by_file`: a key of FILES -> the keys its files hold (`row_keys`, `flat_keys`)."""
  if run not in RUNS:
    raise ValueError(f"unknown run {run!r}; runs: {sorted(RUNS)}")
  out = []
  seen: dict[str, set[str]] = {}
  for file, keys in keys_by_file.items():
    keys = set(keys)
    out += [f"{file}: {k!r} is written but has no entry in rstar_jax/metric_table.py"
            for k in unknown(keys, file)]
    seen[file] = entries_of(keys, file)
  out += [f"{m.file}: entry {m.name!r} names run {run!r}, whose files do not hold it"
          for m in METRICS if m.run == run and m.name not in seen.get(m.file, set())]
  return out
