"""The device check's driver: runs each section in a process of its own
(`python -m experiments.device_check --run_section NAME`, the flags forwarded) with its
own time limit, records its figures or its error, and gathers the report (written by
`report`)."""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

from absl import app
from absl import flags

from experiments.device_check.report import json_default, write_json
from experiments.device_check.sections_env_numerics import section_env, section_numerics
from experiments.device_check.sections_hf_recipe import section_hf_io, section_recipe
from experiments.device_check.sections_rollouts import section_rollouts
from experiments.device_check.sections_train import (section_memory, section_parts,
                                                     section_train_step)
from experiments.device_check.workload import repo_root, scratch_dir

FLAGS = flags.FLAGS

SECTIONS = ("env", "numerics", "train_step", "parts", "memory", "rollouts", "hf_io", "recipe")
# Seconds each section may take on one H100 (its own limit; the whole check also stops
# starting sections when --budget_s is spent). With --tiny (a CPU) they are 4x these:
# a loaded 2-core host is slow too.
SECTION_LIMIT_S = {"env": 90, "numerics": 150, "train_step": 300, "parts": 200,
                   "memory": 150, "rollouts": 200, "hf_io": 200, "recipe": 300}

SECTION_FNS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "env": section_env, "numerics": section_numerics, "train_step": section_train_step,
    "parts": section_parts, "memory": section_memory, "rollouts": section_rollouts,
    "hf_io": section_hf_io, "recipe": section_recipe}
assert tuple(SECTION_FNS) == SECTIONS


def _commit() -> str | None:
  try:
    run = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo_root(),
                         capture_output=True, text=True, timeout=10)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           cwd=repo_root(), capture_output=True, text=True, timeout=10).stdout
    return run.stdout.strip() + ("+dirty" if dirty.strip() else "") if run.returncode == 0 else None
  except (OSError, subprocess.TimeoutExpired):
    return None


def run_one_section(name: str) -> None:
  """Child process: runs section `name`, writes its JSON (figures or the error)."""
  ctx = {}
  if FLAGS.context and os.path.exists(FLAGS.context):
    with open(FLAGS.context) as f:
      ctx = json.load(f)
  from rstar_jax import compile_cache
  if FLAGS.xla_cache:
    compile_cache.enable(FLAGS.xla_cache)
  t = time.perf_counter()
  try:
    if FLAGS.inject_failure == name:
      raise RuntimeError(f"failure injected into section {name!r} (--inject_failure)")
    if FLAGS.inject_failure == f"crash:{name}":   # a process that dies without a word
      os._exit(3)
    result = {"ok": True, **SECTION_FNS[name](ctx)}
  except Exception as e:
    result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:4000],
              "traceback": traceback.format_exc()[-6000:]}
  result["seconds"] = time.perf_counter() - t
  with open(FLAGS.section_result, "w") as f:
    json.dump(result, f, indent=1, default=json_default)


def forwarded_flags() -> list[str]:
  """The command's flags that a section's process runs with (and the scratch directory)."""
  names = ("tiny", "layers", "seq_lens", "attention_impls", "levers", "steps", "slots",
           "recipe_overrides", "inject_failure", "xla_cache")
  args = []
  for name in names:
    value = FLAGS[name].value
    if isinstance(value, bool):
      args.append(f"--{name}" if value else f"--no{name}")
    elif isinstance(value, list):
      args.append(f"--{name}={','.join(value)}")
    else:
      args.append(f"--{name}={value}")
  return args + [f"--scratch={scratch_dir()}"]


def _text(captured) -> str:
  """What a timed-out process wrote (bytes, text or None), as text."""
  if isinstance(captured, bytes):
    return captured.decode(errors="replace")
  return captured or ""


def run_check() -> dict[str, Any]:
  """Runs the sections of --sections in order, each in a process of its own: the report."""
  unknown = [s for s in FLAGS.sections if s not in SECTIONS]
  if unknown:
    raise app.UsageError(f"--sections: unknown {unknown}; known: {list(SECTIONS)}")
  os.makedirs(FLAGS.out, exist_ok=True)
  started = time.perf_counter()
  report: dict[str, Any] = {
      "schema": 1, "benchmark": "device_check",
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "commit": _commit(), "command": " ".join(["python -m experiments.device_check"]
                                               + sys.argv[1:]),
      "tiny": FLAGS.tiny, "load_average": list(os.getloadavg()), "sections": {}}
  budget = FLAGS.budget_s if FLAGS.budget_s is not None else (1e9 if FLAGS.tiny else 560.0)
  context_path = os.path.join(scratch_dir(), "context.json")
  for name in SECTIONS:
    if name not in FLAGS.sections:
      continue
    left = budget - (time.perf_counter() - started)
    if left <= 5:
      report["sections"][name] = {"ok": False, "skipped": True, "seconds": None,
                                  "wall_s": 0.0,
                                  "error": f"not started: --budget_s {budget:g} spent"}
      continue
    # On a CPU (--tiny) a loaded 2-core host may run several times slower than a quiet
    # one: the limits only catch hangs there.
    limit = min(SECTION_LIMIT_S[name] * (4 if FLAGS.tiny else 1), left)
    result_path = os.path.join(scratch_dir(), f"section_{name}.json")
    if os.path.exists(result_path):
      os.remove(result_path)
    with open(context_path, "w") as f:
      json.dump({k: v for k, v in report["sections"].items()}, f, default=json_default)
    cmd = [sys.executable, "-m", "experiments.device_check", f"--run_section={name}",
           f"--section_result={result_path}", f"--context={context_path}",
           *forwarded_flags()]
    print(f"[device_check] {name}: started (limit {limit:.0f} s)", flush=True)
    t = time.perf_counter()
    try:
      run = subprocess.run(cmd, cwd=repo_root(), capture_output=True, text=True, timeout=limit)
      rc, stdout, stderr = run.returncode, run.stdout, run.stderr
    except subprocess.TimeoutExpired as e:
      rc = None
      stdout, stderr = _text(e.stdout), _text(e.stderr)
    wall = time.perf_counter() - t
    if os.path.exists(result_path):
      with open(result_path) as f:
        result = json.load(f)
    else:   # killed by its limit, a crash (segfault, OOM kill) or a failed import
      why = (f"timed out after {limit:.0f} s" if rc is None
             else f"the section's process exited {rc} without a result")
      result = {"ok": False, "error": why, "seconds": None}
    result["wall_s"] = wall
    if not result["ok"]:
      result["output_tail"] = (stdout[-1500:] + "\n" + stderr[-3000:]).strip()
    report["sections"][name] = result
    print(f"[device_check] {name}: {'ok' if result['ok'] else 'FAILED: ' + result['error'][:300]}"
          f" ({wall:.0f} s)", flush=True)
    if FLAGS.out:   # what has run so far survives a kill of the whole check
      write_json(report, partial=True)
  report["total_s"] = time.perf_counter() - started
  report["checks"] = [dict(c, section=name) for name, r in report["sections"].items()
                      for c in r.get("checks", [])]
  report["failed_sections"] = [n for n, r in report["sections"].items() if not r["ok"]]
  env = report["sections"].get("env", {})
  report["device"] = (env.get("devices") or [{}])[0].get("device_kind") if env.get("ok") else None
  return report

