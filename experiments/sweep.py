r"""python -m experiments.sweep --config experiments/configs/toy.py --workdir /tmp/sweep --sweep rl.downsample.method=roc,uniform --seeds 0,1,2 --workers 2

Runs a sweep of config overrides, one run per point, and tabulates the results.

Points: the config file's `get_sweep([variant])` (a list of override dicts, big_vision's
get_hyper style) crossed with the Cartesian product of every `--sweep key=v1,v2` and of
`--seeds` (the key `seed`). `--config.a.b=v` overrides given here go to every point, and
so does `compile_cache_dir=<workdir>/compile_cache` where the config has that field (the
recipe's): the points share their compiled programs. They may not set `workdir` (the
sweep gives each point its own) nor a swept key; nor may `--child_arg`.
Each point runs `python -m <--module> --config <the same --config> --config.k=v ...
--config.workdir=<workdir>/<point name>` (stdout and stderr in `<point dir>/sweep.log`),
up to --workers at once. Finished points (eval_final.json or SWEEP_DONE.json present) are
skipped on rerun; a failed point is reported with its log and the others go on (the
sweep then exits 1). SIGINT or SIGTERM to the sweep (Ctrl-C, `kill`, a scheduler) is
sent on to every running point, which saves and stops as the recipe does; no other point
starts, the tables of what finished are written, and the sweep exits 128 + the signal;
the same command again resumes the stopped points. The points run in their own process
groups and get SIGTERM if the sweep itself is killed (Linux). `--print_only` prints one shell command per unfinished point and
runs nothing.

At the end: `<workdir>/results.csv` (one row per point: eval_final.json's pass@1,
tool-error rate in correct trajectories, response length, ...; the last RL step's
metrics), `results_seeds.csv` (mean and std over points that differ only in seed) and
`results.md` (both tables, also printed); `sweep.json` lists every point.
"""
import shlex
import signal
import sys

from absl import flags
from ml_collections import config_flags

from rstar_jax import config_utils
from rstar_jax.recipe import sweep_overrides, sweep_points, sweep_results, sweep_runner

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "config file (path[:variant]), passed to every point unchanged",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "sweep directory (one sub-directory per point)")
_SWEEP = flags.DEFINE_multi_string("sweep", [], "key=v1,v2 (repeatable; product over keys)")
_SEEDS = flags.DEFINE_list("seeds", [], "seeds: adds the axis seed=...")
_WORKERS = flags.DEFINE_integer("workers", 1, "points run at once")
_PRINT_ONLY = flags.DEFINE_bool("print_only", False, "print one command per point, run nothing")
_MODULE = flags.DEFINE_string("module", "experiments.recipe", "python -m module of each point")
_USE_CONFIG_SWEEP = flags.DEFINE_bool("use_config_sweep", True,
                                      "use the config file's get_sweep() when it has one")
_CHILD_ARGS = flags.DEFINE_multi_string("child_arg", [],
                                        "extra argument for every point, e.g. --stages=sft")


# Entry points whose config is a RecipeConfig: every point's config is built before any
# point runs, so a value the dataclasses refuse stops the sweep at once, not one point later.
_RECIPE_MODULES = ("experiments.recipe", "experiments.train_sft", "experiments.train_rl",
                   "experiments.evaluate")


def main(argv):
  try:
    _main(argv)
  except sweep_points.SweepError as e:
    raise config_utils.ConfigError(str(e)) from None
  except KeyboardInterrupt:   # before any point ran (then `sweep_runner.Stop` handles SIGINT)
    print("sweep stopped by SIGINT before any point started", file=sys.stderr)
    sys.exit(130)


def _main(argv):
  del argv   # config_utils.run refuses positional arguments
  if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    # A background job of a non-interactive shell starts with SIGINT ignored; the sweep
    # is stopped with it as with SIGTERM (`sweep_runner.Stop` takes over once points run).
    signal.signal(signal.SIGINT, signal.default_int_handler)
  if not _WORKDIR.value:
    raise config_utils.ConfigError("--workdir is required (the sweep's directory)")
  spec = config_flags.get_config_filename(flags.FLAGS["config"])
  config = _CONFIG.value
  base = dict(config_flags.get_override_values(flags.FLAGS["config"]))

  config_points = sweep_overrides.load_sweep(spec) if _USE_CONFIG_SWEEP.value else None
  axes = [sweep_overrides.parse_axis(s, config) for s in _SWEEP.value]
  if _SEEDS.value:
    try:
      axes.append((sweep_points.SEED_KEY, [int(s) for s in _SEEDS.value]))
    except ValueError:
      raise config_utils.ConfigError(f"--seeds: integers expected, got {_SEEDS.value}") from None
  overrides = sweep_overrides.cross(config_points or [{}], sweep_overrides.product(axes))
  sweep_overrides.check_shared(base, _CHILD_ARGS.value, overrides)
  build = None
  if _MODULE.value in _RECIPE_MODULES:
    from rstar_jax.recipe import recipe_config
    build = recipe_config.build_config
  sweep_overrides.validate(overrides, config, build=build)
  base = {**sweep_overrides.shared_overrides(config, base, overrides, _WORKDIR.value), **base}
  points = sweep_points.make_points(overrides, _WORKDIR.value)

  def argv_of(p, python=sweep_points.python_executable()):
    return sweep_points.command(p, module=_MODULE.value, config_spec=spec, base_overrides=base,
                                python=python, extra_args=_CHILD_ARGS.value)

  if _PRINT_ONLY.value:
    for p in points:
      marker = sweep_points.finished(p, argv_of(p))
      if marker:
        print(f"# {p.name}: finished ({marker})", file=sys.stderr)
      else:
        print(shlex.join(argv_of(p, python="python")))
    return

  n_done = sum(1 for p in points if sweep_points.finished(p, argv_of(p)))
  print(f"sweep: {len(points)} point(s) of {_MODULE.value} with {spec} in {_WORKDIR.value} "
        f"({n_done} finished before), {_WORKERS.value} at once")
  for p in points:
    print(f"  {p.name}")
  sweep_points.write_manifest(_WORKDIR.value, points, argv_of)
  # Held until the tables are written: a signal then, or one to a sweep whose points
  # all ended, still ends the sweep with 128 + signal after the tables.
  with sweep_runner.Stop() as stop:
    outcomes = sweep_runner.run_points(points, argv_of, workers=_WORKERS.value, stop=stop)
    sweep_points.write_manifest(_WORKDIR.value, points, argv_of, outcomes)
    print(sweep_results.write_tables(_WORKDIR.value, points, outcomes))
    print(f"tables: {_WORKDIR.value}/results.md, results.csv, results_seeds.csv")
  bad = [o for o in outcomes if o.status in ("failed", "interrupted", "not started")]
  for status in ("failed", "interrupted", "not started"):
    these = [o for o in bad if o.status == status]
    if these:
      print(f"{len(these)} point(s) {status}:", file=sys.stderr)
      for o in these:
        print(f"  {o.point.name}: {o.detail}; log: {o.point.log}", file=sys.stderr)
  if stop.requested:
    print(f"sweep stopped by {stop.name}: the tables hold the points that finished; run "
          "the same command again to resume the others (finished points are skipped)",
          file=sys.stderr)
    sys.exit(128 + stop.signum)
  if bad:
    sys.exit(1)


if __name__ == "__main__":
  config_utils.run(main)
