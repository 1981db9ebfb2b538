"""Sample k trajectories per problem, score them, report: the one rollout collector.

RL steps, the stage-3 hard-subset filter and evaluation all call `collect`, so they
share the uid scheme ('<problem uid>#<j>'), the reward, the seed scheme and the
metrics. Seeds: trajectory i of a call gets `SeedSequence([*stream, i])`, where the
caller's `stream` names the run: (seed, step) for an RL step, (seed, EVAL, salt) for
an evaluation. The same stream always gives the same rollouts.
"""
from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import os
from typing import Any, Sequence

from absl import logging
import numpy as np

from rstar_jax.data import math_problems
from rstar_jax.rl import batching, rewards, roc
from rstar_jax.rollout import agent_loop, chat, stats
from rstar_jax.train import interrupt

EVAL = 0x5EED   # stream tag of evaluation-style runs (eval, hard-subset filter)


def trajectory_seeds(stream: Sequence[int], n: int) -> list[int]:
  return [int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in (*stream, i)])
              .generate_state(1)[0] % (2 ** 31 - 1)) for i in range(n)]


def run_sync(coro):
  """`asyncio.run(coro)`, also where this thread already runs an event loop (a Jupyter
  kernel): there the coroutine runs to completion on a loop of its own in a worker thread."""
  try:
    asyncio.get_running_loop()
  except RuntimeError:
    return asyncio.run(coro)
  with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollouts") as pool:
    return pool.submit(asyncio.run, coro).result()


# How often a journaled collection looks for a stop request: a small policy finishes
# dozens of trajectories in 0.1 s (the toy's stage-3 filter, 32 in ~0.5 s), which a
# coarser poll let run to the end after the signal; a wake-up every 10 ms costs nothing.
STOP_POLL_S = 0.01


class _Stopped(Exception):
  def __init__(self, signum: int):
    self.signum = signum


async def _until_stopped(coro):
  """`await coro`, cancelled when a stop is requested (`interrupt.stop_signal`): raises
  `_Stopped`. The trajectories in flight are dropped; each finished one was journaled
  by `run_many`'s progress callback, synchronously, so no journal line is cut."""
  task = asyncio.ensure_future(coro)
  while True:
    done, _ = await asyncio.wait({task}, timeout=STOP_POLL_S)
    if done:
      return task.result()
    signum = interrupt.stop_signal()
    if signum is not None:
      task.cancel()
      try:
        await task
      except asyncio.CancelledError:
        pass
      raise _Stopped(signum)


def collect(engine, tools, proto: chat.ChatProtocol, tokenizer,
            problems: Sequence[math_problems.MathProblem], *, k: int,
            agent: agent_loop.AgentConfig, stream: Sequence[int], progress: bool = False,
            desc: str = "rollouts", journal: str | None = None,
            journal_key: Any = None) -> list[list[agent_loop.Trajectory]]:
  """k scored trajectories per problem, grouped by problem (in order).

  A trajectory the engine failed (`Trajectory.failed`) is run once more with the same
  seed; one that fails again is returned failed (reward 0): RL drops its group,
  evaluation refuses to report (`raise_if_failed`).

  `journal` (a path) makes a long collection resumable: every trajectory is appended
  there as it finishes, and a call whose `journal_key` (what decides the trajectories:
  the model, the settings), stream, k and items match the journal's runs only those not
  in it. Each trajectory keeps its own seed, so the result equals an uninterrupted run.
  A journaled collection also stops at a sample boundary when a stop is requested of the
  active `interrupt.StopRequests` (SIGINT, SIGTERM, SIGUSR2): within `STOP_POLL_S` it
  drops the trajectories in flight and raises `interrupt.Interrupted`; the same call
  again runs only what the journal lacks. (Without a journal, an RL step's collection,
  it runs to the end: the trainer stops after the step.)"""
  items = [(f"{p.uid}#{j}", p.problem) for p in problems for j in range(k)]
  seeds = trajectory_seeds(stream, len(items))
  prompts = [proto.prompt_ids(p.problem) for p in problems]   # once, not once per sample
  header = None
  if journal:
    # The prompts as the model sees them (system prompt, template, tokenizer) and the
    # agent's budgets decide the trajectories too, whatever the caller's key says.
    header = {"journal": 2, "key": journal_key, "stream": [int(x) for x in stream], "k": k,
              "items": _digest(items), "prompts": _digest(prompts),
              "agent": dataclasses.asdict(agent)}
  done = _read_journal(journal, header) if journal else {}
  todo = [i for i in range(len(items)) if i not in done]
  if done:
    logging.info("%s: %d of %d trajectories from %s; running the other %d", desc, len(done),
                 len(items), journal, len(todo))
  bar = None
  if progress:
    from tqdm import tqdm
    bar = tqdm(total=len(items), initial=len(done), desc=desc, unit="traj")
  log = _JournalWriter(journal, header, resume=bool(done)) if journal else None
  index_of = {items[i][0]: i for i in todo}
  kept = [len(done)]   # trajectories in the journal

  def journaled(t: agent_loop.Trajectory) -> None:
    if log is not None and not t.failed:
      log.write(index_of[t.uid], t)
      kept[0] += 1

  def run(coro):
    return run_sync(_until_stopped(coro) if journal else coro)

  def finished(t: agent_loop.Trajectory) -> None:
    journaled(t)
    if bar is not None:
      bar.update(1)
  try:
    ran = run(agent_loop.run_many(
        engine, tools, proto, [items[i] for i in todo], agent, seeds=[seeds[i] for i in todo],
        progress=finished, prompt_ids=[prompts[i // k] for i in todo]))
    trajs = [done.get(i) for i in range(len(items))]
    for i, t in zip(todo, ran):
      trajs[i] = t
    again = [i for i, t in enumerate(trajs) if t.failed]
    if again:
      logging.warning("%s: %d of %d trajectories failed (first: %s %s); running them again",
                      desc, len(again), len(trajs), trajs[again[0]].uid, trajs[again[0]].error)
      index_of = {items[i][0]: i for i in again}
      retried = run(agent_loop.run_many(engine, tools, proto, [items[i] for i in again],
                                        agent, seeds=[seeds[i] for i in again],
                                        progress=journaled,
                                        prompt_ids=[prompts[i // k] for i in again]))
      for i, t in zip(again, retried):
        trajs[i] = t
  except _Stopped as e:
    raise interrupt.Interrupted(
        e.signum, after=f"{kept[0]} of {len(items)} trajectories of {desc}",
        saved=f"those are journaled in {journal}") from None
  finally:
    if bar is not None:
      bar.close()
    if log is not None:
      log.close()
  groups = []
  for i, p in enumerate(problems):
    group = trajs[i * k:(i + 1) * k]
    for t in group:
      t.reward = 0.0 if t.failed else rewards.compute_reward(
          t.model_text(tokenizer), p.answer, truncated=t.truncated)
      t.meta["problem_uid"] = p.uid
    groups.append(group)
  return groups


def _digest(parts) -> str:
  h = hashlib.sha1()
  for part in parts:
    h.update(repr(part).encode("utf-8"))
  return h.hexdigest()[:16]


# A journal line holds what evaluation and the stage-3 filter use, compactly (the filter
# journals 8 rollouts of every training problem: tens of GB as plain JSON lists at 14B):
# token ids as base64 int32, the mask as run lengths, no log-probs.
def _pack_ids(ids) -> str:
  return base64.b64encode(np.asarray(ids, np.int32).tobytes()).decode("ascii")


def _unpack_ids(text: str) -> list[int]:
  return np.frombuffer(base64.b64decode(text), np.int32).tolist()


def _runs(mask) -> list[int]:
  """Run lengths of a 0/1 mask, the first run of ones (possibly empty)."""
  runs, value, n = [], 1, 0
  for m in mask:
    if m == value:
      n += 1
    else:
      runs.append(n)
      value, n = m, 1
  runs.append(n)
  return runs


def _unruns(runs) -> list[int]:
  out = []
  for j, n in enumerate(runs):
    out += [1 - j % 2] * n
  return out


def _journal_record(i: int, t: agent_loop.Trajectory) -> dict:
  d = {f.name: getattr(t, f.name) for f in dataclasses.fields(t)}
  # Not dataclasses.asdict: it rebuilds a Counter from (key, count) pairs, counting pairs.
  d["tool_statuses"] = dict(t.tool_statuses)
  d["prompt_ids"] = _pack_ids(t.prompt_ids)
  d["response_ids"] = _pack_ids(t.response_ids)
  d["response_mask"] = _runs(t.response_mask)
  del d["response_logprobs"]
  return {"i": i, "t": d}


def _trajectory_from(d: dict) -> agent_loop.Trajectory:
  d = dict(d)
  d["prompt_ids"] = _unpack_ids(d["prompt_ids"])
  d["response_ids"] = _unpack_ids(d["response_ids"])
  d["response_mask"] = _unruns(d["response_mask"])
  d["turns"] = [tuple(x) for x in d.get("turns", ())]
  d["tool_statuses"] = collections.Counter(d.get("tool_statuses", {}))
  return agent_loop.Trajectory(**d)


def _read_journal(path: str, header: dict) -> dict[int, agent_loop.Trajectory]:
  """The journal's trajectories by item index, if it was written for `header`; a
  journal of anything else (another model, other settings) is not used. A line cut off
  by a kill ends the usable part. Resumed trajectories carry no log-probs."""
  done = {}
  try:
    with open(path) as f:
      try:
        if json.loads(f.readline()) != json.loads(json.dumps(header, default=str)):
          logging.warning("%s was written for another model or other settings; not used",
                          path)
          return {}
      except ValueError:
        return {}
      for line in f:       # line by line: the filter's journal is large
        try:
          rec = json.loads(line)
          done[int(rec["i"])] = _trajectory_from(rec["t"])
        except (ValueError, KeyError, TypeError):
          break
  except OSError:
    return {}
  return done


class _JournalWriter:
  """Appends one JSON line per finished trajectory, flushed as written."""

  def __init__(self, path: str, header: dict, resume: bool):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if resume:
      self._cut_torn_tail(path)
    else:
      with open(path + ".tmp", "w") as f:
        f.write(json.dumps(header, default=str) + "\n")
      os.replace(path + ".tmp", path)
    self._f = open(path, "a")

  @staticmethod
  def _cut_torn_tail(path: str) -> None:
    with open(path, "rb+") as f:
      f.seek(0, os.SEEK_END)
      size = f.tell()
      back = min(size, 1 << 26)          # a line is far shorter than 64 MB
      f.seek(size - back)
      tail = f.read()
      end = size - back + tail.rfind(b"\n") + 1
      if end < size:
        f.truncate(end)

  def write(self, i: int, t: agent_loop.Trajectory) -> None:
    self._f.write(json.dumps(_journal_record(i, t)) + "\n")
    self._f.flush()

  def close(self) -> None:
    self._f.close()


def raise_if_failed(trajs: Sequence[agent_loop.Trajectory], where: str) -> None:
  """Where every sample must count (an evaluation, the stage-3 filter), a trajectory the
  engine failed twice stops the run, naming it, rather than scoring as a wrong answer."""
  failed = [t for t in trajs if t.failed]
  if failed:
    raise RuntimeError(f"{where}: {len(failed)} of {len(trajs)} trajectories failed in the "
                       f"engine twice (first: {failed[0].uid}: {failed[0].error})")


def drop_failed_groups(groups: Sequence[Sequence[agent_loop.Trajectory]], where: str
                       ) -> tuple[list[list[agent_loop.Trajectory]], int]:
  """(the groups without a failed trajectory, how many were dropped). A group with a
  trajectory the engine failed twice is not a sample of the policy, and its advantages
  would be skewed without it: the whole group goes. Raises if none is left."""
  kept = [list(g) for g in groups if not any(t.failed for t in g)]
  dropped = len(groups) - len(kept)
  if dropped:
    first = next(t for g in groups for t in g if t.failed)
    logging.warning("%s: %d of %d groups dropped: a trajectory failed in the engine (first: "
                    "%s: %s)", where, dropped, len(groups), first.uid, first.error)
    if not kept:
      raise RuntimeError(f"{where}: every group has a trajectory the engine failed (first: "
                         f"{first.uid}: {first.error})")
  return kept, dropped


def check_weight_versions(trajs: Sequence[agent_loop.Trajectory], version: str | None,
                          where: str = "") -> None:
  """Rollouts of the current weights only: a trajectory generated (in part) with other
  weights than `version` raises, naming the versions seen; it is never trained on
  silently. Trajectories whose engines report no version are not checked."""
  bad = collections.Counter(" -> ".join(t.weight_versions) for t in trajs
                            if t.weight_versions and t.weight_versions != [version])
  if bad:
    raise RuntimeError(
        f"{where + ': ' if where else ''}{sum(bad.values())} of {len(trajs)} trajectories were "
        f"not generated with the current weights {version!r} (versions seen: {dict(bad)}); "
        f"the engines missed a weight sync")


def metrics(trajs: Sequence[agent_loop.Trajectory], prefix: str = "rollout/"
            ) -> dict[str, float]:
  """Per-step rollout metrics. A ratio with nothing to count (the tool-error rate
  without a tool call, or inside correct trajectories when none is correct; any mean
  over no trajectory) is left out: missing, never 0 (`stats.present`)."""
  n = len(trajs)
  out = {"reward_mean": stats.ratio(sum(t.reward or 0.0 for t in trajs), n)}
  tool = stats.tool_stats(trajs)
  out.update({k: tool[k] for k in ("tool_calls_per_traj", "tool_error_rate",
                                   "tool_error_rate_correct", "no_tool_share")})
  out.update({
      "truncated_share": stats.ratio(sum(t.truncated for t in trajs), n),
      "model_tokens_mean": stats.ratio(sum(t.model_tokens for t in trajs), n),
      "response_tokens_mean": stats.ratio(sum(len(t.response_ids) for t in trajs), n),
      "turns_mean": stats.ratio(sum(t.num_turns for t in trajs), n),
  })
  return {prefix + k: v for k, v in stats.present(out).items()}


def rollout_stats(t: agent_loop.Trajectory) -> roc.RolloutStats:
  """What RoC reads of a scored trajectory."""
  if t.reward is None:
    raise ValueError(f"trajectory {t.uid}: reward not set")
  return roc.RolloutStats(reward=t.reward, num_tool_calls=t.num_tool_calls,
                          num_tool_errors=t.num_tool_errors,
                          num_answer_tags=t.answer_tags, num_turns=t.num_turns)


def token_trajectory(t: agent_loop.Trajectory) -> batching.TokenTrajectory:
  """The ids, mask and sampler log-probs the RL batch is built from."""
  return batching.TokenTrajectory(prompt_ids=t.prompt_ids, response_ids=t.response_ids,
                                  response_mask=t.response_mask,
                                  response_logprobs=t.response_logprobs)
