"""The benchmark registry: public layouts load, broken files say where, answers grade
strictly, multiple-choice options shuffle stably and reversibly, bootstrap intervals."""
import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rstar_jax import answers
from rstar_jax.eval import benchmarks, suite
from rstar_jax.eval import eval_runs as eval_lib
from tests.eval import benchmark_fixtures as fx


def test_every_registered_benchmark_loads_its_public_layout(tmp_path):
  assert set(fx.WRITERS) == set(benchmarks.REGISTRY) == set(benchmarks.REPORT_SUITE)
  loaded = {name: benchmarks.load(benchmarks.REGISTRY[name], write(str(tmp_path)))
            for name, write in fx.WRITERS.items()}
  # AIME answers are integers compared strictly: "003" is 3.
  assert [(p.uid, p.answer) for p in loaded["aime24"]] == [("60", "3"), ("61", "5"), ("62", "7")]
  assert [p.answer for p in loaded["aime25"]] == ["6", "9", "12"]
  assert [(p.uid, p.answer) for p in loaded["hmmt25"]] == [("1", "\\frac{1}{2}"), ("2", "3")]
  assert loaded["math500"][0].uid == "test/prealgebra/1.json"
  assert loaded["math500"][0].meta["subject"] == "Prealgebra"
  for name, problems in loaded.items():
    assert {p.source for p in problems} == {name}
    assert {p.meta["answer_type"] for p in problems} == {benchmarks.REGISTRY[name].answer_type}
  gpqa = loaded["gpqa_diamond"]
  assert [p.uid for p in gpqa] == ["rec000", "rec001", "rec002"]
  for i, p in enumerate(gpqa):
    # The rendered question: the multi-line question, then four lettered options.
    assert p.problem.startswith(f"Which number is {i}?\nPick one.\n")
    shown = [line[4:] for line in p.problem.splitlines() if line[:1] == "("]
    assert sorted(shown) == sorted(str(i + j) for j in range(4))
    # The reference letter points at the correct answer's text.
    assert shown["ABCD".index(p.answer)] == str(i) == p.meta["correct_text"]
    assert p.meta["Subdomain"] == "Arithmetic" and "Question" not in p.meta


def test_a_local_file_under_any_other_name_is_a_math_benchmark(tmp_path):
  path = fx.math500(str(tmp_path))
  (bench, given), = benchmarks.parse_spec([f"my_set={path}"])
  assert (bench.name, bench.answer_type, bench.report_pass_at_1, given) == (
      "my_set", "math", None, path)
  assert [p.answer for p in benchmarks.load(bench, path)] == ["\\frac{1}{2}", "5"]
  for bad in (["aime24"], ["=x"], ["aime24=a", "aime24=b"], ["a b=c"]):
    with pytest.raises(benchmarks.BenchmarkError):
      benchmarks.parse_spec(bad)


def test_a_missing_file_names_the_benchmark_and_its_layout(tmp_path):
  missing = str(tmp_path / "nowhere.parquet")
  with pytest.raises(benchmarks.BenchmarkError) as e:
    benchmarks.load(benchmarks.REGISTRY["gpqa_diamond"], missing)
  text = str(e.value)
  assert text.startswith("benchmark gpqa_diamond: no file at") and missing in text
  assert all(c in text for c in ("'Question'", "'Correct Answer'", "'Incorrect Answer 3'"))
  with pytest.raises(benchmarks.BenchmarkError, match=r"benchmark aime24: .*'problem'.*'answer'"):
    benchmarks.load(benchmarks.REGISTRY["aime24"], missing)


def _error(name, path):
  with pytest.raises(benchmarks.BenchmarkError) as e:
    benchmarks.load(benchmarks.REGISTRY[name], path)
  return str(e.value)


def test_a_broken_file_names_benchmark_file_row_and_field(tmp_path):
  # JSONL: an AIME answer that is not an integer, on line 2.
  path = str(tmp_path / "aime25.jsonl")
  with open(path, "w") as f:
    f.write(json.dumps({"problem": "a", "answer": "7", "id": "1"}) + "\n")
    f.write(json.dumps({"problem": "b", "answer": "7/2", "id": "2"}) + "\n")
  text = _error("aime25", path)
  assert text.startswith("benchmark aime25 ") and f"{path}, line 2, field 'answer'" in text
  assert "not an integer" in text
  # Parquet: MATH-500 rows without an answer column.
  import pyarrow as pa
  import pyarrow.parquet as pq
  path = str(tmp_path / "math500.parquet")
  pq.write_table(pa.Table.from_pylist([{"problem": "x", "solution": "no box"}]), path)
  text = _error("math500", path)
  assert f"{path}, row 1, field 'answer': missing" in text and "benchmark math500" in text
  # CSV: GPQA with an empty third distractor in data row 2.
  path = fx.gpqa_diamond(str(tmp_path), n=3)
  with open(path, newline="") as f:
    rows = list(csv.reader(f))
  assert rows[2][-1] == "rec001"   # rows[0] is the header
  rows[2][fx.GPQA_COLUMNS.index("Incorrect Answer 3")] = ""
  with open(path, "w", newline="") as f:
    csv.writer(f).writerows(rows)
  text = _error("gpqa_diamond", path)
  assert "benchmark gpqa_diamond" in text
  assert f"{path}, row 2, field 'Incorrect Answer 3': empty" in text
  # Two rows with one id.
  path = str(tmp_path / "dup.jsonl")
  with open(path, "w") as f:
    for text_ in ("a", "b"):
      f.write(json.dumps({"problem": text_, "answer": "1", "id": "same"}) + "\n")
  assert "duplicate" in _error("aime24", path)


@pytest.mark.parametrize("response, reference, expected", [
    # integer: strict after light normalisation
    ("<answer>\\boxed{033}</answer>", "33", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{33.0}", "33", 0.0),
    ("\\boxed{\\frac{66}{2}}", "33", 0.0),
    ("\\boxed{33} cm later \\boxed{34}", "33", 0.0),   # the last box decides
    ("the answer is 33", "33", 0.0),                    # no box: no answer
])
def test_integer_grading(response, reference, expected):
  bench = benchmarks.REGISTRY["aime24"]
  assert benchmarks.grade(bench, response, reference, truncated=False) == expected
  assert benchmarks.grade(bench, response, reference, truncated=True) == 0.0


@pytest.mark.parametrize("response, reference, expected", [
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("\\boxed{x^2+1}", "1+x^2", 1.0),
    ("\\boxed{x^2-1}", "1+x^2", 0.0),
])
def test_math_expression_grading(response, reference, expected):
  bench = benchmarks.REGISTRY["math500"]
  assert benchmarks.grade(bench, response, reference, truncated=False) == expected


@pytest.mark.parametrize("response, letter", [
    ("\\boxed{C}", "C"),
    ("<reason>A looks wrong</reason><answer>\\boxed{(C)}</answer>", "C"),
    ("\\boxed{\\text{C}}", "C"),
    ("\\boxed{\\textbf{(C)}}", "C"),
    ("$\\boxed{C}$", "C"),
    ("So it must be...\nThe answer is (C).", "C"),
    ("Answer: C", "C"),
    ("Final answer: **C**", "C"),
    ("(C)", "C"),
    ("reasoning\n\nC\n\n", "C"),
    # near misses: none of these is an answer
    ("\\boxed{C and D}", None),
    ("\\boxed{C) 42}", None),
    ("\\boxed{c}", None),                    # lower case
    ("\\boxed{3}", None),
    ("\\boxed{E}", None),                    # four options: A-D
    ("\\boxed{C}\nthen \\boxed{maybe}", None),   # the last box decides
    ("\\boxed{C", None),                     # unclosed
    ("I think C is right", None),            # a letter inside a sentence
    ("C or D", None),
    ("The answer is C because of D", None),
    ("answer: c", None),
    ("<answer>\\boxed{C}</answer> later A", "C"),   # the <answer> block decides
    ("<answer>no letter</answer>\\boxed{C}", None),
])
def test_choice_letters_are_graded_strictly(response, letter):
  assert answers.choice_letter(response, 4) == letter
  bench = benchmarks.REGISTRY["gpqa_diamond"]
  for ref in "ABCD":
    assert benchmarks.grade(bench, response, ref, truncated=False) == float(ref == letter)
  assert benchmarks.grade(bench, response, "C", truncated=True) == 0.0


def test_choice_letter_checks_the_number_of_options():
  assert answers.choice_letter("\\boxed{E}", 5) == "E"
  assert answers.choice_letter("\\boxed{B}", 1) is None
  with pytest.raises(ValueError):
    answers.choice_letter("\\boxed{A}", 0)


def test_the_option_order_is_stable_across_processes_and_reversible():
  keys = [f"rec{i}" for i in range(400)]
  here = [benchmarks.option_order(4, k, seed=3) for k in keys]
  code = ("import json; from rstar_jax.eval import benchmarks as b; "
          f"print(json.dumps([b.option_order(4, k, seed=3) for k in {keys!r}]))")
  for hash_seed in ("1", "2"):   # another process, another str hash: the same orders
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONHASHSEED": hash_seed}, check=True)
    assert json.loads(out.stdout) == here
  options = ["right", "w1", "w2", "w3"]
  for order in here:
    assert sorted(order) == [0, 1, 2, 3]
    shown = benchmarks.shuffle(options, order)
    assert benchmarks.unshuffle(shown, order) == options
    assert shown[order.index(0)] == "right"
  # Uniform over positions (a correct answer always at A would be a free 25%): each of the
  # four positions holds the correct answer 100 +- 4 sigma times of 400.
  counts = np.bincount([order.index(0) for order in here], minlength=4)
  assert np.all(np.abs(counts - 100) < 4 * np.sqrt(400 * 0.25 * 0.75)), counts
  # Another seed, other orders.
  other = [benchmarks.option_order(4, k, seed=4) for k in keys]
  assert sum(a != b for a, b in zip(here, other)) > 300


def test_the_shown_letter_follows_the_seed(tmp_path):
  path = fx.gpqa_diamond(str(tmp_path), n=40)
  a = benchmarks.load(benchmarks.REGISTRY["gpqa_diamond"], path, seed=0)
  b = benchmarks.load(benchmarks.REGISTRY["gpqa_diamond"], path, seed=0)
  c = benchmarks.load(benchmarks.REGISTRY["gpqa_diamond"], path, seed=1)
  assert [(p.problem, p.answer) for p in a] == [(p.problem, p.answer) for p in b]
  assert [p.answer for p in a] != [p.answer for p in c]
  assert len({p.answer for p in a}) == 4


def _reference_interval(scores, level, resamples, seed):
  """Independently: one resample at a time with Generator.choice, np.percentile."""
  rng = np.random.default_rng(seed + 1000)
  x = np.array(scores, dtype=float)
  means = [rng.choice(x, size=len(x), replace=True).mean() for _ in range(resamples)]
  return np.percentile(means, [50 * (1 - level), 100 - 50 * (1 - level)])


def test_bootstrap_interval_against_independent_references():
  rng = np.random.default_rng(0)
  for n, k in ((30, 16), (198, 4)):
    # Per-problem pass rates over k samples, of problems of mixed difficulty.
    scores = rng.binomial(k, rng.uniform(0, 1, size=n)) / k
    lo, hi = suite.bootstrap_interval(scores, seed=7)
    assert (lo, hi) == suite.bootstrap_interval(scores, seed=7)   # seeded
    assert lo < scores.mean() < hi
    ref_lo, ref_hi = _reference_interval(scores, 0.95, 20_000, seed=7)
    # Monte Carlo error of a 2.5% quantile of 10,000 resample means: well under 0.3 sd.
    sd = scores.std(ddof=1) / np.sqrt(n)
    assert abs(lo - ref_lo) < 0.15 * sd and abs(hi - ref_hi) < 0.15 * sd, (lo, ref_lo, hi, ref_hi)
    # scipy's percentile bootstrap, another implementation again.
    from scipy import stats
    res = stats.bootstrap((scores,), np.mean, confidence_level=0.95, n_resamples=20_000,
                          method="percentile", random_state=np.random.default_rng(3))
    assert abs(lo - res.confidence_interval.low) < 0.15 * sd
    assert abs(hi - res.confidence_interval.high) < 0.15 * sd
  assert suite.bootstrap_interval([0.5] * 10) == (0.5, 0.5)   # no spread, no width
  with pytest.raises(ValueError):
    suite.bootstrap_interval([])


def test_the_report_protocol_and_greedy_only_by_name():
  configured = eval_lib.EvalConfig(k=4)
  report = suite.protocol("report", configured)
  # arXiv 2508.20722 sec. 5.1: 16 samples, temperature 0.6, 30K tokens, 30 turns.
  assert (report.k, report.agent.temperature, report.agent.max_response_tokens,
          report.agent.max_turns, report.agent.top_p) == (16, 0.6, 30_720, 30, 1.0)
  assert suite.protocol("config", configured) == configured
  greedy_cfg = eval_lib.EvalConfig(
      k=4, agent=eval_lib.agent_loop.AgentConfig(temperature=0.0))
  with pytest.raises(ValueError, match="greedy"):
    suite.protocol("config", greedy_cfg)
  greedy = suite.protocol("greedy", configured)
  assert (greedy.k, greedy.agent.temperature) == (1, 0.0)
  with pytest.raises(ValueError, match="choose from"):
    suite.protocol("fast", configured)


def test_csv_rows_a_bom_and_a_row_with_too_many_cells(tmp_path):
  path = tmp_path / "gpqa.csv"
  header = "Question,Correct Answer,Incorrect Answer 1,Incorrect Answer 2,Incorrect Answer 3"
  path.write_text("\ufeff" + header + "\nQ1,a,b,c,d\nQ2,a,b,c,d,e\n", encoding="utf-8")
  text = _error("gpqa_diamond", str(path))
  assert f"{path}, row 2: 1 cell(s) more than the header's 5 columns" in text
  path.write_text("\ufeff" + header + "\nQ1,a,b,c,d\n", encoding="utf-8")
  (p,) = benchmarks.load(benchmarks.REGISTRY["gpqa_diamond"], str(path))
  assert p.uid == "gpqa:1" and p.meta["options"] == ["a", "b", "c", "d"]   # no id column
  # CSV is read where a layout names its columns, not as a math file of unknown columns.
  with pytest.raises(benchmarks.BenchmarkError, match="unknown file type"):
    benchmarks.load(benchmarks.get("my_csv"), str(path))


def test_the_14b_eval_config_builds_with_the_report_protocol():
  from rstar_jax import config_utils
  from rstar_jax.recipe import recipe_config
  c = config_utils._load_config_file(
      os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "configs",
                   "eval_rstar2_agent_14b.py"))
  cfg = recipe_config.build_config(c)
  assert suite.protocol("config", cfg.eval) == suite.protocol("report", cfg.eval)
  assert cfg.rollout.backend == "sglang"
  assert cfg.eval.agent.max_response_tokens < cfg.rollout.engine.max_len   # backend jax too
