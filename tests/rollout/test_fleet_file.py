"""The fleet file (`rollout/fleet_file.py`): how a running trainer follows servers that a
cluster supervisor moved to new URLs. The rollout engines' side (catching a moved server
up to the latest weights) is in test_sglang_engine.py; the supervisor's side, on a real
two-node Ray cluster, in tests/test_cluster.py."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest

from rstar_jax.rollout import chat
from rstar_jax.rollout.fleet_file import FleetFileError, FleetWatcher, read_fleet, write_fleet
from rstar_jax.rollout.sandbox_client import ToolsConfig, build_tools
from sandbox.launcher import running_server


def test_the_file_is_checked_and_a_bad_one_keeps_the_urls(tmp_path):
  path = str(tmp_path / "fleet.json")
  write_fleet(path, {"sandbox": ["http://h:1"], "rollout": ["http://h:2", "http://h:3"]}, 4)
  assert read_fleet(path) == {"generation": 4, "sandbox": ["http://h:1"],
                              "rollout": ["http://h:2", "http://h:3"]}
  seen = []
  watcher = FleetWatcher(path, "rollout", seen.append, current=["http://h:2", "http://h:3"],
                         interval_s=3600)
  try:
    assert not watcher.check() and seen == []          # what the client already has
    for bad, why in (("{", "not JSON"), ("[1]", "a JSON object expected"),
                     ('{"rollout": ["h:2", "http://h:3"]}', "list of http"),
                     ('{"rollout": "http://h:2"}', "list of http")):
      (tmp_path / "fleet.json").write_text(bad)
      with pytest.raises(FleetFileError, match=why):
        read_fleet(path)
      assert not watcher.check() and watcher.applied == ["http://h:2", "http://h:3"]
    write_fleet(path, {"rollout": ["http://h:2"]}, 5)     # server i must stay server i
    assert not watcher.check() and seen == []
    write_fleet(path, {"rollout": ["http://h:2", "http://h:9"]}, 6)
    assert watcher.check() and seen == [["http://h:2", "http://h:9"]] and watcher.moves == 1
    assert not watcher.check()                            # unchanged since
  finally:
    watcher.stop()
  with pytest.raises(ValueError, match="role"):
    FleetWatcher(path, "trainer", seen.append, current=[])


def test_configs_refuse_a_fleet_file_with_nothing_to_move():
  from rstar_jax.rollout.backends import RolloutConfig
  with pytest.raises(ValueError, match="tools.urls is empty"):
    ToolsConfig(urls_file="/f.json")
  with pytest.raises(ValueError, match="no servers to move"):
    RolloutConfig(backend="jax", servers_file="/f.json")


def _call(code):
  return chat.ParsedToolCall(name="python", code=code, input="")


def test_the_sandbox_tools_follow_a_moved_server_without_being_rebuilt(tmp_path):
  """Real sandbox servers: the tools' only server goes away and comes back at another
  URL (a lost node's server re-created elsewhere); once the fleet file says so, the same
  tools object, watching the file, runs the next calls there."""
  path = str(tmp_path / "fleet.json")
  with running_server(max_children=2, pool_size=1) as new_home, \
      contextlib.ExitStack() as first_server:
    first = first_server.enter_context(running_server(max_children=2, pool_size=1))
    write_fleet(path, {"sandbox": [first]}, 0)
    with build_tools(ToolsConfig(urls=(first,), urls_file=path, timeout_s=30)) as tools:
      out = asyncio.run(_execute(tools, "print(6 * 7)"))
      assert out[0]["status"] == "ok" and out[0]["stdout"].strip() == "42", out
      first_server.close()                           # the server and its node are gone
      write_fleet(path, {"sandbox": [new_home]}, 1)  # the supervisor re-created it
      while tools.urls != [new_home]:   # no deadline: pytest-timeout ends a hang
        time.sleep(0.05)
      out = asyncio.run(_execute(tools, "print(2 + 2)"))
      assert out[0]["status"] == "ok" and out[0]["stdout"].strip() == "4", out


async def _execute(tools, code):
  try:
    return await tools.execute([_call(code)])
  finally:
    await tools.release_loop()


def test_a_client_in_a_running_loop_takes_the_new_urls_at_its_next_call(tmp_path):
  """The RL loop may keep one event loop across steps: the client made for it before the
  move switches URLs at its next call (`SandboxClient.set_urls`), not only new clients."""
  from rstar_jax.rollout.sandbox_client import SandboxTools
  with running_server(max_children=2, pool_size=1) as b, contextlib.ExitStack() as a_server:
    a = a_server.enter_context(running_server(max_children=2, pool_size=1))
    tools = SandboxTools([a], timeout_s=30)

    async def both():
      first = await tools.execute([_call("print(1)")])
      client = tools._client()
      a_server.close()                  # only b answers from here on
      tools.set_urls([b + "/"])
      second = await tools.execute([_call("print(2)")])
      assert tools._client() is client and client.urls == [b]
      await tools.release_loop()
      return first, second
    first, second = asyncio.run(both())
    assert [r["stdout"].strip() for r in first + second] == ["1", "2"]
    with pytest.raises(ValueError, match="1 server"):
      tools.set_urls([a, b])
    assert json.loads(json.dumps(tools.urls)) == [b]
