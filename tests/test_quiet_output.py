"""Quiet, precise output: no TPU-probe line, the config as a short diff, one line for a
second Ctrl-C, signal messages that name the signal (real processes where it matters)."""
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(**extra):
  env = dict(os.environ, PYTHONPATH=REPO, **extra)
  env.pop("XLA_FLAGS", None)
  return env


def test_a_no_op_rerun_prints_a_few_lines_and_no_tpu_probe(tmp_path):
  """JAX_PLATFORMS unset, as a user runs it: jax probes every platform, TPU included,
  and logged "Unable to initialize backend 'tpu' ... libtpu.so" at every start; the
  config printed was ~310 lines of JSON. Now: the changes from the config file, and
  the whole config in config.json."""
  workdir = tmp_path / "run"
  (workdir / "sft").mkdir(parents=True)
  (workdir / "sft" / "DONE.json").write_text('{"steps": 9}')   # a finished SFT stage
  (workdir / "eval_after_sft.json").write_text("{}")
  env = _env()
  env.pop("JAX_PLATFORMS", None)
  out = subprocess.run([sys.executable, "-m", "experiments.recipe", "--config",
                        "experiments/configs/toy.py:smoke", f"--config.workdir={workdir}",
                        "--config.seed=3", "--stages=sft"], cwd=REPO, env=env,
                       capture_output=True, text=True)
  text = out.stdout + out.stderr
  assert out.returncode == 0, text
  assert "Unable to initialize backend" not in text and "libtpu" not in text, text
  lines = text.strip().splitlines()
  assert lines[0] == (f"config: experiments/configs/toy.py:smoke with 2 change(s) (in full: "
                      f"{workdir}/config.json):"), text
  assert "  seed: 0 -> 3" in lines and any(l.startswith("  workdir: ") for l in lines)
  assert lines[-1].startswith("nothing to do") and len(lines) == 5, text
  full = json.load(open(workdir / "config.json"))
  assert full["seed"] == 3 and full["rl"]["downsample"]["method"]


def test_the_startup_filter_drops_the_tpu_probe_only():
  import rstar_jax   # installs the filter
  del rstar_jax
  logger = logging.getLogger("jax._src.xla_bridge")
  record = lambda level, msg: logging.LogRecord(logger.name, level, __file__, 1, msg, (), None)
  probe = ("Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so: libtpu.so: "
           "cannot open shared object file: No such file or directory")
  assert not logger.filter(record(logging.INFO, probe))
  # What still says something: another platform failing, the probe failing otherwise
  # (libtpu installed), anything at WARNING or above.
  assert logger.filter(record(logging.INFO, "Unable to initialize backend 'cuda': no GPU"))
  assert logger.filter(record(logging.INFO, "Unable to initialize backend 'tpu': TPU busy"))
  assert logger.filter(record(logging.WARNING, probe))


SECOND_CTRL_C = textwrap.dedent('''
  import os, signal
  import numpy as np
  import orbax.checkpoint as ocp
  from absl import flags
  from rstar_jax import checkpoint, config_utils
  from rstar_jax.train import interrupt

  _DIR = flags.DEFINE_string("dir", None, "checkpoint directory")
  _CONFIG = flags.DEFINE_string("config", "none", "unused")
  _wait = ocp.CheckpointManager.wait_until_finished

  def _second_ctrl_c_inside_the_write(self):
    os.kill(os.getpid(), signal.SIGINT)   # lands while orbax writes the checkpoint
    return _wait(self)

  def main(argv):
    ckpt = checkpoint.Checkpointer(_DIR.value)
    with interrupt.StopRequests() as stop:
      os.kill(os.getpid(), signal.SIGINT)   # the first Ctrl-C: stop at the step boundary
      assert stop.requested
      ocp.CheckpointManager.wait_until_finished = _second_ctrl_c_inside_the_write
      ckpt.save(1, {"w": np.arange(1000.0)}, {"step": 1})
      print("not reached: the abort is raised when the write is done")

  if __name__ == "__main__":
    config_utils.run(main)
''')


def test_a_second_ctrl_c_during_a_checkpoint_write_ends_with_one_line(tmp_path):
  """It used to cut orbax's wait: ~30-80 lines of tracebacks (orbax's save threads
  failing) next to "checkpoint saved". Now the write completes, then one line."""
  script = tmp_path / "second_ctrl_c.py"
  script.write_text(SECOND_CTRL_C)
  out = subprocess.run([sys.executable, str(script), f"--dir={tmp_path / 'ckpt'}"], cwd=REPO,
                       env=_env(JAX_PLATFORMS="cpu"), capture_output=True, text=True)
  text = out.stdout + out.stderr
  assert out.returncode == 130, text
  assert "Traceback" not in text and "not reached" not in text, text
  assert text.strip().splitlines()[-1] == (
      "aborted by a second SIGINT: the step in flight is not saved; run the same command "
      "again to resume from the last checkpoint"), text
  assert "second SIGINT received: aborting once the checkpoint being written is complete" \
      in text
  # The checkpoint the second Ctrl-C landed in is whole.
  from rstar_jax import checkpoint
  import numpy as np
  ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"))
  state, meta = ckpt.restore({"w": np.zeros(1000)})
  ckpt.close()
  assert meta == {"step": 1} and np.array_equal(np.asarray(state["w"]), np.arange(1000.0))


@pytest.mark.parametrize("first", [signal.SIGTERM, signal.SIGUSR2, signal.SIGINT])
def test_stop_messages_name_the_signal_received(first, caplog):
  from rstar_jax.train import interrupt
  before = signal.getsignal(signal.SIGINT)
  with caplog.at_level(logging.WARNING), interrupt.StopRequests() as stop:
    os.kill(os.getpid(), first)
    assert stop.signum == first
    os.kill(os.getpid(), signal.SIGTERM)   # a scheduler's, while stopping: no abort
    how = "a second SIGINT" if first == signal.SIGINT else f"SIGINT after {first.name}"
    with pytest.raises(interrupt.Aborted, match=f"aborted by {how}: the step in flight"):
      os.kill(os.getpid(), signal.SIGINT)
  assert signal.getsignal(signal.SIGINT) is before
  msgs = [r.getMessage() for r in caplog.records]
  name = signal.Signals(first).name
  assert msgs[0].startswith(f"{name} received: stopping at the next step boundary"), msgs
  assert ("a second SIGINT aborts" if first == signal.SIGINT else "a SIGINT aborts") in msgs[0]
  assert msgs[1].startswith("SIGTERM received: already stopping"), msgs
  assert not any("Ctrl-C" in m for m in msgs), msgs
  assert str(interrupt.Interrupted(first, 3)).startswith(f"stopped by {name} after step 3")


@pytest.mark.parametrize("where,values,message", [
    ("stage1.agent", {"temperature": -1.0},
     r"config.stage1.agent: AgentConfig.temperature must be >= 0 \(0: greedy\), got -1.0"),
    ("stage1.agent", {"top_p": 0.0}, r"AgentConfig.top_p must be in \(0, 1\], got 0.0"),
    ("stage1.agent", {"top_k": -2}, r"AgentConfig.top_k must be >= 0 .*got -2"),
    ("stage1.agent", {"max_turns": 0}, r"AgentConfig.max_turns must be >= 1, got 0"),
    ("stage1", {"hard_k": 0}, r"config.stage1: RLStage.hard_k must be >= 1, got 0"),
    ("stage2", {"num_steps": -1}, r"config.stage2: RLStage.num_steps must be >= 0, got -1"),
    ("stage3", {"hard_pool": -5}, r"RLStage.hard_pool must be >= 0, got -5"),
    ("sft", {"seq_len": 1}, r"config.sft: SFTConfig.seq_len must be >= 2, got 1"),
    ("sft", {"keep_checkpoints": 0}, r"SFTConfig.keep_checkpoints must be >= 1, got 0"),
    ("rl.step", {"logprob_chunk": 0}, r"StepConfig.logprob_chunk must be >= 1, got 0"),
    ("distributed", {"num_processes": -1}, r"DistributedConfig.num_processes must be >= 0"),
    ("tokenizer", {"number_chunk": 4}, r"TokenizerConfig.number_chunk must be in 1..3, got 4"),
    ("rl.optimizer", {"min_lr_ratio": 2.0},
     r"OptimizerConfig.min_lr_ratio must be in \[0, 1\], got 2.0"),
])
def test_validation_errors_name_the_field_and_the_rule(where, values, message):
  """Each bad value, set in the smoke config as a user would (--config.<where>.<k>=v),
  is refused naming its section, its field, the rule and the value."""
  from experiments.configs import toy
  from rstar_jax import config_utils
  from rstar_jax.recipe import recipe_config
  config = toy.get_config("smoke")
  node = config
  for part in where.split("."):
    node = node[part]
  for k, v in values.items():
    node[k] = v
  with pytest.raises(config_utils.ConfigError, match=message):
    recipe_config.build_config(config)


def test_a_request_names_the_sampling_parameter_it_breaks():
  from rstar_jax.rollout.engine import GenerationRequest
  for bad, field in ((dict(temperature=-1.0), "temperature"), (dict(top_p=1.5), "top_p"),
                     (dict(top_k=-1), "top_k")):
    with pytest.raises(ValueError, match=f"{field} must be .*got {list(bad.values())[0]}"):
      GenerationRequest(input_ids=[1], max_new_tokens=2, **bad).validate(max_len=8)


def test_a_missing_model_directory_is_reported_as_missing(tmp_path):
  """Notebook 04 with a wrong hf_dir said "no tokenizer.json (only the fast-tokenizer
  format is supported ...)", sending the user to convert a tokenizer that is not there."""
  from rstar_jax.model import hf_io, tokenizer as tokenizer_lib
  missing = str(tmp_path / "nowhere" / "export")
  with pytest.raises(FileNotFoundError, match=r"nowhere/export': no such directory$"):
    tokenizer_lib.Tokenizer.from_dir(missing)
  with pytest.raises(hf_io.CheckpointError, match=r"nowhere/export: no such directory \(no config.json\)$"):
    hf_io.load_hf(missing)
  (tmp_path / "afile").write_text("")
  with pytest.raises(FileNotFoundError, match="afile': not a directory"):
    tokenizer_lib.Tokenizer.from_dir(str(tmp_path / "afile"))
  # A directory without the file still says what is missing in it, and why.
  with pytest.raises(FileNotFoundError, match="has no tokenizer.json .*fast-tokenizer"):
    tokenizer_lib.Tokenizer.from_dir(str(tmp_path))
