"""Agent loop end to end: multi-turn trajectories against a real sandbox server.

Two engines drive `run_trajectory` / `run_many`:
  * a scripted engine that replays the model turns of toy SFT traces (token ids plus
    made-up log-probs), so the whole trajectory is known in advance: it must
    reproduce `toy_task.render_trace` id for id, with the tool responses coming from
    the real sandbox;
  * a real tiny JaxEngine (random Qwen3) behind an EnginePool, whose sampler
    log-probs must equal the trainer's `sequence_logprobs` on the same tokens.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import math

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar_jax.data import toy_task
from rstar_jax.model import qwen3
from rstar_jax.model.model_config import Qwen3Config
from rstar_jax.rl import train_step as ts
from rstar_jax.rollout import chat
from rstar_jax.rollout.agent_loop import AgentConfig, run_many, run_trajectory
from rstar_jax.rollout.jax_engine import (EngineConfig, GenerationRequest, GenerationResult,
                                          JaxEngine)
from rstar_jax.rollout.scheduler import EnginePool
from rstar_jax.rollout.sandbox_client import SandboxTools
from sandbox.launcher import running_server


# --- fixtures -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sandbox_url():
  with running_server(max_children=8, pool_size=2) as url:
    yield url


@pytest.fixture(scope="module")
def tok():
  return toy_task.train_toy_tokenizer(1024, n=400, seed=0)


@pytest.fixture(scope="module")
def proto(tok):
  return chat.ChatProtocol(tok, toy_task.toy_chat_config())


@pytest.fixture(scope="module")
def traces():
  """Four traces of each variant (clean, bug_fixed: 2 NameError + 2 SyntaxError, no_tool)."""
  problems = toy_task.generate_problems(80, seed=5)
  all_traces = toy_task.make_traces(problems, seed=6, config=toy_task.TraceConfig(
      bug_share=0.35, no_tool_share=0.25))
  def pick(pred):
    found = [t for t in all_traces if pred(t)][:4]
    assert len(found) == 4, "the seed should give 4 traces of each kind"
    return found
  name_bug = lambda t: t.variant == "bug_fixed" and t.codes[0].startswith("prnt")
  syntax_bug = lambda t: t.variant == "bug_fixed" and not name_bug(t)
  return (pick(lambda t: t.variant == "clean") + pick(name_bug)[:2] + pick(syntax_bug)[:2]
          + pick(lambda t: t.variant == "no_tool"))


# --- a scripted engine ------------------------------------------------------------------


@dataclasses.dataclass
class Script:
  """What the 'model' says in each assistant turn of one trajectory."""
  prompt_ids: list[int]
  turns: list[list[int]]
  logprobs: list[list[float]]
  requests: list[GenerationRequest] = dataclasses.field(default_factory=list)


def model_turns(tok, proto, messages) -> list[list[int]]:
  """Ids the model samples per assistant turn (as `render_conversation` lays them out
  with stop_at_tool_call: a call turn ends at `</tool_call>`, the last at `<|im_end|>`)."""
  turns = []
  for msg in messages:
    if msg["role"] != "assistant":
      continue
    ids = tok.encode(chat.assistant_text(msg))
    if not msg.get("tool_calls"):
      ids.append(proto.token_ids.im_end)
    turns.append(ids)
  return turns


def make_script(proto, problem: str, turns: list[list[int]], seed: int) -> Script:
  rng = np.random.RandomState(seed)
  return Script(prompt_ids=proto.prompt_ids(problem), turns=turns,
                logprobs=[(-rng.uniform(0.01, 5.0, len(t))).tolist() for t in turns])


class ScriptedEngine:
  """`async generate` that replays scripted turns, picking the script whose prompt
  starts the request and the turn by how many requests that script has seen.

  Behaves like JaxEngine at the edges the loop relies on: output is cut at
  `max_new_tokens` (finish "length"), a stop id ends it (finish "stop").
  """

  def __init__(self, scripts: list[Script]):
    self.scripts = scripts

  async def generate(self, request: GenerationRequest) -> GenerationResult:
    await asyncio.sleep(0)  # let the other trajectories run, as a real engine would
    ids = list(request.input_ids)
    found = [s for s in self.scripts if ids[:len(s.prompt_ids)] == s.prompt_ids]
    assert len(found) == 1, f"request {request.request_id} matches {len(found)} scripts"
    script = found[0]
    k = len(script.requests)
    script.requests.append(request)
    assert k < len(script.turns), f"request {request.request_id}: script has {k} turns"
    turn = script.turns[k]
    stops = [j for j, t in enumerate(turn) if t in request.stop_token_ids]
    assert stops in ([], [len(turn) - 1]), (
        f"scripted turn {k} has a stop id before its end (at {stops}): a real engine "
        "would have stopped there")
    out = turn[:request.max_new_tokens]
    reason = "stop" if out and out[-1] in request.stop_token_ids else "length"
    return GenerationResult(request_id=request.request_id, output_ids=list(out),
                            logprobs=script.logprobs[k][:len(out)], finish_reason=reason,
                            prompt_tokens=len(ids), reused_prefix_tokens=0, queue_wait_s=0.0)


class CountingTools:
  """The real SandboxTools, counting what reaches the sandbox."""

  def __init__(self, url: str):
    self.inner = SandboxTools(url, timeout_s=10.0)
    self.batches: list[list[chat.ParsedToolCall]] = []

  async def execute(self, calls):
    self.batches.append(list(calls))
    return await self.inner.execute(calls)

  @property
  def num_calls(self) -> int:
    return sum(len(b) for b in self.batches)


def run_scripted(proto, url, scripts, problems, cfg, seeds=None):
  """Runs `problems` [(uid, text)] through run_many with the scripted engine."""
  engine = ScriptedEngine(scripts)
  tools = CountingTools(url)

  async def main():
    try:
      return await run_many(engine, tools, proto, problems, cfg,
                            seeds=seeds or list(range(len(problems))))
    finally:
      await tools.inner.aclose()
  return asyncio.run(main()), tools


def trace_case(tok, proto, trace, seed=0):
  turns = model_turns(tok, proto, trace.messages)
  return make_script(proto, trace.problem.problem, turns, seed)


def tool_texts(trace) -> list[str]:
  return [m["content"] for m in trace.messages if m["role"] == "tool"]


def model_spans(mask) -> list[tuple[int, int]]:
  spans, start = [], None
  for i, m in enumerate(list(mask) + [0]):
    if m and start is None:
      start = i
    elif not m and start is not None:
      spans.append((start, i))
      start = None
  return spans


# --- trajectories that replay SFT traces ---------------------------------------------------


def test_trajectories_reproduce_the_sft_traces(tok, proto, sandbox_url, traces):
  scripts = [trace_case(tok, proto, t, seed=i) for i, t in enumerate(traces)]
  problems = [(f"t{i}", t.problem.problem) for i, t in enumerate(traces)]
  trajs, tools = run_scripted(proto, sandbox_url, scripts, problems, AgentConfig(max_turns=10))

  assert tools.num_calls == sum(len(t.codes) for t in traces)
  for t, s, traj in zip(traces, scripts, trajs):
    where = f"{traj.uid} ({t.variant})"
    rendered = toy_task.render_trace(proto, t)
    assert traj.prompt_ids == rendered.ids[:rendered.prompt_len], where
    resp = rendered.ids[rendered.prompt_len:]
    # The tool responses come from the real sandbox and must equal the traces' texts.
    got_tools = [tok.decode(traj.response_ids[a:b])
                 for a, b in model_spans([1 - m for m in traj.response_mask])]
    resp_mask = rendered.loss_mask[rendered.prompt_len:]
    want_tools = [tok.decode(resp[a:b]) for a, b in model_spans([1 - m for m in resp_mask])]
    assert got_tools == want_tools, where
    assert len(got_tools) == len(tool_texts(t)), where
    for text, got in zip(tool_texts(t), got_tools):
      assert f"<tool_response>\n{text}\n</tool_response>" in got, where
    assert traj.response_ids == resp, where
    assert traj.response_mask == resp_mask, where
    # Every request's input is exactly prompt + response so far: nothing re-tokenized.
    for req, (a, _) in zip(s.requests, traj.turns):
      assert list(req.input_ids) == rendered.ids[:rendered.prompt_len + a], where
      assert req.stop_token_ids == proto.stop_ids
    # Mask 1 exactly on the model's turns; log-probs line up with it.
    assert len(traj.response_logprobs) == len(traj.response_ids) == len(traj.response_mask)
    assert model_spans(traj.response_mask) == traj.turns, where
    assert [traj.response_ids[a:b] for a, b in traj.turns] == s.turns, where
    lp = np.asarray(traj.response_logprobs)
    mask = np.asarray(traj.response_mask, bool)
    np.testing.assert_array_equal(lp[mask], np.concatenate(s.logprobs), err_msg=where)
    assert (lp[~mask] == 0).all(), where
    # Statistics.
    n_calls = {"clean": 1, "bug_fixed": 2, "no_tool": 0}[t.variant]
    assert (traj.num_tool_calls, traj.num_tool_errors) == (n_calls, int(t.variant == "bug_fixed"))
    assert traj.tool_statuses == ({"ok": 1, "error": 1} if t.variant == "bug_fixed"
                                  else {"ok": n_calls} if n_calls else {}), where
    assert traj.finish_reason == "stop" and not traj.truncated, where
    assert traj.num_turns == n_calls + 1 and traj.answer_tags == 1, where
    stats = proto.format_stats(traj.response_ids, traj.response_mask)
    assert (stats.answer_tags, stats.assistant_turns) == (1, traj.num_turns), where
    assert f"\\boxed{{{t.final_answer}}}" in traj.model_text(tok), where
    assert traj.response_mask[-1] == 1 and traj.response_ids[-1] == proto.token_ids.im_end


def test_tool_errors_follow_sandbox_status(tok, proto, sandbox_url, traces):
  """The buggy call's response is the sandbox's error (Type at line N: message)."""
  bug = [t for t in traces if t.variant == "bug_fixed"]
  scripts = [trace_case(tok, proto, t, seed=i) for i, t in enumerate(bug)]
  trajs, tools = run_scripted(proto, sandbox_url, scripts,
                              [(f"b{i}", t.problem.problem) for i, t in enumerate(bug)],
                              AgentConfig())
  assert [len(b) for b in tools.batches] == [1] * (2 * len(bug))  # one call per turn
  for t, traj in zip(bug, trajs):
    first_tool = tok.decode(traj.response_ids[traj.turns[0][1]:traj.turns[1][0]])
    error_type = "NameError" if t.codes[0].startswith("prnt") else "SyntaxError"
    assert "Tool call failure\nreason: error" in first_tool
    assert f"stderr: {error_type} at line 1: " in first_tool
    assert (traj.num_tool_calls, traj.num_tool_errors) == (2, 1)


@pytest.mark.parametrize("max_turns", [1, 2, 3])
def test_max_turns(tok, proto, sandbox_url, traces, max_turns):
  trace = next(t for t in traces if t.variant == "bug_fixed")   # 3 model turns, 2 calls
  script = trace_case(tok, proto, trace)
  (traj,), tools = run_scripted(proto, sandbox_url, [script], [("m", trace.problem.problem)],
                                AgentConfig(max_turns=max_turns))
  rendered = toy_task.render_trace(proto, trace)
  resp = rendered.ids[rendered.prompt_len:]
  assert traj.num_turns == max_turns
  end = traj.turns[-1][1]
  assert traj.response_ids == resp[:end]
  assert traj.response_mask == rendered.loss_mask[rendered.prompt_len:][:end]
  assert traj.response_mask[-1] == 1, "the last turn is always the model's"
  # The model still wanted a tool at turn max_turns: that call is never run.
  assert tools.num_calls == max_turns - 1 == traj.num_tool_calls
  assert traj.num_tool_errors == (0 if max_turns == 1 else 1)
  if max_turns < 3:
    assert traj.finish_reason == "max_turns" and traj.truncated
    assert traj.response_ids[-1] == proto.token_ids.tool_call_end
  else:
    assert traj.finish_reason == "stop" and not traj.truncated


# Response budgets relative to the clean trace's first model turn (a tokens), the tool
# turn after it (b) and the final turn (c).
BUDGETS = {
    "inside_first_turn": lambda a, b, c: 5,
    "before_tool_call_end": lambda a, b, c: a - 1,
    "first_turn_exactly": lambda a, b, c: a,
    "no_room_after_tool_turn": lambda a, b, c: a + b,
    "one_token_after_tool_turn": lambda a, b, c: a + b + 1,
    "all_but_im_end": lambda a, b, c: a + b + c - 1,
    "everything": lambda a, b, c: a + b + c,
}


@pytest.mark.parametrize("case", list(BUDGETS))
def test_response_budget(tok, proto, sandbox_url, traces, case):
  trace = next(t for t in traces if t.variant == "clean")
  script = trace_case(tok, proto, trace)
  rendered = toy_task.render_trace(proto, trace)
  resp = rendered.ids[rendered.prompt_len:]
  resp_mask = rendered.loss_mask[rendered.prompt_len:]
  a, c = map(len, script.turns)
  b = len(resp) - a - c
  budget = BUDGETS[case](a, b, c)
  (traj,), _ = run_scripted(proto, sandbox_url, [script], [("L", trace.problem.problem)],
                            AgentConfig(max_response_tokens=budget))
  # A tool turn that leaves no room for another model token is dropped.
  end = a if a <= budget <= a + b else min(budget, len(resp))
  assert traj.response_ids == resp[:end]
  assert traj.response_mask == resp_mask[:end]
  assert len(traj.response_ids) <= budget
  assert traj.response_mask[-1] == 1, "the last turn is always the model's"
  assert traj.finish_reason == ("stop" if case == "everything" else "length")
  assert traj.truncated == (case != "everything")
  # Tool tokens count toward the budget: the second turn may only fill what is left.
  for req, (start, _) in zip(script.requests, traj.turns):
    assert req.max_new_tokens == budget - start
  if end > a:
    assert (traj.num_tool_calls, traj.num_tool_errors) == (1, 0)


# --- malformed tool calls -------------------------------------------------------------------


def call_turn(tok, content: str, body: str) -> list[int]:
  return tok.encode(f"{content}\n{chat.TOOL_CALL_START}\n{body}\n{chat.TOOL_CALL_END}")


def answer_turn(tok, proto, n: int) -> list[int]:
  return tok.encode(f"Done.\n</reason>\n<answer>\n\\boxed{{{n}}}\n</answer>") + [
      proto.token_ids.im_end]


def test_malformed_tool_call_is_a_parse_error_without_sandbox(tok, proto, sandbox_url):
  bad = '{"name": "python", "arguments": {"code": "print(6 * 7)"}'   # one brace short
  good = json.dumps({"name": "python", "arguments": {"code": "print(6 * 7)"}})
  problem = "What is 6 * 7?"
  turns = [call_turn(tok, "Let me compute.", bad), call_turn(tok, "Fix the JSON.", good),
           answer_turn(tok, proto, 42)]
  script = make_script(proto, problem, turns, seed=1)
  (traj,), tools = run_scripted(proto, sandbox_url, [script], [("p", problem)], AgentConfig())

  try:
    json.loads(bad)
  except json.JSONDecodeError as e:
    parse_error = f"{proto.config.parse_error_prefix}{e}"
  expected = (turns[0] + proto.tool_turn_ids(turns[0], [parse_error]) + turns[1]
              + proto.tool_turn_ids(turns[1], ["Tool call success\nstdout: 42\n"]) + turns[2])
  assert tok.decode(traj.response_ids) == tok.decode(expected)
  assert traj.response_ids == expected
  # Only the well-formed call reached the sandbox.
  assert [[c.code for c in b] for b in tools.batches] == [["print(6 * 7)"]]
  assert (traj.num_tool_calls, traj.num_tool_errors) == (2, 1)
  assert traj.tool_statuses == {"parse_error": 1, "ok": 1}
  assert traj.finish_reason == "stop" and traj.num_turns == 3
  assert model_spans(traj.response_mask) == traj.turns


def test_unclosed_tool_call_is_a_parse_error(tok, proto, sandbox_url):
  """A turn that ends (here at <|im_end|>) inside an unclosed `<tool_call>` is a parse
  error too: the model gets the error and another turn; the sandbox gets nothing."""
  problem = "What is 2 + 2?"
  turn = tok.encode(f"Try.\n{chat.TOOL_CALL_START}\n{{\"name\": ") + [proto.token_ids.im_end]
  script = make_script(proto, problem, [turn, answer_turn(tok, proto, 4)], seed=2)
  (traj,), tools = run_scripted(proto, sandbox_url, [script], [("u", problem)],
                                AgentConfig(max_turns=2))
  assert tools.num_calls == 0
  tool_ids = traj.response_ids[traj.turns[0][1]:traj.turns[1][0]]
  assert "without </tool_call>" in tok.decode(tool_ids)
  # The model closed its turn itself: the tool side does not add another <|im_end|>.
  assert tool_ids[0] != proto.token_ids.im_end
  assert (traj.num_tool_calls, traj.num_tool_errors, traj.finish_reason) == (1, 1, "stop")


# --- a real JaxEngine ------------------------------------------------------------------------


class ForcedFirstTurn:
  """Turn 0 of every trajectory is a scripted tool call (a random model rarely calls a
  tool); every later turn is sampled by the real engine, whose results are recorded."""

  def __init__(self, engine, first_turns: dict[tuple[int, ...], list[int]]):
    self.engine = engine
    self.first_turns = first_turns
    self.real: list[tuple[GenerationRequest, GenerationResult]] = []

  async def generate(self, request):
    forced = self.first_turns.get(tuple(request.input_ids))
    if forced is not None:
      await asyncio.sleep(0)
      return GenerationResult(request_id=request.request_id, output_ids=list(forced),
                              logprobs=[math.nan] * len(forced), finish_reason="stop",
                              prompt_tokens=len(request.input_ids), reused_prefix_tokens=0,
                              queue_wait_s=0.0)
    out = await self.engine.generate(request)
    self.real.append((request, out))
    return out


@pytest.fixture(scope="module")
def tiny_model(tok):
  cfg = Qwen3Config(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=8, initializer_range=0.3, rope_theta=10_000.0)
  return qwen3.create_model(cfg)


def run_real(tiny_model, tok, proto, url, problems, engines_slots, cfg, seeds):
  # One prefill bucket (256) and one decode shape: few compiles on a busy CI machine.
  engines = [JaxEngine(tiny_model, EngineConfig(num_slots=n, max_len=256, min_prefill_bucket=256),
                       name=f"e{i}") for i, n in enumerate(engines_slots)]
  pool = EnginePool(engines, policy="kv_capacity")
  first = {tuple(proto.prompt_ids(p.problem)): tok.encode(chat.assistant_text({
      "content": "Let me compute.",
      "tool_calls": [{"name": toy_task.TOY_TOOL_NAME, "arguments": {"code": p.code}}]}))
      for p in problems}
  engine = ForcedFirstTurn(pool, first)
  tools = SandboxTools(url, timeout_s=10.0)

  async def main():
    try:
      return await run_many(engine, tools, proto,
                            [(f"r{i}", p.problem) for i, p in enumerate(problems)], cfg,
                            seeds=seeds)
    finally:
      await tools.aclose()
  try:
    trajs = asyncio.run(main())
  finally:
    for e in engines:
      e.stop()
  return trajs, engine, pool, first


def trainer_logprobs(model, trajs, length: int = 256) -> np.ndarray:
  """The trainer's log-probs of prompt + response, one padded fp32 batch: row i, column
  j is log p(token j + 1 | tokens <= j) of trajectory i."""
  ids = np.zeros((len(trajs), length + 1), np.int32)
  mask = np.zeros((len(trajs), length), np.int32)
  for i, t in enumerate(trajs):
    seq = t.prompt_ids + t.response_ids
    ids[i, :len(seq)] = seq
    mask[i, :len(seq) - 1] = 1
  graphdef, params = nnx.split(model, nnx.Param)
  fn = jax.jit(functools.partial(ts.sequence_logprobs, graphdef, chunk=64))
  return np.asarray(fn(params, jnp.asarray(ids[:, :-1]), jnp.asarray(ids[:, 1:]),
                       jnp.asarray(mask)))


def test_real_engine_trajectories_and_logprob_alignment(tiny_model, tok, proto, sandbox_url):
  problems = toy_task.generate_problems(6, seed=21)
  cfg = AgentConfig(max_turns=4, max_response_tokens=96, temperature=1.0)
  seeds = [100 + i for i in range(len(problems))]
  trajs, engine, pool, first = run_real(tiny_model, tok, proto, sandbox_url, problems, [3, 3],
                                        cfg, seeds)
  trainer_lps = trainer_logprobs(tiny_model, trajs)
  real_turns = 0
  for p, traj, trainer in zip(problems, trajs, trainer_lps):
    n = len(traj.response_ids)
    assert n == len(traj.response_mask) == len(traj.response_logprobs) and 0 < n <= 96
    assert traj.finish_reason in ("stop", "length", "max_turns")
    assert model_spans(traj.response_mask) == traj.turns
    # Turn 0 is the forced call; the real sandbox answered it.
    forced = first[tuple(traj.prompt_ids)]
    a = len(forced)
    assert traj.turns[0] == (0, a) and traj.response_ids[:a] == forced
    tool_turn = proto.tool_turn_ids(forced, [f"Tool call success\nstdout: {p.answer}\n"])
    assert traj.response_ids[a:a + len(tool_turn)] == tool_turn
    assert traj.tool_statuses["ok"] >= 1 and traj.num_tool_calls >= 1
    assert traj.num_turns >= 2, "the real engine must have sampled at least one turn"
    # Alignment on the tokens the real engine sampled (not the forced turn).
    p0 = len(traj.prompt_ids)
    for s, e in traj.turns[1:]:
      real_turns += 1
      np.testing.assert_allclose(np.asarray(traj.response_logprobs[s:e]),
                                 trainer[p0 + s - 1:p0 + e - 1], atol=1e-5, rtol=0,
                                 err_msg=f"{traj.uid} turn {(s, e)}")
    # Every real turn is what the engine returned, placed where the loop says.
    mine = [(req, out) for req, out in engine.real if list(req.input_ids[:p0]) == traj.prompt_ids]
    assert [traj.response_ids[s:e] for s, e in traj.turns[1:]] == [o.output_ids for _, o in mine]
  assert real_turns == len(engine.real)
  stats = pool.stats()
  assert stats["e0/requests"] + stats["e1/requests"] == len(engine.real)
  assert stats["e0/generated_tokens"] + stats["e1/generated_tokens"] == sum(
      len(o.output_ids) for _, o in engine.real)


def test_real_engine_trajectories_do_not_depend_on_scheduling(tiny_model, tok, proto,
                                                              sandbox_url):
  """Per-request seeds: two engines or one, the trajectories are the same."""
  problems = toy_task.generate_problems(4, seed=22)
  cfg = AgentConfig(max_turns=3, max_response_tokens=96, temperature=0.8, top_p=0.95)
  seeds = [7, 8, 9, 10]
  two, *_ = run_real(tiny_model, tok, proto, sandbox_url, problems, [3, 3], cfg, seeds)
  one, *_ = run_real(tiny_model, tok, proto, sandbox_url, problems, [3], cfg, seeds)
  assert all(t.num_turns >= 2 and t.num_tool_calls >= 1 for t in two)
  for x, y in zip(two, one):
    assert x.response_ids == y.response_ids and x.response_mask == y.response_mask
    np.testing.assert_allclose(x.response_logprobs, y.response_logprobs, atol=1e-5)
    assert x.finish_reason == y.finish_reason


class _RecordingEngine:
  """Answers every request with `max_new_tokens` copies of token 7 (no stop), and
  records the requests; `max_len` as an engine states it."""

  def __init__(self, max_len):
    self.max_len, self.requests = max_len, []

  async def generate(self, request):
    request.validate(self.max_len)   # what JaxEngine and the servers enforce
    self.requests.append(request)
    n = request.max_new_tokens
    return GenerationResult(request_id=request.request_id, output_ids=[7] * n,
                            logprobs=[-1.0] * n, finish_reason="length",
                            prompt_tokens=len(request.input_ids), reused_prefix_tokens=0,
                            queue_wait_s=0.0)


def test_context_longer_than_the_engine_ends_as_truncated(proto):
  """A prompt (or prompt + response) that fills the engine's sequence length ends the
  trajectory with finish 'length' (reward 0 downstream), never as a refused request."""
  prompt = proto.prompt_ids("What is 2+2?")
  cfg = AgentConfig(max_turns=3, max_response_tokens=64)
  short = _RecordingEngine(max_len=len(prompt) + 5)
  t = asyncio.run(run_trajectory(short, None, proto, "What is 2+2?", cfg, seed=0))
  assert [r.max_new_tokens for r in short.requests] == [5]      # capped to the room left
  assert t.finish_reason == "length" and t.truncated and len(t.response_ids) == 5
  tiny = _RecordingEngine(max_len=len(prompt))
  t = asyncio.run(run_trajectory(tiny, None, proto, "What is 2+2?", cfg, seed=0))
  assert tiny.requests == [] and t.finish_reason == "length" and t.response_ids == []


def test_a_tool_turn_that_would_overflow_the_engine_ends_the_trajectory(tok, proto):
  """The tool turn was checked against the response budget only: with a long prompt it
  pushed the trajectory past the engine's max_len and left a tool turn last (the batch
  builder then refused the step)."""
  problem = "What is 6 * 7?"
  turn = call_turn(tok, "Let me compute.", "not json")   # a parse error: no sandbox needed
  script = make_script(proto, problem, [turn, answer_turn(tok, proto, 42)], seed=3)
  engine = ScriptedEngine([script])
  engine.max_len = len(script.prompt_ids) + len(turn) + 3
  cfg = AgentConfig(max_turns=3, max_response_tokens=500)   # the budget alone has room
  t = asyncio.run(run_trajectory(engine, None, proto, problem, cfg, seed=0))
  assert t.finish_reason == "length" and t.truncated
  assert t.response_ids == turn and t.response_mask == [1] * len(turn)   # the model's turn last
  assert len(t.prompt_ids) + len(t.response_ids) <= engine.max_len
  engine = ScriptedEngine([make_script(proto, problem, [turn, answer_turn(tok, proto, 42)], 3)])
  engine.max_len = 4096   # room: the same turns go on to the answer
  t = asyncio.run(run_trajectory(engine, None, proto, problem, cfg, seed=0))
  assert t.finish_reason == "stop" and t.num_turns == 2


class _FlakyEngine:
  """Answers `\\boxed{4}` at once (sampling-free: the same ids whatever the seed), and
  fails the first `fails[uid]` requests of a trajectory as an SGLang server would."""
  max_len = 4096

  def __init__(self, tok, proto, fails):
    self.answer = answer_turn(tok, proto, 4)
    self.fails, self.seen = dict(fails), []

  async def generate(self, request):
    from rstar_jax.rollout.engine import RequestFailed
    await asyncio.sleep(0)
    uid = request.request_id.rsplit("/", 1)[0]
    self.seen.append((uid, request.seed))
    if self.fails.get(uid, 0) > 0:
      self.fails[uid] -= 1
      raise RequestFailed(f"bad reply for {uid}")
    return GenerationResult(request_id=request.request_id, output_ids=list(self.answer),
                            logprobs=[-0.5] * len(self.answer), finish_reason="stop",
                            prompt_tokens=len(request.input_ids), reused_prefix_tokens=0,
                            queue_wait_s=0.0)


def test_a_failed_request_fails_its_trajectory_only_and_collect_runs_it_again(tok, proto):
  """One request-level failure (RequestFailed) used to fail the whole batch through
  asyncio.gather, losing every other trajectory. Now its trajectory ends "error", the
  others finish; `collect` runs the failed ones again with the same seed, and returns a
  twice-failed one as failed (RL drops its group, evaluation refuses to report)."""
  from rstar_jax.data.math_problems import MathProblem
  from rstar_jax.rl import rollout_collector
  problems = [MathProblem(f"p{i}", "What is 2 + 2?", "4", "test") for i in range(3)]
  cfg = AgentConfig(max_turns=2, max_response_tokens=64)
  engine = _FlakyEngine(tok, proto, {"p1#0": 1})
  trajs = asyncio.run(run_many(engine, None, proto, [("p1#0", "What is 2 + 2?"),
                                                     ("p0#0", "What is 2 + 2?")], cfg,
                               seeds=[11, 12]))
  assert trajs[0].failed and trajs[0].error == "RequestFailed: bad reply for p1#0"
  assert not trajs[1].failed and trajs[1].finish_reason == "stop"

  engine = _FlakyEngine(tok, proto, {"p1#0": 1, "p2#1": 2})
  groups = rollout_collector.collect(engine, None, proto, tok, problems, k=2, agent=cfg,
                                     stream=(0, 1))
  flat = [t for g in groups for t in g]
  assert [t.uid for t in flat] == ["p0#0", "p0#1", "p1#0", "p1#1", "p2#0", "p2#1"]
  assert [t.failed for t in flat] == [False, False, False, False, False, True]
  assert [t.reward for t in flat] == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
  # The retry used the trajectory's own seed.
  assert [s for u, s in engine.seen if u == "p1#0"] == [s for u, s in engine.seen
                                                        if u == "p1#0"][:1] * 2
  with pytest.raises(RuntimeError, match=r"evaluation: 1 of 6 trajectories failed in the "
                                         r"engine twice \(first: p2#1: RequestFailed: bad"):
    rollout_collector.raise_if_failed(flat, "evaluation")
  rollout_collector.raise_if_failed(flat[:5], "evaluation")
  # what an RL step trains on
  kept, dropped = rollout_collector.drop_failed_groups(groups, "step 1")
  assert dropped == 1 and [[t.uid for t in g] for g in kept] == [["p0#0", "p0#1"],
                                                                 ["p1#0", "p1#1"]]
  with pytest.raises(RuntimeError, match="step 1: every group has a trajectory the engine"):
    rollout_collector.drop_failed_groups(groups[2:], "step 1")
