"""The reference pages `docs/reference/config.md` and `docs/reference/metrics.md`, made from
the code: every field of the recipe's config tree and every metric name a run writes.

  python -m rstar_jax.recipe.reference --write   # regenerate both pages
  python -m rstar_jax.recipe.reference --check   # exit 1 naming a page that is out of date

A field's description is what its code says of it, found in one of three places (the first
that has one): its `name: text` entry in the docstring of the dataclass that declares it
(several names may share one, `a, b: ...` or `a / b: ...`), a trailing `# comment` on its
line, or the comment lines right above it. The page keeps its first sentence, and the next
ones while the text is under 40 characters; the section heading links to the source for the
rest. A field with none is listed as such and counted at the top of the page. Defaults are
the dataclasses' own, a nested section's those of its parent's default (config files set
their own). The metrics page renders `rstar_jax.metric_table`.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import os
import re
import sys
import tokenize
import typing
from typing import Any, Iterator, Sequence

from rstar_jax import metric_table
from rstar_jax.recipe import recipe_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES_DIR = os.path.join("docs", "reference")
COMMAND = "python -m rstar_jax.recipe.reference --write"
NO_DESCRIPTION = "*(no description in the code)*"
# A default longer than this is shown by the expression that makes it, or cut.
_MAX_DEFAULT = 48
# Abbreviations whose period does not end a sentence.
_ABBREVIATIONS = ("e.g.", "i.e.", "cf.", "vs.", "etc.")


@dataclasses.dataclass(frozen=True)
class Field:
  """One leaf of the config tree."""
  section: str       # "" for RecipeConfig's own fields, else e.g. "rl.loss"
  name: str
  type: str
  default: str       # as shown, in a code span
  description: str   # "" when the code has none


@dataclasses.dataclass(frozen=True)
class Section:
  path: str
  cls: type
  fields: tuple[Field, ...]


# ---- reading the source -----------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _parsed(path: str) -> tuple[ast.Module, dict[int, str], dict[int, str]]:
  """(module AST, line -> trailing comment, line -> whole-line comment) of a source file."""
  with open(path, encoding="utf-8") as f:
    text = f.read()
  trailing, whole = {}, {}
  code_lines = set()
  for tok in tokenize.generate_tokens(io.StringIO(text).readline):
    if tok.type == tokenize.COMMENT:
      line = tok.start[0]
      (trailing if line in code_lines else whole)[line] = tok.string.lstrip("#").strip()
    elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                          tokenize.ENCODING):
      code_lines.update(range(tok.start[0], tok.end[0] + 1))
  return ast.parse(text, path), trailing, whole


def _class_node(cls: type) -> tuple[ast.ClassDef, str] | None:
  """The class statement of `cls` and its file, or None (a class made by a call, e.g.
  `dataclasses.make_dataclass`)."""
  try:
    path = inspect.getsourcefile(sys.modules[cls.__module__])
  except (TypeError, KeyError):
    return None
  if path is None:
    return None
  body: list[ast.stmt] = _parsed(path)[0].body
  node = None
  for part in cls.__qualname__.split("."):
    node = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == part), None)
    if node is None:
      return None
    body = node.body
  return node, path


def _docstring_entries(doc: str, names: set[str]) -> dict[str, str]:
  """`name: text` entries of a docstring (continuation lines indented deeper), for entries
  whose names ("a", "a, b", "a / b") are all in `names`."""
  out: dict[str, str] = {}
  lines = doc.splitlines()
  i = 0
  while i < len(lines):
    m = re.match(r"^(\s*)([A-Za-z_][\w ,/]*?):\s+(\S.*)$", lines[i])
    keys = [k.strip() for k in re.split(r"[,/]", m.group(2))] if m else []
    if not m or not keys or not all(k in names for k in keys):
      i += 1
      continue
    indent, text = len(m.group(1)), [m.group(3).strip()]
    i += 1
    while i < len(lines) and lines[i].strip() and (
        len(lines[i]) - len(lines[i].lstrip()) > indent):
      text.append(lines[i].strip())
      i += 1
    for k in keys:
      out.setdefault(k, " ".join(text))
  return out


def _comments(node: ast.ClassDef, path: str, name: str) -> str:
  """A field's trailing comment, else the comment lines right above it, else ""."""
  _, trailing, whole = _parsed(path)
  for stmt in node.body:
    if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
        and stmt.target.id == name):
      for line in range(stmt.lineno, stmt.end_lineno + 1):
        if line in trailing:
          return trailing[line]
      above, line = [], stmt.lineno - 1
      while line in whole:
        above.insert(0, whole[line])
        line -= 1
      return " ".join(above)
  return ""


def _declaring_classes(cls: type, name: str) -> list[type]:
  """Where to look for `name`'s description: the dataclass that declares it (the first in
  the MRO with it in its own annotations); for a class without a class statement, also the
  dataclasses of its module that declare a field of that name (ModelConfig repeats
  Qwen3Config's fields)."""
  found = [k for k in cls.__mro__ if name in k.__dict__.get("__annotations__", {})][:1]
  if found and _class_node(found[0]) is None:
    module = sys.modules[cls.__module__]
    found += [v for v in vars(module).values()
              if isinstance(v, type) and dataclasses.is_dataclass(v) and v is not found[0]
              and name in v.__dict__.get("__annotations__", {}) and _class_node(v)]
  return found


def _short(text: str) -> str:
  """The first sentence of `text`, more while they are short (under 40 characters)."""
  text = " ".join(text.split())
  # A sentence ends at . ! ? (not an ellipsis "..") before a capital or a digit.
  for m in re.finditer(r"(?<!\.)[.!?](?=\s+[A-Z0-9])", text):
    if text[:m.end()].split()[-1].lower() in _ABBREVIATIONS:
      continue
    if m.end() >= 40:
      return text[:m.end()]
  return text


def description(cls: type, name: str) -> str:
  """What the code says of field `name` of dataclass `cls` (see the module docstring)."""
  for k in _declaring_classes(cls, name):
    found = _class_node(k)
    if found is None:
      continue
    node, path = found
    own = set(k.__dict__.get("__annotations__", {}))
    text = (_docstring_entries(ast.get_docstring(node) or "", own).get(name)
            or _comments(node, path, name))
    if text:
      return _short(text)
  return ""


def _section_doc(cls: type) -> str:
  """The class docstring's prose: its paragraphs up to the field entries ("Attributes:")."""
  found = _class_node(cls)
  doc = (ast.get_docstring(found[0]) if found else inspect.cleandoc(cls.__doc__ or "")) or ""
  if doc.startswith(cls.__name__ + "("):     # the signature dataclasses give an undocumented class
    return ""
  doc = doc.split("Attributes:")[0]
  return " ".join(" ".join(p.split()) for p in doc.split("\n\n") if p.strip())


# ---- the config tree ---------------------------------------------------------------------------
def _type_text(cls: type, f: dataclasses.Field) -> str:
  found = _class_node(next(iter(_declaring_classes(cls, f.name)), cls))
  if found is not None:
    for stmt in found[0].body:
      if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
          and stmt.target.id == f.name):
        return ast.unparse(stmt.annotation)
  if isinstance(f.type, str):
    return f.type
  return getattr(f.type, "__name__", None) or str(f.type).replace("typing.", "")


def _default_expression(cls: type, name: str) -> str | None:
  found = _class_node(next(iter(_declaring_classes(cls, name)), cls))
  if found is None:
    return None
  for stmt in found[0].body:
    if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
        and stmt.target.id == name and isinstance(stmt.value, (ast.Name, ast.Attribute))):
      return ast.unparse(stmt.value)
  return None


def _default_text(cls: type, name: str, value: Any) -> str:
  text = repr(value)
  if len(text) <= _MAX_DEFAULT:
    return text
  return _default_expression(cls, name) or text[:_MAX_DEFAULT - 3] + "..."


def sections(cls: type = recipe_config.RecipeConfig, value: Any = None, path: str = ""
             ) -> Iterator[Section]:
  """Every section of the tree, depth first in field order: its leaf fields, with the
  defaults of `value` (the section's default instance; None at the top)."""
  hints = typing.get_type_hints(cls)
  leaves, nested = [], []
  for f in dataclasses.fields(cls):
    if not f.init:
      continue
    if dataclasses.is_dataclass(hints[f.name]):
      nested.append((f, hints[f.name]))
      continue
    kind = _type_text(cls, f) + (" (JSON text)" if f.metadata.get("config") == "json" else "")
    leaves.append(Field(path, f.name, kind, _default_text(cls, f.name, _value(value, f)),
                        description(cls, f.name)))
  yield Section(path, cls, tuple(leaves))
  for f, sub in nested:
    yield from sections(sub, _value(value, f), f"{path}.{f.name}" if path else f.name)


def _value(parent: Any, f: dataclasses.Field) -> Any:
  """Field `f`'s value in `parent`'s default instance; at the top, the field's own default
  (`RecipeConfig()` itself does not validate: its stages' budgets exceed its engine's)."""
  if parent is not None:
    return getattr(parent, f.name)
  if f.default_factory is not dataclasses.MISSING:
    return f.default_factory()
  return f.default


# ---- pages -------------------------------------------------------------------------------------
def _cell(text: str) -> str:
  return text.replace("|", "\\|")


def _prose_cell(text: str) -> str:
  """`text` for a table cell: `<` outside code spans escaped (else Markdown reads
  `<workdir>` as an HTML tag and drops it)."""
  parts = text.split("`")
  return _cell("`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts)))


def _code(text: str) -> str:
  tick = "``" if "`" in text else "`"
  pad = " " if tick == "``" else ""
  return f"{tick}{pad}{_cell(text)}{pad}{tick}"


def _source_link(cls: type) -> str:
  path = os.path.relpath(inspect.getsourcefile(sys.modules[cls.__module__]), REPO)
  return f"[{path}](../../{path})"


def _anchor(path: str) -> str:
  return re.sub(r"[^a-z0-9_-]", "", (path or "top level").lower().replace(" ", "-"))


def render_config() -> str:
  secs = [s for s in sections() if s.fields]
  fields = [f for s in secs for f in s.fields]
  missing = [f for f in fields if not f.description]
  out = [
      "# Config reference", "",
      f"Generated from the code by `{COMMAND}`; do not edit by hand",
      "(`tests/test_reference_pages.py` fails when this page is out of date).", "",
      "Every field of the recipe's config tree, `RecipeConfig` in "
      f"{_source_link(recipe_config.RecipeConfig)}. Each section holds the keyword "
      "arguments of the dataclass it builds ([architecture](../architecture.md), "
      "\"From config to code\"); set a field on the command line by its path, e.g. "
      "`--config.rl.loss.eps_high=0.28`. Defaults are the dataclasses' own (`stage2` and "
      "`stage3` default to 0 steps); the config files in `experiments/configs/` set their "
      "own. The description is the first sentence of what the field's code says (its "
      "docstring entry, or its comment); the section's source file has the rest.", "",
      f"{len(fields)} fields in {len(secs)} sections; {len(missing)} without a description in "
      "the code.", "",
      "Sections: " + ", ".join(f"[{s.path or 'top level'}](#{_anchor(s.path)})" for s in secs)
      + ".", "",
  ]
  for s in secs:
    out += [f"## {s.path or 'top level'}", ""]
    intro = f"`{s.cls.__name__}` in {_source_link(s.cls)}."
    doc = _section_doc(s.cls)
    out += [f"{intro} {_prose_cell(doc)}" if doc else intro, ""]
    out += ["| field | type | default | description |", "|---|---|---|---|"]
    for f in s.fields:
      full = f"{s.path}.{f.name}" if s.path else f.name
      out.append(f"| `{full}` | {_code(f.type)} | {_code(f.default)} | "
                 f"{_prose_cell(f.description) if f.description else NO_DESCRIPTION} |")
    out.append("")
  return "\n".join(out)


def _group(name: str) -> str:
  return name.split("/")[0] if "/" in name else ""


def render_metrics() -> str:
  out = [
      "# Metrics reference", "",
      f"Generated from `rstar_jax/metric_table.py` by `{COMMAND}`; do not edit by hand. The",
      "tests fail when a run writes a key the table does not have, when an entry is not written",
      "by the test run it names, and when this page is out of date.", "",
      "Every row of a metrics file is one JSON object per step (its `step`), the same scalars go "
      "to TensorBoard, and the progress plot (`rl_progress.png`) and the sweep tables read them. "
      "A rate or mean over nothing (no tool call, no correct trajectory) is left out of a row, "
      "never written as 0 (`rollout/stats.py`); a step that made no update (`update/skipped` 1) "
      "has no `train/` keys. A name's `<what>` is a variable part; keys of a JSON report are "
      "flattened (nested objects joined by `.`, list items as `[]`).", "",
  ]
  for file, (path, what) in metric_table.FILES.items():
    rows = [m for m in metric_table.METRICS if m.file == file]
    out += [f"## {path.rsplit('/', 1)[-1]}", "", f"`{path}`: {_prose_cell(what)}.", ""]
    groups: dict[str, list[metric_table.Metric]] = {}
    for m in rows:
      groups.setdefault(_group(m.name) if file != "eval" else "", []).append(m)
    for g, ms in groups.items():
      if len(groups) > 1:
        title, note = metric_table.GROUPS.get(g, (g, ""))
        out += [f"### {title}", ""] + ([_prose_cell(note), ""] if note else [])
      out += ["| metric | unit | meaning | written |", "|---|---|---|---|"]
      for m in ms:
        out.append(f"| `{m.name}` | {m.unit} | {_prose_cell(m.meaning)} | "
                   f"{_prose_cell(m.when) if m.when else 'always'} |")
      out.append("")
  return "\n".join(out)


PAGES = {"config.md": render_config, "metrics.md": render_metrics}


def stale(directory: str) -> list[str]:
  """The pages under `directory` that differ from what the code gives (missing ones too)."""
  out = []
  for name, render in PAGES.items():
    path = os.path.join(directory, name)
    try:
      with open(path, encoding="utf-8") as f:
        current = f.read()
    except OSError:
      current = None
    if current != render():
      out.append(path)
  return out


def write(directory: str) -> list[str]:
  os.makedirs(directory, exist_ok=True)
  paths = []
  for name, render in PAGES.items():
    path = os.path.join(directory, name)
    with open(path, "w", encoding="utf-8") as f:
      f.write(render())
    paths.append(path)
  return paths


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  mode = parser.add_mutually_exclusive_group(required=True)
  mode.add_argument("--write", action="store_true", help="regenerate the pages")
  mode.add_argument("--check", action="store_true",
                    help="exit 1 naming each page that is out of date")
  parser.add_argument("--dir", default=os.path.join(REPO, PAGES_DIR),
                      help="where the pages are (default: docs/reference)")
  args = parser.parse_args(argv)
  if args.write:
    for path in write(args.dir):
      print(f"wrote {path}")
    return 0
  old = stale(args.dir)
  for path in old:
    print(f"out of date: {path} (regenerate it: {COMMAND})", file=sys.stderr)
  return 1 if old else 0


if __name__ == "__main__":
  sys.exit(main())
