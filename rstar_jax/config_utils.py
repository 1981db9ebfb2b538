"""Config sections <-> the dataclasses they build, start-up checks, the absl wrapper.

A config section has the shape of the keyword-only dataclass it builds: the same
field names, nested sections for nested dataclasses (big_vision / tunix style).
`section(cls, **values)` writes one into a config file with every field present
(defaults from the dataclass, so every field is overridable as `--config.a.b=...`
with its type known to absl); `build(cls, section, where)` turns it back into the
dataclass, naming the path of a bad key, a wrong type or a bad value.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import signal
import sys
import types
import typing
from typing import Any, Callable, Mapping, Sequence

from absl import app
from absl import flags
import ml_collections
from ml_collections import config_dict


class ConfigError(ValueError):
  pass


# ---- dataclass <-> section ----------------------------------------------------------
def _hints(cls) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def _optional_of(tp) -> Any | None:
  """X for `X | None` / `Optional[X]`, else None."""
  if typing.get_origin(tp) in (typing.Union, types.UnionType):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(args) == 1 and len(typing.get_args(tp)) == 2:
      return args[0]
  return None


def _base_type(tp):
  origin = typing.get_origin(tp)
  return origin if origin is not None else tp


def _default(field: dataclasses.Field):
  if field.default is not dataclasses.MISSING:
    return field.default
  if field.default_factory is not dataclasses.MISSING:
    return field.default_factory()
  return dataclasses.MISSING


def _section_value(tp, value, where: str, as_json: bool = False):
  inner = _optional_of(tp)
  if as_json:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
  if dataclasses.is_dataclass(tp):
    if dataclasses.is_dataclass(value):
      value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init}
    return section(tp, **dict(value or {}))
  if value is None:
    if inner is None:
      raise ConfigError(f"{where}: None for a field of type {tp}")
    base = _base_type(inner)
    return config_dict.placeholder(base if isinstance(base, type) else object)
  if isinstance(value, Mapping):
    return ml_collections.ConfigDict(dict(value))
  if (tp is float or inner is float) and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if isinstance(value, list):
    return tuple(value)
  return value


def section(cls, **values) -> ml_collections.ConfigDict:
  """A config section for dataclass `cls`: every field, `values` replacing defaults.

  Nested dataclass fields become nested sections (a dict value there overrides some
  of their fields); None defaults become typed placeholders, so they can still be
  set from the command line."""
  if not dataclasses.is_dataclass(cls):
    raise TypeError(f"section() needs a dataclass, got {cls!r}")
  hints = _hints(cls)
  fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
  unknown = sorted(set(values) - set(fields))
  if unknown:
    raise ConfigError(f"{cls.__name__}: unknown field(s) {unknown}; fields: {sorted(fields)}")
  out = ml_collections.ConfigDict()
  for name, f in fields.items():
    tp = hints[name]
    if name in values:
      value = values[name]
      if dataclasses.is_dataclass(tp) and isinstance(value, Mapping):
        base = _default(f)
        merged = ({g.name: getattr(base, g.name) for g in dataclasses.fields(base) if g.init}
                  if dataclasses.is_dataclass(base) else {})
        merged.update(value)
        value = merged
    else:
      value = _default(f)
      if value is dataclasses.MISSING:
        value = None
    out[name] = _section_value(tp, value, f"{cls.__name__}.{name}",
                               as_json=f.metadata.get("config") == "json")
  return out


def to_dict(config) -> dict[str, Any]:
  if isinstance(config, ml_collections.ConfigDict):
    return config.to_dict()
  return dict(config)


def _type_name(tp) -> str:
  return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp, value, where: str):
  """`value` as the field type `tp` wants it, or ConfigError naming `where`."""
  if dataclasses.is_dataclass(tp):
    if dataclasses.is_dataclass(value):
      return value
    if not isinstance(value, (Mapping, ml_collections.ConfigDict)):
      raise ConfigError(f"{where}: expected a section for {tp.__name__}, got "
                        f"{type(value).__name__} {value!r}")
    return build(tp, value, where)
  if tp is Any:
    return value
  inner = _optional_of(tp)
  if inner is not None:
    return None if value is None else _coerce(inner, value, where)
  base = _base_type(tp)
  bad = lambda: ConfigError(f"{where}: expected {_type_name(tp)}, got "
                            f"{type(value).__name__} {value!r}")
  if base is bool:
    if not isinstance(value, bool):
      raise bad()
    return value
  if base is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise bad()
    return value
  if base is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise bad()
    return float(value)
  if base is str:
    if not isinstance(value, str):
      raise bad()
    return value
  if base in (tuple, Sequence, list):
    if isinstance(value, str) or not isinstance(value, (tuple, list)):
      raise bad()
    args = typing.get_args(tp)
    item = args[0] if args else Any
    return tuple(_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value))
  if base in (dict, Mapping) or base is typing.Mapping:
    if not isinstance(value, (Mapping, ml_collections.ConfigDict)):
      raise bad()
    return to_dict(value) if isinstance(value, ml_collections.ConfigDict) else dict(value)
  return value


def build(cls, config, where: str = "config"):
  """The dataclass `cls` from its config section, checked field by field.

  Unknown keys fail naming the valid ones; a value of the wrong type fails naming
  the field's path; the dataclass's own validation (`__post_init__`) fails with the
  section's path in front of its message."""
  data = to_dict(config) if not isinstance(config, dict) else config
  fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
  unknown = sorted(set(data) - set(fields))
  if unknown:
    raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys: {sorted(fields)}")
  hints = _hints(cls)
  kwargs = {}
  for name, f in fields.items():
    if name not in data:
      continue
    value = data[name]
    if f.metadata.get("config") == "json" and isinstance(value, str):
      try:
        value = json.loads(value)
      except json.JSONDecodeError as e:
        raise ConfigError(f"{where}.{name}: not valid JSON ({e}): {value[:200]!r}") from None
    kwargs[name] = _coerce(hints[name], value, f"{where}.{name}")
  missing = sorted(n for n, f in fields.items() if n not in kwargs and
                   _default(f) is dataclasses.MISSING)
  if missing:
    raise ConfigError(f"{where}: missing required key(s) {missing}")
  try:
    return cls(**kwargs)
  except (TypeError, ValueError) as e:
    if isinstance(e, ConfigError):
      raise
    raise ConfigError(f"{where}: {e}") from e


def diff(old: Any, new: Any, path: str = "") -> list[str]:
  """"key.path: old -> new" for every leaf that differs between two plain configs."""
  if isinstance(old, dict) and isinstance(new, dict):
    out = []
    for k in sorted(set(old) | set(new)):
      p = f"{path}.{k}" if path else k
      if k not in old:
        out.append(f"{p}: (absent) -> {new[k]!r}")
      elif k not in new:
        out.append(f"{p}: {old[k]!r} -> (absent)")
      else:
        out += diff(old[k], new[k], p)
    return out
  return [] if old == new else [f"{path}: {old!r} -> {new!r}"]


def summary(resolved: Mapping[str, Any], full_path: str,
            file_defaults: tuple[str, Mapping[str, Any]] | None = None,
            limit: int = 40) -> str:
  """The resolved config as a few lines: what differs from the config file's own values
  (`file_defaults`: (spec, that file's config resolved the same way); the command
  line's overrides, in effect), and where the whole of it is (`full_path`). Without
  the file's values (a run started from Python), one line."""
  if file_defaults is None:
    return f"config: in full in {full_path}"
  spec, defaults = file_defaults
  changes = diff(dict(defaults), dict(resolved))
  if not changes:
    return f"config: {spec} as it is (in full: {full_path})"
  lines = [f"config: {spec} with {len(changes)} change(s) (in full: {full_path}):"]
  lines += [f"  {c}" for c in changes[:limit]]
  if len(changes) > limit:
    lines.append(f"  ... {len(changes) - limit} more (see {full_path})")
  return "\n".join(lines)


# The config file the entry point was started with and its values before the command
# line's overrides (`run` loads it to check the overrides): what `summary` diffs against.
_file_config: tuple[str, Any] | None = None


def file_config() -> tuple[str, Any] | None:
  """(spec, ConfigDict) of the entry point's --config file without the command line's
  overrides, or None outside `run` (a notebook, a test)."""
  return _file_config


def as_plain(obj) -> Any:
  """A built config (dataclasses, tuples, mappings) as JSON-able plain data."""
  if dataclasses.is_dataclass(obj):
    return {f.name: as_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
  if isinstance(obj, Mapping):
    return {str(k): as_plain(v) for k, v in obj.items()}
  if isinstance(obj, (tuple, list)):
    return [as_plain(v) for v in obj]
  return obj


# ---- entry points --------------------------------------------------------------------
def _load_config_file(spec: str):
  path, _, arg = spec.partition(":")
  mod_spec = importlib.util.spec_from_file_location("_rstar_cfg", path)
  if mod_spec is None or mod_spec.loader is None:
    raise ConfigError(f"--config: cannot load config file {path!r}")
  module = importlib.util.module_from_spec(mod_spec)
  try:
    mod_spec.loader.exec_module(module)
  except (ImportError, SyntaxError) as e:
    raise ConfigError(f"--config {path}: cannot import it ({type(e).__name__}: {e})") from None
  get_config = getattr(module, "get_config", None)
  if get_config is None:
    raise ConfigError(f"--config {path}: defines no get_config()")
  if arg and not inspect.signature(get_config).parameters:
    raise ConfigError(f"--config {spec}: {path} has no variants (its get_config() takes "
                      f"no argument); drop ':{arg}'")
  return get_config(arg) if arg else get_config()


def _config_path_from_argv(argv: Sequence[str], name: str) -> str | None:
  for i, a in enumerate(argv):
    if a.startswith(f"--{name}="):
      return a.split("=", 1)[1]
    if a == f"--{name}" and i + 1 < len(argv):
      return argv[i + 1]
  return None


def check_overrides(argv: Sequence[str], config, name: str = "config") -> None:
  """Raises ConfigError naming the first `--config.x.y` override with an unknown key."""
  for a in argv:
    if not a.startswith(f"--{name}."):
      continue
    key = a[len(name) + 3:].split("=", 1)[0]
    node, walked = config, []
    for part in key.split("."):
      if not isinstance(node, (ml_collections.ConfigDict, dict)) or part not in node:
        where = ".".join(walked) or "<top level>"
        known = sorted(node.keys()) if isinstance(node, (ml_collections.ConfigDict, dict)) else []
        raise ConfigError(
            f"--{name}.{key}: unknown config key {part!r} under {where}; "
            f"known keys there: {known}")
      node = node[part]
      walked.append(part)


def run(main: Callable[[Sequence[str]], Any], config_flag: str = "config") -> None:
  """`app.run(main)` for the entry points: a missing `--config` says how to call,
  unknown override keys are named before flag parsing, and a config error or an
  interrupted run ends with one clear line instead of a traceback."""
  from rstar_jax.train import interrupt
  from sandbox.launcher import SandboxUnavailable

  doc = (sys.modules["__main__"].__doc__ or "").strip().splitlines()
  # The docstring's launch command (big_vision style), wherever it sits in the text.
  usage = next((line.strip() for line in doc if line.strip().startswith("python")),
               doc[0] if doc else "")

  def usage_exit(message: str):
    print(f"{message}\nusage: {usage}", file=sys.stderr)
    sys.exit(2)

  def parser(argv):
    spec = _config_path_from_argv(argv, config_flag)
    helping = any(a.startswith(("--help", "-h", "--helpfull")) for a in argv[1:])
    if spec is None and not helping and flags.FLAGS[config_flag].default is None:
      usage_exit(f"--{config_flag} is required (a config file)")
    if spec is not None:
      global _file_config
      try:
        loaded = _load_config_file(spec)
        check_overrides(argv, loaded, config_flag)
      except (ConfigError, ValueError, OSError) as e:
        usage_exit(f"config error: {e}")
      _file_config = (spec, loaded)
    try:
      rest = flags.FLAGS(argv)
    except flags.Error as e:
      usage_exit(f"flag error: {e}")
    if len(rest) > 1:   # a forgotten `--` or `=`: nothing here takes positional arguments
      usage_exit(f"unexpected argument(s) {rest[1:]}: every setting is a flag "
                 f"(--{config_flag}.<key>=<value>, --<flag>=<value>)")
    return rest

  def wrapped(argv):
    try:
      return main(argv)
    except ConfigError as e:
      print(f"config error: {e}", file=sys.stderr)
      sys.exit(2)
    except SandboxUnavailable as e:   # no bubblewrap, say: what to install, no traceback
      print(f"cannot run on this machine: {e}", file=sys.stderr)
      sys.exit(2)
    except interrupt.Interrupted as e:
      print(f"interrupted: {e}", file=sys.stderr)
      sys.exit(128 + e.signum)
    except KeyboardInterrupt as e:
      # A second Ctrl-C (`interrupt.Aborted`), or one before the run's handlers are in
      # place: one line, not the traceback of wherever it landed.
      print(str(e) if isinstance(e, interrupt.Aborted) else
            "aborted by SIGINT; run the same command again to resume from what was "
            "saved", file=sys.stderr)
      sys.exit(128 + signal.SIGINT)

  # JAX's start-up INFO lines ("Unable to initialize backend 'tpu'", "Resetting cache at
  # <empty>") are dropped by the filter rstar_jax/__init__.py installs on import.
  app.run(wrapped, flags_parser=parser)

