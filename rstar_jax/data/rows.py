"""Rows from data files: the readers, the loader and its errors, the field checks.

Files: `.jsonl` (optionally `.jsonl.gz`), `.json` (an array of rows) and `.parquet`;
`load_rows` reads `.csv` too (GPQA's release format) unless told not to (`csv=False`: a
math file of unknown columns read as CSV would give every cell as text). A malformed row
gives a `DataError` naming the file, the row (1-based line for JSONL, 1-based row for
Parquet and JSON arrays) and the field. With `on_error="skip"` such rows are skipped,
counted and the first few reasons are logged and returned in the `LoadResult`: nothing is
lost silently. A file with no rows at all (empty, only blank lines, `[]`, a 0-row Parquet
table) is a `DataError` naming the file, in both modes.

A row's parser (`parse(row, default_uid, path, row_no)`) raises `FieldError`; the checks
here (`text_field`, `answer_field`, `row_uid`) raise it with the same messages for every
layout: the math problems (`math_problems`), the SFT conversations (`sft_examples`)
and the benchmark layouts (`rstar_jax/eval/benchmarks.py`).
"""
from __future__ import annotations

import collections
import dataclasses
import decimal
import gzip
import json
import math
import os
import pathlib
import zlib
from typing import Any, Callable, Generic, Iterator, Mapping, Sequence, TypeVar

from absl import logging

T = TypeVar("T")
PathLike = str | os.PathLike
ON_ERROR = ("raise", "skip")

# --------------------------------------------------------------------------------------
# Records and errors.


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
  # Case-insensitive, as `reader_for` is: a `.JSONL.GZ` read raw is binary garbage.
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
    return  # No rows; load_rows reports the empty file.
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
    return  # A 0-byte file holds no rows; load_rows reports it (pyarrow's error would not).
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


# CSV only where a layout names its columns (`load_rows(csv=True)`: GPQA's release format); a
# math file of unknown columns read as CSV would give every cell as text, ids and answers alike.
_READERS_WITH_CSV = {**_READERS, ".csv": (_read_csv, "row")}


def reader_for(path: pathlib.Path, readers=None):
  readers = _READERS if readers is None else readers
  name = path.name.lower()
  for suffix in sorted(readers, key=len, reverse=True):
    if name.endswith(suffix):
      return readers[suffix]
  raise ValueError(f"{path}: unknown file type; expected one of {sorted(readers)}")


def as_paths(paths: PathLike | Sequence[PathLike]) -> list[pathlib.Path]:
  if isinstance(paths, (str, os.PathLike)):
    paths = [paths]
  out = [pathlib.Path(p) for p in paths]
  if not out:
    raise ValueError("no data files given")
  for p in out:
    if not p.is_file():
      raise FileNotFoundError(f"data file not found: {p}")
  return out


def uid_prefixes(paths: Sequence[pathlib.Path]) -> dict[pathlib.Path, str]:
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
              max_reported: int = 5, what: str = "data", csv: bool = True) -> LoadResult[T]:
  """Every row of every file (JSONL, JSON, Parquet, and with `csv` CSV with a header row)
  through `parse(row, default_uid, path, row_no)`, which raises `FieldError` on a bad row:
  the loader of every layout (`load_math_problems`, `load_sft_examples`, the benchmarks'
  own), with the same errors (file, row, field) and `on_error`.

  `csv=False` where a layout does not name its columns: its file read as CSV would give
  every cell as text, ids and answers alike. `what` names the data in messages."""
  if on_error not in ON_ERROR:
    raise ValueError(f"on_error={on_error!r}; choose from {ON_ERROR}")
  items: list[T] = []
  errors: list[RowError] = []
  num_rows = num_skipped = 0
  readers = _READERS_WITH_CSV if csv else _READERS
  paths = as_paths(paths)
  prefix = uid_prefixes(paths)
  for path in paths:
    reader, unit = reader_for(path, readers)
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


def text_field(value: Any, field: str, *, what: str = "text") -> str:
  if not isinstance(value, str):
    raise FieldError(field, f"{what} must be a string, got {type(value).__name__} {value!r:.60}")
  if not value.strip():
    raise FieldError(field, f"empty {what}")
  return value.strip()


def answer_field(value: Any, field: str) -> str:
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


def first_key(row: Mapping[str, Any], keys: Sequence[str]) -> str | None:
  """The first of `keys` present in `row` with a non-None value (Parquet pads with None)."""
  for key in keys:
    if row.get(key) is not None:
      return key
  return None


_ID_KEYS = ("id", "ID", "uid", "unique_id", "problem_id", "idx")


def row_uid(row: Mapping[str, Any], default: str) -> str:
  key = first_key(row, _ID_KEYS)
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


def id_field(row: Mapping[str, Any]) -> str | None:
  """The field `_uid` took a row's id from."""
  key = first_key(row, _ID_KEYS)
  if key is None and isinstance(row.get("extra_info"), dict):
    key = "extra_info.index"
  return key

