"""Token-entropy analysis (rstar_jax/analysis/entropy.py, experiments/entropy.py)."""
import json
import math
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from rstar_jax.analysis import entropy
from rstar_jax.model import qwen3
from tests import toy_fixtures
from tests import procs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _np_entropy(logits):
  z = logits - logits.max(-1, keepdims=True)
  p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
  return -(p * np.log(np.maximum(p, 1e-300))).sum(-1)


# ---- entropy values -------------------------------------------------------------------
def test_chunked_entropy_matches_numpy_on_hand_built_logits():
  vocab, h, t = 7, 7, 5
  # Identity unembedding: the hidden state IS the logits row.
  logits = np.array([
      [0, 0, 0, 0, 0, 0, 0],          # uniform: log 7
      [50, 0, 0, 0, 0, 0, 0],         # almost one-hot: ~0
      [1, 1, 0, 0, 0, 0, 0],          # two equal modes, five lesser
      [3, -1, 2, 0.5, -4, 1, 0],
      [np.log(0.5), np.log(0.25), np.log(0.125), np.log(0.125), -80, -80, -80],
  ], np.float32)
  hidden = jnp.asarray(np.stack([logits, logits[::-1]]))
  unembed = jnp.eye(h, vocab, dtype=jnp.float32)
  targets = jnp.zeros((2, t), jnp.int32)
  ref = _np_entropy(np.stack([logits, logits[::-1]]).astype(np.float64))
  assert ref[0, 0] == pytest.approx(math.log(7))
  assert ref[0, 4] == pytest.approx(1.75 * math.log(2))   # 1/2, 1/4, 1/8, 1/8
  for chunk in (1, 2, 3, 5, 512):
    _, ent = qwen3.chunked_logprobs(hidden, unembed, targets, chunk=chunk, return_entropy=True)
    np.testing.assert_allclose(np.asarray(ent), ref, atol=2e-6)
  # Temperature: entropy of softmax(logits / T).
  _, ent = qwen3.chunked_logprobs(hidden, unembed, targets, chunk=2, temperature=0.5,
                                  return_entropy=True)
  np.testing.assert_allclose(
      np.asarray(ent), _np_entropy(np.stack([logits, logits[::-1]]).astype(np.float64) / 0.5),
      atol=2e-5)


CFG = toy_fixtures.CFG


_random_model = toy_fixtures.random_model


def _traj(rng, p, r, vocab=61, mask=None):
  return entropy.StoredTrajectory(
      rng.randint(0, vocab, p).astype(np.int32), rng.randint(0, vocab, r).astype(np.int32),
      np.asarray(mask if mask is not None else [1] * r, np.int8))


def test_token_entropies_match_full_logits_per_trajectory():
  """Batched, padded, chunked entropies == numpy entropy of each trajectory's own full
  logits at the position that predicts each response token."""
  model = _random_model(CFG, seed=3)
  rng = np.random.RandomState(0)
  trajs = [_traj(rng, 5, 9), _traj(rng, 1, 4), _traj(rng, 12, 40, mask=[1, 0] * 20)]
  got = entropy.token_entropies(model, trajs, batch_size=2, chunk=16)
  # Reference: each sequence right-padded to 64 (causal: later tokens change nothing).
  seqs = np.zeros((3, 64), np.int32)
  for i, t in enumerate(trajs):
    seq = np.concatenate([t.prompt_ids, t.response_ids])
    seqs[i, :len(seq)] = seq
  logits = np.asarray(qwen3.forward_logits(model, jnp.asarray(seqs)), np.float64)
  for i, (t, e) in enumerate(zip(trajs, got)):
    p, r = len(t.prompt_ids), len(t.response_ids)
    ref = _np_entropy(logits[i])[p - 1:p - 1 + r]
    assert e.shape == (r,)
    np.testing.assert_allclose(e, ref, atol=1e-4)
  assert got[0].std() > 1e-3   # a real distribution, not a constant
  bad = [_traj(rng, 3, 3, vocab=200)]
  bad[0].response_ids[0] = 100
  with pytest.raises(entropy.TrajectoryError, match="vocab_size 61"):
    entropy.token_entropies(model, bad)


# ---- classification -------------------------------------------------------------------
def test_tool_response_ends_and_window():
  mask = [1, 1, 0, 0, 0, 1, 1, 1, 1, 0, 1, 1]
  ends = entropy.tool_response_ends(mask)
  assert ends.tolist() == [5, 10]
  assert entropy.tool_response_ends([0, 0, 1, 1]).tolist() == [2]   # tool side first
  assert entropy.tool_response_ends([1, 1, 1]).tolist() == []
  assert entropy.tool_response_ends([]).tolist() == []
  w = entropy.reflection_window(mask, ends, 3)
  assert np.flatnonzero(w).tolist() == [5, 6, 7, 10, 11]
  assert not entropy.reflection_window(mask, ends, 0).any()


def test_classify_top_q_and_kinds_hand_built():
  #        0    1    2    3    4    5    6    7    8    9
  ent = [0.1, 3.0, 9.0, 9.0, 0.5, 2.5, 0.2, 2.9, 0.3, 0.4]
  mask = [1, 1, 0, 0, 0, 1, 1, 1, 1, 1]   # tool response at 2-4 (high entropy, ignored)
  ends = entropy.tool_response_ends(mask)
  sel = entropy.classify_positions(np.array(ent), np.array(mask), ends, top_q=0.3, window=2)
  # 7 model tokens; ceil(0.3 * 7) = 3: positions 1 (3.0), 7 (2.9), 5 (2.5).
  assert sel.num_model_tokens == 7
  assert sel.pos.tolist() == [1, 7, 5] and sel.traj.tolist() == [0, 0, 0]
  assert sel.threshold == 2.5
  # Window 2 after the end at 5: positions 5 and 6 are reflection.
  assert sel.reflection.tolist() == [False, False, True]
  assert sel.kinds.tolist() == ["forking", "forking", "reflection"]
  assert sel.in_window == 2
  wide = entropy.classify_positions(np.array(ent), np.array(mask), ends, top_q=0.3, window=3)
  assert wide.reflection.tolist() == [False, True, True]
  # Across trajectories the threshold is shared; ties keep (trajectory, position) order.
  sel = entropy.classify_positions([np.array([1.0, 1.0, 0.0]), np.array([1.0, 5.0])],
                                   [np.array([1, 1, 1]), np.array([0, 1])],
                                   [[], [1]], top_q=0.5, window=1)
  assert list(zip(sel.traj.tolist(), sel.pos.tolist())) == [(1, 1), (0, 0)]
  assert sel.reflection.tolist() == [True, False] and sel.num_model_tokens == 4
  all_ = entropy.classify_positions(np.array(ent), np.array(mask), ends, top_q=1.0, window=2)
  assert len(all_.pos) == 7 and set(all_.pos.tolist()) == {0, 1, 5, 6, 7, 8, 9}
  for bad in (dict(top_q=0.0), dict(top_q=1.5), dict(window=-1)):
    with pytest.raises(ValueError):
      entropy.classify_positions(np.array(ent), np.array(mask), ends, **bad)
  with pytest.raises(ValueError, match="entropies for"):
    entropy.classify_positions(np.zeros(3), np.ones(4), [], top_q=0.5)


def test_token_tables_and_summary():
  ids = [np.array([10, 11, 12, 10, 13, 10]), np.array([10, 14, 11])]
  ent = [np.array([5.0, 4.0, 0.0, 3.0, 0.1, 0.2]), np.array([6.0, 0.0, 2.0])]
  mask = [np.array([1, 1, 0, 1, 1, 1]), np.array([1, 1, 1])]
  ends = [entropy.tool_response_ends(m) for m in mask]   # [[3], []]
  sel = entropy.classify_positions(ent, mask, ends, top_q=0.5, window=1)
  # 8 model tokens -> 4: (1,0) 6.0 tok 10; (0,0) 5.0 tok 10; (0,1) 4.0 tok 11; (0,3) 3.0 tok 10
  assert list(zip(sel.traj.tolist(), sel.pos.tolist())) == [(1, 0), (0, 0), (0, 1), (0, 3)]
  assert sel.reflection.tolist() == [False, False, False, True]
  tables = entropy.token_tables(ids, sel, mask=mask, decode=lambda i: f"<{i}>")
  assert [(r["token_id"], r["count"]) for r in tables["all"]] == [(10, 3), (11, 1)]
  top = tables["all"][0]
  assert top["text"] == "<10>" and top["share"] == 0.75
  assert top["mean_entropy"] == pytest.approx((6 + 5 + 3) / 3)
  assert top["occurrences"] == 4 and top["selected_rate"] == 0.75   # 10 appears 4x (mask 1)
  assert [(r["token_id"], r["count"], r["share"]) for r in tables["forking"]] == [
      (10, 2, 2 / 3), (11, 1, 1 / 3)]
  assert [(r["token_id"], r["count"]) for r in tables["reflection"]] == [(10, 1)]
  assert entropy.token_tables(ids, sel, top_n=1)["all"][0].keys() == {
      "token_id", "text", "count", "share", "mean_entropy"}
  s = entropy.summary(ent, mask, sel)
  assert s["num_selected"] == 4 and s["num_reflection"] == 1 and s["threshold"] == 3.0
  assert s["reflection_share"] == 0.25 and s["reflection_base_rate"] == 1 / 8
  assert s["reflection_enrichment"] == pytest.approx(2.0)
  assert s["entropy_mean"] == pytest.approx(np.mean([5, 4, 3, 0.1, 0.2, 6, 0, 2]))
  assert s["selected_entropy_mean_reflection"] == 3.0
  assert "reflection" in entropy.format_report({"summary": s, "tables": tables})


# ---- trajectory files -----------------------------------------------------------------
def test_load_trajectories_errors_name_file_and_line(tmp_path):
  good = {"uid": "p#0", "prompt_ids": [1, 2], "response_ids": [3, 4, 5],
          "response_mask": [1, 0, 1], "reward": 1.0}
  path = tmp_path / "t.jsonl"
  path.write_text(json.dumps(good) + "\n\n" + json.dumps(good) + "\n")
  got = entropy.load_trajectories(str(path))
  assert len(got) == 2 and got[0].response_mask.tolist() == [1, 0, 1] and got[0].reward == 1.0
  cases = [("{bad json", "not valid JSON"),
           (json.dumps({"uid": "x", "response": "text"}), "missing field.*run the evaluation"),
           (json.dumps({**good, "response_mask": [1, 0]}), "2 entries for 3 response_ids"),
           (json.dumps({**good, "response_mask": [1, 2, 1]}), "only 0 and 1"),
           (json.dumps({**good, "prompt_ids": [1, "a"]}), "non-integer 'a'"),
           (json.dumps({**good, "prompt_ids": []}), "empty prompt_ids"),
           (json.dumps([1, 2]), "expected a JSON object")]
  for line, msg in cases:
    path.write_text(json.dumps(good) + "\n" + line + "\n")
    with pytest.raises(entropy.TrajectoryError, match=f"t.jsonl:2: .*{msg}"):
      entropy.load_trajectories(str(path))
  with pytest.raises(entropy.TrajectoryError, match="no such trajectories file"):
    entropy.load_trajectories(str(tmp_path / "nope.jsonl"))


def test_write_samples_rows_load(tmp_path):
  """The evaluation's samples file carries what the analysis needs."""
  from rstar_jax.data import math_problems
  from rstar_jax.eval import eval_runs
  from rstar_jax.rollout import agent_loop

  class Tok:
    def decode(self, ids):
      return " ".join(map(str, ids))

  t = agent_loop.Trajectory(uid="p#1", prompt_ids=[1, 2], response_ids=[3, 4, 5, 6],
                            response_mask=[1, 0, 0, 1], reward=1.0)
  path = str(tmp_path / "eval_x_samples.jsonl")
  eval_runs.write_samples(path, [t], [math_problems.MathProblem("p", "q", "1", "s")], Tok())
  (row,) = entropy.load_trajectories(path)
  assert row.prompt_ids.tolist() == [1, 2] and row.response_ids.tolist() == [3, 4, 5, 6]
  assert row.response_mask.tolist() == [1, 0, 0, 1] and row.uid == "p#1"
  assert json.loads(open(path).readline())["response"] == "3 4 5 6"


# ---- end to end -----------------------------------------------------------------------
def test_cli_end_to_end_on_tiny_export(tmp_path):
  """A tiny random Qwen3 + toy tokenizer exported with save_hf; toy traces with tool
  calls rendered through the chat protocol; the CLI's entropies equal the library's."""
  hf_dir, model, tok = toy_fixtures.toy_export(str(tmp_path), seed=0)
  path = toy_fixtures.write_toy_samples(str(tmp_path / "samples.jsonl"), tok, n=6, seed=1)
  out = tmp_path / "out" / "entropy.json"
  env = procs.cpu_env(PYTHONPATH=REPO)
  run = subprocess.run([sys.executable, "-m", "experiments.entropy", "--hf_dir", hf_dir,
                        "--trajectories", str(path), "--top_q", "0.25",
                        "--reflection_window", "4", "--out", str(out), "--save_entropies",
                        "--batch_size", "4", "--chunk", "64"],
                       cwd=REPO, env=env, capture_output=True, text=True)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  assert "forking tokens" in run.stdout and "reflection (within 4 tokens" in run.stdout
  result = json.load(open(out))
  trajs = entropy.load_trajectories(str(path))
  n_model = sum(int(t.response_mask.sum()) for t in trajs)
  s = result["summary"]
  assert s["num_trajectories"] == 6 and s["num_model_tokens"] == n_model
  assert s["num_selected"] == math.ceil(0.25 * n_model)
  assert s["num_reflection"] + s["num_forking"] == s["num_selected"]
  ends = sum(len(entropy.tool_response_ends(t.response_mask)) for t in trajs)
  assert ends >= 6 and 0 < s["reflection_base_rate"] < 1   # every trace calls the tool
  assert sum(r["count"] for r in result["tables"]["all"]) <= s["num_selected"]
  assert all(isinstance(r["text"], str) for r in result["tables"]["forking"])
  # The CLI's entropies (loaded from the export) equal the library's on the in-memory model.
  mine = entropy.token_entropies(model, trajs, batch_size=3, chunk=32)
  for row, e in zip(result["entropies"], mine):
    np.testing.assert_allclose(row["entropy"], e, atol=1e-4)
  bad = subprocess.run([sys.executable, "-m", "experiments.entropy", "--hf_dir", hf_dir,
                        "--trajectories", str(tmp_path / "missing.jsonl")],
                       cwd=REPO, env=env, capture_output=True, text=True)
  assert bad.returncode != 0 and "missing.jsonl: no such trajectories file" in bad.stderr
  # Bad flags are named before the model loads or anything is scored.
  (tmp_path / "a_file").write_text("")
  for flag, says in (("--batch_size=0", "--batch_size and --chunk must be >= 1"),
                     ("--dtype=float99", "--dtype='float99': choose from"),
                     (f"--out={tmp_path / 'a_file' / 'e.json'}", "cannot write there")):
    bad = subprocess.run([sys.executable, "-m", "experiments.entropy", "--hf_dir", hf_dir,
                          "--trajectories", str(path), flag],
                         cwd=REPO, env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and says in bad.stderr and "Traceback" not in bad.stderr, \
        (flag, bad.stderr[-2000:])
