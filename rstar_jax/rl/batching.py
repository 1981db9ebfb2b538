"""Trajectories (token ids, masks, sampler log-probs) -> padded train-step arrays.

A trajectory is prompt ids followed by response ids; the response interleaves model
tokens (mask 1, with the sampler's log-prob) and tool-output tokens (mask 0). The
model predicts token t+1 at position t, so every per-token array is shifted by one:
loss_mask[t] says whether target_ids[t] = seq[t+1] was written by the model.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenTrajectory:
  prompt_ids: Sequence[int]
  response_ids: Sequence[int]
  response_mask: Sequence[int]          # 1 = model token, 0 = tool / template token
  response_logprobs: Sequence[float]    # sampler log-prob of model tokens (0 elsewhere)

  def __post_init__(self):
    n = len(self.response_ids)
    if len(self.response_mask) != n or len(self.response_logprobs) != n:
      raise ValueError(f"trajectory: response_ids ({n}), response_mask "
                       f"({len(self.response_mask)}) and response_logprobs "
                       f"({len(self.response_logprobs)}) must have equal lengths")
    if not self.prompt_ids:
      raise ValueError("trajectory: empty prompt")


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def build_batch(trajs: Sequence[TokenTrajectory], advantages: Sequence[float], *,
                row_multiple: int = 1, length_multiple: int = 64, max_len: int | None = None,
                pad_id: int = 0, pow2_lengths: bool = True,
                pow2_rows: bool = False,
                fixed_rows: int | None = None) -> dict[str, np.ndarray]:
  """Pads to [N, T]; N rounded up to `row_multiple` (times a power of two with
  `pow2_rows`) with all-padding rows (loss mask 0, so they change nothing). T is
  rounded up to a power of two (at least `length_multiple`), or to a multiple of
  `length_multiple` with pow2_lengths=False: every distinct T is a fresh compile of
  the train step; `max_len` caps T. `fixed_rows` pads every batch to exactly that many
  rows (with a few length buckets, a few compiles per run) and fails if there are
  more trajectories."""
  if len(trajs) != len(advantages):
    raise ValueError(f"{len(trajs)} trajectories but {len(advantages)} advantages")
  if not trajs:
    raise ValueError("build_batch: no trajectories")
  seq_lens = [len(t.prompt_ids) + len(t.response_ids) - 1 for t in trajs]
  longest = max(seq_lens)
  if pow2_lengths:
    t_len = max(length_multiple, 1 << (longest - 1).bit_length())
  else:
    t_len = _round_up(longest, length_multiple)
  if max_len is not None:
    if max(seq_lens) > max_len:
      raise ValueError(f"a trajectory has {max(seq_lens) + 1} tokens > max_len {max_len}")
    t_len = min(t_len, max_len)
  n = _round_up(len(trajs), row_multiple)
  if pow2_rows:
    n = row_multiple * (1 << (n // row_multiple - 1).bit_length())
  if fixed_rows is not None:
    if len(trajs) > fixed_rows or fixed_rows % row_multiple:
      raise ValueError(f"build_batch: {len(trajs)} trajectories do not fit fixed_rows="
                       f"{fixed_rows} (which must also be a multiple of {row_multiple})")
    n = fixed_rows
  out = {
      "input_ids": np.full((n, t_len), pad_id, np.int32),
      "target_ids": np.full((n, t_len), pad_id, np.int32),
      "attention_mask": np.zeros((n, t_len), np.int32),
      "loss_mask": np.zeros((n, t_len), np.float32),
      "sampler_logp": np.zeros((n, t_len), np.float32),
      "advantages": np.zeros((n,), np.float32),
  }
  for i, (t, adv) in enumerate(zip(trajs, advantages)):
    seq = np.asarray(list(t.prompt_ids) + list(t.response_ids), np.int32)
    L = len(seq) - 1
    p = len(t.prompt_ids) - 1      # target index of the first response token
    out["input_ids"][i, :L] = seq[:-1]
    out["target_ids"][i, :L] = seq[1:]
    out["attention_mask"][i, :L] = 1
    out["loss_mask"][i, p:L] = np.asarray(t.response_mask, np.float32)
    out["sampler_logp"][i, p:L] = np.asarray(t.response_logprobs, np.float32)
    out["advantages"][i] = adv
  out["old_logp"] = out["sampler_logp"].copy()
  return out
