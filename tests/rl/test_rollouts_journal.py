"""rl.rollouts.collect with a journal: a collection killed part-way (an evaluation, the
stage-3 filter: hours at 14B) resumes with what it had finished and ends with exactly
the trajectories of an uninterrupted run."""
import json

import pytest

from experiments.configs import toy
from rstar_jax import recipe
from rstar_jax.rl import rollouts
from rstar_jax.rollout import backends


class _Tools:
  async def execute(self, calls):
    return [{"status": "ok", "stdout": "1\n", "stderr": ""} for _ in calls]


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
def parts(tmp_path_factory):
  root = tmp_path_factory.mktemp("journal")
  cfg = recipe.build_config(toy.get_config("smoke"))
  ctx = recipe.build_context(cfg, _Tools(), workdir=str(root))
  model = recipe.initial_model(cfg, ctx.tokenizer, ctx.mesh, ctx.rules)
  pool = backends.build_engine_pool(cfg.rollout, model, workdir=str(root))
  yield cfg, ctx, pool
  pool.stop()


def _collect(parts, engine, **kw):
  cfg, ctx, _ = parts
  return rollouts.collect(engine, ctx.tools, ctx.proto, ctx.tokenizer, ctx.train_problems[:6],
                          k=3, agent=cfg.stage1.agent, stream=(0, rollouts.EVAL, 7), **kw)


def _flat(groups):
  return [(t.uid, t.prompt_ids, t.response_ids, t.response_mask, t.response_logprobs,
           t.turns, dict(t.tool_statuses), t.num_tool_calls, t.weight_versions, t.reward,
           t.finish_reason, t.meta) for g in groups for t in g]


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

  # Written for another model: not used, all run again.
  other = _Dies(parts[2])
  assert _flat(_collect(parts, other, journal=journal, journal_key={"model": "b"})) == reference
  assert other.started == 18
