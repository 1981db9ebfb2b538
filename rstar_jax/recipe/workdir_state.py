"""What a recipe run keeps in its work directory besides the stages' own files.

  <workdir>/.lock           held by process 0 for the run (`workdir_lock`): one run at a
                            time per directory.
  <workdir>/<stage>/DONE.json
                            a finished stage and its summary (`mark_done`, `stage_done`);
                            a stage with a checkpoint under <stage>/checkpoints/ is
                            resumable (`stage_started`).
  <workdir>/config.json     the resolved config the stages were made with
                            (`check_workdir`): a rerun with another one is refused while a
                            stage is finished or resumable, launch settings aside.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Any

from absl import logging

from rstar_jax import config_utils, distributed

# `cfg` below is a recipe_config.RecipeConfig, typed Any: recipe_config imports this
# module (STAGE_DIRS), and this one reads only the config's workdir and
# allow_config_change fields and its JSON.
# The stages that leave a directory <workdir>/<stage>/ (checkpoints, the export,
# DONE.json), in run order; the final evaluation leaves reports beside them.
STAGE_DIRS = ("sft", "stage1", "stage2", "stage3")


def resolved_json(cfg: Any) -> str:
  """The text of <workdir>/config.json: the whole resolved config."""
  return json.dumps(config_utils.as_plain(cfg), indent=2)   # field order; schema order kept


def stage_done(workdir: str, stage: str) -> dict | None:
  """The summary a finished `stage` left in its DONE.json, or None."""
  path = os.path.join(workdir, stage, "DONE.json")
  if os.path.exists(path):
    try:
      with open(path) as f:
        done = json.load(f)
    except ValueError as e:   # written atomically by us: a hand-made or damaged file
      raise config_utils.ConfigError(f"{path} is not a JSON object ({e}); remove it to run "
                                     f"stage {stage} again") from None
    if not isinstance(done, dict):
      raise config_utils.ConfigError(f"{path} is not a JSON object; remove it to run stage "
                                     f"{stage} again")
    return done
  return None


@contextlib.contextmanager
def workdir_lock(workdir: str):
  """Process 0 holds `<workdir>/.lock` for the run: a second run on the same directory
  (a command started twice, a requeued job overlapping the old one) is refused, on
  every process. Both ran side by side before, cutting and appending each other's
  metrics rows and saving the same checkpoint steps from different trajectories."""
  import fcntl
  import socket
  f, refused = None, None
  if distributed.is_main():
    f = open(os.path.join(workdir, ".lock"), "a+")
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
      f.seek(0)
      f.truncate()
      f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
      f.flush()
    except OSError:
      f.seek(0)
      holder = f.read().strip() or "another process"
      f.close()
      f = None
      refused = (f"{workdir} is in use by {holder} (another run of this recipe); wait for it "
                 f"to end, stop it, or give this run another config.workdir")
  refused = distributed.share_from_main(refused)
  if refused:
    raise config_utils.ConfigError(refused)
  try:
    yield
  finally:
    if f is not None:
      f.close()   # the lock goes with the descriptor (and with the process, if killed)


def stage_started(workdir: str, stage: str) -> bool:
  """Whether `stage` is finished or has saved a checkpoint to resume from."""
  ckpts = os.path.join(workdir, stage, "checkpoints")
  return bool(stage_done(workdir, stage)) or (os.path.isdir(ckpts) and bool(os.listdir(ckpts)))


def mark_done(workdir: str, stage: str, summary: dict) -> None:
  if not distributed.is_main():
    return
  path = os.path.join(workdir, stage, "DONE.json")
  with open(path + ".tmp", "w") as f:
    json.dump(summary, f, indent=2, default=float)
  os.replace(path + ".tmp", path)


# How a run is launched, not what it computes: never a config change. Process 1 of a
# multi-process run compares against the config.json that process 0 may have just
# written (process_id 0); a resumed run may use another coordinator or process count;
# a fleet's servers come up on new ports (or nodes) at every launch and requeue, and
# the RL stages of a run whose SFT ran in-process go to servers (cluster_toy.py).
_LAUNCH_KEYS = ("workdir", "compile_cache_dir", "allow_config_change", "allow_random_init",
                "distributed", "tools.urls", "rollout.servers", "rollout.backend",
                "tools.urls_file", "rollout.servers_file",
                # How often a run saves and how many it keeps, and how the HTTP client
                # waits and retries: nothing the run computes depends on them (and freeing
                # disk mid-run should not need allow_config_change).
                "rl.checkpoint_every", "rl.keep_checkpoints", "sft.checkpoint_every",
                "sft.keep_checkpoints", "rollout.client")


def _is_launch_key(path: str) -> bool:
  return any(path == k or path.startswith(k + ".") for k in _LAUNCH_KEYS)


def make_workdir(path: str) -> str:
  workdir = os.path.abspath(path)
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:   # a file there or above it, no permission
    raise config_utils.ConfigError(f"config.workdir={workdir}: cannot use it as the run's "
                                   f"directory ({type(e).__name__}: {e.strerror or e})") from None
  return workdir


def check_workdir(cfg: Any) -> tuple[str, str]:
  """Writes the resolved config to <workdir>/config.json; returns the workdir and the
  config file that holds this run's config.

  A different config.json already there while stages are finished or have a checkpoint
  to resume from: refused (they were made with the old one), naming every changed key;
  with allow_config_change the new one goes beside it (config_<n>.json), never over it."""
  workdir = make_workdir(cfg.workdir)
  text = resolved_json(cfg)
  path = os.path.join(workdir, "config.json")
  done = [s for s in STAGE_DIRS if stage_started(workdir, s)]
  if os.path.exists(path) and done:
    with open(path) as f:
      old = json.load(f)
    changes = [c for c in config_utils.diff(old, json.loads(text))
               if not _is_launch_key(c.split(":", 1)[0])]
    if changes and not cfg.allow_config_change:
      raise config_utils.ConfigError(
          f"{workdir} holds stages {done} (finished or resumable) made with another config; "
          "changed: "
          + "; ".join(changes[:20]) + (" ..." if len(changes) > 20 else "")
          + ". Use a new --config.workdir, or --config.allow_config_change=True to go on "
          "with the new config (written beside the old one)")
    if changes:
      n = 1
      while os.path.exists(os.path.join(workdir, f"config_{n}.json")):
        beside = os.path.join(workdir, f"config_{n}.json")
        with open(beside) as f:
          if f.read() == text:   # this config again (a rerun): not another copy
            return workdir, beside
        n += 1
      path = os.path.join(workdir, f"config_{n}.json")
      logging.warning("config differs from the finished stages' (%s); writing %s",
                      "; ".join(changes), path)
    else:
      return workdir, path
  if distributed.is_main():
    with open(path + ".tmp", "w") as f:
      f.write(text)
    os.replace(path + ".tmp", path)
  return workdir, path


def last_done(workdir: str, before: str) -> str | None:
  """The last stage finished in `workdir` before stage `before` (any other name: of
  all), or None."""
  order = list(STAGE_DIRS)
  stop = order.index(before) if before in order else len(order)
  done = [s for s in order[:stop] if stage_done(workdir, s)]
  return done[-1] if done else None
