"""A few rows of each registered benchmark in its public dataset's own layout (column
names and types as the hub copies have them), written on the spot: nothing downloaded."""
from __future__ import annotations

import csv
import json
import os

GPQA_COLUMNS = ["Pre-Revision Question", "Question", "Correct Answer", "Incorrect Answer 1",
                "Incorrect Answer 2", "Incorrect Answer 3", "Explanation", "Subdomain",
                "Record ID"]


def _parquet(path: str, rows: list[dict]) -> str:
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.Table.from_pylist(rows), path)
  return path


def _jsonl(path: str, rows: list[dict]) -> str:
  with open(path, "w") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
  return path


def aime24(directory: str, n: int = 3) -> str:
  """HuggingFaceH4/aime_2024: id (int64), problem, solution, answer (string), url, year."""
  rows = [{"id": 60 + i, "problem": f"What is {i + 1} + {i + 2}?", "solution": "Add them.",
           "answer": f"{2 * i + 3:03d}", "url": "https://example.org", "year": "2024"}
          for i in range(n)]
  return _parquet(os.path.join(directory, "aime24.parquet"), rows)


def aime25(directory: str, n: int = 3) -> str:
  """math-ai/aime25 (as assumed): problem, answer, id."""
  rows = [{"problem": f"Compute {i + 2} * 3.", "answer": str(3 * (i + 2)), "id": str(i)}
          for i in range(n)]
  return _jsonl(os.path.join(directory, "aime25.jsonl"), rows)


def hmmt25(directory: str) -> str:
  """MathArena/hmmt_feb_2025: problem_idx (int64), problem, answer (string), problem_type."""
  rows = [{"problem_idx": 1, "problem": "Half of one?", "answer": "\\frac{1}{2}",
           "problem_type": ["Algebra"]},
          {"problem_idx": 2, "problem": "Root of two squared plus one?", "answer": "3",
           "problem_type": ["Algebra", "Number Theory"]}]
  return _parquet(os.path.join(directory, "hmmt25.parquet"), rows)


def math500(directory: str) -> str:
  """HuggingFaceH4/MATH-500: problem, solution, answer, subject, level, unique_id."""
  rows = [{"problem": "Simplify 2/4.", "solution": "It is $\\boxed{\\frac12}$.",
           "answer": "\\frac{1}{2}", "subject": "Prealgebra", "level": 1,
           "unique_id": "test/prealgebra/1.json"},
          {"problem": "What is 7 - 2?", "solution": "$\\boxed{5}$", "answer": "5",
           "subject": "Prealgebra", "level": 1, "unique_id": "test/prealgebra/2.json"}]
  return _jsonl(os.path.join(directory, "math500.jsonl"), rows)


def gpqa_diamond(directory: str, n: int = 3, name: str = "gpqa_diamond.csv") -> str:
  """Idavidrein/gpqa gpqa_diamond.csv: Question, Correct Answer, Incorrect Answer 1..3,
  Record ID and other columns; a cell may hold several lines."""
  path = os.path.join(directory, name)
  with open(path, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(GPQA_COLUMNS)
    for i in range(n):
      w.writerow([f"old {i}", f"Which number is {i}?\nPick one.", f"{i}", f"{i + 1}",
                  f"{i + 2}", f"{i + 3}", "Because.", "Arithmetic", f"rec{i:03d}"])
  return path


WRITERS = {"aime24": aime24, "aime25": aime25, "hmmt25": hmmt25, "math500": math500,
           "gpqa_diamond": gpqa_diamond}
