"""Experiment configs reach the package through one module, rstar_jax.recipe.sections.

Two sides of one rule: a config file imports nothing but that module, its sibling
configs, ml_collections and the standard library (so a new config is written from
sections.py's list, not from the import block of the code that runs it); and every
dataclass a config's sections build, in every variant its docstring names, is a name
sections.py exports (so that list is complete).
"""
import ast
import glob
import importlib
import inspect
import os
import re
import sys

import pytest

from rstar_jax import config_utils
from rstar_jax.recipe import sections

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(glob.glob(os.path.join(REPO, "experiments", "configs", "*.py")))
CONFIG_NAMES = [os.path.basename(p)[:-3] for p in CONFIG_FILES if not p.endswith("__init__.py")]
PUBLIC = "rstar_jax.recipe.sections"


def _allowed(module: str) -> bool:
  top = module.split(".")[0]
  return (module == PUBLIC or module.startswith(PUBLIC + ".")
          or module.startswith("experiments.configs.")
          or top in ("ml_collections", "__future__") or top in sys.stdlib_module_names)


def bad_imports(source: str, filename: str) -> list[str]:
  """'file:line: import X' for every import of `source` that _allowed refuses."""
  out = []
  for node in ast.walk(ast.parse(source, filename)):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:   # relative: from the experiments.configs package
        base = ".".join(["experiments", "configs"][:3 - node.level] + ([base] if base else []))
      names = [f"{base}.{a.name}" for a in node.names]
    else:
      continue
    out += [f"{filename}:{node.lineno}: imports {n}" for n in names if not _allowed(n)]
  return out


def test_the_checker_catches_what_it_should():
  ok = ("import json\nimport ml_collections\nfrom ml_collections import config_dict\n"
        "from rstar_jax.recipe import sections\nfrom experiments.configs import toy\n"
        "from . import toy_roc_ablation\n")
  assert bad_imports(ok, "ok.py") == []
  bad = ("from rstar_jax.recipe import stages as recipe\nfrom rstar_jax import config_utils\n"
         "import numpy\nfrom experiments import preflight\n"
         "def f():\n  from rstar_jax.data import toy_task\n")
  assert bad_imports(bad, "bad.py") == [
      "bad.py:1: imports rstar_jax.recipe.stages", "bad.py:2: imports rstar_jax.config_utils",
      "bad.py:3: imports numpy", "bad.py:4: imports experiments.preflight",
      "bad.py:6: imports rstar_jax.data.toy_task"]


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_configs_import_only_the_public_module(path):
  with open(path) as f:
    bad = bad_imports(f.read(), os.path.relpath(path, REPO))
  assert not bad, ("a config imports the package only through rstar_jax.recipe.sections "
                   "(add what it needs there):\n" + "\n".join(bad))


def docstring_variants(name: str, doc: str) -> set[str]:
  """The variants a config's docstring names: `<file>.py:v`, `:v` in backticks, "v" in
  its Variants paragraph, or the first word of an indented line under a Variants heading
  ("" always: the default)."""
  found = {""}
  found |= set(re.findall(rf"\b{re.escape(name)}\.py:([a-z_]\w*)", doc))
  found |= set(re.findall(r"`:([a-z_]\w*)`", doc))
  paragraphs = re.split(r"\n\s*\n", doc)
  for para in paragraphs:
    if para.lstrip().startswith("Variants"):
      found |= set(re.findall(r'"([a-z_]\w*)"', para))
      found |= set(re.findall(r"^ {2,}([a-z_]\w*) {2,}", para, re.M))
  return found


def test_docstring_variants_are_read():
  doc = ('Variants (`--config experiments/configs/x.py:VARIANT`):\n  smoke   tiny\n'
         '          more text\n\nthe `:layout` variant; y.py:other is not ours, x.py:cluster is.\n'
         '\nVariants: "" the run; "sft" the SFT stage; "a" and "b" as the other\'s.\n')
  assert docstring_variants("x", doc) == {"", "smoke", "layout", "cluster", "sft", "a", "b"}


def _known_variants(get_config) -> set[str]:
  """The variants a config's error for an unknown one lists ("known: a, b")."""
  with pytest.raises(ValueError, match="unknown variant") as e:
    get_config("no-such-variant")
  known = re.search(r"known: (.*)$", str(e.value))
  return {v.strip() for v in known.group(1).split(",")} if known else set()


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_every_built_dataclass_is_named_in_sections(name, monkeypatch):
  module = importlib.import_module(f"experiments.configs.{name}")
  takes_variant = bool(inspect.signature(module.get_config).parameters)
  named = docstring_variants(name, module.__doc__ or "")
  if takes_variant:
    missing = _known_variants(module.get_config) - named
    assert not missing, f"{name}.py: its docstring does not name variant(s) {sorted(missing)}"
  else:
    assert named == {""}, f"{name}.py: its docstring names variants {named}; get_config takes none"

  built = []
  original = config_utils.section

  def recording(cls, **values):
    built.append(cls)
    return original(cls, **values)

  # Nested sections are made by config_utils' own module-level `section`: patched too.
  monkeypatch.setattr(config_utils, "section", recording)
  monkeypatch.setattr(sections, "section", recording)
  exported = {id(getattr(sections, n)) for n in sections.__all__}
  for variant in sorted(named):
    built.clear()
    if takes_variant:
      module.get_config(variant)
    else:
      module.get_config()
    unnamed = sorted({f"{c.__module__}.{c.__qualname__}" for c in built
                      if id(c) not in exported})
    spec = f"{name}.py:{variant}" if variant else f"{name}.py"
    assert not unnamed, (f"{spec}: sections of {unnamed} are built but not named in "
                         f"rstar_jax/recipe/sections.py")


def test_sections_exports_what_it_imports():
  assert sorted(sections.__all__) == sorted(set(sections.__all__))
  for n in sections.__all__:
    assert hasattr(sections, n), n
