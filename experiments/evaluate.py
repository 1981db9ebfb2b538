r"""python -m experiments.evaluate --config experiments/configs/toy.py --config.workdir=/tmp/rstar_toy

Evaluates the latest finished stage (or --hf_dir): pass@1 over k samples, tool stats.

Sampling temperature and k come from config.eval and are printed with the results.
With --hf_dir, the tokenizer saved in that export is used (the one it was trained
with), and the result file (<workdir>/eval_hf_dir.json) records the directory and seed.

The report's table (docs/guides/evaluation.md):

  python -m experiments.evaluate --config experiments/configs/eval_rstar2_agent_14b.py \
      --config.workdir=/runs/eval14b --hf_dir=/models/rStar2-Agent-14B --suite=report \
      --benchmarks=aime24=/data/aime24.parquet,gpqa_diamond=/data/gpqa_diamond.csv \
      --config.rollout.backend=sglang --config.rollout.servers="('http://localhost:30000',)"

runs every benchmark given (rstar_jax/eval/benchmarks.py names them and their layouts)
with the report's protocol (--protocol=report, the default with --suite; `config` takes
config.eval as it is, `greedy` asks for greedy decoding by name), resumable from its
journals, and writes <workdir>/suite/: per benchmark <name>.json, <name>.result.json and
<name>_samples.jsonl, then suite.md and suite.json. SIGINT / SIGTERM stop it (the
trajectories finished so far are in the journal); the same command resumes it.
"""
import os

from absl import flags
from ml_collections import config_flags

from rstar_jax import checkpoint, config_utils

_CONFIG = config_flags.DEFINE_config_file("config", None, "ml_collections config file",
                                          lock_config=True)
_HF_DIR = flags.DEFINE_string("hf_dir", None, "evaluate this HF Qwen3 directory instead")
_SUITE = flags.DEFINE_enum("suite", None, ["report"],
                           "run a benchmark suite: 'report' is the report's table (AIME24, "
                           "AIME25, HMMT25, MATH-500, GPQA-Diamond); needs --hf_dir and "
                           "--benchmarks")
_BENCHMARKS = flags.DEFINE_list("benchmarks", [],
                                "NAME=PATH,...: the local file of each benchmark to run "
                                "(registered names or any other name for a math file)")
_PROTOCOL = flags.DEFINE_enum("protocol", "report", ["report", "config", "greedy"],
                              "with --suite: the report's sampling protocol, config.eval as "
                              "given (not greedy), or greedy decoding asked for by name")


def run_suite(config, hf_dir: str, *, benchmark_spec: list[str], protocol: str):
  """The --suite run; returns the SuiteResult."""
  import contextlib
  import dataclasses

  from rstar_jax.recipe import recipe_config, stages, workdir_state
  from rstar_jax.eval import benchmarks, suite
  from rstar_jax.model import tokenizer as tokenizer_lib
  from rstar_jax.rollout import backends, chat
  from rstar_jax.rollout import sandbox_client as tools_lib

  cfg = recipe_config.build_config(config)
  if not benchmark_spec:
    raise config_utils.ConfigError(
        "--suite needs --benchmarks=NAME=PATH,... (the local file of each benchmark; "
        f"registered: {', '.join(benchmarks.REGISTRY)})")
  try:
    given = benchmarks.parse_spec(benchmark_spec)
    eval_cfg = suite.protocol(protocol, cfg.eval)
    for bench, path in given:   # said now, not after the model has loaded
      benchmarks.load(bench, path)
  except ValueError as e:
    raise config_utils.ConfigError(str(e)) from None
  budget, max_len = eval_cfg.agent.max_response_tokens, cfg.rollout.engine.max_len
  if cfg.rollout.backend == "jax" and budget >= max_len:
    raise config_utils.ConfigError(
        f"protocol {protocol}: {budget} response tokens do not fit "
        f"config.rollout.engine.max_len={max_len} (prompt + response); raise it, or generate "
        "on SGLang servers (--config.rollout.backend=sglang --config.rollout.servers=...)")
  for name in ("config.json", "tokenizer.json"):
    if not os.path.exists(os.path.join(hf_dir, name)):
      raise config_utils.ConfigError(f"--hf_dir {hf_dir}: no {name} (not a HF export with "
                                     "its tokenizer)")
  names = [b.name for b, _ in given]
  not_run = [n for n in benchmarks.REPORT_SUITE if n not in names]
  workdir = os.path.abspath(cfg.workdir)
  os.makedirs(workdir, exist_ok=True)
  tok = tokenizer_lib.Tokenizer.from_dir(hf_dir)
  proto = chat.ChatProtocol(tok, cfg.chat)
  key = {"model": hf_dir, "weights": checkpoint.files_stamp(hf_dir),
         "tools": [cfg.tools.backend, cfg.tools.timeout_s],
         "chat": dataclasses.asdict(cfg.chat)}
  with contextlib.ExitStack() as stack:
    stack.enter_context(workdir_state.workdir_lock(workdir))
    tools = stack.enter_context(tools_lib.build_tools(cfg.tools))

    def engines():
      if cfg.rollout.backend == "jax":
        from rstar_jax.model import hf_io
        model = hf_io.load_hf(hf_dir, mesh=cfg.mesh.make(), rules=cfg.mesh.logical_rules(),
                              **stages.runtime_overrides(cfg))
        pool = backends.build_engine_pool(cfg.rollout, model, workdir=workdir,
                                          rules=cfg.mesh.logical_rules())
      else:   # the servers serve --hf_dir themselves: no weights to load or push here
        pool = backends.build_engine_pool(cfg.rollout, None, workdir=workdir)
      stack.callback(pool.stop)
      return pool

    return suite.run_suite(engines, tools, proto, tok, given, eval_cfg,
                           out_dir=os.path.join(workdir, "suite"), seed=cfg.seed,
                           protocol_name=protocol, key=key, model_source=hf_dir,
                           not_run=not_run)


def main(argv):
  del argv
  from rstar_jax.train import interrupt
  # The recipe's mechanism, for every evaluation run here: SIGINT / SIGTERM / SIGUSR2 stop
  # a journaled collection at its next finished trajectory (rl.rollout_collector.collect raises
  # interrupt.Interrupted; config_utils.run ends with one line and exit 128 + signal).
  with interrupt.StopRequests():
    _main()


def _main():
  from rstar_jax.recipe import stages
  if _SUITE.value is not None:
    if _HF_DIR.value is None:
      raise config_utils.ConfigError("--suite evaluates a checkpoint: give --hf_dir")
    result = run_suite(_CONFIG.value, os.path.abspath(_HF_DIR.value),
                       benchmark_spec=_BENCHMARKS.value, protocol=_PROTOCOL.value)
    print(result.markdown())
    return
  if _BENCHMARKS.value or _PROTOCOL.present:
    raise config_utils.ConfigError("--benchmarks and --protocol go with --suite")
  if _HF_DIR.value is None:
    stages.run(_CONFIG.value, stages=["eval"])
    return
  print(stages.evaluate_hf_dir(_CONFIG.value, os.path.abspath(_HF_DIR.value)).to_table())


if __name__ == "__main__":
  config_utils.run(main)
