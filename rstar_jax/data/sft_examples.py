"""SFT conversations: chat-message rows with tool calls, validated into dataclasses.

SFT data is chat-message JSONL (`{"messages": [...]}`, roles system / user /
assistant / tool, optional structured `tool_calls`); it is validated here into
plain dataclasses and rendered to tokens elsewhere (rstar_jax/rollout/chat.py).
Files are read by `rows.load_rows` (JSONL / JSON / Parquet), with its errors naming the
file, the row and the field.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import pathlib
from typing import Any, Iterable, Sequence

from rstar_jax.data.rows import FieldError, LoadResult, PathLike, load_rows, row_uid


SFT_ROLES = ("system", "user", "assistant", "tool")
_MESSAGE_KEYS = frozenset(("role", "content", "tool_calls", "name", "tool_call_id"))


@dataclasses.dataclass(frozen=True)
class SftToolCall:
  """A structured tool call of an assistant message of SFT data (`{"name", "arguments"}`,
  any tool). `rollout.chat.assistant_text` renders it into the turn's text, which the
  rollout protocol parses back into a `rollout.chat.ParsedToolCall` (the Python tool's
  code and input, or a parse error)."""
  name: str
  arguments: dict = dataclasses.field(hash=False)


@dataclasses.dataclass(frozen=True)
class ChatMessage:
  role: str
  content: str
  tool_calls: tuple[SftToolCall, ...] = ()
  name: str | None = None  # optional tool name on tool messages.
  tool_call_id: str | None = None


@dataclasses.dataclass(frozen=True)
class SftExample:
  """One SFT conversation; `meta` keeps the row's other fields (e.g. `tools`)."""
  uid: str
  messages: tuple[ChatMessage, ...]
  meta: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)


def _parse_tool_call(raw: Any, field: str) -> SftToolCall:
  """Accepts `{"name", "arguments"}` and OpenAI's `{"type": "function", "function": {...}}`."""
  if not isinstance(raw, dict):
    raise FieldError(field, f"a tool call must be an object, got {type(raw).__name__}")
  if "function" in raw:
    raw, field = raw["function"], f"{field}.function"
    if not isinstance(raw, dict):
      raise FieldError(field, f"must be an object, got {type(raw).__name__}")
  name = raw.get("name")
  if not isinstance(name, str) or not name.strip():
    raise FieldError(f"{field}.name", f"missing or not a non-empty string: {name!r}")
  arguments = raw.get("arguments", {})
  if isinstance(arguments, str):
    try:
      arguments = json.loads(arguments)
    except (ValueError, RecursionError) as e:   # also > 4300 digits, deep nesting
      why = e.msg if isinstance(e, json.JSONDecodeError) else f"{type(e).__name__}: {str(e)[:200]}"
      raise FieldError(f"{field}.arguments", f"not valid JSON ({why})") from None
  if not isinstance(arguments, dict):
    raise FieldError(f"{field}.arguments",
                     f"must be a JSON object, got {type(arguments).__name__}")
  return SftToolCall(name, arguments)


def validate_messages(messages: Any, field: str = "messages") -> tuple[ChatMessage, ...]:
  """Checks a chat transcript and returns it as `ChatMessage`s; raises `FieldError`.

  Rules: an optional system message first; then user and assistant alternate, starting
  with a user; an assistant message with `tool_calls` is followed by exactly one tool
  message per call and then by an assistant message. Tool messages may also follow an
  assistant whose content holds literal `<tool_call>` text (the rStar2 wire format),
  then one per `<tool_call>`. The conversation ends with an assistant message that
  makes no call: the last turn is always the model's.
  """
  if not isinstance(messages, list):
    raise FieldError(field, f"must be a list of messages, got {type(messages).__name__}")
  if not messages:
    raise FieldError(field, "empty conversation")
  out: list[ChatMessage] = []
  pending_calls = 0  # tool responses still owed to the last assistant message.
  for i, raw in enumerate(messages):
    where = f"{field}[{i}]"
    if not isinstance(raw, dict):
      raise FieldError(where, f"a message must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _MESSAGE_KEYS)
    if unknown:
      raise FieldError(where, f"unknown key(s) {unknown}; known: {sorted(_MESSAGE_KEYS)}")
    role = raw.get("role")
    if role not in SFT_ROLES:
      raise FieldError(f"{where}.role", f"{role!r} is not one of {list(SFT_ROLES)}")
    raw_calls = raw.get("tool_calls")
    if raw_calls is not None and role != "assistant":
      raise FieldError(f"{where}.tool_calls", f"only assistant messages make tool calls, not {role}")
    if raw_calls is not None and not isinstance(raw_calls, list):
      raise FieldError(f"{where}.tool_calls", f"must be a list, got {type(raw_calls).__name__}")
    calls = tuple(_parse_tool_call(c, f"{where}.tool_calls[{j}]")
                  for j, c in enumerate(raw_calls or []))
    content = raw.get("content")
    if content is None and calls:
      content = ""  # OpenAI style: content may be null when the message only calls tools.
    if not isinstance(content, str):
      raise FieldError(f"{where}.content", f"must be a string, got {type(content).__name__}")
    if not content.strip() and not calls:
      raise FieldError(f"{where}.content", f"empty {role} message")
    for key in ("name", "tool_call_id"):
      if raw.get(key) is not None and not isinstance(raw[key], str):
        raise FieldError(f"{where}.{key}", f"must be a string, got {type(raw[key]).__name__}")

    previous = out[-1].role if out else None
    if role == "system":
      if i != 0:
        raise FieldError(f"{where}.role", "a system message may only come first")
    elif role == "tool":
      if pending_calls == 0:
        raise FieldError(f"{where}.role", "tool message without a pending tool call "
                                          "(it must follow an assistant message that calls a tool)")
      pending_calls -= 1
    else:
      if pending_calls:
        raise FieldError(f"{where}.role", f"{role} message while {pending_calls} tool call(s) of "
                                          "the previous assistant message have no tool response")
      expected = "user" if previous in (None, "system", "assistant") else "assistant"
      if role != expected:
        raise FieldError(f"{where}.role", f"expected a {expected} message after "
                                          f"{previous or 'the start'}, got {role}")
      if role == "assistant":
        pending_calls = len(calls) or content.count("<tool_call>")
    out.append(ChatMessage(role, content, calls, raw.get("name"), raw.get("tool_call_id")))

  if out[-1].role != "assistant" or pending_calls:
    raise FieldError(f"{field}[{len(out) - 1}]",
                     "a conversation must end with an assistant message that calls no tool")
  return tuple(out)


def load_sft_examples(paths: PathLike | Sequence[PathLike], *, on_error: str = "raise",
                      max_reported: int = 5) -> LoadResult[SftExample]:
  """Loads chat-message rows `{"messages": [...], ...}` (JSONL / JSON / Parquet).

  Rows are validated with `validate_messages`; other row fields go to `meta`
  (`tools`, if present, must be a list of objects). Errors name the file, the row
  and the field, e.g. `sft.jsonl, line 7, field 'messages[2].role': ...`.
  """

  def parse(row: dict, default_uid: str, path: pathlib.Path, row_no: int) -> SftExample:
    del path, row_no
    if "messages" not in row:
      raise FieldError("messages", f"missing (row keys: {sorted(row)})")
    messages = validate_messages(row["messages"])
    tools = row.get("tools")
    if tools is not None and (not isinstance(tools, list)
                              or not all(isinstance(t, dict) for t in tools)):
      raise FieldError("tools", "must be a list of tool schema objects")
    meta = {k: v for k, v in row.items() if k != "messages"}
    return SftExample(row_uid(row, default_uid), messages, meta)

  return load_rows(paths, parse, on_error=on_error, max_reported=max_reported,
                   what="SFT data", csv=False)


def role_counts(examples: Iterable[SftExample]) -> dict[str, int]:
  """Messages per role over a corpus: a quick look at what an SFT set teaches."""
  counts: collections.Counter[str] = collections.Counter()
  for example in examples:
    counts.update(m.role for m in example.messages)
  return dict(counts)
