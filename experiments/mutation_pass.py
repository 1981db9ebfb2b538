"""A mutation pass over the code whose tests must catch small wrong changes: the RL math
(losses, advantages, rewards), answer parsing, RoC down-sampling, the sandbox executor's
status mapping, and the loss masks of tool-output tokens.

Each mutant is one small edit (an operator swapped, a constant changed, a line made
inert), given as (file, original snippet, mutated snippet, the test files that should
catch it). For each, the edit is made in a scratch copy of the working tree (the
checkout itself is never touched), the tests run with `-x`, and the mutant is KILLED when
they fail, SURVIVED when they pass. A baseline run of every test command on the
unmodified copy comes first (a command that fails unmutated makes its kills meaningless).

Not run in CI (minutes of CPU): run on demand,

  python -m experiments.mutation_pass [--only ID,ID] [--out mutation.json] [--no-baseline]

Surviving mutants and why each is equivalent or which test now kills it: docs/testing.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Mutant:
  id: str
  file: str
  original: str
  mutated: str
  tests: tuple[str, ...]
  what: str


LOSS_TESTS = ("tests/rl/test_loss_oracle.py", "tests/rl/test_rl_losses.py")
ADV_TESTS = ("tests/rl/test_rl_advantages.py",)
REWARD_TESTS = ("tests/rl/test_rl_rewards.py",)
ROC_TESTS = ("tests/rl/test_rl_roc.py",)
EXEC_TESTS = ("tests/sandbox/test_containment.py", "tests/sandbox/test_correctness.py", "-k",
              "cpu_time or segfault or exit_variants or session or deadline or sigterm")
LOSSES, ADV, REWARDS, ANSWERS = ("rstar_jax/rl/losses.py", "rstar_jax/rl/advantages.py",
                                 "rstar_jax/rl/rewards.py", "rstar_jax/answers.py")
ROC, EXECUTOR = "rstar_jax/rl/roc.py", "sandbox/executor.py"

MUTANTS = [
    # ---- the loss ----
    Mutant("L1", LOSSES,
           "log_ratio = jnp.clip(new_f - old_f, -config.log_ratio_clamp, config.log_ratio_clamp)",
           "log_ratio = new_f - old_f", LOSS_TESTS, "log-ratio clamp removed"),
    Mutant("L2", LOSSES, "lo, hi = 1.0 - config.eps_low, 1.0 + config.eps_high",
           "lo, hi = 1.0 - config.eps_high, 1.0 + config.eps_low", LOSS_TESTS,
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
           "math-verify reached with one side unparsed"),
    Mutant("N1", ANSWERS, "      i += 2\n      continue", "      i += 1\n      continue",
           REWARD_TESTS, "_match_brace escape skip 2 -> 1"),
    Mutant("N2", ANSWERS, "start = response_text.rfind(ANSWER_OPEN)",
           "start = response_text.find(ANSWER_OPEN)", REWARD_TESTS,
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
           "only positive exit codes are errors"),
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


def _pytest(tree: str, tests: tuple[str, ...], timeout: float) -> tuple[int, float, str]:
  env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
  env["PYTHONPATH"] = tree
  t0 = time.perf_counter()
  try:
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:xdist",
                        "-p", "no:cacheprovider", *tests], cwd=tree, env=env,
                       capture_output=True, text=True, timeout=timeout)
    code, out = p.returncode, p.stdout
  except subprocess.TimeoutExpired:
    code, out = -1, "timed out"
  lines = [l for l in out.splitlines() if l.strip()]
  return code, time.perf_counter() - t0, lines[-1] if lines else ""


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--only", default="", help="comma-separated mutant ids")
  ap.add_argument("--out", default="", help="write the table as JSON here")
  ap.add_argument("--no-baseline", action="store_true")
  ap.add_argument("--timeout", type=float, default=600.0, help="seconds per test run")
  args = ap.parse_args(argv)
  mutants = MUTANTS
  if args.only:
    wanted = set(args.only.split(","))
    mutants = [m for m in MUTANTS if m.id in wanted]
    if wanted - {m.id for m in mutants}:
      ap.error(f"unknown mutant ids {sorted(wanted - {m.id for m in mutants})}")
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                          capture_output=True, text=True).stdout.strip()
  rows = []
  with tempfile.TemporaryDirectory(prefix="mutation_pass_") as tree:
    _copy_tree(tree)
    for m in mutants:   # every snippet must be found exactly once before anything runs
      n = open(os.path.join(tree, m.file)).read().count(m.original)
      if n != 1:
        raise SystemExit(f"{m.id}: the original snippet occurs {n} times in {m.file}")
    if not args.no_baseline:
      for tests in dict.fromkeys(m.tests for m in mutants):
        code, secs, last = _pytest(tree, tests, args.timeout)
        print(f"baseline {' '.join(tests)}: exit {code} in {secs:.0f} s ({last})", flush=True)
        if code != 0:
          raise SystemExit("a baseline test run fails unmutated: fix it first")
    for m in mutants:
      path = os.path.join(tree, m.file)
      text = open(path).read()
      try:
        with open(path, "w") as f:
          f.write(text.replace(m.original, m.mutated))
        code, secs, last = _pytest(tree, m.tests, args.timeout)
      finally:
        with open(path, "w") as f:
          f.write(text)
      status = "survived" if code == 0 else "killed"
      rows.append({"id": m.id, "file": m.file, "what": m.what, "status": status,
                   "exit": code, "seconds": round(secs, 1), "tests": " ".join(m.tests),
                   "last_line": last})
      print(f"{m.id:4} {status:8} {secs:5.0f} s  {m.file}: {m.what}  [{last}]", flush=True)
  killed = sum(r["status"] == "killed" for r in rows)
  print(f"\n{killed} of {len(rows)} mutants killed; survived: "
        f"{[r['id'] for r in rows if r['status'] == 'survived']} (commit {commit})")
  print("\n| id | file | mutation | result | tests |\n|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['id']} | {r['file']} | {r['what']} | {r['status']} | {r['tests']} |")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"commit": commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "rows": rows}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
