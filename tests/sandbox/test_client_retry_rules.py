"""The sandbox client's re-send rule per 5xx: only a 503 (the server's "nothing was run")
is sent elsewhere; a 500 or a proxy's 502/504 may come after the calls ran, so only the
same server is asked again, for the same call ids, and nothing runs twice."""
import asyncio

from aiohttp import web
import pytest

from sandbox.client import SandboxClient
from tests.sandbox.test_client import Stub, _calls


class _RanThenFailed(Stub):
  """Runs the first request's calls, then answers `status` (a proxy or a crashed handler
  losing the answer)."""

  def __init__(self, status):
    super().__init__()
    self.lose_status = status

  async def _execute(self, request):
    if self.requests == 0:
      self.requests += 1
      body = await request.json()
      self.bodies.append(body)
      for c in body["calls"]:
        self.ran[c["id"]] = self.ran.get(c["id"], 0) + 1
      self.calls += body["calls"]
      return web.Response(status=self.lose_status, text="upstream lost the answer")
    return await super()._execute(request)


@pytest.mark.parametrize("status", [500, 502, 504])
def test_a_5xx_other_than_503_asks_the_same_server_for_the_same_ids(status):
  async def main():
    a, b = _RanThenFailed(status), Stub()
    urls = [await a.start(), await b.start()]
    async with SandboxClient(urls, batch_size=8, backoff_s=0.01) as client:
      client._rr = 1   # the first pick is A
      rs = await client.execute(_calls(3))
      assert [r.status for r in rs] == ["ok"] * 3 and {r.server for r in rs} == {urls[0]}
      assert b.requests == 0 and a.requests == 2
      assert [c["id"] for c in a.bodies[0]["calls"]] == [c["id"] for c in a.bodies[1]["calls"]]
      assert sorted(a.ran.values()) == [1, 1, 1]      # each call ran once
    await a.stop()
    await b.stop()
  asyncio.run(main())


def test_a_503_goes_elsewhere():
  async def main():
    a, b = Stub(fail_first=5, status=503), Stub()
    urls = [await a.start(), await b.start()]
    async with SandboxClient(urls, batch_size=8, backoff_s=0.01, health_interval_s=60) as client:
      client._rr = 1
      rs = await client.execute(_calls(3))
      assert [r.status for r in rs] == ["ok"] * 3 and {r.server for r in rs} == {urls[1]}
      assert a.ran == {}
    await a.stop()
    await b.stop()
  asyncio.run(main())
