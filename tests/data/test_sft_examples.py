"""Tests for rstar_jax.data.sft_examples: SFT chat-message rows, their tool calls and checks."""
import json

import pytest

from rstar_jax.data import sft_examples
from rstar_jax.data.rows import DataError


def _write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def _tool_conversation():
  return [
      {"role": "system", "content": "You are helpful."},
      {"role": "user", "content": "What is 123*456?"},
      {"role": "assistant", "content": "<reason>compute</reason>",
       "tool_calls": [{"name": "python", "arguments": {"code": "print(123*456)"}}]},
      {"role": "tool", "content": "56088"},
      {"role": "assistant", "content": None, "tool_calls": [
          {"type": "function", "function": {"name": "python", "arguments": '{"code": "1"}'}}]},
      {"role": "tool", "content": "1"},
      {"role": "assistant", "content": "<answer>\\boxed{56088}</answer>"},
  ]


def test_sft_rows_load(tmp_path):
  rows = [{"id": "c1", "messages": _tool_conversation(), "tools": [{"name": "python"}]},
          {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                        {"role": "user", "content": "call"},
                        {"role": "assistant", "content": '<tool_call>{"name": "python"}</tool_call>'},
                        {"role": "tool", "content": "ok"},
                        {"role": "assistant", "content": "done"}]}]
  result = sft_examples.load_sft_examples(_write_jsonl(tmp_path / "sft.jsonl", rows))
  first, second = result.items
  assert first.uid == "c1" and first.meta["tools"] == [{"name": "python"}]
  assert [m.role for m in first.messages] == ["system", "user", "assistant", "tool", "assistant",
                                              "tool", "assistant"]
  assert first.messages[2].tool_calls == (
      sft_examples.SftToolCall("python", {"code": "print(123*456)"}),)
  assert first.messages[4].content == "" and first.messages[4].tool_calls[0].arguments == {"code": "1"}
  assert second.uid == "sft:2" and second.messages[-1].content == "done"
  assert sft_examples.role_counts(result.items) == {"system": 1, "user": 3, "assistant": 6,
                                                    "tool": 3}


def _break(messages, index, **changes):
  messages = [dict(m) for m in messages]
  messages[index].update(changes)
  return messages


@pytest.mark.parametrize("messages, field, message", [
    (_break(_tool_conversation(), 1, role="human"), "messages[1].role", "not one of"),
    (_break(_tool_conversation(), 1, content=["parts"]), "messages[1].content", "must be a string"),
    (_break(_tool_conversation(), 6, content=""), "messages[6].content", "empty assistant"),
    (_break(_tool_conversation(), 1, role="system"), "messages[1].role", "only come first"),
    (_break(_tool_conversation(), 3, role="assistant"), "messages[3].role", "no tool response"),
    (_break(_tool_conversation(), 2, tool_calls=[{"name": "python", "arguments": "{bad"}]),
     "messages[2].tool_calls[0].arguments", "not valid JSON"),
    (_break(_tool_conversation(), 1, tool_calls=[]), "messages[1].tool_calls", "only assistant"),
    (_break(_tool_conversation(), 1, weight=0), "messages[1]", "unknown key"),
    ([{"role": "assistant", "content": "hi"}], "messages[0].role", "expected a user"),
    ([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"},
      {"role": "assistant", "content": "c"}], "messages[1].role", "without a pending tool call"),
    (_tool_conversation()[:4], "messages[3]", "must end with an assistant"),
    ([], "messages", "empty conversation"),
    ("hello", "messages", "must be a list"),
    # json.loads' ValueError / RecursionError escaped with no file or line, and unskipped.
    (_break(_tool_conversation(), 2, tool_calls=[
        {"name": "python", "arguments": '{"x": ' + "9" * 5000 + "}"}]),
     "messages[2].tool_calls[0].arguments", "not valid JSON (ValueError"),
    (_break(_tool_conversation(), 2, tool_calls=[
        {"name": "python", "arguments": "[" * 50_000 + "]" * 50_000}]),
     "messages[2].tool_calls[0].arguments", "not valid JSON (RecursionError"),
])
def test_sft_malformed_rows(tmp_path, messages, field, message):
  good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
  path = _write_jsonl(tmp_path / "sft.jsonl", [good, {"messages": messages}])
  with pytest.raises(DataError) as info:
    sft_examples.load_sft_examples(path)
  assert (info.value.row_error.row, info.value.row_error.field) == (2, field)
  assert message in str(info.value) and "sft.jsonl, line 2" in str(info.value)
  skipped = sft_examples.load_sft_examples(path, on_error="skip")
  assert (len(skipped.items), skipped.num_skipped) == (1, 1)


def test_sft_missing_messages(tmp_path):
  path = _write_jsonl(tmp_path / "s.jsonl", [{"conversation": []}])
  with pytest.raises(DataError, match="field 'messages': missing"):
    sft_examples.load_sft_examples(path)
