r"""Named evaluation benchmarks as data: file layout, answer type, the report's figure.

Each entry of `REGISTRY` says which columns a local copy of the public dataset has (its
own column names; no hub access is assumed: users point the name at a file), how its
answers are graded, and what rStar2-Agent-14B scored on it in the report (arXiv
2508.20722: Table 3 for MATH-500 / AIME24 / AIME25 / HMMT Feb. 25, Table 5 for
GPQA-Diamond, Table 4 for the average response lengths, given for AIME24 and AIME25 only).

Columns, as the public datasets spell them (where a benchmark circulates in several
layouts, each accepted spelling is listed, the first being the one named):

* `aime24`: HuggingFaceH4/aime_2024 (`id`, `problem`, `solution`, `answer`, `url`, `year`;
  the release's `data_preprocess/aime2024_rstar2_agent_loop.py` reads `problem` and
  `answer`); Maxwell-Jia/AIME_2024's `ID` / `Problem` / `Answer` are accepted too.
* `aime25`: math-ai/aime25 (`problem`, `answer`, `id`, as assumed: its card was not
  reachable here); opencompass/AIME2025's `question` / `answer` (what the release's
  preprocessing reads) and `Problem` / `Answer` are accepted too.
* `hmmt25`: MathArena/hmmt_feb_2025 (`problem_idx`, `problem`, `answer`, `problem_type`).
* `math500`: HuggingFaceH4/MATH-500 (`problem`, `solution`, `answer`, `subject`, `level`,
  `unique_id`).
* `gpqa_diamond`: Idavidrein/gpqa, config gpqa_diamond (`Question`, `Correct Answer`,
  `Incorrect Answer 1` .. `3`, `Record ID`, ...; distributed as CSV).

Answer types: "integer" (strict integer comparison, `rl.rewards`: the reference must be
an integer, checked at load), "math" (`rl.rewards.compute_reward`: integers strictly,
anything else through math-verify) and "choice" (`answers.choice_letter`, strict: see
there). Multiple-choice questions are shown with their options in a seeded per-question
order (`option_order`): stable across runs and machines, and reversible (`unshuffle`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
from typing import Any, Mapping, Sequence

from rstar_jax import answers
from rstar_jax.data import math_problems, rows
from rstar_jax.rl import rewards

ANSWER_TYPES = ("integer", "math", "choice")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Benchmark:
  """One benchmark: where its fields are in a file, how it is graded, what the report says.

  Attributes:
    name: the name users give (`--benchmarks aime24=/path/aime24.parquet`).
    title: as the report's tables name it.
    answer_type: one of ANSWER_TYPES.
    columns: role -> accepted column names (first: the public dataset's). Roles:
      "problem" and "answer" (integer, math); "question", "correct", "incorrect_1" ..
      "incorrect_3" (choice). None: a local file in any layout `load_math_problems` reads.
    id_columns: columns that name a row (first present wins), else `<file stem>:<row>`.
    dataset: the public dataset the layout is taken from.
    num_problems: its size (a file of another size is loaded with a warning in the table).
    report_pass_at_1: rStar2-Agent-14B's average pass@1 in the report, percent.
    report_response_tokens: its average response length in tokens (report Table 4).
    report_source: where in the report the figures are.
  """
  name: str
  title: str
  answer_type: str
  columns: Mapping[str, tuple[str, ...]] | None = None
  id_columns: tuple[str, ...] = ()
  dataset: str = ""
  num_problems: int | None = None
  report_pass_at_1: float | None = None
  report_response_tokens: float | None = None
  report_source: str = ""

  def __post_init__(self):
    if self.answer_type not in ANSWER_TYPES:
      raise ValueError(f"Benchmark {self.name}: answer_type={self.answer_type!r}; choose from "
                       f"{ANSWER_TYPES}")
    if self.columns is not None:
      need = (("question", "correct", *INCORRECT) if self.answer_type == "choice"
              else ("problem", "answer"))
      missing = [r for r in need if not self.columns.get(r)]
      if missing:
        raise ValueError(f"Benchmark {self.name}: columns lack roles {missing}")

  @property
  def num_options(self) -> int:
    return 1 + len(INCORRECT) if self.answer_type == "choice" else 0

  def layout(self) -> str:
    """The expected file layout, in words (for errors and the docs)."""
    if self.columns is None:
      return ("a JSONL / JSON / Parquet math file in any layout "
              "rstar_jax.data.math_problems.load_math_problems reads")
    roles = ", ".join(f"{role}: {' or '.join(repr(c) for c in cols)}"
                      for role, cols in self.columns.items())
    where = f" ({self.dataset})" if self.dataset else ""
    return f"a JSONL / JSON / Parquet / CSV file{where} with columns {roles}"


INCORRECT = ("incorrect_1", "incorrect_2", "incorrect_3")
_MATH_COLUMNS = {"problem": ("problem", "Problem", "question"), "answer": ("answer", "Answer")}
_REPORT = "arXiv 2508.20722"

REGISTRY: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark(name="aime24", title="AIME24", answer_type="integer", columns=_MATH_COLUMNS,
              id_columns=("id", "ID"), dataset="HuggingFaceH4/aime_2024", num_problems=30,
              report_pass_at_1=80.6, report_response_tokens=9339.7,
              report_source=f"{_REPORT} Table 3 (pass@1), Table 4 (length)"),
    Benchmark(name="aime25", title="AIME25", answer_type="integer", columns=_MATH_COLUMNS,
              id_columns=("id", "ID"), dataset="math-ai/aime25", num_problems=30,
              report_pass_at_1=69.8, report_response_tokens=10943.4,
              report_source=f"{_REPORT} Table 3 (pass@1), Table 4 (length)"),
    Benchmark(name="hmmt25", title="HMMT Feb. 25", answer_type="math", columns=_MATH_COLUMNS,
              id_columns=("problem_idx", "id"), dataset="MathArena/hmmt_feb_2025",
              num_problems=30, report_pass_at_1=52.7, report_source=f"{_REPORT} Table 3"),
    Benchmark(name="math500", title="MATH-500", answer_type="math", columns=_MATH_COLUMNS,
              id_columns=("unique_id", "id"), dataset="HuggingFaceH4/MATH-500",
              num_problems=500, report_pass_at_1=97.8, report_source=f"{_REPORT} Table 3"),
    Benchmark(name="gpqa_diamond", title="GPQA-Diamond", answer_type="choice",
              columns={"question": ("Question",), "correct": ("Correct Answer",),
                       "incorrect_1": ("Incorrect Answer 1",),
                       "incorrect_2": ("Incorrect Answer 2",),
                       "incorrect_3": ("Incorrect Answer 3",)},
              id_columns=("Record ID",), dataset="Idavidrein/gpqa (gpqa_diamond)",
              num_problems=198, report_pass_at_1=60.9, report_source=f"{_REPORT} Table 5"),
)}
# The report's table, in its order.
REPORT_SUITE = ("aime24", "aime25", "hmmt25", "math500", "gpqa_diamond")


class BenchmarkError(ValueError):
  """A benchmark's file is missing or broken; the message names the benchmark."""


def get(name: str) -> Benchmark:
  """The registered benchmark `name`, or a local math file's entry (graded as "math",
  no report figure) for any other name."""
  if name in REGISTRY:
    return REGISTRY[name]
  if not name or not name.replace("_", "").replace("-", "").isalnum():
    raise BenchmarkError(f"benchmark name {name!r}: use letters, digits, '_' and '-' "
                         f"(registered: {sorted(REGISTRY)})")
  return Benchmark(name=name, title=name, answer_type="math")


def parse_spec(items: Sequence[str]) -> list[tuple[Benchmark, str]]:
  """`["aime24=/p/a.jsonl", "math500=/p/m.parquet"]` -> [(Benchmark, path)]."""
  out, seen = [], set()
  for item in items:
    name, sep, path = item.partition("=")
    name, path = name.strip(), path.strip()
    if not sep or not name or not path:
      raise BenchmarkError(f"--benchmarks: {item!r} is not NAME=PATH (e.g. "
                           f"aime24=/data/aime24.parquet)")
    if name in seen:
      raise BenchmarkError(f"--benchmarks: {name} given twice")
    seen.add(name)
    out.append((get(name), path))
  return out


# ---- multiple choice -------------------------------------------------------------------
def option_order(num_options: int, key: str, seed: int) -> list[int]:
  """The order options are shown in: position i shows original option `order[i]`.

  Each position's rank is a SHA-256 of (seed, key, option index): a uniformly random
  permutation per question that is the same on every run, machine and library version
  (no RNG stream involved), and another for another seed."""
  def rank(i: int) -> bytes:
    return hashlib.sha256(f"{seed}\x00{key}\x00{i}".encode("utf-8")).digest()
  return sorted(range(num_options), key=rank)


def shuffle(options: Sequence[Any], order: Sequence[int]) -> list[Any]:
  return [options[j] for j in order]


def unshuffle(shown: Sequence[Any], order: Sequence[int]) -> list[Any]:
  """The inverse of `shuffle`: the options in their original order."""
  original: list[Any] = [None] * len(shown)
  for position, j in enumerate(order):
    original[j] = shown[position]
  return original


CHOICE_INSTRUCTION = "Put the letter of the correct option in \\boxed{}, e.g. \\boxed{A}."


def render_choice(question: str, shown: Sequence[str]) -> str:
  """The question as the model sees it: the options lettered (A) .. in the shown order."""
  lines = [question.strip(), ""]
  lines += [f"({answers.CHOICE_LETTERS[i]}) {opt.strip()}" for i, opt in enumerate(shown)]
  return "\n".join(lines + ["", CHOICE_INSTRUCTION])


# ---- loading -----------------------------------------------------------------------------
def _column(row: Mapping[str, Any], bench: Benchmark, role: str) -> str:
  names = bench.columns[role]
  for name in names:
    if row.get(name) is not None:
      return name
  present = [n for n in names if n in row]
  if present:   # the column is there, the cell empty (CSV) or null (Parquet)
    raise rows.FieldError(present[0], f"empty ({role})")
  raise rows.FieldError(names[0], f"missing ({role}: expected column "
                                  f"{' or '.join(repr(n) for n in names)}; row has "
                                  f"{sorted(row)})")


def _row_id(row: Mapping[str, Any], bench: Benchmark, default: str) -> str:
  for name in bench.id_columns:
    value = row.get(name)
    if value is not None:
      if isinstance(value, bool) or not isinstance(value, (str, int)) or not str(value).strip():
        raise rows.FieldError(name, f"id must be a non-empty string or an int, got "
                                    f"{value!r:.60}")
      return str(value).strip()
  return default


def _parse(bench: Benchmark, seed: int):
  def parse(row: dict, default_uid: str, path: pathlib.Path, row_no: int
            ) -> math_problems.MathProblem:
    uid = _row_id(row, bench, default_uid)
    if bench.answer_type == "choice":
      texts = {}
      for role in ("question", "correct", *INCORRECT):
        col = _column(row, bench, role)
        texts[role] = rows.text_field(row[col], col)
      options = [texts["correct"], *(texts[r] for r in INCORRECT)]
      order = option_order(len(options), uid, seed)
      letter = answers.CHOICE_LETTERS[order.index(0)]
      used = {c for r in ("question", "correct", *INCORRECT) for c in bench.columns[r]}
      meta = {k: v for k, v in row.items() if k not in used}
      meta.update(answer_type="choice", options=options, order=order,
                  correct_text=texts["correct"])
      return math_problems.MathProblem(uid, render_choice(texts["question"],
                                                          shuffle(options, order)),
                                       letter, bench.name, meta)
    p_col, a_col = _column(row, bench, "problem"), _column(row, bench, "answer")
    problem = rows.text_field(row[p_col], p_col, what="problem")
    answer = rows.answer_field(row[a_col], a_col)
    if bench.answer_type == "integer":
      value = answers.parse_integer(answer)
      if value is None:
        raise rows.FieldError(a_col, f"{answer!r:.60} is not an integer ({bench.name} is "
                                     "graded as integers)")
      answer = str(value)
    meta = {k: v for k, v in row.items() if k not in (p_col, a_col)}
    meta["answer_type"] = bench.answer_type
    return math_problems.MathProblem(uid, problem, answer, bench.name, meta)
  return parse


def load(bench: Benchmark, path: str, *, seed: int = 0) -> list[math_problems.MathProblem]:
  """The benchmark's problems from a local file (multiple-choice options shown in the
  order `option_order(.., uid, seed)`).

  A missing file, or a broken row (the error names the benchmark, the file, the row and
  the field), is a `BenchmarkError`; nothing is skipped silently."""
  if not os.path.isfile(path):
    raise BenchmarkError(f"benchmark {bench.name}: no file at {path!r}; expected "
                         f"{bench.layout()}")
  try:
    if bench.columns is None:
      result = math_problems.load_math_problems(path, on_error="raise")
      problems = [dataclasses.replace(p, source=bench.name,
                                      meta={**p.meta, "answer_type": bench.answer_type})
                  for p in result.items]
    else:
      problems = list(rows.load_rows(path, _parse(bench, seed), on_error="raise",
                                     what=f"benchmark {bench.name}").items)
    math_problems.check_unique_uids(problems)
  except (rows.DataError, ValueError) as e:
    raise BenchmarkError(f"benchmark {bench.name} ({bench.layout()}): {e}") from e
  return problems


# ---- grading -----------------------------------------------------------------------------
def grade(bench: Benchmark, response_text: str, reference: str, *, truncated: bool) -> float:
  """Outcome reward in {0, 1}: a truncated response scores 0 (as in training)."""
  if truncated:
    return 0.0
  if bench.answer_type == "choice":
    return 1.0 if answers.choice_letter(response_text, bench.num_options) == reference else 0.0
  return rewards.compute_reward(response_text, reference, truncated=False)
