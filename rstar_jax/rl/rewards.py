"""Outcome reward: 1 if the final `\\boxed{}` answer matches the reference, else 0.

rStar2-Agent report (GRPO-RoC). The answer is the LAST `\\boxed{...}` of the final answer: inside the
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
import threading
from typing import Any

from math_verify import parse as mv_parse
from math_verify import verify as mv_verify

from rstar_jax.answers import final_answer, parse_integer, strip_enclosing_braces

__all__ = [
    "is_correct",
    "compute_reward",
]

# Seconds math-verify may spend per parse / comparison (main thread only, see module doc).
DEFAULT_TIMEOUT_S = 5


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


class _NotParsed(Exception):
  pass


@functools.lru_cache(maxsize=4096)
def _parse_or_raise(expr: str, timeout_s: int | None) -> tuple[Any, ...]:
  # Wrapping in \boxed{} makes math-verify's LaTeX extractor take the whole expression.
  parsed = tuple(mv_parse("\\boxed{" + expr + "}", parsing_timeout=timeout_s))
  if not parsed:
    raise _NotParsed   # lru_cache keeps no exception: see _parse_cached
  return parsed


def _parse_cached(expr: str, timeout_s: int | None) -> tuple[Any, ...]:
  """math-verify's parse of `expr`; () when it gives nothing.

  Only successful parses are cached: math-verify returns [] on a parse timeout too, and
  one slow parse of a reference (a loaded host) would otherwise mark every later sample
  of that problem wrong for the life of the process.
  """
  try:
    return _parse_or_raise(expr, timeout_s)
  except _NotParsed:
    return ()


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
  pred = _parse_cached(strip_enclosing_braces(_strip_delimiters(answer.replace("{,}", ","))),
                       timeout)
  if not gold or not pred:
    return False
  return bool(mv_verify(list(gold), list(pred), timeout_seconds=timeout))


def compute_reward(response_text: str, reference: str | int, *, truncated: bool,
                   timeout_s: int | None = DEFAULT_TIMEOUT_S) -> float:
  """Outcome reward in {0.0, 1.0}; truncated trajectories get 0 (kept, as the report does).

  Args:
    response_text: the decoded response (all turns; the answer is taken from the end).
    reference: the ground-truth answer.
    truncated: whether the rollout hit the length or turn budget.
    timeout_s: see `is_correct`.
  """
  if truncated:
    return 0.0
  return 1.0 if is_correct(final_answer(response_text), reference, timeout_s=timeout_s) else 0.0
