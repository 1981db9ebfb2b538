"""Math RL problems and SFT chat data: loading, validation, filtering, iteration.

Math problems come in several public layouts; every row is normalised to one
`MathProblem`:

* verl / DAPO-Math-17k: `prompt` is a list of chat messages (one user turn),
  `reward_model: {"ground_truth": ..., "style": "rule"}`, `data_source`,
  `extra_info: {"index": ...}`. DAPO's "Solve the following math problem step by
  step ... Answer:" wrapper is stripped by default, because rStar2 asks for
  `\\boxed{}` in its own system prompt and the two instructions would contradict.
* plain rows: `problem`/`answer` (MATH-500, DeepScaleR, ...), AIME-style
  `Problem`/`Answer`/`ID` or `question`/`answer`/`id`, and rows with only a
  `solution` from which the last `\\boxed{...}` is taken as the answer.

Files: `.jsonl` (optionally `.jsonl.gz`), `.json` (an array of rows) and `.parquet`;
`load_rows` (a layout with named columns) reads `.csv` too (GPQA's release format).
A malformed row gives a `DataError` naming the file, the row (1-based line for
JSONL, 1-based row for Parquet and JSON arrays) and the field. With
`on_error="skip"` such rows are skipped, counted and the first few reasons are
logged and returned in the `LoadResult`: nothing is lost silently. A file with no
rows at all (empty, only blank lines, `[]`, a 0-row Parquet table) is a `DataError`
naming the file, in both modes.

The filters (`filter_integer_answers`, `deduplicate`) return what they drop as
well as what they keep, for the same reason.

`EpochIterator` yields fixed-size batches in a seeded order that reshuffles every
epoch, and can save / restore its position so an RL run resumes on the exact
next batch.

SFT data is chat-message JSONL (`{"messages": [...]}`, roles system / user /
assistant / tool, optional structured `tool_calls`); it is validated here into
plain dataclasses and rendered to tokens elsewhere (rstar_jax/rollout/chat.py).
"""
from __future__ import annotations

import collections
import dataclasses
import decimal
import gzip
import hashlib
import json
import math
import os
import pathlib
import unicodedata
import zlib
from typing import Any, Callable, Generic, Iterable, Iterator, Mapping, Sequence, TypeVar

from absl import logging
import numpy as np

from rstar_jax.registry import Registry

# One definition of "boxed answer" and "integer answer" for data and reward alike: a
# problem the integer filter keeps is exactly one the reward compares strictly.
from rstar_jax.answers import extract_boxed, parse_integer

T = TypeVar("T")
PathLike = str | os.PathLike
ON_ERROR = ("raise", "skip")

# --------------------------------------------------------------------------------------
# Records and errors.


@dataclasses.dataclass(frozen=True)
class MathProblem:
  """One math problem with a reference answer.

  Attributes:
    uid: unique id (from the row's id field, else `<file stem>:<row>`).
    problem: the problem statement, without any answer-format instruction.
    answer: the reference answer as text (canonical integer text after
      `filter_integer_answers`).
    source: `data_source` / `source` field of the row, else the file stem.
    meta: everything else the row carried (level, subject, solution, the raw
      answer, ...). Treat it as read-only.
  """
  uid: str
  problem: str
  answer: str
  source: str
  meta: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)


@dataclasses.dataclass(frozen=True)
class RowError:
  """Why one row could not be loaded."""
  path: str
  row: int  # 1-based.
  unit: str  # "line" (JSONL) or "row" (Parquet, JSON arrays).
  field: str | None  # dotted path of the offending field; None for the whole row.
  message: str

  def __str__(self) -> str:
    where = f"{self.path}, {self.unit} {self.row}"
    if self.field is not None:
      where += f", field '{self.field}'"
    return f"{where}: {self.message}"


class DataError(ValueError):
  """A malformed row (`row_error` says where and why) or an unusable file.

  File-level errors (a file with no rows at all) have `row_error=None`; `path` names
  the file in both cases.
  """

  def __init__(self, row_error: RowError | None = None, *, path: PathLike | None = None,
               message: str | None = None):
    if row_error is None and (path is None or message is None):
      raise TypeError("DataError needs a RowError, or a path and a message")
    super().__init__(str(row_error) if row_error is not None else f"{path}: {message}")
    self.row_error = row_error
    self.path = row_error.path if row_error is not None else str(path)


class FieldError(ValueError):
  """Raised by row parsers; the loader adds file and row to it."""

  def __init__(self, field: str | None, message: str):
    super().__init__(f"field '{field}': {message}" if field else message)
    self.field = field
    self.message = message


@dataclasses.dataclass(frozen=True)
class LoadResult(Generic[T]):
  """What a loader read: the good items and an account of the skipped rows."""
  items: tuple[T, ...]
  num_rows: int  # non-blank rows seen.
  num_skipped: int
  errors: tuple[RowError, ...]  # the first `max_reported` reasons for skipping.

  def summary(self) -> str:
    text = f"loaded {len(self.items)} of {self.num_rows} rows, skipped {self.num_skipped}"
    if self.errors:
      shown = "\n  ".join(str(e) for e in self.errors)
      more = self.num_skipped - len(self.errors)
      text += f"; first reasons:\n  {shown}" + (f"\n  ... and {more} more" if more > 0 else "")
    return text


# --------------------------------------------------------------------------------------
# Row readers: (1-based row number, parsed row or RowError).

_Read = tuple[int, Any, RowError | None]


def _open_bytes(path: pathlib.Path):
  # Case-insensitive, as `_reader_for` is: a `.JSONL.GZ` read raw is binary garbage.
  return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def _not_utf8(raw: bytes, e: UnicodeDecodeError) -> str:
  return f"not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})"


def _json_error(e: Exception) -> str:
  """json.loads' error as a row's reason: JSONDecodeError, or the ValueError of a number
  of > 4300 digits, or the RecursionError of deep nesting."""
  if isinstance(e, json.JSONDecodeError):
    return f"invalid JSON ({e.msg} at column {e.colno})"
  return f"invalid JSON ({type(e).__name__}: {str(e)[:200]})"


# What a truncated or corrupt (compressed) file raises while it is read.
_CORRUPT = (EOFError, OSError, zlib.error)


def _read_jsonl(path: pathlib.Path) -> Iterator[_Read]:
  line_no = 0
  try:
    with _open_bytes(path) as f:
      for line_no, raw in enumerate(f, start=1):
        try:   # utf-8-sig: a BOM on the first line is no error
          line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
        except UnicodeDecodeError as e:   # one bad row, like invalid JSON: on_error decides
          yield line_no, None, RowError(str(path), line_no, "line", None, _not_utf8(raw, e))
          continue
        if not line.strip():  # Blank lines (e.g. a trailing newline) hold no row.
          continue
        try:
          row = json.loads(line)
        except (ValueError, RecursionError) as e:
          yield line_no, None, RowError(str(path), line_no, "line", None, _json_error(e))
          continue
        yield line_no, row, None
  except _CORRUPT as e:
    raise DataError(path=path, message=f"corrupt or truncated after line {line_no} "
                    f"({type(e).__name__}: {e})") from e


def _read_json_array(path: pathlib.Path) -> Iterator[_Read]:
  try:
    with _open_bytes(path) as f:
      raw = f.read()
  except _CORRUPT as e:
    raise DataError(path=path, message=f"corrupt or truncated ({type(e).__name__}: {e})") from e
  try:
    text = raw.decode("utf-8-sig")
  except UnicodeDecodeError as e:
    raise DataError(path=path, message=_not_utf8(raw, e)) from None
  if not text.strip():
    return  # No rows; _load_rows reports the empty file.
  try:
    data = json.loads(text)
  except (ValueError, RecursionError) as e:
    raise DataError(RowError(str(path), getattr(e, "lineno", 1), "line", None,
                             _json_error(e))) from e
  if isinstance(data, dict) and isinstance(data.get("data"), list):
    data = data["data"]
  if not isinstance(data, list):
    raise ValueError(f"{path}: a .json file must hold an array of rows (or {{\"data\": [...]}}), "
                     f"got {type(data).__name__}; use .jsonl for one row per line")
  for i, row in enumerate(data, start=1):
    yield i, row, None


def _read_parquet(path: pathlib.Path) -> Iterator[_Read]:
  import pyarrow  # Imported lazily: only Parquet users pay for it.
  import pyarrow.parquet as pq
  if path.stat().st_size == 0:
    return  # A 0-byte file holds no rows; _load_rows reports it (pyarrow's error would not).
  row_no = 0
  try:
    batches = pq.ParquetFile(path).iter_batches(batch_size=4096)
    for batch in batches:
      for row in batch.to_pylist():
        row_no += 1
        yield row_no, row, None
  except (pyarrow.ArrowException, OSError) as e:
    raise DataError(path=path, message=f"corrupt or truncated Parquet after row {row_no} "
                    f"({type(e).__name__}: {e})") from e


def _read_csv(path: pathlib.Path) -> Iterator[_Read]:
  """A CSV file with a header row (GPQA's release format); row 1 is the first data row.
  Cells are strings; an empty cell is None, as Parquet pads a missing value."""
  import csv
  try:
    with open(path, newline="", encoding="utf-8-sig") as f:
      reader = csv.DictReader(f)
      for row_no, row in enumerate(reader, start=1):
        if None in row:   # more cells than the header names
          yield row_no, None, RowError(str(path), row_no, "row", None,
                                       f"{len(row[None])} cell(s) more than the header's "
                                       f"{len(reader.fieldnames or ())} columns")
          continue
        yield row_no, {k: (v if v != "" else None) for k, v in row.items()}, None
  except UnicodeDecodeError as e:
    raise DataError(path=path, message=f"not UTF-8 ({e.reason} at byte {e.start})") from None
  except csv.Error as e:
    raise DataError(path=path, message=f"malformed CSV ({e})") from e


_READERS: dict[str, tuple[Callable[[pathlib.Path], Iterator[_Read]], str]] = {
    ".jsonl": (_read_jsonl, "line"),
    ".jsonl.gz": (_read_jsonl, "line"),
    ".json": (_read_json_array, "row"),
    ".parquet": (_read_parquet, "row"),
}


# CSV only where a layout names its columns (`load_rows`: GPQA's release format); a math
# file of unknown columns read as CSV would give every cell as text, ids and answers alike.
_READERS_WITH_CSV = {**_READERS, ".csv": (_read_csv, "row")}


def _reader_for(path: pathlib.Path, readers=None):
  readers = _READERS if readers is None else readers
  name = path.name.lower()
  for suffix in sorted(readers, key=len, reverse=True):
    if name.endswith(suffix):
      return readers[suffix]
  raise ValueError(f"{path}: unknown file type; expected one of {sorted(readers)}")


def _as_paths(paths: PathLike | Sequence[PathLike]) -> list[pathlib.Path]:
  if isinstance(paths, (str, os.PathLike)):
    paths = [paths]
  out = [pathlib.Path(p) for p in paths]
  if not out:
    raise ValueError("no data files given")
  for p in out:
    if not p.is_file():
      raise FileNotFoundError(f"data file not found: {p}")
  return out


def _uid_prefixes(paths: Sequence[pathlib.Path]) -> dict[pathlib.Path, str]:
  """Default uids are `<file stem>:<row>`; files that share a stem (aime24/test.jsonl,
  aime25/test.jsonl) get their path below the common parent instead (with its suffix
  where that is what tells them apart: a.jsonl, a.parquet), so that their rows do not
  share uids. Paths are not resolved: a symlink (a hub cache) keeps its own name."""
  counts = collections.Counter(p.stem for p in paths)
  if max(counts.values()) == 1:
    return {p: p.stem for p in paths}
  absolute = [pathlib.Path(os.path.abspath(p)) for p in paths]
  common = pathlib.Path(os.path.commonpath([a.parent for a in absolute]))
  rel = {p: a.relative_to(common) for p, a in zip(paths, absolute)}
  out = {p: str(rel[p].with_name(p.stem)) if counts[p.stem] > 1 else p.stem for p in paths}
  clash = collections.Counter(out.values())
  return {p: str(rel[p]) if clash[v] > 1 else v for p, v in out.items()}


def load_rows(paths: PathLike | Sequence[PathLike],
              parse: Callable[[dict, str, pathlib.Path, int], T], *, on_error: str = "raise",
              max_reported: int = 5, what: str = "data") -> LoadResult[T]:
  """Every row of every file (JSONL, JSON, Parquet, and CSV with a header row) through
  `parse(row, default_uid, path, row_no)`, which raises `FieldError` on a bad row: the
  loader for a layout of one's own, with the same errors (file, row, field) and
  `on_error` as `load_math_problems`."""
  return _load_rows(paths, parse, on_error, max_reported, what, readers=_READERS_WITH_CSV)


def _load_rows(paths: PathLike | Sequence[PathLike],
               parse: Callable[[dict, str, pathlib.Path, int], T],
               on_error: str, max_reported: int, what: str, readers=None) -> LoadResult[T]:
  """Runs `parse(row, default_uid, path, row_no)` over every row of every file."""
  if on_error not in ON_ERROR:
    raise ValueError(f"on_error={on_error!r}; choose from {ON_ERROR}")
  items: list[T] = []
  errors: list[RowError] = []
  num_rows = num_skipped = 0
  paths = _as_paths(paths)
  prefix = _uid_prefixes(paths)
  for path in paths:
    reader, unit = _reader_for(path, readers)
    rows_before = num_rows
    for row_no, row, error in reader(path):
      num_rows += 1
      if error is None and not isinstance(row, dict):
        error = RowError(str(path), row_no, unit, None,
                         f"a row must be a JSON object, got {type(row).__name__}")
      if error is None:
        try:
          items.append(parse(row, f"{prefix[path]}:{row_no}", path, row_no))
          continue
        except FieldError as e:
          error = RowError(str(path), row_no, unit, e.field, e.message)
      if on_error == "raise":
        raise DataError(error)
      num_skipped += 1
      if len(errors) < max_reported:
        errors.append(error)
    if num_rows == rows_before:
      # Raised in "skip" mode too: an empty file is a wrong path or a failed export, not a
      # bad row, and loading nothing from it silently would hide that.
      raise DataError(path=path, message=f"no rows: the file is empty or holds only blank "
                                         f"lines ({what})")
  result = LoadResult(tuple(items), num_rows, num_skipped, tuple(errors))
  if num_skipped:
    logging.warning("%s: %s", what, result.summary())
  return result


# --------------------------------------------------------------------------------------
# Field helpers.


def _text_field(value: Any, field: str, *, what: str = "text") -> str:
  if not isinstance(value, str):
    raise FieldError(field, f"{what} must be a string, got {type(value).__name__} {value!r:.60}")
  if not value.strip():
    raise FieldError(field, f"empty {what}")
  return value.strip()


def _answer_field(value: Any, field: str) -> str:
  """Answers are strings or numbers (AIME files often store ints)."""
  if isinstance(value, bool) or value is None:
    raise FieldError(field, f"answer must be a string or a number, got {value!r}")
  if isinstance(value, int):
    return str(value)
  if isinstance(value, float):
    if not math.isfinite(value):
      raise FieldError(field, f"answer is {value} (a missing value?)")
    if not value.is_integer():
      # Positional: repr gives "5e-05", which no math verifier matches against "0.00005".
      return format(decimal.Decimal(repr(value)), "f")
    mantissa = repr(abs(value)).split("e")[0].replace(".", "").strip("0")
    if abs(value) > 2**53 and len(mantissa) > 15:
      # 12345678901234567890.0 is stored as ...7168: the file's digits are lost already.
      # A float of at most 15 significant digits (1e20) reads back as what was written.
      raise FieldError(field, f"answer {value!r} is a float above 2**53 with more digits than "
                              "a float holds; store it as an integer or a string")
    return str(int(value))
  if not isinstance(value, str):
    raise FieldError(field, f"answer must be a string or a number, got {type(value).__name__}")
  if not value.strip():
    raise FieldError(field, "empty answer")
  return value.strip()


# For layouts defined elsewhere (rstar_jax/eval/benchmarks.py): the same checks and messages.
text_field, answer_field = _text_field, _answer_field


def _first_key(row: Mapping[str, Any], keys: Sequence[str]) -> str | None:
  """The first of `keys` present in `row` with a non-None value (Parquet pads with None)."""
  for key in keys:
    if row.get(key) is not None:
      return key
  return None


_ID_KEYS = ("id", "ID", "uid", "unique_id", "problem_id", "idx")


def _uid(row: Mapping[str, Any], default: str) -> str:
  key = _first_key(row, _ID_KEYS)
  if key is not None:
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, (str, int)):
      raise FieldError(key, f"id must be a string or an int, got {type(value).__name__}")
    return _nonempty_id(value, key)
  extra = row.get("extra_info")
  if isinstance(extra, dict) and isinstance(extra.get("index"), (str, int)):
    return _nonempty_id(extra["index"], "extra_info.index")
  return default


def _nonempty_id(value: str | int, field: str) -> str:
  # Refused here: an empty uid was only refused by the evaluation, after all generation.
  if not str(value).strip():
    raise FieldError(field, f"empty id {value!r}")
  return str(value)


def _id_field(row: Mapping[str, Any]) -> str | None:
  """The field `_uid` took a row's id from."""
  key = _first_key(row, _ID_KEYS)
  if key is None and isinstance(row.get("extra_info"), dict):
    key = "extra_info.index"
  return key


def _source(row: Mapping[str, Any], path: pathlib.Path) -> str:
  for key in ("data_source", "source"):
    if row.get(key) is not None:
      if not isinstance(row[key], str):
        raise FieldError(key, f"must be a string, got {type(row[key]).__name__}")
      return row[key]
  return path.stem


# DAPO-Math-17k wraps every problem in an "Answer:" instruction; see the module docstring.
_DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response "
                "should be of the form Answer: $Answer (without quotes) where $Answer is the "
                "answer to the problem.")
_DAPO_SUFFIX = 'Remember to put your answer on its own line after "Answer:".'


def strip_answer_instructions(text: str) -> str:
  """Removes DAPO-Math-17k's answer-format wrapper, if present."""
  stripped = text.strip()
  if stripped.startswith(_DAPO_PREFIX):
    stripped = stripped[len(_DAPO_PREFIX):]
  if stripped.endswith(_DAPO_SUFFIX):
    stripped = stripped[:-len(_DAPO_SUFFIX)]
  return stripped.strip()


# --------------------------------------------------------------------------------------
# Math layouts (a registry, so a new public layout is one decorated function).

MathRowParser = Callable[[dict, str, pathlib.Path], MathProblem]
_LAYOUTS: Registry = Registry("math data layout", error=KeyError, hint=" (or 'auto')")


register_layout = _LAYOUTS.register   # fn(row, default_uid, path) -> MathProblem
get_layout = _LAYOUTS.lookup


def _prompt_text(prompt: Any) -> str:
  """The problem text of a verl `prompt`: a string or a list with one user message."""
  if isinstance(prompt, str):
    return _text_field(prompt, "prompt", what="problem")
  if not isinstance(prompt, list):
    raise FieldError("prompt", f"must be a list of chat messages or a string, "
                               f"got {type(prompt).__name__}")
  users = []
  for i, message in enumerate(prompt):
    if not isinstance(message, dict):
      raise FieldError(f"prompt[{i}]", f"a message must be an object, got {type(message).__name__}")
    if not isinstance(message.get("role"), str):
      raise FieldError(f"prompt[{i}].role", f"missing or not a string: {message.get('role')!r}")
    if message["role"] == "user":
      users.append(_text_field(message.get("content"), f"prompt[{i}].content", what="problem"))
  if len(users) != 1:
    raise FieldError("prompt", f"expected exactly one user message, found {len(users)}")
  return users[0]


@register_layout("verl")
def _parse_verl(row: dict, default_uid: str, path: pathlib.Path) -> MathProblem:
  if "prompt" not in row or row["prompt"] is None:
    raise FieldError("prompt", "missing")
  text = _prompt_text(row["prompt"])
  reward_model = row.get("reward_model")
  if not isinstance(reward_model, dict):
    raise FieldError("reward_model", "missing or not an object with a 'ground_truth'")
  if reward_model.get("ground_truth") is None:
    raise FieldError("reward_model.ground_truth", "missing")
  answer = _answer_field(reward_model["ground_truth"], "reward_model.ground_truth")
  meta = {k: v for k, v in row.items() if k not in ("prompt", "reward_model")}
  meta["reward_style"] = reward_model.get("style")
  if isinstance(row["prompt"], list):
    system = [m.get("content") for m in row["prompt"] if m.get("role") == "system"]
    if system:
      meta["system"] = system[0]
  return MathProblem(_uid(row, default_uid), text, answer, _source(row, path), meta)


_PROBLEM_KEYS = ("problem", "Problem", "question", "Question", "prompt")
_ANSWER_KEYS = ("answer", "Answer", "final_answer", "ground_truth")
_SOLUTION_KEYS = ("solution", "Solution")


@register_layout("problem")
def _parse_problem(row: dict, default_uid: str, path: pathlib.Path) -> MathProblem:
  problem_key = _first_key(row, _PROBLEM_KEYS)
  if problem_key is None:
    raise FieldError("problem", f"missing: none of {list(_PROBLEM_KEYS)} present "
                                f"(row keys: {sorted(row)})")
  text = _text_field(row[problem_key], problem_key, what="problem")
  answer_key = _first_key(row, _ANSWER_KEYS)
  if answer_key is not None:
    answer = _answer_field(row[answer_key], answer_key)
  else:
    solution_key = _first_key(row, _SOLUTION_KEYS)
    if solution_key is None:
      raise FieldError("answer", f"missing: none of {list(_ANSWER_KEYS + _SOLUTION_KEYS)} present "
                                 f"(row keys: {sorted(row)})")
    solution = _text_field(row[solution_key], solution_key, what="solution")
    boxed = extract_boxed(solution)
    if boxed is None:
      raise FieldError(solution_key, "no answer field and no \\boxed{...} in the solution")
    if not boxed:
      raise FieldError(solution_key, "empty answer (\\boxed{} is empty)")
    answer = boxed
  meta = {k: v for k, v in row.items() if k not in (problem_key, answer_key)}
  return MathProblem(_uid(row, default_uid), text, answer, _source(row, path), meta)


def _detect_layout(row: dict) -> MathRowParser:
  # A verl row is recognised by its reward_model; everything else is a plain row.
  return _LAYOUTS["verl"] if "reward_model" in row else _LAYOUTS["problem"]


def load_math_problems(paths: PathLike | Sequence[PathLike], *, layout: str = "auto",
                       on_error: str = "raise", strip_instructions: bool = True,
                       max_reported: int = 5, prefix_clashing_ids: bool = False
                       ) -> LoadResult[MathProblem]:
  """Loads math problems from JSONL / JSON / Parquet files.

  Within one file, an id (`id`, `extra_info.index`, ...) that an earlier row gave to
  another problem is a malformed row naming both rows; a repeated copy of the same
  problem is kept (`deduplicate` drops it).

  Args:
    paths: one file or several (their rows are concatenated in order).
    layout: "auto" (per row: verl if it has `reward_model`, else plain), or a
      registered layout name ("verl", "problem").
    on_error: "raise" stops at the first malformed row with a `DataError`; "skip"
      skips such rows, counts them and reports the first `max_reported` reasons.
    strip_instructions: remove DAPO's "Answer:" instruction wrapper from problems.
    max_reported: how many skip reasons to keep (all are counted).
    prefix_clashing_ids: when files share ids taken from their rows (verl numbers
      `extra_info.index` from 0 in every file), every row id of those files becomes
      `<file prefix>:<id>`, the prefix of the default uids `<file prefix>:<row>`.

  Returns:
    A `LoadResult` whose `items` are `MathProblem`s.
  """
  fixed = None if layout == "auto" else get_layout(layout)
  paths = _as_paths(paths)
  ids_seen: dict[pathlib.Path, dict[str, tuple[int, MathProblem]]] = collections.defaultdict(dict)
  origins: list[tuple[pathlib.Path, bool]] = []   # per item: its file, whether its row named it

  def parse(row: dict, default_uid: str, path: pathlib.Path, row_no: int) -> MathProblem:
    problem = (fixed or _detect_layout(row))(row, default_uid, path)
    if strip_instructions:
      text = strip_answer_instructions(problem.problem)
      if not text:
        raise FieldError("problem", "empty problem once the answer instructions are removed")
      if text != problem.problem:
        problem = dataclasses.replace(problem, problem=text)
    from_row = problem.uid != default_uid
    if from_row:
      first = ids_seen[path].setdefault(problem.uid, (row_no, problem))
      if (first[0] != row_no and normalise_problem_text(first[1].problem)
          != normalise_problem_text(problem.problem)):
        raise FieldError(_id_field(row), f"duplicate id {problem.uid!r}: {_reader_for(path)[1]} "
                                         f"{first[0]} has it for another problem")
    origins.append((path, from_row))   # appended last: one per item of the result
    return problem

  result = _load_rows(paths, parse, on_error, max_reported, "math data")
  if prefix_clashing_ids:
    result = _prefix_clashing_ids(result, origins, _uid_prefixes(paths))
  return result


def _prefix_clashing_ids(result: LoadResult[MathProblem], origins: list[tuple[pathlib.Path, bool]],
                         prefixes: Mapping[pathlib.Path, str]) -> LoadResult[MathProblem]:
  files_of: dict[str, set[pathlib.Path]] = collections.defaultdict(set)
  for item, (path, from_row) in zip(result.items, origins, strict=True):
    if from_row:
      files_of[item.uid].add(path)
  # All ids of a file that shares any, so that one file's uids all look alike.
  clashing = {p for files in files_of.values() if len(files) > 1 for p in files}
  if not clashing:
    return result
  logging.info("math data: files %s share row ids; their uids are now <file>:<id>",
               sorted(prefixes[p] for p in clashing))
  items = tuple(dataclasses.replace(item, uid=f"{prefixes[path]}:{item.uid}")
                if from_row and path in clashing else item
                for item, (path, from_row) in zip(result.items, origins, strict=True))
  return dataclasses.replace(result, items=items)


# --------------------------------------------------------------------------------------
# Filters.

def filter_integer_answers(problems: Iterable[MathProblem]
                           ) -> tuple[list[MathProblem], list[MathProblem]]:
  """Keeps problems with integer answers (rStar2's RL data rule). Returns (kept, dropped).

  "Integer answer" is `rstar_jax.answers.parse_integer`: an integer literal after light
  normalisation ("42", "-7", "1,000", "$12$", "\\boxed{5}", "x = 4"); "1/2", "\\sqrt{2}",
  "3.5", "12.0" are dropped.

  Kept answers are rewritten in canonical form ("1,000" -> "1000") so the reward can
  compare strictly; the original text goes to `meta["raw_answer"]` when it differs.
  """
  kept, dropped = [], []
  for problem in problems:
    value = parse_integer(problem.answer)
    if value is None:
      dropped.append(problem)
      continue
    canonical = str(value)
    if canonical != problem.answer:
      problem = dataclasses.replace(problem, answer=canonical,
                                    meta={**problem.meta, "raw_answer": problem.answer})
    kept.append(problem)
  return kept, dropped


def normalise_problem_text(text: str) -> str:
  """The key used for de-duplication: NFKC, case-folded, whitespace collapsed."""
  return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def deduplicate(problems: Iterable[MathProblem]) -> tuple[list[MathProblem], list[MathProblem]]:
  """Drops problems whose normalised text was seen before. Returns (kept, duplicates).

  The first occurrence is kept. Duplicates whose answer differs from the kept one are
  logged: they usually reveal a labelling error in one of the sources.
  """
  first: dict[str, MathProblem] = {}
  kept, duplicates = [], []
  conflicts = 0
  for problem in problems:
    key = normalise_problem_text(problem.problem)
    if key in first:
      duplicates.append(problem)
      if problem.answer != first[key].answer:
        conflicts += 1
        if conflicts <= 3:
          logging.warning("duplicate problem %s (of %s) has a different answer: %r vs %r",
                          problem.uid, first[key].uid, problem.answer, first[key].answer)
      continue
    first[key] = problem
    kept.append(problem)
  if conflicts:
    logging.warning("%d duplicate problems had an answer different from the kept copy", conflicts)
  return kept, duplicates


def check_unique_uids(items: Sequence[Any]) -> None:
  """Raises if two items share a `uid` (per-problem statistics would merge them)."""
  seen: dict[str, int] = {}
  clashes = []
  for i, item in enumerate(items):
    uid = item.uid
    if uid in seen:
      clashes.append(f"{uid!r} (items {seen[uid]} and {i})")
    else:
      seen[uid] = i
  if clashes:
    raise ValueError(f"{len(clashes)} duplicate uid(s), e.g. {', '.join(clashes[:3])}; "
                     "run deduplicate() or give the rows distinct ids")


def split_problems(problems: Sequence[T], *, held_out: int | float, seed: int
                   ) -> tuple[list[T], list[T]]:
  """A seeded random split into (train, held_out).

  Args:
    held_out: a count (int) or a fraction in (0, 1) (float) of the problems.
  """
  n = len(problems)
  if isinstance(held_out, bool) or not isinstance(held_out, (int, float)):
    raise TypeError(f"held_out must be an int count or a float fraction, got {held_out!r}")
  if isinstance(held_out, float):
    if not 0.0 < held_out < 1.0:
      raise ValueError(f"held_out fraction must be in (0, 1), got {held_out}")
    count = int(round(held_out * n))
  else:
    count = held_out
  if not 0 <= count <= n:
    raise ValueError(f"held_out={held_out} asks for {count} of {n} problems")
  order = np.random.default_rng(seed).permutation(n)
  held = sorted(order[:count].tolist())
  train = sorted(order[count:].tolist())
  # Sorted indices keep the file order inside each part: easier to inspect.
  return [problems[i] for i in train], [problems[i] for i in held]


# --------------------------------------------------------------------------------------
# Resumable iteration.


def _fingerprint_v1(items: Sequence[Any]) -> str:
  """The fingerprint of iterator states version 1 (uids only)."""
  h = hashlib.sha1()
  for item in items:
    key = getattr(item, "uid", None)
    h.update((key if isinstance(key, str) else repr(item)).encode("utf-8"))
    h.update(b"\0")
  return h.hexdigest()[:16]


def _fingerprint(items: Sequence[Any]) -> str:
  # Text and answer too, not the uid alone: default uids are `<stem>:<row>`, so a file
  # rewritten in another order kept every uid and a resumed run repeated and skipped rows.
  h = hashlib.sha1()
  for item in items:
    key = getattr(item, "uid", None)
    if isinstance(key, str):
      key = (key, getattr(item, "problem", None), getattr(item, "answer", None))
    h.update(repr(key if key is not None else item).encode("utf-8"))   # repr: no surrogates
    h.update(b"\0")
  return h.hexdigest()[:16]


class EpochIterator(Generic[T]):
  """Yields batches of `batch_size` items; a fresh seeded shuffle every epoch.

  Epoch `e` uses the order `default_rng([seed, e]).permutation(n)`: a function of
  (seed, epoch) only, so `state()` is a handful of ints and `restore()` continues on
  the exact next batch, across epoch boundaries too. (Seeding with the pair rather
  than `seed + epoch` keeps runs with neighbouring seeds from sharing orders.)

  With `drop_remainder=True` (default) every batch is full and the last
  `n % batch_size` items of each epoch's order sit that epoch out (different
  ones each epoch); with False the last batch of an epoch is short.
  `num_epochs=None` iterates forever.
  """

  # 2: the fingerprint covers problem and answer too (version 1: uids only, still read).
  _STATE_VERSION = 2

  def __init__(self, items: Sequence[T], *, batch_size: int, seed: int = 0,
               drop_remainder: bool = True, num_epochs: int | None = None):
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
      raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
      raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if num_epochs is not None and (not isinstance(num_epochs, int) or num_epochs <= 0):
      raise ValueError(f"num_epochs must be a positive int or None, got {num_epochs!r}")
    if not items:
      raise ValueError("EpochIterator needs at least one item")
    if drop_remainder and batch_size > len(items):
      raise ValueError(f"batch_size {batch_size} > {len(items)} items: with drop_remainder=True "
                       "no full batch exists; lower the batch size or pass drop_remainder=False")
    if items and hasattr(items[0], "uid"):
      check_unique_uids(items)
    self._items = list(items)
    self._batch_size = batch_size
    self._seed = seed
    self._drop_remainder = drop_remainder
    self._num_epochs = num_epochs
    self._fingerprint = _fingerprint(self._items)
    self._epoch = 0
    self._position = 0
    self._order_epoch = -1
    self._order = np.zeros(0, np.int64)

  @property
  def epoch(self) -> int:
    return self._epoch

  @property
  def batches_per_epoch(self) -> int:
    n, b = len(self._items), self._batch_size
    return n // b if self._drop_remainder else -(-n // b)

  def _epoch_order(self) -> np.ndarray:
    if self._order_epoch != self._epoch:
      rng = np.random.default_rng([self._seed, self._epoch])
      self._order = rng.permutation(len(self._items))
      self._order_epoch = self._epoch
    return self._order

  def __iter__(self) -> EpochIterator[T]:
    return self

  def __next__(self) -> list[T]:
    if self._num_epochs is not None and self._epoch >= self._num_epochs:
      raise StopIteration
    order = self._epoch_order()
    take = order[self._position:self._position + self._batch_size]
    batch = [self._items[i] for i in take]
    self._position += len(take)
    # Move to the next epoch as soon as no further batch fits, so that state() taken
    # after an epoch's last batch already points at the next epoch.
    smallest = self._batch_size if self._drop_remainder else 1
    if len(self._items) - self._position < smallest:
      self._epoch += 1
      self._position = 0
    return batch

  def state(self) -> dict[str, Any]:
    """A small JSON-serialisable dict; store it in the checkpoint."""
    return {"version": self._STATE_VERSION, "epoch": self._epoch, "position": self._position,
            "seed": self._seed, "batch_size": self._batch_size, "num_items": len(self._items),
            "drop_remainder": self._drop_remainder, "fingerprint": self._fingerprint}

  def restore(self, state: Mapping[str, Any]) -> None:
    """Continues from `state()`; refuses a state saved over different data or settings."""
    expected = self.state()
    missing = [k for k in expected if k not in state]
    if missing:
      raise ValueError(f"iterator state lacks {missing}; got keys {sorted(state)}")
    if state["version"] == 1:
      # Saved before the fingerprint covered text and answers: it is checked the way it was
      # then (uids only), so a run can resume across the upgrade; a reordered file with
      # default uids passes that check, as it did before.
      if state["fingerprint"] != _fingerprint_v1(self._items):
        raise ValueError("iterator state (version 1) was saved over other data: its uids "
                         "differ from these")
      logging.warning("resuming from a version-1 iterator state: only the problems' uids are "
                      "checked against the saved run, not their text")
      state = {**state, "version": self._STATE_VERSION, "fingerprint": self._fingerprint}
    if state["version"] != self._STATE_VERSION:
      raise ValueError(f"iterator state version {state['version']} != {self._STATE_VERSION}")
    for key in ("seed", "batch_size", "num_items", "drop_remainder", "fingerprint"):
      if state[key] != expected[key]:
        raise ValueError(f"iterator state was saved with {key}={state[key]!r} but this iterator "
                         f"has {key}={expected[key]!r}: the data or its settings changed")
    epoch, position = state["epoch"], state["position"]
    if not (isinstance(epoch, int) and epoch >= 0 and isinstance(position, int)
            and 0 <= position < len(self._items)):
      raise ValueError(f"iterator state has an invalid position: epoch={epoch!r}, "
                       f"position={position!r} for {len(self._items)} items")
    self._epoch, self._position = epoch, position


# --------------------------------------------------------------------------------------
# SFT chat data.

SFT_ROLES = ("system", "user", "assistant", "tool")
_MESSAGE_KEYS = frozenset(("role", "content", "tool_calls", "name", "tool_call_id"))


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """A structured tool call of an assistant message."""
  name: str
  arguments: dict = dataclasses.field(hash=False)


@dataclasses.dataclass(frozen=True)
class ChatMessage:
  role: str
  content: str
  tool_calls: tuple[ToolCall, ...] = ()
  name: str | None = None  # optional tool name on tool messages.
  tool_call_id: str | None = None


@dataclasses.dataclass(frozen=True)
class SftExample:
  """One SFT conversation; `meta` keeps the row's other fields (e.g. `tools`)."""
  uid: str
  messages: tuple[ChatMessage, ...]
  meta: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)


def _parse_tool_call(raw: Any, field: str) -> ToolCall:
  """Accepts `{"name", "arguments"}` and OpenAI's `{"type": "function", "function": {...}}`."""
  if not isinstance(raw, dict):
    raise FieldError(field, f"a tool call must be an object, got {type(raw).__name__}")
  if "function" in raw:
    raw, field = raw["function"], f"{field}.function"
    if not isinstance(raw, dict):
      raise FieldError(field, f"must be an object, got {type(raw).__name__}")
  name = raw.get("name")
  if not isinstance(name, str) or not name.strip():
    raise FieldError(f"{field}.name", f"missing or not a non-empty string: {name!r}")
  arguments = raw.get("arguments", {})
  if isinstance(arguments, str):
    try:
      arguments = json.loads(arguments)
    except (ValueError, RecursionError) as e:   # also > 4300 digits, deep nesting
      why = e.msg if isinstance(e, json.JSONDecodeError) else f"{type(e).__name__}: {str(e)[:200]}"
      raise FieldError(f"{field}.arguments", f"not valid JSON ({why})") from None
  if not isinstance(arguments, dict):
    raise FieldError(f"{field}.arguments",
                     f"must be a JSON object, got {type(arguments).__name__}")
  return ToolCall(name, arguments)


def validate_messages(messages: Any, field: str = "messages") -> tuple[ChatMessage, ...]:
  """Checks a chat transcript and returns it as `ChatMessage`s; raises `FieldError`.

  Rules: an optional system message first; then user and assistant alternate, starting
  with a user; an assistant message with `tool_calls` is followed by exactly one tool
  message per call and then by an assistant message. Tool messages may also follow an
  assistant whose content holds literal `<tool_call>` text (the rStar2 wire format),
  then one per `<tool_call>`. The conversation ends with an assistant message that
  makes no call: the last turn is always the model's.
  """
  if not isinstance(messages, list):
    raise FieldError(field, f"must be a list of messages, got {type(messages).__name__}")
  if not messages:
    raise FieldError(field, "empty conversation")
  out: list[ChatMessage] = []
  pending_calls = 0  # tool responses still owed to the last assistant message.
  for i, raw in enumerate(messages):
    where = f"{field}[{i}]"
    if not isinstance(raw, dict):
      raise FieldError(where, f"a message must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _MESSAGE_KEYS)
    if unknown:
      raise FieldError(where, f"unknown key(s) {unknown}; known: {sorted(_MESSAGE_KEYS)}")
    role = raw.get("role")
    if role not in SFT_ROLES:
      raise FieldError(f"{where}.role", f"{role!r} is not one of {list(SFT_ROLES)}")
    raw_calls = raw.get("tool_calls")
    if raw_calls is not None and role != "assistant":
      raise FieldError(f"{where}.tool_calls", f"only assistant messages make tool calls, not {role}")
    if raw_calls is not None and not isinstance(raw_calls, list):
      raise FieldError(f"{where}.tool_calls", f"must be a list, got {type(raw_calls).__name__}")
    calls = tuple(_parse_tool_call(c, f"{where}.tool_calls[{j}]")
                  for j, c in enumerate(raw_calls or []))
    content = raw.get("content")
    if content is None and calls:
      content = ""  # OpenAI style: content may be null when the message only calls tools.
    if not isinstance(content, str):
      raise FieldError(f"{where}.content", f"must be a string, got {type(content).__name__}")
    if not content.strip() and not calls:
      raise FieldError(f"{where}.content", f"empty {role} message")
    for key in ("name", "tool_call_id"):
      if raw.get(key) is not None and not isinstance(raw[key], str):
        raise FieldError(f"{where}.{key}", f"must be a string, got {type(raw[key]).__name__}")

    previous = out[-1].role if out else None
    if role == "system":
      if i != 0:
        raise FieldError(f"{where}.role", "a system message may only come first")
    elif role == "tool":
      if pending_calls == 0:
        raise FieldError(f"{where}.role", "tool message without a pending tool call "
                                          "(it must follow an assistant message that calls a tool)")
      pending_calls -= 1
    else:
      if pending_calls:
        raise FieldError(f"{where}.role", f"{role} message while {pending_calls} tool call(s) of "
                                          "the previous assistant message have no tool response")
      expected = "user" if previous in (None, "system", "assistant") else "assistant"
      if role != expected:
        raise FieldError(f"{where}.role", f"expected a {expected} message after "
                                          f"{previous or 'the start'}, got {role}")
      if role == "assistant":
        pending_calls = len(calls) or content.count("<tool_call>")
    out.append(ChatMessage(role, content, calls, raw.get("name"), raw.get("tool_call_id")))

  if out[-1].role != "assistant" or pending_calls:
    raise FieldError(f"{field}[{len(out) - 1}]",
                     "a conversation must end with an assistant message that calls no tool")
  return tuple(out)


def load_sft_examples(paths: PathLike | Sequence[PathLike], *, on_error: str = "raise",
                      max_reported: int = 5) -> LoadResult[SftExample]:
  """Loads chat-message rows `{"messages": [...], ...}` (JSONL / JSON / Parquet).

  Rows are validated with `validate_messages`; other row fields go to `meta`
  (`tools`, if present, must be a list of objects). Errors name the file, the row
  and the field, e.g. `sft.jsonl, line 7, field 'messages[2].role': ...`.
  """

  def parse(row: dict, default_uid: str, path: pathlib.Path, row_no: int) -> SftExample:
    del path, row_no
    if "messages" not in row:
      raise FieldError("messages", f"missing (row keys: {sorted(row)})")
    messages = validate_messages(row["messages"])
    tools = row.get("tools")
    if tools is not None and (not isinstance(tools, list)
                              or not all(isinstance(t, dict) for t in tools)):
      raise FieldError("tools", "must be a list of tool schema objects")
    meta = {k: v for k, v in row.items() if k != "messages"}
    return SftExample(_uid(row, default_uid), messages, meta)

  return _load_rows(paths, parse, on_error, max_reported, "SFT data")


def role_counts(examples: Iterable[SftExample]) -> dict[str, int]:
  """Messages per role over a corpus: a quick look at what an SFT set teaches."""
  counts: collections.Counter[str] = collections.Counter()
  for example in examples:
    counts.update(m.role for m in example.messages)
  return dict(counts)
