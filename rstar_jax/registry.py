"""Name -> implementation registries for swappable pieces chosen by config strings.

A `Registry` is a dict (so `name in R`, `sorted(R)`, `R[name]` work) with a
`register(name)` decorator that refuses duplicates and a `lookup(name)` whose error
names the kind of thing and lists the known names.
"""
from __future__ import annotations

from typing import Callable, Mapping, TypeVar

T = TypeVar("T")


class Registry(dict):

  def __init__(self, what: str, *, aliases: Mapping[str, str] | None = None,
               error: type[Exception] = ValueError, hint: str = ""):
    super().__init__()
    self.what, self.aliases, self.error, self.hint = what, dict(aliases or {}), error, hint

  def register(self, name: str) -> Callable[[T], T]:
    def deco(fn: T) -> T:
      if name in self:
        raise ValueError(f"{self.what} {name!r} is already registered")
      self[name] = fn
      return fn
    return deco

  def lookup(self, name: str):
    key = self.aliases.get(name, name)
    if key not in self:
      raise self.error(f"unknown {self.what} {name!r}; known: {sorted(self)}{self.hint}")
    return self[key]
