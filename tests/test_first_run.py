"""A fresh machine's first run: the README's main command without bubblewrap stops at once
with what to install and the switch that runs without it, before any work or workdir."""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_recipe_without_bubblewrap_stops_before_any_work_naming_the_fix(tmp_path):
  workdir = tmp_path / "run"
  env = {k: v for k, v in os.environ.items() if k != "SANDBOX_ALLOW_WEAK_ISOLATION"}
  env["PATH"] = str(tmp_path / "empty")   # no bwrap to find (the interpreter is absolute)
  p = subprocess.run([sys.executable, "-m", "experiments.recipe", "--config",
                      "experiments/configs/toy.py:smoke", f"--config.workdir={workdir}"],
                     cwd=REPO, env=env, capture_output=True, text=True)
  assert p.returncode == 2, p.stderr
  assert "cannot run on this machine: the sandbox server cannot start here" in p.stderr
  assert "apt-get install -y bubblewrap" in p.stderr
  assert "SANDBOX_ALLOW_WEAK_ISOLATION=1" in p.stderr
  assert "Traceback" not in p.stderr
  assert "Unable to initialize backend" not in p.stderr   # JAX's start-up noise is quiet
  assert not workdir.exists()   # refused before the workdir, the tokenizer, any compile


def test_pyproject_states_the_python_this_runs_on():
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
  assert project["name"] == "rstar-jax"
  assert project["requires-python"] == ">=3.11"
  assert sys.version_info >= (3, 11)
  # The requirements files stay the one source of the environment's exact pins.
  assert "dependencies" not in project


def test_the_readme_s_first_run_after_installing_is_the_smoke_recipe_then_the_full_one():
  """A reader's first command installs and runs the one-minute smoke run, the next
  installs and runs the full recipe (the main job, one command from a fresh machine);
  both are commands tests/test_docs.py checks (module, flags, config keys)."""
  from tests import test_docs
  cmds = test_docs._commands("README.md")
  install = "pip install -r requirements.txt && "
  first = next(i for i, c in enumerate(cmds) if c.startswith(install))
  smoke, full = cmds[first], cmds[first + 1]
  recipe = install + "python -m experiments.recipe --config experiments/configs/toy.py"
  assert smoke.startswith(recipe + ":smoke "), cmds
  assert full.startswith(recipe + " "), cmds
  for cmd in (smoke, full):
    assert ("README.md", cmd) in test_docs._cases()
    test_docs._check(cmd, "README.md")
