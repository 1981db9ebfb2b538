"""Call/Result wire types and the in-process cell runner (no server)."""
from __future__ import annotations

import io
import sys

import pytest

from sandbox import runner
from sandbox.config import ExecutorConfig
from sandbox.schema import STATUSES, Call, Result


def test_call_from_obj_accepts_str_mapping_and_call():
  assert Call.from_obj("print(1)") == Call(code="print(1)")
  c = Call.from_obj({"code": "x", "input": "a", "timeout": 2, "session_id": "s"})
  assert (c.code, c.input, c.timeout, c.session_id) == ("x", "a", 2, "s")
  assert Call.from_obj(c) is c
  assert Call.from_obj(c.to_dict()) == c


@pytest.mark.parametrize("obj,needle", [
    ({"input": "x"}, "missing required field 'code'"),
    ({"code": 1}, "Call.code must be a str"),
    ({"code": "x", "timeout": -1}, "timeout must be > 0"),
    ({"code": "x", "timeout": "3"}, "timeout must be a number"),
    ({"code": "x", "stdin": "y"}, "unknown field(s) ['stdin']"),
    ({"code": "x", "session_id": ""}, "session_id must be a non-empty str"),
    (3, "expected a Call, str or mapping"),
])
def test_call_rejects_bad_input_with_clear_message(obj, needle):
  with pytest.raises(ValueError, match="calls\\[7\\]") as e:
    Call.from_obj(obj, where="calls[7]")
  assert needle in str(e.value)


def test_result_round_trip_and_status_check():
  r = Result(status="error", error_message="NameError at line 3: name 'x' is not defined",
             error_source="print(x)", error_line=3)
  assert Result.from_dict(r.to_dict()) == r
  assert r.error_text() == "NameError at line 3: name 'x' is not defined\n    print(x)"
  assert not r.ok and Result(status="ok").ok
  assert set(STATUSES) == {"ok", "error", "timeout", "memory_exceeded", "output_exceeded",
                           "killed", "internal_error"}
  with pytest.raises(ValueError, match="Result.status must be one of"):
    Result(status="oops")


def test_executor_config_validation():
  with pytest.raises(ValueError, match="max_children must be > 0"):
    ExecutorConfig(max_children=0)
  with pytest.raises(ValueError, match="isolation must be"):
    ExecutorConfig(isolation="docker")
  with pytest.raises(ValueError, match="default_timeout .* exceeds"):
    ExecutorConfig(default_timeout=10, max_timeout=5)


def _run_cell(source):
  out, err = io.StringIO(), io.StringIO()
  old = sys.stdout, sys.stderr
  sys.stdout, sys.stderr = out, err
  try:
    outcome = runner.run_cell(source, {"__name__": "__main__"})
  finally:
    sys.stdout, sys.stderr = old
  return outcome, out.getvalue(), err.getvalue()


def test_run_cell_trailing_expression_and_errors():
  o, out, _ = _run_cell("x = 2\nx * 21")
  assert o["status"] == "ok" and out == "42\n"
  o, out, _ = _run_cell("x = None\nx")  # None is not echoed, as in a notebook
  assert o["status"] == "ok" and out == ""
  o, _, err = _run_cell("a = 1\n\nprint(x)\n")
  assert o["error_message"] == "NameError at line 3: name 'x' is not defined"
  assert o["error_source"] == "print(x)" and o["error_line"] == 3
  assert 'File "<cell>", line 3' in err and "runner.py" not in err
  o, _, _ = _run_cell("def f(:\n  pass")
  assert o["error_type"] == "SyntaxError" and o["error_line"] == 1
  assert o["error_message"].startswith("SyntaxError at line 1:")
  o, _, _ = _run_cell("raise MemoryError('big')")
  assert o["status"] == "memory_exceeded"
  o, _, _ = _run_cell("import sys\nsys.exit(0)")
  assert o["status"] == "ok" and o["exit_code"] == 0
  o, _, _ = _run_cell("import sys\nsys.exit(3)")
  assert (o["status"], o["exit_code"], o["error_type"]) == ("error", 3, "SystemExit")
