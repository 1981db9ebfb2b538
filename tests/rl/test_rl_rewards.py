"""Outcome reward: extraction of the final boxed answer and comparison with the reference."""
import importlib.metadata
import pathlib
import subprocess
import sys
import textwrap
import threading

from packaging.requirements import Requirement  # a dependency of pytest
from packaging.utils import canonicalize_name
import pytest

from rstar_jax import answers
from rstar_jax.rl import rewards


def _resp(answer_body: str, reasoning: str = "Let me think.") -> str:
  return f"<reason>{reasoning}</reason>\n<answer>{answer_body}</answer>"


# (boxed content, reference, expected) -------------------------------------------------------
INTEGER_CASES = [
    ("42", "42", True),
    (" 42 ", "42", True),
    ("$42$", "42", True),
    ("42.", "42", True),
    ("+42", "42", True),
    ("-7", "-7", True),
    ("-7", "7", False),
    ("1,234", "1234", True),
    ("1{,}234", "1234", True),
    ("1\\,234", "1234", True),
    ("1 234", "1234", True),
    ("1,234,567", "1234567", True),
    ("1234", "1,234", True),           # thousands separator in the reference
    ("1,23", "123", False),            # not a thousands grouping: a pair, not an integer
    ("12,34", "1234", False),
    ("012", "12", True),               # AIME style leading zeros: same integer (documented)
    ("\\text{42}", "42", True),
    ("\\textbf{42}", "42", True),
    ("\\mathbf{42}", "42", True),
    ("x = 42", "42", True),
    ("n=42", "42", True),
    ("a_{1} = 42", "42", True),
    ("42^\\circ", "42", True),
    ("42^{\\circ}", "42", True),
    ("\\boxed{42}", "42", True),       # a box inside the box
    ("\\left(42\\right)", "42", False),  # parentheses make it a tuple/interval, not a literal
    ("42.0", "42", False),             # strict: not an integer literal
    ("\\frac{84}{2}", "42", False),    # strict: not an integer literal
    ("42 \\text{ cm}", "42", False),
    ("41", "42", False),
    ("420", "42", False),
    ("4 2", "42", True),               # spaces are not significant in LaTeX math
    ("1\\ 2", "12", False),            # ...but a typeset space is: two numbers
    ("1~2", "12", False),
    ("1\\,23", "123", False),
    ("1\\,000", "1000", True),          # a thin space between thousands
    ("12~345\\ 678", "12345678", True),
    ("\\$5", "5", True),                # an escaped (currency) dollar sign
    ("\\boxed{\\$1\\,000}", "1000", True),
    ("", "42", False),
    ("x", "42", False),
    ("42", 42, True),                  # int reference
    ("-0", "0", True),
    ("\u22127", "-7", True),           # Unicode minus
]


@pytest.mark.parametrize("pred,ref,expected", INTEGER_CASES)
def test_integer_reference(pred, ref, expected):
  assert rewards.is_correct(pred, ref) is expected


GENERAL_CASES = [
    ("\\frac{1}{2}", "\\frac{1}{2}", True),
    ("\\dfrac{1}{2}", "\\frac{1}{2}", True),
    ("\\tfrac12", "\\frac{1}{2}", True),
    ("1/2", "\\frac{1}{2}", True),
    ("0.5", "\\frac{1}{2}", True),
    ("\\frac{1}{2}", "0.5", True),
    ("\\frac{1}{3}", "\\frac{1}{2}", False),
    ("-\\frac{1}{2}", "\\frac{1}{2}", False),
    ("\\frac{\\pi}{2}", "\\pi/2", True),
    ("\\sqrt{12}", "2\\sqrt{3}", True),
    ("1.414", "\\sqrt{2}", False),     # near miss: rounded value of an irrational
    ("1+x^2", "x^2+1", True),
    ("x^2-1", "x^2+1", False),
    ("\\{2,1\\}", "\\{1,2\\}", True),
    ("$\\frac{3}{4}$", "\\frac{3}{4}", True),
    ("\\frac{3}{4}", "$\\frac{3}{4}$", True),
    ("0.75", "0.7", False),
]


@pytest.mark.parametrize("pred,ref,expected", GENERAL_CASES)
def test_general_reference_through_math_verify(pred, ref, expected):
  assert rewards.is_correct(pred, ref) is expected


EXTRACTION_CASES = [
    ("\\boxed{5}", "5"),
    ("\\boxed 5", "5"),
    ("\\boxed{ 5 }", "5"),
    ("$\\boxed{5}$.", "5"),
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),      # nested braces
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),                          # escaped braces
    # A one-sided escaped brace (\left\{ ... \right.): `\{` is skipped whole, not
    # counted as an opening brace; the boxed content is still found.
    ("\\boxed{\\left\\{1,2\\right.}", "\\left\\{1,2\\right."),
    ("\\boxed{a\\}b}", "a\\}b"),
    ("first \\boxed{3} then \\boxed{7}", "7"),                      # last one wins
    ("\\fbox{9}", "9"),
    ("no box here", None),
    ("\\boxed{12", None),                                           # unbalanced: None
    ("\\boxed{3} and finally \\boxed{4", None),                     # the last one decides
    ("\\boxed{}", ""),
]


@pytest.mark.parametrize("text,expected", EXTRACTION_CASES)
def test_extract_boxed(text, expected):
  assert answers.extract_boxed(text) == expected


def test_answer_tag_takes_precedence_over_reasoning():
  text = _resp("The answer is 5.", reasoning="maybe \\boxed{7}")
  assert answers.final_answer(text) is None  # boxed only in the reasoning: no answer
  text = _resp("\\boxed{5}", reasoning="maybe \\boxed{7}")
  assert answers.final_answer(text) == "5"
  # A boxed value after </answer> does not count either.
  assert answers.final_answer(_resp("\\boxed{5}") + " \\boxed{6}") == "5"


def test_last_answer_block_wins():
  text = "<answer>\\boxed{1}</answer> wait <answer>\\boxed{2}</answer>"
  assert answers.final_answer(text) == "2"


def test_unclosed_answer_tag_reads_to_end():
  assert answers.final_answer("<reason>r</reason><answer>so \\boxed{8}") == "8"


def test_no_answer_tag_uses_whole_response():
  assert answers.final_answer("work ... \\boxed{3} ... so \\boxed{11}.") == "11"


@pytest.mark.parametrize("text,ref,truncated,expected", [
    (_resp("\\boxed{42}"), "42", False, 1.0),
    (_resp("\\boxed{42}"), "42", True, 0.0),       # truncated: always 0
    (_resp("\\boxed{41}"), "42", False, 0.0),
    (_resp("42"), "42", False, 0.0),               # no boxed: 0
    ("plain \\boxed{42}", "42", False, 1.0),
    (_resp("$\\boxed{\\dfrac{1}{2}}$"), "0.5", False, 1.0),
    (_resp("\\boxed{1{,}000}"), "1000", False, 1.0),
])
def test_compute_reward(text, ref, truncated, expected):
  assert rewards.compute_reward(text, ref, truncated=truncated) == expected


@pytest.mark.parametrize("text,ref", [
    (_resp("\\boxed{{204}}"), "204"),            # redundant braces around the answer
    (_resp("\\boxed{{{204}}}"), "204"),
    (_resp("\\boxed{ { 204 } }"), "204"),
    (_resp("\\boxed{{-3}}"), "-3"),
    (_resp("\\boxed{{1,234}}"), "1234"),
    (_resp("\\boxed{x = {204}}"), "204"),
    (_resp("\\boxed{{204}}"), 204),
    (_resp("\\boxed{{\\frac{1}{2}}}"), "\\frac{1}{2}"),
])
def test_redundant_braces_score_full_reward(text, ref):
  assert rewards.compute_reward(text, ref, truncated=False) == 1.0


@pytest.mark.parametrize("answer,expected", [
    ("{{204}}", "204"),
    ("{204}", "204"),
    ("{ {204} }", "204"),
    ("{204}.", "204"),
    ("\\{1,2\\}", "\\{1,2\\}"),        # a set: escaped braces are kept
    ("{\\{1,2\\}}", "\\{1,2\\}"),      # ... also inside a redundant group
    ("\\frac{1}{2}", "\\frac{1}{2}"),      # argument braces are kept
    ("{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("{1}{2}", "{1}{2}"),                # two groups: the first brace does not enclose all
    ("{a}^{2}", "{a}^{2}"),
    ("{{1}{2}}", "{1}{2}"),
])
def test_normalize_answer_strips_only_enclosing_braces(answer, expected):
  assert answers.normalize_answer(answer) == expected


def test_an_answer_of_more_digits_than_python_converts_is_not_an_integer():
  """int() refuses > 4300 digits: the reward raised and stopped the whole step."""
  huge = "1" * 5000
  assert answers.parse_integer(huge) is None
  assert rewards.is_correct(huge, "12") is False


def test_a_long_run_of_spacing_commands_after_a_digit_is_fast():
  """The digit-gap regex backtracked exponentially on a run of `\\,` / `~` after a digit
  that no digit follows: 18 of them took 28 s, 40 would take days (the reward froze); so
  this run of 40 ends or pytest-timeout ends it, however loaded the host (no tighter bound).
  A subprocess, because the re module cannot be interrupted in-process."""
  code = textwrap.dedent(r"""
      from rstar_jax import answers
      from rstar_jax.rl import rewards
      for sep in (" \\, ", "~ ", " \\ \\; "):
        run = "1" + sep * 40 + "x"
        assert answers.normalize_answer(run).startswith("1")
        assert rewards.compute_reward("\\boxed{" + run + "}", "1", truncated=False) == 0.0
      print("ok")""")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=pathlib.Path(__file__).parents[2])
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
  assert answers.normalize_answer("1 \\, \\, 000") == "1000"   # still a thousands gap


def test_brace_set_answers_are_not_integers():
  assert answers.parse_integer("\\{204\\}") is None
  assert rewards.is_correct("{1}{2}", "12") is False


def test_bad_reference_raises():
  with pytest.raises(TypeError, match="reference"):
    rewards.is_correct("1", None)
  with pytest.raises(ValueError, match="empty"):
    rewards.is_correct("1", "  ")


def test_works_outside_the_main_thread():
  # math-verify's signal-based timeout would raise here; is_correct must disable it.
  out, errors = [], []

  def work():
    try:
      out.append(rewards.is_correct("\\dfrac{2}{4}", "\\frac{1}{2}"))
      out.append(rewards.is_correct("\\frac{1}{3}", "\\frac{1}{2}"))
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  t = threading.Thread(target=work)
  t.start()
  t.join()
  assert not errors, errors
  assert out == [True, False]


def test_a_parse_that_gave_nothing_is_not_cached(monkeypatch):
  """math-verify's parse returns [] on a timeout: one slow parse of a reference (a loaded
  host) was cached and marked every later sample of that problem wrong."""
  real, calls = rewards.mv_parse, []

  def timing_out_once(*args, **kwargs):
    calls.append(args[0])
    return [] if len(calls) == 1 else real(*args, **kwargs)

  monkeypatch.setattr(rewards, "mv_parse", timing_out_once)
  ref = "\\frac{7}{13}"   # in no other test: not in the cache yet
  assert rewards.is_correct("\\dfrac{7}{13}", ref) is False   # the reference "timed out"
  assert rewards.is_correct("\\dfrac{7}{13}", ref) is True
  assert rewards.is_correct("\\dfrac{7}{13}", ref) is True
  assert len(calls) == 3   # the retry, then both parses cached


def _pins(path):
  out = {}
  for line in pathlib.Path(path).read_text().splitlines():
    line = line.split("#")[0].strip()
    if line and not line.startswith("-"):
      req = Requirement(line)
      out[canonicalize_name(req.name)] = req
  return out


def test_math_verify_and_its_parser_are_pinned_consistently():
  """requirements.txt pins math-verify's whole chain down to the ANTLR runtime, with no extra.

  An extra spelled `[antlr4_13_2]` is not matched by pip 23 against the wheel's `antlr4-13-2`
  (a warning on every install, and the runtime is then left unpinned).
  """
  pins = _pins(pathlib.Path(__file__).parents[2] / "requirements.txt")
  assert not pins["math-verify"].extras, "pin math-verify's dependencies directly, no extras"
  for package in ("math-verify", "latex2sympy2-extended"):
    for text in importlib.metadata.requires(package) or []:
      dep = Requirement(text)
      if dep.marker is not None:  # extras (test, dev, antlr4-*) are not installed
        continue
      name = canonicalize_name(dep.name)
      assert name in pins, f"{package} needs {dep}; pin it in requirements.txt"
      (pinned,) = [str(s.version) for s in pins[name].specifier if s.operator == "=="]
      assert dep.specifier.contains(pinned), f"{package} needs {dep}, requirements.txt has {pinned}"
      assert importlib.metadata.version(name) == pinned
  # latex2sympy2_extended ships parsers generated by exactly these ANTLR versions.
  assert importlib.metadata.version("antlr4-python3-runtime").startswith(("4.9.3", "4.11", "4.13.2"))
  assert rewards.is_correct("\\frac{1}{2}", "0.5")  # the LaTeX parser loads and works
