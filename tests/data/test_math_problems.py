"""Tests for rstar_jax.data.math_problems (and the row loader of rstar_jax.data.rows it
reads with): layouts, malformed rows, filters, iteration."""
import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rstar_jax.data import math_problems as mp
from rstar_jax.data.rows import DataError
from rstar_jax.data.sft_examples import load_sft_examples

DAPO_PROMPT = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
    "\n\nWhat is $6 \\times 7$?\n\n"
    'Remember to put your answer on its own line after "Answer:".')


def _verl_row(text, answer, index):
  return {"data_source": "math_dapo", "prompt": [{"role": "user", "content": text}],
          "ability": "MATH", "reward_model": {"ground_truth": answer, "style": "rule"},
          "extra_info": {"index": index}}


def _write_jsonl(path, rows):
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
  return path


def _problems(n, prefix="p"):
  return [mp.MathProblem(f"{prefix}{i}", f"problem {i}", str(i), "test") for i in range(n)]


# ---------------------------------------------------------------------------- layouts


def test_dapo_parquet_layout(tmp_path):
  rows = [_verl_row(DAPO_PROMPT, "42", "a-1"), _verl_row("Compute 2+2.", "4", "a-2")]
  path = tmp_path / "dapo.parquet"
  pq.write_table(pa.Table.from_pylist(rows), path)
  result = mp.load_math_problems(path)
  assert [p.uid for p in result.items] == ["a-1", "a-2"]
  first = result.items[0]
  assert first.problem == "What is $6 \\times 7$?"  # DAPO wrapper stripped.
  assert first.answer == "42" and first.source == "math_dapo"
  assert first.meta["ability"] == "MATH" and first.meta["reward_style"] == "rule"
  assert result.num_rows == 2 and result.num_skipped == 0
  kept = mp.load_math_problems(path, strip_instructions=False).items[0]
  assert kept.problem.startswith("Solve the following")


def test_verl_jsonl_with_system_message(tmp_path):
  row = _verl_row("Find x.", 3, 7)
  row["prompt"].insert(0, {"role": "system", "content": "be brief"})
  result = mp.load_math_problems(_write_jsonl(tmp_path / "v.jsonl", [row]), layout="verl")
  (p,) = result.items
  assert (p.uid, p.problem, p.answer, p.meta["system"]) == ("7", "Find x.", "3", "be brief")


def test_plain_and_aime_layouts(tmp_path):
  plain = _write_jsonl(tmp_path / "math500.jsonl", [
      {"problem": "What is 1+1?", "answer": "2", "unique_id": "test/1.json", "level": 1}])
  aime = _write_jsonl(tmp_path / "aime24.jsonl", [
      {"ID": "2024-I-1", "Problem": "Find N.", "Answer": 204, "Solution": "..."}])
  aime25 = _write_jsonl(tmp_path / "aime25.jsonl", [{"question": "Find M.", "answer": "70"}])
  result = mp.load_math_problems([plain, aime, aime25])
  a, b, c = result.items
  assert (a.uid, a.problem, a.answer, a.meta["level"]) == ("test/1.json", "What is 1+1?", "2", 1)
  assert (b.uid, b.answer, b.source) == ("2024-I-1", "204", "aime24")
  assert (c.uid, c.problem, c.answer) == ("aime25:1", "Find M.", "70")


def test_solution_boxed_answer_and_json_array(tmp_path):
  path = tmp_path / "sol.json"
  path.write_text(json.dumps([
      {"problem": "P1", "solution": "So \\boxed{x} no, finally $\\boxed{\\frac{1}{2}}$."},
      {"problem": "P2", "solution": "thus \\boxed 5$"}]))
  first, second = mp.load_math_problems(path).items
  assert first.answer == "\\frac{1}{2}" and first.meta["solution"].startswith("So")
  assert second.answer == "5"


def test_unknown_file_type_and_missing_file(tmp_path):
  (tmp_path / "x.csv").write_text("a,b\n")
  with pytest.raises(ValueError, match="unknown file type"):
    mp.load_math_problems(tmp_path / "x.csv")
  with pytest.raises(FileNotFoundError, match="nope.jsonl"):
    mp.load_math_problems(tmp_path / "nope.jsonl")
  with pytest.raises(KeyError, match="known"):
    mp.load_math_problems(tmp_path / "x.csv", layout="hf")


# ---------------------------------------------------------------------------- malformed rows


@pytest.mark.parametrize("line, field, message", [
    ('{"problem": "ok", "answer": ', None, "invalid JSON"),
    ('{"answer": "3"}', "problem", "missing"),
    ('{"problem": 12, "answer": "3"}', "problem", "must be a string"),
    ('{"problem": "P", "answer": "  "}', "answer", "empty answer"),
    ('{"problem": "P", "answer": [1]}', "answer", "string or a number"),
    ('{"problem": "P"}', "answer", "missing"),
    ('{"problem": "P", "solution": "no box here"}', "solution", "boxed"),
    ('[1, 2]', None, "JSON object"),
    ('{"prompt": "P", "reward_model": {"style": "rule"}}', "reward_model.ground_truth", "missing"),
    ('{"prompt": [{"role": "user", "content": 5}], "reward_model": {"ground_truth": "1"}}',
     "prompt[0].content", "must be a string"),
    # An empty id was only refused by the evaluation's records, after all generation.
    ('{"id": "", "problem": "P", "answer": "1"}', "id", "empty id"),
    ('{"ID": " ", "problem": "P", "answer": "1"}', "ID", "empty id"),
    ('{"prompt": "P", "reward_model": {"ground_truth": "1"}, "extra_info": {"index": ""}}',
     "extra_info.index", "empty id"),
    # Its digits are gone already: it was read as 12345678901234567168.
    ('{"problem": "P", "answer": 12345678901234567890.0}', "answer", "above 2**53"),
    ('{"problem": "P", "answer": -1.2345678901234567e20}', "answer", "above 2**53"),
])
def test_malformed_row_names_file_line_and_field(tmp_path, line, field, message):
  good = json.dumps({"problem": "fine", "answer": "1"})
  path = tmp_path / "bad.jsonl"
  path.write_text(f"{good}\n\n{line}\n")  # The blank line 2 still counts: the bad row is line 3.
  with pytest.raises(DataError) as info:
    mp.load_math_problems(path)
  error = info.value.row_error
  assert (error.row, error.unit, error.field) == (3, "line", field)
  assert message in str(info.value)
  assert "bad.jsonl, line 3" in str(info.value)


def test_float_answers_are_written_positionally(tmp_path):
  """repr gave '5e-05', which math-verify does not match against '0.00005'."""
  values = [0.00005, 2.5e-7, 0.1, -3.25, 12.0, -0.0, float(2**53), -1e20, 1.5e21]
  path = _write_jsonl(tmp_path / "f.jsonl", [{"problem": f"p{i}", "answer": v}
                                             for i, v in enumerate(values)])
  # Big whole floats with few digits read back as written (1e20 was refused as inexact).
  assert [p.answer for p in mp.load_math_problems(path).items] == [
      "0.00005", "0.00000025", "0.1", "-3.25", "12", "0", "9007199254740992",
      "-100000000000000000000", "1500000000000000000000"]


def test_upper_case_gz_suffix_is_decompressed(tmp_path):
  """The reader was chosen case-insensitively but gzip case-sensitively: a .JSONL.GZ file
  was read as compressed bytes (not UTF-8)."""
  path = tmp_path / "up.JSONL.GZ"
  path.write_bytes(gzip.compress(b'{"problem": "p", "answer": "1"}\n'))
  (p,) = mp.load_math_problems(path).items
  assert (p.problem, p.answer) == ("p", "1")


def test_parquet_error_names_row(tmp_path):
  rows = [{"problem": "a", "answer": "1"}, {"problem": "b", "answer": ""}]
  path = tmp_path / "t.parquet"
  pq.write_table(pa.Table.from_pylist(rows), path)
  with pytest.raises(DataError, match=r"t\.parquet, row 2, field 'answer': empty answer"):
    mp.load_math_problems(path)


def _write_empty(path, kind):
  """Writes a file of `kind` that holds no rows."""
  if kind == "zero bytes":
    path.write_bytes(b"")
  elif kind == "blank lines":
    text = "\n  \n\t\n"
    if path.name.endswith(".gz"):
      with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(text)
    else:
      path.write_text(text)
  elif kind == "empty array":
    path.write_text("[]\n")
  elif kind == "empty data array":
    path.write_text('{"data": []}')
  elif kind == "zero-row table":
    pq.write_table(pa.table({"problem": pa.array([], pa.string()),
                             "answer": pa.array([], pa.string())}), path)
  return path


@pytest.mark.parametrize("name, kind", [
    ("e.jsonl", "zero bytes"), ("e.jsonl", "blank lines"),
    ("e.jsonl.gz", "zero bytes"), ("e.jsonl.gz", "blank lines"),
    ("e.json", "zero bytes"), ("e.json", "blank lines"), ("e.json", "empty array"),
    ("e.json", "empty data array"),
    ("e.parquet", "zero bytes"), ("e.parquet", "zero-row table"),
])
@pytest.mark.parametrize("load", [mp.load_math_problems, load_sft_examples])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_empty_file_is_an_error_naming_it(tmp_path, name, kind, load, on_error):
  path = _write_empty(tmp_path / name, kind)
  with pytest.raises(DataError, match="no rows: the file is empty or holds only blank lines"
                     ) as info:
    load(path, on_error=on_error)
  assert str(path) in str(info.value) and info.value.path == str(path)
  assert info.value.row_error is None


def test_empty_file_among_good_ones_is_named(tmp_path):
  good = _write_jsonl(tmp_path / "good.jsonl", [{"problem": "p", "answer": "1"}])
  empty = _write_empty(tmp_path / "empty.jsonl", "blank lines")
  with pytest.raises(DataError, match=r"empty\.jsonl: no rows"):
    mp.load_math_problems([good, empty])
  assert len(mp.load_math_problems([good, good]).items) == 2


def test_skip_mode_counts_and_reports(tmp_path):
  lines = [json.dumps({"problem": f"p{i}", "answer": str(i)}) for i in range(4)]
  lines.insert(1, "not json")
  lines.insert(3, json.dumps({"problem": "x", "answer": ""}))
  lines.append(json.dumps({"problem": None, "answer": "1"}))
  path = _write_jsonl(tmp_path / "mixed.jsonl", lines)
  result = mp.load_math_problems(path, on_error="skip", max_reported=2)
  assert [p.problem for p in result.items] == ["p0", "p1", "p2", "p3"]
  assert (result.num_rows, result.num_skipped) == (7, 3)
  assert [e.row for e in result.errors] == [2, 4]  # Only the first two reasons are kept...
  assert "skipped 3" in result.summary() and "1 more" in result.summary()  # ...all are counted.
  with pytest.raises(ValueError, match="on_error"):
    mp.load_math_problems(path, on_error="ignore")


# ---------------------------------------------------------------------------- filters


@pytest.mark.parametrize("text, value", [
    ("42", "42"), ("-7", "-7"), ("+3", "3"), ("1,000", "1000"), ("1{,}000", "1000"),
    ("1\\,000", "1000"), ("$42$", "42"), ("\\boxed{12}", "12"), (" 007 ", "7"),
    ("12,345,678", "12345678"), ("1/2", None), ("\\sqrt{2}", None), ("3.5", None),
    ("42.0", None), ("(1,2)", None), ("1,2", None), ("12,34", None), ("\\frac{1}{2}", None)])
def test_integer_filter_cases(text, value):
  kept, dropped = mp.filter_integer_answers([mp.MathProblem("u", "P", text, "s")])
  assert [p.answer for p in kept] == ([] if value is None else [value])
  assert len(dropped) == (value is None)


def test_filter_integer_answers():
  problems = [mp.MathProblem("a", "A", "1,000", "s"), mp.MathProblem("b", "B", "1/2", "s"),
              mp.MathProblem("c", "C", "-7", "s"), mp.MathProblem("d", "D", "\\sqrt{2}", "s")]
  kept, dropped = mp.filter_integer_answers(problems)
  assert [(p.uid, p.answer) for p in kept] == [("a", "1000"), ("c", "-7")]
  assert kept[0].meta["raw_answer"] == "1,000" and "raw_answer" not in kept[1].meta
  assert [p.uid for p in dropped] == ["b", "d"]


def test_deduplicate_by_normalised_text():
  problems = [mp.MathProblem("a", "What is  2+2?", "4", "s"),
              mp.MathProblem("b", "what is 2+2?\n", "4", "s"),
              mp.MathProblem("c", "What is 3+3?", "6", "s"),
              mp.MathProblem("d", "WHAT IS 2+2?", "5", "s")]
  kept, duplicates = mp.deduplicate(problems)
  assert [p.uid for p in kept] == ["a", "c"]
  assert [p.uid for p in duplicates] == ["b", "d"]


def test_split_is_seeded_and_disjoint():
  problems = _problems(20)
  train, held = mp.split_problems(problems, held_out=0.25, seed=3)
  assert len(held) == 5 and len(train) == 15
  assert {p.uid for p in train} | {p.uid for p in held} == {p.uid for p in problems}
  assert mp.split_problems(problems, held_out=5, seed=3) == (train, held)
  assert mp.split_problems(problems, held_out=5, seed=4) != (train, held)
  with pytest.raises(ValueError, match="held_out"):
    mp.split_problems(problems, held_out=21, seed=0)


# ---------------------------------------------------------------------------- iterator


def _uids(batch):
  return [p.uid for p in batch]


def test_iterator_is_deterministic_and_reshuffles_each_epoch():
  problems = _problems(10)
  a = mp.EpochIterator(problems, batch_size=3, seed=7)
  b = mp.EpochIterator(problems, batch_size=3, seed=7)
  run_a = [_uids(next(a)) for _ in range(9)]
  assert run_a == [_uids(next(b)) for _ in range(9)]
  assert all(len(batch) == 3 for batch in run_a)
  epoch0, epoch1 = sum(run_a[:3], []), sum(run_a[3:6], [])
  assert len(set(epoch0)) == 9 and len(set(epoch1)) == 9  # No repeats inside an epoch.
  assert epoch0 != epoch1
  assert a.epoch == 3 and a.batches_per_epoch == 3
  other = mp.EpochIterator(problems, batch_size=3, seed=8)
  assert [_uids(next(other)) for _ in range(3)] != run_a[:3]


@pytest.mark.parametrize("drop_remainder", [True, False])
@pytest.mark.parametrize("stop_after", [1, 3, 4, 5])
def test_iterator_resumes_exactly(drop_remainder, stop_after):
  problems = _problems(10)
  reference = mp.EpochIterator(problems, batch_size=3, seed=1, drop_remainder=drop_remainder)
  expected = [_uids(next(reference)) for _ in range(stop_after + 6)]
  first = mp.EpochIterator(problems, batch_size=3, seed=1, drop_remainder=drop_remainder)
  for _ in range(stop_after):
    next(first)
  state = json.loads(json.dumps(first.state()))  # Must survive a JSON checkpoint.
  resumed = mp.EpochIterator(problems, batch_size=3, seed=1, drop_remainder=drop_remainder)
  resumed.restore(state)
  assert [_uids(next(resumed)) for _ in range(6)] == expected[stop_after:]


def test_iterator_short_last_batch_and_num_epochs():
  it = mp.EpochIterator(_problems(5), batch_size=2, seed=0, drop_remainder=False, num_epochs=2)
  sizes = [len(batch) for batch in it]
  assert sizes == [2, 2, 1, 2, 2, 1]


def test_iterator_rejects_foreign_state_and_bad_settings():
  it = mp.EpochIterator(_problems(6), batch_size=2, seed=0)
  with pytest.raises(ValueError, match="fingerprint"):
    it.restore(mp.EpochIterator(_problems(6, "q"), batch_size=2, seed=0).state())
  with pytest.raises(ValueError, match="seed"):
    it.restore(mp.EpochIterator(_problems(6), batch_size=2, seed=1).state())
  with pytest.raises(ValueError, match="lacks"):
    it.restore({"epoch": 0})
  with pytest.raises(ValueError, match="batch_size"):
    mp.EpochIterator(_problems(2), batch_size=3)
  with pytest.raises(ValueError, match="duplicate uid"):
    mp.EpochIterator(_problems(2) + _problems(1), batch_size=1)


def test_iterator_refuses_a_reordered_file_and_an_old_state(tmp_path):
  """The fingerprint hashed uids only: a file rewritten in another order keeps its default
  uids `<stem>:<row>`, and a resumed run repeated some problems and skipped others."""
  rows = [{"problem": f"problem {i}", "answer": str(i)} for i in range(8)]
  path = _write_jsonl(tmp_path / "train.jsonl", rows)
  it = mp.EpochIterator(mp.load_math_problems(path).items, batch_size=2, seed=0)
  next(it)
  state = json.loads(json.dumps(it.state()))
  _write_jsonl(path, rows[::-1])
  reordered = mp.EpochIterator(mp.load_math_problems(path).items, batch_size=2, seed=0)
  with pytest.raises(ValueError, match="fingerprint"):
    reordered.restore(state)
  answers = [dict(r, answer="0") for r in rows]   # same uids and problems, other answers
  relabelled = mp.EpochIterator(mp.load_math_problems(_write_jsonl(path, answers)).items,
                                batch_size=2, seed=0)
  with pytest.raises(ValueError, match="fingerprint"):
    relabelled.restore(state)
  same = mp.EpochIterator(mp.load_math_problems(_write_jsonl(path, rows)).items,
                          batch_size=2, seed=0)
  same.restore(state)
  # A state from before (version 1: a fingerprint of the uids only) still resumes a run
  # across the upgrade, checked as it was then; over other uids it is refused.
  old = dict(state, version=1, fingerprint=mp._fingerprint_v1(same._items))
  same.restore(old)
  assert same.state()["position"] == state["position"]
  other = mp.EpochIterator(_problems(8, "q"), batch_size=2, seed=0)
  with pytest.raises(ValueError, match="version 1.*uids differ"):
    other.restore(old)


def test_undecodable_and_truncated_files_are_named(tmp_path):
  """A non-UTF-8 line is one bad row (named; skipped in skip mode, the other rows kept);
  a truncated .jsonl.gz / .parquet or a non-UTF-8 .json names the file, not a bare
  UnicodeDecodeError / EOFError / ArrowInvalid. A UTF-8 BOM is not an error."""
  good = [json.dumps({"problem": f"p{i}", "answer": str(i)}).encode() for i in range(3)]
  path = tmp_path / "latin1.jsonl"
  path.write_bytes(b"\xef\xbb\xbf" + good[0] + b"\n"
                   + '{"problem": "café", "answer": "1"}'.encode("latin-1") + b"\n"
                   + good[1] + b"\n" + good[2] + b"\n")
  with pytest.raises(DataError, match=r"latin1.jsonl, line 2: not UTF-8 \(byte 0xe9"):
    mp.load_math_problems(path)
  result = mp.load_math_problems(path, on_error="skip")
  assert [p.problem for p in result.items] == ["p0", "p1", "p2"] and result.num_skipped == 1
  huge = _write_jsonl(tmp_path / "huge.jsonl", [good[0].decode(),
                                                '{"problem": "x", "answer": ' + "1" * 5000 + "}",
                                                "[" * 100_000])
  result = mp.load_math_problems(huge, on_error="skip")   # a row each, not a traceback
  assert len(result.items) == 1 and [e.message[:30] for e in result.errors] == [
      "invalid JSON (ValueError: Exce", "invalid JSON (RecursionError: "]

  whole = gzip.compress(b"\n".join(good * 200) + b"\n")
  gz = tmp_path / "cut.jsonl.gz"
  gz.write_bytes(whole[: len(whole) // 2])
  with pytest.raises(DataError, match=r"cut.jsonl.gz: corrupt or truncated after line"):
    mp.load_math_problems(gz, on_error="skip")

  js = tmp_path / "rows.json"
  js.write_bytes(b'[{"problem": "caf\xe9", "answer": "1"}]')
  with pytest.raises(DataError, match=r"rows.json: not UTF-8 \(byte 0xe9"):
    mp.load_math_problems(js)

  pq_path = tmp_path / "cut.parquet"
  pq.write_table(pa.table({"problem": ["p"] * 100, "answer": ["1"] * 100}), pq_path)
  pq_path.write_bytes(pq_path.read_bytes()[:-20])
  with pytest.raises(DataError, match=r"cut.parquet: corrupt or truncated Parquet"):
    mp.load_math_problems(pq_path, on_error="skip")


def test_files_that_share_a_name_give_distinct_uids_and_eval_clashes_fail_at_load(tmp_path):
  """aime24/test.jsonl and aime25/test.jsonl both gave uids test:1, test:2, ...: the
  evaluation then failed after generating everything. Default uids now carry the
  directory when names clash; ids from the rows that clash in the eval data are refused
  when the files are loaded."""
  from rstar_jax.data import data_config
  rows = [{"problem": f"q{i}", "answer": str(i)} for i in range(2)]
  a = _write_jsonl((tmp_path / "aime24").mkdir() or tmp_path / "aime24" / "test.jsonl", rows)
  b = _write_jsonl((tmp_path / "aime25").mkdir() or tmp_path / "aime25" / "test.jsonl", rows)
  c = _write_jsonl(tmp_path / "other.jsonl", rows)
  uids = [p.uid for p in mp.load_math_problems([a, b, c]).items]
  assert uids == ["aime24/test:1", "aime24/test:2", "aime25/test:1", "aime25/test:2",
                  "other:1", "other:2"]
  assert [p.uid for p in mp.load_math_problems(a).items] == ["test:1", "test:2"]   # as before
  pq.write_table(pa.table({"problem": ["q9"], "answer": ["9"]}), tmp_path / "other.parquet")
  assert [p.uid for p in mp.load_math_problems([c, tmp_path / "other.parquet"]).items] == [
      "other.jsonl:1", "other.jsonl:2", "other.parquet:1"]
  _, evals = data_config.load_problems(
      data_config.DataConfig(kind="files", eval_files=(str(a), str(b))), seed=0)
  assert len({p.uid for p in evals}) == 4
  with_ids = [dict(r, id=i) for i, r in enumerate(rows)]
  x = _write_jsonl(tmp_path / "x.jsonl", with_ids)
  y = _write_jsonl(tmp_path / "y.jsonl", with_ids)
  with pytest.raises(DataError, match=r"x.jsonl, .*y.jsonl: evaluation problems: 2 duplicate "
                                         r"uid\(s\), e.g. '0' \(items 0 and 2\)"):
    data_config.load_problems(
        data_config.DataConfig(kind="files", eval_files=(str(x), str(y))), seed=0)


def _train(*paths):
  from rstar_jax.data import data_config
  cfg = data_config.DataConfig(kind="files", train_files=tuple(str(p) for p in paths))
  return data_config.load_problems(cfg, seed=0)[0]


def test_training_files_numbered_from_zero_each_get_file_prefixed_uids(tmp_path):
  """verl numbers extra_info.index from 0 in every file: two training files shared uids,
  and only RL's EpochIterator refused them, after SFT had run."""
  dapo = _write_jsonl(tmp_path / "dapo.jsonl", [_verl_row(f"dapo {i}", str(i), i)
                                                for i in range(3)])
  deepscaler = _write_jsonl(tmp_path / "deepscaler.jsonl", [
      _verl_row(f"deepscaler {i}", str(i), i) for i in range(4)])
  aime = _write_jsonl(tmp_path / "aime.jsonl", [_verl_row("aime 0", "7", "2024-I-1")])
  train = _train(dapo, deepscaler, aime)
  assert [p.uid for p in train] == [   # every id of a file that shares any; others as they were
      "dapo:0", "dapo:1", "dapo:2", "deepscaler:0", "deepscaler:1", "deepscaler:2",
      "deepscaler:3", "2024-I-1"]
  assert train[0].meta["extra_info"] == {"index": 0}   # the row's own id is kept
  mp.EpochIterator(train, batch_size=2)
  assert [p.uid for p in _train(dapo)] == ["0", "1", "2"]   # one file: unchanged
  # The eval files keep refusing shared ids (test above); the plain loader leaves them.
  assert [p.uid for p in mp.load_math_problems([dapo, deepscaler]).items][:4] == [
      "0", "1", "2", "0"]


def test_a_duplicate_id_in_one_file_names_both_rows(tmp_path):
  rows = [_verl_row("first", "1", 0), _verl_row("second", "2", 1), _verl_row("third", "3", 0)]
  path = _write_jsonl(tmp_path / "t.jsonl", rows)
  with pytest.raises(DataError, match=r"t.jsonl, line 3, field 'extra_info.index': duplicate "
                                         r"id '0': line 1 has it for another problem"):
    _train(path)
  result = mp.load_math_problems(path, on_error="skip")
  assert [p.problem for p in result.items] == ["first", "second"] and result.num_skipped == 1
  # A repeated copy of a problem (DAPO-Math-17k repeats each one) is no clash: deduplicated.
  copies = _write_jsonl(tmp_path / "c.jsonl", [_verl_row("same", "1", 0)] * 3)
  assert [p.uid for p in _train(copies)] == ["0"]


def test_training_uids_that_still_clash_are_refused_at_load(tmp_path):
  """a.jsonl's row 2 has id 1, prefixed to 'a:1': the default uid of its row 1."""
  a = _write_jsonl(tmp_path / "a.jsonl", [{"problem": "p", "answer": "1"},
                                          {"id": 1, "problem": "q", "answer": "2"}])
  b = _write_jsonl(tmp_path / "b.jsonl", [{"id": 1, "problem": "r", "answer": "3"}])
  with pytest.raises(DataError, match=r"a.jsonl, .*b.jsonl: training problems: 1 duplicate "
                                         r"uid\(s\), e.g. 'a:1'"):
    _train(a, b)
