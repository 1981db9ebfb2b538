"""rstar_jax.checkpoint under faults: a writer killed mid-save, a torn step directory,
a full disk (a real tmpfs), `max_to_keep` across reopenings. Real orbax, real files,
real processes; the saved values are known functions of the step, so a restore is
checked against numpy."""
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import jax.numpy as jnp
import numpy as np
import pytest

from rstar_jax import checkpoint as ckpt_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 1 << 20     # 4 MB of float32: a save takes long enough to be cut off inside


def _state(step, n=N):
  return {"w": jnp.asarray(np.random.default_rng(step).standard_normal(n, dtype=np.float32))}


def _check_restores(ck, step, n=N):
  state, meta = ck.restore(_state(0, n))
  assert meta == {"step": step}
  np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(_state(step, n)["w"]))


_WRITER = """
import sys, numpy as np, jax.numpy as jnp
from rstar_jax import checkpoint as C
ck = C.Checkpointer(sys.argv[1], max_to_keep=2)
for step in range(1000):
  w = jnp.asarray(np.random.default_rng(step).standard_normal(%d, dtype=np.float32))
  ck.save(step, {"w": w}, {"step": step})
  print(step, flush=True)
""" % N


def test_a_writer_killed_mid_save_leaves_only_complete_steps(tmp_path):
  d = str(tmp_path / "ckpt")
  proc = subprocess.Popen([sys.executable, "-c", _WRITER, d], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True,
                          env={**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"})
  try:
    assert proc.stdout.readline().strip() == "0"       # one complete step on disk
    while not any(ckpt_lib.TMP_MARK in n for n in os.listdir(d)):
      assert proc.poll() is None
      time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)                    # inside the next save
  finally:
    proc.kill()
    proc.wait()
  ck = ckpt_lib.Checkpointer(d, max_to_keep=2)
  steps = ck.all_steps()
  assert steps and ck.latest_step() == max(steps)
  for s in steps:
    assert os.path.exists(os.path.join(d, str(s), ckpt_lib.COMMIT_FILE))
  _check_restores(ck, max(steps))
  ck.save(max(steps) + 1, _state(max(steps) + 1), {"step": max(steps) + 1})
  ck.close()
  # The cut-off save's temporary directory is gone; the keep limit holds.
  assert sorted(os.listdir(d)) == sorted(str(s) for s in (max(steps), max(steps) + 1))


def test_a_torn_step_directory_is_moved_aside_never_restored(tmp_path):
  d = str(tmp_path / "ckpt")
  ck = ckpt_lib.Checkpointer(d, max_to_keep=3)
  for s in (1, 2):
    ck.save(s, _state(s, 64), {"step": s})
  ck.close()
  # Step 3 as a copy cut off part-way leaves it: no commit file, array data missing.
  shutil.copytree(os.path.join(d, "2"), os.path.join(d, "3"))
  os.remove(os.path.join(d, "3", ckpt_lib.COMMIT_FILE))
  shutil.rmtree(os.path.join(d, "3", "state", "d"))
  ck = ckpt_lib.Checkpointer(d, max_to_keep=3)
  assert ck.latest_step() == 2 and ck.all_steps() == [1, 2]
  assert len(ck.moved_aside) == 1 and os.path.basename(ck.moved_aside[0]).startswith("3.incomplete-")
  assert os.path.isdir(ck.moved_aside[0])            # kept for inspection, not deleted
  _check_restores(ck, 2, 64)
  ck.save(3, _state(3, 64), {"step": 3})              # the resumed run writes step 3 again
  _check_restores(ck, 3, 64)
  ck.close()


def test_keep_limit_holds_across_reopenings(tmp_path):
  d = str(tmp_path / "ckpt")
  for first in (0, 3, 6):       # three "runs", each resuming the last
    ck = ckpt_lib.Checkpointer(d, max_to_keep=2)
    assert ck.latest_step() == (None if first == 0 else first - 1)
    for s in range(first, first + 3):
      ck.save(s, _state(s, 64), {"step": s})
    ck.close()
    assert sorted(os.listdir(d), key=int) == [str(first + 1), str(first + 2)]


@pytest.fixture
def tiny_disk(tmp_path):
  mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
  mnt.mkdir()
  r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)],
                     capture_output=True, text=True)
  if r.returncode != 0:
    pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
  try:
    yield str(mnt)
  finally:
    subprocess.run(["umount", str(mnt)], check=False)


def test_a_full_disk_raises_a_clear_error_and_keeps_the_previous_steps(tiny_disk):
  d = os.path.join(tiny_disk, "ckpt")
  n = 600_000          # 2.4 MB a step (random: incompressible); the third copy does not fit
  ck = ckpt_lib.Checkpointer(d, max_to_keep=2)
  ck.save(1, _state(1, n), {"step": 1})
  ck.save(2, _state(2, n), {"step": 2})
  with pytest.raises(ckpt_lib.CheckpointWriteError,
                     match=r"step 3 was not written .* disk is full \(ENOSPC\); the previous "
                           r"steps \[1, 2\] are intact"):
    ck.save(3, _state(3, n), {"step": 3})
  assert sorted(os.listdir(d)) == ["1", "2"]          # the partial save's space is freed
  ck = ckpt_lib.Checkpointer(d, max_to_keep=2)
  assert ck.all_steps() == [1, 2]
  _check_restores(ck, 2, n)


def test_files_stamp_changes_when_an_export_is_written_again_in_place(tmp_path):
  """What evaluation journals are keyed on: the export's .json / .safetensors files by
  name, size and mtime; other files do not count; no directory, no stamp."""
  from rstar_jax import checkpoint as ckpt_lib
  assert ckpt_lib.files_stamp(str(tmp_path / "absent")) == []
  (tmp_path / "config.json").write_text("{}")
  (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
  (tmp_path / "notes.txt").write_text("ignored")
  first = ckpt_lib.files_stamp(str(tmp_path))
  assert [row[:2] for row in first] == [["config.json", 2], ["model.safetensors", 10]]
  assert ckpt_lib.files_stamp(str(tmp_path)) == first
  (tmp_path / "model.safetensors").write_bytes(b"y" * 11)   # another model, same path
  assert ckpt_lib.files_stamp(str(tmp_path)) != first
  (tmp_path / "notes.txt").write_text("still ignored, other size")
  assert [row[0] for row in ckpt_lib.files_stamp(str(tmp_path))] == ["config.json",
                                                                     "model.safetensors"]
