"""Start-up validation of ml_collections configs and the absl entry-point wrapper.

`config_flags` already rejects a value of the wrong type (`--config.x=abc` for an
int); an unknown key, though, surfaces as a bare `AttributeError: 'nope'`. `run`
checks every `--config.a.b` override against the loaded config first and names
the bad key and the keys that do exist.
"""
from __future__ import annotations

import importlib.util
import sys
from typing import Any, Callable, Sequence

from absl import app
from absl import flags
import ml_collections


class ConfigError(ValueError):
  pass


def _load_config_file(spec: str):
  path, _, arg = spec.partition(":")
  mod_spec = importlib.util.spec_from_file_location("_rstar_cfg", path)
  if mod_spec is None or mod_spec.loader is None:
    raise ConfigError(f"--config: cannot load config file {path!r}")
  module = importlib.util.module_from_spec(mod_spec)
  mod_spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


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
  """`app.run(main)` with unknown-override checking before flag parsing."""

  def parser(argv):
    spec = _config_path_from_argv(argv, config_flag)
    if spec is not None:
      try:
        check_overrides(argv, _load_config_file(spec), config_flag)
      except ConfigError as e:
        raise app.UsageError(str(e)) from None
    return flags.FLAGS(argv)

  app.run(main, flags_parser=parser)


def to_dict(config) -> dict[str, Any]:
  return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def build_dataclass(cls, section, where: str):
  """Constructs a keyword-only dataclass from a config section, naming bad keys."""
  import dataclasses
  data = to_dict(section)
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(data) - names)
  if unknown:
    raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys: {sorted(names)}")
  try:
    return cls(**data)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"{where}: {e}") from e


def model_config(section):
  """Qwen3Config from `config.model`: `preset` (or `hf_dir`) plus field overrides."""
  from rstar_jax.model import config as model_cfg
  from rstar_jax.model import hf_io
  data = {k: v for k, v in to_dict(section).items() if v is not None}
  preset = data.pop("preset", None)
  hf_dir = data.pop("hf_dir", None)
  if bool(preset) == bool(hf_dir):
    raise ConfigError("config.model: set exactly one of `preset` or `hf_dir`")
  fields = {f for f in model_cfg.Qwen3Config.__dataclass_fields__}
  unknown = sorted(set(data) - fields)
  if unknown:
    raise ConfigError(f"config.model: unknown key(s) {unknown}; valid: {sorted(fields)}")
  try:
    if hf_dir:
      return hf_io.load_config(hf_dir, **data)
    return model_cfg.get_preset(preset, **data)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config.model: {e}") from e


def mesh_from_config(section):
  """Builds the (data, fsdp, tensor) mesh; errors say why the sizes do not fit."""
  from rstar_jax.model import sharding
  try:
    return sharding.make_mesh(to_dict(section))
  except ValueError as e:
    raise ConfigError(f"config.mesh: {e}") from e


def enable_compile_cache(path: str) -> None:
  """JAX's persistent compilation cache in `path`.

  Every stage builds fresh jitted functions (new trainer, new engine) with the same
  shapes as the stage before; with the cache they load in milliseconds instead of
  compiling again, and a resumed or repeated run compiles nothing it compiled before.
  """
  import jax
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
