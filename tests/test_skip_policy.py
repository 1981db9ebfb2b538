"""tests/skip_policy.py in real pytest sessions (subprocesses), with and without xdist:
under CI=true a skip that the allow-list does not name fails the session and is named."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import skip_policy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_TESTS = '''
import pytest

def test_passes():
  assert 1 + 1 == 2

def test_guarded():
  pytest.skip("no bubblewrap here")

@pytest.mark.parametrize("x", [1, 2])
def test_param(x):
  if x == 2:
    pytest.skip("one config only")

@pytest.mark.xfail(reason="known", strict=True)
def test_xfail():
  assert False
'''


def _session(tmp_path, allow: str, *args: str, ci: str | None = "true"):
  (tmp_path / "test_inner.py").write_text(_TESTS)
  (tmp_path / "allow.txt").write_text(allow)
  (tmp_path / "pytest.ini").write_text("[pytest]\n")
  env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_XDIST_WORKER",
                                                           "PYTEST_ADDOPTS")}
  env["PYTHONPATH"] = REPO
  if ci is not None:
    env["CI"] = ci
  return subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "tests.skip_policy", "-p", "no:cacheprovider",
       "--skip-allowlist", str(tmp_path / "allow.txt"), *args, "test_inner.py"],
      cwd=tmp_path, env=env, capture_output=True, text=True)


@pytest.mark.parametrize("xdist", [(), ("-n", "2")], ids=["serial", "xdist-n2"])
def test_a_skip_outside_the_allowlist_fails_ci_and_is_named(tmp_path, xdist):
  out = _session(tmp_path, "test_inner.py::test_param[[]2] | one config only\n", *xdist)
  text = out.stdout + out.stderr
  assert out.returncode == 1, text
  assert "NOT ALLOWED SKIP test_inner.py::test_guarded: no bubblewrap here" in text, text
  assert "1 skip(s) not allowed" in text and "test_param" not in text.split(
      "skips not in")[1], text   # the allowed one is not named, nor the xfail
  if not xdist:
    return
  # Every skip allowed: the same session passes.
  out = _session(tmp_path, "test_inner.py::test_param[[]2] | one config only\n"
                           "*::test_guarded | a reason\n", *xdist)
  assert out.returncode == 0 and "NOT ALLOWED" not in out.stdout, out.stdout + out.stderr


def test_outside_ci_skips_pass_unless_strict(tmp_path):
  assert _session(tmp_path, "", ci="false").returncode == 0
  strict = _session(tmp_path, "", "--strict-skips", ci=None)
  assert strict.returncode == 1 and "2 skip(s) not allowed" in strict.stdout, strict.stdout


def test_an_entry_without_a_reason_is_refused(tmp_path):
  (tmp_path / "a.txt").write_text("# comment\n\ntests/x.py::test_y | why\ntests/x.py::test_z\n")
  with pytest.raises(pytest.UsageError, match=r"a.txt:4: .* non-empty reason"):
    skip_policy.read_allowlist(str(tmp_path / "a.txt"))
  (tmp_path / "b.txt").write_text("tests/x.py::test_y |   \n")
  with pytest.raises(pytest.UsageError, match="b.txt:1"):
    skip_policy.read_allowlist(str(tmp_path / "b.txt"))


def test_the_repos_allowlist_reads():
  for pattern, reason in skip_policy.read_allowlist(skip_policy.ALLOWLIST):
    assert pattern.startswith("tests/") and reason
    # Isolation and contract tests are never allowed to skip in CI.
    assert not pattern.startswith(("tests/sandbox/", "tests/rollout/")), pattern
