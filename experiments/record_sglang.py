r"""python -m experiments.record_sglang --url http://127.0.0.1:30000 --out /tmp/sglang_0.5.23_qwen3.jsonl

Records real request/response pairs of an SGLang server (run it on the GPU host next to
a server launched as docs/guides/rollout_servers_and_sglang.md says), through our own client
(`rstar_jax.rollout.sglang.engine`), one JSON line per HTTP exchange:
{"route", "request", "status", "reply"}. Commit the file under
tests/rollout/recordings/ and `tests/rollout/test_sglang_recordings.py` replays it on
every CI run: each request body and reply is checked against SGLang 0.5.23's own API
schema and each /generate reply is parsed by the client as in training.

What it exercises: /health, /model_info, /server_info, /v1/loads, /generate (sampled with
a seed, greedy, stop ids, top-k, a one-token budget), an abort of a running request,
pause -> continue, /flush_cache and, with --model_path (the directory the server
serves, or another checkpoint of the same architecture), /update_weights_from_disk with
a weight version. Token ids are taken below the server's vocabulary size.
Works against our own server too (`python -m rstar_jax.rollout.api_server`), which is how
the test checks this script.
"""
import asyncio
import json
import os
import sys

from absl import app
from absl import flags

_URL = flags.DEFINE_string("url", None, "base URL of the SGLang server")
_OUT = flags.DEFINE_string("out", None, "JSONL file to write")
_MODEL_PATH = flags.DEFINE_string("model_path", "", "a checkpoint directory the server can read: "
                                  "also record /update_weights_from_disk (empty: skip)")
_VERSION = flags.DEFINE_string("weight_version", "recorded-1", "version given with the update")
_NEW = flags.DEFINE_integer("max_new_tokens", 16, "tokens per generate request")


def main(argv):
  if len(argv) > 1:
    sys.exit(f"unexpected arguments {argv[1:]}")
  if not _URL.value or not _OUT.value:
    sys.exit("--url and --out are required\nusage: " + __doc__.strip().splitlines()[0])
  from rstar_jax.rollout.sglang import engine as se, transport, wire
  from rstar_jax.rollout.engine import GenerationRequest

  exchanges = []

  def record(route, body, status, reply):
    exchanges.append({"route": route, "request": body, "status": status, "reply": reply})

  cfg = transport.ClientConfig(load_poll_s=0.0, retries=1)
  [eng] = se.connect([_URL.value], config=cfg, on_exchange=record)
  try:
    info = eng.get_model_info()
    vocab = int(eng.vocab_size or 1000)
    ids = lambda *xs: [x % vocab for x in xs]
    eng.get_loads()
    eng.health()
    reqs = [
        GenerationRequest(input_ids=ids(100, 200, 300, 400), max_new_tokens=_NEW.value,
                          temperature=1.0, seed=1, request_id="rec-sampled"),
        GenerationRequest(input_ids=ids(100, 200, 300, 400), max_new_tokens=_NEW.value,
                          temperature=0.0, seed=2, request_id="rec-greedy"),
        GenerationRequest(input_ids=ids(7, 8, 9), max_new_tokens=_NEW.value, temperature=1.0,
                          top_k=5, top_p=0.9, seed=3, stop_token_ids=tuple(ids(11, 12, 13)),
                          request_id="rec-stop-topk"),
        GenerationRequest(input_ids=ids(5), max_new_tokens=1, temperature=1.0, seed=4,
                          request_id="rec-one-token"),
    ]

    async def generate_all():
      return await asyncio.gather(*(eng.generate(r) for r in reqs))
    results = asyncio.run(generate_all())

    async def abort_one():
      # Generation is paused first, so that the request is surely still in flight when
      # the abort comes (a small model would finish it within any fixed delay).
      await asyncio.to_thread(eng.pause_generation)
      long = GenerationRequest(input_ids=ids(1, 2, 3), max_new_tokens=512, temperature=1.0,
                               seed=5, request_id="rec-aborted")
      task = asyncio.ensure_future(eng.generate(long))
      await asyncio.sleep(0.3)
      aborted = await eng.abort(long.request_id)
      await asyncio.to_thread(eng.continue_generation)
      try:
        await task
      except wire.SGLangError as e:   # the abort ends it (a partial result or an error)
        return aborted, str(e)[:200]
      return aborted, "completed before the abort"
    abort_outcome = asyncio.run(abort_one())
    eng.flush_cache()
    if _MODEL_PATH.value:
      se.update_weights_from_disk([eng], os.path.abspath(_MODEL_PATH.value), _VERSION.value)
  finally:
    eng.stop()
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, "w") as f:
    for x in exchanges:
      f.write(json.dumps(x) + "\n")
  print(f"model: {info.get('model_path')} (weight_version {info.get('weight_version')})")
  for r in results:
    print(f"  {r.request_id}: {len(r.output_ids)} tokens, finish {r.finish_reason}, "
          f"version {r.weight_version}")
  print(f"  abort: {abort_outcome}")
  print(f"{len(exchanges)} exchanges written to {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
