r"""python -m experiments.benchmarks.bench_server --out /tmp/bench_server.json

Rollout tokens/s through two rollout-server processes (`python -m
rstar_jax.rollout.api_server`, the SGLang API over loopback HTTP) against the same two
JaxEngines in this process, and the cost of a weight sync through disk.

(a) The same requests (random prompts of --prompt_len tokens, --new_tokens sampled per
    request, no stop ids, the same seeds) go through an EnginePool of two in-process
    JaxEngines and through an EnginePool of two SGLangEngines talking to two server
    processes with the same engine config. Runs alternate (in-process, servers, ...)
    so machine noise hits both; medians. The overhead target is servers/in-process
    wall time <= 1.25.
(b) `DiskWeightSync.publish` to two servers of a larger random model (--sync_hidden,
    --sync_layers, --sync_vocab; ~117M parameters by default): seconds to write the versioned
    checkpoint (bf16 and float32), seconds for both servers to pause, load it,
    continue and confirm the version, GB written, and seconds per GB, extrapolated to
    Qwen3-14B (bf16, 29.5 GB) at the same rates.

The model of (a) is the toy recipe's (2 layers x 128, vocabulary 2048) by default, with
random weights; --layers / --hidden / --vocab size it up (HTTP overhead per request is
fixed, so its share falls as a request's compute grows).
The machine may be shared: the load average is printed with the results. Not a test:
nothing is asserted.
"""
import asyncio
import atexit
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from absl import app
from absl import flags

from experiments.common import results_json

flags.DEFINE_integer("requests", 64, "(a) requests per run")
flags.DEFINE_integer("hidden", 128, "(a) hidden size (the toy recipe's model by default)")
flags.DEFINE_integer("layers", 2, "(a) layers")
flags.DEFINE_integer("vocab", 2048, "(a) vocabulary")
flags.DEFINE_integer("prompt_len", 64, "(a) prompt tokens per request")
flags.DEFINE_integer("new_tokens", 64, "(a) generated tokens per request")
flags.DEFINE_integer("slots", 16, "(a) KV slots per engine")
flags.DEFINE_integer("max_len", 256, "(a) KV length per slot")
flags.DEFINE_integer("repeats", 3, "(a) timed runs per side, after one warm-up each",
                     lower_bound=1)
flags.DEFINE_integer("syncs", 3, "(b) weight syncs per dtype", lower_bound=1)
flags.DEFINE_integer("sync_hidden", 1024, "(b) hidden size of the synced model (fixed costs "
                     "are amortised over its bytes: ~0.23 GB in bf16 at the defaults)")
flags.DEFINE_integer("sync_layers", 4, "(b) its layers")
flags.DEFINE_integer("sync_vocab", 32768, "(b) its vocabulary")
flags.DEFINE_boolean("pin", False, "pin server k to core k mod cores (taskset): on one host the "
                     "servers otherwise each run a thread pool over every core and oversubscribe "
                     "it, which a server with its own accelerator never does")
flags.DEFINE_string("out", "/tmp/bench_server.json", "where the figures go as JSON")
FLAGS = flags.FLAGS

QWEN3_14B_BF16_GB = 14.77e9 * 2 / 1e9


def _start_server(hf_dir, port, log_path, slots=None, max_len=None, warmup=True, core=None):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  log = open(log_path, "w")
  pin = ["taskset", "-c", str(core)] if core is not None else []
  proc = subprocess.Popen(
      [*pin, sys.executable, "-m", "rstar_jax.rollout.api_server", "--hf_dir", hf_dir,
       "--port", str(port),
       "--num_slots", str(slots or FLAGS.slots), "--max_len", str(max_len or FLAGS.max_len),
       *([] if warmup else ["--no_warmup"])],
      env=env, stdout=log, stderr=subprocess.STDOUT)
  return proc, log


def _wait(url, proc, log_path, timeout=300):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if proc.poll() is not None:
      raise RuntimeError(f"server exited: {open(log_path).read()[-2000:]}")
    try:
      with urllib.request.urlopen(url + "/health", timeout=5) as r:
        if r.status == 200:
          return
    except OSError:
      time.sleep(0.3)
  raise RuntimeError(f"{url} not ready in {timeout} s")


def main(argv):
  del argv
  import numpy as np
  from flax import nnx

  from rstar_jax.model import model_config, hf_io, qwen3
  from rstar_jax.rollout.sglang import engine as se
  from rstar_jax.rollout.engine import GenerationRequest
  from rstar_jax.rollout.jax_engine import EngineConfig, JaxEngine
  from rstar_jax.rollout.scheduler import EnginePool
  from rstar_jax.rollout.weight_sync import DiskWeightSync, WeightSyncConfig
  from sandbox.launcher import free_port

  load0 = os.getloadavg()
  cfg = model_config.Qwen3Config(vocab_size=FLAGS.vocab, hidden_size=FLAGS.hidden,
                                 intermediate_size=3 * FLAGS.hidden,
                                 num_hidden_layers=FLAGS.layers, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=FLAGS.hidden // 2,
                                 tie_word_embeddings=True)
  model = qwen3.create_model(cfg, seed=0)
  root = tempfile.mkdtemp(prefix="bench_server_")
  # The export and every weight sync's checkpoint (~1 GB a run): gone when the run ends.
  atexit.register(shutil.rmtree, root, ignore_errors=True)
  hf_dir = os.path.join(root, "model")
  hf_io.save_hf(model, hf_dir, dtype="float32")
  ecfg = EngineConfig(num_slots=FLAGS.slots, max_len=FLAGS.max_len)
  rng = np.random.RandomState(0)
  prompts = [rng.randint(0, cfg.vocab_size, FLAGS.prompt_len).tolist()
             for _ in range(FLAGS.requests)]

  def requests(run):
    return [GenerationRequest(input_ids=p, max_new_tokens=FLAGS.new_tokens, temperature=1.0,
                              seed=run * 10_000 + i, request_id=f"r{run}-{i}")
            for i, p in enumerate(prompts)]

  def timed(pool, run):
    async def go():
      return await asyncio.gather(*(pool.generate(r) for r in requests(run)))
    t = time.perf_counter()
    outs = asyncio.run(go())
    wall = time.perf_counter() - t
    return wall, sum(len(o.output_ids) for o in outs)

  servers = []
  try:
    ports = [free_port() for _ in range(2)]
    for k, port in enumerate(ports):
      core = k % (os.cpu_count() or 1) if FLAGS.pin and shutil.which("taskset") else None
      servers.append((*_start_server(hf_dir, port, os.path.join(root, f"server{k}.log"), core=core),
                      f"http://127.0.0.1:{port}", os.path.join(root, f"server{k}.log")))
    local = EnginePool([JaxEngine(model, ecfg, name=f"jax{i}") for i in range(2)])
    for proc, _, url, log_path in servers:
      _wait(url, proc, log_path)
    expected = hf_io.config_to_hf_dict(cfg, "float32")
    remote = EnginePool(se.connect([s[2] for s in servers], expected_model=expected))
    # (a) warm-up (compiles every prefill bucket met, and the decode step) then alternate.
    timed(local, 0)
    timed(remote, 0)
    walls = {"in_process": [], "servers": []}
    tokens = {}
    for run in range(1, FLAGS.repeats + 1):
      for name, pool in (("in_process", local), ("servers", remote)):
        wall, n = timed(pool, run)
        walls[name].append(wall)
        tokens[name] = n
    split = {name: {e.name: pool.metrics[e.name]["requests"] for e in pool.engines}
             for name, pool in (("in_process", local), ("servers", remote))}
    local.stop()
    remote.stop()
    for proc, log, _, _ in servers:
      proc.kill()
      proc.wait(30)
      log.close()
    servers = []
    # (b) weight syncs of a larger model: the same parameters each time (what is
    # measured is the transport: write, pause, load, continue, confirm).
    big_cfg = model_config.Qwen3Config(
        vocab_size=FLAGS.sync_vocab, hidden_size=FLAGS.sync_hidden,
        intermediate_size=3 * FLAGS.sync_hidden, num_hidden_layers=FLAGS.sync_layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=FLAGS.sync_hidden // 8,
        tie_word_embeddings=False)
    big = qwen3.create_model(big_cfg, seed=1)
    big_dir = os.path.join(root, "big")
    hf_io.save_hf(big, big_dir, dtype="float32")
    for k in range(2):
      port = free_port()
      log_path = os.path.join(root, f"sync_server{k}.log")
      servers.append((*_start_server(big_dir, port, log_path, slots=1, max_len=64,
                                     warmup=False), f"http://127.0.0.1:{port}", log_path))
    for proc, _, url, log_path in servers:
      _wait(url, proc, log_path)
    engines = se.connect([x[2] for x in servers],
                         expected_model=hf_io.config_to_hf_dict(big_cfg, "float32"))
    sync = DiskWeightSync(WeightSyncConfig(dtype="bfloat16", keep=2), big, engines,
                          os.path.join(root, "weight_sync"))
    state = nnx.state(big)
    syncs = {"bfloat16": [], "float32": []}
    first = {}
    for dtype in syncs:
      sync.cfg = WeightSyncConfig(dtype=dtype, keep=2)
      # The first publish of a dtype compiles the on-device converters (one per tensor
      # shape and layout): reported apart, as in a run it is paid once.
      first[dtype] = sync.publish(state, f"{dtype}-warmup")
      for k in range(FLAGS.syncs):
        syncs[dtype].append(sync.publish(state, f"{dtype}-{k}"))
    for e in engines:
      e.stop()
  finally:
    for proc, log, _, _ in servers:
      proc.kill()
      proc.wait(30)
      log.close()

  med = {k: statistics.median(v) for k, v in walls.items()}
  tps = {k: tokens[k] / med[k] for k in med}
  ratio = med["servers"] / med["in_process"]
  print(f"\nrollout server vs in-process: 2 engines x {FLAGS.slots} slots x {FLAGS.max_len}, "
        f"{FLAGS.requests} requests, prompt {FLAGS.prompt_len}, {FLAGS.new_tokens} new tokens; "
        f"{cfg.num_params / 1e6:.2f}M params; {os.cpu_count()} CPUs; load "
        f"{'/'.join(f'{x:.2f}' for x in load0)} -> {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
  print(f"servers pinned one per core: {FLAGS.pin}")
  print(f"{'path':<34}{'median s':>10}{'min s':>10}{'tokens/s':>11}")
  for k, label in (("in_process", "EnginePool of 2 JaxEngines"),
                   ("servers", "EnginePool of 2 server processes")):
    print(f"{label:<34}{med[k]:>10.3f}{min(walls[k]):>10.3f}{tps[k]:>11.0f}")
  print(f"servers / in-process wall time: {ratio:.2f}x (target <= 1.25x); requests per engine "
        f"(all runs): {split}")
  print(f"\nweight sync through disk to 2 servers (pause -> load -> continue -> version "
        f"confirmed), a {big_cfg.num_params / 1e6:.0f}M-parameter model")
  print(f"{'dtype':<10}{'GB':>8}{'write s':>10}{'update s':>10}{'total s':>10}{'s/GB':>9}"
        f"{'Qwen3-14B est. s':>18}")
  summary = {}
  for dtype, rows in syncs.items():
    m = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    est = m["sync/s_per_gb"] * QWEN3_14B_BF16_GB
    summary[dtype] = dict(m, qwen3_14b_estimate_s=est)
    summary[dtype]["first_total_s"] = first[dtype]["sync/total_s"]
    print(f"{dtype:<10}{m['sync/gb']:>8.4f}{m['sync/write_s']:>10.3f}{m['sync/update_s']:>10.3f}"
          f"{m['sync/total_s']:>10.3f}{m['sync/s_per_gb']:>9.1f}{est:>18.0f}"
          f"   (first, with compiles: {first[dtype]['sync/total_s']:.2f} s)")
  print("(the 14B estimate scales this model's s/GB linearly: same disk, same host; on a "
        "cluster the shared storage's bandwidth and the servers' load path set the figure)")
  result = {"benchmark": "bench_server", "flags": {k: getattr(FLAGS, k) for k in (
                "requests", "prompt_len", "new_tokens", "slots", "max_len", "repeats", "syncs")},
            "cpus": os.cpu_count(), "pinned": FLAGS.pin, "load_average_start": load0,
            "load_average_end": os.getloadavg(), "num_params": cfg.num_params,
            "sync_num_params": big_cfg.num_params,
            "model": {"layers": FLAGS.layers, "hidden": FLAGS.hidden, "vocab": FLAGS.vocab},
            "wall_s": walls, "tokens": tokens, "tokens_per_s": tps,
            "servers_over_in_process": ratio, "requests_per_engine": split, "sync": summary, "sync_runs": syncs}
  results_json.write(FLAGS.out, result)


if __name__ == "__main__":
  app.run(main)
