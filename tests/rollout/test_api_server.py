"""Our rollout server (`python -m rstar_jax.rollout.api_server`) as real processes on
127.0.0.1, driven by the SGLang client:

  * multi-turn agent-loop trajectories through two servers equal the in-process
    JaxEngine's for the same seeds (ids, masks, log-probs within 1e-5), and every
    exchange of that run (request bodies and our replies) validates against SGLang
    0.5.23's schema (`conftest.SGLangSchema`);
  * an unknown sampling key is refused with SGLang's own error text;
  * a weight update from disk makes served outputs follow the new params and
    /model_info and the replies report the new version; a checkpoint of another
    architecture is refused and changes nothing;
  * abort (explicit and by cancelling the caller) while the server is paused;
    the engine-level abort of a running and of a queued request (in process);
  * a server SIGKILLed mid-request: the request completes on the other server;
  * `rollout.backend=server` builds the pool; in-memory weight updates are refused.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from rstar_jax.data import toy_task
from rstar_jax.model import hf_io, qwen3
from rstar_jax.rollout import chat
from rstar_jax.rollout.sglang import engine as se, transport, wire
from rstar_jax.rollout.agent_loop import AgentConfig, run_many
from rstar_jax.rollout.backends import RolloutConfig, build_engine_pool
from rstar_jax.rollout.engine import GenerationRequest, GenerationResult
from rstar_jax.rollout.jax_engine import EngineConfig, JaxEngine
from rstar_jax.rollout.scheduler import EnginePool
from rstar_jax.rollout.api_server import ServedEngine

from tests.rollout.conftest import SERVER_BUCKET, SERVER_MAX_LEN, SERVER_SLOTS, ServerProcess

CLIENT = transport.ClientConfig(backoff_s=0.05, backoff_max_s=0.2, retries=2, probe_interval_s=0.2,
                         load_poll_s=0.2)


def local_engine(model, name="local") -> JaxEngine:
  return JaxEngine(model, EngineConfig(num_slots=SERVER_SLOTS, max_len=SERVER_MAX_LEN,
                                       min_prefill_bucket=SERVER_BUCKET), name=name)


class FakeTools:
  """A deterministic tool executor (no code is run)."""

  async def execute(self, calls):
    await asyncio.sleep(0)
    return [{"status": "ok", "stdout": f"{len(c.code or '')}\n", "stderr": ""} for c in calls]


class ForcedFirstTurn:
  """Turn 0 of each trajectory is a scripted tool call (a random model rarely calls a
  tool), so every trajectory is multi-turn; later turns come from `engine`."""

  def __init__(self, engine, first_turns):
    self.engine, self.first_turns = engine, first_turns

  async def generate(self, request):
    forced = self.first_turns.get(tuple(request.input_ids))
    if forced is not None:
      return GenerationResult(request_id=request.request_id, output_ids=list(forced),
                              logprobs=[math.nan] * len(forced), finish_reason="stop",
                              prompt_tokens=len(request.input_ids), reused_prefix_tokens=0,
                              queue_wait_s=0.0)
    return await self.engine.generate(request)


@pytest.fixture(scope="module")
def proto(toy_tok):
  return chat.ChatProtocol(toy_tok, toy_task.toy_chat_config())


def rollouts(engine, toy_tok, proto, problems, cfg, seeds):
  first = {tuple(proto.prompt_ids(p.problem)): toy_tok.encode(chat.assistant_text({
      "content": "Let me compute.",
      "tool_calls": [{"name": toy_task.TOY_TOOL_NAME, "arguments": {"code": p.code}}]}))
      for p in problems}
  return asyncio.run(run_many(ForcedFirstTurn(engine, first), FakeTools(), proto,
                              [(f"r{i}", p.problem) for i, p in enumerate(problems)], cfg,
                              seeds=seeds))


def post(url, route, body: bytes | dict):
  data = body if isinstance(body, bytes) else json.dumps(body).encode()
  req = urllib.request.Request(url + route, data=data,
                               headers={"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(req, timeout=60) as r:
      return r.status, r.read().decode()
  except urllib.error.HTTPError as e:
    return e.code, e.read().decode()


def loads(url) -> dict:
  with urllib.request.urlopen(url + "/v1/loads", timeout=30) as r:
    return json.loads(r.read())["loads"][0]


def wait_for(predicate, what: str, tries: int = 300, pause: float = 0.05):
  for _ in range(tries):
    if predicate():
      return
    time.sleep(pause)
  raise AssertionError(f"timed out waiting for {what}")


# ---- end to end ---------------------------------------------------------------------
def test_trajectories_through_servers_equal_in_process(served, toy_tok, proto, sglang_schema):
  problems = toy_task.generate_problems(5, seed=31)
  cfg = AgentConfig(max_turns=3, max_response_tokens=96, temperature=1.0, top_p=0.95)
  seeds = [200 + i for i in range(len(problems))]
  exchanges = []
  urls = [served["servers"][k].url for k in ("a", "b")]
  engines = se.connect(urls, config=CLIENT, on_exchange=lambda *x: exchanges.append(x),
                       expected_model=hf_io.config_to_hf_dict(served["cfg"], "float32"))
  pool = EnginePool(engines, policy="kv_capacity")
  try:
    remote = rollouts(pool, toy_tok, proto, problems, cfg, seeds)
  finally:
    pool.stop()
  local_eng = local_engine(served["models"]["m1"])
  try:
    local = rollouts(EnginePool([local_eng]), toy_tok, proto, problems, cfg, seeds)
  finally:
    local_eng.stop()
  real_turns = 0
  for x, y in zip(remote, local):
    assert x.num_turns >= 2 and x.num_tool_calls >= 1
    assert x.response_ids == y.response_ids and x.response_mask == y.response_mask
    assert x.finish_reason == y.finish_reason and x.turns == y.turns
    for s, e in x.turns[1:]:
      real_turns += 1
      np.testing.assert_allclose(x.response_logprobs[s:e], y.response_logprobs[s:e],
                                 atol=1e-5, rtol=0, err_msg=x.uid)
  assert real_turns >= len(problems)
  # The contract, on every exchange of the run.
  generates = [x for x in exchanges if x[0] == "/generate"]
  assert len(generates) == real_turns
  assert {x[0] for x in exchanges} >= {"/health", "/server_info", "/model_info", "/generate"}
  for route, body, status, reply in exchanges:
    assert status == 200, (route, reply)
    sglang_schema.check_exchange(route, body, status, reply)
  stats = pool.stats()
  assert sum(stats[f"{e.name}/requests"] for e in engines) == real_turns


def test_a_deterministic_server_gives_the_bits_of_the_batch_invariant_engine(served,
                                                                              sglang_schema):
  """--enable-deterministic-inference (SGLang's flag): /server_info reports it as SGLang
  does, a client that requires it refuses a server without it, and concurrent requests
  through the server get the tokens and log-prob bits of the in-process batch-invariant
  engine running them one at a time."""
  det = ServerProcess(served["dirs"]["m1"], served["root"], "det",
                      extra_args=("--enable-deterministic-inference",))
  strict = dataclasses.replace(CLIENT, require_deterministic=True)
  try:
    with pytest.raises(wire.ServerMismatchError, match="--enable-deterministic-inference"):
      se.connect([served["servers"]["a"].url], config=strict)
    det.wait_ready()
    [eng] = se.connect([det.url], config=strict,
                       on_exchange=lambda *x: sglang_schema.check_exchange(*x))
    rng = np.random.RandomState(5)
    vocab = served["cfg"].vocab_size
    reqs = [GenerationRequest(input_ids=rng.randint(0, vocab, int(rng.randint(5, 120))).tolist(),
                              max_new_tokens=int(rng.randint(5, 40)), temperature=1.0,
                              seed=i, request_id=f"d{i}") for i in range(6)]

    async def all_at_once():
      return await asyncio.gather(*(eng.generate(r) for r in reqs))
    try:
      remote = asyncio.run(all_at_once())
    finally:
      eng.stop()
  finally:
    det.kill()
  local = JaxEngine(served["models"]["m1"], EngineConfig(
      num_slots=SERVER_SLOTS, max_len=SERVER_MAX_LEN, min_prefill_bucket=SERVER_BUCKET,
      batch_invariant=True))
  for r, x in zip(reqs, remote):
    [y] = local.generate_sync([r])
    assert x.output_ids == y.output_ids, r.request_id
    assert (np.float32(x.logprobs).tobytes() == np.float32(y.logprobs).tobytes()), r.request_id


def test_unknown_sampling_key_refused_with_sglangs_error(served, sglang_schema):
  url = served["servers"]["a"].url
  body = wire.generate_body(GenerationRequest(input_ids=[1, 2], max_new_tokens=2), rid="bad-key")
  body["sampling_params"]["temprature"] = 0.5
  with pytest.raises(sglang_schema.api.JsonContractError) as want:
    sglang_schema.api.GenerateRequest.from_json_value(body)
  status, text = post(url, "/generate", body)
  assert status == 400 and json.loads(text) == {"error": str(want.value)}
  # Refused, not silently ignored: a field SGLang knows but we do not implement.
  body["sampling_params"].pop("temprature")
  body["sampling_params"]["regex"] = "[0-9]+"
  status, text = post(url, "/generate", body)
  assert status == 400 and "regex" in json.loads(text)["error"]["message"]
  status, text = post(url, "/generate", b"{not json")
  assert status == 400 and "not JSON" in text


def test_non_finite_numbers_huge_or_deep_bodies_and_string_flags_are_400s(served):
  """json.loads takes NaN (a NaN temperature gave NaN log-probs), > 4300-digit numbers and
  deep nesting raised past the handlers (500s), and "false" was a true abort_all."""
  url = served["servers"]["a"].url
  body = wire.generate_body(GenerationRequest(input_ids=[1, 2], max_new_tokens=2), rid="nan")
  text = json.dumps(body).replace('"temperature": 1.0', '"temperature": NaN')
  assert "NaN" in text
  status, reply = post(url, "/generate", text.encode())
  assert status == 400 and "temperature must be a number >= 0, got nan" in reply
  text = json.dumps(body).replace('"temperature": 1.0', '"temperature": ' + "9" * 400)
  status, reply = post(url, "/generate", text.encode())
  assert status == 400 and "temperature must be a number >= 0" in reply
  for route in ("/abort_request", "/pause_generation", "/update_weights_from_disk", "/generate"):
    for raw in (b'{"rid": ' + b"1" * 5000 + b"}", b"[" * 100_000 + b"]" * 100_000):
      status, reply = post(url, route, raw)
      assert status == 400 and "not JSON" in reply, (route, status, reply[:200])
  status, reply = post(url, "/abort_request", {"rid": "x", "abort_all": "false"})
  assert status == 400 and "abort_all must be true or false, got 'false'" in reply
  status, reply = post(url, "/update_weights_from_disk",
                       {"model_path": "/nowhere", "abort_all_requests": "false"})
  assert status == 400 and "abort_all_requests must be true or false" in reply


def test_weight_update_from_disk(served, sglang_schema):
  c = served["servers"]["c"]
  exchanges = []
  [eng] = se.connect([c.url], config=CLIENT, on_exchange=lambda *x: exchanges.append(x))
  reqs = [GenerationRequest(input_ids=[5 + i, 9, 40 + i], max_new_tokens=12, seed=i,
                            temperature=1.0, request_id=f"w{i}") for i in range(3)]

  async def gen_all():
    return await asyncio.gather(*(eng.generate(r) for r in reqs))
  try:
    before = asyncio.run(gen_all())
    assert {r.weight_version for r in before} == {"default"}
    secs = se.update_weights_from_disk([eng], served["dirs"]["m2"], "step-1")
    assert list(secs) == [c.url]
    info = eng.get_model_info()
    assert info["weight_version"] == "step-1" and info["model_path"] == served["dirs"]["m2"]
    after = asyncio.run(gen_all())
    assert {r.weight_version for r in after} == {"step-1"}
    local_eng = local_engine(served["models"]["m2"])
    try:
      want = local_eng.generate_sync(reqs)
    finally:
      local_eng.stop()
    for got, ref, old in zip(after, want, before):
      assert got.output_ids == ref.output_ids
      np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-5, rtol=0)
      assert got.logprobs != old.logprobs          # the new weights are in use
    # Another architecture is refused and leaves the served model alone.
    other = qwen3.create_model(_wider(served["cfg"]))
    hf_io.save_hf(other, served["root"] + "/wide", dtype="float32")
    with pytest.raises(wire.ServerRequestError, match="another architecture: hidden_size=48"):
      se.update_weights_from_disk([eng], served["root"] + "/wide", "step-2")
    with pytest.raises(wire.ServerRequestError, match="no config.json"):
      se.update_weights_from_disk([eng], served["root"] + "/missing", "step-2")
    assert eng.get_model_info()["weight_version"] == "step-1"
    assert asyncio.run(gen_all())[0].output_ids == after[0].output_ids
  finally:
    eng.stop()
  for route, body, status, reply in exchanges:
    sglang_schema.check_exchange(route, body, status, reply)
  assert {"/pause_generation", "/update_weights_from_disk", "/continue_generation"} <= {
      x[0] for x in exchanges}


def _wider(cfg):
  import dataclasses
  return dataclasses.replace(cfg, hidden_size=48)


def test_abort_and_cancel_while_paused(served, sglang_schema):
  a = served["servers"]["a"]
  exchanges = []
  [eng] = se.connect([a.url], config=CLIENT, on_exchange=lambda *x: exchanges.append(x))
  req = GenerationRequest(input_ids=[3, 4, 5], max_new_tokens=20, seed=3, request_id="ab")
  try:
    eng.pause_generation("in_place")

    async def abort_it():
      task = asyncio.ensure_future(eng.generate(req))
      await asyncio.get_running_loop().run_in_executor(
          None, wait_for, lambda: loads(a.url)["num_waiting_reqs"] == 1, "a waiting request")
      assert await eng.abort("ab")
      with pytest.raises(wire.GenerationAborted, match="aborted by the server") as info:
        await task
      assert info.value.partial.output_ids == []
      assert not await eng.abort("ab")          # nothing in flight any more

    async def cancel_it():
      task = asyncio.ensure_future(eng.generate(req))
      await asyncio.get_running_loop().run_in_executor(
          None, wait_for, lambda: loads(a.url)["num_waiting_reqs"] == 1, "a waiting request")
      task.cancel()
      with pytest.raises(asyncio.CancelledError):
        await task
    asyncio.run(abort_it())
    asyncio.run(cancel_it())
    # The cancelled caller's request was aborted on the server.
    wait_for(lambda: loads(a.url)["num_waiting_reqs"] == 0, "the cancelled request to go")
    eng.continue_generation()
    out = asyncio.run(eng.generate(req))
    assert out.finish_reason == "length" and len(out.output_ids) == 20
    wait_for(lambda: loads(a.url)["num_running_reqs"] == 0, "an idle server")
  finally:
    eng.stop()
  for x in exchanges:
    sglang_schema.check_exchange(*x)
  assert "/abort_request" in {x[0] for x in exchanges}


def test_engine_abort_of_running_and_queued_requests(served):
  """ServedEngine.abort on the engine itself, stepped by hand (deterministic)."""
  eng = ServedEngine(served["models"]["m1"], EngineConfig(num_slots=1, max_len=64,
                                                          min_prefill_bucket=16))
  running = eng.submit(GenerationRequest(input_ids=[1, 2], max_new_tokens=30, seed=1,
                                         request_id="run"))
  queued = eng.submit(GenerationRequest(input_ids=[3, 4], max_new_tokens=30, seed=2,
                                        request_id="wait"))
  eng.step()                      # prefill + one decode step: 2 tokens, "wait" queued
  assert not running.done() and not queued.done()
  assert eng.abort("wait") and eng.abort("run") and not eng.abort("run")
  r, q = running.result(0), queued.result(0)
  assert (r.finish_reason, len(r.output_ids), len(r.logprobs)) == ("abort", 2, 2)
  assert (q.finish_reason, q.output_ids) == ("abort", [])
  assert eng.num_active() == 0 and not eng.queue
  # The freed slot serves the next request normally.
  [nxt] = eng.generate_sync([GenerationRequest(input_ids=[1, 2], max_new_tokens=3, seed=1)])
  assert nxt.finish_reason == "length" and nxt.output_ids == r.output_ids[:2] + nxt.output_ids[2:]


def test_server_killed_mid_request_completes_on_another(served):
  a, c = served["servers"]["a"], served["servers"]["c"]
  engines = se.connect([c.url, a.url], config=CLIENT)
  req = GenerationRequest(input_ids=[11, 12, 13, 14], max_new_tokens=16, seed=9,
                          request_id="survivor")
  try:
    engines[0].pause_generation("in_place")   # the request stays on c until c dies

    async def main():
      task = asyncio.ensure_future(engines[0].generate(req))
      await asyncio.get_running_loop().run_in_executor(
          None, wait_for, lambda: loads(c.url)["num_waiting_reqs"] == 1, "the request on c")
      c.proc.kill()
      return await task
    out = asyncio.run(main())
    assert out.server == a.url and engines[0].metrics["failovers"] == 1
    assert not engines[0].alive and engines[0].free_kv_tokens() < 0 < engines[1].free_kv_tokens()
    local_eng = local_engine(served["models"]["m1"])
    try:
      [want] = local_eng.generate_sync([GenerationRequest(
          input_ids=req.input_ids, max_new_tokens=16, seed=9)])
    finally:
      local_eng.stop()
    assert out.output_ids == want.output_ids
    np.testing.assert_allclose(out.logprobs, want.logprobs, atol=1e-5, rtol=0)
  finally:
    for e in engines:
      e.stop()


def test_server_backend_builds_the_pool(served):
  url = served["servers"]["a"].url
  with pytest.raises(ValueError, match="servers is empty"):
    RolloutConfig(backend="server")
  pool = build_engine_pool(RolloutConfig(backend="server", servers=(url,)),
                           served["models"]["m1"])
  try:
    assert [type(e) for e in pool.engines] == [se.SGLangEngine]
    assert pool.max_len == SERVER_MAX_LEN
    with pytest.raises(NotImplementedError, match="update_weights_from_disk"):
      pool.update_weights(None)
  finally:
    pool.stop()
  other = qwen3.create_model(_wider(served["cfg"]))
  with pytest.raises(wire.ServerMismatchError, match="hidden_size=32 \\(trainer: 48\\)"):
    build_engine_pool(RolloutConfig(backend="sglang", servers=(url,)), other)


def test_a_burst_of_requests_splits_evenly_over_two_servers(served):
  """The pool picks a whole burst synchronously while the I/O thread registers requests
  later: each pick must already count the ones before it (before the fix, one server
  got about 2/3 of a burst and the servers took 1.5x the in-process wall time)."""
  urls = (served["servers"]["a"].url, served["servers"]["b"].url)
  for policy in ("kv_capacity", "sticky"):
    pool = build_engine_pool(RolloutConfig(backend="server", servers=urls,
                                           scheduler_policy=policy))
    try:
      reqs = [GenerationRequest(input_ids=[1, 2, 3], max_new_tokens=4, temperature=1.0,
                                seed=i, request_id=f"burst{i}") for i in range(16)]

      async def burst():
        return await asyncio.gather(*(pool.generate(r) for r in reqs))
      outs = asyncio.run(burst())
      assert all(len(o.output_ids) == 4 for o in outs)
      assert sorted(pool.metrics[e.name]["requests"] for e in pool.engines) == [8, 8], policy
      assert all(e.free_kv_tokens() == e.capacity for e in pool.engines)   # all released
    finally:
      pool.stop()


def test_pool_weight_sync_through_disk_moves_every_server(served, tmp_path, sglang_schema):
  """pool.update_weights(params, version) with backend=server: a versioned checkpoint is
  written (complete before it is named), both servers pause -> update -> continue and
  confirm the version, and what they serve follows the new parameters exactly."""
  from flax import nnx
  from rstar_jax.rollout.weight_sync import WeightSyncConfig
  a, b = served["servers"]["a"], served["servers"]["b"]
  m1, m2 = served["models"]["m1"], served["models"]["m2"]
  cfg = RolloutConfig(backend="server", servers=(a.url, b.url),
                      weight_sync=WeightSyncConfig(dtype="float32", keep=2))
  pool = build_engine_pool(cfg, m1, workdir=str(tmp_path))
  reqs = [GenerationRequest(input_ids=[7 + i, 11, 30 + i], max_new_tokens=10, seed=100 + i,
                            temperature=1.0, request_id=f"sync{i}") for i in range(4)]

  async def gen_all():
    return await asyncio.gather(*(pool.generate(r) for r in reqs))
  try:
    assert pool.sync_metrics() == {}
    pool.update_weights(nnx.state(m2), "stage1-step1")
    sync_dir = tmp_path / "weight_sync"
    assert sorted(p.name for p in sync_dir.iterdir()) == ["stage1-step1"]
    assert (sync_dir / "stage1-step1" / "config.json").exists()
    for e in pool.engines:
      info = e.get_model_info()
      assert info["weight_version"] == "stage1-step1"
      assert info["model_path"] == str(sync_dir / "stage1-step1")
      sglang_schema.check_model_info(info)
    got = asyncio.run(gen_all())
    assert {r.weight_version for r in got} == {"stage1-step1"}
    local = local_engine(m2)
    try:
      want = local.generate_sync(reqs)
    finally:
      local.stop()
    for g, w in zip(got, want):
      assert g.output_ids == w.output_ids
      np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5, rtol=0)
    m = pool.sync_metrics()
    size = sum(f.stat().st_size for f in (sync_dir / "stage1-step1").iterdir())
    assert m["sync/gb"] == pytest.approx(size / 1e9) and m["sync/servers"] == 2.0
    assert 0 < m["sync/write_s"] <= m["sync/total_s"]
    # Older versions are removed beyond `keep`; the served one stays.
    pool.update_weights(nnx.state(m1), "stage1-step2")
    pool.update_weights(nnx.state(m1), "stage1-step3")
    assert sorted(p.name for p in sync_dir.iterdir()) == ["stage1-step2", "stage1-step3"]
    back = asyncio.run(gen_all())
    assert {r.weight_version for r in back} == {"stage1-step3"}
    assert back[0].logprobs != got[0].logprobs
  finally:
    pool.stop()


def test_running_servers_start_answer_and_are_gone_after(served, tmp_path):
  """`server.running_servers` (benchmarks' local servers): a server of a real export
  answers /health and generates inside the block and is gone after it; one that cannot
  start (no checkpoint) is an error carrying its log."""
  from rstar_jax.rollout import api_server as rollout_server
  from rstar_jax.rollout.jax_engine import EngineConfig
  cfg = EngineConfig(num_slots=2, max_len=128, min_prefill_bucket=128)
  with rollout_server.running_servers(served["dirs"]["m1"], 1, cfg,
                                      log_dir=str(tmp_path / "logs")) as urls:
    (engine,) = se.connect(urls)
    try:
      out = asyncio.run(engine.generate(GenerationRequest(input_ids=[1, 2, 3], max_new_tokens=2,
                                                          temperature=0.0, request_id="r")))
    finally:
      engine.stop()
    assert len(out.output_ids) >= 1 and out.server == urls[0]
  with pytest.raises(urllib.error.URLError):
    urllib.request.urlopen(urls[0] + "/health", timeout=5)
  with pytest.raises(RuntimeError, match="exited"):
    with rollout_server.running_servers(str(tmp_path / "nothing"), 1, cfg,
                                        log_dir=str(tmp_path / "logs2")):
      pass
