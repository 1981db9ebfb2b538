"""Reading the JSON-lines files runs write (metrics rows, journals): stdlib only, so the
lightest modules (sweep) can use it."""
from __future__ import annotations

import json


def read_jsonl(path: str) -> list[dict]:
  """Every row of a JSONL file (blank lines skipped; a malformed line raises)."""
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def last_jsonl_row(path: str) -> dict | None:
  """The last whole row of a JSONL file (None if it has none; a half-written last line
  of a killed run is skipped)."""
  last = None
  with open(path) as f:
    for line in f:
      line = line.strip()
      if line:
        try:
          last = json.loads(line)
        except json.JSONDecodeError:
          continue
  return last
