"""Recorded SGLang exchanges (`experiments/record_sglang.py`) replayed offline: every
request body and reply is checked against SGLang 0.5.23's own schema, and every
/generate reply goes through the client's parser as in training. The recorder itself is
run here against our rollout server (a real process); recordings of real SGLang servers
committed under recordings/ are replayed in the same test (none is committed yet)."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from rstar_jax.rollout.sglang import wire
from rstar_jax.rollout.engine import GenerationRequest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
COMMITTED = sorted(glob.glob(os.path.join(HERE, "recordings", "*.jsonl")))


def replay(path: str, schema) -> dict[str, int]:
  """Checks every exchange of a recording; returns how many of each route it holds."""
  routes: dict[str, int] = {}
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  assert rows, f"{path}: empty recording"
  for x in rows:
    route, body, status, reply = x["route"], x["request"], x["status"], x["reply"]
    routes[route] = routes.get(route, 0) + 1
    schema.check_exchange(route, body, status, reply)
    if route != "/generate" or status != 200:
      continue
    sp = body["sampling_params"]
    req = GenerationRequest(input_ids=body["input_ids"], max_new_tokens=sp["max_new_tokens"],
                            temperature=sp["temperature"], top_p=sp["top_p"],
                            top_k=max(sp["top_k"], 0), stop_token_ids=tuple(sp["stop_token_ids"]),
                            seed=sp["sampling_seed"], request_id=body["rid"])
    try:
      out = wire.parse_generate_reply(reply, req, rid=body["rid"], url=path)
    except wire.GenerationAborted:
      routes["aborted"] = routes.get("aborted", 0) + 1
      continue
    assert 0 < len(out.output_ids) == len(out.logprobs) <= req.max_new_tokens, x
    if out.finish_reason == "stop":
      assert out.output_ids[-1] in req.stop_token_ids, x
  return routes


def test_recorder_against_our_server_then_replayed(served, sglang_schema, tmp_path):
  url = served["servers"]["a"].url
  out = tmp_path / "ours.jsonl"
  run = subprocess.run(
      [sys.executable, "-m", "experiments.record_sglang", "--url", url, "--out", str(out),
       "--model_path", served["dirs"]["m1"], "--weight_version", "recorded-1"],
      cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True)
  assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
  assert "exchanges written to" in run.stdout and "abort: (True" in run.stdout
  routes = replay(str(out), sglang_schema)
  assert routes["/generate"] == 5 and routes["aborted"] == 1
  for r in ("/abort_request", "/pause_generation", "/continue_generation", "/flush_cache",
            "/update_weights_from_disk", "/model_info", "/v1/loads", "/health"):
    assert routes.get(r, 0) >= 1, (r, routes)
  # A recording that breaks SGLang's schema is caught, not replayed silently.
  rows = [json.loads(l) for l in open(out)]
  gen = next(x for x in rows if x["route"] == "/generate")
  gen["request"]["sampling_params"]["sampling_sed"] = 1
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps(gen) + "\n")
  with pytest.raises(BaseException, match="sampling_sed"):
    replay(str(bad), sglang_schema)
  # Recordings of real SGLang servers, once a GPU host has committed one. (There was a
  # separate test for them, parametrized over the files: with none committed it was
  # always skipped, and a recording built here from SGLang's schema would only check the
  # schema against itself; the recorder run above is what exercises replay today.)
  for path in COMMITTED:
    assert replay(path, sglang_schema).get("/generate", 0) >= 1, path
