"""Math problems (for RL training and evaluation): layouts, loading, filters, iteration.

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

Files (`.jsonl`, `.jsonl.gz`, `.json`, `.parquet`) are read by `rows.load_rows`: a
malformed row gives a `DataError` naming the file, the row and the field, and
`on_error="skip"` skips, counts and reports such rows: nothing is lost silently.

The filters (`filter_integer_answers`, `deduplicate`) return what they drop as
well as what they keep, for the same reason.

`EpochIterator` yields fixed-size batches in a seeded order that reshuffles every
epoch, and can save / restore its position so an RL run resumes on the exact
next batch.

SFT conversations are in `sft_examples`.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import pathlib
import unicodedata
from typing import Any, Callable, Generic, Iterable, Mapping, Sequence, TypeVar

from absl import logging
import numpy as np

from rstar_jax.registry import Registry

# One definition of "boxed answer" and "integer answer" for data and reward alike: a
# problem the integer filter keeps is exactly one the reward compares strictly.
from rstar_jax.answers import extract_boxed, parse_integer
from rstar_jax.data.rows import (FieldError, LoadResult, PathLike, answer_field, as_paths,
                                 first_key, id_field, load_rows, reader_for, row_uid, text_field,
                                 uid_prefixes)

T = TypeVar("T")

# --------------------------------------------------------------------------------------
# The record.


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


# --------------------------------------------------------------------------------------
# Fields of math rows (the generic checks are in `rows`).


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
    return text_field(prompt, "prompt", what="problem")
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
      users.append(text_field(message.get("content"), f"prompt[{i}].content", what="problem"))
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
  answer = answer_field(reward_model["ground_truth"], "reward_model.ground_truth")
  meta = {k: v for k, v in row.items() if k not in ("prompt", "reward_model")}
  meta["reward_style"] = reward_model.get("style")
  if isinstance(row["prompt"], list):
    system = [m.get("content") for m in row["prompt"] if m.get("role") == "system"]
    if system:
      meta["system"] = system[0]
  return MathProblem(row_uid(row, default_uid), text, answer, _source(row, path), meta)


_PROBLEM_KEYS = ("problem", "Problem", "question", "Question", "prompt")
_ANSWER_KEYS = ("answer", "Answer", "final_answer", "ground_truth")
_SOLUTION_KEYS = ("solution", "Solution")


@register_layout("problem")
def _parse_problem(row: dict, default_uid: str, path: pathlib.Path) -> MathProblem:
  problem_key = first_key(row, _PROBLEM_KEYS)
  if problem_key is None:
    raise FieldError("problem", f"missing: none of {list(_PROBLEM_KEYS)} present "
                                f"(row keys: {sorted(row)})")
  text = text_field(row[problem_key], problem_key, what="problem")
  answer_key = first_key(row, _ANSWER_KEYS)
  if answer_key is not None:
    answer = answer_field(row[answer_key], answer_key)
  else:
    solution_key = first_key(row, _SOLUTION_KEYS)
    if solution_key is None:
      raise FieldError("answer", f"missing: none of {list(_ANSWER_KEYS + _SOLUTION_KEYS)} present "
                                 f"(row keys: {sorted(row)})")
    solution = text_field(row[solution_key], solution_key, what="solution")
    boxed = extract_boxed(solution)
    if boxed is None:
      raise FieldError(solution_key, "no answer field and no \\boxed{...} in the solution")
    if not boxed:
      raise FieldError(solution_key, "empty answer (\\boxed{} is empty)")
    answer = boxed
  meta = {k: v for k, v in row.items() if k not in (problem_key, answer_key)}
  return MathProblem(row_uid(row, default_uid), text, answer, _source(row, path), meta)


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
  paths = as_paths(paths)
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
        raise FieldError(id_field(row), f"duplicate id {problem.uid!r}: {reader_for(path)[1]} "
                                         f"{first[0]} has it for another problem")
    origins.append((path, from_row))   # appended last: one per item of the result
    return problem

  result = load_rows(paths, parse, on_error=on_error, max_reported=max_reported,
                     what="math data", csv=False)
  if prefix_clashing_ids:
    result = _prefix_clashing_ids(result, origins, uid_prefixes(paths))
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


