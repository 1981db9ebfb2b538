"""A mutation pass over the code whose tests must catch small wrong changes: the RL math
(losses, advantages, rewards, the off-policy corrections), answer parsing and GPQA
grading, RoC down-sampling, the bootstrap interval, bounded staleness (the filter, the
pending rollouts read back at a resume), checkpoint integrity, the fleet file, the
sandbox executor's status mapping and the loss masks of tool-output tokens.

Each mutant is one small edit (an operator swapped, a constant changed, a line made
inert), given as (file, original snippet, mutated snippet, the test files that should
catch it). For each, the edit is made in a scratch copy of the working tree (the
checkout itself is never touched) and the tests run with `-x` and `--junitxml`. The
mutant is KILLED only when a named test failed on an assertion (AssertionError or
pytest's `Failed`, such as "DID NOT RAISE"): that test's id and the failure's first line
are its evidence. A run that passes is SURVIVED; anything else is ERROR: a collection,
import or set-up error, a pytest-timeout time-out, a test that raised something other
than an assertion, an exit code other than 0 or 1. A mutant marked `equivalent` (with
the reason) is one no test can kill; the full pass runs it and reports it as
EQUIVALENT when it survives, and `--rotate` skips it.

The full pass (minutes of CPU; a baseline run of every test command on the unmodified
copy comes first, since a command that fails unmutated makes its kills meaningless):

  python -m experiments.mutation_pass [--only ID,ID] [--out mutation.json] [--no-baseline]

CI (`.ci/run`) runs a rotating few after the test suite: N non-equivalent mutants picked
by sha256(commit hash + id), no baseline, exit 1 if any is not killed:

  python -m experiments.mutation_pass --rotate 8

Every mutant's snippet must occur exactly once in the current code
(tests/test_mutation_pass.py): code that moves fails CI until its mutant is rewritten.
Results and the equivalent survivors' reasons: docs/testing.md ("Mutation pass").
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Mutant:
  id: str
  file: str
  original: str
  mutated: str
  tests: tuple[str, ...]
  what: str
  equivalent: str = ""     # why no test can kill it (then --rotate skips it)

  @property
  def test_paths(self) -> tuple[str, ...]:
    """The test files of `tests` (not the pytest options, nor a `-k` expression)."""
    out, skip = [], False
    for a in self.tests:
      if skip:
        skip = False
      elif a == "-k":
        skip = True
      elif not a.startswith("-"):
        out.append(a.split("::")[0])
    return tuple(out)


LOSS_TESTS = ("tests/rl/test_loss_oracle.py", "tests/rl/test_rl_losses.py")
ADV_TESTS = ("tests/rl/test_rl_advantages.py",)
REWARD_TESTS = ("tests/rl/test_rl_rewards.py",)
ROC_TESTS = ("tests/rl/test_rl_roc.py",)
EXEC_TESTS = ("tests/sandbox/test_containment.py", "tests/sandbox/test_correctness.py", "-k",
              "cpu_time or segfault or exit_variants or session or deadline or sigterm")
LOSSES, ADV, REWARDS, ANSWERS = ("rstar_jax/rl/losses.py", "rstar_jax/rl/advantages.py",
                                 "rstar_jax/rl/rewards.py", "rstar_jax/answers.py")
ROC, EXECUTOR = "rstar_jax/rl/roc.py", "sandbox/executor.py"
SUITE, ASYNC = "rstar_jax/eval/suite.py", "rstar_jax/rl/async_rollouts.py"
CHECKPOINT, FLEET = "rstar_jax/checkpoint.py", "rstar_jax/rollout/fleet_file.py"
CHOICE_TESTS = ("tests/eval/test_benchmarks.py", "-k", "choice")
BOOTSTRAP_TESTS = ("tests/eval/test_benchmarks.py", "-k", "bootstrap")
STALENESS_TESTS = ("tests/rl/test_async_rollouts.py", "-k", "staleness_filter")
PENDING_TESTS = ("tests/test_mutants_extra.py", "-k", "load_pending")
OFF_POLICY_TESTS = ("tests/rl/test_off_policy_loss.py",)
CHECKPOINT_TESTS = ("tests/test_checkpoint.py", "-k", "torn")
FLEET_TESTS = ("tests/rollout/test_fleet_file.py", "-k", "file_is_checked")

MUTANTS = [
    # ---- the loss ----
    Mutant("L1", LOSSES,
           "log_ratio = jnp.clip(new_f - old_f, -config.log_ratio_clamp, config.log_ratio_clamp)",
           "log_ratio = new_f - old_f", LOSS_TESTS, "log-ratio clamp removed"),
    Mutant("L2", LOSSES,
           "lo, hi = 1.0 - config.eps_low, 1.0 + config.eps_high\n  pg_unclipped",
           "lo, hi = 1.0 - config.eps_high, 1.0 + config.eps_low\n  pg_unclipped", LOSS_TESTS,
           "clip-higher: eps_low and eps_high swapped"),
    Mutant("L3", LOSSES, "per_token = jnp.maximum(pg_unclipped, pg_clipped)",
           "per_token = jnp.minimum(pg_unclipped, pg_clipped)", LOSS_TESTS,
           "pessimistic max -> min"),
    Mutant("L4", LOSSES, "jnp.minimum(per_token, -advantages * config.dual_clip_c)",
           "jnp.maximum(per_token, -advantages * config.dual_clip_c)", LOSS_TESTS,
           "dual clip min -> max"),
    Mutant("L5", LOSSES, "neg_adv = advantages < 0", "neg_adv = advantages > 0", LOSS_TESTS,
           "dual clip on positive advantages"),
    Mutant("L6", LOSSES,
           "  del config\n  return (values * mask).sum() / jnp.maximum(norm.num_tokens, 1.0)",
           "  del config\n  return (values * mask).sum() / jnp.maximum(norm.num_seqs, 1.0)",
           LOSS_TESTS, "token-mean divides by sequences"),
    Mutant("L7", LOSSES, "per_seq = (values * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0)",
           "per_seq = (values * mask).sum(-1) / jnp.maximum(mask.sum(), 1.0)", LOSS_TESTS,
           "seq-mean-token-mean: per-sequence length -> batch tokens"),
    Mutant("L8", LOSSES, "(config.max_response_len * jnp.maximum(norm.num_seqs, 1.0))",
           "(config.max_response_len * 1.0)", LOSS_TESTS,
           "seq-mean-token-sum-norm without 1 / sequences"),
    Mutant("L9", LOSSES, "  d = ref_logp - logp", "  d = logp - ref_logp", LOSS_TESTS,
           "k3 of the wrong direction"),
    Mutant("L10", LOSSES, "jnp.clip(jnp.exp(d) - d - 1.0, -10.0, 10.0)",
           "jnp.exp(d) - d - 1.0", LOSS_TESTS, "k3 clip removed"),
    Mutant("L11", LOSSES, "0.5 * jnp.square(logp - ref_logp)", "jnp.square(logp - ref_logp)",
           LOSS_TESTS, "k2 without the 1/2"),
    Mutant("L12", LOSSES, "num_seqs=(m.sum(-1) > 0).sum()", "num_seqs=(m.sum(-1) >= 0).sum()",
           LOSS_TESTS, "all-padding rows counted as sequences"),
    Mutant("L14", LOSSES, "approx_kl=tm(ratio - 1.0 - log_ratio)",
           "approx_kl=tm(ratio - 1.0 + log_ratio)", LOSS_TESTS, "approx_kl sign"),
    Mutant("L15", LOSSES,
           "old_f = jax.lax.stop_gradient(jnp.asarray(old_logp, jnp.float32))",
           "old_f = jnp.asarray(old_logp, jnp.float32)", LOSS_TESTS,
           "stop_gradient on old_logp removed"),
    # ---- advantages ----
    Mutant("A1", ADV, "std = rewards.std(ddof=config.std_ddof)", "std = rewards.std()",
           ADV_TESTS, "std_ddof ignored"),
    Mutant("A2", ADV, "return (rewards - rewards.mean()) / (std + config.eps)",
           "return (rewards - rewards.min()) / (std + config.eps)", ADV_TESTS,
           "GRPO baseline min instead of mean"),
    Mutant("A3", ADV, "if rewards.size <= config.std_ddof:", "if rewards.size < config.std_ddof:",
           ADV_TESTS, "a group of one goes through the std"),
    Mutant("R1", REWARDS, "  if truncated:\n    return 0.0", "  if False:\n    return 0.0",
           REWARD_TESTS, "truncated rollouts rewarded"),
    Mutant("R2", REWARDS, "return pred_int is not None and pred_int == ref_int",
           "return pred_int is not None and abs(pred_int) == abs(ref_int)", REWARD_TESTS,
           "integer comparison ignores the sign"),
    Mutant("R3", REWARDS, "if not gold or not pred:", "if not gold and not pred:", REWARD_TESTS,
           "math-verify reached with one side unparsed",
           equivalent="math_verify.verify with an empty list on either side (or both) returns "
           "False, so the reward is the same; the original only saves the call"),
    Mutant("N1", ANSWERS, "      i += 2\n      continue", "      i += 1\n      continue",
           REWARD_TESTS, "_match_brace escape skip 2 -> 1"),
    Mutant("N2", ANSWERS,
           "start = response_text.rfind(ANSWER_OPEN)\n  if start < 0:\n    return extract_boxed(",
           "start = response_text.find(ANSWER_OPEN)\n  if start < 0:\n    return extract_boxed(",
           REWARD_TESTS,
           "first <answer> block instead of the last"),
    Mutant("N3", ANSWERS, "pos = matches[-1].end()", "pos = matches[0].end()", REWARD_TESTS,
           "first \\boxed instead of the last"),
    Mutant("N6", ANSWERS, "    count += 1\n    pos = end + len(ANSWER_CLOSE)",
           "    count += 1\n    pos = start + 1", ROC_TESTS,
           "count_answer_tags resumes inside a block"),
    # ---- RoC ----
    Mutant("C1", ROC, "  if s.num_tool_calls == 0:\n    return 0.5",
           "  if s.num_tool_calls == 0:\n    return 0.0", ROC_TESTS, "p_err without tool calls 0"),
    Mutant("C2", ROC, "return min(1.0, (s.num_answer_tags - 1) / s.num_turns)",
           "return min(1.0, s.num_answer_tags / s.num_turns)", ROC_TESTS,
           "p_format counts the first answer"),
    Mutant("C3", ROC,
           "weights = 1.0 / np.maximum(_penalties(group, pos, config), config.penalty_floor)",
           "weights = np.maximum(_penalties(group, pos, config), config.penalty_floor)",
           ROC_TESTS, "weights proportional to the penalty, not its inverse"),
    Mutant("C4", ROC, "return _fill(n_pos, n_neg, keep, (n_neg * keep) // (n_pos + n_neg))",
           "return _fill(n_pos, n_neg, keep, -(-(n_neg * keep) // (n_pos + n_neg)))",
           ROC_TESTS, "half_of_each rounds negatives up"),
    Mutant("C5", ROC, "  if n_pos < pos_slots:\n    return n_pos, keep - n_pos",
           "  if n_pos < pos_slots:\n    return n_pos, neg_slots", ROC_TESTS,
           "a short positive pile is not topped up"),
    Mutant("C6", ROC, "    return self.reward > 0", "    return self.reward >= 0", ROC_TESTS,
           "reward 0 counted positive"),
    Mutant("C7", ROC, 'rng.random() * cdf[-1], side="right"))',
           'rng.random() * cdf[-1], side="left"))', ROC_TESTS,
           "searchsorted side right -> left"),
    Mutant("C8", ROC, 'kept_pos = pos[np.argsort(pos_pen, kind="stable")[:k_pos]]',
           'kept_pos = pos[np.argsort(-pos_pen, kind="stable")[:k_pos]]', ROC_TESTS,
           "topk keeps the highest-penalty positives"),
    Mutant("C9", ROC, "len({float(s.reward) for s in group}) <= 1",
           "len({float(s.reward) for s in group}) < 1", ROC_TESTS,
           "equal-reward groups not dropped"),
    # ---- the sandbox executor's status mapping ----
    Mutant("E1", EXECUTOR, '      if sig == "SIGXCPU":', '      if sig == "SIGXCPU_":', EXEC_TESTS,
           "an RLIMIT_CPU kill (SIGXCPU) reported as killed"),
    Mutant("E2", EXECUTOR, "      r.exit_code = -int(getattr(signal.Signals, sig, 0))",
           "      r.exit_code = int(getattr(signal.Signals, sig, 0))", EXEC_TESTS,
           "signal exit code positive"),
    Mutant("E3", EXECUTOR,
           'r.status in ("timeout", "killed", "output_exceeded", "internal_error"):',
           'r.status in ("killed", "output_exceeded", "internal_error"):', EXEC_TESTS,
           "a timed-out session not reported lost"),
    Mutant("E4", EXECUTOR, "      if code != 0:", "      if code > 0:", EXEC_TESTS,
           "only positive exit codes are errors",
           equivalent="the worker reports exitcode as os.WEXITSTATUS(status), 0..255, never "
           "negative (a call ended by a signal takes the `signal` branch), so `!= 0` and `> 0` "
           "agree on every value that reaches them"),
    # ---- loss masks of tool-output tokens ----
    Mutant("M1", "rstar_jax/rollout/agent_loop.py",
           "traj.response_mask += [0] * len(tool_ids)", "traj.response_mask += [1] * len(tool_ids)",
           ("tests/rollout/test_agent_loop.py", "-k", "not real_engine"),
           "tool output trained on (rollout)"),
    Mutant("M2", "rstar_jax/rollout/chat.py", "mask += [1] * len(model) + [0] * len(tool)",
           "mask += [1] * len(model) + [1] * len(tool)", ("tests/rollout/test_chat.py",),
           "tool output trained on (rendered conversation)"),
    Mutant("M3", "rstar_jax/rl/batching.py",
           'out["loss_mask"][i, p:L] = np.asarray(t.response_mask, np.float32)',
           'out["loss_mask"][i, p:L] = 1.0',
           ("tests/rl/test_train_step.py", "-k", "build_batch"),
           "the batch's loss mask ignores the response mask"),
    # ---- GPQA grading (multiple choice) ----
    Mutant("G1", ANSWERS, "return letter if CHOICE_LETTERS.index(letter) < num_options else None",
           "return letter if CHOICE_LETTERS.index(letter) <= num_options else None",
           CHOICE_TESTS, "a letter one past the options accepted"),
    Mutant("G2", ANSWERS, '_CHOICE_WRAP_RE = re.compile(r"^\\(?([A-J])\\)?$")',
           '_CHOICE_WRAP_RE = re.compile(r"^\\(?([A-J])")', CHOICE_TESTS,
           "a box that starts with a letter counts (\\boxed{C and D} -> C)"),
    # ---- the bootstrap interval of the report's table ----
    Mutant("B1", SUITE, "alpha = (1 - level) / 2", "alpha = 1 - level", BOOTSTRAP_TESTS,
           "a 90% interval for a 95% one (both tails get 1 - level)"),
    Mutant("B2", SUITE,
           "means[start:start + n] = x[rng.integers(0, x.size, size=(n, x.size))].mean(axis=1)",
           "means[start:start + n] = x[rng.integers(0, x.size, size=n)]", BOOTSTRAP_TESTS,
           "resamples single scores, not problem sets (the scores' spread, not the mean's)"),
    # ---- bounded staleness ----
    Mutant("S1", ASYNC, "g_ages.append(None if None in steps else step - min(steps))",
           "g_ages.append(None if None in steps else step - max(steps))", STALENESS_TESTS,
           "a trajectory's age from its newest weight version, not its oldest"),
    Mutant("S2", ASYNC, "if any(a is None or a > max_staleness or a < 0 for a in g_ages):",
           "if all(a is None or a > max_staleness or a < 0 for a in g_ages):", STALENESS_TESTS,
           "a group with one stale trajectory kept (dropped only when all are)"),
    Mutant("P1", ASYNC,
           'if r["step"] != step + i or not 0 <= r["step"] - r["version_step"] <= max_staleness:',
           'if r["step"] != step + i or not 0 <= r["step"] - r["version_step"]:', PENDING_TESTS,
           "load_pending takes back rollouts older than the bound"),
    Mutant("P2", ASYNC,
           'if r["step"] != step + i or not 0 <= r["step"] - r["version_step"] <= max_staleness:',
           'if not 0 <= r["step"] - r["version_step"] <= max_staleness:', PENDING_TESTS,
           "load_pending takes back a run that is not contiguous from the checkpoint's step"),
    # ---- the decoupled objective (off-policy corrections) ----
    Mutant("O1", LOSSES, "return jnp.where(capped, 0.0, w), capped", "return w, capped",
           OFF_POLICY_TESTS, "decoupled: tokens beyond the cap kept"),
    Mutant("O2", LOSSES, "return jnp.minimum(w, cap), w > cap", "return w, w > cap",
           OFF_POLICY_TESTS, "decoupled-truncated: the weight not truncated at the cap"),
    Mutant("O3", LOSSES,
           "    old_f = x.prox            # the trust region is around the proximal policy",
           "    pass", OFF_POLICY_TESTS,
           "the ratio against the sampler, not the proximal policy"),
    Mutant("O4", LOSSES, "log_w = jnp.clip(x.prox - old_f,", "log_w = jnp.clip(old_f - x.prox,",
           OFF_POLICY_TESTS, "behaviour weight inverted (behav / prox)"),
    # ---- checkpoint integrity ----
    Mutant("K1", CHECKPOINT,
           "    if os.path.exists(os.path.join(path, COMMIT_FILE)):\n      continue",
           "    if True:\n      continue", CHECKPOINT_TESTS,
           "a step directory without the commit file not moved aside"),
    # ---- the fleet file ----
    Mutant("F1", FLEET, "if len(urls) != len(self.applied):",
           "if len(urls) > len(self.applied):", FLEET_TESTS,
           "a file with fewer servers applied (server i must stay server i)"),
    Mutant("F2", FLEET, 'u.startswith(("http://", "https://")) for u in urls):',
           'u.startswith(("http://", "https://", "h")) for u in urls):', FLEET_TESTS,
           "a URL without its scheme accepted"),
]


def _copy_tree(dst: str) -> None:
  files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
  for f in files:
    if not f:
      continue
    src = os.path.join(REPO, f.decode())
    if not os.path.isfile(src):
      continue
    target = os.path.join(dst, f.decode())
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.copy2(src, target)


def classify(code: int, junit_xml: str | None) -> tuple[str, list[dict]]:
  """("killed" | "survived" | "error", evidence) of one pytest run from its exit code and
  its JUnit XML (None: no report was written).

  Killed: exit 1 and at least one test that failed on an assertion (the report's
  `failure` whose exception is AssertionError or pytest's `Failed`, not a pytest-timeout
  time-out); the evidence is those tests' ids and their failures' first lines. Survived:
  exit 0. Everything else is an error; its evidence is what the report says went wrong
  (collection / set-up errors, time-outs, other exceptions)."""
  caught, other = [], []
  if junit_xml:
    try:
      root = ET.fromstring(junit_xml)
    except ET.ParseError as e:
      return "error", [{"test": "", "message": f"unreadable JUnit XML: {e}"}]
    for case in root.iter("testcase"):
      name = "::".join(x for x in (case.get("classname", ""), case.get("name", "")) if x)
      for el in case:
        if el.tag not in ("failure", "error"):
          continue
        message = (el.get("message") or "").strip()
        lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
        first = lines[0] if lines else ""
        if first.endswith(":") and len(lines) > 1:   # "AssertionError:" then numpy's text
          first = f"{first} {lines[1]}"
        text_lines = [ln.strip() for ln in (el.text or "").splitlines() if ln.strip()]
        # pytest ends a failure's text with "<file>:<line>: <exception type>".
        exc = text_lines[-1].rsplit(": ", 1)[-1] if text_lines else ""
        timed_out = "Timeout" in message and "pytest-timeout" in message
        assertion = (el.tag == "failure" and not timed_out and
                     (exc in ("AssertionError", "Failed") or
                      message.startswith(("assert ", "AssertionError"))))
        entry = {"test": name, "message": first[:200]}
        if not assertion:
          entry["kind"] = ("timeout" if timed_out else el.tag if el.tag == "error"
                           else f"raised {exc or 'an exception'}")
        (caught if assertion else other).append(entry)
  if code == 0 and not caught and not other:
    return "survived", []
  if code == 1 and caught:
    return "killed", caught
  if not other:
    other = [{"test": "", "kind": "exit", "message": f"pytest exit code {code}"}]
  return "error", other


def _pytest(tree: str, tests: tuple[str, ...], timeout: float) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
  env["PYTHONPATH"] = tree
  fd, xml_path = tempfile.mkstemp(prefix="mutation_junit_", suffix=".xml")
  os.close(fd)
  os.remove(xml_path)
  t0 = time.perf_counter()
  try:
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:xdist",
                        "-p", "no:cacheprovider", f"--junitxml={xml_path}", *tests], cwd=tree,
                       env=env, capture_output=True, text=True, timeout=timeout)
    code, out = p.returncode, p.stdout
  except subprocess.TimeoutExpired:
    code, out = -1, "timed out"
  secs = time.perf_counter() - t0
  try:
    with open(xml_path) as f:
      junit = f.read()
  except FileNotFoundError:
    junit = None
  finally:
    if os.path.exists(xml_path):
      os.remove(xml_path)
  status, evidence = classify(code, junit)
  lines = [l for l in out.splitlines() if l.strip()]
  return {"status": status, "exit": code, "seconds": round(secs, 1), "evidence": evidence,
          "last_line": lines[-1] if lines else ""}


def rotation(commit: str, n: int, mutants=None) -> list[Mutant]:
  """n non-equivalent mutants, the same for a commit: sorted by sha256(commit + id)."""
  pool = [m for m in (MUTANTS if mutants is None else mutants) if not m.equivalent]
  pool.sort(key=lambda m: hashlib.sha256(f"{commit}{m.id}".encode()).hexdigest())
  return pool[:n]


def _short(test_id: str) -> str:
  """tests.eval.test_benchmarks::test_x[a long param] -> test_benchmarks::test_x[a lo...]"""
  module, _, name = test_id.partition("::")
  name = name if len(name) <= 70 else name[:67] + "..."
  return f"{module.rsplit('.', 1)[-1]}::{name}" if name else module


def _caught_by(row: dict) -> str:
  if row["status"] == "killed":
    return "; ".join(f"{_short(e['test'])} ({e['message'][:60]})" for e in row["evidence"])
  if row["status"] == "equivalent":
    return row["equivalent"]
  return "; ".join(f"{e.get('kind', '')}: {e['test']} {e['message']}".strip()
                   for e in row["evidence"]) or row["last_line"]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--only", default="", help="comma-separated mutant ids")
  ap.add_argument("--rotate", type=int, default=0,
                  help="run N non-equivalent mutants picked from the commit (no baseline, "
                  "short output); exit 1 if any is not killed")
  ap.add_argument("--out", default="", help="write the table as JSON here")
  ap.add_argument("--no-baseline", action="store_true")
  ap.add_argument("--timeout", type=float, default=600.0, help="seconds per test run")
  args = ap.parse_args(argv)
  commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO,
                          capture_output=True, text=True).stdout.strip()
  mutants = MUTANTS
  if args.only and args.rotate:
    ap.error("--only and --rotate exclude each other")
  if args.only:
    wanted = set(args.only.split(","))
    mutants = [m for m in MUTANTS if m.id in wanted]
    if wanted - {m.id for m in mutants}:
      ap.error(f"unknown mutant ids {sorted(wanted - {m.id for m in mutants})}")
  if args.rotate:
    if not commit:
      ap.error("--rotate needs a git commit to pick from")
    mutants = rotation(commit, args.rotate)
  quiet = bool(args.rotate)
  rows = []
  t_start = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="mutation_pass_") as tree:
    _copy_tree(tree)
    for m in mutants:   # every snippet must be found exactly once before anything runs
      n = open(os.path.join(tree, m.file)).read().count(m.original)
      if n != 1:
        raise SystemExit(f"{m.id}: the original snippet occurs {n} times in {m.file}: "
                         "rewrite the mutant in experiments/mutation_pass.py")
    if not args.no_baseline and not args.rotate:
      for tests in dict.fromkeys(m.tests for m in mutants):
        r = _pytest(tree, tests, args.timeout)
        print(f"baseline {' '.join(tests)}: exit {r['exit']} in {r['seconds']:.0f} s "
              f"({r['last_line']})", flush=True)
        if r["status"] != "survived":
          raise SystemExit("a baseline test run fails unmutated: fix it first")
    for m in mutants:
      path = os.path.join(tree, m.file)
      text = open(path).read()
      try:
        with open(path, "w") as f:
          f.write(text.replace(m.original, m.mutated))
        r = _pytest(tree, m.tests, args.timeout)
      finally:
        with open(path, "w") as f:
          f.write(text)
      status = r["status"]
      if m.equivalent and status == "survived":
        status = "equivalent"
      elif m.equivalent and status == "killed":
        print(f"{m.id}: marked equivalent but killed: drop the mark", flush=True)
      row = {"id": m.id, "file": m.file, "what": m.what, "status": status, "exit": r["exit"],
             "seconds": r["seconds"], "tests": " ".join(m.tests), "evidence": r["evidence"],
             "last_line": r["last_line"]}
      if m.equivalent:
        row["equivalent"] = m.equivalent
      rows.append(row)
      if not quiet:
        print(f"{m.id:4} {status:10} {r['seconds']:5.0f} s  {m.file}: {m.what}  "
              f"[{_caught_by(row)}]", flush=True)
  counts = {k: sum(r["status"] == k for r in rows)
            for k in ("killed", "equivalent", "survived", "error")}
  bad = [r["id"] for r in rows if r["status"] in ("survived", "error")]
  total = time.perf_counter() - t_start
  if quiet:
    print(f"mutation rotation ({len(rows)} of {len(MUTANTS)} mutants, commit {commit[:9]}, "
          f"{total:.0f} s):")
    for r in rows:
      print(f"  {r['id']:4} {r['status']:8} {r['seconds']:4.0f} s  {r['what']}  "
            f"[{_caught_by(r)[:120]}]")
  else:
    print(f"\n{counts['killed']} killed, {counts['equivalent']} equivalent, "
          f"{counts['survived']} survived, {counts['error']} error of {len(rows)} mutants "
          f"in {total:.0f} s (commit {commit[:9]})")
    print("\n| id | file | mutation | result | caught by |\n|---|---|---|---|---|")
    for r in rows:
      cells = (r["id"], r["file"].removeprefix("rstar_jax/"), r["what"], r["status"],
               _caught_by(r))
      print("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
  if bad:
    print(f"NOT KILLED: {bad} (survived or error; see docs/testing.md, Mutation pass)")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"commit": commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "seconds": round(total, 1), "counts": counts, "rows": rows}, f, indent=1)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
