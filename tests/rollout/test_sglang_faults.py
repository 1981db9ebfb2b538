"""What the SGLang client may repeat or let a server change, against SGLang 0.5.23's own
code: its SamplingParams class (run from the wheel the contract tests download) for the
--preferred-sampling-params rule, and fake servers for the 5xx re-send rule."""
import sys
import types
import zipfile

from aiohttp import web
import pytest

from rstar_jax.rollout.sglang import engine as se
from rstar_jax.rollout.sglang import wire
from rstar_jax.rollout.engine import GenerationRequest
from tests.rollout import conftest
from tests.rollout.test_sglang_engine import FAST, REQ, FakeServer, good_reply, run


@pytest.fixture(scope="module")
def sglang_sampling_params(tmp_path_factory):
  """sglang.srt.sampling.sampling_params.SamplingParams as SGLang 0.5.23 ships it. Its
  module imports torch only for watermarking (a stub here: a watermark is not a key the
  rule lets through), so the class itself, defaults and __post_init__, is SGLang's."""
  pytest.importorskip("msgspec")
  wheel = conftest._wheel()
  with zipfile.ZipFile(wheel) as z:
    src = z.read("sglang/srt/sampling/sampling_params.py").decode()
  stub = types.ModuleType("sglang.srt.sampling.watermarking.core")
  stub.WatermarkRequestConfig = dict
  stub.normalize_watermark_request = lambda w: w
  saved = {k: sys.modules.get(k) for k in ("sglang.srt.sampling.watermarking.core",)}
  sys.modules["sglang.srt.sampling.watermarking.core"] = stub
  try:
    mod = types.ModuleType("sglang_sampling_params")
    exec(compile(src, "sglang/srt/sampling/sampling_params.py", "exec"), mod.__dict__)
  finally:
    for k, v in saved.items():
      if v is None:
        sys.modules.pop(k, None)
      else:
        sys.modules[k] = v
  return mod.SamplingParams


def _served(sp_cls, preferred, request):
  """The SamplingParams SGLang builds for `request` under `preferred`
  (tokenizer_manager: `{**preferred, **request}`)."""
  return sp_cls(**({**preferred, **request} if preferred else dict(request)))


def test_the_defaults_table_is_sglangs(sglang_sampling_params):
  sent = wire.generate_body(REQ, "r")["sampling_params"]
  fields = dict(zip(sglang_sampling_params.__struct_fields__,
                    sglang_sampling_params.__struct_defaults__))
  for key, value in wire.SGLANG_SAMPLING_DEFAULTS.items():
    assert fields[key] == value, key
  # Every API key of SGLang's class is either sent or in the table (the internal ones
  # that normalize() fills are not accepted from requests).
  internal = {"stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len",
              "is_normalized", "ebnf_full_assistant"}
  assert set(fields) - internal == set(sent) | set(wire.SGLANG_SAMPLING_DEFAULTS)


PREFERRED = [
    {},
    {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 4},  # all sent: ours win
    {"min_p": 0.0, "n": 1, "repetition_penalty": 1.0},                       # SGLang's defaults
    {"skip_special_tokens": True, "no_stop_trim": False},                   # sent: ours win
    {"min_p": 0.05},
    {"repetition_penalty": 1.1},
    {"presence_penalty": 0.5, "temperature": 0.7},
    {"frequency_penalty": 0.2},
    {"min_new_tokens": 3},
    {"ignore_eos": True},
    {"stop": ["\n\n"]},
    {"logit_bias": {"5": -100.0}},
    {"regex": "[0-9]+"},
]


@pytest.mark.parametrize("preferred", PREFERRED, ids=[str(p) for p in PREFERRED])
def test_preferred_sampling_params_are_refused_exactly_when_they_change_sampling(
    sglang_sampling_params, preferred):
  request = wire.generate_body(GenerationRequest(input_ids=[1], max_new_tokens=8, temperature=1.0,
                                               top_p=1.0, top_k=0, seed=3), "r")["sampling_params"]
  changes = _served(sglang_sampling_params, preferred, request) != _served(
      sglang_sampling_params, {}, request)
  assert bool(wire.preferred_sampling_changes(preferred)) == changes, (preferred, changes)
  assert bool(wire.preferred_sampling_changes(__import__("json").dumps(preferred))) == changes


class _PreferringServer(FakeServer):
  preferred = None

  async def _model_info(self, request):
    return web.json_response({"model_path": self.model_path, "is_generation": True,
                              "weight_version": self.weight_version, "model_type": "qwen3",
                              "preferred_sampling_params": self.preferred})


def test_a_server_with_changing_preferred_params_is_refused_at_connect():
  srv = _PreferringServer()
  try:
    srv.preferred = {"temperature": 0.6}          # overridden by every request: accepted
    [eng] = se.connect([srv.url], config=FAST)
    eng.stop()
    srv.preferred = {"repetition_penalty": 1.05}
    with pytest.raises(wire.ServerMismatchError, match=r"repetition_penalty.*1\.05"):
      se.connect([srv.url], config=FAST)
  finally:
    srv.stop()


def test_a_503_abort_is_resent_and_other_5xx_are_aborted_there_first():
  """SGLang's 503 (a request its scheduler aborted and released, {"detail": ...}) proves
  the server holds nothing: re-sent at once. A 502/504, or a 503 in another shape, may
  leave the request running there: /abort_request for that rid goes before the re-send."""
  for first, aborted_first in (((503, {"detail": "Request waiting timeout reached."}), False),
                               ((502, "Bad Gateway"), True),
                               ((503, "Service Unavailable"), True),
                               ((504, "Gateway Timeout"), True)):
    seen = []

    def gen(body, first=first):
      seen.append(body["rid"])
      return first if len(seen) == 1 else good_reply(body)
    srv = FakeServer(gen)
    try:
      [eng] = se.connect([srv.url], config=FAST)
      try:
        out = run(eng.generate(REQ))
      finally:
        eng.stop()
      assert out.output_ids == [5, 6, 2] and len(seen) == 2 and out.rid == seen[1]
      order = [(r, b["rid"]) for r, b in srv.calls if r in ("/generate", "/abort_request")]
      if aborted_first:
        assert order[:3] == [("/generate", seen[0]), ("/abort_request", seen[0]),
                             ("/generate", seen[1])], (first, order)
      else:
        assert order == [("/generate", seen[0]), ("/generate", seen[1])], (first, order)
    finally:
      srv.stop()
