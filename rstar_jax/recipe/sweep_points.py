"""A sweep's points: their names, directories, commands, finished markers and manifest.

A point is a dict of config overrides (keys are config paths such as
"rl.downsample.method", values python values). It runs `python -m <module> --config <spec>
--config.k=v ... --config.workdir=<dir>` in its own work directory `<sweep workdir>/<point
name>`, the name made from its overrides (sorted by key, e.g.
`rl.downsample.method=uniform,seed=1`). A point is finished when its `eval_final.json`
exists or the run exited 0 (then `SWEEP_DONE.json` is written), and the command that
finished it is the sweep's (order of the arguments aside); finished points are skipped on
rerun. `sweep.json` lists every point, for the notebooks (`load_points`).

Where the points come from: sweep_overrides; how they run: sweep_runner; their tables and
curves: sweep_results. These are base-layer modules (stdlib, numpy, ml_collections with its
absl flags, and the stdlib-only rstar_jax.jsonl; config_utils is a layer above); the entry
point is experiments/sweep.py.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shlex
import sys
import threading
from typing import Any, Callable, Mapping, Sequence

import numpy as np

class SweepError(ValueError):
  """A bad sweep: unknown key, value of the wrong type, duplicate point, bad flag."""


DONE_MARKER = "SWEEP_DONE.json"
FINAL_REPORT = "eval_final.json"
LOG_NAME = "sweep.log"
SEED_KEY = "seed"
COMPILE_CACHE_KEY = "compile_cache_dir"   # see `sweep_overrides.shared_overrides`
MAX_NAME = 180   # characters of a point directory name


# ---- names and commands ----------------------------------------------------------------
def plain_value(value: Any) -> Any:
  """`value` with numpy scalars (np.logspace's, np.arange's) as the python values they
  hold: a point's values reach it as text, and `repr(np.float64(x))` is
  "np.float64(x)", which no flag parser reads as a number."""
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, (list, tuple)):
    return (tuple if isinstance(value, tuple) else list)(plain_value(v) for v in value)
  return value


def format_value(value: Any) -> str:
  """A value as absl/config_flags reads it back (`--config.k=<this>`)."""
  value = plain_value(value)
  if isinstance(value, (list, tuple)):
    return repr(tuple(value))
  if isinstance(value, float):
    return repr(value)
  return str(value)


def _name_value(value: Any) -> str:
  if isinstance(value, (list, tuple)):
    return "(" + ",".join(_name_value(v) for v in value) + ")"
  return format_value(value)


_UNSAFE = re.compile(r"[^A-Za-z0-9._=,+\-()]")


def point_name(overrides: Mapping[str, Any]) -> str:
  """The directory name of a point: `k=v` pairs sorted by key, joined by commas, with
  characters unsafe in a file name replaced by `_`; long names are cut and end in a
  hash of the whole; "base" for no overrides."""
  if not overrides:
    return "base"
  raw = ",".join(f"{k}={_name_value(overrides[k])}" for k in sorted(overrides))
  name = _UNSAFE.sub("_", raw)
  if name.startswith((".", "-")):
    name = "_" + name
  if len(name) > MAX_NAME or name != raw:
    # Cut or changed: a hash of the exact overrides keeps distinct points distinct.
    digest = hashlib.sha1(raw.encode()).hexdigest()[:8]
    name = f"{name[:MAX_NAME - 9]}~{digest}"
  return name


@dataclasses.dataclass(frozen=True)
class Point:
  name: str
  overrides: dict[str, Any]
  workdir: str
  # The command the sweep runs it with, for a point read back from sweep.json
  # (`load_points`): what `finished` holds its done marker against.
  command: tuple[str, ...] | None = dataclasses.field(default=None, compare=False)

  @property
  def log(self) -> str:
    return os.path.join(self.workdir, LOG_NAME)


@dataclasses.dataclass
class Outcome:
  point: Point
  # "done" (ran now), "skipped" (finished before), "failed", "interrupted" (stopped by
  # SIGINT / SIGTERM: a rerun resumes it), "not started" (the sweep was stopped first).
  status: str
  returncode: int | None = None
  seconds: float = 0.0
  detail: str = ""


def make_points(overrides: Sequence[Mapping[str, Any]], sweep_workdir: str) -> list[Point]:
  root = os.path.abspath(sweep_workdir)
  return [Point(point_name(o), dict(o), os.path.join(root, point_name(o))) for o in overrides]


def override_args(overrides: Mapping[str, Any]) -> list[str]:
  return [f"--config.{k}={format_value(v)}" for k, v in overrides.items()]


def command(point: Point, *, module: str, config_spec: str,
            base_overrides: Mapping[str, Any] | None = None, python: str = "python",
            extra_args: Sequence[str] = ()) -> list[str]:
  """argv of one point: base overrides first, then the point's own, its work directory
  last (absl keeps the last value of a flag: no other argument can move the point
  elsewhere; `sweep_overrides.check_shared` refuses them too)."""
  return [python, "-m", module, "--config", config_spec, *override_args(base_overrides or {}),
          *override_args(point.overrides), *extra_args, f"--config.workdir={point.workdir}"]


def python_executable() -> str:
  return sys.executable or "python"


# ---- finished points ---------------------------------------------------------------------
def finished(point: Point, argv: Sequence[str] | None = None) -> str | None:
  """Why `point` counts as finished (its marker's path), or None.

  With `argv` (the command the sweep would run now; by default the one sweep.json
  records for a point from `load_points`), a point the sweep finished with another
  command does not count (`changed_command`): it runs again, and the run decides (the
  recipe resumes what is left, or refuses a config that changed under finished stages),
  instead of the sweep reporting results of other settings."""
  if argv is None:
    argv = point.command
  path = marker(point)
  if path and argv is not None and changed_command(point, argv):
    return None
  return path


def marker(point: Point) -> str | None:
  """The point's eval_final.json or done marker, whatever command wrote it, or None."""
  for marker in (FINAL_REPORT, DONE_MARKER):
    path = os.path.join(point.workdir, marker)
    if os.path.exists(path):
      return path
  return None


def _comparable(argv: Sequence[str]) -> list[str]:
  """What decides a point's run in its command, each part as shell text, order aside:
  the module, the config file (resolved: a relative and an absolute path to one file are
  one), the overrides (the last value per key, as absl keeps) and the other arguments.
  Not the interpreter (another virtualenv runs the same point) nor where the compiled
  programs are kept (points of sweeps before the shared cache had none)."""
  args = [str(a) for a in list(argv)[1:]]
  parts, overrides, i = [], {}, 0
  while i < len(args):
    a = args[i]
    if a in ("-m", "--config") and i + 1 < len(args):
      value = args[i + 1]
      if a == "--config":
        path, colon, variant = value.partition(":")
        value = os.path.abspath(path) + colon + variant
      parts.append(shlex.join([a, value]))
      i += 2
      continue
    m = re.match(r"--config\.([^=]+)=", a)
    if m:
      overrides[m.group(1)] = a   # absl keeps the last value of a flag
    else:
      parts.append(shlex.quote(a))
    i += 1
  parts += [shlex.quote(a) for k, a in overrides.items() if k != COMPILE_CACHE_KEY]
  return parts


def changed_command(point: Point, argv: Sequence[str]) -> str | None:
  """How `argv` differs from the command the sweep last finished `point` with (as
  recorded in its done marker), or None: the same, or no record."""
  try:
    with open(os.path.join(point.workdir, DONE_MARKER)) as f:
      before = json.load(f).get("command")
  except (OSError, ValueError):
    return None
  if not isinstance(before, list):
    return None
  old, new = _comparable(before), _comparable(argv)
  if collections.Counter(old) == collections.Counter(new):
    return None
  added = [a for a in new if a not in old]
  dropped = [a for a in old if a not in new]
  return "; ".join(part for part in (f"now also {' '.join(added)}" if added else "",
                                      f"no longer {' '.join(dropped)}" if dropped else "")
                   if part) or "an argument given another number of times"


# ---- the manifest ------------------------------------------------------------------------
def write_manifest(sweep_workdir: str, points: Sequence[Point],
                   argv_of: Callable[[Point], Sequence[str]],
                   outcomes: Sequence[Outcome] | None = None) -> str:
  """sweep.json: every point's name, overrides, directory, command and status (what a
  notebook reads to find the runs)."""
  by = {o.point.name: o for o in outcomes or ()}
  data = {"points": [{"name": p.name, "overrides": p.overrides, "workdir": p.workdir,
                      "command": list(argv_of(p)),
                      "status": by[p.name].status if p.name in by else None,
                      "returncode": by[p.name].returncode if p.name in by else None,
                      "log": p.log} for p in points]}
  os.makedirs(sweep_workdir, exist_ok=True)
  path = os.path.join(sweep_workdir, "sweep.json")
  write_atomic(path, json.dumps(data, indent=2, default=str))
  return path


def write_atomic(path: str, text: str) -> None:
  """`text` into `path` whole or not at all: notebooks read sweep.json and the tables
  while a sweep runs (and rewrites them), and a killed sweep must not leave half a file."""
  tmp = f"{path}.tmp{os.getpid()}-{threading.get_ident()}"
  try:
    with open(tmp, "w") as f:
      f.write(text)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise


def load_points(sweep_workdir: str) -> list[Point]:
  """The points of a sweep, from its sweep.json (written when the sweep starts), each
  with the command the sweep runs it with (so that `finished` and
  `sweep_results.result_rows` count a point finished with another command as not
  finished)."""
  path = os.path.join(sweep_workdir, "sweep.json")
  try:
    with open(path) as f:
      data = json.load(f)
    return [Point(p["name"], dict(p["overrides"]), p["workdir"],
                  tuple(p["command"]) if p.get("command") is not None else None)
            for p in data["points"]]
  except FileNotFoundError:
    raise SweepError(f"{path}: no sweep manifest here (run experiments.sweep with "
                     f"--workdir {sweep_workdir} first)") from None
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise SweepError(f"{path}: unreadable sweep manifest ({type(e).__name__}: {e})") from None
