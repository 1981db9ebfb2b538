"""The mutation pass's list (experiments/mutation_pass.py) against the current code, and
how it reads a pytest run's result. No pytest is run here: a change that moves the code a
mutant edits fails this test until the mutant is rewritten, so the pass cannot describe
older code."""
from __future__ import annotations

import collections
import os

import pytest

from experiments import mutation_pass as mp


def test_every_mutant_edits_code_that_exists_once_and_names_tests_that_exist():
  ids = collections.Counter(m.id for m in mp.MUTANTS)
  assert not [i for i, n in ids.items() if n > 1], ids
  for m in mp.MUTANTS:
    path = os.path.join(mp.REPO, m.file)
    assert os.path.isfile(path), (m.id, m.file)
    with open(path) as f:
      n = f.read().count(m.original)
    assert n == 1, f"{m.id}: the original snippet occurs {n} times in {m.file}"
    assert m.mutated != m.original, m.id
    assert m.what and m.tests and m.test_paths, m.id
    for t in m.test_paths:
      assert os.path.isfile(os.path.join(mp.REPO, t)), (m.id, t)
    if "-k" in m.tests:
      assert m.tests.index("-k") + 1 < len(m.tests), m.id


def test_the_equivalent_mutants_carry_their_reason_and_are_never_rotated():
  equivalent = {m.id for m in mp.MUTANTS if m.equivalent}
  assert equivalent == {"R3", "E4"}
  pool = len(mp.MUTANTS) - len(equivalent)
  for commit in ("0" * 40, "f" * 40, "e408f23de"):
    everything = mp.rotation(commit, len(mp.MUTANTS))
    assert len(everything) == pool and not {m.id for m in everything} & equivalent
    picked = mp.rotation(commit, 4)
    assert picked == everything[:4] == mp.rotation(commit, 4)   # a function of the commit
  assert mp.rotation("0" * 40, 6) != mp.rotation("1" * 40, 6)


def _junit(*cases):
  body = "".join(f'<testcase classname="tests.t_mod" name="{name}">{inner}</testcase>'
                 for name, inner in cases)
  return f'<?xml version="1.0"?><testsuites><testsuite>{body}</testsuite></testsuites>'


ASSERTION = ('<failure message="assert 1 == 2">&gt;   assert 1 == 2\nE   assert 1 == 2\n\n'
             't_mod.py:3: AssertionError</failure>')
NUMPY = ('<failure message="AssertionError: \nNot equal to tolerance rtol=1e-07">E   ...\n\n'
         't_mod.py:4: AssertionError</failure>')
NOT_RAISED = ('<failure message="Failed: DID NOT RAISE &lt;class \'ValueError\'&gt;">E   Failed'
              '\n\nt_mod.py:5: Failed</failure>')
TIMEOUT = ('<failure message="Failed: Timeout (&gt;1.0s) from pytest-timeout.">E   Failed: '
           'Timeout\n\nt_mod.py:6: Failed</failure>')
TYPE_ERROR = ('<failure message="TypeError: unsupported operand">E   TypeError\n\n'
              't_mod.py:7: TypeError</failure>')
SETUP = '<error message="failed on setup with &quot;RuntimeError: boom&quot;">E</error>'


@pytest.mark.parametrize("code, cases, status, tests", [
    (0, [("test_ok", "")], "survived", []),
    (1, [("test_a", ASSERTION)], "killed", ["tests.t_mod::test_a"]),
    (1, [("test_np", NUMPY)], "killed", ["tests.t_mod::test_np"]),
    (1, [("test_r", NOT_RAISED)], "killed", ["tests.t_mod::test_r"]),
    (1, [("test_s", SETUP), ("test_a", ASSERTION)], "killed", ["tests.t_mod::test_a"]),
    (1, [("test_t", TIMEOUT)], "error", ["tests.t_mod::test_t"]),
    (1, [("test_e", TYPE_ERROR)], "error", ["tests.t_mod::test_e"]),
    (1, [("test_s", SETUP)], "error", ["tests.t_mod::test_s"]),
    (2, [("", '<error message="collection failure">ImportError</error>')], "error",
     ["tests.t_mod"]),
    (2, [("test_a", ASSERTION)], "error", [""]),      # interrupted: not a plain failure
    (0, [("test_s", SETUP)], "error", ["tests.t_mod::test_s"]),
])
def test_a_kill_is_a_named_test_failing_on_an_assertion(code, cases, status, tests):
  got, evidence = mp.classify(code, _junit(*cases))
  assert got == status
  assert [e["test"] for e in evidence] == tests
  if status == "killed":
    assert all(e["message"] and "kind" not in e for e in evidence)


def test_a_run_without_a_report_is_an_error():
  assert mp.classify(-1, None)[0] == "error"
  assert mp.classify(4, None) == ("error", [{"test": "", "kind": "exit",
                                             "message": "pytest exit code 4"}])
  assert mp.classify(1, "<not xml")[0] == "error"
  assert mp.classify(0, None) == ("survived", [])
