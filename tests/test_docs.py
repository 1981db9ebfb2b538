r"""Docs that stay true: every command a doc shows parses, every path and link it names exists.

Checked statically, so the whole file runs in seconds: a `python -m X` / `python X.py` command
resolves to a module of this repository (or an allowed outside one), each `--flag` it passes is
defined in that module (absl DEFINE_* or argparse), its `--config` file loads through the entry
points' own loader and every `--config.a.b` override names a key of that config; `pip -r`,
`papermill`, `sbatch`, `bash` and pytest arguments and repository scripts (`.ci/run`) name files
that exist.

Which text is a command. The docs are README.md, WORKSPACE.md, sandbox/README.md and docs/**.md.
Every fenced block is read whatever its language, as a shell reads it: a line ending in `\`
continues on the next, `#` starts a comment, the body of a here-document (`python - <<'PY'` ..
`PY`) is the program's input, not commands, and a `$ ` prompt is dropped. Then:

- in a shell block (`bash`, `sh`, `shell`, `zsh`) every line is a command, and a program this file
  neither checks nor lists in OUTSIDE fails the test (so a new program is a decision);
- in a block of code or data (`python`, `json`, `yaml`, `toml`, ...) no line is a command;
- in any other block (untagged, `console`, `text`, ...), which mixes commands with their output,
  tables and diagrams, a line is a command when it starts with a `$ ` prompt or, after any
  `NAME=value` assignments, with a program this file knows: a Python interpreter (`python`,
  `python3`, `python3.11`), `pip`, `bash`, `sh`, `sbatch`, `papermill`, a program in OUTSIDE, or a
  path into this repository (`.ci/run`, `experiments/...`).

Inline code spans that start with `python ` are commands too.
"""
from __future__ import annotations

import functools
import glob
import os
import re
import shlex

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = sorted(["README.md", "WORKSPACE.md", os.path.join("sandbox", "README.md")] + [
    os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "**", "*.md"),
                                                recursive=True)])
# Programs a doc may show that are not this repository's to check (the host's, or another
# project's): their arguments are left alone.
OUTSIDE = {"apt-get", "git", "cd", ".", "source", "ray", "docker", "export", "tensorboard", "mkdir",
           "tee", "ruff", "yapf-diff"}
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


SHELL_FENCES = {"bash", "sh", "shell", "zsh"}
CODE_FENCES = {"python", "py", "python3", "pycon", "json", "jsonl", "yaml", "yml", "toml", "ini",
               "cfg", "diff", "c", "cpp", "cuda", "dockerfile"}
CHECKED = {"pip", "pip3", "bash", "sh", "sbatch", "papermill"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")
SUBSTITUTION = re.compile(r"\$\(\([^()]*\)\)|\$\([^()]*\)")
SEPARATORS = {";", "&&", "||", "|", "&", "(", ")", "((", "))", ";;"}
# Words a shell reads as syntax: a part that starts with one of the first set is not a
# command (a loop's header, a block's end); one of the second set is dropped before the command.
SHELL_SKIP = {"for", "case", "done", "fi", "esac", "}", "{"}
SHELL_PREFIX = {"do", "then", "else", "if", "while", "until", "!", "time", "exec"}


def _is_repo_path(word: str) -> bool:
  return word.startswith("./") or word.split("/")[0] in REPO_DIRS and "/" in word


def _starts_a_command(line: str) -> bool:
  """For blocks that mix commands and output: the first program is one this file knows."""
  words = line.split()
  while words and ASSIGNMENT.match(words[0]):
    words = words[1:]
  if not words:
    return False
  prog = words[0]
  return bool(PYTHONS.match(prog)) or prog in CHECKED or prog in OUTSIDE or _is_repo_path(prog)


def _fence_commands(lang: str, lines: list[str]) -> list[str]:
  """The command lines of one fenced block (the rule in the module docstring)."""
  if lang in CODE_FENCES:
    return []
  cmds, logical, heredoc = [], "", None
  for line in lines:
    if heredoc is not None:
      if line.strip() == heredoc:
        heredoc = None
      continue
    if logical:   # a continued line: one space where the `\\` and the indentation were
      line = line.lstrip()
    if line.rstrip().endswith("\\"):
      logical += line.rstrip()[:-1].rstrip() + " "
      continue
    logical, line = "", logical + line
    m = HEREDOC.search(line)
    if m:
      heredoc = m.group(1)
    line = line.strip()
    prompt = line.startswith("$ ")
    if prompt:
      line = line[2:].strip()
    if not line or line.startswith("#"):
      continue
    if prompt or lang in SHELL_FENCES or _starts_a_command(line):
      cmds.append(line)
  return cmds


def _commands(doc: str) -> list[str]:
  """The doc's commands: in its fenced blocks, and inline spans that start with `python `."""
  cmds, lang, block = [], None, []
  text = _read(doc)
  for line in text.splitlines():
    m = FENCE.match(line)
    if m:
      if lang is None:
        lang, block = (m.group(2) or "").lower(), []
      else:
        cmds.extend(_fence_commands(lang, block))
        lang = None
      continue
    if lang is not None:
      block.append(line)
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
    if a == "--":
      # The end of this program's flags: what follows is a command it runs (e.g.
      # experiments.under_load's), checked as a command of its own.
      after = rest[i + 1:]
      if after[:1] in (["python"], ["python3"]) and len(after) > 1:
        _check_python(after[1:], where)
      rest = rest[:i]
      break
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
    from rstar_jax.recipe import sweep_overrides
    config = _config(config_spec)   # raises ConfigError naming what is wrong
    config_utils.check_overrides(overrides + swept, config)
    for a in overrides:   # and the value reads under the field's type, as the entry point reads it
      key, _, text = a[len("--config."):].partition("=")
      sweep_overrides._child_reads(config, key, text)


def module_or(args: list[str]) -> str:
  return args[1] if args[:1] == ["-m"] else args[0]


def _simple_commands(cmd: str) -> list[list[str]]:
  """The words of each simple command of a shell line: split at ; && || | & and parentheses,
  comments, redirections (and their targets), NAME=value prefixes and shell keywords removed;
  usage brackets (`[--only L1]`) opened."""
  cmd = SUBSTITUTION.sub("0", cmd)   # $((30000 + g)), $(nproc): a value here, not checked
  lex = shlex.shlex(cmd, posix=True, punctuation_chars=True)
  lex.whitespace_split = True
  parts, words, skip_next = [], [], False
  for tok in lex:
    if skip_next:
      skip_next = False
      continue
    if tok in SEPARATORS:
      parts.append(words)
      words = []
    elif tok and set(tok) <= set("<>&|;()") and ("<" in tok or ">" in tok):
      if words and words[-1].isdigit():   # 2>&1: the descriptor is no argument
        words.pop()
      skip_next = True
    else:
      words.append(tok)
  parts.append(words)
  out = []
  for words in parts:
    while words and (ASSIGNMENT.match(words[0]) or words[0] in SHELL_PREFIX):
      words = words[1:]
    if not words or words[0] in SHELL_SKIP:
      continue
    opened, clean = False, []
    for w in words:
      if w.startswith("[-"):
        opened, w = True, w[1:]
      if opened and w.endswith("]"):
        opened, w = False, w[:-1]
      clean.append(w)
    out.append(clean)
  return out


def _first_operand(args: list[str]) -> str | None:
  return next((a for a in args if not a.startswith("-")), None)


def _check(cmd: str, where: str) -> None:
  for words in _simple_commands(cmd):
    prog, args = words[0], words[1:]
    if PYTHONS.match(prog):
      if args[:1] in (["-"], ["-c"]):   # a program on stdin (a here-document) or inline
        continue
      _check_python(args, where)
    elif prog in ("pip", "pip3"):
      for i, a in enumerate(args):
        if a == "-r":
          assert os.path.isfile(os.path.join(REPO, args[i + 1])), f"{where}: no {args[i + 1]}"
    elif prog in ("papermill", "sbatch", "bash", "sh"):
      operand = _first_operand(args)
      assert operand, f"{where}: {prog} without a file"
      assert os.path.isfile(os.path.join(REPO, operand)), f"{where}: no {operand}"
    elif _is_repo_path(prog) or "/" in prog:
      assert os.path.isfile(os.path.join(REPO, prog)), f"{where}: no {prog}"
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


def test_every_fence_is_read_as_a_shell_reads_it():
  """Untagged and console blocks, continuations, comments, here-documents, prompts, usage
  brackets: the commands come out whole and only they; a wrong flag in any of them fails."""
  block = [
      "# a comment",
      "python -m experiments.recipe --config experiments/configs/toy.py:smoke \\",
      "  --config.stage1.num_steps=2 \\",
      "  --stages=sft   # a trailing comment",
      "2026-11-27 04:19 UTC, AMD EPYC   (output, not a command)",
      "python - <<'PY'",
      "import nothing_checked_here",
      "PY",
      "for g in 0 1; do",
      "  CUDA_VISIBLE_DEVICES=$g python -m sglang.launch_server --port $((30000 + g)) &",
      "done",
      "$ .ci/run",
  ]
  for lang in ("", "console", "text"):
    cmds = _fence_commands(lang, block)
    assert cmds == [
        "python -m experiments.recipe --config experiments/configs/toy.py:smoke "
        "--config.stage1.num_steps=2 --stages=sft   # a trailing comment",
        "python - <<'PY'",
        "CUDA_VISIBLE_DEVICES=$g python -m sglang.launch_server --port $((30000 + g)) &",
        ".ci/run"], cmds
    for cmd in cmds:
      _check(cmd, cmd)
  assert _fence_commands("python", block) == []
  assert _fence_commands("bash", ["mkdir -p /tmp/x && rm -rf /tmp/x"]) == [
      "mkdir -p /tmp/x && rm -rf /tmp/x"]
  assert _simple_commands("python -m experiments.mutation_pass [--only L1,N1] [--no-baseline]") == [
      ["python", "-m", "experiments.mutation_pass", "--only", "L1,N1", "--no-baseline"]]
  bad = [
      ["python -m experiments.recipe --config experiments/configs/toy.py \\", "  --no_such_flag=1"],
      ["$ python -m sandbox.server --no-such-option 1"],
      ["python -m experiments.mutation_pass [--no-such-option]"],
      ["pip install -r requirements.txt && .ci/no_such_script"],
      ["python -m experiments.recipe --config experiments/configs/toy.py 2>&1 | rm -rf /tmp/x"],
  ]
  for lines in bad:
    cmds = _fence_commands("", lines)
    assert cmds, lines
    with pytest.raises(AssertionError):
      for cmd in cmds:
        _check(cmd, cmd)


def test_the_sandbox_readme_and_the_evaluation_headline_are_checked():
  assert os.path.join("sandbox", "README.md") in DOCS
  assert any(c.startswith("python -m sandbox.server") for c in _commands("sandbox/README.md"))
  headline = [c for c in _commands("docs/guides/evaluation.md")
              if "eval_rstar2_agent_14b.py" in c and "--config.rollout.servers" in c]
  assert headline, "the evaluation guide's headline command is not read as a command"


# Words about the environment the project was built in rather than the project: a reader
# cannot act on them, and cannot look up a tracker's numbers. Each pattern targets a
# phrasing, not a word: "agent" (the rStar2-Agent policy, `AgentConfig`), HTTP and sandbox
# sessions, pytest sessions and Linux login sessions are the project's own and stay.
ENVIRONMENT_WORDS = [
    (r"\b(?:other|another|fellow|several|many|two|three|four|five) agents?\b",
     "agents as co-workers"),
    (r"\bagents'", "agents as co-workers"),
    (r"\blent\b|\blends?\b|\blending\b", "machines lent to the work"),
    (r"\bworkplace", "the workplace"),
    (r"\b(?:this|our|shared|\d+-core) container\b", "the container the work ran in"),
    (r"\b(?:in|during|from|for|of|within) this session\b", "a working session"),
    (r"\bthis session's\b", "a working session"),
    (r"\bsessions' (?:machines?|hosts?|time|budget)", "a working session"),
    (r"\ba session (?:is|was|lasts|lasted|of) (?:about |up to )?\d", "a working session"),
    (r"\b(?:working|work|coding|development|agent|helper|earlier|later|next|previous) sessions?\b",
     "a working session"),
    (r"\bissues?(?: |-)#?\d+(?:(?: ?/ ?| ?, | and )#?\d+)*", "a tracker number"),
    (r"\(#\d+\)|\b(?:PR|pull request|ticket|tracker item) #?\d+", "a tracker number"),
]
WORDS_SCOPE = ["docs/**/*.md", "README.md", "WORKSPACE.md", "sandbox/README.md",
               "notebooks/*.ipynb", "experiments/**/*.py", "rstar_jax/**/*.py", "sandbox/**/*.py",
               "tests/**/*.py", "experiments/**/*.sh", "experiments/**/*.sbatch", ".ci/run",
               "requirements*.txt", "tests/*.txt"]
# This file names the words it looks for; nothing else is exempt.
WORDS_EXEMPT = {os.path.relpath(os.path.abspath(__file__), REPO)}


def _environment_hits(text: str) -> list[tuple[int, str, str]]:
  """(line number, what matched, why) for each phrase about the work's environment."""
  hits = []
  for pattern, why in ENVIRONMENT_WORDS:
    # A phrase may wrap: a space in a pattern is any run of white space, newlines too.
    for m in re.finditer(pattern.replace(" ", r"\s+"), text, re.I):
      hits.append((text.count("\n", 0, m.start()) + 1, " ".join(m.group(0).split()), why))
  return sorted(hits)


def _words_files() -> list[str]:
  files = set()
  for pattern in WORDS_SCOPE:
    files.update(os.path.relpath(p, REPO)
                 for p in glob.glob(os.path.join(REPO, pattern), recursive=True))
  return sorted(files - WORDS_EXEMPT)


def test_no_words_about_the_environment_the_project_was_built_in():
  """The docs, notebooks and code speak of the project: not of who worked on it or where
  (agents, machines lent by a workplace, "this container", a working session), and not
  of tracker numbers a reader cannot look up ("issue 41", "(#37)"): say what the thing is."""
  found = []
  for rel in _words_files():
    with open(os.path.join(REPO, rel), encoding="utf-8") as f:
      text = f.read()
    for n, what, why in _environment_hits(text):
      line = text.splitlines()[n - 1].strip()
      found.append(f"{rel}:{n}: {why}: {what!r} in {line[:160]!r}")
  assert not found, "\n".join(["words about the environment, not the project:"] + found)


def test_the_environment_words_are_found_and_the_project_words_are_not():
  bad = ["2 cores shared with four other agents' jobs", "the sessions' machines were shared",
         "a session is 3 hours", "On this workplace's lent GPU machines",
         "it does in this container", "Measured (2-core shared container)",
         "measured in this\nsession.", "refused in this\n  container",
         "An ablation (issue 41): x", "(issue 37)", "issue 18/19", "Issues 6 and 18",
         "the issue-43 settings", "see #12 (#12)"]
  good = ["the agent loop of rStar2-Agent", "AgentConfig.max_turns", "cfg.stage1.agent",
          "a sandbox session keeps its globals", "close_session('nb-7')",
          "the HTTP session is closed", "fails the session (exit 1)", "the session fixture",
          "other sessions, other users (autogroups)", "e.g. a container runtime",
          "pytree containers", "the issue is the deadline", "known issues"]
  for text in bad:
    assert _environment_hits(text), text
  for text in good:
    assert not _environment_hits(text), text
