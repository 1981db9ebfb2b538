"""Token entropy of a policy on stored trajectories: where are the high-entropy tokens?

The rStar2-Agent report (following "Beyond the 80/20 rule", Wang et al. 2025) finds
that the highest-entropy tokens of the trained policy are "forking" tokens (where the
reasoning can branch) and tokens that reflect on tool output. This module measures
that on trajectories the recipe stored (`<workdir>/eval_*_samples.jsonl`, which holds
`prompt_ids`, `response_ids` and `response_mask`):

1. `token_entropies`: the policy's entropy H(p(. | prefix)) at every response token,
   from one forward pass per batch of trajectories; logits exist for `chunk` positions
   at a time (`Qwen3.token_logprobs(..., return_entropy=True)`), never [B, T, V].
2. `classify_positions`: among model-written tokens (mask 1) only, the top-q share with
   the highest entropy over the whole set of trajectories; each is "reflection" when
   it lies within `window` tokens after the end of a tool response (the first model
   token after a tool turn and the window - 1 after it), else "forking".
3. `token_tables` / `summary`: which tokens those are, per class, and summary numbers
   (threshold, mean entropies, the reflection share against its base rate).

Steps 2-3 are numpy only (testable without a model). Layer "analysis": imports model/
only.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import os
from typing import Any, Callable, Mapping, Sequence

import numpy as np

REFLECTION, FORKING = "reflection", "forking"


class TrajectoryError(ValueError):
  """A malformed trajectory row (the message names file and line)."""


# ---- trajectories ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StoredTrajectory:
  prompt_ids: np.ndarray     # int32 [P]
  response_ids: np.ndarray   # int32 [R]
  response_mask: np.ndarray  # int8 [R], 1 = model-written
  uid: str = ""
  reward: float | None = None


def _int_list(row: Mapping[str, Any], key: str, where: str) -> list[int]:
  value = row.get(key)
  if not isinstance(value, list):
    raise TrajectoryError(f"{where}: field {key!r} must be a list of ints, got "
                          f"{type(value).__name__}")
  if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
    bad = next(v for v in value if not isinstance(v, int) or isinstance(v, bool))
    raise TrajectoryError(f"{where}: field {key!r} holds a non-integer {bad!r}")
  return value


def parse_row(row: Any, where: str) -> StoredTrajectory:
  if not isinstance(row, dict):
    raise TrajectoryError(f"{where}: expected a JSON object, got {type(row).__name__}")
  missing = [k for k in ("prompt_ids", "response_ids", "response_mask") if k not in row]
  if missing:
    hint = (" (a samples file written before token ids were stored: run the evaluation "
            "again to write them)" if "response" in row else "")
    raise TrajectoryError(f"{where}: missing field(s) {missing}{hint}")
  prompt = _int_list(row, "prompt_ids", where)
  resp = _int_list(row, "response_ids", where)
  mask = _int_list(row, "response_mask", where)
  if len(mask) != len(resp):
    raise TrajectoryError(f"{where}: response_mask has {len(mask)} entries for "
                          f"{len(resp)} response_ids")
  if any(m not in (0, 1) for m in mask):
    raise TrajectoryError(f"{where}: response_mask must hold only 0 and 1")
  if not prompt:
    raise TrajectoryError(f"{where}: empty prompt_ids (the first response token needs "
                          "a prefix to be scored)")
  if any(v < 0 for v in prompt + resp):
    raise TrajectoryError(f"{where}: negative token id")
  reward = row.get("reward")
  return StoredTrajectory(np.asarray(prompt, np.int32), np.asarray(resp, np.int32),
                          np.asarray(mask, np.int8), uid=str(row.get("uid", "")),
                          reward=float(reward) if isinstance(reward, (int, float)) else None)


def load_trajectories(path: str, limit: int | None = None) -> list[StoredTrajectory]:
  """Rows of a JSONL file with prompt_ids, response_ids, response_mask (the recipe's
  eval_*_samples.jsonl); a malformed row raises TrajectoryError naming file and line."""
  if not os.path.exists(path):
    raise TrajectoryError(f"{path}: no such trajectories file")
  out = []
  with open(path) as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path}:{lineno}"
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise TrajectoryError(f"{where}: not valid JSON ({e})") from None
      out.append(parse_row(row, where))
      if limit is not None and len(out) >= limit:
        break
  if not out:
    raise TrajectoryError(f"{path}: no trajectories")
  return out


# ---- entropies (needs the model) -------------------------------------------------------
def _bucket(n: int, minimum: int = 64) -> int:
  return max(minimum, 1 << (n - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _entropy_fn():
  import jax
  import jax.numpy as jnp
  from flax import nnx

  @functools.partial(jax.jit, static_argnames=("graphdef", "chunk"))
  def fn(graphdef, state, tokens, lengths, temperature, *, chunk):
    model = nnx.merge(graphdef, state)
    t = tokens.shape[1]
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens.shape)
    segment_ids = (positions < lengths[:, None]).astype(jnp.int32)
    hidden, _ = model(tokens, positions, segment_ids=segment_ids)
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    _, ent = model.token_logprobs(hidden, targets, chunk=chunk, temperature=temperature,
                                  return_entropy=True)
    return ent

  return fn


def token_entropies(model, trajectories: Sequence[StoredTrajectory], *, batch_size: int = 8,
                    chunk: int = 256, temperature: float = 1.0,
                    progress: Callable[[int, int], None] | None = None) -> list[np.ndarray]:
  """Entropy (nats) of the policy's next-token distribution at every response token:
  `out[i][j]` is H(p(. | prompt_i + response_i[:j])), the distribution response token j
  was drawn from (tool-side tokens get a value too; `classify_positions` drops them).

  Trajectories are batched by length (padded to a power of two, >= 64, so few shapes
  compile); logits exist for `chunk` positions of a batch at a time."""
  from flax import nnx
  vocab = model.cfg.vocab_size
  for i, t in enumerate(trajectories):
    top = max(int(t.prompt_ids.max()), int(t.response_ids.max()) if len(t.response_ids) else 0)
    if top >= vocab:
      raise TrajectoryError(f"trajectory {i} ({t.uid}): token id {top} >= the model's "
                            f"vocab_size {vocab} (a different tokenizer?)")
  graphdef, state = nnx.split(model)
  fn = _entropy_fn()
  order = sorted(range(len(trajectories)), key=lambda i: -(
      len(trajectories[i].prompt_ids) + len(trajectories[i].response_ids)))
  out: list[np.ndarray | None] = [None] * len(trajectories)
  for start in range(0, len(order), batch_size):
    idx = order[start:start + batch_size]
    seqs = [np.concatenate([trajectories[i].prompt_ids, trajectories[i].response_ids])
            for i in idx]
    width = _bucket(max(len(s) for s in seqs))
    tokens = np.zeros((batch_size, width), np.int32)
    lengths = np.ones((batch_size,), np.int32)   # filler rows: length 1, discarded
    for r, s in enumerate(seqs):
      tokens[r, :len(s)] = s
      lengths[r] = len(s)
    ent = np.asarray(fn(graphdef, state, tokens, lengths, np.float32(temperature),
                        chunk=min(chunk, width)))
    for r, i in enumerate(idx):
      p, n = len(trajectories[i].prompt_ids), len(trajectories[i].response_ids)
      # Position k predicts token k + 1: response token j comes from position p + j - 1.
      out[i] = ent[r, p - 1:p - 1 + n].astype(np.float64)
    if progress is not None:
      progress(min(start + batch_size, len(order)), len(order))
  return out  # type: ignore[return-value]


# ---- classification (numpy only) -------------------------------------------------------
def tool_response_ends(mask: Sequence[int]) -> np.ndarray:
  """Indices of the first model token after each tool-side run of a response's loss
  mask (where a tool response, with its chat wrapping, has just ended)."""
  m = np.asarray(mask, np.int8)
  if m.size == 0:
    return np.zeros((0,), np.int64)
  return np.flatnonzero((m[1:] == 1) & (m[:-1] == 0)) + 1


def reflection_window(mask: Sequence[int], ends: Sequence[int], window: int) -> np.ndarray:
  """Bool per position: within `window` tokens from a tool response's end (e <= i < e + w)."""
  n = len(mask)
  out = np.zeros((n,), bool)
  for e in ends:
    e = int(e)
    if not 0 <= e <= n:
      raise ValueError(f"tool response end {e} outside a response of {n} tokens")
    out[e:min(n, e + window)] = True
  return out


@dataclasses.dataclass(frozen=True)
class Selection:
  """The top-q high-entropy model tokens of a set of trajectories.

  Attributes:
    traj, pos: trajectory index and response position of each selected token, in
      order of decreasing entropy.
    entropy: their entropies.
    reflection: True for "reflection" tokens, False for "forking".
    threshold: the lowest selected entropy.
    num_model_tokens: model tokens considered (mask 1).
    in_window: model tokens inside a reflection window (the base rate's numerator).
  """
  traj: np.ndarray
  pos: np.ndarray
  entropy: np.ndarray
  reflection: np.ndarray
  threshold: float
  num_model_tokens: int
  in_window: int
  top_q: float
  window: int

  @property
  def kinds(self) -> np.ndarray:
    return np.where(self.reflection, REFLECTION, FORKING)


def _one_trajectory(entropies) -> bool:
  if isinstance(entropies, np.ndarray):
    return entropies.dtype != object and entropies.ndim == 1
  return len(entropies) == 0 or np.isscalar(entropies[0])


def classify_positions(entropies, mask, tool_response_ends, top_q: float = 0.2,
                       window: int = 8) -> Selection:
  """The top `top_q` share (ceil(top_q * N) of the N model tokens, mask 1) with the
  highest entropy over all trajectories, each classified as reflection (within `window`
  tokens after a tool response's end, see `reflection_window`) or forking.

  `entropies`, `mask` and `tool_response_ends` are one trajectory's arrays, or lists of
  them (one per trajectory; the threshold is then shared). Ties at the threshold are
  broken by (trajectory, position) order, so exactly ceil(top_q * N) are selected."""
  if not 0.0 < top_q <= 1.0:
    raise ValueError(f"top_q must be in (0, 1], got {top_q}")
  if window < 0:
    raise ValueError(f"window must be >= 0, got {window}")
  if _one_trajectory(entropies):
    ents, masks, ends = [entropies], [mask], [tool_response_ends]
  else:
    ents, masks, ends = list(entropies), list(mask), list(tool_response_ends)
  if not len(ents) == len(masks) == len(ends):
    raise ValueError(f"{len(ents)} entropy arrays, {len(masks)} masks, {len(ends)} end lists")
  traj, pos, ent, refl = [], [], [], []
  in_window = 0
  for i, (e, m, ed) in enumerate(zip(ents, masks, ends)):
    e, m = np.asarray(e, np.float64), np.asarray(m)
    if e.shape != m.shape:
      raise ValueError(f"trajectory {i}: {e.shape[0]} entropies for {m.shape[0]} mask entries")
    model = np.flatnonzero(m == 1)
    w = reflection_window(m, ed, window)
    if not np.all(np.isfinite(e[model])):
      raise ValueError(f"trajectory {i}: non-finite entropy at a model token")
    traj.append(np.full(model.shape, i))
    pos.append(model)
    ent.append(e[model])
    refl.append(w[model])
    in_window += int(w[model].sum())
  traj_a, pos_a = np.concatenate(traj or [[]]).astype(np.int64), np.concatenate(
      pos or [[]]).astype(np.int64)
  ent_a, refl_a = np.concatenate(ent or [[]]), np.concatenate(refl or [[]]).astype(bool)
  n = ent_a.size
  k = math.ceil(top_q * n - 1e-9) if n else 0
  # Highest entropy first; stable, so ties keep (trajectory, position) order.
  order = np.argsort(-ent_a, kind="stable")[:k]
  return Selection(traj=traj_a[order], pos=pos_a[order], entropy=ent_a[order],
                   reflection=refl_a[order],
                   threshold=float(ent_a[order[-1]]) if k else float("nan"),
                   num_model_tokens=int(n), in_window=in_window, top_q=top_q, window=window)


def token_tables(token_ids: Sequence[Sequence[int]], selection: Selection, *,
                 mask: Sequence[Sequence[int]] | None = None,
                 decode: Callable[[int], str] | None = None,
                 top_n: int | None = 30) -> dict[str, list[dict[str, Any]]]:
  """Frequency tables of the selected tokens: {"all", "reflection", "forking"} -> rows
  sorted by count (then id) with token id, text, count, share (of that class's selected
  tokens), mean entropy, and - when `mask` is given - occurrences among all model tokens
  and the share of those occurrences that were selected (how often that token is a
  high-entropy one)."""
  decode = decode or str
  ids = [np.asarray(t) for t in token_ids]
  selected = np.array([int(ids[t][p]) for t, p in zip(selection.traj, selection.pos)],
                      np.int64)
  occurrences: collections.Counter = collections.Counter()
  if mask is not None:
    for t, m in zip(ids, mask):
      occurrences.update(int(x) for x in t[np.asarray(m) == 1])
  tables = {}
  for name, keep in (("all", np.ones(selected.shape, bool)),
                     (REFLECTION, selection.reflection),
                     (FORKING, ~selection.reflection)):
    toks, ents = selected[keep], selection.entropy[keep]
    counts = collections.Counter(int(x) for x in toks)
    total = int(keep.sum())
    rows = []
    for tid, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top_n]:
      row = {"token_id": tid, "text": decode(tid), "count": c, "share": c / total,
             "mean_entropy": float(ents[toks == tid].mean())}
      if mask is not None:
        row["occurrences"] = occurrences[tid]
        row["selected_rate"] = c / occurrences[tid] if occurrences[tid] else None
      rows.append(row)
    tables[name] = rows
  return tables


def summary(entropies: Sequence[np.ndarray], masks: Sequence[Sequence[int]],
            selection: Selection) -> dict[str, Any]:
  """Summary numbers: entropy of all model tokens, of the selected, the reflection share
  among the selected against its base rate among all model tokens (their ratio > 1:
  high-entropy tokens gather after tool responses)."""
  model = np.concatenate([np.asarray(e, np.float64)[np.asarray(m) == 1]
                          for e, m in zip(entropies, masks)] or [np.zeros(0)])
  k = len(selection.entropy)
  n_refl = int(selection.reflection.sum())
  base = selection.in_window / selection.num_model_tokens if selection.num_model_tokens else None
  share = n_refl / k if k else None
  stat = lambda a: (None if a.size == 0 else float(a.mean()))
  return {
      "num_trajectories": len(masks), "num_model_tokens": selection.num_model_tokens,
      "top_q": selection.top_q, "window": selection.window, "num_selected": k,
      "threshold": None if not k else selection.threshold,
      "entropy_mean": stat(model), "entropy_median": None if model.size == 0 else
      float(np.median(model)),
      "entropy_p80": None if model.size == 0 else float(np.quantile(model, 0.8)),
      "selected_entropy_mean": stat(selection.entropy),
      "num_reflection": n_refl, "num_forking": k - n_refl,
      "reflection_share": share, "reflection_base_rate": base,
      "reflection_enrichment": (share / base) if share is not None and base else None,
      "selected_entropy_mean_reflection": stat(selection.entropy[selection.reflection]),
      "selected_entropy_mean_forking": stat(selection.entropy[~selection.reflection]),
  }


# ---- the whole analysis ---------------------------------------------------------------
def analyze(trajectories: Sequence[StoredTrajectory], entropies: Sequence[np.ndarray], *,
            top_q: float = 0.2, window: int = 8, decode: Callable[[int], str] | None = None,
            top_n: int = 30) -> dict[str, Any]:
  masks = [t.response_mask for t in trajectories]
  ends = [tool_response_ends(m) for m in masks]
  sel = classify_positions(list(entropies), masks, ends, top_q=top_q, window=window)
  return {"summary": summary(entropies, masks, sel),
          "tables": token_tables([t.response_ids for t in trajectories], sel, mask=masks,
                                 decode=decode, top_n=top_n)}


def format_report(result: Mapping[str, Any], top_n: int = 15) -> str:
  s = result["summary"]
  f = lambda x: "n/a" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))
  lines = [
      f"{s['num_trajectories']} trajectories, {s['num_model_tokens']} model tokens; top "
      f"{100 * s['top_q']:g}% = {s['num_selected']} tokens with entropy >= {f(s['threshold'])} "
      f"nats (mean over model tokens {f(s['entropy_mean'])}, median {f(s['entropy_median'])})",
      f"reflection (within {s['window']} tokens after a tool response): {s['num_reflection']} "
      f"({f(s['reflection_share'])} of the selected; base rate {f(s['reflection_base_rate'])}, "
      f"enrichment {f(s['reflection_enrichment'])}); forking: {s['num_forking']}"]
  for name in ("forking", "reflection"):
    rows = result["tables"][name][:top_n]
    lines.append(f"\n{name} tokens (top {len(rows)}):")
    lines.append(f"  {'token':<20} {'count':>6} {'share':>6} {'H mean':>7} {'sel/occ':>8}")
    for r in rows:
      rate = r.get("selected_rate")
      lines.append(f"  {json.dumps(r['text'])[:20]:<20} {r['count']:>6} {r['share']:>6.3f} "
                   f"{r['mean_entropy']:>7.3f} {'' if rate is None else f'{rate:.2f}':>8}")
  return "\n".join(lines)
