"""Toy arithmetic task: problems, rStar2-format SFT traces, noise shares, SFT masks."""
import contextlib
import io
import math
import random
import re

import pytest

from rstar_jax.data import toy_task
from rstar_jax.rollout import chat


def _exec_stdout(code: str) -> str:
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(code, {})  # pylint: disable=exec-used
  return out.getvalue()


@pytest.fixture(scope="module")
def tok():
  return toy_task.train_toy_tokenizer(n=400, seed=0)


@pytest.fixture(scope="module")
def proto(tok):
  return chat.ChatProtocol(tok, toy_task.toy_chat_config())


@pytest.fixture(scope="module")
def traces():
  problems = toy_task.generate_problems(400, seed=11)
  return toy_task.make_traces(problems, seed=12, config=toy_task.TraceConfig(
      bug_share=0.3, no_tool_share=0.2))


def test_problems_are_seeded_and_answers_correct():
  a = toy_task.generate_problems(200, seed=3)
  assert a == toy_task.generate_problems(200, seed=3)
  assert a != toy_task.generate_problems(200, seed=4)
  assert {p.kind for p in a} == set(toy_task.kinds())
  assert {p.level for p in a} == set(range(1, toy_task.NUM_LEVELS + 1))
  for p in a:
    assert _exec_stdout(p.code) == f"{p.answer}\n"
    assert isinstance(p.answer, int)
    row = p.as_row()
    assert row["problem"] == p.problem and int(row["answer"]) == p.answer
    # The code spells out the problem's expression verbatim (copy-friendly for a tiny model).
    expr = re.fullmatch(r"What is (?:the sum of the digits of )?(\S+)\?", p.problem).group(1)
    assert expr in p.code, (p.problem, p.code)


def test_level_0_has_two_digit_operands_and_is_drawn_only_when_asked_for():
  for kind in ("product", "sum", "digit_sum", "modpow"):
    for p in toy_task.generate_problems(40, seed=2, levels=[0], kinds=[kind]):
      numbers = re.findall(r"\d+", p.problem)
      assert all(len(n) <= 2 for n in numbers), p.problem
      assert _exec_stdout(p.code) == f"{p.answer}\n"
  assert 0 not in {p.level for p in toy_task.generate_problems(300, seed=3)}


def test_levels_make_problems_harder():
  rng = random.Random(0)
  for kind in ("product", "sum", "digit_sum", "modpow"):
    easy = toy_task.make_problem(rng, kind, 1)
    hard = toy_task.make_problem(rng, kind, toy_task.NUM_LEVELS)
    digits = lambda p: sum(len(n) for n in re.findall(r"\d+", p.problem))
    assert digits(hard) > digits(easy)
  # Products at level 1 are 3x3 digits (5-6 digit answers); at level 5, 5x5.
  products = toy_task.generate_problems(50, seed=1, levels=[1], kinds=["product"])
  assert all(10_000 <= p.answer < 1_000_000 for p in products)
  products = toy_task.generate_problems(50, seed=1, levels=[5], kinds=["product"])
  assert all(p.answer >= 10 ** 8 for p in products)


def test_bad_problem_arguments():
  with pytest.raises(ValueError, match=r"level must be an int in 0\.\.5, got 6"):
    toy_task.generate_problems(3, seed=0, levels=[6])
  with pytest.raises(ValueError, match=r"level must be an int in 0\.\.5, got -1"):
    toy_task.generate_problems(3, seed=0, levels=[-1])
  with pytest.raises(ValueError, match="unknown toy problem kind 'cube'; known:"):
    toy_task.generate_problems(3, seed=0, kinds=["cube"])
  with pytest.raises(ValueError, match="already registered"):
    toy_task.register("product")(lambda rng, level: ("", "0", 0))


def test_trace_code_prints_the_answer_and_tool_text_is_real(traces):
  cfg = toy_task.toy_chat_config()
  for t in traces:
    msgs = t.messages
    assert msgs[0] == {"role": "user", "content": t.problem.problem}
    final = msgs[-1]["content"]
    assert final.endswith(f"\n</reason>\n<answer>\n\\boxed{{{t.final_answer}}}\n</answer>")
    assert "<reason>" not in final  # opened by the generation prompt
    if t.variant == "no_tool":
      assert len(msgs) == 2 and not t.codes
      continue
    assert t.correct
    assert _exec_stdout(t.codes[-1]) == f"{t.problem.answer}\n"
    tools = [m for m in msgs if m["role"] == "tool"]
    assert len(tools) == len(t.codes) == (2 if t.variant == "bug_fixed" else 1)
    for code, tool in zip(t.codes, tools):
      timed = re.search(r"execution time: ([\d.]+)s$", tool["content"])
      assert bool(timed) == cfg.show_execution_time
      wall = float(timed.group(1)) if timed else 0.01
      result = toy_task.run_code(code, wall_time=wall)
      assert tool["content"] == chat.truncate_middle(
          chat.render_executor_result(result, cfg), cfg.response_max_chars)
    assert tools[-1]["content"].startswith(f"Tool call success\nstdout: {t.problem.answer}\n")
    if t.variant == "bug_fixed":
      error = tools[0]["content"]
      assert error.startswith("Tool call failure\nreason: error\nstderr: ")
      assert re.search(r"(SyntaxError at line 1: '\(' was never closed|NameError at line 1: "
                       r"name 'prnt' is not defined)\n    \S", error), error
      with pytest.raises((SyntaxError, NameError)):
        _exec_stdout(t.codes[0])


def test_executor_error_format():
  result = toy_task.run_code("x = 1\ny = 2\nprint(z)")
  assert result["status"] == "error"
  assert result["error"] == "NameError at line 3: name 'z' is not defined\n    print(z)"
  result = toy_task.run_code("print(1)\nprint((2)")
  assert result["error"] == "SyntaxError at line 2: '(' was never closed\n    print((2)"
  assert toy_task.run_code("print(7)") == {"status": "ok", "stdout": "7\n", "stderr": "",
                                           "wall_time": 0.01}


def test_noise_shares_match_config():
  n = 3000
  cfg = toy_task.TraceConfig(bug_share=0.25, no_tool_share=0.15, no_tool_correct_share=0.4)
  problems = toy_task.generate_problems(n, seed=5, levels=[1], kinds=["sum"])
  traces = toy_task.make_traces(problems, seed=6, config=cfg)
  counts = {v: sum(t.variant == v for t in traces) for v in toy_task.VARIANTS}

  def within(k, total, p):  # 5 binomial standard deviations
    return abs(k - total * p) <= 5 * math.sqrt(total * p * (1 - p))

  assert within(counts["bug_fixed"], n, 0.25), counts
  assert within(counts["no_tool"], n, 0.15), counts
  no_tool = [t for t in traces if t.variant == "no_tool"]
  assert within(sum(t.correct for t in no_tool), len(no_tool), 0.4)
  assert all(t.correct for t in traces if t.variant != "no_tool")
  wrong = [t for t in no_tool if not t.correct]
  assert all(len(str(t.final_answer)) == len(str(t.problem.answer)) for t in wrong)
  bugs = [t.codes[0] for t in traces if t.variant == "bug_fixed"]
  assert {c.startswith("prnt(") for c in bugs} == {True, False}
  clean = toy_task.make_traces(problems[:200], seed=1, config=toy_task.TraceConfig(
      bug_share=0.0, no_tool_share=0.0))
  assert all(t.variant == "clean" for t in clean)


@pytest.mark.parametrize("kwargs, message", [
    (dict(bug_share=0.7, no_tool_share=0.4), "bug_share \\+ no_tool_share must be <= 1"),
    (dict(bug_share=-0.1), "bug_share must be in"),
    (dict(no_tool_correct_share=2), "no_tool_correct_share must be in"),
    (dict(bug_kinds=("typo",)), "bug_kinds must be a non-empty subset"),
])
def test_trace_config_validation(kwargs, message):
  with pytest.raises(ValueError, match=message):
    toy_task.TraceConfig(**kwargs)


def test_sft_mask_covers_exactly_the_assistant_tokens(tok, proto, traces):
  im_end = "<|im_end|>"
  for t in traces:
    rendered = toy_task.render_trace(proto, t)
    assert len(rendered.ids) == len(rendered.loss_mask)
    assert rendered.ids[:rendered.prompt_len] == proto.prompt_ids(t.problem.problem)
    assert tok.decode(rendered.ids) == toy_task.conversation_text(t.messages, proto.config)
    runs, other, current, cur_other = [], [], [], []
    for i, m in zip(rendered.ids, rendered.loss_mask):
      (current if m else cur_other).append(i)
      if m and cur_other:
        other.append(tok.decode(cur_other))
        cur_other = []
      elif not m and current:
        runs.append(tok.decode(current))
        current = []
    runs.append(tok.decode(current))
    assistant = [chat.assistant_text(m) for m in t.messages if m["role"] == "assistant"]
    assert runs == [a for a in assistant[:-1]] + [assistant[-1] + im_end]
    # Everything else is prompt or tool side: system/user/tool text and the separators.
    for text in other[1:]:
      assert text.startswith(im_end + "\n<|im_start|>user\n<tool_response>\n")
      assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n<reason>")


def test_rollout_of_the_trace_reproduces_the_sft_ids(tok, proto, traces):
  """Drive the protocol as the agent loop does, 'sampling' the trace's own tokens."""
  for t in traces[:60]:
    ids = proto.prompt_ids(t.problem.problem)
    mask = [0] * len(ids)
    msgs = list(t.messages[1:])
    while True:
      gen = tok.encode(chat.assistant_text(msgs.pop(0)))
      turn = proto.parse_turn(gen)
      if not turn.wants_tool:
        gen.append(proto.token_ids.im_end)
        ids += gen
        mask += [1] * len(gen)
        break
      assert turn.stop == "tool_call" and len(turn.calls) == 1 and turn.calls[0].ok
      response = msgs.pop(0)["content"]
      timed = re.search(r"execution time: ([\d.]+)s$", response)
      wall = float(timed.group(1)) if timed else 0.01
      assert proto.tool_response_text(
          turn.calls[0], toy_task.run_code(turn.calls[0].code, wall)) == response
      tool = proto.tool_turn_ids(gen, [response])
      ids += gen + tool
      mask += [1] * len(gen) + [0] * len(tool)
    rendered = toy_task.render_trace(proto, t)
    assert (ids, mask) == (rendered.ids, rendered.loss_mask)
    stats = proto.format_stats(ids[rendered.prompt_len:], mask[rendered.prompt_len:])
    assert stats.answer_tags == 1
    assert stats.assistant_turns == 1 + len(t.codes)


def test_numbers_are_the_same_chunk_ids_wherever_they_occur(tok):
  # Copying a number from the problem into the code and from stdout into the answer
  # must be copying the same ids, whatever precedes the number.
  chunks = toy_task.number_chunks()
  assert len(chunks) == 1110
  assert all(len(tok.encode(c)) == 1 for c in chunks)
  for n in (7, 42, 905, 1000, 45678, 1000050, 98765432):
    ids = tok.encode(str(n))
    assert len(ids) == math.ceil(len(str(n)) / 3)
    assert tok.decode(ids) == str(n)
    for context in ("What is {}*3?", "print({}*3)", "stdout: {}\n", "\\boxed{{{}}}",
                    "The result is {}."):
      text = context.format(n)
      got = tok.encode(text)
      assert any(got[i:i + len(ids)] == ids for i in range(len(got))), (text, got, ids)


@pytest.mark.parametrize("chunk,want", [(1, ["4", "5", "6", "7", "0"]),
                                         (2, ["45", "67", "0"]), (3, ["456", "70"])])
def test_number_chunk_sets_how_numbers_are_cut(chunk, want):
  tok = toy_task.train_toy_tokenizer(1024 if chunk == 1 else 2048, n=200, seed=0,
                                     number_chunk=chunk)
  pieces = [tok.decode([i]) for i in tok.encode("print(45670)")]
  assert [p for p in pieces if any(c.isdigit() for c in p)] == want
  if chunk > 1:
    assert all(len(tok.encode(c)) == 1 for c in toy_task.number_chunks(chunk))
  with pytest.raises(ValueError, match="number chunk size"):
    toy_task.train_toy_tokenizer(n=10, number_chunk=0)


def test_toy_sequences_are_short(tok, proto, traces):
  assert tok.vocab_size <= 2048
  for name in ("<|im_start|>", "<tool_call>", "</tool_call>", "<reason>", "</answer>"):
    assert tok.encode(name) == [tok.token_id(name)]
  lengths = {}
  for t in traces:
    lengths.setdefault(t.variant, []).append(len(toy_task.render_trace(proto, t).ids))
  mean = {k: sum(v) / len(v) for k, v in lengths.items()}
  assert mean["clean"] <= 250 and mean["no_tool"] <= 150 and mean["bug_fixed"] <= 400, mean
  assert max(max(v) for v in lengths.values()) <= 512
  assert len(proto.prompt_ids("What is 123 * 456?")) <= 100


def test_rows_pass_the_sft_loader_and_render_the_same(proto, traces):
  from rstar_jax.data import sft_examples
  for t in traces[:40]:
    row = t.as_row()
    messages = sft_examples.validate_messages(row["messages"])
    assert proto.render_conversation(messages) == proto.render_conversation(t.messages)


def test_tokenizer_corpus_is_deterministic_and_round_trips(tok):
  corpus = toy_task.tokenizer_corpus(50, seed=2)
  assert corpus == toy_task.tokenizer_corpus(50, seed=2)
  assert any("<tool_response>" in c for c in corpus)
  for text in corpus:
    assert tok.decode(tok.encode(text)) == text


def test_toy_errors_read_like_the_sandbox_errors():
  """SFT traces must show the model the same error text RL rollouts will show it."""
  from sandbox import runner, schema
  for code in ("prnt(12 * 3)", "print(sum(int(d) for d in str(12 * 3))", "x = 1\nprint(z)"):
    with contextlib.redirect_stderr(io.StringIO()):
      fields = runner.run_cell(code, {"__name__": "__main__"})
    sandbox_result = schema.Result(**fields)
    toy = toy_task.run_code(code)
    assert toy["status"] == sandbox_result.status == "error"
    assert toy["error"] == sandbox_result.error_text()
    cfg = toy_task.toy_chat_config()
    as_sandbox = dict(sandbox_result.to_dict(), wall_time=toy["wall_time"])
    assert chat.render_executor_result(as_sandbox, cfg) == chat.render_executor_result(toy, cfg)


def test_copy_probe_masks_the_digits_of_the_code_and_of_the_answer(tok, proto):
  problems = toy_task.generate_problems(24, seed=5, levels=[1, 2])
  arrays, mask, in_code = toy_task.copy_probe(proto, problems, seed=6)
  for i, p in enumerate(problems):
    targets = arrays["target_ids"][i]
    code = tok.decode([int(t) for t, m, c in zip(targets, mask[i], in_code[i]) if m and c])
    answer = tok.decode([int(t) for t, m, c in zip(targets, mask[i], in_code[i])
                         if m and not c])
    expr = re.search(r"print\((.*)\)$", p.code).group(1)
    # Every digit the assistant writes is a copy: the operands (never the prompt's own
    # copy of them), then the printed result, twice (restated, then boxed).
    assert code == re.sub(r"\D", "", expr), (p.problem, code)
    assert answer == str(p.answer) * 2, (p.problem, answer)


def test_the_workdir_tokenizer_is_reused_only_with_the_settings_it_was_trained_with(tmp_path):
  """A run stopped before its first checkpoint may change its config; the toy tokenizer it
  had trained stayed in the workdir and was used under the new settings, config.json then
  stating a vocabulary the run did not have."""
  from rstar_jax.data import data_config
  cfg = data_config.TokenizerConfig(kind="toy", vocab_size=600, number_chunk=3)
  tok = data_config.build_tokenizer(cfg, str(tmp_path), seed=0)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer"]   # no temporary left
  again = data_config.build_tokenizer(cfg, str(tmp_path), seed=0)
  assert again.vocab_size == tok.vocab_size
  bigger = data_config.TokenizerConfig(kind="toy", vocab_size=900, number_chunk=3)
  with pytest.raises(ValueError, match="was trained with .*'vocab_size': 600.* asks for "
                                       ".*'vocab_size': 900"):
    data_config.build_tokenizer(bigger, str(tmp_path), seed=0)
  with pytest.raises(ValueError, match="'seed': 0.*'seed': 1"):
    data_config.build_tokenizer(cfg, str(tmp_path), seed=1)
