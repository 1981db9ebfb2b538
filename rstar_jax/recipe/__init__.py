"""Orchestration: what runs the layers below as jobs.

  stages   the multi-stage recipe (SFT -> RL stages 1-3 -> evaluation): its config,
           the stage runners and resume.
  workdir_state
           a run's work directory: its lock, the stages' done markers, config.json and
           the config changes refused under finished stages.
  sweep_overrides, sweep_points, sweep_runner, sweep_results
           many recipe runs over a grid of config overrides: the points and their
           checks, their names, commands and manifest, their processes, their tables.
  cluster  fleets on Ray (sandbox servers, rollout servers, trainer processes) and
           their supervision.
  layout   a multi-node run's layout: which devices train, serve rollouts, run sandboxes.
  sections every section dataclass and helper a config file names: the one module
           experiments/configs/*.py import.
  preflight_checks
           the cheap part of the launch checks (bytes from shapes, rollout memory): the
           preflight prints them, the recipe runs them at start.
  reference
           generates docs/reference/ (every config field, every metric) and checks it.

Nothing below this package imports it.
"""
