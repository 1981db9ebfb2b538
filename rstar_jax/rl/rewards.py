"""Outcome reward: 1 if the final `\\boxed{}` answer matches the reference, else 0.

SPEC.md sections 3-4. The answer is the LAST `\\boxed{...}` of the final answer: inside the
last `<answer>...</answer>` block when the response has an `<answer>` tag (a boxed value
written earlier in the reasoning does not count then), else anywhere in the response.

Comparison:
  * Integer references (all of the RL training data) are compared strictly as integers: after
    a light normalisation (spaces, `$`, `\\text{}`, thousands separators "1,234" / "1{,}234" /
    "1\\,234", a leading `x =`, `^\\circ`, a trailing period) the prediction must be an integer
    literal with the same value. "012" equals 12 (AIME answers are often written with three
    digits); "12.0", "\\frac{24}{2}" and "12 cm" are rejected: they are not integer literals.
  * Any other reference goes through math-verify (`parse` + `verify`), which accepts
    equivalent forms ("1/2", "\\dfrac{1}{2}", "0.5"; "x^2+1" vs "1+x^2"; sets; intervals).

Timeouts: math-verify bounds its sympy work with `signal.alarm`, which only works in the
main thread (elsewhere it raises "signal only works in main thread"). `is_correct` therefore
passes math-verify's `parsing_timeout`/`timeout_seconds` only when it runs in the main
thread and passes None (no timeout, no signal) from any other thread. Callers that verify
from threads and need a hard bound should run the rewards in a process pool (each worker's
main thread gets the signal timeout). Integer references never reach math-verify, so the
training path has no sympy cost and no timeout concern.
"""
from __future__ import annotations

import functools
import re
import threading
from typing import Any

from math_verify import parse as mv_parse
from math_verify import verify as mv_verify

__all__ = [
    "extract_boxed",
    "final_answer",
    "normalize_answer",
    "parse_integer",
    "is_correct",
    "compute_reward",
]

# Seconds math-verify may spend per parse / comparison (main thread only, see module doc).
DEFAULT_TIMEOUT_S = 5

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_ANSWER_OPEN = "<answer>"
_ANSWER_CLOSE = "</answer>"
_INT_RE = re.compile(r"[+-]?\d+")
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+")
_TEXT_WRAP_RE = re.compile(
    r"\\(?:text|textbf|textrm|textnormal|mathrm|mathbf|mbox|rm|bf)\s*\{([^{}]*)\}")
# "x = 5", "n=12", "a_1 = 3", "a_{10} = 3": a named single value.
_ASSIGN_PREFIX_RE = re.compile(r"^[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?=")


def _match_brace(text: str, open_pos: int) -> int | None:
  """Index of the `}` closing the `{` at `open_pos`, or None when unbalanced.

  `\\{` and `\\}` are literal braces in LaTeX (set notation), so they do not nest.
  """
  depth = 0
  i = open_pos
  while i < len(text):
    c = text[i]
    if c == "\\":
      i += 2
      continue
    if c == "{":
      depth += 1
    elif c == "}":
      depth -= 1
      if depth == 0:
        return i
    i += 1
  return None


def extract_boxed(text: str) -> str | None:
  """Content of the last `\\boxed{...}` (or `\\fbox{...}`, `\\boxed 5`) in `text`.

  Returns None when there is no `\\boxed`, or when the last one is malformed (unbalanced
  braces, e.g. a truncated answer): an earlier boxed value is NOT used instead, since the
  model's final word was something else.
  """
  if not isinstance(text, str):
    raise TypeError(f"extract_boxed expects a str, got {type(text).__name__}")
  matches = list(_BOXED_RE.finditer(text))
  if not matches:
    return None
  pos = matches[-1].end()
  while pos < len(text) and text[pos].isspace():
    pos += 1
  if pos >= len(text):
    return None
  if text[pos] == "{":
    end = _match_brace(text, pos)
    if end is None:
      return None
    return text[pos + 1:end].strip()
  # `\boxed 5`: TeX takes one token; take the run up to whitespace or a math delimiter.
  m = re.match(r"[^\s$]+", text[pos:])
  return m.group(0) if m else None


def final_answer(response_text: str) -> str | None:
  """The boxed final answer of a response, or None.

  With an `<answer>` tag, only the last `<answer>` block counts (up to `</answer>` or the
  end of the text when unclosed); without one, the whole response.
  """
  if not isinstance(response_text, str):
    raise TypeError(f"final_answer expects a str, got {type(response_text).__name__}")
  start = response_text.rfind(_ANSWER_OPEN)
  if start < 0:
    return extract_boxed(response_text)
  start += len(_ANSWER_OPEN)
  end = response_text.find(_ANSWER_CLOSE, start)
  segment = response_text[start:] if end < 0 else response_text[start:end]
  return extract_boxed(segment)


def _unwrap_boxed(s: str) -> str:
  s = s.strip()
  while True:
    m = _BOXED_RE.match(s)
    if not m:
      return s
    inner_start = m.end()
    while inner_start < len(s) and s[inner_start].isspace():
      inner_start += 1
    if inner_start >= len(s) or s[inner_start] != "{":
      return s
    end = _match_brace(s, inner_start)
    if end is None or s[end + 1:].strip():
      return s
    s = s[inner_start + 1:end].strip()


def normalize_answer(answer: str) -> str:
  """Light, conservative string normalisation used for the integer comparison.

  Removes: math delimiters (`$`, `\\(`, `\\)`, `\\[`, `\\]`), an enclosing `\\boxed{}`,
  `\\left`/`\\right`, LaTeX spacing (`\\!`, `\\,`, `\\;`, `\\:`, `\\ `, `~`), text/roman
  wrappers, degree signs, all whitespace, a trailing period, a leading `x =`; turns
  `\\dfrac`/`\\tfrac` into `\\frac` and `{,}` into `,`; strips thousands separators from a
  number whose comma groups are all of three digits ("1,234" -> "1234", but "1,23" stays).
  """
  s = answer.replace("$", "").replace("\u2212", "-")  # Unicode minus sign.
  for tok in ("\\(", "\\)", "\\[", "\\]"):
    s = s.replace(tok, "")
  s = _unwrap_boxed(s)
  s = s.replace("{,}", ",")
  s = re.sub(r"\\(?:left|right)(?![A-Za-z])", "", s)
  s = re.sub(r"\\[!,;:> ]", "", s).replace("~", "")
  s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
  prev = None
  while prev != s:  # nested wrappers: \text{\textbf{5}}
    prev = s
    s = _TEXT_WRAP_RE.sub(r"\1", s)
  s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?", "", s).replace("°", "")
  s = re.sub(r"\s+", "", s)
  s = s.rstrip(".")
  s = _ASSIGN_PREFIX_RE.sub("", s)
  if _THOUSANDS_RE.fullmatch(s):
    s = s.replace(",", "")
  return s


def parse_integer(answer: str) -> int | None:
  """The integer an answer states literally (after `normalize_answer`), else None."""
  s = normalize_answer(answer)
  if _INT_RE.fullmatch(s):
    return int(s)
  return None


def _timeout_for_this_thread(timeout_s: int | None) -> int | None:
  # math-verify's timeout is signal.alarm: only the main thread may install it.
  if threading.current_thread() is threading.main_thread():
    return timeout_s
  return None


def _strip_delimiters(s: str) -> str:
  s = s.strip()
  for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
    if s.startswith(left) and s.endswith(right) and len(s) >= len(left) + len(right):
      s = s[len(left):len(s) - len(right)].strip()
  return s


@functools.lru_cache(maxsize=4096)
def _parse_cached(expr: str, timeout_s: int | None) -> tuple[Any, ...]:
  # Wrapping in \boxed{} makes math-verify's LaTeX extractor take the whole expression.
  return tuple(mv_parse("\\boxed{" + expr + "}", parsing_timeout=timeout_s))


def is_correct(answer: str | None, reference: str | int,
               *, timeout_s: int | None = DEFAULT_TIMEOUT_S) -> bool:
  """Whether an extracted answer matches the reference.

  Args:
    answer: the boxed content (from `final_answer`), or None when there was none.
    reference: the ground truth, a string (LaTeX allowed) or an int.
    timeout_s: math-verify's per-step limit in the main thread (None disables it);
      ignored outside the main thread (see the module docstring).
  """
  if isinstance(reference, bool) or not isinstance(reference, (str, int)):
    raise TypeError(f"reference must be a str or int, got {type(reference).__name__}: "
                    f"{reference!r}")
  if answer is None:
    return False
  if not isinstance(answer, str):
    raise TypeError(f"answer must be a str or None, got {type(answer).__name__}")
  ref_text = str(reference).strip()
  if not ref_text:
    raise ValueError("reference is empty")
  if not answer.strip():
    return False

  ref_int = reference if isinstance(reference, int) else parse_integer(ref_text)
  if ref_int is not None:
    pred_int = parse_integer(answer)
    return pred_int is not None and pred_int == ref_int

  timeout = _timeout_for_this_thread(timeout_s)
  gold = _parse_cached(_strip_delimiters(ref_text), timeout)
  pred = _parse_cached(_strip_delimiters(answer.replace("{,}", ",")), timeout)
  if not gold or not pred:
    return False
  return bool(mv_verify(list(gold), list(pred), timeout_seconds=timeout))


def compute_reward(response_text: str, reference: str | int, *, truncated: bool,
                   timeout_s: int | None = DEFAULT_TIMEOUT_S) -> float:
  """Outcome reward in {0.0, 1.0}; truncated trajectories get 0 (kept, SPEC.md section 3).

  Args:
    response_text: the decoded response (all turns; the answer is taken from the end).
    reference: the ground-truth answer.
    truncated: whether the rollout hit the length or turn budget.
    timeout_s: see `is_correct`.
  """
  if truncated:
    return 0.0
  return 1.0 if is_correct(final_answer(response_text), reference, timeout_s=timeout_s) else 0.0
