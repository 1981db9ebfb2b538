"""rl.rollout_collector.collect with a journal: a collection killed part-way (an evaluation, the
stage-3 filter: hours at 14B) resumes with what it had finished and ends with exactly
the trajectories of an uninterrupted run."""
import dataclasses
import json

import pytest

from rstar_jax.rl import rollout_collector
from rstar_jax.rollout import chat


class _Killed(RuntimeError):
  pass


class _Dies:
  """The pool, failing the whole collection (as a kill would) at its `at`-th reply."""

  def __init__(self, pool, at=None):
    self._pool, self.at, self.returned, self.started = pool, at, 0, 0

  async def generate(self, request):
    self.started += request.request_id.endswith("/turn0")   # trajectories begun
    out = await self._pool.generate(request)
    self.returned += 1
    if self.at is not None and self.returned >= self.at:   # the others still in flight
      raise _Killed("the process dies here")
    return out

  def __getattr__(self, name):
    return getattr(self._pool, name)


@pytest.fixture(scope="module")
def parts(smoke_rl):
  cfg, ctx, _, pool, _ = smoke_rl
  return cfg, ctx, pool


def _collect(parts, engine, **kw):
  cfg, ctx, _ = parts
  return rollout_collector.collect(engine, ctx.tools, ctx.proto, ctx.tokenizer, ctx.train_problems[:6],
                          k=3, agent=cfg.stage1.agent, stream=(0, rollout_collector.EVAL, 7), **kw)


def _flat(groups):
  # Every field but the log-probs, which a journal does not keep (evaluation and the
  # stage-3 filter do not use them).
  return [(t.uid, t.prompt_ids, t.response_ids, t.response_mask, t.turns,
           dict(t.tool_statuses), t.num_tool_calls, t.num_tool_errors, t.weight_versions,
           t.reward, t.finish_reason, t.answer_tags, t.meta) for g in groups for t in g]


def test_a_killed_collection_resumes_from_its_journal(parts, tmp_path):
  reference = _flat(_collect(parts, parts[2]))
  journal = str(tmp_path / "eval.journal.jsonl")
  with pytest.raises(_Killed):
    _collect(parts, _Dies(parts[2], at=8), journal=journal, journal_key={"model": "a"})
  with open(journal) as f:
    lines = f.read().splitlines()
  assert json.loads(lines[0])["key"] == {"model": "a"} and 3 <= len(lines) - 1 < 18
  with open(journal, "a") as f:
    f.write('{"i": 17, "t": {"uid": "cut off')      # a line torn by the kill

  again = _Dies(parts[2])
  got = _collect(parts, again, journal=journal, journal_key={"model": "a"})
  assert _flat(got) == reference
  assert again.started == 18 - (len(lines) - 1)        # only what the journal lacked
  with open(journal) as f:
    assert all(json.loads(line) for line in f.read().splitlines())   # the torn line is gone

  # Written for another model, or with another prompt: not used, all run again.
  other = _Dies(parts[2])
  assert _flat(_collect(parts, other, journal=journal, journal_key={"model": "b"})) == reference
  assert other.started == 18
  cfg, ctx, pool = parts
  reworded = chat.ChatProtocol(ctx.tokenizer, dataclasses.replace(
      cfg.chat, system_prompt="Another system prompt."))
  other = _Dies(pool)
  rollout_collector.collect(other, ctx.tools, reworded, ctx.tokenizer, ctx.train_problems[:6], k=3,
                   agent=cfg.stage1.agent, stream=(0, rollout_collector.EVAL, 7), journal=journal,
                   journal_key={"model": "b"})
  assert other.started == 18


def test_a_journal_line_keeps_what_evaluation_reads():
  from rstar_jax.rollout.agent_loop import Trajectory
  t = Trajectory(uid="p#1", prompt_ids=[5, 2**31 - 1], response_ids=[1, 2, 3, 4, 5, 6],
                 response_mask=[1, 1, 0, 0, 1, 1], response_logprobs=[-0.1] * 6,
                 turns=[(0, 2), (4, 6)], num_tool_calls=1, finish_reason="stop",
                 weight_versions=["v1"], error="")
  t.tool_statuses["ok"] += 1
  back = rollout_collector._trajectory_from(json.loads(json.dumps(rollout_collector._journal_record(3, t)))["t"])
  assert back.response_logprobs == []
  back.response_logprobs = t.response_logprobs
  assert back == t
  for mask in ([], [0], [1], [0, 0, 1], [1, 0, 1, 0]):
    assert rollout_collector._unruns(rollout_collector._runs(mask)) == mask


class _SignalsAt(_Dies):
  """The pool; at its `at`-th reply this process gets SIGTERM (a real signal, taken by
  the active `interrupt.StopRequests`). With `hold=True` no later reply comes back until
  the collection cancels it: a collection that missed the stop would hang (ended by
  pytest-timeout), and one that sees it cannot have finished the rest first, however
  the host schedules the signal's handler and the stop poll (STOP_POLL_S)."""

  def __init__(self, pool, at=None, hold=False):
    super().__init__(pool, at)
    self.hold = hold

  async def generate(self, request):
    import asyncio
    import os
    import signal
    self.started += request.request_id.endswith("/turn0")
    out = await self._pool.generate(request)
    self.returned += 1
    if self.at is not None and self.returned == self.at:
      os.kill(os.getpid(), signal.SIGTERM)
    elif self.hold and self.at is not None and self.returned > self.at:
      await asyncio.get_running_loop().create_future()   # until cancelled
    return out


def test_a_stop_request_ends_a_journaled_collection_at_a_finished_trajectory(parts, tmp_path):
  import signal
  from rstar_jax.train import interrupt
  reference = _flat(_collect(parts, parts[2]))
  journal = str(tmp_path / "eval.journal.jsonl")
  with interrupt.StopRequests(), pytest.raises(interrupt.Interrupted) as e:
    _collect(parts, _SignalsAt(parts[2], at=8, hold=True), journal=journal,
             journal_key={"model": "a"})
  assert e.value.signum == signal.SIGTERM and "trajectories of rollouts" in str(e.value)
  with open(journal) as f:
    kept = len(f.read().splitlines()) - 1
  assert 0 < kept < 18 and f"after {kept} of 18 trajectories" in str(e.value)
  again = _Dies(parts[2])
  assert _flat(_collect(parts, again, journal=journal, journal_key={"model": "a"})) == reference
  assert again.started == 18 - kept
  # Without a journal (an RL step's rollouts) a stop request waits for the end: the
  # trainer stops after the step.
  with interrupt.StopRequests() as stop:
    assert _flat(_collect(parts, _SignalsAt(parts[2], at=8))) == reference
    assert stop.signum == signal.SIGTERM
