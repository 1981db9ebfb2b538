"""Malformed and hostile requests against a real server: always a 4xx naming the
problem, never a 500, and the server stays healthy. Plus call ids (exactly once)."""
from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from sandbox.launcher import health, running_server

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
CLIENT_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def url():
  # A light warm parent: these tests are about the HTTP layer.
  with running_server(max_children=8, pool_size=1,
                      extra_args=["--preload", "math,json", "--max-body-mb", "1",
                                  "--client-timeout", str(CLIENT_TIMEOUT), "--max-batch", "64",
                                  "--max-timeout", "30"]) as u:
    yield u


def post(url, path, body, content_type="application/json", raw=False):
  """(HTTP status, parsed JSON answer)."""
  data = body if raw else json.dumps(body).encode()
  headers = {} if content_type is None else {"Content-Type": content_type}
  req = urllib.request.Request(f"{url}{path}", data=data, headers=headers, method="POST")
  try:
    with _OPENER.open(req, timeout=60) as resp:
      return resp.status, json.loads(resp.read())
  except urllib.error.HTTPError as e:
    text = e.read()
    try:
      return e.code, json.loads(text)
    except ValueError:
      return e.code, {"error": text.decode(errors="replace")}


def stats(url):
  with _OPENER.open(f"{url}/stats", timeout=10) as resp:
    return json.loads(resp.read())


BIG = "1" + "0" * 400
# (raw body, expected status, words the error must contain)
BAD_BODIES = [
    (b"", 400, "not valid JSON"),
    (b"{", 400, "not valid JSON"),
    (b"\xff\xfe{}", 400, "not UTF-8"),
    (b"[]", 400, "must be a JSON object"),
    (b"null", 400, "must be a JSON object"),
    (b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
    (b'{"calls": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400, "nested too deeply"),
    (b'{"calls": "print(1)"}', 400, "'calls' must be a list"),
    (b'{}', 400, "list field 'calls'"),
    (b'{"calls": [], "timeout": 0.001}', 400, "unknown field(s) ['timeout']"),
    (b'{"calls": [{"code": "1", "timeot": 1}]}', 400, "calls[0]: unknown field(s) ['timeot']"),
    (b'{"calls": [{"code": "1", "input": {"nested": 1}}]}', 400, "calls[0]: Call.input must be a str"),
    (b'{"calls": [{"input": "x"}]}', 400, "calls[0]: missing required field 'code'"),
    (b'{"calls": [1]}', 400, "calls[0]: expected an object"),
    (b'{"calls": ["print(1)"]}', 400, "calls[0]: expected an object"),
    (b'{"calls": [{"code": 5}]}', 400, "Call.code must be a str"),
    (b'{"calls": [{"code": "1", "timeout": ' + BIG.encode() + b'}]}', 400, "integer of 401 digits"),
    (b'{"calls": [{"code": "1", "timeout": -' + BIG.encode() + b'}]}', 400, "timeout must be > 0"),
    (b'{"calls": [{"code": "1", "timeout": 1' + b"0" * 5000 + b'}]}', 400, "not valid JSON"),
    (b'{"calls": [{"code": "1", "timeout": 1e999}]}', 400, "finite"),
    (b'{"calls": [{"code": "1", "timeout": NaN}]}', 400, "NaN is not valid JSON"),
    (b'{"calls": [{"code": "1", "timeout": -Infinity}]}', 400, "-Infinity is not valid JSON"),
    (b'{"calls": [{"code": "1", "timeout": 0}]}', 400, "timeout must be > 0"),
    (b'{"calls": [{"code": "1", "timeout": 5e-324}]}', 200, ""),  # tiny but valid: times out
    (b'{"calls": [{"code": "1", "timeout": true}]}', 400, "timeout must be a number"),
    (b'{"calls": [{"code": "1", "timeout": "3"}]}', 400, "timeout must be a number"),
    (b'{"calls": [{"code": "1", "timeout": 31}]}', 400, "exceeds the server's max_timeout"),
    (b'{"calls": [{"code": "1", "session_id": ""}]}', 400, "session_id must be a non-empty str"),
    (b'{"calls": [{"code": "1", "session_id": 7}]}', 400, "session_id must be a non-empty str"),
    (b'{"calls": [{"code": "1", "id": "a b"}]}', 400, "id must be a str of 1-128 characters"),
    (b'{"calls": [{"code": "1", "id": "' + b"x" * 129 + b'"}]}', 400, "id must be a str"),
    (b'{"calls": [{"code": "1", "id": 3}]}', 400, "id must be a str"),
    (b'{"calls": [{"code": "1", "id": "d"}, {"code": "2", "id": "d"}]}', 400, "appears twice"),
    (json.dumps({"calls": [{"code": "1"}] * 65}).encode(), 400, "too many calls in one request: 65 > 64"),
    (b'{"calls": [], "expect_instance": 3}', 400, "'expect_instance' must be a str"),
]


@pytest.mark.parametrize("body,status,needle", BAD_BODIES,
                         ids=[f"{i}-{b[:24]!r}" for i, (b, _, _) in enumerate(BAD_BODIES)])
def test_malformed_bodies_get_a_4xx_naming_the_problem(url, body, status, needle):
  code, answer = post(url, "/execute", body, raw=True)
  assert code == status, answer
  if status != 200:
    assert needle in answer["error"], answer
  else:
    assert answer["results"][0]["status"] == "timeout"


def test_content_type_and_size(url):
  body = json.dumps({"calls": [{"code": "print(1)"}]}).encode()
  for ctype in (None, "text/plain", "application/x-www-form-urlencoded", "application/json; charset=latin-1"):
    code, answer = post(url, "/execute", body, content_type=ctype, raw=True)
    assert code == 415 and ("Content-Type" in answer["error"] or "UTF-8" in answer["error"]), (ctype, answer)
  code, answer = post(url, "/execute", body, content_type="application/json; charset=utf-8", raw=True)
  assert code == 200 and answer["results"][0]["stdout"] == "1\n"
  big = json.dumps({"calls": [{"code": "x = '" + "a" * (2 << 20) + "'"}]}).encode()
  code, answer = post(url, "/execute", big, raw=True)
  assert code == 413 and "--max-body-mb 1" in answer["error"], answer
  code, answer = post(url, "/sessions/close", b'{"session_ids": [], "all": true}', raw=True)
  assert code == 400 and "unknown field(s) ['all']" in answer["error"]
  code, answer = post(url, "/sessions/close", b'{"session_ids": ["a"]}', content_type="text/plain", raw=True)
  assert code == 415


def test_content_encoding_that_does_not_decode_is_a_400_and_an_unknown_one_a_415(url):
  import gzip
  body = json.dumps({"calls": [{"code": "print(1)"}]}).encode()
  def send(encoding, data):
    req = urllib.request.Request(f"{url}/execute", data=data, method="POST", headers={
        "Content-Type": "application/json", "Content-Encoding": encoding})
    try:
      with _OPENER.open(req, timeout=60) as resp:
        return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
      return e.code, json.loads(e.read())
  code, answer = send("gzip", gzip.compress(body))
  assert code == 200 and answer["results"][0]["stdout"] == "1\n"
  for encoding, data in (("gzip", b"\x1f\x8b\x08\x00garbage"), ("deflate", b"not deflate")):
    code, answer = send(encoding, data)   # was a 500 (or, decoded to nothing, bad JSON)
    assert code == 400 and ("cannot read the request body" in answer["error"]
                            or "not valid JSON" in answer["error"]), answer
  code, answer = send("x-foo", body)     # was run as if it were plain JSON
  assert code == 415 and "Content-Encoding must be gzip, deflate or none" in answer["error"]


def test_finished_results_are_evicted_while_an_older_call_still_runs():
  # The store's byte cap held only up to the oldest running call: behind a long call,
  # every finished result was kept until it ended.
  with running_server(max_children=4, pool_size=1, extra_args=[
      "--preload", "json", "--result-cache-mb", "1"]) as u:
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      long = pool.submit(post, u, "/execute", {"calls": [
          {"code": "import time\ntime.sleep(6)", "id": "long"}]})
      time.sleep(0.5)
      for i in range(30):   # 30 x 60 KB of output through a 1 MB store
        code, _ = post(u, "/execute", {"calls": [{"code": "print('x' * 60000)", "id": f"o{i}"}]})
        assert code == 200
      remembered = stats(u)["remembered_ids"]
      assert long.result()[0] == 200
    assert remembered <= 18, remembered   # 1 MB / ~60 KB, plus the running one


def test_lone_surrogates_are_a_syntax_error_of_the_call_not_of_the_server(url):
  # What a model's broken emoji escape ("\ud83d" without its pair) decodes to: the code
  # cannot be compiled (a tool error the model sees); as stdin it is just data.
  code, answer = post(url, "/execute", {"calls": [
      {"code": "print('ok')\ns = '\ud83d'\nprint(s)"},
      {"code": "x = input()\nprint(len(x), ascii(x))", "input": "a\udc00b"},
      {"code": "print('fine')", "session_id": "sur\udfff"}]})
  assert code == 200, answer
  a, b, c = answer["results"]
  assert (a["status"], a["error_type"], a["error_line"]) == ("error", "SyntaxError", 2)
  assert "lone surrogate '\\ud83d'" in a["error_message"] and a["error_source"] == "s = '\\ud83d'"
  assert b["status"] == "ok" and b["stdout"] == "3 'a\\udc00b'\n"
  assert c["status"] == "ok" and c["stdout"] == "fine\n"


def test_no_500_and_healthy_after_all_of_it(url):
  for body, _, _ in BAD_BODIES:
    code, _ = post(url, "/execute", body, raw=True)
    assert code < 500
  s = stats(url)
  assert s["statuses"]["internal_error"] == 0
  assert health(url)["status"] == "ok"


def _raw_socket(url):
  host, port = url.rsplit("/", 1)[1].split(":")
  return socket.create_connection((host, int(port)), timeout=30)


def test_slow_clients_time_out(url):
  # A body that never completes: 408 after the client timeout.
  with _raw_socket(url) as s:
    s.sendall(b"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"calls\"")
    t = time.monotonic()
    answer = s.recv(4096)
    assert b" 408 " in answer.split(b"\r\n")[0] and b"did not arrive within" in answer
    assert time.monotonic() - t >= CLIENT_TIMEOUT * 0.9
  # Headers that never complete: the connection is closed.
  with _raw_socket(url) as s:
    s.sendall(b"POST /execute HTTP/1.1\r\nHost: x\r\nContent-")
    t = time.monotonic()
    assert s.recv(4096) == b""  # closed by the server (the 30 s socket timeout would raise)
    assert time.monotonic() - t >= CLIENT_TIMEOUT * 0.9
  assert health(url)["status"] == "ok"


def test_a_call_id_runs_once(url):
  call = {"code": "import random\nprint(random.random())", "id": "once-1"}
  before = stats(url)
  code1, a1 = post(url, "/execute", {"calls": [call]})
  code2, a2 = post(url, "/execute", {"calls": [call, {"code": "print(2)", "id": "once-2"}]})
  assert code1 == code2 == 200
  assert a1["results"][0]["stdout"] == a2["results"][0]["stdout"]  # the stored result
  assert a2["results"][0]["call_id"] == "once-1" and a2["results"][1]["stdout"] == "2\n"
  after = stats(url)
  assert after["calls"] - before["calls"] == 2  # once-1 ran once, once-2 once
  assert after["replayed"] - before["replayed"] == 1
  # The same id for different code is refused, nothing runs.
  code, answer = post(url, "/execute", {"calls": [{"code": "print(3)", "id": "once-1"}]})
  assert code == 409 and "already used for a different call" in answer["error"]
  # A retry that expects another server instance (this one restarted) is refused too.
  code, answer = post(url, "/execute", {"calls": [call], "expect_instance": "0" * 32})
  assert code == 409 and "restarted" in answer["error"]
  assert stats(url)["calls"] == after["calls"]


def test_a_retry_while_the_call_still_runs_waits_for_the_same_run(url):
  import concurrent.futures
  call = {"code": "import time, random\ntime.sleep(1)\nprint(random.random())", "id": "slow-1"}
  before = stats(url)["calls"]
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    first = pool.submit(post, url, "/execute", {"calls": [call]})
    time.sleep(0.3)
    second = pool.submit(post, url, "/execute", {"calls": [call]})
    (c1, a1), (c2, a2) = first.result(), second.result()
  assert c1 == c2 == 200 and a1["results"][0]["stdout"] == a2["results"][0]["stdout"]
  assert stats(url)["calls"] - before == 1


def _zygote(server_pid: int) -> int:
  """The warm parent: the sandbox.worker process whose parent is not one (bwrap sits
  between it and the server where bubblewrap runs; forked calls share its cmdline)."""
  from sandbox.launcher import _descendants

  def is_worker(pid):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")[1:3] == [b"-m", b"sandbox.worker"]
    except OSError:
      return False

  def parent(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
      stat = f.read()
    return int(stat[stat.rindex(b")") + 2:].split()[1])

  found = [p for p in _descendants(server_pid) if is_worker(p) and not is_worker(parent(p))]
  assert len(found) == 1, found
  return found[0]


def test_a_call_that_waits_for_a_process_is_not_timed_out_meanwhile(url):
  """The deadline starts when a child takes the call. The warm parent is stopped here
  (as a burst of forks, or slots held by dying calls, would hold it) for longer than
  the call's timeout: the call then runs in full. Before, its deadline ran out while it
  waited, the worker dropped it unrun, and the model read a timeout for `print(1)`."""
  import os
  import signal
  import threading
  zygote = _zygote(health(url)["pid"])
  resumed_at = []

  def resume_zygote():
    resumed_at.append(time.monotonic())
    os.kill(zygote, signal.SIGCONT)

  os.kill(zygote, signal.SIGSTOP)
  resume = threading.Timer(2.5, resume_zygote)
  resume.start()
  try:
    status, body = post(url, "/execute", {"calls": [{"code": "print(1)", "timeout": 1.0}]})
    answered_at = time.monotonic()
  finally:
    resume.join()
    os.kill(zygote, signal.SIGCONT)
  r = body["results"][0]
  assert status == 200 and r["status"] == "ok" and r["stdout"] == "1\n", body
  # Counted from the start, not from the wait: only the stopped parent hands a call to a
  # child, so the call ran between the resume and the answer, and its wall time (the
  # server's CLOCK_MONOTONIC, as ours) fits in that interval. Counted from the arrival,
  # it would also hold the 2.5 s the parent was stopped. An order of events, no bound on
  # the host's speed.
  assert resumed_at and resumed_at[0] < answered_at, (resumed_at, answered_at)
  assert r["wall_time"] <= answered_at - resumed_at[0] + 1e-6, (r, answered_at - resumed_at[0])


def test_a_call_no_process_takes_fails_unrun_after_start_timeout():
  """The wait for a process is bounded by start_timeout: past it the call comes back as
  internal_error (not the model's timeout) and never runs, even once the warm parent
  goes on."""
  import os
  import signal
  import threading
  with running_server(max_children=2, pool_size=0,
                      extra_args=["--preload", "json", "--start-timeout", "5"]) as u:
    zygote = _zygote(health(u)["pid"])
    os.kill(zygote, signal.SIGSTOP)
    resume = threading.Timer(7.0, os.kill, (zygote, signal.SIGCONT))
    resume.start()
    try:
      status, body = post(u, "/execute", {"calls": [
          {"code": "open('/tmp/ran', 'w'); print(1)", "timeout": 1.0}]})
    finally:
      resume.join()
      os.kill(zygote, signal.SIGCONT)
    r = body["results"][0]
    assert status == 200 and r["status"] == "internal_error", body
    assert "within start_timeout=5 s; it did not run" in r["error_message"], r
    assert r["stdout"] == ""
    _, again = post(u, "/execute", {"calls": [{"code": "print(2)"}]})   # still serving
    assert again["results"][0]["stdout"] == "2\n", again


def test_a_started_event_read_after_the_calls_end_keeps_its_grace_timer():
  """The worker's "started" datagram and the call's own pipes are separate fds: a fast
  call's record and EOFs can be read first, setting the short grace timer that ends it.
  The late "started" must only drop the start limit; it had cancelled every timer and
  armed the full deadline, so the finished call waited out its timeout as a timeout."""
  import asyncio
  from sandbox import executor
  from sandbox.config import ExecutorConfig

  async def main():
    loop = asyncio.get_running_loop()
    ex = executor.Executor(ExecutorConfig())
    job = executor._Job(1, 30.0, loop.create_future())
    job.start_handle = loop.call_later(100.0, ex._on_no_start, job)
    job.handles += [job.start_handle, loop.call_later(0.05, ex._finish, job)]   # the grace
    ex._jobs[1] = job
    ex._on_started({"ev": "started", "id": 1})
    await asyncio.wait_for(job.fut, 5)
    assert job.finished and not job.timed_out and job.start_handle.cancelled()
  asyncio.run(main())
