"""Narrow tests that kill mutants of experiments/mutation_pass.py no other test killed.

load_pending (`rl/async_rollouts.py`): at a resume, the pending rollouts saved with
checkpoint `step` are taken back only as a contiguous run from `step`, each within the
staleness bound; the first that breaks either rule ends the run (what follows it was
generated after a rollout the resumed run regenerates, so it is regenerated too).
"""
from __future__ import annotations

import pytest

from rstar_jax.rl import async_rollouts as async_lib
from rstar_jax.rollout import agent_loop


def _save(directory, step, entries):
  """entries: (step, version_step) pairs, saved as `save_pending` writes them."""
  saved = []
  for s, v in entries:
    p = async_lib.Pending(step=s, version=f"v{v}", version_step=v, data_before={"pos": s},
                          data_after={"pos": s + 1}, future=None)
    groups = [[agent_loop.Trajectory(uid=f"p{s}#0", prompt_ids=[1],
                                     weight_versions=[f"v{v}"])]]
    saved.append((p, groups, 0.5))
  async_lib.save_pending(str(directory), step, saved, {f"v{v}": v for _, v in entries})


def _taken(directory, step, max_staleness):
  pending, versions = async_lib.load_pending(str(directory), step, max_staleness)
  return [(p.step, p.version_step) for p in pending], versions


@pytest.mark.parametrize("entries, bound, expected", [
    ([(3, 2), (4, 3), (5, 4)], 1, [(3, 2), (4, 3), (5, 4)]),   # all within the bound
    ([(3, 2), (4, 2)], 1, [(3, 2)]),                          # step 4 two versions old
    ([(3, 2), (4, 2), (5, 4)], 1, [(3, 2)]),                  # ... and what follows it
    ([(3, 2), (4, 2)], 2, [(3, 2), (4, 2)]),                  # a larger bound takes it
    ([(3, 2), (5, 4)], 1, [(3, 2)]),                          # a gap ends the run
    ([(4, 3), (5, 4)], 1, []),                                # not from the checkpoint's step
    ([(3, 4)], 1, []),                                        # a version from the future
])
def test_load_pending_takes_back_a_contiguous_run_within_the_bound(tmp_path, entries, bound,
                                                                   expected):
  _save(tmp_path, 3, entries)
  taken, versions = _taken(tmp_path, 3, bound)
  assert taken == expected
  assert versions == {f"v{v}": v for _, v in entries}


def test_load_pending_without_a_file_takes_nothing(tmp_path):
  assert _taken(tmp_path, 3, 1) == ([], {})
