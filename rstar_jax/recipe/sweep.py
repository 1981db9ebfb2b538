"""Hyper-parameter sweeps over config overrides: points, names, runs, result tables.

A sweep is a list of points; a point is a dict of config overrides (keys are config
paths such as "rl.downsample.method", values python values). Points come from a
config file's `get_sweep()` (big_vision's `get_hyper` style: a list of override
dicts), from command-line axes (`key=v1,v2`, Cartesian product over keys), or both
(every config point crossed with every command-line point). `seed` is a key like any
other, so repeats over seeds are an axis.

Each point runs `python -m <module> --config <spec> --config.k=v ... --config.workdir=<dir>`
in its own work directory `<sweep workdir>/<point name>`, the name made from its
overrides (sorted by key, e.g. `rl.downsample.method=uniform,seed=1`). A point is
finished when its `eval_final.json` exists or the run exited 0 (then `SWEEP_DONE.json`
is written), and the command that finished it is the sweep's (order of the arguments
aside); finished points are skipped on rerun. SIGINT / SIGTERM to the sweep reach every
running point once (`Stop`): they save and stop, and a rerun resumes them. The result
tables read `eval_final.json`
(and the last row of the last RL stage's metrics) of each point and average the
finished points that differ only in `seed`.

This is a base-layer module (stdlib, numpy, ml_collections with its absl flags, and the
stdlib-only rstar_jax.jsonl; config_utils is a layer above); the entry point is
experiments/sweep.py.
"""
from __future__ import annotations

import ast
import collections
import concurrent.futures
import contextlib
import copy
import csv
import dataclasses
import hashlib
import importlib.util
import inspect
import io
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import warnings
from typing import Any, Callable, Mapping, Sequence

import ml_collections
import numpy as np
from absl import flags
from ml_collections import config_flags

from rstar_jax import jsonl



class SweepError(ValueError):
  """A bad sweep: unknown key, value of the wrong type, duplicate point, bad flag."""


ConfigError = SweepError   # local alias (the entry point reports it as a config error)

DONE_MARKER = "SWEEP_DONE.json"
FINAL_REPORT = "eval_final.json"
LOG_NAME = "sweep.log"
SEED_KEY = "seed"
RESERVED_KEYS = ("workdir",)   # the sweep sets it per point
COMPILE_CACHE_KEY = "compile_cache_dir"   # see `shared_overrides`
MAX_NAME = 180                 # characters of a point directory name

# Columns of the tables, from eval_final.json (rstar_jax.eval.metrics.EvalReport).
EVAL_KEYS = ("pass_at_1", "tool_error_rate_correct", "tool_error_rate", "mean_response_tokens",
             "mean_response_tokens_correct", "tool_calls_per_trajectory", "share_no_tool_call",
             "share_truncated", "mean_turns")
# From the last row of the last RL stage's metrics_rl.jsonl, prefixed "last_rl/".
STAGE_KEYS = ("rollout/reward_mean", "rollout/tool_error_rate_correct",
              "rollout/model_tokens_mean")
STAGE_DIRS = ("stage1", "stage2", "stage3")
NO_SIGNAL_KEY = "no_signal_stages"


# ---- values and axes -------------------------------------------------------------------
def _plain(value: Any) -> Any:
  """`value` with numpy scalars (np.logspace's, np.arange's) as the python values they
  hold: a point's values reach it as text, and `repr(np.float64(x))` is
  "np.float64(x)", which no flag parser reads as a number."""
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, (list, tuple)):
    return (tuple if isinstance(value, tuple) else list)(_plain(v) for v in value)
  return value


def split_top_level(text: str, sep: str = ",") -> list[str]:
  """`text` split at `sep` outside brackets and quotes ("(1,2),3" -> ["(1,2)", "3"])."""
  parts, depth, quote, cur = [], 0, None, []
  for ch in text:
    if quote:
      cur.append(ch)
      if ch == quote:
        quote = None
      continue
    if ch in "'\"":
      quote = ch
    elif ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == sep and depth == 0:
      parts.append("".join(cur))
      cur = []
      continue
    cur.append(ch)
  parts.append("".join(cur))
  return [p.strip() for p in parts]


def parse_value(text: str, field_type: type | None = None) -> Any:
  """A command-line value: a python literal (1, 0.5, True, None, (1, 2), 'x') or, failing
  that or for a str field, the text itself."""
  if field_type is str:
    try:
      value = ast.literal_eval(text)
      return value if isinstance(value, str) else text
    except (ValueError, SyntaxError):
      return text
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def _field_type(config, key: str) -> type | None:
  node = config
  parts = key.split(".")
  for part in parts[:-1]:
    if not isinstance(node, (ml_collections.ConfigDict, dict)) or part not in node:
      return None
    node = node[part]
  if isinstance(node, ml_collections.ConfigDict) and parts[-1] in node:
    try:
      return node.get_type(parts[-1])
    except (KeyError, AttributeError):
      return None
  return None


def parse_axis(spec: str, config=None) -> tuple[str, list[Any]]:
  """`"key=v1,v2"` -> (key, [v1, v2]); values typed by the config field when given."""
  key, eq, values = spec.partition("=")
  key = key.strip()
  if not eq or not key or not values.strip():
    raise ConfigError(f"--sweep {spec!r}: expected key=v1,v2,... (e.g. "
                      "rl.downsample.method=roc,uniform)")
  if key.startswith("config."):
    key = key[len("config."):]
  ftype = _field_type(config, key) if config is not None else None
  parsed = [parse_value(v, ftype) for v in split_top_level(values)]
  if any(v == "" for v in parsed):
    raise ConfigError(f"--sweep {spec!r}: empty value")
  return key, parsed


def product(axes: Sequence[tuple[str, Sequence[Any]]]) -> list[dict[str, Any]]:
  """Cartesian product of (key, values) axes, first axis slowest; [{}] for no axes."""
  keys = [k for k, _ in axes]
  dup = sorted({k for k in keys if keys.count(k) > 1})
  if dup:
    raise ConfigError(f"sweep key(s) given twice: {dup}")
  return [dict(zip(keys, combo)) for combo in itertools.product(*(list(v) for _, v in axes))]


def cross(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]) -> list[dict]:
  """Every point of `a` merged with every point of `b` (keys may not overlap)."""
  out = []
  for pa in a:
    for pb in b:
      both = sorted(set(pa) & set(pb))
      if both:
        raise ConfigError(f"sweep key(s) {both} come from both the config's get_sweep() and "
                          "the command line; give each key in one place")
      out.append({**pa, **pb})
  return out


# ---- config files ----------------------------------------------------------------------
def load_config_module(spec: str):
  """(module, variant) of a config spec `path.py[:variant]`."""
  path, _, variant = spec.partition(":")
  if not os.path.isfile(path):
    raise ConfigError(f"--config: no such config file {path!r}")
  mod_spec = importlib.util.spec_from_file_location("_rstar_sweep_cfg", path)
  if mod_spec is None or mod_spec.loader is None:
    raise ConfigError(f"--config: cannot load config file {path!r}")
  module = importlib.util.module_from_spec(mod_spec)
  mod_spec.loader.exec_module(module)
  return module, variant


def _call_with_variant(fn, variant: str):
  """`fn(variant)` when it takes an argument (big_vision's get_hyper(arg)), else `fn()`."""
  return fn(variant) if inspect.signature(fn).parameters else fn()


def load_config(spec: str):
  module, variant = load_config_module(spec)
  return module.get_config(variant) if variant else module.get_config()


def load_sweep(spec: str) -> list[dict[str, Any]] | None:
  """The config file's `get_sweep([variant])` points, checked to be a list of dicts
  with string keys; None when the file defines no get_sweep."""
  module, variant = load_config_module(spec)
  fn = getattr(module, "get_sweep", None)
  if fn is None:
    return None
  points = _call_with_variant(fn, variant)
  where = f"{spec.partition(':')[0]}: get_sweep()"
  if not isinstance(points, (list, tuple)) or not points:
    raise ConfigError(f"{where} must return a non-empty list of override dicts, got "
                      f"{type(points).__name__}")
  out = []
  for i, p in enumerate(points):
    if not isinstance(p, Mapping) or not all(isinstance(k, str) for k in p):
      raise ConfigError(f"{where}[{i}]: expected a dict of config path -> value, got {p!r}")
    out.append({k: _plain(v) for k, v in p.items()})
  return out


def validate(points: Sequence[Mapping[str, Any]], config,
             build: Callable[[Any], Any] | None = None) -> None:
  """Every key exists in `config` (else the valid keys there are named) and every value
  fits its field's type and reads back the same from the flag the point gets
  (`--config.k=<format_value(v)>`, parsed as the point's entry point parses it);
  reserved keys (workdir), None values, bools for non-bool fields and duplicate points
  are refused. With `build` (the entry point's config builder, e.g. `recipe.build_config`),
  each point's whole config is built too, so that a value its dataclass refuses (an
  unknown method, a negative step count) stops the sweep before any point runs."""
  seen: dict[str, int] = {}
  read_back: set[tuple[str, str]] = set()   # (key, flag text) already checked: once each
  for i, p in enumerate(points):
    node = copy.deepcopy(config)
    for key, value in p.items():
      value = _plain(value)
      if key in RESERVED_KEYS:
        raise ConfigError(f"sweep key {key!r} is set by the sweep itself (one directory per "
                          "point under --workdir); do not sweep it")
      walk, walked = config, []
      for part in key.split("."):
        if not isinstance(walk, (ml_collections.ConfigDict, dict)) or part not in walk:
          where = ".".join(walked) or "<top level>"
          known = (sorted(walk.keys()) if isinstance(walk, (ml_collections.ConfigDict, dict))
                   else f"none ({where} is a {type(walk).__name__} field)")
          raise ConfigError(f"sweep key {key!r}: unknown config key {part!r} under {where}; "
                            f"known keys there: {known}")
        walk = walk[part]
        walked.append(part)
      if value is None:
        # Each point's values reach it as --config.<key>=<text>, and the flag parser
        # reads "None" as a value of the field's type, not as None.
        raise ConfigError(f"sweep point {i} ({point_name(p)}): {key}=None cannot be passed "
                          "on the command line; set it in the config file (a variant) instead")
      parent, _, leaf = key.rpartition(".")
      target = node
      for part in parent.split(".") if parent else ():
        target = target[part]
      if isinstance(target[leaf], ml_collections.ConfigDict):
        raise ConfigError(f"sweep key {key!r} is a config section, not a field; sweep one of "
                          f"its fields: {sorted(target[leaf].keys())}")
      ftype = _field_type(config, key)
      if isinstance(value, bool) and ftype not in (None, bool, object, type(None)):
        # The config casts True to 1.0 for a float field, but the point gets the text
        # "True", which a float or int flag refuses.
        raise ConfigError(f"sweep point {i} ({point_name(p)}): {key}={value!r} is a bool, but "
                          f"the field is of type {ftype.__name__}; give a {ftype.__name__}")
      try:
        setattr(target, leaf, value)
      except (TypeError, ValueError) as e:
        raise ConfigError(f"sweep point {i} ({point_name(p)}): {key}={value!r} does not fit "
                          f"the config field: {e}") from None
      if (isinstance(config, ml_collections.ConfigDict)
          and (key, format_value(value)) not in read_back):
        _check_flag(i, p, key, value, target[leaf], config)
        read_back.add((key, format_value(value)))
    if build is not None:
      try:
        build(node)
      except (TypeError, ValueError) as e:   # ConfigError is a ValueError
        raise ConfigError(f"sweep point {i} ({point_name(p)}): {e}") from None
    name = point_name(p)
    if name in seen:
      raise ConfigError(f"sweep points {seen[name]} and {i} are the same ({name})")
    seen[name] = i


def _child_reads(config, key: str, text: str) -> Any:
  """The value of `key` after `--config.<key>=<text>`, parsed by config_flags as a point's
  entry point parses it (each field type has its own parser: float, int, bool, tuple...)."""
  argv = ["sweep", f"--config.{key}={text}"]
  fv = flags.FlagValues()
  holder = config_flags.DEFINE_config_dict("config", copy.deepcopy(config), flag_values=fv,
                                           sys_argv=argv)
  fv(argv)
  node = holder.value
  for part in key.split("."):
    node = node[part]
  return node


def _check_flag(i: int, point: Mapping[str, Any], key: str, value: Any, held: Any,
                config) -> None:
  """`value`, which the config holds as `held`, reaches the point as the same value: its
  flag text must parse back to `held` under the field's type, or the point would fail
  (or run another setting) after the sweep accepted it."""
  text = format_value(value)
  where = f"sweep point {i} ({point_name(point)}): {key}={value!r} reaches the point as " \
          f"--config.{key}={text}"
  try:
    got = _child_reads(config, key, text)
  except (flags.Error, TypeError, ValueError) as e:
    raise ConfigError(f"{where}, which its flag parser refuses: {e}") from None
  # repr too: nan reads back as nan, yet nan != nan.
  if type(got) is not type(held) or (got != held and repr(got) != repr(held)):
    raise ConfigError(f"{where}, which it reads back as {got!r}, not {held!r}; give a value "
                      f"of the field's type ({type(held).__name__})")


def check_shared(base_overrides: Mapping[str, Any], child_args: Sequence[str],
                 points: Sequence[Mapping[str, Any]]) -> None:
  """The `--config.k=v` overrides and the extra arguments every point gets leave alone
  what the sweep sets per point: a reserved key (workdir), a swept key, the config file.

  absl keeps the last of two values for one flag, so a base `--config.workdir=...` (given
  out of habit, as to every other entry point) would send every point into one directory,
  and the sweep would then count points finished whose results are elsewhere."""
  swept = sorted({k for p in points for k in p})
  reserved = sorted(set(base_overrides) & set(RESERVED_KEYS))
  if reserved:
    raise ConfigError(f"--config.{reserved[0]}=... is set by the sweep itself (<--workdir>/"
                      "<point name> for each point); drop it (the sweep's own directory is "
                      "--workdir)")
  both = sorted(set(base_overrides) & set(swept))
  if both:
    raise ConfigError(f"key(s) {both} are both swept and set with --config.<key>=...; give "
                      "each in one place")
  for arg in child_args:
    # The forms config_flags reads as an override: -config.k, --config.k=v, --noconfig.k.
    m = re.match(r"-{1,2}(no)?config\.([^=]+)", arg)
    key = m.group(2) if m else None
    if key in RESERVED_KEYS:
      raise ConfigError(f"--child_arg {arg!r}: config.{key} is set by the sweep itself "
                        "(<--workdir>/<point name> for each point); drop it")
    if key in swept:
      raise ConfigError(f"--child_arg {arg!r}: config.{key} is swept; give each key in one "
                        "place")
    if re.match(r"-{1,2}config(=|$)", arg):
      raise ConfigError(f"--child_arg {arg!r}: the sweep passes its own --config to every "
                        "point; give the config file as the sweep's --config")


def shared_overrides(config, base_overrides: Mapping[str, Any],
                     points: Sequence[Mapping[str, Any]], sweep_workdir: str) -> dict[str, Any]:
  """Overrides the sweep adds for every point: one compile cache for all of them.

  A config with a top-level `compile_cache_dir` field (the recipe's) gets
  <sweep dir>/compile_cache, unless the sweep's command line sets or sweeps it. The
  points' programs differ in neither shape nor code across seeds and most swept values,
  so each later point loads them instead of compiling (JAX's cache is safe to share
  between processes, `rstar_jax/compile_cache.py`).
  """
  key = COMPILE_CACHE_KEY
  if key not in config or key in base_overrides or any(key in p for p in points):
    return {}
  return {key: os.path.join(os.path.abspath(sweep_workdir), "compile_cache")}


# ---- names and commands ----------------------------------------------------------------
def format_value(value: Any) -> str:
  """A value as absl/config_flags reads it back (`--config.k=<this>`)."""
  value = _plain(value)
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
  elsewhere; `check_shared` refuses them too)."""
  return [python, "-m", module, "--config", config_spec, *override_args(base_overrides or {}),
          *override_args(point.overrides), *extra_args, f"--config.workdir={point.workdir}"]


def finished(point: Point, argv: Sequence[str] | None = None) -> str | None:
  """Why `point` counts as finished (its marker's path), or None.

  With `argv` (the command the sweep would run now; by default the one sweep.json
  records for a point from `load_points`), a point the sweep finished with another
  command does not count (`changed_command`): it runs again, and the run decides (the
  recipe resumes what is left, or refuses a config that changed under finished stages),
  instead of the sweep reporting results of other settings."""
  if argv is None:
    argv = point.command
  path = _marker(point)
  if path and argv is not None and changed_command(point, argv):
    return None
  return path


def _marker(point: Point) -> str | None:
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


# ---- running ---------------------------------------------------------------------------
@dataclasses.dataclass
class Outcome:
  point: Point
  # "done" (ran now), "skipped" (finished before), "failed", "interrupted" (stopped by
  # SIGINT / SIGTERM: a rerun resumes it), "not started" (the sweep was stopped first).
  status: str
  returncode: int | None = None
  seconds: float = 0.0
  detail: str = ""


# Exit statuses of a child stopped by Ctrl-C or SIGTERM (a preemption): the recipe's
# 128 + signal after it saved, or killed by the signal itself.
_INTERRUPTED = tuple(x for s in (signal.SIGINT, signal.SIGTERM) for x in (128 + s, -s))
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _signal_name(signum: int) -> str:
  try:
    return signal.Signals(signum).name
  except ValueError:
    return f"signal {signum}"


class Stop:
  """SIGINT / SIGTERM to the sweep, passed on to the points it runs.

  Each point runs in its own process group: a Ctrl-C at the terminal reaches the sweep
  alone (the terminal signals its foreground group), and the sweep sends each running
  point's group the signal it got, exactly once per signal received. A point thus gets
  one SIGINT for one Ctrl-C (a second one would make the recipe abort without saving),
  and a SIGTERM from a scheduler, which reaches only the sweep's PID, reaches the points
  too. No point starts after a signal. A point is started with PR_SET_PDEATHSIG =
  SIGTERM on Linux: a sweep killed outright (SIGKILL, an OOM kill) still stops its
  points the way a scheduler would, checkpoint included, instead of orphaning them.

  As a context manager (in the main thread), it installs the handlers explicitly:
  a background job of a non-interactive shell starts with SIGINT ignored, and
  Python then leaves it ignored. Handlers run in the main thread, so the lock below
  is never held by the thread a handler interrupts.
  """

  def __init__(self, log: Callable[[str], None] = print):
    self.signum: int | None = None    # the first signal received
    self.received = 0
    self._log = log
    self._lock = threading.Lock()
    self._running: dict[str, subprocess.Popen] = {}
    self._old: dict[int, Any] = {}

  @property
  def requested(self) -> bool:
    return self.signum is not None

  @property
  def name(self) -> str:
    return _signal_name(self.signum) if self.signum is not None else ""

  def __enter__(self) -> "Stop":
    if threading.current_thread() is threading.main_thread():
      self._old = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
    return self

  def __exit__(self, *exc) -> None:
    for s, old in self._old.items():
      signal.signal(s, old)
    self._old = {}

  def _handle(self, signum, frame) -> None:
    del frame
    self.request(signum)

  def request(self, signum: int) -> None:
    """Stops the sweep on `signum`: no point starts; the running ones get `signum`."""
    with self._lock:
      first = self.signum is None
      if first:
        self.signum = signum
      self.received += 1
      running = dict(self._running)
      for proc in running.values():
        _signal_group(proc, signum)
    name = _signal_name(signum)
    if not running:
      self._log(f"[sweep] {name} received: no point is running; none is started")
    elif first:
      self._log(f"[sweep] {name} received: sent to the {len(running)} running point(s) "
                f"({', '.join(running)}), which save and stop; none is started. Waiting "
                "for them (a rerun resumes them)")
    else:
      self._log(f"[sweep] {name} received again: sent to the {len(running)} running "
                "point(s) again (a second SIGINT makes a recipe stop at once, without "
                "saving the step in flight); waiting for them")

  def start(self, name: str, argv: Sequence[str], **kwargs) -> subprocess.Popen | None:
    """The point's process, started in its own process group and registered (None when
    the sweep is stopping): under the lock, so a signal reaches it exactly once."""
    with self._lock:
      if self.signum is not None:
        return None
      proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL,
                              preexec_fn=_point_preexec(os.getpid()), **kwargs)
      self._running[name] = proc
      return proc

  def finished(self, name: str) -> None:
    with self._lock:
      self._running.pop(name, None)


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
  with contextlib.suppress(ProcessLookupError, PermissionError):
    if proc.poll() is None:
      os.killpg(proc.pid, signum)


def _point_preexec(parent: int) -> Callable[[], None]:
  """What a point's process does between fork and exec: its own process group, SIGINT
  and SIGTERM at their defaults (a sweep started in the background passes SIGINT on
  ignored, and a point would then miss the Ctrl-C the sweep forwards before its own
  handlers are installed), and SIGTERM when the sweep dies (Linux). The kernel sends
  that signal when the *thread* that forked the point ends: the worker thread that
  starts a point waits for it (`_run_one`), so it outlives the point unless the sweep
  dies."""
  prctl = None
  if sys.platform.startswith("linux"):
    import ctypes
    with contextlib.suppress(OSError, AttributeError):
      prctl = ctypes.CDLL(None, use_errno=True).prctl
  pr_set_pdeathsig = 1

  def preexec() -> None:
    os.setpgid(0, 0)
    for s in STOP_SIGNALS:
      signal.signal(s, signal.SIG_DFL)
    if prctl is not None:
      prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
      if os.getppid() != parent:   # the sweep died before prctl: stop now
        os.kill(os.getpid(), signal.SIGTERM)
  return preexec


def _run_one(point: Point, argv: Sequence[str], env: Mapping[str, str] | None,
             cwd: str | None, stop: Stop) -> Outcome:
  os.makedirs(point.workdir, exist_ok=True)
  t0 = time.time()
  with open(point.log, "a") as log:
    log.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(argv)}\n")
    log.flush()
    try:
      proc = stop.start(point.name, argv, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                        env=None if env is None else dict(env))
    except OSError as e:
      log.write(f"# could not start: {e}\n")
      return Outcome(point, "failed", None, time.time() - t0, f"could not start: {e}")
    if proc is None:
      return Outcome(point, "not started", None, 0.0,
                     f"not started ({stop.name} received before it)")
    try:
      rc = proc.wait()
    finally:
      stop.finished(point.name)
  seconds = time.time() - t0
  if rc != 0:
    if rc in _INTERRUPTED:
      sig = _signal_name(rc - 128 if rc > 0 else -rc)
      how = (f"saved and exited with status {rc}" if rc > 0 else
             f"killed by {sig} before it could save")
      return Outcome(point, "interrupted", rc, seconds, f"stopped by {sig} ({how})")
    return Outcome(point, "failed", rc, seconds, f"exit status {rc}")
  _write_atomic(os.path.join(point.workdir, DONE_MARKER),
                json.dumps({"command": list(argv), "overrides": point.overrides,
                            "returncode": rc, "seconds": round(seconds, 1)},
                           indent=2, default=str))
  return Outcome(point, "done", rc, seconds)


def run_points(points: Sequence[Point], argv_of: Callable[[Point], Sequence[str]], *,
               workers: int = 1, env: Mapping[str, str] | None = None, cwd: str | None = None,
               log: Callable[[str], None] = print, stop: Stop | None = None) -> list[Outcome]:
  """Runs the unfinished points, up to `workers` at once; a failed point is reported
  with its log and the others go on. Outcomes are in the order of `points`.

  SIGINT / SIGTERM (see `Stop`; pass one to read which signal stopped the sweep) are
  passed on to the running points, which save and stop (status "interrupted": a rerun
  resumes them); the points not started yet are "not started"; this returns when every
  running point has exited."""
  if workers < 1:
    raise ConfigError(f"--workers must be >= 1, got {workers}")
  outcomes: dict[str, Outcome] = {}
  todo = []
  for p in points:
    marker = finished(p)
    changed = marker and changed_command(p, argv_of(p))
    if marker and not changed:
      outcomes[p.name] = Outcome(p, "skipped", detail=marker)
      log(f"[sweep] {p.name}: finished before ({marker}), skipped")
    else:
      if changed:
        log(f"[sweep] {p.name}: finished before with another command ({changed}); running "
            "it again with this one (a recipe resumes what is left, or refuses a changed config)")
      todo.append(p)
  lock = threading.Lock()
  count = [0]
  own = stop is None
  stop = Stop(log) if own else stop

  def one(p: Point) -> Outcome:
    if stop.requested:
      return Outcome(p, "not started", None, 0.0, f"not started ({stop.name} received before it)")
    with lock:
      log(f"[sweep] start {p.name} (log: {p.log})")
    out = _run_one(p, argv_of(p), env, cwd, stop)
    with lock:
      if out.status == "not started":
        return out
      count[0] += 1
      head = f"[sweep] {count[0]}/{len(todo)}"
      if out.status == "interrupted":
        log(f"{head} interrupted {p.name} after {out.seconds:.0f} s: {out.detail}; a rerun "
            f"resumes it; log: {p.log}")
      elif out.status == "failed":
        log(f"{head} FAILED {p.name}: {out.detail} after {out.seconds:.0f} s; log: {p.log}")
      else:
        log(f"{head} done {p.name} in {out.seconds:.0f} s")
    return out

  if todo:
    with stop if own else contextlib.nullcontext():
      with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        for out in pool.map(one, todo):
          outcomes[out.point.name] = out
  return [outcomes[p.name] for p in points]


# ---- results ---------------------------------------------------------------------------
def point_metrics(point: Point) -> dict[str, Any]:
  """The point's final metrics: EVAL_KEYS (+ pass@k) from eval_final.json, and the last
  row of the last RL stage's metrics_rl.jsonl as `last_rl/<key>`. {} when neither exists."""
  out: dict[str, Any] = {}
  path = os.path.join(point.workdir, FINAL_REPORT)
  if os.path.exists(path):
    try:
      with open(path) as f:
        report = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
      raise ConfigError(f"{path}: unreadable report ({e})") from None
    for k in EVAL_KEYS:
      if k in report:
        out[k] = report[k]
    for k, v in sorted((report.get("pass_at_k") or {}).items(), key=lambda kv: int(kv[0])):
      if str(k) != "1":
        out[f"pass_at_{k}"] = v
  for stage in reversed(STAGE_DIRS):
    path = os.path.join(point.workdir, stage, "metrics_rl.jsonl")
    if os.path.exists(path):
      row = jsonl.last_jsonl_row(path)
      if row:
        out["last_rl/stage"] = stage
        out["last_rl/step"] = row.get("step")
        for k in STAGE_KEYS:
          if k in row:
            out[f"last_rl/{k.split('/', 1)[-1]}"] = row[k]
      break
  # RL stages that trained without a learning signal (every group all-correct or
  # all-wrong: zero advantages), from their DONE.json; "none" when every finished stage
  # had one, absent when no RL stage finished.
  done = {}
  for stage in STAGE_DIRS:
    path = os.path.join(point.workdir, stage, "DONE.json")
    if os.path.exists(path):
      try:
        with open(path) as f:
          done[stage] = json.load(f)
      except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: unreadable stage marker ({e})") from None
  if done:
    out[NO_SIGNAL_KEY] = " ".join(s for s, d in done.items()
                                  if d.get("no_learning_signal")) or "none"
  return out


def result_rows(points: Sequence[Point], outcomes: Sequence[Outcome] | None = None
                ) -> tuple[list[dict[str, Any]], list[str]]:
  """One row per point (name, status, swept keys, metrics) and the metric columns.

  Status: "finished", "failed" or "interrupted" from `outcomes`; without them (a
  notebook reading a sweep) "finished" when its marker holds (for points from
  `load_points`: with the command sweep.json records), "stale" when it finished with
  another command (its results are of other settings), else "missing"."""
  status = {o.point.name: o.status for o in outcomes or ()}
  keys = sorted({k for p in points for k in p.overrides})
  rows, metric_cols = [], []
  for p in points:
    m = point_metrics(p)
    st = status.get(p.name) or ("finished" if finished(p) else
                                "stale" if _marker(p) else "missing")
    if st in ("skipped", "done"):
      st = "finished"
    row = {"point": p.name, "status": st}
    row.update({k: format_value(p.overrides[k]) if k in p.overrides else "" for k in keys})
    row.update(m)
    for k in m:
      if k not in metric_cols:
        metric_cols.append(k)
    rows.append(row)
  order = [k for k in EVAL_KEYS if k in metric_cols]
  order += sorted(k for k in metric_cols if k.startswith("pass_at_") and k not in order)
  order += [k for k in metric_cols if k not in order]
  for row in rows:   # a metric a point lacks (null, no such key) is missing: "n/a"
    for k in order:
      row.setdefault(k, None)
  return rows, ["point", "status", *keys, *order]


def _numeric(v) -> float | None:
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    return None
  return float(v) if np.isfinite(v) else None


def seed_rows(points: Sequence[Point], rows: Sequence[Mapping[str, Any]],
              metric_cols: Sequence[str]) -> tuple[list[dict[str, Any]], list[str]]:
  """Points that differ only in `seed`, grouped: n finished points, the seeds left out
  (with their status), then per metric "mean ± std" over the finished points that have
  a value (a missing one, e.g. a tool-error rate inside correct trajectories of a run
  with none correct, is skipped, never counted as 0; std with ddof=1, as over repeated
  runs; only the mean for one value; "(n=k)" when k values are fewer than the group's
  points; None, "n/a" in the tables, when no point has one). Raw `<metric>_mean` /
  `<metric>_std` go in the dict too (for CSV)."""
  # Which stages lacked a learning signal is text, not a metric: counted per group.
  metric_cols = [c for c in metric_cols if c != NO_SIGNAL_KEY]
  groups: dict[str, list[int]] = {}
  rest_of: dict[str, dict[str, Any]] = {}
  for i, p in enumerate(points):
    rest = {k: v for k, v in p.overrides.items() if k != SEED_KEY}
    g = point_name(rest)
    groups.setdefault(g, []).append(i)
    rest_of[g] = rest
  keys = sorted({k for r in rest_of.values() for k in r})
  out = []
  for g, idx in groups.items():
    row: dict[str, Any] = {"group": g}
    row.update({k: format_value(rest_of[g][k]) if k in rest_of[g] else "" for k in keys})
    seeds = [points[i].overrides.get(SEED_KEY) for i in idx]
    # A sweep without a seed axis: no seeds to list, and a point left out is named.
    label = lambda i: (str(points[i].overrides[SEED_KEY]) if SEED_KEY in points[i].overrides
                       else points[i].name)
    row["seeds"] = " ".join(str(s) for s in seeds if s is not None)
    # Only finished points count: an interrupted run's last RL row is from an early step,
    # and a failed or stale point's eval_final.json is from an earlier command.
    done = [i for i in idx if rows[i]["status"] == "finished"]
    row["n"] = len(done)
    row["left out"] = ", ".join(f"{label(i)} ({rows[i]['status']})"
                                for i in idx if i not in done)
    marked = [rows[i].get(NO_SIGNAL_KEY) for i in done if rows[i].get(NO_SIGNAL_KEY)]
    row["no signal"] = (f"{sum(m != 'none' for m in marked)} of {len(marked)}"
                        if marked else None)
    for col in metric_cols:
      vals = [x for x in (_numeric(rows[i].get(col)) for i in done) if x is not None]
      if not vals:
        row[col] = None
        continue
      mean = float(np.mean(vals))
      std = float(np.std(vals, ddof=1)) if len(vals) > 1 else None
      row[f"{col}_mean"], row[f"{col}_std"] = mean, std
      row[col] = _fmt(mean) + (f" ± {_fmt(std)}" if std is not None else "") + \
          (f" (n={len(vals)})" if len(vals) != len(idx) else "")
    out.append(row)
  signal_col = ["no signal"] if any(NO_SIGNAL_KEY in r for r in rows) else []
  return out, ["group", *keys, "seeds", "n", "left out", *signal_col, *metric_cols]


def _fmt(v: Any) -> str:
  if v is None:   # a missing value (rollout/stats.py): never 0, never a blank
    return "n/a"
  if isinstance(v, float):
    return f"{v:.4g}"
  return str(v)


def markdown(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
  esc = lambda s: _fmt(s).replace("|", "\\|")   # None: "n/a"; an absent cell: blank
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(esc(r.get(c, "")) for c in columns) + " |" for r in rows]
  return "\n".join(lines)


def to_csv(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
  buf = io.StringIO()
  w = csv.DictWriter(buf, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
  w.writeheader()
  for r in rows:
    w.writerow({c: "" if r.get(c) is None else r.get(c) for c in columns})
  return buf.getvalue()


def write_tables(sweep_workdir: str, points: Sequence[Point],
                 outcomes: Sequence[Outcome] | None = None) -> str:
  """results.csv (one row per point), results_seeds.csv (mean and std over seeds) and
  results.md (both tables) in the sweep work directory; returns the markdown."""
  rows, cols = result_rows(points, outcomes)
  metric_cols = [c for c in cols if c not in ("point", "status", NO_SIGNAL_KEY) and
                 not any(c in p.overrides for p in points)]
  grouped, gcols = seed_rows(points, rows, metric_cols)
  gcsv_cols = [c for c in gcols if c not in metric_cols]
  for c in metric_cols:
    gcsv_cols += [f"{c}_mean", f"{c}_std"]
  os.makedirs(sweep_workdir, exist_ok=True)
  _write_atomic(os.path.join(sweep_workdir, "results.csv"), to_csv(rows, cols))
  _write_atomic(os.path.join(sweep_workdir, "results_seeds.csv"), to_csv(grouped, gcsv_cols))
  md = ("## Final metrics per point\n\n" + markdown(rows, cols) +
        "\n\n## Mean ± std over seeds (points that differ only in `seed`; finished points "
        "only, the others are left out; std ddof=1)\n\n" + markdown(grouped, gcols) + "\n")
  _write_atomic(os.path.join(sweep_workdir, "results.md"), md)
  return md


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
  _write_atomic(path, json.dumps(data, indent=2, default=str))
  return path


def _write_atomic(path: str, text: str) -> None:
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


def python_executable() -> str:
  return sys.executable or "python"


# ---- curves (what a notebook plots) -------------------------------------------------------
def load_points(sweep_workdir: str) -> list[Point]:
  """The points of a sweep, from its sweep.json (written when the sweep starts), each
  with the command the sweep runs it with (so that `finished` and `result_rows` count
  a point finished with another command as not finished)."""
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


def point_curves(point: Point, keys: Sequence[str]) -> dict[str, np.ndarray]:
  """Per RL step of a point, stages one after another: "step" (1, 2, ... across stages),
  "stage" (its index in STAGE_DIRS) and each key of `keys` (NaN where a row lacks it).
  Rows that do not parse (a killed run's torn last line) are left out."""
  rows, stages = [], []
  for i, stage in enumerate(STAGE_DIRS):
    path = os.path.join(point.workdir, stage, "metrics_rl.jsonl")
    if not os.path.exists(path):
      continue
    with open(path) as f:
      for line in f:
        try:
          row = json.loads(line)
        except json.JSONDecodeError:
          continue
        if isinstance(row, dict):
          rows.append(row)
          stages.append(i)
  out = {"step": np.arange(1, len(rows) + 1), "stage": np.asarray(stages, dtype=int)}
  for k in keys:
    vals = [_numeric(r.get(k)) for r in rows]
    out[k] = np.asarray([np.nan if v is None else v for v in vals], dtype=float)
  return out


def seed_curves(points: Sequence[Point], key: str) -> dict[str, dict[str, np.ndarray]]:
  """`key` per RL step for every group of points that differ only in `seed`: "step",
  "mean", "std" (ddof=1; NaN with one seed) and "n" (seeds with a value at that step),
  up to the longest run of the group."""
  groups: dict[str, list[np.ndarray]] = {}
  for p in points:
    rest = {k: v for k, v in p.overrides.items() if k != SEED_KEY}
    groups.setdefault(point_name(rest), []).append(point_curves(p, [key])[key])
  out = {}
  for g, curves in groups.items():
    length = max((len(c) for c in curves), default=0)
    table = np.full((len(curves), length), np.nan)
    for i, c in enumerate(curves):
      table[i, :len(c)] = c
    n = np.sum(~np.isnan(table), axis=0)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
      warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: mean is NaN
      mean = np.nanmean(table, axis=0) if length else np.zeros(0)
      std = np.nanstd(table, axis=0, ddof=1) if length else np.zeros(0)
    std = np.where(n > 1, std, np.nan)
    out[g] = {"step": np.arange(1, length + 1), "mean": mean, "std": std, "n": n}
  return out
