"""Shared fixtures of the HTTP rollout tests: SGLang 0.5.23's own API schema, read from
its wheel, and real rollout-server processes on loopback.

What the schema check is (`SGLangSchema`):
  * `pip download --no-deps sglang==0.5.23` (cached in $RSTAR_SGLANG_WHEEL_DIR or
    ~/.cache/rstar_jax/wheels); nothing of SGLang is vendored here.
  * `sglang/api/v1/api_types.py` is imported from the wheel: it is SGLang's generated
    JSON contract (msgspec Structs + `decode_*` functions, the same judgment the
    server's `/generate` gate applies, "api_contract.generate_contract_error"). It needs
    only msgspec. Request bodies go through `GenerateRequest.from_json_value`,
    `AbortRequest...`; replies through `GenerateResponse`, `GetModelInfoResponse`,
    `GetServerInfoResponse`. These decoders reject unknown *sampling* keys (the
    server's 400) but ignore unknown top-level keys, so in addition every key we send
    or answer must be a declared field.
  * The modules that import torch / zmq (`managers/io_struct.py`,
    `entrypoints/http_server.py`, `entrypoints/v1_loads.py`, `managers/load_snapshot.py`)
    are not imported but parsed with `ast`: the field names of `GenerateReqInput`
    (the dataclass FastAPI parses /generate into), `UpdateWeightFromDiskReqInput`,
    `PauseGenerationReqInput` (and its `mode` Literal values),
    `ContinueGenerationReqInput`, `AbortReq` (+ `BaseReq`'s), `LoadSnapshot`, and the
    string keys of the dict literals the route functions answer with (`model_info`,
    `update_weights_from_disk`, `pause_generation`, `continue_generation`,
    `get_loads`). Admin bodies and replies must use only those names, with the types
    the annotations say for the fields we use.
"""
from __future__ import annotations

import ast
import glob
import importlib.util
import os
import subprocess
import sys
import time
import urllib.request
import zipfile
from typing import Any

import pytest

from sandbox.launcher import free_port  # noqa: F401  (test_sglang_engine imports it from here)

from rstar_jax.rollout.sglang.wire import SGLANG_VERSION  # the one pin
from tests import procs
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_WANTED = ("sglang/api/v1/api_types.py", "sglang/srt/managers/io_struct.py",
           "sglang/srt/entrypoints/http_server.py", "sglang/srt/entrypoints/v1_loads.py",
           "sglang/srt/managers/load_snapshot.py", "sglang/srt/arg_groups/fields/exec_.py",
           "sglang/srt/server_args.py", "sglang/srt/utils/common.py")


# ---- SGLang's schema ------------------------------------------------------------------
def _wheel() -> str:
  cache = os.environ.get("RSTAR_SGLANG_WHEEL_DIR",
                         os.path.expanduser("~/.cache/rstar_jax/wheels"))
  found = glob.glob(os.path.join(cache, f"sglang-{SGLANG_VERSION}-*.whl"))
  if found:
    return found[0]
  os.makedirs(cache, exist_ok=True)
  r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                      f"sglang=={SGLANG_VERSION}", "-d", cache],
                     capture_output=True, text=True, timeout=600)
  found = glob.glob(os.path.join(cache, f"sglang-{SGLANG_VERSION}-*.whl"))
  if r.returncode != 0 or not found:
    _skip_or_fail(f"cannot download the sglang=={SGLANG_VERSION} wheel with pip (no network?): "
                  f"{(r.stderr or r.stdout).strip()[-300:]}")
  return found[0]


def _skip_or_fail(why: str) -> None:
  """A missing schema source skips the contract tests on a developer's machine; in CI
  (CI=true) it fails them: CI must not go green without checking the contract."""
  if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
    pytest.fail(f"CI=true: {why}", pytrace=False)
  pytest.skip(why)


def _class_fields(tree: ast.Module, name: str) -> dict[str, ast.expr]:
  for node in ast.walk(tree):
    if isinstance(node, ast.ClassDef) and node.name == name:
      return {n.target.id: n.annotation for n in node.body
              if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
  raise AssertionError(f"class {name} not found in the sglang source")


def _dict_keys(tree: ast.Module, function: str) -> set[str]:
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
      return {k.value for d in ast.walk(node) if isinstance(d, ast.Dict)
              for k in d.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
  raise AssertionError(f"function {function} not found in the sglang source")


class SGLangSchema:
  def __init__(self, root: str):
    path = os.path.join(root, "sglang/api/v1/api_types.py")
    spec = importlib.util.spec_from_file_location("sglang_api_v1_types", path)
    self.api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(self.api)
    read = lambda rel: ast.parse(open(os.path.join(root, rel)).read())
    io_struct = read("sglang/srt/managers/io_struct.py")
    http = read("sglang/srt/entrypoints/http_server.py")
    base = set(_class_fields(io_struct, "BaseReq"))
    self.generate_req_input = set(_class_fields(io_struct, "GenerateReqInput"))
    self.update_fields = _class_fields(io_struct, "UpdateWeightFromDiskReqInput")
    self.update_keys = set(self.update_fields) | base
    pause = _class_fields(io_struct, "PauseGenerationReqInput")
    self.pause_keys = set(pause) | base
    self.pause_modes = {e.value for e in ast.walk(pause["mode"]) if isinstance(e, ast.Constant)}
    self.continue_keys = set(_class_fields(io_struct, "ContinueGenerationReqInput")) | base
    self.abort_keys = set(_class_fields(io_struct, "AbortReq")) | base
    self.model_info_keys = _dict_keys(http, "model_info")
    self.update_reply_keys = _dict_keys(http, "update_weights_from_disk")
    self.pause_reply_keys = _dict_keys(http, "pause_generation")
    self.continue_reply_keys = _dict_keys(http, "continue_generation")
    self.loads_keys = _dict_keys(read("sglang/srt/entrypoints/v1_loads.py"), "get_loads")
    self.load_snapshot_keys = set(_class_fields(read("sglang/srt/managers/load_snapshot.py"),
                                                "LoadSnapshot"))
    self.sampling_fields = tuple(self.api.SamplingParams.__struct_fields__)
    # Deterministic inference: a field of the `exec.deterministic` namespace, one of the
    # namespaces ServerArgs is assembled from (flat fields), and /server_info is built
    # from the resolved ServerArgs (`build_server_info` -> `resolved_dict`).
    self.deterministic_fields = set(_class_fields(
        read("sglang/srt/arg_groups/fields/exec_.py"), "ExecDeterministic"))
    self.server_args_namespaces = {
        elt.id for node in ast.walk(read("sglang/srt/server_args.py"))
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES" for t in node.targets)
        for elt in node.value.elts if isinstance(elt, ast.Name)}
    self.server_info_calls = {
        n.func.attr for f in ast.walk(read("sglang/srt/utils/common.py"))
        if isinstance(f, ast.FunctionDef) and f.name == "build_server_info"
        for n in ast.walk(f) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}

  # -- requests --
  def check_generate_request(self, body: dict) -> None:
    self.api.GenerateRequest.from_json_value(body)      # raises JsonContractError
    declared = set(self.api.GenerateRequest.__struct_fields__) & self.generate_req_input
    assert set(body) <= declared, f"undeclared /generate keys {set(body) - declared}"
    assert isinstance(body["input_ids"], list) and body["return_logprob"] is True

  def check_abort_request(self, body: dict) -> None:
    self.api.AbortRequest.from_json_value(body)
    assert set(body) <= self.abort_keys, set(body) - self.abort_keys
    assert isinstance(body.get("rid", ""), str)

  def check_update_request(self, body: dict) -> None:
    assert set(body) <= self.update_keys, set(body) - self.update_keys
    assert isinstance(body["model_path"], str) and isinstance(body["weight_version"], str)
    assert all(isinstance(body[k], bool) for k in body
               if ast.unparse(self.update_fields.get(k, ast.Constant(""))) == "bool")

  def check_pause_request(self, body: dict) -> None:
    assert set(body) <= self.pause_keys and body.get("mode", "abort") in self.pause_modes, body

  def check_continue_request(self, body: dict) -> None:
    assert set(body) <= self.continue_keys, body

  # -- replies --
  def check_generate_reply(self, reply: dict, *, logprobs: bool = True) -> None:
    api = self.api
    decoded = api.GenerateResponse.from_json_value(reply)
    assert set(reply) <= set(api.GenerateResponse.__struct_fields__), set(reply)
    meta = reply["meta_info"]
    assert set(meta) <= set(api.GenerateMetaInfo.__struct_fields__), (
        set(meta) - set(api.GenerateMetaInfo.__struct_fields__))
    assert isinstance(decoded.meta_info.finish_reason,
                      (api.FinishStop, api.FinishLength, api.FinishAbort)), meta["finish_reason"]
    if logprobs:
      entries = decoded.meta_info.output_token_logprobs
      assert entries is not None and all(isinstance(e, api.LogprobEntry) for e in entries)
      assert [e.token_id for e in entries] == decoded.output_ids

  def check_model_info(self, reply: dict) -> None:
    self.api.GetModelInfoResponse.from_json_value(reply)
    assert set(reply) <= self.model_info_keys, set(reply) - self.model_info_keys

  def check_server_info(self, reply: dict) -> None:
    info = self.api.GetServerInfoResponse.from_json_value(reply)
    assert info.max_context_length > 1 and info.max_total_num_tokens > 0

  def check_loads(self, reply: dict) -> None:
    assert set(reply) <= self.loads_keys, set(reply) - self.loads_keys
    for load in reply["loads"]:
      assert set(load) <= self.load_snapshot_keys, set(load) - self.load_snapshot_keys

  def check_exchange(self, route: str, body: Any, status: int, reply: Any) -> None:
    """One recorded client <-> server exchange (`SGLangEngine(on_exchange=...)`)."""
    checks = {
        "/generate": (self.check_generate_request, self.check_generate_reply),
        "/abort_request": (self.check_abort_request, None),
        "/update_weights_from_disk": (
            self.check_update_request,
            lambda r: set(r) == self.update_reply_keys or pytest.fail(f"update reply {r}")),
        "/pause_generation": (
            self.check_pause_request,
            lambda r: set(r) <= self.pause_reply_keys or pytest.fail(f"pause reply {r}")),
        "/continue_generation": (
            self.check_continue_request,
            lambda r: set(r) <= self.continue_reply_keys or pytest.fail(f"continue reply {r}")),
        "/model_info": (None, self.check_model_info),
        "/server_info": (None, self.check_server_info),
        "/v1/loads": (None, self.check_loads),
        "/health": (None, None), "/flush_cache": (None, None),
    }
    assert route in checks, f"the client called a route outside the pinned subset: {route}"
    check_body, check_reply = checks[route]
    if check_body is not None:
      check_body(body)
    else:
      assert body is None, (route, body)
    if check_reply is not None and status == 200:
      check_reply(reply)


@pytest.fixture(scope="session")
def sglang_schema(tmp_path_factory) -> SGLangSchema:
  try:
    import msgspec  # noqa: F401  (sglang's api_types need it; requirements-dev pins it)
  except ImportError:
    _skip_or_fail("msgspec is not installed (pip install -r requirements-dev.txt): SGLang's "
                  "api_types module needs it")
  root = str(tmp_path_factory.mktemp("sglang_src"))
  with zipfile.ZipFile(_wheel()) as z:
    for name in _WANTED:
      z.extract(name, root)
  return SGLangSchema(root)


# ---- Real rollout servers ---------------------------------------------------------------
SERVER_SLOTS, SERVER_MAX_LEN, SERVER_BUCKET = 4, 256, 256


class ServerProcess:
  """`python -m rstar_jax.rollout.api_server` on 127.0.0.1, started without waiting."""

  def __init__(self, hf_dir: str, log_dir: str, name: str, *, num_slots: int = SERVER_SLOTS,
               max_len: int = SERVER_MAX_LEN, bucket: int = SERVER_BUCKET,
               one_device: bool = False, extra_args: tuple[str, ...] = ()):
    self.port = free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.log_path = os.path.join(log_dir, f"server_{name}.log")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               RSTAR_COMPILE_CACHE=os.environ.get(
                   "RSTAR_COMPILE_CACHE", os.path.join("/tmp", "rstar_jax_test_compile_cache")))
    if one_device:
      # as the recipe's own process runs in tests/test_recipe.py
      env = procs.cpu_env(**{k: env[k] for k in ("PYTHONPATH", "RSTAR_COMPILE_CACHE")})
    self._log = open(self.log_path, "w")
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "rstar_jax.rollout.api_server", "--hf_dir", hf_dir,
         "--port", str(self.port), "--num_slots", str(num_slots),
         "--max_len", str(max_len), "--min_prefill_bucket", str(bucket), *extra_args],
        cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)

  def wait_ready(self) -> None:
    """Until /health answers; a server that exits fails at once with its log. No deadline:
    a start on a loaded host is slow, not wrong (pytest-timeout ends a hang)."""
    while True:
      if self.proc.poll() is not None:
        raise AssertionError(f"server exited {self.proc.returncode}: "
                             f"{open(self.log_path).read()[-2000:]}")
      try:
        with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
          if r.status == 200:
            return
      except OSError:
        pass
      time.sleep(0.2)

  def kill(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait(30)
    self._log.close()


@pytest.fixture(scope="session")
def toy_tok():
  from rstar_jax.data import toy_task
  return toy_task.train_toy_tokenizer(1024, n=400, seed=0)


@pytest.fixture(scope="session")
def served(tmp_path_factory, toy_tok):
  """Three servers of a tiny random Qwen3 (model dir m1; m2: other weights, same shapes).

  a and b serve the end-to-end tests, c is updated and finally killed."""
  from rstar_jax.model import hf_io, qwen3
  from rstar_jax.model.model_config import Qwen3Config
  root = tmp_path_factory.mktemp("served")
  cfg = Qwen3Config(vocab_size=toy_tok.vocab_size, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=8, initializer_range=0.3, rope_theta=10_000.0)
  tok_dir = str(root / "tokenizer")
  toy_tok.save(tok_dir)
  dirs, models = {}, {}
  for name, seed in (("m1", 0), ("m2", 1)):
    models[name] = qwen3.create_model(cfg, seed=seed)
    dirs[name] = str(root / name)
    hf_io.save_hf(models[name], dirs[name], dtype="float32", tokenizer_dir=tok_dir)
  servers = {k: ServerProcess(dirs["m1"], str(root), k) for k in ("a", "b", "c")}
  try:
    for s in servers.values():
      s.wait_ready()
    yield {"servers": servers, "dirs": dirs, "models": models, "cfg": cfg, "root": str(root)}
  finally:
    for s in servers.values():
      s.kill()
