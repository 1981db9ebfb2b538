"""Orchestration: what runs the layers below as jobs.

  stages   the multi-stage recipe (SFT -> RL stages 1-3 -> evaluation): its config,
           the stage runners, resume and the work directory's markers.
  sweep    many recipe runs over a grid of config overrides, their tables and manifest.
  cluster  fleets on Ray (sandbox servers, rollout servers, trainer processes) and
           their supervision.

Nothing below this package imports it.
"""
