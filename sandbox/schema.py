"""Wire types shared by the server, the client and the worker: `Call` and `Result`.

Both travel as JSON objects. `Result.status` is the only field a rollout should
read to count tool errors; stdout/stderr are for the model to see.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

# Every status a result can carry, and what it means.
STATUSES = (
    "ok",               # ran to the end (or sys.exit(0) / os._exit(0))
    "error",            # uncaught exception, syntax error, non-zero exit
    "timeout",          # killed at its wall deadline (or its CPU limit)
    "memory_exceeded",  # MemoryError under the address-space limit
    "output_exceeded",  # stdout or stderr passed the cap; killed
    "killed",           # died by a signal it did not get from us (segfault, abort, SIGKILL)
    "internal_error",   # the sandbox failed, not the code (worker died, no server reachable)
)

# Isolation levels, strongest first. Every result says which one ran it.
ISOLATION_LEVELS = ("bwrap", "rlimits+uid", "rlimits")


MAX_ID_CHARS = 128
MAX_SESSION_ID_CHARS = 256
_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.:")


def _short(value: Any, limit: int = 60) -> str:
  text = repr(value)
  return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def _check_timeout(timeout: Any, where: str) -> None:
  if timeout is None:
    return
  if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
    raise ValueError(f"{where}: timeout must be a number of seconds, got {_short(timeout)}")
  if isinstance(timeout, int):  # exact: float() of a 400-digit int overflows
    if timeout <= 0:
      raise ValueError(f"{where}: timeout must be > 0 and finite, got {_short(timeout)}")
    if timeout > 10**9:
      raise ValueError(f"{where}: timeout must be a finite number of seconds, got an integer of "
                       f"{len(str(timeout))} digits")
    return
  if not math.isfinite(timeout) or timeout <= 0:
    raise ValueError(f"{where}: timeout must be > 0 and finite, got {_short(timeout)}")


def check_call_id(call_id: Any, where: str = "Call") -> None:
  """Call ids: 1-128 characters of [A-Za-z0-9-_.:] (they travel in logs and JSON keys)."""
  if call_id is None:
    return
  if not isinstance(call_id, str) or not 1 <= len(call_id) <= MAX_ID_CHARS \
      or not _ID_CHARS.issuperset(call_id):
    raise ValueError(f"{where}: id must be a str of 1-{MAX_ID_CHARS} characters from "
                     f"[A-Za-z0-9-_.:], got {_short(call_id)}")


CALL_FIELDS = frozenset({"code", "input", "timeout", "session_id", "id"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Call:
  """One code execution request.

  code: Python source; a trailing bare expression has its repr printed.
  input: text fed to the program's stdin.
  timeout: wall-clock seconds; None means the server's default.
  session_id: calls sharing an id see each other's globals (see README).
  id: names the call for exactly-once delivery: a server that has seen the id
    answers with the stored result instead of running it again. The client fills
    in a unique id when None.
  """
  code: str
  input: str = ""
  timeout: float | None = None
  session_id: str | None = None
  id: str | None = None

  def __post_init__(self):
    if not isinstance(self.code, str):
      raise ValueError(f"Call.code must be a str, got {type(self.code).__name__}")
    if not isinstance(self.input, str):
      raise ValueError(f"Call.input must be a str, got {type(self.input).__name__}")
    _check_timeout(self.timeout, "Call")
    if self.session_id is not None and (not isinstance(self.session_id, str) or not self.session_id):
      raise ValueError(f"Call.session_id must be a non-empty str or None, got {_short(self.session_id)}")
    if self.session_id is not None and len(self.session_id) > MAX_SESSION_ID_CHARS:
      raise ValueError(f"Call.session_id must be at most {MAX_SESSION_ID_CHARS} characters, "
                       f"got {len(self.session_id)}")
    check_call_id(self.id, "Call")

  def to_dict(self) -> dict[str, Any]:
    d: dict[str, Any] = {"code": self.code}
    if self.input:
      d["input"] = self.input
    if self.timeout is not None:
      d["timeout"] = self.timeout
    if self.session_id is not None:
      d["session_id"] = self.session_id
    if self.id is not None:
      d["id"] = self.id
    return d

  @classmethod
  def from_obj(cls, obj: "Call | Mapping[str, Any] | str", where: str = "call") -> "Call":
    """Accepts a Call, a plain code string, or a mapping with the Call's fields."""
    if isinstance(obj, Call):
      return obj
    if isinstance(obj, str):
      return cls(code=obj)
    if not isinstance(obj, Mapping):
      raise ValueError(f"{where}: expected a Call, str or mapping, got {type(obj).__name__}")
    unknown = set(obj) - CALL_FIELDS
    if unknown:
      names = sorted(_short(k, 40) if not isinstance(k, str) or len(k) > 40 else k for k in unknown)
      raise ValueError(f"{where}: unknown field(s) {names}; "
                       f"known: {', '.join(sorted(CALL_FIELDS))}")
    if "code" not in obj:
      raise ValueError(f"{where}: missing required field 'code'")
    try:
      inp = obj.get("input")
      return cls(code=obj["code"], input="" if inp is None else inp,
                 timeout=obj.get("timeout"), session_id=obj.get("session_id"), id=obj.get("id"))
    except ValueError as e:
      raise ValueError(f"{where}: {e}") from None


@dataclasses.dataclass(kw_only=True)
class Result:
  """Outcome of one call. `status` is one of STATUSES.

  error_message reads like `NameError at line 3: name 'x' is not defined` and
  error_source holds the offending source line (both None when status is ok).
  """
  status: str
  stdout: str = ""
  stderr: str = ""
  exit_code: int | None = None
  error_type: str | None = None
  error_line: int | None = None
  error_message: str | None = None
  error_source: str | None = None
  wall_time: float = 0.0
  cpu_time: float = 0.0
  isolation: str = ""
  truncated: bool = False
  session_id: str | None = None
  session_new: bool | None = None  # True: this call started a fresh session state
  server: str | None = None        # filled in by the client: the URL that answered
  call_id: str | None = None       # the call's id (see Call.id)

  def __post_init__(self):
    if self.status not in STATUSES:
      raise ValueError(f"Result.status must be one of {STATUSES}, got {self.status!r}")

  @property
  def ok(self) -> bool:
    return self.status == "ok"

  def error_text(self) -> str:
    """The error line plus the offending source line, '' when there is no error."""
    if not self.error_message:
      return ""
    if self.error_source:
      return f"{self.error_message}\n    {self.error_source}"
    return self.error_message

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "Result":
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})

  @classmethod
  def internal_error(cls, message: str, **kw: Any) -> "Result":
    return cls(status="internal_error", error_type="SandboxError", error_message=message, **kw)
