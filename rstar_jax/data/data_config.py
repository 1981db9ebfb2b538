"""`config.tokenizer`, `config.data` and the SFT conversations: where text comes from.

Each section is the dataclass here of the same name; the recipe, the evaluation entry
point and the benchmarks build their tokenizer and problems through these functions.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Sequence

from absl import logging

from rstar_jax import config_utils
from rstar_jax.data import math_problems, rows, sft_examples, toy_task
from rstar_jax.model import tokenizer as tokenizer_lib
from rstar_jax.rollout import chat

TOKENIZER_KINDS = ("toy", "hf")
DATA_KINDS = ("toy", "files")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizerConfig:
  """Attributes:
    kind: "toy" (a byte-level BPE trained on toy-task text at the first run and saved in
      <workdir>/tokenizer) or "hf" (a Hugging Face tokenizer directory, `path`).
    path: the HF directory (kind "hf").
    vocab_size: size of the toy tokenizer.
    number_chunk: digits per number token of the toy tokenizer (1 = Qwen's split).
  """
  kind: str = "toy"
  path: str | None = None
  vocab_size: int = 2048
  number_chunk: int = 3

  def __post_init__(self):
    if self.kind not in TOKENIZER_KINDS:
      raise ValueError(f"TokenizerConfig.kind={self.kind!r}; choose from {TOKENIZER_KINDS}")
    if self.kind == "hf" and not self.path:
      raise ValueError("TokenizerConfig.path must name a HF tokenizer directory for kind 'hf'")
    if self.vocab_size <= 0:
      raise ValueError(f"TokenizerConfig.vocab_size must be > 0, got {self.vocab_size!r}")
    if not 1 <= self.number_chunk <= 3:
      raise ValueError(f"TokenizerConfig.number_chunk must be in 1..3, got "
                       f"{self.number_chunk!r}")


def build_tokenizer(cfg: TokenizerConfig, workdir: str, *, seed: int
                    ) -> tokenizer_lib.Tokenizer:
  if cfg.kind == "hf":
    return tokenizer_lib.Tokenizer.from_dir(cfg.path)
  path = os.path.join(workdir, "tokenizer")
  made_with = {"vocab_size": cfg.vocab_size, "number_chunk": cfg.number_chunk, "seed": seed}
  if os.path.exists(os.path.join(path, "tokenizer.json")):
    try:
      with open(os.path.join(path, _MADE_WITH)) as f:
        old = json.load(f)
    except FileNotFoundError:
      old = None   # trained before this was recorded
    if old is not None and old != made_with:
      # The workdir's toy tokenizer is reused by every later run; one trained with other
      # settings would be used while config.json said otherwise.
      raise config_utils.ConfigError(
          f"{path} was trained with {old}, this run asks for {made_with}: keep the old "
          f"settings, or remove {path} (and the stages trained with it)")
    return tokenizer_lib.Tokenizer.from_dir(path)
  tok = toy_task.train_toy_tokenizer(cfg.vocab_size, seed=seed, number_chunk=cfg.number_chunk)
  tmp = f"{path}.tmp-{os.getpid()}"    # complete or absent: a kill mid-write left a torn one
  shutil.rmtree(tmp, ignore_errors=True)
  tok.save(tmp)
  with open(os.path.join(tmp, _MADE_WITH), "w") as f:
    json.dump(made_with, f)
  shutil.rmtree(path, ignore_errors=True)    # a directory without tokenizer.json
  os.replace(tmp, path)
  return tok


_MADE_WITH = "made_with.json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToyDataConfig:
  """The toy arithmetic tool task (`data/toy_task.py`).

  Attributes:
    levels: difficulty levels to draw from (1..5; 0 is two-digit operands, for a
      first run whose tiny model must learn to copy them fast).
    kinds: problem kinds (empty: all of them).
    train_problems / eval_problems: how many of each (eval drawn with another seed).
  """
  levels: tuple[int, ...] = (1, 2)
  kinds: tuple[str, ...] = ()
  train_problems: int = 2000
  eval_problems: int = 128

  def __post_init__(self):
    bad = [l for l in self.levels if not toy_task.MIN_LEVEL <= l <= toy_task.NUM_LEVELS]
    if not self.levels or bad:
      raise ValueError(f"ToyDataConfig.levels must be a non-empty subset of "
                       f"{toy_task.MIN_LEVEL}..{toy_task.NUM_LEVELS}, got {self.levels}")
    unknown = sorted(set(self.kinds) - set(toy_task.kinds()))
    if unknown:
      raise ValueError(f"ToyDataConfig.kinds: unknown {unknown}; known {list(toy_task.kinds())}")
    for name in ("train_problems", "eval_problems"):
      if getattr(self, name) < 0:
        raise ValueError(f"ToyDataConfig.{name} must be >= 0, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
  """Attributes:
    kind: "toy" (generated problems) or "files" (JSONL / Parquet math data).
    train_files / eval_files: data files (kind "files"), see `math_problems.load_math_problems`.
    integer_only: keep training problems with integer answers only (the
      rStar2-Agent report, "RL Data Curation").
    on_error: "raise" on a malformed row, or "skip" (counted and reported).
    toy: the toy task's settings (kind "toy").
  """
  kind: str = "toy"
  train_files: tuple[str, ...] = ()
  eval_files: tuple[str, ...] = ()
  integer_only: bool = True
  on_error: str = "raise"
  toy: ToyDataConfig = dataclasses.field(default_factory=ToyDataConfig)

  def __post_init__(self):
    if self.kind not in DATA_KINDS:
      raise ValueError(f"DataConfig.kind={self.kind!r}; choose from {DATA_KINDS}")
    if self.on_error not in rows.ON_ERROR:
      raise ValueError(f"DataConfig.on_error={self.on_error!r}; choose from {rows.ON_ERROR}")
    if self.kind == "files" and not self.train_files and not self.eval_files:
      raise ValueError("DataConfig: kind 'files' needs train_files and/or eval_files")


def _toy_kinds(cfg: ToyDataConfig) -> list[str] | None:
  return list(cfg.kinds) or None


def load_problems(cfg: DataConfig, *, seed: int
                  ) -> tuple[list[math_problems.MathProblem], list[math_problems.MathProblem]]:
  """(train, eval) problems."""
  if cfg.kind == "toy":
    t = cfg.toy
    train = toy_task.generate_problems(t.train_problems, seed=seed, levels=t.levels,
                                       kinds=_toy_kinds(t))
    evals = toy_task.generate_problems(t.eval_problems, seed=seed + 10_000, levels=t.levels,
                                       kinds=_toy_kinds(t))
    as_math = lambda ps, tag: [math_problems.MathProblem(uid=f"{tag}{i}", problem=p.problem,
                                                         answer=str(p.answer), source="toy",
                                                         meta={"level": p.level, "kind": p.kind})
                               for i, p in enumerate(ps)]
    return as_math(train, "toy-train-"), as_math(evals, "toy-eval-")
  # Training files often number their rows from 0 each (verl's extra_info.index).
  train = (math_problems.load_math_problems(list(cfg.train_files), on_error=cfg.on_error,
                                            prefix_clashing_ids=True).items
           if cfg.train_files else [])
  evals = (math_problems.load_math_problems(list(cfg.eval_files), on_error=cfg.on_error).items
           if cfg.eval_files else [])
  try:   # now, not after every problem has been generated and scored
    math_problems.check_unique_uids(evals)
  except ValueError as e:
    raise rows.DataError(path=", ".join(cfg.eval_files),
                         message=f"evaluation problems: {e}") from None
  if cfg.integer_only:
    train, dropped = math_problems.filter_integer_answers(train)
    logging.info("integer filter dropped %d training problems", len(dropped))
  train, dups = math_problems.deduplicate(train)
  logging.info("de-duplication dropped %d training problems", len(dups))
  try:   # now, not when RL starts after SFT
    math_problems.check_unique_uids(train)
  except ValueError as e:
    raise rows.DataError(path=", ".join(cfg.train_files),
                         message=f"training problems: {e}") from None
  return list(train), list(evals)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTDataConfig:
  """Where SFT conversations come from.

  Attributes:
    files: chat-message JSONL files (`sft_examples.load_sft_examples`); empty with the toy
      data: generated toy traces.
    num_traces: toy traces to generate.
    traces: shares of noisy toy traces (buggy first calls, answers without the tool).
  """
  files: tuple[str, ...] = ()
  num_traces: int = 1000
  traces: toy_task.TraceConfig = dataclasses.field(default_factory=toy_task.TraceConfig)

  def __post_init__(self):
    if self.num_traces < 0:
      raise ValueError(f"SFTDataConfig.num_traces must be >= 0, got {self.num_traces}")


def sft_conversations(cfg: SFTDataConfig, data: DataConfig, proto: chat.ChatProtocol, *,
                      seed: int, on_error: str = "raise") -> list[tuple[list[int], list[int]]]:
  """(ids, loss_mask) of every SFT conversation, rendered by the rollout protocol."""
  if data.kind == "toy" and not cfg.files:
    problems = toy_task.generate_problems(cfg.num_traces, seed=seed + 20_000,
                                          levels=data.toy.levels, kinds=_toy_kinds(data.toy))
    traces = toy_task.make_traces(problems, seed=seed + 1, config=cfg.traces,
                                  chat_config=proto.config)
    rendered = [toy_task.render_trace(proto, t) for t in traces]
  else:
    if not cfg.files:
      raise ValueError("SFT needs sft.files (chat-message JSONL) unless data.kind is 'toy'")
    examples = sft_examples.load_sft_examples(list(cfg.files), on_error=on_error).items
    rendered = [proto.render_conversation(e.messages) for e in examples]
  return [(r.ids, r.loss_mask) for r in rendered]


def toy_problems_for(cfg: DataConfig, n: int, *, seed: int) -> Sequence[toy_task.ToyProblem]:
  """n toy problems of the configured levels and kinds (probes, benchmarks)."""
  return toy_task.generate_problems(n, seed=seed, levels=cfg.toy.levels,
                                    kinds=_toy_kinds(cfg.toy))
