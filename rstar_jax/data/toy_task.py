"""A toy task where the Python tool matters, with rStar2-format SFT traces.

Problems are integer arithmetic a small model cannot do in its head but can with one
Python call: products, sums, modular powers and digit sums of 2-5 digit numbers,
at difficulty levels 1..NUM_LEVELS (more digits, more terms). Level 0 (two-digit
operands, drawn only when asked for) is for a first run: its 90 two-digit numbers are
each a token seen often in SFT, so a tiny model learns to copy them in ~270-320 steps.

SFT traces are chat messages in the rStar2 format (the release's chat template): the assistant
reasons after the generation prompt's `<reason>`, calls the Python tool, reads the
executor's output, then writes `</reason> <answer> \\boxed{N} </answer>`. A
configurable share of traces is noisy, the behaviour GRPO-RoC is meant to clean up:
  * `bug_fixed`: the first call has a bug (a syntax error or a NameError); the tool
    response is the executor's error text; the model fixes the code and calls again.
  * `no_tool`: the model answers without the tool, a guess that is right only with
    probability `no_tool_correct_share`.
Tool responses are the real outputs: each trace's code is run in-process (it is code
this module wrote) and rendered by the same function the rollout uses. Traces become
token ids and loss masks through `ChatProtocol.render_conversation`, the rollout's
own functions, so SFT and RL see identical formats.

Sequences are short: with `toy_chat_config()` and the tokenizer of
`train_toy_tokenizer()` (byte-level BPE, 1637 ids, numbers in chunks of up to 3
digits), a whole trace over levels 1-5, prompt (~75 tokens) included, is ~161 tokens
when clean (147-187), ~98 without the tool and ~254 with a bug and its fix (224-303).
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import random
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from rstar_jax.model import tokenizer as tokenizer_lib
from rstar_jax.registry import Registry
from rstar_jax.rollout import chat

NUM_LEVELS = 5
# Level 0 is opt-in (ToyDataConfig.levels=(0,)): `generate_problems` draws 1..NUM_LEVELS.
MIN_LEVEL = 0
VARIANTS = ("clean", "bug_fixed", "no_tool")
BUG_KINDS = ("syntax", "name")
TOY_TOOL_NAME = "python"
_FILENAME = "<toy>"
# How the sandbox shows the offending line under "Type at line N: message".
ERROR_LINE_INDENT = "    "


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToyProblem:
  """One problem: its text, the integer answer, and Python code that prints it."""
  problem: str
  answer: int
  kind: str
  level: int
  code: str

  def as_row(self) -> dict[str, Any]:
    """A row in the plain `problem` / `answer` layout the math data loaders read."""
    return {"problem": self.problem, "answer": str(self.answer), "kind": self.kind,
            "level": self.level}


# --- problem kinds: a registry --------------------------------------------------------

# A kind maps (rng, level) to (problem text, the expressions of the code, answer).
KindFn = Callable[[random.Random, int], tuple[str, str, int]]
_KINDS: Registry = Registry("toy problem kind")
register = _KINDS.register
get = _KINDS.lookup


def kinds() -> tuple[str, ...]:
  return tuple(sorted(_KINDS))


def _num(rng: random.Random, digits: int) -> int:
  return rng.randint(10 ** (digits - 1), 10 ** digits - 1)


def _check_level(level: int) -> int:
  if type(level) is not int or not MIN_LEVEL <= level <= NUM_LEVELS:
    raise ValueError(f"level must be an int in {MIN_LEVEL}..{NUM_LEVELS}, got {level!r}")
  return level


# Digits of the two factors per level, shared by the product-like kinds.
_FACTOR_DIGITS = {0: (2, 2), 1: (3, 3), 2: (4, 3), 3: (4, 4), 4: (5, 4), 5: (5, 5)}


@register("product")
def _product(rng: random.Random, level: int) -> tuple[str, str, int]:
  da, db = _FACTOR_DIGITS[level]
  a, b = _num(rng, da), _num(rng, db)
  return f"What is {a}*{b}?", f"{a}*{b}", a * b


@register("sum")
def _sum(rng: random.Random, level: int) -> tuple[str, str, int]:
  count, digits = {0: (2, 2), 1: (2, 4), 2: (3, 4), 3: (4, 4), 4: (4, 5), 5: (5, 5)}[level]
  terms = [_num(rng, digits) for _ in range(count)]
  expr = "+".join(map(str, terms))
  return f"What is {expr}?", expr, sum(terms)


@register("modpow")
def _modpow(rng: random.Random, level: int) -> tuple[str, str, int]:
  da, db, dm = {0: (2, 1, 2), 1: (2, 2, 3), 2: (3, 2, 3), 3: (3, 3, 4), 4: (4, 3, 4),
                5: (5, 4, 5)}[level]
  a, b, m = _num(rng, da), _num(rng, db), _num(rng, dm)
  # The code spells the problem's expression out as it stands (not pow(a, b, m)):
  # see `make_problem`.
  expr = f"{a}**{b}%{m}"
  return f"What is {expr}?", expr, pow(a, b, m)


@register("digit_sum")
def _digit_sum(rng: random.Random, level: int) -> tuple[str, str, int]:
  da, db = _FACTOR_DIGITS[level]
  a, b = _num(rng, da), _num(rng, db)
  return (f"What is the sum of the digits of {a}*{b}?",
          f"sum(int(d) for d in str({a}*{b}))", sum(int(d) for d in str(a * b)))


def make_problem(rng: random.Random, kind: str, level: int) -> ToyProblem:
  """A problem whose code copies the problem's expression verbatim.

  Expressions have no spaces and every number is 1-2 tokens of the toy tokenizer, so
  copying them into code is a chain of one-token look-ups (the token after the one
  just copied), which a 2-layer model learns within the toy's SFT budget; with
  spaces around operators (` * `, a separate " " token before every number) the
  same look-up is ambiguous and the model copied the wrong number.
  """
  text, expr, answer = get(kind)(rng, _check_level(level))
  return ToyProblem(problem=text, answer=answer, kind=kind, level=level,
                    code=f"print({expr})")


def generate_problems(n: int, *, seed: int, levels: Sequence[int] = tuple(range(1, NUM_LEVELS + 1)),
                      kinds: Sequence[str] | None = None) -> list[ToyProblem]:
  """`n` problems, kinds and levels drawn uniformly; the same seed gives the same list."""
  if n < 0:
    raise ValueError(f"n must be >= 0, got {n}")
  levels = [_check_level(l) for l in levels]
  kinds = list(kinds) if kinds is not None else list(_KINDS)
  if not levels or not kinds:
    raise ValueError(f"need at least one level and one kind, got levels={levels}, kinds={kinds}")
  for k in kinds:
    get(k)
  rng = random.Random(seed)
  return [make_problem(rng, rng.choice(kinds), rng.choice(levels)) for _ in range(n)]


# --- an in-process executor for the code this module writes -----------------------------


def format_exception(e: BaseException, code: str) -> str:
  """`Type at line N: message` plus the offending line, as the sandbox reports it."""
  if isinstance(e, SyntaxError):
    lineno, message = e.lineno, e.msg
  else:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == _FILENAME]
    lineno, message = (frames[-1].lineno if frames else None), str(e)
  lines = code.splitlines()
  if lineno is None or not 1 <= lineno <= len(lines):
    return f"{type(e).__name__}: {message}"
  return (f"{type(e).__name__} at line {lineno}: {message}\n"
          f"{ERROR_LINE_INDENT}{lines[lineno - 1].strip()}")


def run_code(code: str, wall_time: float = 0.01) -> dict[str, Any]:
  """Runs trusted toy code in this process; returns a sandbox-style result mapping.

  Only for code generated here (no isolation). `wall_time` is passed through so that
  traces stay deterministic for a seed.
  """
  stdout = io.StringIO()
  try:
    compiled = compile(code, _FILENAME, "exec")
    with contextlib.redirect_stdout(stdout):
      exec(compiled, {"__name__": "__main__"})  # pylint: disable=exec-used
  except Exception as e:  # pylint: disable=broad-except
    return {"status": "error", "stdout": stdout.getvalue(), "stderr": "",
            "error": format_exception(e, code), "wall_time": wall_time}
  return {"status": "ok", "stdout": stdout.getvalue(), "stderr": "", "wall_time": wall_time}


# --- traces ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class TraceConfig:
  """Shares of noisy SFT traces.

  Attributes:
    bug_share: share of traces whose first call has a bug, then a fixed call.
    no_tool_share: share of traces that answer without calling the tool.
    no_tool_correct_share: probability that a no-tool guess is right.
    bug_kinds: bugs to draw from, uniformly: "syntax" (unclosed parenthesis) and
      "name" (misspelled `print`).
  """
  bug_share: float = 0.2
  no_tool_share: float = 0.1
  no_tool_correct_share: float = 0.5
  bug_kinds: tuple[str, ...] = BUG_KINDS

  def __post_init__(self):
    for field in ("bug_share", "no_tool_share", "no_tool_correct_share"):
      value = getattr(self, field)
      if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"TraceConfig.{field} must be in [0, 1], got {value!r}")
    if self.bug_share + self.no_tool_share > 1.0 + 1e-12:
      raise ValueError(f"TraceConfig: bug_share + no_tool_share must be <= 1, got "
                       f"{self.bug_share} + {self.no_tool_share}")
    if not self.bug_kinds or any(k not in BUG_KINDS for k in self.bug_kinds):
      raise ValueError(f"TraceConfig.bug_kinds must be a non-empty subset of {BUG_KINDS}, "
                       f"got {self.bug_kinds!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToyTrace:
  """One SFT conversation. `messages` use the chat-message JSONL layout (roles user /
  assistant / tool, structured `tool_calls`), ready for `render_conversation`."""
  problem: ToyProblem
  messages: tuple[dict[str, Any], ...]
  variant: str
  final_answer: int

  @property
  def correct(self) -> bool:
    return self.final_answer == self.problem.answer

  @property
  def codes(self) -> tuple[str, ...]:
    """The code of each call, in order."""
    return tuple(c["arguments"]["code"] for m in self.messages for c in m.get("tool_calls", ()))

  def as_row(self) -> dict[str, Any]:
    return {"messages": [dict(m) for m in self.messages], "problem": self.problem.problem,
            "answer": str(self.problem.answer), "variant": self.variant}


_INTROS = ("Let me compute this with Python.", "I will use Python to compute it.",
           "This needs exact arithmetic, so I will run Python.")
_FIXES = ("The code has a {error}. Let me fix it.", "There is a {error}; I will correct the code.")
_RESULTS = ("The result is {n}.", "The code printed {n}.")
_GUESSES = ("I will answer directly.", "I can do this in my head.")


def _final_text(lead: str, n: int) -> str:
  return f"{lead}\n</reason>\n<answer>\n\\boxed{{{n}}}\n</answer>"


def _buggy(code: str, bug: str) -> str:
  if bug == "syntax":
    return code[:-1]  # drops the closing parenthesis of print(...)
  return "prnt" + code[len("print"):]


def _wrong_guess(rng: random.Random, answer: int) -> int:
  """The answer with one digit changed (the leading one never to 0)."""
  digits = list(str(answer))
  pos = rng.randrange(len(digits))
  choices = [d for d in "0123456789" if d != digits[pos] and not (pos == 0 and d == "0"
                                                                   and len(digits) > 1)]
  digits[pos] = rng.choice(choices)
  return int("".join(digits))


def make_trace(problem: ToyProblem, rng: random.Random, *,
               config: TraceConfig = TraceConfig(),
               chat_config: chat.ChatConfig | None = None) -> ToyTrace:
  """One trace for `problem`; the variant is drawn with the shares of `config`."""
  chat_config = chat_config or toy_chat_config()
  tool_name = chat_config.tool_name
  user = {"role": "user", "content": problem.problem}
  u = rng.random()
  if u < config.no_tool_share:
    correct = rng.random() < config.no_tool_correct_share
    guess = problem.answer if correct else _wrong_guess(rng, problem.answer)
    final = {"role": "assistant", "content": _final_text(rng.choice(_GUESSES), guess)}
    return ToyTrace(problem=problem, messages=(user, final), variant="no_tool",
                    final_answer=guess)

  def call(content: str, code: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    msg = {"role": "assistant", "content": content,
           "tool_calls": [{"name": tool_name, "arguments": {"code": code}}]}
    result = run_code(code, wall_time=round(rng.uniform(0.01, 0.05), 2))
    text = chat.truncate_middle(chat.render_executor_result(result, chat_config),
                                chat_config.response_max_chars, chat_config.truncation_marker)
    return msg, {"role": "tool", "content": text}, result

  messages: list[dict[str, Any]] = [user]
  variant = "clean"
  if u < config.no_tool_share + config.bug_share:
    variant = "bug_fixed"
    bug = rng.choice(config.bug_kinds)
    msg, tool, result = call(rng.choice(_INTROS), _buggy(problem.code, bug))
    if result["status"] != "error":
      raise AssertionError(f"the {bug} bug did not fail: {msg}")
    error_type = result["error"].split(" ", 1)[0]
    messages += [msg, tool]
    intro = rng.choice(_FIXES).format(error=error_type)
  else:
    intro = rng.choice(_INTROS)
  msg, tool, result = call(intro, problem.code)
  printed = result["stdout"].strip()
  if result["status"] != "ok" or printed != str(problem.answer):
    raise AssertionError(f"toy code {problem.code!r} printed {printed!r}, expected "
                         f"{problem.answer} ({result})")
  messages += [msg, tool]
  messages.append({"role": "assistant",
                   "content": _final_text(rng.choice(_RESULTS).format(n=printed), problem.answer)})
  return ToyTrace(problem=problem, messages=tuple(messages), variant=variant,
                  final_answer=problem.answer)


def make_traces(problems: Iterable[ToyProblem], *, seed: int,
                config: TraceConfig = TraceConfig(),
                chat_config: chat.ChatConfig | None = None) -> list[ToyTrace]:
  rng = random.Random(seed)
  chat_config = chat_config or toy_chat_config()
  return [make_trace(p, rng, config=config, chat_config=chat_config) for p in problems]


def render_trace(protocol: chat.ChatProtocol, trace: ToyTrace) -> chat.RenderedConversation:
  """Token ids and loss mask (1 on assistant tokens) through the rollout's functions."""
  return protocol.render_conversation(trace.messages)


def copy_probe(protocol: chat.ChatProtocol, problems: Sequence[ToyProblem], *, seed: int
               ) -> tuple[dict[str, Any], Any, Any]:
  """Clean traces of `problems` for scoring copying by teacher forcing.

  Every digit the assistant writes in a clean trace is a copy: the operands into the
  code, then the printed result, restated and boxed. Returns ([N, T] int32 arrays
  input_ids / target_ids / segment_ids, a float mask of the targets that are such
  digit tokens, and a bool mask of the positions before the tool response (the code)).
  """
  import numpy as np
  traces = make_traces(problems, seed=seed, chat_config=protocol.config,
                       config=TraceConfig(bug_share=0.0, no_tool_share=0.0))
  rendered = [render_trace(protocol, t) for t in traces]
  tok = protocol.tokenizer
  is_digit = np.array([any(ch.isdigit() for ch in tok.decode([i]))
                       for i in range(tok.vocab_size)])
  response_start = tok.token_id(tokenizer_lib.TOOL_RESPONSE_START)
  n, t_len = len(rendered), max(len(r.ids) for r in rendered) - 1
  arrays = {k: np.zeros((n, t_len), np.int32)
            for k in ("input_ids", "target_ids", "segment_ids")}
  mask = np.zeros((n, t_len), np.float32)
  in_code = np.zeros((n, t_len), bool)
  for i, r in enumerate(rendered):
    ids, length = np.asarray(r.ids), len(r.ids) - 1
    arrays["input_ids"][i, :length] = ids[:-1]
    arrays["target_ids"][i, :length] = ids[1:]
    arrays["segment_ids"][i, :length] = 1
    mask[i, :length] = np.asarray(r.loss_mask[1:]) * is_digit[ids[1:]]
    in_code[i, :list(ids).index(response_start)] = True
  return arrays, mask, in_code


# --- chat config and tokenizer for the toy --------------------------------------------


def toy_chat_config(**overrides: Any) -> chat.ChatConfig:
  """The release's protocol with short texts, so that sequences stay ~100-250 tokens.

  Same structure (system + tools section, user turn, `<reason>` generation prompt,
  Hermes calls, `<tool_response>` turns, release truncation); only the wording is
  shorter (no call-format instructions: SFT teaches the format) and the tool is called
  `python` with just `code`. The system turn is 58 tokens with the toy tokenizer
  instead of 597 with the release's texts.
  """
  # A minimal schema: the tools section costs prompt tokens on every sequence.
  schema = {"type": "function",
            "function": {"name": TOY_TOOL_NAME,
                         "parameters": {"properties": {"code": {"type": "string"}}}}}
  kwargs: dict[str, Any] = dict(
      system_prompt=("Reason in <reason> </reason>, then answer in <answer> </answer> "
                     "with \\boxed{}."),
      tools_header="\n<tools>",
      tools_footer="\n</tools>",
      tool_schema=schema,
      user_template="{problem}",
      show_execution_time=False,  # deterministic rollouts (exact resume); the toy needs no timing
  )
  kwargs.update(overrides)
  return chat.ChatConfig(**kwargs)


def conversation_text(messages: Sequence[dict[str, Any]], chat_config: chat.ChatConfig) -> str:
  """The whole conversation as text (what the ids of `render_conversation` decode to)."""
  text = chat.prompt_text(messages[0]["content"], chat_config)
  i = 1
  while i < len(messages):
    content = chat.assistant_text(messages[i], i)
    n_calls = len(messages[i].get("tool_calls") or ())
    if not n_calls:
      return text + content + chat.IM_END
    responses = [m["content"] for m in messages[i + 1:i + 1 + n_calls]]
    # Whether the model wrote <|im_end|> or the tool side added it, the text is the same.
    text += content + chat.tool_turn_text(responses, chat_config, close_assistant=True)
    i += 1 + n_calls
  return text


def tokenizer_corpus(n: int = 2000, *, seed: int = 0,
                     config: TraceConfig = TraceConfig(),
                     chat_config: chat.ChatConfig | None = None) -> list[str]:
  """Texts for training the toy tokenizer: whole conversations of every variant at
  every level (all digits and the protocol's wording occur many times)."""
  chat_config = chat_config or toy_chat_config()
  problems = generate_problems(n, seed=seed)
  traces = make_traces(problems, seed=seed + 1, config=config, chat_config=chat_config)
  return [conversation_text(t.messages, chat_config) for t in traces]


def number_chunks(digits: int = 3) -> list[str]:
  """Every chunk the number-chunk pre-tokenizer can cut (0-9, 00-99, 000-999 for 3
  digits), so that each becomes one id whatever the corpus happened to contain."""
  return [f"{i:0{w}d}" for w in range(1, digits + 1) for i in range(10 ** w)]


def train_toy_tokenizer(vocab_size: int = 2048, *, n: int = 2000, seed: int = 0,
                        chat_config: chat.ChatConfig | None = None,
                        number_chunk: int = 3) -> tokenizer_lib.Tokenizer:
  """A byte-level BPE for the toy task (about a second on one core).

  Numbers are cut into chunks of up to `number_chunk` digits and every chunk is one id
  (1110 ids for 3 digits): copying a number from the problem into the code and from
  the output into the answer is then copying a few rare tokens, which a 2-layer model
  learns in a few hundred SFT steps; with Qwen's one-digit split (`number_chunk=1`,
  ~550 ids in all) it wrote the right digits in the wrong order.
  """
  corpus = tokenizer_corpus(n, seed=seed, chat_config=chat_config,
                            config=TraceConfig(bug_share=0.3, no_tool_share=0.2))
  if number_chunk > 1:
    # Twice, to pass the BPE trainer's min_frequency=2.
    corpus += [" ".join(number_chunks(number_chunk))] * 2
  return tokenizer_lib.train_tokenizer(corpus, vocab_size,
                                       pattern=tokenizer_lib.number_chunk_pattern(number_chunk))
