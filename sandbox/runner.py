"""Runs one cell of Python source, notebook style, and describes how it ended.

Used inside the sandboxed child; pure Python so it can be tested in-process.
"""
from __future__ import annotations

import ast
import linecache
import re
import sys
import traceback
from typing import Any

CELL_FILENAME = "<cell>"
_SURROGATE = re.compile("[\ud800-\udfff]")


def _source_line(source: str, lineno: int | None) -> str | None:
  if not lineno:
    return None
  lines = source.splitlines()
  if 1 <= lineno <= len(lines):
    return lines[lineno - 1].strip() or None
  return None


def _user_traceback(tb):
  """Drops the runner's own frames so the traceback starts at the user's cell."""
  while tb is not None and tb.tb_frame.f_code.co_filename != CELL_FILENAME:
    tb = tb.tb_next
  return tb


def _innermost_cell_line(tb) -> int | None:
  line = None
  while tb is not None:
    if tb.tb_frame.f_code.co_filename == CELL_FILENAME:
      line = tb.tb_lineno
    tb = tb.tb_next
  return line


# The record must stay small and parse anywhere: a hostile exception (a 1 MB class name,
# sys.exit(10**5000)) would otherwise make it unreadable to the server.
_MAX_TEXT, _MAX_NAME = 4000, 200


def _clip(text: str, limit: int) -> str:
  return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more chars]"


def _message(error_type: str, line: int | None, text: str) -> str:
  where = f" at line {line}" if line else ""
  text = _clip(text, _MAX_TEXT)
  return f"{error_type}{where}: {text}" if text else f"{error_type}{where}"


def _register_source(source: str) -> None:
  # Lets traceback print the user's lines for frames in <cell>.
  linecache.cache[CELL_FILENAME] = (len(source), None, source.splitlines(True), CELL_FILENAME)


def run_cell(source: str, globals_: dict[str, Any]) -> dict[str, Any]:
  """Executes `source` in `globals_`; prints the repr of a trailing expression.

  Returns a dict with status ('ok', 'error' or 'memory_exceeded'), exit_code and
  the error fields of `schema.Result`. Tracebacks go to sys.stderr.
  """
  _register_source(source)
  bad = _SURROGATE.search(source)
  if bad is not None:
    # Python cannot compile text that is not valid Unicode; typically a model's broken
    # "\ud83d" escape (half of a surrogate pair) in the tool call's JSON.
    lineno = source.count("\n", 0, bad.start()) + 1
    text = (f"lone surrogate {ascii(bad.group())} in the source (a broken \\u escape?); "
            "Python source must be valid Unicode")
    sys.stderr.write(f"SyntaxError: {text}\n")
    return dict(status="error", exit_code=1, error_type="SyntaxError", error_line=lineno,
                error_message=_message("SyntaxError", lineno, text),
                error_source=ascii(_source_line(source, lineno) or "")[1:-1] or None)
  try:
    tree = ast.parse(source, CELL_FILENAME, "exec")
  except (SyntaxError, ValueError) as e:  # ValueError: source contains NUL bytes
    lineno = getattr(e, "lineno", None)
    text = getattr(e, "msg", None) or str(e)
    error_type = _clip(type(e).__name__, _MAX_NAME)
    sys.stderr.write("".join(traceback.format_exception_only(type(e), e)))
    bad = getattr(e, "text", None)
    return dict(status="error", exit_code=1, error_type=error_type, error_line=lineno,
                error_message=_message(error_type, lineno, text),
                error_source=(bad.strip() or None) if bad else _source_line(source, lineno))

  last = None
  if tree.body and isinstance(tree.body[-1], ast.Expr):
    last = ast.Expression(tree.body.pop().value)
  try:
    exec(compile(tree, CELL_FILENAME, "exec"), globals_)  # noqa: S102 (that is the job)
    if last is not None:
      value = eval(compile(last, CELL_FILENAME, "eval"), globals_)  # noqa: S307
      if value is not None:
        print(repr(value))
    return dict(status="ok", exit_code=0)
  except SystemExit as e:
    code = e.code
    if code is None or code == 0:
      return dict(status="ok", exit_code=0)
    line = _innermost_cell_line(e.__traceback__)
    if isinstance(code, int):
      # A real process's status is 32 bits at most; past that, 1 (as a message would).
      exit_code, text = (code if -2**31 <= code < 2**31 else 1), _clip(str(code), 100)
    else:  # sys.exit("message") prints it and exits 1, as CPython does
      sys.stderr.write(f"{code}\n")
      exit_code, text = 1, str(code)
    return dict(status="error", exit_code=exit_code, error_type="SystemExit", error_line=line,
                error_message=_message("SystemExit", line, text),
                error_source=_source_line(source, line))
  except BaseException as e:  # noqa: BLE001: anything the cell raises is its result
    line = _innermost_cell_line(e.__traceback__)
    error_type = _clip(type(e).__name__, _MAX_NAME)
    try:
      text = str(e)
    except Exception:  # noqa: BLE001: a hostile __str__ must not kill the report
      text = "<unprintable exception>"
    try:
      sys.stderr.write("".join(traceback.format_exception(type(e), e, _user_traceback(e.__traceback__))))
    except Exception:  # noqa: BLE001
      sys.stderr.write(f"{error_type}: {text}\n")
    status = "memory_exceeded" if isinstance(e, MemoryError) else "error"
    return dict(status=status, exit_code=1, error_type=error_type, error_line=line,
                error_message=_message(error_type, line, text),
                error_source=_source_line(source, line))
