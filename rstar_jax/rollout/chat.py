"""The rStar2-Agent chat and tool-call protocol, on token ids.

Qwen chat format with Hermes-style tools, as in the public release's chat template
(microsoft/rStar, rstar2_agent/config/rstar2_agent_trainer.yaml):

  <|im_start|>system
  {system prompt}

  # Tools
  ... <tools>
  {tool json schema}
  </tools> ... <|im_end|>
  <|im_start|>user
  {answer instructions}{problem}<|im_end|>
  <|im_start|>assistant
  <reason>{model: reasoning ... <tool_call>
  {"name": "python...", "arguments": {"code": "..."}}
  </tool_call>}<|im_end|>      <- tool side when the model stopped at </tool_call>
  <|im_start|>user
  <tool_response>
  {executor output}
  </tool_response><|im_end|>
  <|im_start|>assistant
  <reason>{model: ... </reason> <answer> ... \\boxed{N} </answer><|im_end|>}

Token-in / token-out: the agent loop keeps the ids the model sampled and appends the
ids this module returns; earlier text is never re-tokenized. `render_conversation`
renders SFT messages through exactly the same functions, so SFT and RL see the same
token boundaries and the same loss masks.

Decisions (see docs/architecture.md):
- `<reason>` is re-opened in every generation prompt, also after tool responses
  (`reopen_reason=True`), as the release's template does (its agent loop appends the
  template's generation prompt after each tool turn). A released checkpoint therefore
  runs unchanged; set `reopen_reason=False` for one `<reason>` span over all turns.
- A turn stops at `</tool_call>` (`stop_at_tool_call=True`, one call per turn as in the
  release) or at `<|im_end|>` / eos. After a stop at `</tool_call>` the `<|im_end|>`
  that closes the assistant turn was not sampled: it is appended as a tool-side
  (loss-masked) token, followed by the `\\n` separator the release's loop dropped.
- A malformed call (bad JSON, unknown tool, missing `code`, an unclosed
  `<tool_call>`) is not fatal: its error text becomes that call's tool response and
  counts as a tool error.
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from rstar_jax.answers import count_answer_tags
from rstar_jax.model import tokenizer as tokenizer_lib
# Statuses of a sandbox result: the sandbox service's contract (sandbox/ has no JAX).
from sandbox.schema import STATUSES as TOOL_STATUSES

IM_START = tokenizer_lib.IM_START
IM_END = tokenizer_lib.IM_END
TOOL_CALL_START = tokenizer_lib.TOOL_CALL_START
TOOL_CALL_END = tokenizer_lib.TOOL_CALL_END
TOOL_RESPONSE_START = tokenizer_lib.TOOL_RESPONSE_START
TOOL_RESPONSE_END = tokenizer_lib.TOOL_RESPONSE_END

# The release's texts, verbatim (rstar2_agent_trainer.yaml custom_chat_template).
DEFAULT_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The User asks a question, and the "
    "Assistant solves it. The Assistant first thinks about the reasoning process in the "
    "mind and then provides the User with the answer. The reasoning process is enclosed "
    "within <reason> </reason> and answer is enclosed within <answer> </answer> tags, "
    "respectively, i.e., <reason> reasoning process here </reason> <answer> answer here "
    "</answer>.")
DEFAULT_TOOLS_HEADER = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
DEFAULT_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
DEFAULT_USER_TEMPLATE = (
    "You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here "
    "</answer>. And your final answer will be extracted automatically by the \\boxed{} "
    "tag.\nThis is the problem:\n{problem}")
DEFAULT_TOOL_NAME = "python_code_with_standard_io"  # the release's stdin/stdout tool

# How an error is shown: "concise" shows only `Type at line N: message` plus the line
# (what the release's executor printed) in place of the traceback the sandbox writes to
# stderr; "full" keeps stderr and appends the concise error if it is not already there.
ERROR_FORMATS = ("concise", "full")


_TOOL_CALL_RE = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END),
                           re.DOTALL)


def python_tool_schema(name: str = DEFAULT_TOOL_NAME, description: str | None = None
                       ) -> dict[str, Any]:
  """OpenAI-style function schema of the Python executor tool."""
  return {
      "type": "function",
      "function": {
          "name": name,
          "description": description or (
              "Execute Python code and return its standard output and standard error. "
              "Use print() to show the values you need."),
          "parameters": {
              "type": "object",
              "properties": {
                  "code": {"type": "string", "description": "The Python code to execute."},
                  "input": {"type": "string",
                            "description": "Text given to the program as standard input."},
              },
              "required": ["code"],
          },
      },
  }


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatConfig:
  """The protocol's texts and limits. Defaults are the release's.

  Attributes:
    system_prompt: the system prompt before the tools section.
    tools_header / tools_footer: text around the JSON schema in the tools section.
    tool_schema: the Python tool's function schema; its `function.name` is the name a
      call must use and its parameters must include `code`.
    user_template: the user turn; `{problem}` is replaced by the problem text.
    reason_open: appended to every generation prompt (`<|im_start|>assistant\\n`).
    reopen_reason: also append `reason_open` to the generation prompt after tool
      responses (release behaviour). False: one reason span across all turns.
    max_parallel_calls: calls executed per assistant turn; further calls are
      ignored (counted in `ParsedTurn.num_dropped`). Release: 1.
    stop_at_tool_call: end a turn at `</tool_call>` (saves the tokens a model would
      spend imagining the tool output). Only possible with max_parallel_calls == 1.
    stream_max_chars: each of stdout / stderr is cut to this many characters
      (head + marker + tail) before the response is assembled. None: no cut.
    response_max_chars: the whole tool response is cut to this many characters
      (head + marker + tail). None: no cut.
    truncation_marker: text placed where characters were cut.
    parse_error_prefix: prefix of the tool response for a malformed call.
    error_format: one of ERROR_FORMATS, how a failed call's error is shown.
  """
  system_prompt: str = DEFAULT_SYSTEM_PROMPT
  tools_header: str = DEFAULT_TOOLS_HEADER
  tools_footer: str = DEFAULT_TOOLS_FOOTER
  # Held as JSON text in config sections: key order is part of the prompt's text.
  tool_schema: Mapping[str, Any] = dataclasses.field(default_factory=python_tool_schema,
                                                     metadata={"config": "json"})
  user_template: str = DEFAULT_USER_TEMPLATE
  reason_open: str = "<reason>"
  reopen_reason: bool = True
  max_parallel_calls: int = 1
  stop_at_tool_call: bool = True
  stream_max_chars: int | None = 1000
  response_max_chars: int | None = 256
  truncation_marker: str = "...(truncated)..."
  parse_error_prefix: str = "Failed to decode tool call: "
  error_format: str = "concise"
  # The release shows the measured run time; it makes rollouts depend on machine load,
  # so it can be turned off (the toy does) for exactly reproducible runs.
  show_execution_time: bool = True

  def __post_init__(self):
    if self.error_format not in ERROR_FORMATS:
      raise ValueError(f"ChatConfig.error_format must be one of {ERROR_FORMATS}, got "
                       f"{self.error_format!r}")
    if self.user_template.count("{problem}") != 1:
      raise ValueError("ChatConfig.user_template must contain '{problem}' exactly once, got "
                       f"{self.user_template.count('{problem}')} in {self.user_template!r}")
    if not isinstance(self.max_parallel_calls, int) or self.max_parallel_calls < 1:
      raise ValueError(f"ChatConfig.max_parallel_calls must be an int >= 1, got "
                       f"{self.max_parallel_calls!r}")
    if self.stop_at_tool_call and self.max_parallel_calls > 1:
      raise ValueError(
          f"ChatConfig: stop_at_tool_call=True ends a turn at the first </tool_call>, so "
          f"max_parallel_calls={self.max_parallel_calls} could never be used; set "
          "stop_at_tool_call=False for parallel calls")
    for field in ("stream_max_chars", "response_max_chars"):
      value = getattr(self, field)
      if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"ChatConfig.{field} must be None or an int >= 1, got {value!r}")
    _validate_tool_schema(self.tool_schema)

  @property
  def tool_name(self) -> str:
    return self.tool_schema["function"]["name"]


def _validate_tool_schema(schema: Any) -> None:
  where = "ChatConfig.tool_schema"
  if not isinstance(schema, Mapping):
    raise ValueError(f"{where} must be a mapping, got {type(schema).__name__}")
  function = schema.get("function")
  if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) \
      or not function["name"]:
    raise ValueError(f"{where} needs 'function': {{'name': <non-empty str>, ...}}, got "
                     f"{schema!r}")
  properties = (function.get("parameters") or {}).get("properties") or {}
  if "code" not in properties:
    raise ValueError(f"{where}: the Python tool's parameters.properties must include "
                     f"'code', got {sorted(properties)}")
  try:
    json.dumps(schema)
  except TypeError as e:
    raise ValueError(f"{where} is not JSON-serializable: {e}") from None


# --- text of the fixed parts ---------------------------------------------------------


def system_text(config: ChatConfig, system_prompt: str | None = None) -> str:
  """The system turn with the tools section, including its closing newline."""
  prompt = config.system_prompt if system_prompt is None else system_prompt
  schema = json.dumps(dict(config.tool_schema), ensure_ascii=False)
  return (f"{IM_START}system\n{prompt}{config.tools_header}\n{schema}{config.tools_footer}"
          f"{IM_END}\n")


def user_parts(problem: str, config: ChatConfig) -> list[str]:
  """`user_text` in parts, the problem marked `Verbatim` (untrusted text)."""
  parts = [f"{IM_START}user\n"]
  for i, piece in enumerate(config.user_template.split("{problem}")):
    if i:
      parts.append(tokenizer_lib.Verbatim(problem))
    parts.append(piece)
  parts.append(f"{IM_END}\n")
  return parts


def user_text(problem: str, config: ChatConfig) -> str:
  """The user turn carrying the problem, including its closing newline."""
  return "".join(user_parts(problem, config))


def generation_prompt_text(config: ChatConfig, *, first: bool) -> str:
  """`<|im_start|>assistant\\n` plus `<reason>` (after tool turns only if reopen_reason)."""
  reason = config.reason_open if (first or config.reopen_reason) else ""
  return f"{IM_START}assistant\n{reason}"


def prompt_text(problem: str, config: ChatConfig, system_prompt: str | None = None) -> str:
  return (system_text(config, system_prompt) + user_text(problem, config)
          + generation_prompt_text(config, first=True))


def tool_call_text(name: str, arguments: Mapping[str, Any]) -> str:
  """A call as the release's template writes it (the form SFT teaches)."""
  body = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
  return f"\n{TOOL_CALL_START}\n{body}\n{TOOL_CALL_END}"


def tool_turn_text(responses: Sequence[str], config: ChatConfig, *,
                   close_assistant: bool) -> str:
  """What follows an assistant turn that called tools (see `tool_turn_parts`)."""
  return "".join(tool_turn_parts(responses, config, close_assistant=close_assistant))


def tool_turn_parts(responses: Sequence[str], config: ChatConfig, *,
                    close_assistant: bool) -> list[str]:
  """What follows an assistant turn that called tools, in parts, each response marked
  `Verbatim` (a tool's output is untrusted text).

  Args:
    responses: one tool response text per call, in call order; all are merged in one
      user turn.
    config: for the next generation prompt.
    close_assistant: prepend `<|im_end|>` (the turn stopped at `</tool_call>`, so
      the model has not written it).
  """
  if not responses:
    raise ValueError("tool_turn_text needs at least one tool response")
  parts = [IM_END if close_assistant else "", "\n", IM_START, "user"]
  for text in responses:
    parts += [f"\n{TOOL_RESPONSE_START}\n", tokenizer_lib.Verbatim(text),
              f"\n{TOOL_RESPONSE_END}"]
  parts.append(f"{IM_END}\n")
  parts.append(generation_prompt_text(config, first=False))
  return parts


# --- tool output -----------------------------------------------------------------------


def truncate_middle(text: str, max_chars: int | None, marker: str = "...(truncated)...") -> str:
  """Keeps the first max_chars // 2 and the last max_chars - max_chars // 2 characters
  of a longer text, with `marker` between: the result has max_chars + len(marker)
  characters. Text within the limit (or max_chars None) is returned unchanged."""
  if max_chars is None or len(text) <= max_chars:
    return text
  head = max_chars // 2
  tail = max_chars - head
  return text[:head] + marker + text[len(text) - tail:]


def _result_str(result: Mapping[str, Any], key: str) -> str:
  value = result.get(key)
  if value is None:
    return ""
  if not isinstance(value, str):
    raise ValueError(f"tool result field {key!r} must be a string, got "
                     f"{type(value).__name__}: {value!r}")
  return value


def error_text(result: Mapping[str, Any]) -> str:
  """The concise error of a result: its `error` field, else the sandbox's
  `error_message` plus `error_source` (as `sandbox.schema.Result.error_text()`)."""
  error = _result_str(result, "error")
  if error:
    return error
  message = _result_str(result, "error_message")
  source = _result_str(result, "error_source")
  return f"{message}\n    {source}" if message and source else message


def render_executor_result(result: Mapping[str, Any], config: ChatConfig) -> str:
  """Renders a sandbox result the way the release's executor reports it.

  Args:
    result: mapping with `status` (one of TOOL_STATUSES) and optional `stdout`,
      `stderr`, `error` (e.g. "NameError at line 3: name 'x' is not defined\n
      print(x)"; or the sandbox's `error_message` / `error_source`) and `wall_time`
      (seconds). Other keys are ignored, so `sandbox.schema.Result.to_dict()` works.
    config: stream truncation length and marker; `error_format`.

  Returns:
    "Tool call success" or "Tool call failure\nreason: <status>", then
    "stdout: ...", "stderr: ..." (a failed call's concise error is shown there, where
    the release's executor printed it) and "execution time: 0.12s"; empty parts are
    left out.
  """
  if not isinstance(result, Mapping):
    raise ValueError(f"tool result must be a mapping, got {type(result).__name__}")
  status = result.get("status")
  if status not in TOOL_STATUSES:
    raise ValueError(f"tool result status must be one of {TOOL_STATUSES}, got {status!r} "
                     f"(keys: {sorted(result)})")
  stdout = _result_str(result, "stdout")
  stderr = _result_str(result, "stderr")
  error = error_text(result) if status != "ok" else ""
  if error:
    if config.error_format == "concise":
      stderr = error
    elif error.strip() not in stderr:
      stderr = stderr + ("\n" if stderr and not stderr.endswith("\n") else "") + error
  wall_time = result.get("wall_time")
  if wall_time is not None and (isinstance(wall_time, bool)
                                or not isinstance(wall_time, (int, float))):
    raise ValueError(f"tool result field 'wall_time' must be a number, got {wall_time!r}")
  cut = lambda s: truncate_middle(s, config.stream_max_chars, config.truncation_marker)
  if status == "ok":
    lines = ["Tool call success"]
  else:
    lines = ["Tool call failure", f"reason: {status}"]
  if stdout:
    lines.append(f"stdout: {cut(stdout)}")
  if stderr:
    lines.append(f"stderr: {cut(stderr)}")
  if wall_time is not None and config.show_execution_time:
    lines.append(f"execution time: {wall_time:.2f}s")
  return "\n".join(lines)


# --- parsing one assistant turn ------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParsedToolCall:
  """One `<tool_call>` read from a generated turn's text: either a runnable call of the
  Python tool or a parse error. (A tool call as SFT data states it, any tool with any
  arguments, is `rstar_jax.data.sft_examples.SftToolCall`; rendered to text, it is parsed
  into this.)

  Attributes:
    code: the Python source (None for a parse error).
    input: text for stdin ('' if not given).
    name: the tool name the model wrote, if it could be read.
    error: the text returned to the model as the tool response when the call cannot
      be run (bad JSON, unknown tool, missing `code`, unclosed tag); None if ok.
    raw: the text between the tags.
  """
  code: str | None = None
  input: str = ""
  name: str | None = None
  error: str | None = None
  raw: str = ""

  @property
  def ok(self) -> bool:
    return self.error is None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParsedTurn:
  """What one generated assistant turn asks for.

  Attributes:
    text: the decoded turn, special tokens kept.
    calls: the calls to answer, in order (at most max_parallel_calls); parse errors
      included: each still gets a tool response.
    num_dropped: calls beyond max_parallel_calls, ignored as in the release.
    answer_tags: complete `<answer>...</answer>` blocks in the turn.
    stop: 'tool_call' (last id is `</tool_call>`), 'end_of_turn' (`<|im_end|>` or
      eos), 'length' (no stop id: cut by a budget) or None (parsed from text).
  """
  text: str
  calls: tuple[ParsedToolCall, ...]
  num_dropped: int = 0
  answer_tags: int = 0
  stop: str | None = None

  @property
  def wants_tool(self) -> bool:
    return bool(self.calls)

  @property
  def has_answer(self) -> bool:
    return self.answer_tags > 0

  @property
  def num_parse_errors(self) -> int:
    return sum(not c.ok for c in self.calls)


def _parse_call(raw: str, tool_name: str, prefix: str) -> ParsedToolCall:
  def fail(message: str, name: str | None = None) -> ParsedToolCall:
    return ParsedToolCall(name=name, error=prefix + message, raw=raw)

  # ValueError covers JSONDecodeError and Python's limit on integer digits (a number
  # of > 4300 digits); degenerate repetition also nests brackets past the recursion
  # limit. Both are the model's malformed call, never the rollout's crash.
  try:
    obj = json.loads(raw.strip())
  except (ValueError, RecursionError) as e:
    return fail(str(e) if isinstance(e, json.JSONDecodeError) else
                f"invalid JSON ({type(e).__name__}: {str(e)[:200]})")
  if not isinstance(obj, dict):
    return fail(f'expected a JSON object {{"name": ..., "arguments": {{...}}}}, got '
                f"{type(obj).__name__}")
  name = obj.get("name")
  if not isinstance(name, str):
    return fail("missing 'name' (a string)")
  if name != tool_name:
    return fail(f"unknown tool {name!r}; the available tool is {tool_name!r}", name)
  if "arguments" not in obj:
    return fail("missing 'arguments'", name)
  args = obj["arguments"]
  if isinstance(args, str):  # OpenAI style: arguments as a JSON string.
    try:
      args = json.loads(args)
    except (ValueError, RecursionError) as e:
      return fail(f"'arguments' is a string that is not valid JSON: {str(e)[:200]}", name)
  if not isinstance(args, dict):
    return fail(f"'arguments' must be a JSON object, got {type(args).__name__}", name)
  code = args.get("code")
  if code is None:
    return fail("missing required argument 'code'", name)
  if not isinstance(code, str):
    return fail(f"argument 'code' must be a string, got {type(code).__name__}", name)
  stdin = args.get("input")
  if stdin is None:
    stdin = ""
  if not isinstance(stdin, str):
    return fail(f"argument 'input' must be a string, got {type(stdin).__name__}", name)
  return ParsedToolCall(code=code, input=stdin, name=name, raw=raw)


def parse_tool_calls(text: str, config: ChatConfig) -> ParsedTurn:
  """Finds the `<tool_call>{json}</tool_call>` blocks of one assistant turn's text.

  Text around and between calls is allowed. A trailing `<tool_call>` without its
  closing tag is reported as a malformed call (the model meant to call a tool).
  """
  calls = [_parse_call(m.group(1), config.tool_name, config.parse_error_prefix)
           for m in _TOOL_CALL_RE.finditer(text)]
  last_end = 0
  for m in _TOOL_CALL_RE.finditer(text):
    last_end = m.end()
  rest = text[last_end:]
  if TOOL_CALL_START in rest:
    raw = rest[rest.index(TOOL_CALL_START) + len(TOOL_CALL_START):]
    calls.append(ParsedToolCall(error=f"{config.parse_error_prefix}{TOOL_CALL_START} without "
                                      f"{TOOL_CALL_END}", raw=raw))
  kept = calls[:config.max_parallel_calls]
  return ParsedTurn(text=text, calls=tuple(kept), num_dropped=len(calls) - len(kept),
                    answer_tags=count_answer_tags(text))


# --- the protocol on a tokenizer -----------------------------------------------------


class TokenizerLike(Protocol):
  eos_id: int

  def encode(self, text: str) -> list[int]: ...

  def encode_parts(self, parts: Sequence[str]) -> list[int]: ...

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...

  def chat_token_ids(self) -> tokenizer_lib.ChatTokenIds: ...

  def has_token(self, token: str) -> bool: ...

  def token_id(self, token: str) -> int: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class FormatStats:
  """Format facts of a finished trajectory (inputs of GRPO-RoC's p_format)."""
  answer_tags: int
  assistant_turns: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class RenderedConversation:
  """Token ids of a whole conversation and the loss mask (1 on model tokens).

  `ids[:prompt_len]` is exactly `ChatProtocol.prompt_ids(problem)`.
  """
  ids: list[int]
  loss_mask: list[int]
  prompt_len: int


class ChatProtocol:
  """The chat protocol bound to a tokenizer: everything the agent loop needs in ids.

  One trajectory:
    ids = proto.prompt_ids(problem)
    loop:
      gen = engine.generate(ids, stop_ids=proto.stop_ids)   # model tokens
      turn = proto.parse_turn(gen)
      if not turn.wants_tool: break
      responses = [proto.tool_response_text(c, sandbox.run(c) if c.ok else None)
                   for c in turn.calls]
      ids += gen + proto.tool_turn_ids(gen, responses)       # tool tokens, mask 0
  """

  def __init__(self, tokenizer: TokenizerLike, config: ChatConfig | None = None):
    self.tokenizer = tokenizer
    self.config = config or ChatConfig()
    self.token_ids = tokenizer.chat_token_ids()
    eos = [tokenizer.eos_id]
    if tokenizer.has_token(tokenizer_lib.ENDOFTEXT):
      eos.append(tokenizer.token_id(tokenizer_lib.ENDOFTEXT))
    self.end_ids = tuple(dict.fromkeys([self.token_ids.im_end, *eos]))
    stops = ([self.token_ids.tool_call_end] if self.config.stop_at_tool_call else [])
    self.stop_ids: tuple[int, ...] = tuple(dict.fromkeys(stops + list(self.end_ids)))
    # A turn that stops here continues with tool output (when turns stop at the call's
    # end; otherwise at the turn's end, which also ends final answers).
    self.continue_ids: tuple[int, ...] = (
        (self.token_ids.tool_call_end,) if self.config.stop_at_tool_call
        else (self.token_ids.im_end,))
    self._system_ids = tokenizer.encode(system_text(self.config))
    self._assistant_header = tokenizer.encode(f"{IM_START}assistant\n")

  # -- prompt --
  def prompt_text(self, problem: str) -> str:
    return prompt_text(problem, self.config)

  def prompt_ids(self, problem: str, system_prompt: str | None = None) -> list[int]:
    """System turn + user turn + `<|im_start|>assistant\\n<reason>`."""
    system = (self._system_ids if system_prompt is None
              else self.tokenizer.encode(system_text(self.config, system_prompt)))
    return (list(system)
            + self.tokenizer.encode_parts(user_parts(self._check_problem(problem),
                                                     self.config))
            + self.tokenizer.encode(generation_prompt_text(self.config, first=True)))

  @staticmethod
  def _check_problem(problem: str) -> str:
    if not isinstance(problem, str) or not problem.strip():
      raise ValueError(f"problem must be a non-empty string, got {problem!r}")
    return problem

  # -- one turn --
  def stop_reason(self, generated_ids: Sequence[int]) -> str:
    if not generated_ids:
      return "length"
    last = generated_ids[-1]
    if last == self.token_ids.tool_call_end and self.config.stop_at_tool_call:
      return "tool_call"
    if last in self.end_ids:
      return "end_of_turn"
    return "length"

  def parse_turn(self, generated_ids: Sequence[int]) -> ParsedTurn:
    """Parses the ids the model generated in one assistant turn."""
    text = self.tokenizer.decode(generated_ids, skip_special_tokens=False)
    parsed = parse_tool_calls(text, self.config)
    stop = self.stop_reason(generated_ids)
    if stop == "tool_call" and not parsed.calls:
      # Stopped at </tool_call> with no call opened (a misspelled opening tag, bare
      # JSON): a malformed call, answered with its error, not a final answer.
      parsed = dataclasses.replace(parsed, calls=(ParsedToolCall(
          error=f"{self.config.parse_error_prefix}{TOOL_CALL_END} without {TOOL_CALL_START}",
          raw=text),))
    return dataclasses.replace(parsed, stop=stop)

  def tool_response_text(self, call: ParsedToolCall, result: Mapping[str, Any] | None = None
                         ) -> str:
    """The (truncated) text returned to the model for one call: the parse error of a
    malformed call, else the rendered sandbox result."""
    if call.error is not None:
      text = call.error
    else:
      if result is None:
        raise ValueError("tool_response_text: a runnable call needs its sandbox result")
      text = render_executor_result(result, self.config)
    # A lone surrogate (an exception message built with chr(0xd800)) survives JSON
    # but not the tokenizer: escape it rather than fail the rollout.
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return truncate_middle(text, self.config.response_max_chars, self.config.truncation_marker)

  @staticmethod
  def is_tool_error(call: ParsedToolCall, result: Mapping[str, Any] | None = None) -> bool:
    """A call errs when it cannot be parsed or its sandbox status is not 'ok'
    (structured status, not the release's substring test). `internal_error` is the
    sandbox failing, not the code: it is no error of the model's (RoC's p_err must
    not penalise a positive for an outage)."""
    if call.error is not None or result is None:
      return True
    return result.get("status") not in ("ok", "internal_error")

  def tool_turn_ids(self, generated_ids: Sequence[int], responses: Sequence[str]) -> list[int]:
    """Ids to append after the model's turn `generated_ids`: every one is a tool-side
    token (loss mask 0). Closes the assistant turn (`<|im_end|>` if the model stopped
    before writing it, then `\\n`), adds one user turn with all `responses` and the
    next generation prompt."""
    close = not generated_ids or generated_ids[-1] != self.token_ids.im_end
    return self.tokenizer.encode_parts(tool_turn_parts(responses, self.config,
                                                       close_assistant=close))

  # -- whole trajectories --
  def format_stats(self, response_ids: Sequence[int],
                   loss_mask: Sequence[int] | None = None) -> FormatStats:
    """`<answer>` tags written by the model and assistant turns of a response (all
    ids after the prompt). With the loss mask, only model tokens are searched and each
    run of model tokens is a turn; without it, turns are counted by the assistant
    headers in the response, and tags anywhere in the response count."""
    ids = list(response_ids)
    if loss_mask is None:
      turns = 1 + _count_subsequence(ids, self._assistant_header)
      return FormatStats(answer_tags=count_answer_tags(self.tokenizer.decode(ids)),
                         assistant_turns=turns)
    if len(loss_mask) != len(ids):
      raise ValueError(f"loss_mask has {len(loss_mask)} entries for {len(ids)} ids")
    runs, current = [], []
    for token, m in zip(ids, loss_mask):
      if m:
        current.append(token)
      elif current:
        runs.append(current)
        current = []
    if current:
      runs.append(current)
    tags = sum(count_answer_tags(self.tokenizer.decode(r)) for r in runs)
    return FormatStats(answer_tags=tags, assistant_turns=len(runs))

  def render_conversation(self, messages: Sequence[Any]) -> RenderedConversation:
    """Renders chat messages (SFT data) to ids and a loss mask through the same
    functions the rollout uses.

    Messages are mappings or objects with the same fields (such as
    `rstar_jax.data.sft_examples.ChatMessage`): an optional `system` message (replaces
    the system prompt; the tools section is kept), one `user` message (the problem),
    then assistant turns. An assistant turn that calls tools (`tool_calls`:
    [{"name", "arguments"}], or calls written in its content) is followed by one
    `tool` message per call, whose content is used verbatim (render it with
    `tool_response_text`); the last message is an assistant turn without calls.
    Assistant content starts after the generation prompt's `<reason>`.
    """
    where = "render_conversation"
    msgs = list(messages)
    system_prompt = None
    if msgs and _get(msgs[0], "role") == "system":
      system_prompt = _content(msgs[0], 0)
      msgs = msgs[1:]
      offset = 1
    else:
      offset = 0
    if not msgs or _get(msgs[0], "role") != "user":
      raise ValueError(f"{where}: expected a 'user' message (the problem) first, got "
                       f"{[_get(m, 'role') for m in messages][:3]}")
    ids = self.prompt_ids(_content(msgs[0], offset), system_prompt)
    mask = [0] * len(ids)
    prompt_len = len(ids)
    i = 1
    if i >= len(msgs):
      raise ValueError(f"{where}: no assistant message after the user message")
    while i < len(msgs):
      index = i + offset
      msg = msgs[i]
      if _get(msg, "role") != "assistant":
        raise ValueError(f"{where}: message {index} should be 'assistant', got "
                         f"{_get(msg, 'role')!r}")
      text = assistant_text(msg, index)
      for token in (IM_END, tokenizer_lib.ENDOFTEXT):
        if token in text:
          raise ValueError(f"{where}: message {index} contains {token!r} in its text; a turn "
                           "ends at its first end token, so the rollout never generates one "
                           "inside a turn")
      parsed = parse_tool_calls(text, self.config)
      n_calls = len(parsed.calls) + parsed.num_dropped
      if n_calls == 0:
        if i != len(msgs) - 1:
          raise ValueError(f"{where}: message {index} is an assistant turn without a tool "
                           "call, so it must be the last message")
        model = self.tokenizer.encode(text) + [self.token_ids.im_end]
        ids += model
        mask += [1] * len(model)
        break
      if n_calls > self.config.max_parallel_calls:
        raise ValueError(f"{where}: message {index} has {n_calls} tool calls but "
                         f"max_parallel_calls={self.config.max_parallel_calls}")
      model = self.tokenizer.encode(text)
      if self.config.stop_at_tool_call:
        if not text.endswith(TOOL_CALL_END):
          raise ValueError(f"{where}: message {index} has text after {TOOL_CALL_END}, which "
                           "the rollout never generates with stop_at_tool_call=True")
      else:
        model.append(self.token_ids.im_end)
      responses = []
      for j in range(n_calls):
        k = i + 1 + j
        if k >= len(msgs) or _get(msgs[k], "role") != "tool":
          raise ValueError(f"{where}: message {index} makes {n_calls} tool call(s); expected "
                           f"{n_calls} 'tool' message(s) after it, message {k + offset} is "
                           f"{_get(msgs[k], 'role') if k < len(msgs) else 'missing'}")
        responses.append(_content(msgs[k], k + offset))
      tool = self.tool_turn_ids(model, responses)
      ids += model + tool
      mask += [1] * len(model) + [0] * len(tool)
      i += 1 + n_calls
      if i >= len(msgs):
        raise ValueError(f"{where}: the conversation ends with a tool message; the last "
                         "turn must be the model's")
    return RenderedConversation(ids=ids, loss_mask=mask, prompt_len=prompt_len)


def _get(obj: Any, key: str) -> Any:
  """Field of a message / call given as a mapping or as an object (e.g. the
  dataclasses of rstar_jax.data.sft_examples)."""
  if isinstance(obj, Mapping):
    return obj.get(key)
  return getattr(obj, key, None)


def _content(msg: Any, index: int) -> str:
  content = _get(msg, "content")
  if content is None:
    content = ""
  if not isinstance(content, str):
    raise ValueError(f"message {index} ({_get(msg, 'role')!r}): 'content' must be a string, "
                     f"got {type(content).__name__}")
  return content


def assistant_text(msg: Any, index: int = 0) -> str:
  """The text a model writes for an assistant message: content, then its structured
  `tool_calls` in the release's form."""
  text = _content(msg, index)
  for call in _get(msg, "tool_calls") or ():
    fn = _get(call, "function") or call
    if not isinstance(_get(fn, "name"), str):
      raise ValueError(f"message {index}: each tool call needs a 'name', got {call!r}")
    args = _get(fn, "arguments")
    args = {} if args is None else args
    if isinstance(args, str):
      try:
        args = json.loads(args)
      except json.JSONDecodeError as e:
        raise ValueError(f"message {index}: tool call arguments are not JSON: {e}") from None
    if not isinstance(args, Mapping):
      raise ValueError(f"message {index}: tool call arguments must be an object, got {args!r}")
    text += tool_call_text(_get(fn, "name"), args)
  return text


def _count_subsequence(ids: Sequence[int], pattern: Sequence[int]) -> int:
  n, m = len(ids), len(pattern)
  if m == 0:
    return 0
  return sum(1 for s in range(n - m + 1) if list(ids[s:s + m]) == list(pattern))
