"""The fleet file: where a running trainer learns that a server moved.

On a Ray cluster a server whose node is lost is re-created on another node under a new
URL (`recipe/cluster.py`). The supervisor rewrites this JSON file on shared storage
(atomically: a temporary file renamed over it),

    {"generation": 3, "sandbox": ["http://10.0.0.5:8321", ...], "rollout": [...]}

and the trainer's clients, started with `tools.urls_file` / `rollout.servers_file`
pointing at it, watch it and move their i-th server to the file's i-th URL of their role
without a restart: no step since the last checkpoint is lost. The lists keep their
length and order (server i stays server i); a file that breaks that is refused with a
warning and the clients keep their URLs.
"""
from __future__ import annotations

import json
import os
import threading
from typing import Callable, Mapping, Sequence

from absl import logging

ROLES = ("sandbox", "rollout")


class FleetFileError(ValueError):
  """The fleet file is not what the supervisor writes."""


def write_fleet(path: str, urls: Mapping[str, Sequence[str]], generation: int) -> None:
  """Writes the file atomically: a reader sees the old content or the new, never a part."""
  body = {"generation": int(generation)}
  for role in ROLES:
    body[role] = list(urls.get(role, ()))
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(body, f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def read_fleet(path: str) -> dict:
  """The file's content, checked: FleetFileError naming what is wrong."""
  try:
    with open(path) as f:
      body = json.load(f)
  except json.JSONDecodeError as e:
    raise FleetFileError(f"fleet file {path}: not JSON ({e})") from None
  if not isinstance(body, dict):
    raise FleetFileError(f"fleet file {path}: a JSON object expected, got {type(body).__name__}")
  for role in ROLES:
    urls = body.get(role, [])
    if not isinstance(urls, list) or not all(
        isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls):
      raise FleetFileError(f"fleet file {path}: {role!r} must be a list of http(s) URLs, "
                           f"got {urls!r}")
  return body


class FleetWatcher:
  """Polls the fleet file every `interval_s` seconds in a daemon thread and calls
  `apply(urls)` with its `role`'s list each time that list changes (not at start: the
  client was built with the URLs it was given). `apply` must be thread-safe."""

  def __init__(self, path: str, role: str, apply: Callable[[list[str]], None], *,
               current: Sequence[str], interval_s: float = 1.0):
    if role not in ROLES:
      raise ValueError(f"FleetWatcher: role must be one of {ROLES}, got {role!r}")
    self.path, self.role, self._apply = path, role, apply
    self.interval_s = interval_s
    self.applied = list(current)
    self.moves = 0     # lists applied since start
    self._stamp = None
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name=f"fleet-watch-{role}", daemon=True)
    self._thread.start()

  def _run(self) -> None:
    while not self._stop.wait(self.interval_s):
      self.check()

  def check(self) -> bool:
    """Reads the file if it changed; True when a new list was applied."""
    try:
      st = os.stat(self.path)
    except FileNotFoundError:
      return False
    stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
    if stamp == self._stamp:
      return False
    self._stamp = stamp
    try:
      urls = read_fleet(self.path)[self.role]
    except (OSError, FleetFileError) as e:
      logging.warning("fleet file: %s; keeping the %s URLs %s", e, self.role, self.applied)
      return False
    if urls == self.applied:
      return False
    if len(urls) != len(self.applied):
      logging.warning("fleet file %s lists %d %s server(s), this client has %d: server i "
                      "must stay server i; keeping %s", self.path, len(urls), self.role,
                      len(self.applied), self.applied)
      return False
    logging.warning("fleet file %s: %s servers moved: %s -> %s", self.path, self.role,
                    self.applied, urls)
    self._apply(list(urls))
    self.applied = list(urls)
    self.moves += 1
    return True

  def stop(self) -> None:
    self._stop.set()
    if self._thread is not threading.current_thread():
      self._thread.join(timeout=5)
