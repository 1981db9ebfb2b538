"""Docs that stay true: every command a doc shows parses, every path and link it names exists.

Checked statically, so the whole file runs in seconds: a `python -m X` / `python X.py` command
resolves to a module of this repository (or an allowed outside one), each `--flag` it passes is
defined in that module (absl DEFINE_* or argparse), its `--config` file loads through the entry
points' own loader and every `--config.a.b` override names a key of that config; `pip -r`,
`papermill`, `sbatch` and pytest arguments name files that exist. Commands are the lines of
bash code blocks and inline code spans that start with `python `.
"""
from __future__ import annotations

import functools
import glob
import os
import re
import shlex

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = sorted(["README.md", "WORKSPACE.md"] + [
    os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "**", "*.md"),
                                                recursive=True)])
# Programs a doc may show that are not this repository's to check (the host's, or another
# project's): their arguments are left alone.
OUTSIDE = {"apt-get", "git", "cd", ".", "source", "ray", "docker", "export", "tensorboard"}
# `python -m` modules from elsewhere: the standard library, pip, pytest, SGLang (GPU hosts).
OUTSIDE_MODULES = {"venv", "pip", "pytest", "sglang.launch_server"}
PYTHONS = re.compile(r"^python(3(\.\d+)?)?$")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# Absl: DEFINE_string("name", ...), config_flags.DEFINE_config_file("config", ...); argparse.
ABSL_FLAG = re.compile(r"DEFINE_\w+\(\s*[\"'](\w+)[\"']")
ARGPARSE_FLAG = re.compile(r"add_argument\(\s*[\"']--([\w-]+)[\"']")
REPO_DIRS = ("rstar_jax", "experiments", "tests", "sandbox", "notebooks", "docs", ".ci")
PATH_SUFFIXES = (".py", ".md", ".ipynb", ".sbatch", ".txt", ".toml", ".ini", ".jsonl")


def _read(doc: str) -> str:
  with open(os.path.join(REPO, doc), encoding="utf-8") as f:
    return f.read()


def _prose(text: str) -> str:
  """The text outside code blocks."""
  out, fenced = [], False
  for line in text.splitlines():
    if FENCE.match(line):
      fenced = not fenced
      continue
    if not fenced:
      out.append(line)
  return "\n".join(out)


def _commands(doc: str) -> list[str]:
  """Command lines of the doc's bash blocks, and inline spans that start with `python `."""
  cmds, lang = [], None
  text = _read(doc)
  for line in text.splitlines():
    m = FENCE.match(line)
    if m:
      lang = (m.group(2) or "none") if lang is None else None
      continue
    if lang in ("bash", "sh", "shell") and line.strip() and not line.strip().startswith("#"):
      cmds.append(line.strip())
  for span in INLINE.findall(_prose(text)):
    if span.startswith("python ") or span.startswith("python3"):
      cmds.append(span)
  return cmds


def _cases():
  return [(doc, cmd) for doc in DOCS for cmd in _commands(doc)]


@functools.lru_cache(maxsize=None)
def _flags_of(path: str) -> frozenset[str]:
  with open(path, encoding="utf-8") as f:
    src = f.read()
  return frozenset(ABSL_FLAG.findall(src)) | frozenset(ARGPARSE_FLAG.findall(src))


@functools.lru_cache(maxsize=None)
def _config(spec: str):
  from rstar_jax import config_utils
  cwd = os.getcwd()
  os.chdir(REPO)   # config paths in docs are relative to the repository root
  try:
    return config_utils._load_config_file(spec)
  finally:
    os.chdir(cwd)


def _module_file(module: str) -> str | None:
  base = os.path.join(REPO, *module.split("."))
  for path in (base + ".py", os.path.join(base, "__main__.py")):
    if os.path.isfile(path):
      return path
  return None


def _check_python(args: list[str], where: str) -> None:
  if args[:1] == ["-m"]:
    module, rest = args[1], args[2:]
    if module in OUTSIDE_MODULES:
      if module == "pytest":
        for a in rest:
          if a.startswith("tests/"):
            assert os.path.exists(os.path.join(REPO, a.split("::")[0])), f"{where}: no {a}"
      return
    path = _module_file(module)
    assert path, f"{where}: no module {module} in this repository"
  else:
    path, rest = os.path.join(REPO, args[0]), args[1:]
    assert os.path.isfile(path), f"{where}: no file {args[0]}"
  defined = _flags_of(path)
  config_spec, overrides, swept = None, [], []
  i = 0
  while i < len(rest):
    a = rest[i]
    if a.startswith("--config.") or a.startswith("--config="):
      if a.startswith("--config="):
        config_spec = a.split("=", 1)[1]
      else:
        overrides.append(a)
    elif a.startswith("--"):
      name = a[2:].split("=", 1)[0].replace("-", "_") if "=" in a else a[2:]
      plain = name.replace("-", "_")
      known = {d.replace("-", "_") for d in defined}
      assert (plain in known or (plain.startswith("no") and plain[2:] in known)
              or plain in ("help", "helpfull")), (
                  f"{where}: {module_or(args)} defines no flag --{name} (defined: {sorted(defined)})")
      takes_value = "=" not in a and i + 1 < len(rest) and not rest[i + 1].startswith("--")
      if takes_value and plain == "config":
        config_spec = rest[i + 1]
      if takes_value and plain == "sweep":
        swept.append("--config." + rest[i + 1].split("=", 1)[0])
      if takes_value:
        i += 1
    i += 1
  if overrides or swept:
    assert config_spec, f"{where}: --config.* overrides without --config"
  if config_spec:
    from rstar_jax import config_utils
    from rstar_jax.recipe import sweep
    config = _config(config_spec)   # raises ConfigError naming what is wrong
    config_utils.check_overrides(overrides + swept, config)
    for a in overrides:   # and the value reads under the field's type, as the entry point reads it
      key, _, text = a[len("--config."):].partition("=")
      sweep._child_reads(config, key, text)


def module_or(args: list[str]) -> str:
  return args[1] if args[:1] == ["-m"] else args[0]


def _check(cmd: str, where: str) -> None:
  for part in re.split(r"\s*(?:&&|;|\|\|)\s*", cmd):
    words = shlex.split(part)
    if not words:
      continue
    prog, args = words[0], words[1:]
    if PYTHONS.match(prog):
      _check_python(args, where)
    elif prog == "pip":
      for i, a in enumerate(args):
        if a == "-r":
          assert os.path.isfile(os.path.join(REPO, args[i + 1])), f"{where}: no {args[i + 1]}"
    elif prog in ("papermill", "sbatch", "bash"):
      assert os.path.isfile(os.path.join(REPO, args[0])), f"{where}: no {args[0]}"
    else:
      assert prog in OUTSIDE, f"{where}: {prog!r} is neither checked here nor listed as outside"


@pytest.mark.parametrize("doc,cmd", _cases())
def test_every_command_a_doc_shows_parses(doc, cmd):
  _check(cmd, f"{doc}: {cmd}")


def _named_paths(doc: str) -> list[tuple[str, str]]:
  """(what the doc wrote, the path it resolves to) for each relative link and each code span
  that names a file or directory of this repository."""
  text, here = _read(doc), os.path.dirname(os.path.join(REPO, doc))
  out = []
  for target in LINK.findall(text):
    if re.match(r"^[a-z]+:", target) or target.startswith("#"):
      continue
    out.append((target, os.path.normpath(os.path.join(here, target.split("#")[0]))))
  for span in INLINE.findall(_prose(text)):
    span = span.strip()
    if any(c in span for c in "<>*{}$ ") or "..." in span or span.startswith("/"):
      continue
    path, _, name = span.partition("::")
    top = path.split("/")[0]
    if top in REPO_DIRS or (("/" in path) and path.endswith(PATH_SUFFIXES)):
      candidates = [os.path.join(REPO, path)]
      if top not in REPO_DIRS:   # `rl/roc.py` in the architecture doc: inside the package
        candidates.append(os.path.join(REPO, "rstar_jax", path))
      found = next((c for c in candidates if os.path.exists(c)), candidates[0])
      out.append((span, found if not name else f"{found}::{name.split('(')[0]}"))
  return out


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_a_doc_names_exists(doc):
  missing = []
  for written, path in _named_paths(doc):
    file, _, name = path.partition("::")
    if not os.path.exists(file):
      missing.append(written)
    elif name:
      with open(file, encoding="utf-8") as f:
        if not re.search(rf"^\s*(def|class)\s+{re.escape(name)}\b", f.read(), re.M):
          missing.append(written)
  assert not missing, f"{doc} names what does not exist: {missing}"


def test_the_readme_test_command_is_what_ci_runs():
  with open(os.path.join(REPO, ".ci", "run"), encoding="utf-8") as f:
    ci = [line.strip() for line in f if line.strip() and not line.startswith("#")]
  command = next(line for line in reversed(ci) if "pytest" in line)
  assert command in _commands("README.md")
  assert command in _commands("WORKSPACE.md")


def test_the_checker_catches_what_it_should():
  """Each kind of mistake the docs could make fails the check."""
  bad = [
      "python -m experiments.no_such_entry_point --config experiments/configs/toy.py",
      "python -m experiments.recipe --config experiments/configs/no_such.py",
      "python -m experiments.recipe --config experiments/configs/toy.py --config.stage1.no_such_key=1",
      "python -m experiments.recipe --config experiments/configs/toy.py --no_such_flag=1",
      "python -m experiments.recipe --config experiments/configs/toy.py --config.stage1.num_steps=five",
      "python -m experiments.sweep --config experiments/configs/toy.py --workdir /tmp/x --sweep rl.nope=1,2",
      "pip install -r requirements-nope.txt",
      "papermill notebooks/99_nope.ipynb out.ipynb",
      "rm -rf /",
  ]
  for cmd in bad:
    with pytest.raises(Exception):
      _check(cmd, cmd)
  _check("python -m experiments.recipe --config experiments/configs/toy.py:smoke "
         "--config.stage1.num_steps=2 --stages=sft", "a good command")
