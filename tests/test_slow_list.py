"""tests/slow_tests.txt names every slow test with why CI leaves it out (or runs it in
rotation), and nothing else: a slow test added without an entry, an entry without a
reason, or an entry whose test is gone or no longer slow fails here."""
import fnmatch
import os
import subprocess
import sys

from tests import conftest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _collected(*args) -> list[str]:
  env = {k: v for k, v in os.environ.items() if k != "CI"}
  out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:xdist",
                        "-p", "no:cacheprovider", *args], cwd=REPO, env=env,
                       capture_output=True, text=True)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return [l for l in out.stdout.splitlines() if "::" in l]


def test_every_slow_test_is_listed_with_a_reason_and_every_entry_is_a_slow_test():
  entries = conftest._slow_list()
  assert entries and all(reason for _, reason in entries), entries
  slow = _collected("-m", "slow")
  assert slow
  unlisted = [t for t in slow if not any(fnmatch.fnmatchcase(t, p) for p, _ in entries)]
  assert not unlisted, f"slow tests missing from tests/slow_tests.txt: {unlisted}"
  stale = [p for p, _ in entries if not any(fnmatch.fnmatchcase(t, p) for t in slow)]
  assert not stale, f"tests/slow_tests.txt entries that match no slow test: {stale}"


def test_ci_runs_this_commit_s_share_of_the_rotating_slow_tests():
  """--rotate-slow (on under CI=true) takes ROTATING_SLOW_PER_RUN [rotating] cases out
  of the slow set, and only those."""
  plain = set(_collected("-m", "not slow", "tests/rl/test_every_option.py"))
  rotated = set(_collected("-m", "not slow", "--rotate-slow", "tests/rl/test_every_option.py"))
  extra = rotated - plain
  assert plain <= rotated and len(extra) == conftest.ROTATING_SLOW_PER_RUN, extra
  rotating = [p for p, r in conftest._slow_list() if r.startswith("[rotating]")]
  assert all(any(fnmatch.fnmatchcase(t, p) for p in rotating) for t in extra), extra
