"""Outcome reward: extraction of the final boxed answer and comparison with the reference."""
import threading

import pytest

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
    ("first \\boxed{3} then \\boxed{7}", "7"),                      # last one wins
    ("\\fbox{9}", "9"),
    ("no box here", None),
    ("\\boxed{12", None),                                           # unbalanced: None
    ("\\boxed{3} and finally \\boxed{4", None),                     # the last one decides
    ("\\boxed{}", ""),
]


@pytest.mark.parametrize("text,expected", EXTRACTION_CASES)
def test_extract_boxed(text, expected):
  assert rewards.extract_boxed(text) == expected


def test_answer_tag_takes_precedence_over_reasoning():
  text = _resp("The answer is 5.", reasoning="maybe \\boxed{7}")
  assert rewards.final_answer(text) is None  # boxed only in the reasoning: no answer
  text = _resp("\\boxed{5}", reasoning="maybe \\boxed{7}")
  assert rewards.final_answer(text) == "5"
  # A boxed value after </answer> does not count either.
  assert rewards.final_answer(_resp("\\boxed{5}") + " \\boxed{6}") == "5"


def test_last_answer_block_wins():
  text = "<answer>\\boxed{1}</answer> wait <answer>\\boxed{2}</answer>"
  assert rewards.final_answer(text) == "2"


def test_unclosed_answer_tag_reads_to_end():
  assert rewards.final_answer("<reason>r</reason><answer>so \\boxed{8}") == "8"


def test_no_answer_tag_uses_whole_response():
  assert rewards.final_answer("work ... \\boxed{3} ... so \\boxed{11}.") == "11"


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
