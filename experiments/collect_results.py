r"""python -m experiments.collect_results --workdir /tmp/rstar_toy --name toy_recipe_avx512_2026-11-28 --command="python -m experiments.recipe --config experiments/configs/toy.py --config.workdir=/tmp/rstar_toy" --wall_s 900 --load_start 0.2

Turns a finished run's work directory into a small results folder that can be committed:
`experiments/results/<name>/` with the run's metrics JSONL, evaluation JSON, plot and a
`meta.json` saying where, when and from what the figures came.

Run it in either of two ways:

* wrapping the run, so that everything in meta.json is measured in the same process: the
  command after `--` runs in the current directory, with the fp32 1024^3 matmul peak
  (`experiments.common.roofline`) and the load average measured before it starts and after it
  ends, and its wall time; then the work directory is collected:
    python -m experiments.collect_results --workdir /tmp/rstar_toy --name toy_recipe -- \
        python -m experiments.recipe --config experiments/configs/toy.py --config.workdir=/tmp/rstar_toy
* after the fact, on a work directory a run already finished: `--command`, `--wall_s` and
  `--load_start` say what ran, how long it took and how loaded the host was when it
  started (meta.json must not guess them); the peak and the end load are measured at
  collection, right after the run.

What a work directory is, and what is copied (never checkpoints or exports: a folder
stays a few MB, `--max_mb`):

  recipe     `config.json` and `eval_final.json`, every stage directory with its
             `DONE.json` (a stage without one did not finish: refused). Copied: config.json,
             the evaluation reports `eval_*.json` (+ `.made_with.json`), each stage's
             metrics JSONL and DONE.json, `rl_progress.png` (drawn from the metrics when the
             run left none), the evaluations' trajectories gzipped (`--samples`).
  sweep      `sweep.json` and `results.md` (written when a sweep ends); every point must be
             a finished recipe run. Copied: results.md / .csv, results_seeds.csv, sweep.json,
             and each point as a recipe run under `points/<point>/`, without trajectories.
  benchmark  JSON files only, from a benchmark's `--out` (e.g.
             `experiments.benchmarks.async_throughput --out <workdir>/async_throughput.json`). Copied: every `*.json`, plus a plot of
             per-step seconds when a file holds `measured` rows with `per_step_s`.

`--extra FILE` copies more files (a run's stdout log, say). meta.json holds: date, commit
and dirty flag of `--code_dir` (the checkout the run's code came from), the command, CPU
model, family and model number, ISA (avx512 / avx2), core count, load average at start and end, wall time, the
matmul peak rounds measured here (min / median / max), the files with their sizes and
sha256, and the headline figures read from the evaluation reports (pass@1 with a 95%
bootstrap interval over problems, the tool-error rate in correct trajectories).
"""
from __future__ import annotations

import datetime
import glob
import gzip
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags

from experiments.common import results_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE_STAGES = ("sft", "stage1", "stage2", "stage3")

flags.DEFINE_string("workdir", None, "the finished run's work directory")
flags.DEFINE_string("name", None, "folder name under --out_root (letters, digits, . _ -)")
flags.DEFINE_string("out_root", os.path.join(REPO, "experiments", "results"),
                    "where the results folder goes")
flags.DEFINE_string("command", "", "the command that made --workdir (collecting after the fact)")
flags.DEFINE_float("wall_s", None, "the run's wall time in seconds (collecting after the fact)")
flags.DEFINE_float("load_start", None,
                   "1-minute load average when the run started (collecting after the fact)")
flags.DEFINE_string("started", "", "when the run started, ISO 8601 UTC (default: unknown)")
flags.DEFINE_string("code_dir", "", "git checkout the run's code came from (default: the "
                    "current directory's checkout)")
flags.DEFINE_integer("peak_rounds", 3, "matmul peak measurements (each a median of 7)",
                     lower_bound=1)
flags.DEFINE_multi_string("extra", [], "another file to copy into the folder (repeatable)")
flags.DEFINE_bool("samples", True, "copy the evaluations' trajectories (gzipped) of a recipe run")
flags.DEFINE_float("max_mb", 5.0, "refuse a folder larger than this", lower_bound=0.0)
flags.DEFINE_bool("overwrite", False, "replace an existing folder of that name")
FLAGS = flags.FLAGS


class NotFinished(ValueError):
  """The work directory is not a finished run (or not one this tool knows)."""


# ---- what kind of run, and is it finished ----

def kind_of(workdir: str) -> str:
  """'recipe', 'sweep' or 'benchmark'; NotFinished names what is missing otherwise."""
  if not os.path.isdir(workdir):
    raise NotFinished(f"--workdir={workdir}: no such directory")
  if os.path.exists(os.path.join(workdir, "sweep.json")):
    return "sweep"
  if os.path.exists(os.path.join(workdir, "config.json")):
    return "recipe"
  if glob.glob(os.path.join(workdir, "*.json")):
    return "benchmark"
  raise NotFinished(
      f"--workdir={workdir}: not a run this tool knows: no config.json (a recipe run), "
      f"sweep.json (a sweep) nor *.json (a benchmark's --out). Point --workdir at the "
      f"directory the run wrote")


def check_recipe(workdir: str) -> list[str]:
  """The finished stages of a recipe run; NotFinished if it did not finish."""
  if not os.path.exists(os.path.join(workdir, "eval_final.json")):
    raise NotFinished(
        f"--workdir={workdir}: no eval_final.json, so the recipe did not finish (the final "
        f"evaluation writes it last). Rerun the run's command to resume it, then collect")
  stages = []
  for stage in RECIPE_STAGES:
    d = os.path.join(workdir, stage)
    if not os.path.isdir(d):
      continue   # a stage the config turned off
    if not os.path.exists(os.path.join(d, "DONE.json")):
      raise NotFinished(
          f"--workdir={workdir}: {stage}/ has no DONE.json, so that stage did not finish. "
          f"Rerun the run's command to resume it, then collect")
    stages.append(stage)
  return stages


def check_sweep(workdir: str) -> list[tuple[str, str]]:
  """(name, directory) of each point; NotFinished unless the sweep ended and each finished."""
  if not os.path.exists(os.path.join(workdir, "results.md")):
    raise NotFinished(
        f"--workdir={workdir}: sweep.json but no results.md, so the sweep did not end "
        f"(it writes results.md last). Rerun the sweep's command to resume it, then collect")
  with open(os.path.join(workdir, "sweep.json")) as f:
    sweep = json.load(f)
  points = _points(workdir, sweep)
  if not points:
    raise NotFinished(f"--workdir={workdir}: sweep.json lists no points")
  for name, d in points:
    if not os.path.exists(os.path.join(d, "eval_final.json")):
      raise NotFinished(
          f"--workdir={workdir}: point {name} has no eval_final.json (not finished). Rerun "
          f"the sweep's command to resume it, then collect")
    check_recipe(d)
  return points


def _points(workdir: str, sweep: dict) -> list[tuple[str, str]]:
  """(name, directory) per point of sweep.json: `<workdir>/<name>` (a sweep directory that
  was moved keeps its points beside it), else the directory the manifest recorded."""
  out = []
  for p in sweep.get("points", []):
    beside = os.path.join(workdir, p["name"])
    out.append((p["name"], beside if os.path.isdir(beside) else p.get("workdir") or beside))
  return out


def check_benchmark(workdir: str) -> list[str]:
  files = sorted(glob.glob(os.path.join(workdir, "*.json")))
  for path in files:
    try:
      with open(path) as f:
        json.load(f)
    except ValueError as e:
      raise NotFinished(f"--workdir={workdir}: {os.path.basename(path)} is not JSON ({e}); a "
                        f"benchmark writes its --out file only when it ends") from e
  return files


# ---- copying ----

def _copy(src: str, dst: str) -> None:
  os.makedirs(os.path.dirname(dst), exist_ok=True)
  shutil.copyfile(src, dst)


def _gzip(src: str, dst: str) -> None:
  os.makedirs(os.path.dirname(dst), exist_ok=True)
  # mtime=0: the same trajectories give the same bytes, so a recollected folder diffs clean.
  with open(src, "rb") as fin, open(dst, "wb") as raw, \
      gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as fout:
    shutil.copyfileobj(fin, fout)


def copy_recipe(workdir: str, out: str, *, samples: bool) -> None:
  stages = check_recipe(workdir)
  _copy(os.path.join(workdir, "config.json"), os.path.join(out, "config.json"))
  for path in sorted(glob.glob(os.path.join(workdir, "eval_*.json"))):
    _copy(path, os.path.join(out, os.path.basename(path)))
  if samples:
    for path in sorted(glob.glob(os.path.join(workdir, "eval_*_samples.jsonl"))):
      _gzip(path, os.path.join(out, os.path.basename(path) + ".gz"))
  for stage in stages:
    for path in sorted(glob.glob(os.path.join(workdir, stage, "metrics_*.jsonl"))
                       + [os.path.join(workdir, stage, "DONE.json")]):
      _copy(path, os.path.join(out, stage, os.path.basename(path)))
  plot = os.path.join(workdir, "rl_progress.png")
  rl = [s for s in stages if s != "sft"]
  if os.path.exists(plot):
    _copy(plot, os.path.join(out, "rl_progress.png"))
  elif rl:
    # A run whose plot is gone still has the metrics: draw it from the copies (the run's
    # own directory is only read).
    from rstar_jax.analysis import progress
    progress.plot_rl_progress(out, rl)


def copy_sweep(workdir: str, out: str) -> None:
  points = check_sweep(workdir)
  for base in ("results.md", "results.csv", "results_seeds.csv", "sweep.json"):
    if os.path.exists(os.path.join(workdir, base)):
      _copy(os.path.join(workdir, base), os.path.join(out, base))
  for name, d in points:
    copy_recipe(d, os.path.join(out, "points", name), samples=False)


def copy_benchmark(workdir: str, out: str) -> None:
  for path in check_benchmark(workdir):
    _copy(path, os.path.join(out, os.path.basename(path)))
    with open(path) as f:
      data = json.load(f)
    rows = data.get("measured") if isinstance(data, dict) else None
    if rows and all(isinstance(r, dict) and "per_step_s" in r for r in rows):
      _plot_steps(rows, os.path.join(out, os.path.basename(path)[:-len(".json")] + ".png"))


def _plot_steps(rows: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4))
  for r in rows:
    label = ", ".join(f"{k}={r[k]}" for k in ("engines", "max_staleness") if k in r)
    ax.plot(range(1, len(r["per_step_s"]) + 1), r["per_step_s"], marker=".", label=label)
  ax.set_xlabel("step")
  ax.set_ylabel("seconds")
  ax.set_yscale("log")   # the first steps compile: 10x and more the steady ones
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


# ---- the machine and the code ----

def isa() -> str:
  """'avx512' (AVX-512F), 'avx2', or 'other': which XLA:CPU kernels, hence which bits."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("flags"):
          found = set(line.split(":", 1)[1].split())
          return "avx512" if "avx512f" in found else "avx2" if "avx2" in found else "other"
  except OSError:
    pass
  return "unknown"


def cpu_family() -> str:
  """"family F model M" from /proc/cpuinfo: the model name alone ("AMD EPYC") does not tell
  one generation, hence one set of kernels and speeds, from another."""
  found = {}
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        key = line.split(":", 1)[0].strip()
        if key in ("cpu family", "model") and key not in found:
          found[key] = line.split(":", 1)[1].strip()
        if not line.strip():
          break   # the first processor's block is enough
  except OSError:
    pass
  return (f"family {found['cpu family']} model {found['model']}"
          if len(found) == 2 else "unknown")


def git_state(code_dir: str) -> dict:
  """Commit and whether tracked files differ from it (untracked files do not count: a
  work directory or a log beside the code is not a change to the code)."""
  def git(*args):
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                          cwd=code_dir).stdout.strip()
  try:
    return {"commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "code_dir": os.path.abspath(code_dir)}
  except (OSError, subprocess.CalledProcessError) as e:
    raise ValueError(f"--code_dir={code_dir}: not a git checkout ({e}); give the checkout "
                     f"the run's code came from") from e


def matmul_peak(rounds: int) -> dict:
  from experiments.common import roofline
  peaks = [roofline.matmul_peak_gflops() for _ in range(rounds)]
  return {"what": "fp32 1024^3 jitted matmul, GFLOP/s, each round the median of 7",
          "rounds": peaks, "min": min(peaks), "median": statistics.median(peaks),
          "max": max(peaks)}


# ---- the figures ----

def eval_figures(path: str) -> dict:
  """pass@1 with a 95% bootstrap interval over problems, and the tool-error rates."""
  with open(path) as f:
    report = json.load(f)
  out = {k: report.get(k) for k in ("pass_at_1", "tool_error_rate_correct", "tool_error_rate",
                                    "samples_per_problem", "num_problems", "temperature")}
  scores = [p["num_correct"] / p["num_samples"] for p in report.get("per_problem", [])
            if p.get("num_samples")]
  if scores:
    from rstar_jax.eval import suite
    lo, hi = suite.bootstrap_interval(scores)
    out["pass_at_1_ci95_over_problems"] = [lo, hi]
  return out


def figures(out: str, kind: str) -> dict:
  if kind == "recipe":
    return {os.path.basename(p)[:-len(".json")]: eval_figures(p)
            for p in sorted(glob.glob(os.path.join(out, "eval_*.json")))
            if not p.endswith(".made_with.json") and "_samples" not in p}
  if kind == "sweep":
    return {name: figures(os.path.join(out, "points", name), "recipe")
            for name in sorted(os.listdir(os.path.join(out, "points")))}
  return {}


def file_list(out: str) -> list[dict]:
  rows = []
  for root, _, names in os.walk(out):
    for n in sorted(names):
      path = os.path.join(root, n)
      with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
      rows.append({"path": os.path.relpath(path, out), "bytes": os.path.getsize(path),
                   "sha256": digest})
  return sorted(rows, key=lambda r: r["path"])


# ---- the whole ----

def validate(*, workdir: str | None, name: str, out_root: str, command: str, wall_s: float | None,
             load_start: float | None, code_dir: str, extra=(), overwrite: bool = False
             ) -> tuple[str | None, dict]:
  """(kind, git state) when `collect` can run on these; ValueError (NotFinished for the
  work directory) naming the flag otherwise. Cheap: run before the peak is measured.
  workdir=None: all but the work directory (before the run that makes it); kind None."""
  if not name or not all(c.isalnum() or c in "._-" for c in name):
    raise ValueError(f"--name={name!r}: use letters, digits and . _ - only (one folder "
                     f"name, e.g. toy_recipe_avx512_2026-11-28)")
  if not command:
    raise ValueError("--command is empty: give the command that made --workdir (or run it "
                     "through this tool after --)")
  for field, value in (("wall_s", wall_s), ("load_start", load_start)):
    if value is None or value < 0:
      raise ValueError(f"--{field}={value}: give the run's {field} (>= 0) when collecting after "
                       f"the fact, or run the command through this tool after --")
  for path in extra:
    if not os.path.isfile(path):
      raise ValueError(f"--extra={path}: no such file")
  kind = None
  if workdir is not None:
    kind = kind_of(workdir)
    {"recipe": check_recipe, "sweep": check_sweep, "benchmark": check_benchmark}[kind](workdir)
  state = git_state(code_dir)
  final = os.path.join(out_root, name)
  if os.path.exists(final) and not overwrite:
    raise ValueError(f"{final} exists: choose another --name, or pass --overwrite")
  return kind, state


def collect(*, workdir: str, name: str, out_root: str, command: str, wall_s: float,
            load_start: float, started: str, code_dir: str, peak: dict, load_end: float,
            extra=(), samples: bool = True, max_mb: float = 5.0, overwrite: bool = False,
            peak_before: dict | None = None) -> str:
  """Copies `workdir` into `<out_root>/<name>/` and writes meta.json; returns the folder.
  Nothing is left behind on refusal (a folder is written beside, then moved in place)."""
  kind, state = validate(workdir=workdir, name=name, out_root=out_root, command=command,
                         wall_s=wall_s, load_start=load_start, code_dir=code_dir, extra=extra,
                         overwrite=overwrite)
  final = os.path.join(out_root, name)
  tmp = final + ".partial"
  shutil.rmtree(tmp, ignore_errors=True)
  try:
    if kind == "recipe":
      copy_recipe(workdir, tmp, samples=samples)
    elif kind == "sweep":
      copy_sweep(workdir, tmp)
    else:
      copy_benchmark(workdir, tmp)
    for path in extra:
      _copy(path, os.path.join(tmp, os.path.basename(path)))
    files = file_list(tmp)
    size_mb = sum(r["bytes"] for r in files) / 2**20
    if size_mb > max_mb:
      raise ValueError(
          f"{name}: {size_mb:.1f} MB of files, over --max_mb={max_mb}; the largest: "
          + ", ".join(f"{r['path']} ({r['bytes'] / 2**20:.1f} MB)"
                      for r in sorted(files, key=lambda r: -r["bytes"])[:3])
          + ". Pass --nosamples (a recipe's trajectories) or raise --max_mb")
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    meta = {
        "name": name, "kind": kind, "date": started or now, "collected": now,
        "command": command, **state, "workdir": os.path.abspath(workdir),
        "cpu_model": results_json.cpu_model(), "cpu_family": cpu_family(), "isa": isa(),
        "cores": os.cpu_count(),
        "load_start": load_start, "load_end": load_end, "wall_s": wall_s,
        "matmul_peak_gflops": peak, "figures": figures(tmp, kind), "files": files,
    }
    if peak_before is not None:
      meta["matmul_peak_gflops_before"] = peak_before
    with open(os.path.join(tmp, "meta.json"), "w") as f:
      json.dump(meta, f, indent=1)
    if os.path.exists(final):
      shutil.rmtree(final)
    os.replace(tmp, final)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return final


def main(argv):
  command = argv[1:]
  if command and command[0] == "--":
    command = command[1:]
  if not FLAGS.workdir or not FLAGS.name:
    raise app.UsageError("--workdir and --name are required")
  code_dir = FLAGS.code_dir or os.getcwd()
  peak_before = None
  try:
    if command:
      if FLAGS.command or FLAGS.wall_s is not None or FLAGS.load_start is not None:
        raise app.UsageError("a command after -- is measured here: drop --command, --wall_s "
                             "and --load_start")
      # What can be checked before the run is, not after an hour of it.
      validate(workdir=None, name=FLAGS.name, out_root=FLAGS.out_root, command=" ".join(command),
               wall_s=0, load_start=0, code_dir=code_dir, extra=FLAGS.extra,
               overwrite=FLAGS.overwrite)
      started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
      load_start = os.getloadavg()[0]
      peak_before = matmul_peak(FLAGS.peak_rounds)
      t = time.perf_counter()
      rc = subprocess.run(command).returncode
      wall_s = time.perf_counter() - t
      if rc != 0:
        print(f"[collect_results] the command exited {rc}; nothing collected", file=sys.stderr)
        sys.exit(rc)
      text = " ".join(command)
    else:
      started, load_start, wall_s, text = (FLAGS.started, FLAGS.load_start, FLAGS.wall_s,
                                           FLAGS.command)
    load_end = os.getloadavg()[0]
    kw = dict(workdir=FLAGS.workdir, name=FLAGS.name, out_root=FLAGS.out_root, command=text,
              wall_s=wall_s, load_start=load_start, code_dir=code_dir, extra=FLAGS.extra,
              overwrite=FLAGS.overwrite)
    validate(**kw)   # before the peak's seconds are spent
    peak = matmul_peak(FLAGS.peak_rounds)
    final = collect(**kw, started=started, peak=peak, load_end=load_end,
                    samples=FLAGS.samples, max_mb=FLAGS.max_mb, peak_before=peak_before)
  except ValueError as e:   # NotFinished included: a clear line, not a traceback
    print(f"[collect_results] {e}", file=sys.stderr)
    sys.exit(2)
  with open(os.path.join(final, "meta.json")) as f:
    meta = json.load(f)
  size = sum(r["bytes"] for r in meta["files"]) / 2**20
  print(f"{final}: {len(meta['files'])} files, {size:.2f} MB; {meta['cpu_model']} "
        f"({meta['isa']}, {meta['cores']} cores), matmul peak median "
        f"{peak['median']:.0f} GFLOP/s, load {load_start:.1f} -> {load_end:.1f}, "
        f"wall {wall_s:.0f} s")
  for what, fig in meta["figures"].items():
    if isinstance(fig, dict) and "pass_at_1" in fig:
      ci = fig.get("pass_at_1_ci95_over_problems")
      print(f"  {what}: pass@1 {100 * fig['pass_at_1']:.1f}%"
            + (f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]" if ci else ""))


if __name__ == "__main__":
  app.run(main)
