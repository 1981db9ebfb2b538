"""Client behaviour against stub servers: retries, rotation, ordering, no re-runs."""
from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from sandbox.client import SandboxClient
from sandbox.launcher import free_port


class Stub:
  """A fake sandbox server on 127.0.0.1 whose answers a test scripts."""

  def __init__(self, fail_first: int = 0, status: int = 503, delay: float = 0.0,
               result_status: str = "ok", port: int | None = None, drop_first: int = 0):
    self.requests = 0
    self.drop_first = drop_first  # take the request, then drop the connection unanswered
    self.bodies: list[dict] = []
    self.ran: dict[str, int] = {}
    self.calls: list[dict] = []
    self.fail_first, self.status, self.delay = fail_first, status, delay
    self.result_status = result_status
    self.port = port
    self.runner = None

  async def _execute(self, request):
    self.requests += 1
    body = await request.json()
    self.bodies.append(body)
    if self.requests <= self.fail_first:
      return web.Response(status=self.status, text="scripted failure")
    fresh = [c for c in body["calls"] if c["id"] not in self.ran]
    for c in fresh:  # what a real server does: an id it has seen is answered, not re-run
      self.ran[c["id"]] = self.ran.get(c["id"], 0) + 1
    if self.requests <= self.drop_first:
      request.transport.close()
      await asyncio.sleep(0.05)
      return web.Response(status=200)
    if self.delay:
      await asyncio.sleep(self.delay)
    self.calls += fresh
    return web.json_response({"results": [
        {"status": self.result_status, "stdout": c["code"], "isolation": "stub"} for c in body["calls"]]})

  async def _health(self, request):
    return web.json_response({"status": "ok"})

  async def start(self) -> str:
    app = web.Application()
    app.add_routes([web.post("/execute", self._execute), web.get("/health", self._health)])
    self.runner = web.AppRunner(app)
    await self.runner.setup()
    site = web.TCPSite(self.runner, "127.0.0.1", self.port or 0)
    await site.start()
    self.port = self.runner.addresses[0][1]
    return f"http://127.0.0.1:{self.port}"

  async def stop(self):
    await self.runner.cleanup()


def _calls(n, **kw):
  return [dict(code=f"c{i}", **kw) for i in range(n)]


def test_order_batching_and_dead_server_taken_out():
  async def main():
    stub = Stub()
    good = await stub.start()
    dead = f"http://127.0.0.1:{free_port()}"
    async with SandboxClient([dead, good], batch_size=4, backoff_s=0.01,
                             health_interval_s=60) as client:
      results = await client.execute(_calls(40))
      assert [r.stdout for r in results] == [f"c{i}" for i in range(40)]
      assert all(r.status == "ok" and r.server == good for r in results)
      assert client.servers_up() == [good]
      assert stub.requests == 10  # 40 calls in batches of 4, each run exactly once
      assert sorted(c["code"] for c in stub.calls) == sorted(f"c{i}" for i in range(40))
    await stub.stop()
  asyncio.run(main())


def test_5xx_is_retried_with_backoff():
  async def main():
    stub = Stub(fail_first=2, status=503)
    url = await stub.start()
    async with SandboxClient([url], backoff_s=0.01, health_interval_s=0.0) as client:
      (r,) = await client.execute(["print(1)"])
      assert r.status == "ok" and stub.requests == 3 and len(stub.calls) == 1
    await stub.stop()
  asyncio.run(main())


def test_a_returned_result_is_never_rerun():
  async def main():
    stub = Stub(result_status="internal_error")
    url = await stub.start()
    async with SandboxClient([url], backoff_s=0.01) as client:
      rs = await client.execute(_calls(3))
      assert [r.status for r in rs] == ["internal_error"] * 3
      assert stub.requests == 1
    await stub.stop()
  asyncio.run(main())


def test_request_timeout_is_not_retried():
  async def main():
    stub = Stub(delay=1.0)
    url = await stub.start()
    async with SandboxClient([url], backoff_s=0.01, request_timeout_s=0.3) as client:
      (r,) = await client.execute(["print(1)"])
      assert r.status == "internal_error" and "timed out" in r.error_message
      assert stub.requests == 1
    await stub.stop()
  asyncio.run(main())


def test_gives_up_with_internal_error_when_nothing_is_reachable():
  async def main():
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    async with SandboxClient(dead, max_retries=2, backoff_s=0.01, health_interval_s=0.0) as client:
      rs = await client.execute(_calls(2))
      assert [r.status for r in rs] == ["internal_error"] * 2
      assert "gave up after 3 attempts" in rs[0].error_message
  asyncio.run(main())


def test_dead_server_comes_back_into_rotation():
  async def main():
    a_port = free_port()
    b = Stub()
    b_url = await b.start()
    a_url = f"http://127.0.0.1:{a_port}"
    async with SandboxClient([a_url, b_url], batch_size=1, backoff_s=0.01,
                             health_interval_s=0.1) as client:
      await client.execute(_calls(4))
      assert client.servers_up() == [b_url]
      a = Stub(port=a_port)
      await a.start()
      await asyncio.sleep(0.2)
      for _ in range(20):  # the next picks probe /health and take A back
        await client.execute(_calls(4))
        if a.requests:
          break
        await asyncio.sleep(0.1)
      assert a.requests > 0 and set(client.servers_up()) == {a_url, b_url}
      await a.stop()
    await b.stop()
  asyncio.run(main())


def test_session_calls_stay_on_one_server_in_order():
  async def main():
    stubs = [Stub(), Stub(), Stub()]
    urls = [await s.start() for s in stubs]
    async with SandboxClient(urls, batch_size=2) as client:
      calls = [dict(code=f"s{i}", session_id="abc") for i in range(5)] + _calls(6)
      rs = await client.execute(calls)
      assert [r.stdout for r in rs[:5]] == [f"s{i}" for i in range(5)]
      assert len({r.server for r in rs[:5]}) == 1
      owner = next(s for s in stubs if any(c["code"] == "s0" for c in s.calls))
      assert [c["code"] for c in owner.calls if c.get("session_id") == "abc"] == [f"s{i}" for i in range(5)]
    for s in stubs:
      await s.stop()
  asyncio.run(main())


def test_bad_input_raises_clear_errors():
  with pytest.raises(ValueError, match="must start with http"):
    SandboxClient(["127.0.0.1:80"])
  with pytest.raises(ValueError, match="at least one server"):
    SandboxClient([])

  async def main():
    async with SandboxClient(["http://127.0.0.1:9"]) as client:
      with pytest.raises(ValueError, match=r"calls\[1\]: missing required field 'code'"):
        await client.execute(["print(1)", {"input": "x"}])
  asyncio.run(main())


def test_lost_answer_is_asked_again_of_the_same_server_with_the_same_ids():
  async def main():
    a, b = Stub(drop_first=1), Stub()
    urls = [await a.start(), await b.start()]
    async with SandboxClient(urls, batch_size=8, backoff_s=0.01) as client:
      client._rr = 1  # the first pick is A (fewest in flight, round robin from A)
      rs = await client.execute(_calls(4))
      assert [r.stdout for r in rs] == [f"c{i}" for i in range(4)]
      assert {r.server for r in rs} == {urls[0]}
      assert a.requests == 2 and b.requests == 0  # pinned to A, never sent elsewhere
      assert [c["id"] for c in a.bodies[0]["calls"]] == [c["id"] for c in a.bodies[1]["calls"]]
      assert all(n == 1 for n in a.ran.values()) and len(a.ran) == 4
      assert len({r.call_id for r in rs}) == 4
    await a.stop()
    await b.stop()
  asyncio.run(main())


def test_a_server_that_dies_after_taking_the_request_gets_no_rerun_elsewhere():
  async def main():
    a, b = Stub(drop_first=1), Stub()
    urls = [await a.start(), await b.start()]
    async with SandboxClient(urls, batch_size=8, backoff_s=0.2) as client:
      client._rr = 1
      task = asyncio.ensure_future(client.execute(_calls(3)))
      while a.requests == 0:
        await asyncio.sleep(0.01)
      await a.stop()  # gone before the retry: the calls may have run there
      rs = await task
      assert [r.status for r in rs] == ["internal_error"] * 3
      assert "may have run and are not re-run" in rs[0].error_message
      assert b.requests == 0
      rs = await client.execute(_calls(2))  # new calls go to B
      assert [r.server for r in rs] == [urls[1]] * 2
    await b.stop()
  asyncio.run(main())


def test_rerun_lost_runs_the_calls_of_a_dead_server_elsewhere():
  """The opt-in for stateless work (RL tool calls): the same death as above, and the
  calls run on B instead of coming back as "may have run"; a session call still does not."""
  async def main():
    a, b = Stub(drop_first=1), Stub()
    urls = [await a.start(), await b.start()]
    async with SandboxClient(urls, batch_size=8, backoff_s=0.2, rerun_lost=True) as client:
      client._rr = 1
      task = asyncio.ensure_future(client.execute(_calls(3)))
      while a.requests == 0:
        await asyncio.sleep(0.01)
      await a.stop()
      rs = await task
      assert [(r.status, r.stdout, r.server) for r in rs] == [
          ("ok", f"c{i}", urls[1]) for i in range(3)]
      assert b.requests == 1 and all(n == 1 for n in b.ran.values())
    await b.stop()
    a, b = Stub(drop_first=1), Stub()
    urls = [await a.start(), await b.start()]
    async with SandboxClient(urls, batch_size=8, backoff_s=0.2, rerun_lost=True) as client:
      client._rr = 1
      task = asyncio.ensure_future(client.execute(
          [dict(code="x = 1", session_id="s1"), dict(code="print(x)", session_id="s1")]))
      while a.requests == 0:
        await asyncio.sleep(0.01)
      await a.stop()
      rs = await task
      assert [r.status for r in rs] == ["internal_error"] * 2 and b.requests == 0
    await b.stop()
  asyncio.run(main())


def test_client_ids_are_unique_and_kept_when_given():
  async def main():
    stub = Stub()
    url = await stub.start()
    async with SandboxClient([url], batch_size=3) as client:
      rs = await client.execute(_calls(5) + [{"code": "x", "id": "mine-1"}])
      ids = [c["id"] for c in stub.calls]
      assert len(set(ids)) == 6 and "mine-1" in ids
      assert rs[-1].call_id == "mine-1" and len({r.call_id for r in rs}) == 6
    await stub.stop()
  asyncio.run(main())


def test_a_call_the_server_refuses_fails_alone_and_the_batch_goes_on():
  # A 4xx raised out of execute() before: every other call of the batch was lost.
  from sandbox.launcher import running_server
  with running_server(max_children=2, pool_size=1, extra_args=["--preload", "json"]) as url:
    async def main():
      async with SandboxClient([url]) as c:
        return await c.execute(["print(2)", "x = 1  # " + "#" * (1 << 20), "print(3)"])
    ok2, big, ok3 = asyncio.run(main())
  assert (ok2.status, ok2.stdout, ok3.status, ok3.stdout) == ("ok", "2\n", "ok", "3\n")
  assert big.status == "internal_error" and "max_code_bytes" in big.error_message
  assert big.call_id is not None and big.call_id != ok2.call_id
