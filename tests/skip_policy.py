"""Skips are checked against tests/skip_allowlist.txt at the end of a run.

A skipped test checks nothing, and a skip that keeps CI green hides exactly the failures
the test was written for (no bubblewrap: the containment tests skip; no network: the
SGLang contract tests skip). Under CI=true (or `--strict-skips`) every skip must match an
entry of the allow-list, which gives a reason for each; any other skip fails the session
and is named in the summary.

Works under pytest-xdist: the controller receives every worker's test and collection
reports through the same hooks, and only the controller (no `workerinput`) judges.

The hooks are re-exported by tests/conftest.py; `-p tests.skip_policy` loads them into
any other pytest run (the test of this module does that).
"""
from __future__ import annotations

import fnmatch
import os

import pytest

ALLOWLIST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "skip_allowlist.txt")
_SKIPS = pytest.StashKey[list]()
_BAD = pytest.StashKey[list]()
_CONFIG: list = [None]   # the reports carry no config: the session's, set at configure


def read_allowlist(path: str) -> list[tuple[str, str]]:
  """(node-id pattern, reason) per entry; `pattern | reason`, `#` starts a comment line."""
  entries = []
  with open(path) as f:
    for n, line in enumerate(f, 1):
      line = line.strip()
      if not line or line.startswith("#"):
        continue
      pattern, sep, reason = line.partition(" | ")
      if not sep or not pattern.strip() or not reason.strip():
        raise pytest.UsageError(f"{path}:{n}: an entry is `<node id pattern> | <reason>` "
                                f"with a non-empty reason, got {line!r}")
      entries.append((pattern.strip(), reason.strip()))
  return entries


def _strict(config) -> bool:
  return (config.getoption("strict_skips")
          or os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"))


def pytest_addoption(parser):
  parser.addoption("--strict-skips", action="store_true", dest="strict_skips",
                   help="fail the session when a test is skipped that "
                        "tests/skip_allowlist.txt does not allow (on by default when CI=true)")
  parser.addoption("--skip-allowlist", dest="skip_allowlist", default=ALLOWLIST,
                   help="the allow-list of skips (default: tests/skip_allowlist.txt)")


def _record(config, nodeid: str, report) -> None:
  if not report.skipped or hasattr(report, "wasxfail"):
    return   # an xfail is reported as skipped: it ran
  longrepr = report.longrepr
  reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
  reason = reason.removeprefix("Skipped: ")
  config.stash.setdefault(_SKIPS, []).append((nodeid, reason))


def pytest_runtest_logreport(report):
  _record(_CONFIG[0], report.nodeid, report)


def pytest_collectreport(report):
  # A module skipped as a whole (pytest.importorskip at import time, allow_module_level).
  _record(_CONFIG[0], report.nodeid, report)


def pytest_configure(config):
  _CONFIG[0] = config


def judge(session) -> None:
  """Called from pytest_sessionfinish: sets the exit status when a skip is not allowed."""
  config = session.config
  if hasattr(config, "workerinput"):
    return   # an xdist worker: the controller sees its reports and judges
  skips = config.stash.get(_SKIPS, [])
  if not skips or not _strict(config):
    return
  allowed = read_allowlist(config.getoption("skip_allowlist"))
  bad = [(nodeid, reason) for nodeid, reason in skips
         if not any(fnmatch.fnmatchcase(nodeid, p) for p, _ in allowed)]
  config.stash[_BAD] = bad
  if bad and session.exitstatus == 0:
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_sessionfinish(session):
  judge(session)


def pytest_terminal_summary(terminalreporter, config):
  bad = config.stash.get(_BAD, [])
  if not bad:
    return
  terminalreporter.section("skips not in tests/skip_allowlist.txt", sep="=", red=True)
  for nodeid, reason in bad:
    terminalreporter.line(f"NOT ALLOWED SKIP {nodeid}: {reason}", red=True)
  terminalreporter.line(f"{len(bad)} skip(s) not allowed: the session fails (CI=true or "
                        "--strict-skips). Fix the cause, or add `<node id> | <reason>` to "
                        "the allow-list.", red=True)
