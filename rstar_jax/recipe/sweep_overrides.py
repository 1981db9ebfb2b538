"""A sweep's overrides: where its points come from, parsed and checked before any runs.

Points come from a config file's `get_sweep()` (big_vision's `get_hyper` style: a list of
override dicts), from command-line axes (`key=v1,v2`, Cartesian product over keys), or
both (every config point crossed with every command-line point). `seed` is a key like any
other, so repeats over seeds are an axis. Every key and value is checked against the config
(and read back through the flag parser a point uses) before any point runs.
"""
from __future__ import annotations

import ast
import copy
import importlib.util
import inspect
import itertools
import os
import re
from typing import Any, Callable, Mapping, Sequence

import ml_collections
from absl import flags
from ml_collections import config_flags

from rstar_jax.recipe import sweep_points

RESERVED_KEYS = ("workdir",)   # the sweep sets it per point


# ---- values and axes -------------------------------------------------------------------
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
    raise sweep_points.SweepError(f"--sweep {spec!r}: expected key=v1,v2,... (e.g. "
                                  "rl.downsample.method=roc,uniform)")
  if key.startswith("config."):
    key = key[len("config."):]
  ftype = _field_type(config, key) if config is not None else None
  parsed = [parse_value(v, ftype) for v in split_top_level(values)]
  if any(v == "" for v in parsed):
    raise sweep_points.SweepError(f"--sweep {spec!r}: empty value")
  return key, parsed


def product(axes: Sequence[tuple[str, Sequence[Any]]]) -> list[dict[str, Any]]:
  """Cartesian product of (key, values) axes, first axis slowest; [{}] for no axes."""
  keys = [k for k, _ in axes]
  dup = sorted({k for k in keys if keys.count(k) > 1})
  if dup:
    raise sweep_points.SweepError(f"sweep key(s) given twice: {dup}")
  return [dict(zip(keys, combo)) for combo in itertools.product(*(list(v) for _, v in axes))]


def cross(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]) -> list[dict]:
  """Every point of `a` merged with every point of `b` (keys may not overlap)."""
  out = []
  for pa in a:
    for pb in b:
      both = sorted(set(pa) & set(pb))
      if both:
        raise sweep_points.SweepError(
            f"sweep key(s) {both} come from both the config's get_sweep() and "
            "the command line; give each key in one place")
      out.append({**pa, **pb})
  return out


# ---- config files ----------------------------------------------------------------------
def load_config_module(spec: str):
  """(module, variant) of a config spec `path.py[:variant]`."""
  path, _, variant = spec.partition(":")
  if not os.path.isfile(path):
    raise sweep_points.SweepError(f"--config: no such config file {path!r}")
  mod_spec = importlib.util.spec_from_file_location("_rstar_sweep_cfg", path)
  if mod_spec is None or mod_spec.loader is None:
    raise sweep_points.SweepError(f"--config: cannot load config file {path!r}")
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
    raise sweep_points.SweepError(f"{where} must return a non-empty list of override dicts, got "
                                  f"{type(points).__name__}")
  out = []
  for i, p in enumerate(points):
    if not isinstance(p, Mapping) or not all(isinstance(k, str) for k in p):
      raise sweep_points.SweepError(
          f"{where}[{i}]: expected a dict of config path -> value, got {p!r}")
    out.append({k: sweep_points.plain_value(v) for k, v in p.items()})
  return out


def validate(points: Sequence[Mapping[str, Any]], config,
             build: Callable[[Any], Any] | None = None) -> None:
  """Every key exists in `config` (else the valid keys there are named) and every value
  fits its field's type and reads back the same from the flag the point gets
  (`--config.k=<format_value(v)>`, parsed as the point's entry point parses it);
  reserved keys (workdir), None values, bools for non-bool fields and duplicate points
  are refused. With `build` (the entry point's config builder, e.g.
  `recipe_config.build_config`), each point's whole config is built too, so that a value
  its dataclass refuses (an unknown method, a negative step count) stops the sweep
  before any point runs."""
  seen: dict[str, int] = {}
  read_back: set[tuple[str, str]] = set()   # (key, flag text) already checked: once each
  for i, p in enumerate(points):
    node = copy.deepcopy(config)
    for key, value in p.items():
      value = sweep_points.plain_value(value)
      if key in RESERVED_KEYS:
        raise sweep_points.SweepError(
            f"sweep key {key!r} is set by the sweep itself (one directory per "
            "point under --workdir); do not sweep it")
      walk, walked = config, []
      for part in key.split("."):
        if not isinstance(walk, (ml_collections.ConfigDict, dict)) or part not in walk:
          where = ".".join(walked) or "<top level>"
          known = (sorted(walk.keys()) if isinstance(walk, (ml_collections.ConfigDict, dict))
                   else f"none ({where} is a {type(walk).__name__} field)")
          raise sweep_points.SweepError(
              f"sweep key {key!r}: unknown config key {part!r} under {where}; "
              f"known keys there: {known}")
        walk = walk[part]
        walked.append(part)
      if value is None:
        # Each point's values reach it as --config.<key>=<text>, and the flag parser
        # reads "None" as a value of the field's type, not as None.
        raise sweep_points.SweepError(
            f"sweep point {i} ({sweep_points.point_name(p)}): {key}=None cannot be passed "
            "on the command line; set it in the config file (a variant) instead")
      parent, _, leaf = key.rpartition(".")
      target = node
      for part in parent.split(".") if parent else ():
        target = target[part]
      if isinstance(target[leaf], ml_collections.ConfigDict):
        raise sweep_points.SweepError(
            f"sweep key {key!r} is a config section, not a field; sweep one of "
            f"its fields: {sorted(target[leaf].keys())}")
      ftype = _field_type(config, key)
      if isinstance(value, bool) and ftype not in (None, bool, object, type(None)):
        # The config casts True to 1.0 for a float field, but the point gets the text
        # "True", which a float or int flag refuses.
        raise sweep_points.SweepError(
            f"sweep point {i} ({sweep_points.point_name(p)}): {key}={value!r} is a bool, but "
            f"the field is of type {ftype.__name__}; give a {ftype.__name__}")
      try:
        setattr(target, leaf, value)
      except (TypeError, ValueError) as e:
        raise sweep_points.SweepError(
            f"sweep point {i} ({sweep_points.point_name(p)}): {key}={value!r} does not fit "
            f"the config field: {e}") from None
      if (isinstance(config, ml_collections.ConfigDict) and
          (key, sweep_points.format_value(value)) not in read_back):
        _check_flag(i, p, key, value, target[leaf], config)
        read_back.add((key, sweep_points.format_value(value)))
    if build is not None:
      try:
        build(node)
      except (TypeError, ValueError) as e:   # ConfigError is a ValueError
        raise sweep_points.SweepError(
            f"sweep point {i} ({sweep_points.point_name(p)}): {e}") from None
    name = sweep_points.point_name(p)
    if name in seen:
      raise sweep_points.SweepError(f"sweep points {seen[name]} and {i} are the same ({name})")
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
  text = sweep_points.format_value(value)
  where = (f"sweep point {i} ({sweep_points.point_name(point)}): {key}={value!r} reaches the "
           f"point as --config.{key}={text}")
  try:
    got = _child_reads(config, key, text)
  except (flags.Error, TypeError, ValueError) as e:
    raise sweep_points.SweepError(f"{where}, which its flag parser refuses: {e}") from None
  # repr too: nan reads back as nan, yet nan != nan.
  if type(got) is not type(held) or (got != held and repr(got) != repr(held)):
    raise sweep_points.SweepError(
        f"{where}, which it reads back as {got!r}, not {held!r}; give a value "
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
    raise sweep_points.SweepError(
        f"--config.{reserved[0]}=... is set by the sweep itself (<--workdir>/"
        "<point name> for each point); drop it (the sweep's own directory is "
        "--workdir)")
  both = sorted(set(base_overrides) & set(swept))
  if both:
    raise sweep_points.SweepError(
        f"key(s) {both} are both swept and set with --config.<key>=...; give "
        "each in one place")
  for arg in child_args:
    # The forms config_flags reads as an override: -config.k, --config.k=v, --noconfig.k.
    m = re.match(r"-{1,2}(no)?config\.([^=]+)", arg)
    key = m.group(2) if m else None
    if key in RESERVED_KEYS:
      raise sweep_points.SweepError(f"--child_arg {arg!r}: config.{key} is set by the sweep itself "
                                    "(<--workdir>/<point name> for each point); drop it")
    if key in swept:
      raise sweep_points.SweepError(
          f"--child_arg {arg!r}: config.{key} is swept; give each key in one "
          "place")
    if re.match(r"-{1,2}config(=|$)", arg):
      raise sweep_points.SweepError(
          f"--child_arg {arg!r}: the sweep passes its own --config to every "
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
  key = sweep_points.COMPILE_CACHE_KEY
  if key not in config or key in base_overrides or any(key in p for p in points):
    return {}
  return {key: os.path.join(os.path.abspath(sweep_workdir), "compile_cache")}
