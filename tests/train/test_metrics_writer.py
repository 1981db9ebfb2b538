"""MetricsWriter.truncate_after: what a resumed (or restarted) run keeps of the file."""
import json

from rstar_jax import metrics_writer


def test_truncate_keeps_rows_up_to_the_step_and_drops_a_torn_line(tmp_path):
  w = metrics_writer.MetricsWriter(str(tmp_path), "rl", tensorboard=False)
  for step in (1, 2, 3):
    w.write(step, {"loss": float(step)})
  with open(w.path, "a") as f:
    f.write('{"step": 4, "lo')   # a kill mid-line
  w.truncate_after(2)
  assert [json.loads(l)["step"] for l in open(w.path)] == [1, 2]
  w.write(3, {"loss": 3.0})
  assert [json.loads(l)["step"] for l in open(w.path)] == [1, 2, 3]
  # No checkpoint to resume from: the trainers truncate to 0, so a rerun after a kill
  # before the first checkpoint does not append a second step 1, 2, 3.
  w.truncate_after(0)
  assert open(w.path).read() == ""
  assert not (tmp_path / "metrics_rl.jsonl.tmp").exists()
