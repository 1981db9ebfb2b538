"""Evaluation runner on a scripted engine: known answers give known pass@k."""
import datetime
import decimal
import json
import os

import pytest

from rstar_jax.data import math_problems, toy_task
from rstar_jax.eval import eval_runs
from rstar_jax.rollout import agent_loop, chat
from rstar_jax.rollout.jax_engine import GenerationResult


class ScriptedEngine:
  """Answers problem i's sample j correctly iff (i + j) % 4 == 0 (no tool calls)."""

  def __init__(self, tok, proto, problems, prompt_of):
    self.tok, self.proto = tok, proto
    self.answers = {tuple(prompt_of(p)): p.answer for p in problems}
    self.seen: dict[tuple, int] = {}
    self.index = {tuple(prompt_of(p)): i for i, p in enumerate(problems)}

  async def generate(self, request):
    key = tuple(request.input_ids)
    j = self.seen.get(key, 0)
    self.seen[key] = j + 1
    i = self.index[key]
    ans = self.answers[key] if (i + j) % 4 == 0 else "-1"
    text = f"think</reason>\n<answer>\n\\boxed{{{ans}}}\n</answer>"
    ids = self.tok.encode(text) + [self.proto.token_ids.im_end]
    return GenerationResult(request_id=request.request_id, output_ids=ids,
                            logprobs=[0.0] * len(ids), finish_reason="stop",
                            prompt_tokens=len(request.input_ids), reused_prefix_tokens=0,
                            queue_wait_s=0.0)


class NoTools:
  async def execute(self, calls):
    raise AssertionError("no tool call expected")


def test_evaluate_on_scripted_engine():
  tok = toy_task.train_toy_tokenizer(vocab_size=512, n=200)
  proto = chat.ChatProtocol(tok, toy_task.toy_chat_config())
  toy = toy_task.generate_problems(8, seed=0)
  problems = [math_problems.MathProblem(uid=f"p{i}", problem=p.problem, answer=str(p.answer),
                                        source="toy") for i, p in enumerate(toy)]
  engine = ScriptedEngine(tok, proto, problems, lambda p: proto.prompt_ids(p.problem))
  cfg = agent_loop.AgentConfig(max_turns=2, max_response_tokens=64, temperature=0.8)
  report, trajs = eval_runs.evaluate(engine, NoTools(), proto, tok, problems,
                                    eval_runs.EvalConfig(k=4, agent=cfg), stream=(0,),
                                    progress=False, dataset="scripted", model_source="x", seed=3)
  # Problem i has exactly one correct sample among j = 0..3: pass@1 = 1/4, pass@4 = 1.
  assert abs(report.pass_at_1 - 0.25) < 1e-9
  assert abs(report.pass_at_k[4] - 1.0) < 1e-9
  assert report.temperature == 0.8 and "temperature 0.8" in report.to_table()
  assert report.share_truncated == 0 and report.tool_calls_per_trajectory == 0
  assert all(t.finish_reason == "stop" for t in trajs)
  assert (report.model_source, report.seed) == ("x", 3)   # provenance in the result file
  assert report.from_json(report.to_json()).model_source == "x"


def test_response_tokens_count_tool_outputs_as_the_budget_does():
  t = agent_loop.Trajectory(uid="p#0", prompt_ids=[1], response_ids=list(range(10)),
                            response_mask=[1] * 4 + [0] * 3 + [1] * 3, turns=[(0, 4), (7, 10)])
  (rec,) = eval_runs.records_from([t])
  assert rec.response_tokens == 10 and t.model_tokens == 7


class _Decode:
  def decode(self, ids):
    return "response"


def test_write_samples_writes_parquet_meta_as_text(tmp_path):
  """Parquet meta (a date, a Decimal, an image's bytes) made json.dumps raise after the
  whole evaluation had run, and left a .tmp behind."""
  meta = {"date": datetime.datetime(2025, 2, 15), "difficulty": decimal.Decimal("2.5"),
          "note": b"plain", "image": b"\x89PNG", "level": 3}
  problem = math_problems.MathProblem("p", "What is 2+2?", "4", "s", meta)
  t = agent_loop.Trajectory(uid="p#0", prompt_ids=[1], response_ids=[2, 3], response_mask=[1, 1])
  path = str(tmp_path / "samples.jsonl")
  eval_runs.write_samples(path, [t], [problem], _Decode())
  (row,) = [json.loads(line) for line in open(path)]
  assert row["meta"] == {"date": "2025-02-15T00:00:00", "difficulty": "2.5", "note": "plain",
                         "image": "b'\\x89PNG'", "level": 3}
  assert os.listdir(tmp_path) == ["samples.jsonl"]


def test_write_samples_leaves_no_tmp_file_when_it_fails(tmp_path):
  class Broken:
    def decode(self, ids):
      raise RuntimeError("decoder broke")

  t = agent_loop.Trajectory(uid="p#0", prompt_ids=[1], response_ids=[2], response_mask=[1])
  with pytest.raises(RuntimeError, match="decoder broke"):
    eval_runs.write_samples(str(tmp_path / "s.jsonl"), [t], [], Broken())
  assert os.listdir(tmp_path) == []


def test_a_planned_evaluation_without_eval_data_is_refused_up_front(tmp_path):
  """kind 'files' with train_files only was accepted; the eval stage then failed on no
  records, and with eval.after_sft every rerun failed again before reaching RL."""
  from experiments.configs import toy
  from rstar_jax import config_utils
  from rstar_jax.recipe import recipe_config, stages
  c = toy.get_config("smoke")
  c.data.kind, c.data.train_files = "files", ("train.jsonl",)
  c.eval.after_sft = True
  cfg = recipe_config.build_config(c)
  workdir = str(tmp_path)
  with pytest.raises(config_utils.ConfigError,
                     match=r"\(the eval stage\) but config.data.eval_files is empty"):
    stages.plan(cfg, workdir, None)
  with pytest.raises(config_utils.ConfigError,
                     match=r"\(config.eval.after_sft\) but config.data.eval_files is empty"):
    stages.plan(cfg, workdir, ["sft"])
  c.eval.after_sft = False
  # No evaluation planned.
  assert stages.plan(recipe_config.build_config(c), workdir, ["sft"]) == ["sft"]
  c = toy.get_config("smoke")
  c.data.toy.eval_problems = 0
  with pytest.raises(config_utils.ConfigError, match="config.data.toy.eval_problems is 0"):
    stages.plan(recipe_config.build_config(c), workdir, ["eval"])
