"""The SGLang client on its own: `rollout/sglang/engine.py` and its parts (`wire.py`,
`transport.py`, `admin.py` beside it).

  * contract: the request bodies it builds validate against SGLang 0.5.23's schema read
    from the pip-downloaded wheel (see `conftest.SGLangSchema` for exactly what is
    checked); an unknown sampling key is rejected by that schema;
  * behaviour against tiny aiohttp fake servers on 127.0.0.1: malformed replies give a
    clear error and are never re-sent; connection drops are retried with backoff;
    a 400 is not retried; a model / vocabulary mismatch is refused at connect; a dead
    server leaves rotation and is probed back; /flush_cache is retried while 400; a
    weight update whose version /model_info does not confirm fails.
Replies of our real server and whole trajectories are in test_api_server.py.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time

from aiohttp import web
import pytest

from rstar_jax.rollout.sglang import engine as se, transport, wire
from rstar_jax.rollout.engine import GenerationRequest, RequestFailed
from rstar_jax.rollout.api_server import SAMPLING_FIELDS

from tests.rollout.conftest import free_port


# ---- contract of the bodies ---------------------------------------------------------
REQUESTS = [
    GenerationRequest(input_ids=[1, 2, 3], max_new_tokens=8, seed=5, request_id="r0"),
    GenerationRequest(input_ids=[7], max_new_tokens=1, stop_token_ids=(3, 4), temperature=0.0,
                      top_p=0.9, top_k=20, seed=0, request_id="u/turn3"),
    GenerationRequest(input_ids=list(range(100)), max_new_tokens=500, temperature=0.7,
                      top_p=1.0, top_k=0, seed=2 ** 31 - 2),
]


def test_our_sampling_fields_are_sglangs(sglang_schema):
  assert SAMPLING_FIELDS == sglang_schema.sampling_fields


@pytest.mark.parametrize("i", range(len(REQUESTS)))
def test_generate_body_validates_against_sglang(sglang_schema, i):
  req = REQUESTS[i]
  body = wire.generate_body(req, rid=f"rid-{i}")
  sglang_schema.check_generate_request(body)
  sp = body["sampling_params"]
  assert sp["top_k"] == (req.top_k if req.top_k > 0 else -1)   # SGLang rejects 0
  assert sp["sampling_seed"] == req.seed and sp["stop_token_ids"] == list(req.stop_token_ids)
  assert sp["no_stop_trim"] is True and sp["skip_special_tokens"] is False
  assert sp["spaces_between_special_tokens"] is False and body["stream"] is False
  decoded = sglang_schema.api.GenerateRequest.from_json_value(body)
  assert decoded.sampling_params.max_new_tokens == req.max_new_tokens


def test_schema_rejects_unknown_sampling_keys(sglang_schema):
  body = wire.generate_body(REQUESTS[0], rid="x")
  body["sampling_params"]["top_k_typo"] = 3
  with pytest.raises(sglang_schema.api.JsonContractError, match="unknown field `top_k_typo`"):
    sglang_schema.api.GenerateRequest.from_json_value(body)
  with pytest.raises(AssertionError, match="undeclared"):   # and top-level ones by our check
    sglang_schema.check_generate_request(dict(wire.generate_body(REQUESTS[0], rid="x"), seed=1))


def test_admin_bodies_validate_against_sglang(sglang_schema):
  sglang_schema.check_abort_request(wire.abort_body("some-rid"))
  for mode in wire.PAUSE_MODES:
    sglang_schema.check_pause_request(wire.pause_body(mode))
  assert set(wire.PAUSE_MODES) == sglang_schema.pause_modes
  sglang_schema.check_continue_request(wire.continue_body())
  sglang_schema.check_update_request(wire.update_weights_body("/ckpt/step_3", "3"))
  sglang_schema.check_update_request(wire.update_weights_body("/ckpt/step_3", "3",
                                                            abort_all_requests=True))
  with pytest.raises(ValueError, match="pause mode"):
    wire.pause_body("freeze")


# ---- a fake server -------------------------------------------------------------------
def good_reply(body, ids=(5, 6, 2), version="default"):
  return {"text": "", "output_ids": list(ids), "meta_info": {
      "id": body["rid"], "finish_reason": {"type": "stop", "matched": ids[-1]},
      "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(ids),
      "cached_tokens": 0, "weight_version": version,
      "output_token_logprobs": [[-0.5, t, None] for t in ids]}}


class FakeServer:
  """An aiohttp app on 127.0.0.1 in its own thread; `generate(body)` decides replies:
  a dict (JSON 200), (status, payload), or "drop" (connection closed, no reply)."""

  def __init__(self, generate=None, *, vocab_dir: str = "", port: int | None = None):
    self.port = port or free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.generate = generate or good_reply
    self.model_path = vocab_dir
    self.weight_version = "default"
    self.report_version = None
    self.healthy = True
    self.hang = set()   # routes that never answer
    self.server_info = {"max_context_length": 64, "max_total_num_tokens": 256}
    self.update_delay = 0.0
    self.stopping = False
    self.flush_answers: list[int] = []
    self.calls: list[tuple[str, object]] = []
    self.loop = asyncio.new_event_loop()
    self._started = threading.Event()
    self.thread = threading.Thread(target=self._run, daemon=True)
    self.thread.start()
    self._started.wait()

  def _run(self):
    asyncio.set_event_loop(self.loop)
    app = web.Application()
    app.router.add_post("/generate", self._generate)
    app.router.add_get("/health", self._health)
    app.router.add_get("/model_info", self._model_info)
    app.router.add_get("/server_info", self._server_info)
    app.router.add_get("/v1/loads", self._loads)
    app.router.add_post("/flush_cache", self._flush)
    for route in ("/pause_generation", "/continue_generation", "/abort_request"):
      app.router.add_post(route, self._ok)
    app.router.add_post("/update_weights_from_disk", self._update)
    self.runner = web.AppRunner(app)
    self.loop.run_until_complete(self.runner.setup())
    self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
    self._started.set()
    self.loop.run_forever()

  async def _health(self, request):
    self.calls.append(("/health", None))
    return web.Response(status=200 if self.healthy else 503)

  async def _server_info(self, request):
    self.calls.append(("/server_info", None))
    return web.json_response(self.server_info)

  async def _loads(self, request):
    self.calls.append(("/v1/loads", None))
    if "/v1/loads" in self.hang:
      await asyncio.sleep(1.5)   # past the client's limit in the test; short for cleanup
    return web.json_response({"loads": [{"num_total_tokens": 0, "max_total_num_tokens": 256}]})

  async def _generate(self, request):
    body = await request.json()
    self.calls.append(("/generate", body))
    if "/generate" in self.hang:   # silent until the test ends
      while not self.stopping:
        await asyncio.sleep(0.05)
    out = self.generate(body)
    if asyncio.iscoroutine(out):   # a reply that takes a while, others served meanwhile
      out = await out
    if out == "drop":
      request.transport.abort()
      await asyncio.sleep(0.05)
      return web.Response()
    if isinstance(out, tuple):
      status, payload = out
      if isinstance(payload, str):
        return web.Response(status=status, text=payload)
      if isinstance(payload, bytes):
        return web.Response(status=status, body=payload)
      return web.json_response(payload, status=status)
    return web.json_response(out)

  async def _model_info(self, request):
    self.calls.append(("/model_info", None))
    return web.json_response({"model_path": self.model_path, "is_generation": True,
                              "weight_version": self.report_version or self.weight_version,
                              "model_type": "qwen3"})

  async def _flush(self, request):
    self.calls.append(("/flush_cache", None))
    if "/flush_cache" in self.hang:
      await asyncio.sleep(1.5)   # past the client's limit in the test; short for cleanup
    status = self.flush_answers.pop(0) if self.flush_answers else 200
    return web.Response(status=status, text="flush")

  async def _ok(self, request):
    self.calls.append((request.path, await request.json()))
    return web.json_response({"message": "ok", "status": "ok"})

  async def _update(self, request):
    body = await request.json()
    self.calls.append(("/update_weights_from_disk", body))
    await asyncio.sleep(self.update_delay)
    self.model_path = body["model_path"]
    self.weight_version = body["weight_version"]
    return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})

  def generates(self) -> int:
    return sum(r == "/generate" for r, _ in self.calls)

  def stop(self):
    self.stopping = True

    async def down():
      await self.runner.cleanup()
    asyncio.run_coroutine_threadsafe(down(), self.loop).result()
    self.loop.call_soon_threadsafe(self.loop.stop)
    self.thread.join()


FAST = transport.ClientConfig(backoff_s=0.01, backoff_max_s=0.05, retries=2, probe_interval_s=0.05,
                       load_poll_s=0, startup_timeout_s=10, no_server_wait_s=0.3)


@pytest.fixture
def fakes():
  made = []
  def make(*args, **kwargs):
    made.append(FakeServer(*args, **kwargs))
    return made[-1]
  yield make
  for f in made:
    f.stop()


def run(coro):
  return asyncio.run(coro)


REQ = GenerationRequest(input_ids=[1, 2, 3], max_new_tokens=8, seed=1, request_id="q")


def test_good_reply_and_update_weights_is_not_in_memory(fakes):
  fake = fakes()
  [eng] = se.connect([fake.url], config=FAST)
  try:
    out = run(eng.generate(REQ))
    assert (out.output_ids, out.logprobs, out.finish_reason) == ([5, 6, 2], [-0.5] * 3, "stop")
    assert out.weight_version == "default" and out.server == fake.url
    assert eng.max_len == 64 and eng.free_kv_tokens() == 256 and eng.num_active() == 0
    with pytest.raises(NotImplementedError, match="update_weights_from_disk"):
      eng.update_weights({})
    with pytest.raises(ValueError, match="do not fit"):   # validated before any HTTP
      run(eng.generate(GenerationRequest(input_ids=list(range(64)), max_new_tokens=1)))
  finally:
    eng.stop()


MALFORMED = {
    "not json": (200, "<html>oops</html>"),
    "no meta_info": {"text": "", "output_ids": [1]},
    "no logprobs": lambda b: {"output_ids": [5], "meta_info": {
        "finish_reason": {"type": "stop", "matched": 5}}},
    "bad entry": lambda b: {"meta_info": {"finish_reason": {"type": "length", "length": 1},
                                          "output_token_logprobs": [[-0.1]]}},
    "ids differ": lambda b: dict(good_reply(b), output_ids=[5, 6, 7]),
    "unknown finish": lambda b: {"meta_info": {"finish_reason": {"type": "done"},
                                               "output_token_logprobs": []}},
    "positive logprob": lambda b: {"meta_info": {"finish_reason": {"type": "length"},
                                                 "output_token_logprobs": [[3.0, 5, None]]}},
    "-inf logprob": (200, b'{"meta_info": {"finish_reason": {"type": "length"}, '
                     b'"output_token_logprobs": [[-Infinity, 5, null]]}}'),
    "truncated prompt": lambda b: {**good_reply(b), "meta_info": {
        **good_reply(b)["meta_info"], "prompt_tokens": 2}},
    "outside vocab": lambda b: good_reply(b, ids=(5, 99999)),
    "output_ids not a list": lambda b: dict(good_reply(b), output_ids=5),
    "not utf-8": (200, b'{"text": "\xff\xfe"}'),
    "huge number": (200, b'{"meta_info": ' + b"1" * 5000 + b"}"),
    "bad weight spans": lambda b: {**good_reply(b), "meta_info": {
        **good_reply(b)["meta_info"], "weight_versions": [["v1", 0, 3]]}},
}
WHAT = {"not json": "not JSON", "no meta_info": "no meta_info", "no logprobs":
        "output_token_logprobs missing", "bad entry": r"output_token_logprobs\[0\]",
        "ids differ": "output_ids", "unknown finish": "finish_reason",
        "positive logprob": "not finite and <= 0", "-inf logprob": "-inf is not finite",
        "truncated prompt": "prompt_tokens=2 but 3 input ids", "outside vocab": "outside the vocabulary",
        "output_ids not a list": "output_ids must be a list", "not utf-8": "no meta_info",
        "huge number": "reply is not JSON",
        "bad weight spans": "weight_versions must be a list of"}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_reply_is_a_clear_error_and_never_resent(fakes, tmp_path, case):
  with open(tmp_path / "config.json", "w") as f:
    json.dump({"model_type": "qwen3", "vocab_size": 1000}, f)
  reply = MALFORMED[case]
  fake = fakes(reply if callable(reply) else (lambda b: reply), vocab_dir=str(tmp_path))
  [eng] = se.connect([fake.url], config=FAST)
  try:
    with pytest.raises(wire.MalformedReplyError, match=WHAT[case]) as info:
      run(eng.generate(REQ))
    assert fake.url in str(info.value)
    assert isinstance(info.value, RequestFailed)   # the agent loop fails that trajectory only
    assert fake.generates() == 1
    assert eng.alive   # a bad reply is not a dead server
  finally:
    eng.stop()


def test_a_turn_that_spans_a_weight_update_names_both_versions(fakes):
  """SGLang's weight_version is the last span's: a request paused across an update
  (retract / in_place) has tokens of both, which must not pass as on-policy."""
  spans = [{"version": "v1", "start": 0, "end": 2}, {"version": "v2", "start": 2, "end": 3}]
  fake = fakes(lambda b: {**good_reply(b, version="v2"), "meta_info": {
      **good_reply(b, version="v2")["meta_info"], "weight_versions": spans}})
  [eng] = se.connect([fake.url], config=FAST)
  try:
    assert run(eng.generate(REQ)).weight_version == "v1 -> v2"
    fake.generate = lambda b: {**good_reply(b, version="v2"), "meta_info": {
        **good_reply(b, version="v2")["meta_info"], "weight_versions": spans[1:]}}
    assert run(eng.generate(REQ)).weight_version == "v2"
  finally:
    eng.stop()


def test_exchanges_that_time_out_are_named_and_a_silent_server_leaves_rotation(fakes):
  """aiohttp's total limit raises asyncio.TimeoutError, which is no connection error: it
  escaped as a bare TimeoutError and ended the /v1/loads poller for good."""
  fake = fakes()
  cfg = dataclasses.replace(FAST, admin_timeout_s=0.3, poll_timeout_s=0.3, load_poll_s=0.05)
  [eng] = se.connect([fake.url], config=cfg)
  try:
    fake.hang.add("/flush_cache")
    with pytest.raises(transport.RequestTimedOut, match=r"/flush_cache: .*no reply within 0.3 s"):
      eng.flush_cache()
    # Not sent again: a call that timed out may still be running (a weight load).
    assert sum(r == "/flush_cache" for r, _ in fake.calls) == 1
    fake.healthy = False   # so that the probe keeps it out once the poller drops it
    fake.hang.add("/v1/loads")
    _until(lambda: not eng.alive)
    assert not eng.alive and "/v1/loads: " in eng.dead_reason \
        and "no reply within 0.3 s" in eng.dead_reason
    fake.healthy = True
    fake.hang.discard("/v1/loads")
    _until(lambda: eng.alive)                      # probed back; the poller lives on
    polls = sum(r == "/v1/loads" for r, _ in fake.calls)
    _until(lambda: sum(r == "/v1/loads" for r, _ in fake.calls) > polls)
  finally:
    eng.stop()


def test_refusal_is_not_retried(fakes):
  fake = fakes(lambda b: (400, {"error": {"message": "input too long"}}))
  [eng] = se.connect([fake.url], config=FAST)
  try:
    with pytest.raises(wire.ServerRequestError, match="input too long"):
      run(eng.generate(REQ))
    assert fake.generates() == 1
  finally:
    eng.stop()


def test_dropped_connection_is_retried_with_a_new_rid(fakes):
  seen = []
  def gen(body):
    seen.append(body["rid"])
    return "drop" if len(seen) < 3 else good_reply(body)
  fake = fakes(gen)
  [eng] = se.connect([fake.url], config=FAST)
  try:
    out = run(eng.generate(REQ))
    assert out.output_ids == [5, 6, 2] and len(seen) == 3 and len(set(seen)) == 3
    assert out.rid == seen[-1] and eng.metrics["retries"] == 2 and eng.alive
    # The dropped attempts were aborted on the server (it may still hold them).
    aborted = {b["rid"] for r, b in fake.calls if r == "/abort_request"}
    for _ in range(100):
      if aborted >= set(seen[:2]):
        break
      run(asyncio.sleep(0.02))
      aborted = {b["rid"] for r, b in fake.calls if r == "/abort_request"}
    assert aborted >= set(seen[:2])
  finally:
    eng.stop()


def test_dead_server_fails_over_leaves_rotation_and_is_probed_back(fakes):
  a = fakes()
  b = fakes()
  engines = se.connect([a.url, b.url], config=FAST)
  a.generate = lambda body: "drop"   # accepts connections, never answers
  a.healthy = False
  try:
    out = run(engines[0].generate(REQ))
    assert out.server == b.url and a.generates() == FAST.retries + 1
    assert not engines[0].alive and engines[0].free_kv_tokens() < -(1 << 30)
    assert engines[0].metrics["failovers"] == 1
    # Out of rotation: the next request goes straight to b.
    out = run(engines[0].generate(REQ))
    assert out.server == b.url and a.generates() == FAST.retries + 1
    a.generate = good_reply            # a recovers: the probe brings it back
    a.healthy = True
    for _ in range(200):
      if engines[0].alive:
        break
      run(asyncio.sleep(0.02))
    assert engines[0].alive and engines[0].metrics["probes"] >= 1
    assert run(engines[0].generate(REQ)).server == a.url
  finally:
    for e in engines:
      e.stop()


def test_all_servers_dead_is_a_clear_error(fakes):
  a = fakes(lambda b: "drop")
  [eng] = se.connect([a.url], config=FAST)
  try:
    with pytest.raises(se.NoServerAvailable, match="no server left for request q"):
      run(eng.generate(REQ))
  finally:
    eng.stop()


def test_model_mismatch_is_refused_at_connect(fakes, tmp_path):
  with open(tmp_path / "config.json", "w") as f:
    json.dump({"model_type": "qwen3", "vocab_size": 1000, "hidden_size": 64}, f)
  fake = fakes(vocab_dir=str(tmp_path))
  with pytest.raises(wire.ServerMismatchError, match=r"vocab_size=1000 \(trainer: 2048\)"):
    se.connect([fake.url], config=FAST, expected_model={"vocab_size": 2048, "hidden_size": 64})
  [eng] = se.connect([fake.url], config=FAST,
                     expected_model={"vocab_size": 1000, "model_type": "qwen3"})
  assert eng.vocab_size == 1000
  eng.stop()


def test_unreachable_server_at_connect(fakes):
  url = f"http://127.0.0.1:{free_port()}"
  with pytest.raises(wire.SGLangError, match="no healthy answer from /health"):
    se.connect([url], config=transport.ClientConfig(startup_timeout_s=0.3, backoff_s=0.05))


def test_flush_cache_retried_while_400(fakes):
  fake = fakes()
  fake.flush_answers = [400, 400]
  [eng] = se.connect([fake.url], config=FAST)
  try:
    eng.flush_cache()
    assert sum(r == "/flush_cache" for r, _ in fake.calls) == 3
    fake.flush_answers = [400] * 50
    with pytest.raises(wire.SGLangError, match="still refused"):
      eng.flush_cache()
  finally:
    eng.stop()


def test_weight_update_sequence_and_unconfirmed_version(fakes):
  fake = fakes()
  engines = se.connect([fake.url], config=FAST)
  try:
    secs = se.update_weights_from_disk(engines, "/ckpt/v7", "7")
    assert list(secs) == [fake.url]
    admin = [r for r, _ in fake.calls if r not in ("/health", "/server_info", "/v1/loads")]
    assert admin[-4:] == ["/pause_generation", "/update_weights_from_disk",
                          "/continue_generation", "/model_info"]
    assert engines[0].weight_version == "7"
    fake.report_version = "6"          # the server claims success but keeps old weights
    with pytest.raises(wire.SGLangError, match="reports weight_version '6' after updating to '8'"):
      se.update_weights_from_disk(engines, "/ckpt/v8", "8")
  finally:
    for e in engines:
      e.stop()


def test_real_sglang_server_info_gives_the_length_limit(fakes):
  """SGLang 0.5.23's /server_info (Python frontend) has no max_context_length: the
  server flags (context_length often null) and the scheduler's max_req_input_len, which
  inputs must stay below. Requiring max_context_length refused every real server."""
  fake = fakes()
  fake.server_info = {"context_length": None, "max_total_num_tokens": 256, "status": "ready",
                      "max_req_input_len": 59, "version": "0.5.23", "frontend": "python"}
  [eng] = se.connect([fake.url], config=FAST)
  try:
    assert eng.max_len == 59
    with pytest.raises(ValueError, match="do not fit"):
      run(eng.generate(GenerationRequest(input_ids=list(range(59)), max_new_tokens=1)))
  finally:
    eng.stop()
  fake.server_info = {"context_length": None, "max_total_num_tokens": 256}
  with pytest.raises(wire.MalformedReplyError, match="max_req_input_len .SGLang. or "
                                                   "max_context_length.*neither"):
    se.connect([fake.url], config=FAST)


def test_reproducible_rollouts_require_sglangs_deterministic_inference(fakes, sglang_schema):
  """rollout.client.require_deterministic: a server must report SGLang's
  `enable_deterministic_inference` server arg as true in /server_info, or it is refused.
  The key is SGLang's own (read from its source): a flat ServerArgs field, and
  /server_info is the resolved ServerArgs."""
  assert wire.DETERMINISTIC_KEY in sglang_schema.deterministic_fields
  assert "ExecDeterministic" in sglang_schema.server_args_namespaces
  assert "resolved_dict" in sglang_schema.server_info_calls
  strict = dataclasses.replace(FAST, require_deterministic=True)
  fake = fakes()
  base = {"context_length": None, "max_total_num_tokens": 256, "max_req_input_len": 59,
          "version": "0.5.23", "frontend": "python"}
  for info in (base, dict(base, enable_deterministic_inference=False)):
    fake.server_info = info
    with pytest.raises(wire.ServerMismatchError, match="--enable-deterministic-inference"):
      se.connect([fake.url], config=strict)
    [eng] = se.connect([fake.url], config=FAST)     # not asked for: any server will do
    eng.stop()
  fake.server_info = dict(base, enable_deterministic_inference=True)
  [eng] = se.connect([fake.url], config=strict)
  try:
    out = run(eng.generate(REQUESTS[0]))
    assert out.output_ids == [5, 6, 2]
    body = next(b for r, b in fake.calls if r == "/generate")
    assert body["sampling_params"]["sampling_seed"] == REQUESTS[0].seed
  finally:
    eng.stop()


def test_a_silent_server_hands_its_requests_to_another(fakes):
  """A server that stops answering (a hung host) leaves rotation when /v1/loads times
  out; its requests in flight, which got no reply, go to another server. Before, they
  waited for the silent server forever (request_timeout_s is None: generations are long)."""
  a, b = fakes(), fakes()
  a.hang = {"/generate", "/v1/loads"}
  cfg = dataclasses.replace(FAST, load_poll_s=0.05, poll_timeout_s=0.3, probe_interval_s=5.0)
  ea, eb = se.connect([a.url, b.url], config=cfg)
  try:
    async def go():
      return await asyncio.wait_for(ea.generate(REQ), 20)
    out = run(go())
    assert out.server == b.url and not ea.alive and "/v1/loads" in ea.dead_reason
    assert a.generates() == 1 and b.generates() == 1
    assert ea.metrics["failovers"] == 1
  finally:
    ea.stop()
    eb.stop()


def test_requests_wait_for_a_server_back_in_rotation(fakes):
  """Every server out for a moment (one server restarting): a request waits up to
  no_server_wait_s for a probe to bring one back. Before, NoServerAvailable (which is
  not a per-trajectory failure) failed the whole batch at once."""
  a = fakes(lambda b: "drop")
  cfg = dataclasses.replace(FAST, no_server_wait_s=30.0)
  [eng] = se.connect([a.url], config=cfg)
  a.healthy = False

  def back():
    time.sleep(0.5)
    a.generate = good_reply
    a.healthy = True
  threading.Thread(target=back, daemon=True).start()
  try:
    out = run(eng.generate(REQ))
    assert out.output_ids == [5, 6, 2] and eng.alive and a.generates() >= 2
  finally:
    eng.stop()


def test_a_returning_server_catches_up_to_the_latest_weights(fakes):
  """The trainer publishes again while a returning server is still loading the version
  it missed (the trainer skips servers out of rotation): it loads the newer one too
  before it rejoins. Before, it rejoined serving the older version."""
  a, b = fakes(), fakes()
  ea, eb = se.connect([a.url, b.url], config=dataclasses.replace(FAST, probe_interval_s=0.1))
  try:
    b.healthy = False
    eb.group.io.call(_dead(eb), 10)
    se.update_weights_from_disk([ea, eb], "/ckpt/v1", "v1")      # a only
    b.update_delay = 1.0
    b.healthy = True                                             # catching up to v1...
    _until(lambda: any(r == "/update_weights_from_disk" for r, _ in b.calls))
    se.update_weights_from_disk([ea, eb], "/ckpt/v2", "v2")      # ...when v2 comes
    _until(lambda: eb.alive)
    assert eb.weight_version == "v2" and b.weight_version == "v2"
    assert [body["weight_version"] for r, body in b.calls
            if r == "/update_weights_from_disk"] == ["v1", "v2"]
  finally:
    ea.stop()
    eb.stop()


def _until(pred):
  """Polls until pred() holds. No deadline: how long a loaded host takes is no failure;
  a hang is (pytest-timeout ends it with every thread's stack)."""
  while not pred():
    time.sleep(0.02)


async def _dead(engine):
  engine._mark_dead("test: the server went away")


def test_an_abort_during_a_weight_update_is_sent_again_after_it(fakes):
  """SGLang drops an abort for a request held at its pause gate, and that request then
  runs to the end: a request cancelled while a weight update paused the server is
  aborted again once generation continues."""
  fake = fakes()
  fake.update_delay = 0.5
  [eng] = se.connect([fake.url], config=FAST)
  try:
    eng._paused += 1             # as between _sync_from_disk's pause and continue
    eng.group.io.call(eng._abort_quietly("r-1"), 10)
    eng._paused -= 1
    se.update_weights_from_disk([eng], "/ckpt/v1", "v1")
    _until(lambda: sum(r == "/abort_request" for r, _ in fake.calls) >= 2)
    routes = [r for r, _ in fake.calls]
    last_abort = max(i for i, r in enumerate(routes) if r == "/abort_request")
    assert routes.index("/continue_generation") < last_abort
    # Once only: the re-sent abort is not queued again for the next update.
    se.update_weights_from_disk([eng], "/ckpt/v2", "v2")
    time.sleep(0.2)
    assert [b for r, b in fake.calls if r == "/abort_request"] == [{"rid": "r-1"}] * 2
    assert not eng._abort_after_pause
  finally:
    eng.stop()


def test_in_place_pauses_are_refused_for_weight_updates():
  with pytest.raises(ValueError, match="in_place cannot be followed by a weight update"):
    transport.ClientConfig(pause_mode="in_place")


def test_one_failing_request_leaves_the_servers_other_requests_running(fakes):
  """A request whose connection keeps dropping takes its server out of rotation, but the
  server's other requests, still running fine, are not cut off and re-sent (minutes of
  GPU work each at 14B); only a server silent as a whole (/v1/loads) loses them."""
  async def long(body):
    await asyncio.sleep(1.0)
    return good_reply(body)

  def on_a(body):
    return "drop" if body["rid"].startswith("bad") else long(body)
  a, b = fakes(on_a), fakes()
  ea, eb = se.connect([a.url, b.url], config=dataclasses.replace(FAST, probe_interval_s=5.0))
  try:
    async def go():
      longs = [asyncio.ensure_future(ea.generate(GenerationRequest(
          input_ids=[1, 2, 3], max_new_tokens=8, seed=i, request_id=f"long{i}")))
          for i in range(3)]
      await asyncio.sleep(0.1)
      bad = await ea.generate(GenerationRequest(input_ids=[1, 2, 3], max_new_tokens=8,
                                                request_id="bad"))
      return bad, await asyncio.gather(*longs)
    bad, longs = run(go())
    assert bad.server == b.url and not ea.alive
    assert [o.server for o in longs] == [a.url] * 3
    assert sum(body["rid"].startswith("long") for r, body in a.calls if r == "/generate") == 3
  finally:
    ea.stop()
    eb.stop()


def test_a_server_moved_through_the_fleet_file_rejoins_at_its_new_url_with_the_latest_weights(
    fakes, tmp_path):
  """`rollout.servers_file`: server b's node is lost while a request runs on it, and the
  supervisor re-creates it at a new URL (c, started from the initial checkpoint) and
  rewrites the fleet file. The pool's engine for b follows: the request in flight goes
  to another server, and b's engine finds the server at c, catches it up to the version published
  before the move, and serves from there, all without a new pool (no trainer restart)."""
  from rstar_jax.rollout import backends
  from rstar_jax.rollout.fleet_file import write_fleet
  a, b, c = fakes(), fakes(), fakes()
  fleet = str(tmp_path / "fleet.json")
  write_fleet(fleet, {"rollout": [a.url, b.url]}, 0)
  pool = backends.build_engine_pool(backends.RolloutConfig(
      backend="sglang", servers=(a.url, b.url), servers_file=fleet, client=FAST))
  ea, eb = pool.engines
  try:
    se.update_weights_from_disk(pool.engines, "/ckpt/v1", "v1")
    assert a.weight_version == b.weight_version == "v1" and c.weight_version == "default"
    b.hang = {"/generate"}            # b's node is about to vanish with this request
    box = {}
    worker = threading.Thread(target=lambda: box.setdefault("out", run(eb.generate(REQ))))
    worker.start()
    _until(lambda: b.generates() == 1)
    write_fleet(fleet, {"rollout": [a.url, c.url]}, 1)
    worker.join()
    assert box["out"].server in (a.url, c.url)   # a, or c once back in rotation
    _until(lambda: eb.alive and eb.url == c.url)
    assert c.weight_version == "v1" and c.model_path == "/ckpt/v1"
    # c served nothing before it held the published weights.
    routes = [r for r, _ in c.calls]
    assert "/generate" not in routes[:routes.index("/update_weights_from_disk")]
    assert pool.watcher.moves == 1 and ea.url == a.url and eb.name.endswith(b.url[7:])
    b.healthy = False
    out = run(eb.generate(REQ))
    assert out.server == c.url and b.generates() == 1
    # A file that changes the number of servers is refused: the URLs stay.
    write_fleet(fleet, {"rollout": [a.url]}, 2)
    assert not pool.watcher.check() and [e.url for e in pool.engines] == [a.url, c.url]
  finally:
    pool.stop()
  assert not pool.watcher._thread.is_alive()
