"""DiskWeightSync's directory over restarts: what a crashed or resumed run left there is
cleaned up, and at most `keep` versions stay on disk."""
import os

from flax import nnx

from rstar_jax.model import qwen3
from rstar_jax.model.model_config import Qwen3Config
from rstar_jax.rollout import weight_sync

CFG = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8)


def test_a_restarted_run_cleans_up_and_keeps_at_most_keep_versions(tmp_path):
  model = qwen3.create_model(CFG)
  d = str(tmp_path / "weight_sync")
  cfg = weight_sync.WeightSyncConfig(keep=2, dtype="float32")
  first = weight_sync.DiskWeightSync(cfg, model, [], d)
  for v in ("stage1-step1", "stage1-step2", "stage1-step3"):
    first.publish(nnx.state(model), v)
  assert sorted(os.listdir(d)) == ["stage1-step2", "stage1-step3"]
  os.makedirs(os.path.join(d, "stage1-step4.tmp-12345"))   # a crash while writing
  # The run resumes in a new process: its first publishes trim the old run's versions
  # too (they were never removed before: one full checkpoint left per restart).
  again = weight_sync.DiskWeightSync(cfg, model, [], d)
  assert sorted(os.listdir(d)) == ["stage1-step2", "stage1-step3"]
  again.publish(nnx.state(model), "stage2-step1")
  assert sorted(os.listdir(d)) == ["stage1-step3", "stage2-step1"]
  again.publish(nnx.state(model), "stage2-step2")
  assert sorted(os.listdir(d)) == ["stage2-step1", "stage2-step2"]
  assert os.path.exists(os.path.join(d, "stage2-step2", "config.json"))
