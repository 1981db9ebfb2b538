"""Final-answer parsing, shared by rewards (rl/), data filters (data/) and rollouts.

The answer is the LAST `\\boxed{}` inside the last `<answer>...</answer>` block (the whole
response when there is no `<answer>` tag); `normalize_answer` / `parse_integer` are the light
normalisation the strict integer comparison uses (the rStar2-Agent report: outcome reward
on integer answers, compared strictly); the reward itself
(integer or math-verify comparison) is `rstar_jax.rl.rewards`.
"""
from __future__ import annotations

import re

ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_INT_RE = re.compile(r"[+-]?\d+")
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+")
# A visible space between two digits ("1\\,000", "1\\ 000", "1~000"): a thousands
# separator only where every group after the first has three digits, else two numbers
# ("1\\ 2" is not 12). Bare whitespace is not one: math mode typesets "4 2" as 42.
# Each `\s*` sits after a separator, never next to another `\s*`: nested `(\s*X\s*)+`
# let a long run not followed by a digit backtrack exponentially (seconds per answer).
_DIGIT_GAP_RE = re.compile(r"(?<=\d)\s*(?:(?:\\[,;:> ]|~)\s*)+(?=\d)")
_GAP = "\x00"
_SPACED_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:\x00\d{3})+")
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
  start = response_text.rfind(ANSWER_OPEN)
  if start < 0:
    return extract_boxed(response_text)
  start += len(ANSWER_OPEN)
  end = response_text.find(ANSWER_CLOSE, start)
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


def strip_enclosing_braces(s: str) -> str:
  """Removes redundant `{...}` groups around the whole of `s`: `{{204}}` -> `204`.

  Only a `{` at position 0 whose matching `}` is the last character is removed, so
  `\\{1,2\\}` (a set: escaped braces), `\\frac{1}{2}` and `{1}{2}` are left alone.
  """
  s = s.strip()
  while s.startswith("{") and _match_brace(s, 0) == len(s) - 1:
    s = s[1:-1].strip()
  return s


def normalize_answer(answer: str) -> str:
  """Light, conservative string normalisation used for the integer comparison.

  Removes: math delimiters (`$`, `\\(`, `\\)`, `\\[`, `\\]`), an enclosing `\\boxed{}`,
  `\\left`/`\\right`, LaTeX spacing (`\\!`, `\\,`, `\\;`, `\\:`, `\\ `, `~`; between two
  digits only as a thousands separator, "1\\,000", else left as one space), text/roman
  wrappers, degree signs, all whitespace, a trailing period, a leading `x =`, redundant
  braces around the whole answer (`{{204}}` -> `204`, see `strip_enclosing_braces`); turns
  `\\dfrac`/`\\tfrac` into `\\frac` and `{,}` into `,`; strips thousands separators from a
  number whose comma groups are all of three digits ("1,234" -> "1234", but "1,23" stays).
  """
  # An escaped dollar (a currency sign: "\\$5") first, or "\\5" would be left.
  s = answer.replace("\\$", "").replace("$", "").replace("\u2212", "-")  # Unicode minus.
  for tok in ("\\(", "\\)", "\\[", "\\]"):
    s = s.replace(tok, "")
  s = _unwrap_boxed(s)
  s = s.replace("{,}", ",")
  s = re.sub(r"\\(?:left|right)(?![A-Za-z])", "", s)
  s = _DIGIT_GAP_RE.sub(_GAP, s.replace(_GAP, ""))
  s = re.sub(r"\\[!,;:> ]", "", s).replace("~", "")
  s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
  prev = None
  while prev != s:  # nested wrappers: \text{\textbf{5}}
    prev = s
    s = _TEXT_WRAP_RE.sub(r"\1", s)
  s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?", "", s).replace("°", "")
  s = re.sub(r"\s+", "", s)
  s = s.rstrip(".")
  s = strip_enclosing_braces(s)
  s = _ASSIGN_PREFIX_RE.sub("", s)
  s = strip_enclosing_braces(s)  # "x={5}"
  if _THOUSANDS_RE.fullmatch(s):
    s = s.replace(",", "")
  elif _SPACED_THOUSANDS_RE.fullmatch(s):
    s = s.replace(_GAP, "")
  return s.replace(_GAP, " ")   # digits spaced otherwise: two numbers, not one


def parse_integer(answer: str) -> int | None:
  """The integer an answer states literally (after `normalize_answer`), else None."""
  s = normalize_answer(answer)
  if _INT_RE.fullmatch(s):
    try:
      return int(s)
    except ValueError:   # more digits than Python converts (4300): no integer answer
      return None
  return None




def count_answer_tags(text: str) -> int:
  """Complete `<answer>...</answer>` blocks in text the model wrote (not tool output).

  An unmatched opening tag does not count: a rollout that never closed its answer is
  treated as having one answer fewer.
  """
  count, pos = 0, 0
  while True:
    start = text.find(ANSWER_OPEN, pos)
    if start < 0:
      return count
    end = text.find(ANSWER_CLOSE, start + len(ANSWER_OPEN))
    if end < 0:
      return count
    count += 1
    pos = end + len(ANSWER_CLOSE)


# --------------------------------------------------------------------------------------
# Multiple choice (GPQA-style): which option letter a response chose.

CHOICE_LETTERS = "ABCDEFGHIJ"
# What may wrap the letter inside a \boxed{}: "(C)", "\text{C}", "\textbf{(C)}", "$C$".
_CHOICE_WRAP_RE = re.compile(r"^\(?([A-J])\)?$")
# A final line that states the letter and nothing else: "C", "(C)", "C.", "**C**",
# "Answer: C", "The answer is (C).", "Final answer: (C)". Case-sensitive letter.
_CHOICE_LINE_RE = re.compile(
    r"^(?:(?:[Tt]he\s+)?(?:[Ff]inal\s+|[Cc]orrect\s+)?(?:[Aa]nswer|[Oo]ption|[Cc]hoice)"
    r"(?:\s+is)?\s*:?\s*)?\(?([A-J])\)?\.?$")


def choice_letter(response_text: str, num_options: int = 4) -> str | None:
  """The option letter a response chose, or None; strict (GPQA-style grading).

  Where: the last `<answer>` block when the response has one (as `final_answer`), else
  the whole response. What counts, in order:

  1. A `\\boxed{}` there: the LAST one decides, and its content (after `normalize_answer`:
     `$`, `\\text{}`, `\\textbf{}`, spaces) must be exactly one letter, bare or in
     parentheses: `\\boxed{C}`, `\\boxed{(C)}`, `\\boxed{\\text{C}}`. Anything else in the
     last box (`\\boxed{C and D}`, `\\boxed{C) 42}`, `\\boxed{c}`, `\\boxed{3}`) is no
     answer: an earlier box or a letter after it is not used instead.
  2. No box: the last non-blank line, with markdown `*` / `_` emphasis removed, must be
     the letter alone or in parentheses, optionally after "Answer:", "The answer is",
     "Final answer:", "The correct option is" and optionally with a final period:
     `C`, `(C)`, `**C**`, `Answer: C`, `The answer is (C).`. A letter inside a sentence
     ("so C is right", "C or D", "I pick C because ...") is no answer.

  Letters are upper case and must name one of the `num_options` options (A-D for 4):
  `\\boxed{E}` with four options is no answer.
  """
  if not isinstance(response_text, str):
    raise TypeError(f"choice_letter expects a str, got {type(response_text).__name__}")
  if not 1 <= num_options <= len(CHOICE_LETTERS):
    raise ValueError(f"num_options must be in [1, {len(CHOICE_LETTERS)}], got {num_options}")
  start = response_text.rfind(ANSWER_OPEN)
  segment = response_text
  if start >= 0:
    start += len(ANSWER_OPEN)
    end = response_text.find(ANSWER_CLOSE, start)
    segment = response_text[start:] if end < 0 else response_text[start:end]
  if _BOXED_RE.search(segment):
    boxed = extract_boxed(segment)
    m = _CHOICE_WRAP_RE.match(normalize_answer(boxed)) if boxed is not None else None
  else:
    lines = [ln for ln in segment.splitlines() if ln.strip()]
    last = re.sub(r"[*_]", "", lines[-1]).strip() if lines else ""
    m = _CHOICE_LINE_RE.match(last)
  if m is None:
    return None
  letter = m.group(1)
  return letter if CHOICE_LETTERS.index(letter) < num_options else None
