r"""Rollout throughput: JaxEngine versus transformers `generate()`, and agent rollouts.

  python -m experiments.benchmarks.bench_rollout

(a) Generated tokens/s at batch 64 of the same random Qwen3 (the `small` preset by
    default: 4 layers, hidden 256): our JaxEngine (continuous batching, requests
    admitted together prefilled in one jitted call, one jitted decode step for all
    slots) versus
    `transformers.Qwen3ForCausalLM.generate()` on torch CPU, loaded from the directory
    our model was exported to with `hf_io.save_hf`. Both sample (temperature 1, no
    top-k / top-p), both get the same prompt lengths and produce exactly
    `--new_tokens` tokens per row (no stop ids; `min_new_tokens` on the torch side).
    Runs alternate (JAX, torch, JAX, torch, ...) so machine noise hits both; medians.
    JaxEngine's compile time (its first run minus its median) is reported apart from
    its steady state. A profile of the JaxEngine run splits its time into jitted
    prefill calls, jitted decode steps and host-side Python around them.
(b) Multi-turn agent rollouts against a real sandbox server (started here): toy
    problems, a JaxEngine behind an EnginePool, SandboxTools, `run_many`. A random
    model almost never writes a tool call, so a wrapper makes the first
    `--calls_per_traj` turns of each trajectory "think" `--think_tokens` sampled
    tokens and then appends a scripted call that runs the problem's code; the last
    turn is sampled freely until a stop id or the response budget. Reports
    trajectories/s, tool calls/s, tool latency, slot utilisation of the engine.
    `--static_baseline` also runs the same rollouts with static batching (`TurnBatches`:
    a turn of every live trajectory starts together and returns when its longest
    sequence is done, as `generate()` pads a batch), alternating with the continuous
    runs in one process, and reports the ratio. Use `--slots` >= `--trajectories` so
    the static batch fits the engine at once.

(c) `--invariant`: EngineConfig.batch_invariant off versus on, alternating in one
    process (`--rounds` runs each), on an agent-shaped workload at the toy recipe's
    sizes (its model, 64 slots x 384): `--trajectories` trajectories of up to
    `--max_turns` turns, each turn `--think_tokens` sampled tokens (1/2x-2x per
    trajectory) then a scripted tool response of 16-40 tokens after a 5-40 ms "tool"
    wait (asyncio sleep, no sandbox: the engine's cost is what is compared). Reports
    generated tokens/s, decode ms per step against the decode roofline (limits probed
    after every round), prefill time and tokens, and whether the two modes sampled the
    same tokens. Run it alone: `--invariant --skip_a --skip_b`.

Everything goes to --out as JSON too. Not a test: nothing is asserted. Figures depend on the machine and its load.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import tempfile
import time

from absl import app
from absl import flags

from experiments.common import results_json
from experiments.common import roofline
from experiments.common.scripted_rollouts import TimedTools, ToolCallingEngine, TurnBatches

flags.DEFINE_string("preset", "small", "model preset (rstar_jax.model.model_config.PRESETS)")
flags.DEFINE_integer("vocab", 0, "(a) vocabulary size; 0 = the preset's")
flags.DEFINE_integer("batch", 64, "(a) sequences generated at once")
flags.DEFINE_integer("prompt_len", 64, "(a) prompt tokens per sequence")
flags.DEFINE_integer("new_tokens", 128, "(a) generated tokens per sequence")
flags.DEFINE_integer("repeats", 2, "(a) timed runs per side, after one warm-up each",
                     lower_bound=1)
flags.DEFINE_integer("threads", 0, "torch intra-op threads (0 = torch's default)")
flags.DEFINE_integer("trajectories", 64, "(b) trajectories in the timed run")
flags.DEFINE_integer("slots", 32, "(b) engine slots (concurrent sequences)")
flags.DEFINE_integer("max_len", 512, "(b) KV cache length per slot")
flags.DEFINE_integer("max_turns", 4, "(b) assistant turns per trajectory")
flags.DEFINE_integer("max_response_tokens", 320, "(b) response budget (model + tool tokens)")
flags.DEFINE_integer("calls_per_traj", 3, "(b) turns that end in a scripted tool call")
flags.DEFINE_integer("think_tokens", 24, "(b) tokens sampled before each scripted call")
flags.DEFINE_integer("sandbox_children", 8, "(b) sandbox server --max-children")
flags.DEFINE_float("prefix_grace_s", 0.25, "(b) EngineConfig.prefix_grace_s (0: a freed slot "
                   "goes to the next queued request at once)")
flags.DEFINE_boolean("static_baseline", False, "(b) also time static batching (TurnBatches), "
                     "alternating with the continuous runs")
flags.DEFINE_boolean("unequal", False, "(b) very unequal lengths: per trajectory 1/4x-4x "
                     "--think_tokens and a last turn of 8-256 tokens (log-uniform)")
flags.DEFINE_integer("prefill_batch_tokens", 256,
                     "(b) EngineConfig.prefill_batch_tokens (256: the engine's default)")
flags.DEFINE_integer("rounds", 2, "(b) timed runs per mode with --static_baseline")
flags.DEFINE_boolean("skip_a", False, "skip part (a)")
flags.DEFINE_boolean("skip_b", False, "skip part (b)")
flags.DEFINE_boolean("decode_buckets", True, "JaxEngine decode attends to a power-of-two "
                     "prefix of the slots (EngineConfig.decode_buckets)")
flags.DEFINE_integer("decode_steps", 4, "EngineConfig.decode_steps: tokens per decode call "
                     "while no request waits (the engine's default is 1)")
flags.DEFINE_boolean("warm_up", True, "(b) compile every engine shape before timing; "
                     "--nowarm_up compiles each when first met, inside the timings (smoke runs)")
flags.DEFINE_boolean("invariant", False, "(c) time EngineConfig.batch_invariant off vs on "
                     "(toy recipe sizes), alternating")
flags.DEFINE_string("out", "/tmp/bench_rollout.json", "where the figures go as JSON")
FLAGS = flags.FLAGS


class JitTimer:
  """Wraps the engine's jitted `_prefill` / `_decode` to time each call to completion.

  The engine reads their results on the host right after each call (`int(tok)`,
  `np.asarray`), so blocking here adds no synchronisation it would not do anyway.
  """

  def __init__(self):
    from rstar_jax.rollout import jax_engine
    self.mod = jax_engine
    self.orig = {"_prefill": jax_engine._prefill, "_decode": jax_engine._decode}
    self.seconds = {k: 0.0 for k in self.orig}
    self.calls = {k: 0 for k in self.orig}

  def __enter__(self):
    import jax
    for name, fn in self.orig.items():
      def timed(*args, _fn=fn, _name=name, **kw):
        t = time.perf_counter()
        out = jax.block_until_ready(_fn(*args, **kw))
        self.seconds[_name] += time.perf_counter() - t
        self.calls[_name] += 1
        return out
      setattr(self.mod, name, timed)
    return self

  def __exit__(self, *exc):
    for name, fn in self.orig.items():
      setattr(self.mod, name, fn)

  def reset(self):
    self.seconds = {k: 0.0 for k in self.orig}
    self.calls = {k: 0 for k in self.orig}


# --- (a) JaxEngine versus transformers generate() ---------------------------------------


def bench_generate():
  import jax.numpy as jnp
  import numpy as np
  import torch
  import transformers

  from rstar_jax.model import model_config
  from rstar_jax.model import hf_io, qwen3
  from rstar_jax.rollout.jax_engine import EngineConfig, GenerationRequest, JaxEngine

  if FLAGS.threads:
    torch.set_num_threads(FLAGS.threads)
  overrides = {"vocab_size": FLAGS.vocab} if FLAGS.vocab else {}
  cfg = model_config.get_preset(FLAGS.preset, **overrides)
  model = qwen3.create_model(cfg)
  tmp = tempfile.mkdtemp(prefix="bench_rollout_")
  hf_io.save_hf(model, tmp, dtype="float32")
  tmodel = transformers.Qwen3ForCausalLM.from_pretrained(
      tmp, dtype=torch.float32, attn_implementation="sdpa")
  tmodel.eval()
  shutil.rmtree(tmp)   # the weights are loaded

  b, p, n = FLAGS.batch, FLAGS.prompt_len, FLAGS.new_tokens
  max_len = -(-(p + n + 1) // 16) * 16   # room for prompt + every new token, no more
  rng = np.random.RandomState(0)

  # Same function on both sides (a wrong export would make the comparison moot).
  probe = rng.randint(0, cfg.vocab_size, (1, p))
  ours = np.asarray(qwen3.forward_logits(model, jnp.asarray(probe)))
  with torch.no_grad():
    theirs = tmodel(torch.tensor(probe)).logits.numpy()
  logit_diff = float(np.abs(ours - theirs).max())

  def prompts():
    return rng.randint(0, cfg.vocab_size, (b, p))

  ecfg = EngineConfig(num_slots=b, max_len=max_len, decode_buckets=FLAGS.decode_buckets,
                      decode_steps=FLAGS.decode_steps)
  k = ecfg.decode_steps

  def run_jax(tokens, seed):
    engine = JaxEngine(model, ecfg)
    reqs = [GenerationRequest(input_ids=row.tolist(), max_new_tokens=n, temperature=1.0,
                              top_p=1.0, top_k=0, seed=seed * 1000 + i)
            for i, row in enumerate(tokens)]
    t = time.perf_counter()
    outs = engine.generate_sync(reqs)
    dt = time.perf_counter() - t
    assert sum(len(o.output_ids) for o in outs) == b * n
    return dt

  def run_torch(tokens, seed):
    torch.manual_seed(seed)
    ids = torch.tensor(tokens)
    t = time.perf_counter()
    with torch.no_grad():
      out = tmodel.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                            temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=n,
                            min_new_tokens=n, pad_token_id=0, eos_token_id=None)
    dt = time.perf_counter() - t
    assert out.shape == (b, p + n), out.shape
    return dt

  timer = JitTimer()
  with timer:
    first_jax = run_jax(prompts(), 0)       # compiles prefill (bucket p) and decode
    run_torch(prompts(), 0)                 # warm-up
    timer.reset()
    times = {"jax": [], "torch": []}
    # The machine's limits are probed between the rounds, not once after them: a host's
    # speed can shift by 1.5x within seconds (seen 2026-11-26), and a limit taken in
    # another phase than the runs gave a decode step at 106% of its bound.
    probes = {"peak": [], "bandwidth": [], "rows_peak": []}
    for r in range(FLAGS.repeats):
      times["jax"].append(run_jax(prompts(), r + 1))
      times["torch"].append(run_torch(prompts(), r + 1))
      # (not inside the timed runs: the timer sees only the engine's jitted calls)
      probes["peak"].append(roofline.matmul_peak_gflops(repeats=3))
      probes["bandwidth"].append(roofline.memory_bandwidth_gbs(repeats=3))
      probes["rows_peak"].append(
          roofline.matmul_chain_gflops(b, cfg.hidden_size, cfg.intermediate_size, repeats=3))
    prof = dict(timer.seconds), dict(timer.calls)
  med = {k: statistics.median(v) for k, v in times.items()}
  ntok = b * n
  print(f"\n(a) generation, batch {b}, prompt {p}, {n} new tokens each (sampling T=1, no "
        f"top-k/p), fp32, 1 host CPU device, {os.cpu_count()} CPUs, torch threads "
        f"{torch.get_num_threads()}")
  print(f"    model: {FLAGS.preset} {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"mlp {cfg.intermediate_size}, heads {cfg.num_attention_heads}/"
        f"{cfg.num_key_value_heads} x {cfg.head_dim}, vocab {cfg.vocab_size}, "
        f"{cfg.num_params / 1e6:.2f}M params; JaxEngine slots {b}, max_len {max_len}")
  print(f"    max |logit diff| ours vs transformers on one prompt: {logit_diff:.2e}")
  print(f"    {'engine':<30}{'median s':>10}{'min s':>10}{'tokens/s':>11}")
  for key, label in (("jax", "rstar_jax JaxEngine"), ("torch", "transformers generate()")):
    print(f"    {label:<30}{med[key]:>10.3f}{min(times[key]):>10.3f}{ntok / med[key]:>11.0f}")
  print(f"    ratio JaxEngine / transformers tokens/s: {med['torch'] / med['jax']:.2f}x "
        f"(target >= 2x)")
  print(f"    JaxEngine first run incl. compile {first_jax:.2f} s -> compile ~"
        f"{first_jax - med['jax']:.2f} s (excluded above)")
  secs, calls = prof
  total = sum(times["jax"])
  host = total - secs["_prefill"] - secs["_decode"]
  reps = FLAGS.repeats
  each = {f: 1e3 * secs[f] / max(calls[f], 1) for f in secs}
  print(f"    JaxEngine profile (per run, mean of {reps}): prefill {secs['_prefill'] / reps:.3f} s "
        f"in {calls['_prefill'] // reps} calls ({each['_prefill']:.2f} ms each), "
        f"decode {secs['_decode'] / reps:.3f} s in {calls['_decode'] // reps} calls of {k} "
        f"steps ({each['_decode'] / k:.2f} ms per step), host Python "
        f"{host / reps:.3f} s ({100 * host / total:.0f}%)")
  print(f"    torch per generated position: {1e3 * med['torch'] / n:.2f} ms for the whole batch")
  # Roofline of one decode step (b rows): useful FLOPs (every weight once per row, the
  # head included, plus attention over the filled part, on average p + n/2 positions)
  # and bytes (every weight once, plus the k/v the step reads: the length bucket of
  # the step with decode_buckets where `decode_attend` takes it, else whole slots).
  peak, bandwidth, rows_peak = (statistics.median(probes[k])
                                for k in ("peak", "bandwidth", "rows_peak"))
  print("    limits probed after each round (min / median / max): " + "; ".join(
      f"{label} {min(probes[k]):.0f} / {statistics.median(probes[k]):.0f} / {max(probes[k]):.0f} {unit}"
      for k, label, unit in (("peak", "1024^3 matmul", "GFLOP/s"),
                             ("bandwidth", "read bandwidth", "GB/s"),
                             ("rows_peak", f"chain of {b}-row products", "GFLOP/s"))))
  head = cfg.vocab_size * cfg.hidden_size
  dense = cfg.num_params - head * (1 if cfg.tie_word_embeddings else 2) + head
  filled = p + n / 2
  attn = 4 * b * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * filled
  step_flops = 2 * b * dense + attn
  if FLAGS.decode_buckets:   # a call from step j0 attends at length p + j0 + k
    read = np.mean([ecfg.decode_attend(p + j // k * k + k) or max_len for j in range(n)])
  else:
    read = max_len
  kv_bytes = b * read * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4
  step_bytes = 4 * cfg.num_params + kv_bytes
  step_s = secs["_decode"] / max(calls["_decode"] * k, 1)
  decode_roof = {"peak_gflops": peak, "bandwidth_gbs": bandwidth, "step_s": step_s,
                 "probes": probes,
                 "flops_per_step": step_flops, "bytes_per_step": step_bytes,
                 "gflops": step_flops / step_s / 1e9, "gbs": step_bytes / step_s / 1e9}
  decode_roof["fraction_of_peak"] = decode_roof["gflops"] / peak
  decode_roof["fraction_of_bandwidth"] = decode_roof["gbs"] / bandwidth
  limit_s = max(step_flops / (peak * 1e9), step_bytes / (bandwidth * 1e9))
  decode_roof["limit_step_s"] = limit_s
  decode_roof["fraction_of_limit"] = limit_s / step_s
  print(f"    decode roofline: {step_flops / 1e9:.3f} GFLOP and {step_bytes / 1e6:.1f} MB per step; "
        f"{decode_roof['gflops']:.1f} GFLOP/s = {100 * decode_roof['fraction_of_peak']:.0f}% of the "
        f"measured matmul peak {peak:.0f}; {decode_roof['gbs']:.1f} GB/s = "
        f"{100 * decode_roof['fraction_of_bandwidth']:.0f}% of the measured bandwidth "
        f"{bandwidth:.1f} GB/s; the binding limit is {1e3 * limit_s:.2f} ms/step "
        f"({'FLOPs' if step_flops / peak > step_bytes / bandwidth else 'bytes'}), reached "
        f"{100 * decode_roof['fraction_of_limit']:.0f}%")
  # The roofline's max() assumes the matmuls hide under the memory stream; a layer's
  # ops run one after another, so the sum of both is the bound without that overlap.
  serial_s = step_flops / (peak * 1e9) + step_bytes / (bandwidth * 1e9)
  decode_roof["serial_limit_step_s"] = serial_s
  decode_roof["fraction_of_serial_limit"] = serial_s / step_s
  print(f"    without overlap (FLOPs at the peak, then bytes at the bandwidth) a step takes "
        f"{1e3 * serial_s:.2f} ms: reached {100 * serial_s / step_s:.0f}%")
  # The same bound with the matmuls at the rate this machine gives their shape (b rows)
  # rather than a 1024^3 product's: what a decode step could reach here at best.
  rows_s = step_flops / (rows_peak * 1e9) + step_bytes / (bandwidth * 1e9)
  decode_roof.update(rows_peak_gflops=rows_peak, rows_serial_limit_step_s=rows_s,
                     fraction_of_rows_serial_limit=rows_s / step_s)
  print(f"    the same with the matmuls at the rate of a chain of {b}-row products here "
        f"({rows_peak:.0f} GFLOP/s, {100 * rows_peak / peak:.0f}% of the peak): {1e3 * rows_s:.2f} ms, "
        f"reached {100 * rows_s / step_s:.0f}%")
  # The roofline with that rate: the limit set by FLOPs (at the rate the step's shapes
  # get here) or bytes, whichever binds, and what the whole run would be against
  # generate() if every decode step took only that (prefill and host time as measured).
  rows_limit_s = max(step_flops / (rows_peak * 1e9), step_bytes / (bandwidth * 1e9))
  steps_per_run = calls["_decode"] * k / reps
  at_limit_s = (secs["_prefill"] + host) / reps + steps_per_run * rows_limit_s
  decode_roof.update(rows_limit_step_s=rows_limit_s, fraction_of_rows_limit=rows_limit_s / step_s,
                     ratio_if_decode_at_rows_limit=med["torch"] / at_limit_s)
  binds = "FLOPs" if step_flops / rows_peak > step_bytes / bandwidth else "bytes"
  print(f"    the binding limit at that rate ({binds}) is {1e3 * rows_limit_s:.2f} ms/step: "
        f"reached {100 * rows_limit_s / step_s:.0f}%; with every decode step at it the engine "
        f"would be {med['torch'] / at_limit_s:.2f}x generate()")
  return {"decode_roofline": decode_roof, "batch": b, "prompt_len": p, "new_tokens": n, "preset": FLAGS.preset,
          "num_params": cfg.num_params, "wall_s": times, "jax_first_run_s": first_jax,
          "tokens_per_s": {k: ntok / med[k] for k in med},
          "ratio_jax_over_torch": med["torch"] / med["jax"], "max_logit_diff": logit_diff,
          "profile_s": secs, "profile_calls": calls, "host_python_s": host, "decode_steps": k}


# --- (b) multi-turn rollouts with the sandbox ------------------------------------------------
# (ToolCallingEngine, TurnBatches, TimedTools: experiments/common/scripted_rollouts.py)


def bench_agent():
  import numpy as np

  from rstar_jax.data import toy_task
  from rstar_jax.model import model_config, qwen3
  from rstar_jax.rollout import chat
  from rstar_jax.rollout.agent_loop import AgentConfig, run_many
  from rstar_jax.rollout.jax_engine import EngineConfig, JaxEngine
  from rstar_jax.rollout.scheduler import EnginePool
  from rstar_jax.rollout.sandbox_client import SandboxTools
  from sandbox.launcher import running_server

  tok = toy_task.train_toy_tokenizer(1024)
  proto = chat.ChatProtocol(tok, toy_task.toy_chat_config())
  cfg = model_config.get_preset(FLAGS.preset, vocab_size=tok.vocab_size)
  model = qwen3.create_model(cfg, seed=1)
  ecfg = EngineConfig(num_slots=FLAGS.slots, max_len=FLAGS.max_len,
                      prefix_grace_s=FLAGS.prefix_grace_s,
                      prefill_batch_tokens=FLAGS.prefill_batch_tokens,
                      decode_steps=FLAGS.decode_steps)
  engine = JaxEngine(model, ecfg)
  acfg = AgentConfig(max_turns=FLAGS.max_turns, max_response_tokens=FLAGS.max_response_tokens)

  # Compile every prefill shape and decode bucket before timing.
  t = time.perf_counter()
  n_shapes = engine.warm_up() if FLAGS.warm_up else 0
  compile_s = time.perf_counter() - t

  def problems_for(n, seed):
    problems = toy_task.generate_problems(n, seed=seed)
    uids = [f"p{seed}_{i}" for i in range(n)]
    calls = {u: tok.encode(chat.assistant_text({"content": "", "tool_calls": [{
        "name": toy_task.TOY_TOOL_NAME, "arguments": {"code": p.code}}]}))
             for u, p in zip(uids, problems)}
    return [(u, p.problem) for u, p in zip(uids, problems)], calls

  pool = EnginePool([engine])

  def rollout(url, n, seed, static=False):
    problems, calls = problems_for(n, seed)
    wrapped = ToolCallingEngine(pool, calls, FLAGS.calls_per_traj, FLAGS.think_tokens,
                                cfg.vocab_size, unequal=FLAGS.unequal)
    tools = TimedTools(SandboxTools(url, timeout_s=10.0))

    async def main():
      engine_ = TurnBatches(wrapped, n) if static else wrapped
      try:
        return await run_many(engine_, tools, proto, problems, acfg,
                              seeds=list(range(seed * 10_000, seed * 10_000 + n)),
                              progress=engine_.finished if static else None)
      finally:
        await tools.inner.aclose()
    t = time.perf_counter()
    trajs = asyncio.run(main())
    return trajs, tools, time.perf_counter() - t, wrapped

  try:
    with running_server(max_children=FLAGS.sandbox_children, pool_size=2) as url:
      rollout(url, 4, seed=1)          # warm-up: the sandbox pool, the HTTP client
      modes = {"continuous": [], "static": []}
      engine_s = {m: [] for m in modes}  # per run: (decode s, decode steps, prefill s, calls)
      if FLAGS.static_baseline:
        # The same problems and seeds in both modes, alternating: load hits both.
        for _ in range(FLAGS.rounds):
          for mode in modes:
            m0 = dict(engine.metrics)
            _, _, w, _ = rollout(url, FLAGS.trajectories, seed=2, static=mode == "static")
            modes[mode].append(w)
            engine_s[mode].append(tuple(engine.metrics[k] - m0.get(k, 0) for k in (
                "decode_s", "decode_steps", "prefill_s", "prefill_calls")))
      before = dict(engine.metrics)
      trajs, tools, wall, wrapped = rollout(url, FLAGS.trajectories, seed=2)
      after = dict(engine.metrics)
  finally:
    engine.stop()

  d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
  n = len(trajs)
  calls = sum(t.num_tool_calls for t in trajs)
  errors = sum(t.num_tool_errors for t in trajs)
  lat = np.asarray(tools.latencies) * 1e3
  reasons = {}
  for t in trajs:
    reasons[t.finish_reason] = reasons.get(t.finish_reason, 0) + 1
  resp = np.asarray([len(t.response_ids) for t in trajs])
  model_tok = sum(t.model_tokens for t in trajs)
  util = d.get("active_slot_steps", 0) / max(d.get("decode_steps", 1) * ecfg.num_slots, 1)
  print(f"\n(b) multi-turn rollouts, real sandbox (max_children {FLAGS.sandbox_children}), "
        f"toy problems, 1 JaxEngine ({ecfg.num_slots} slots x {ecfg.max_len} tokens)")
  print(f"    model: {FLAGS.preset} {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"vocab {cfg.vocab_size} (toy tokenizer), random weights; agent: max_turns "
        f"{acfg.max_turns}, max_response_tokens {acfg.max_response_tokens}; turns < "
        f"{FLAGS.calls_per_traj} = {FLAGS.think_tokens} sampled tokens + scripted call")
  if not FLAGS.warm_up:
    print("    engine warm-up skipped (--nowarm_up): shapes compile when first met, "
          "inside the timings below")
  else:
    print(f"    engine warm-up (compile {n_shapes} prefill and decode shapes): {compile_s:.1f} s "
          "(excluded)")
  rows = [
      ("trajectories", f"{n}"),
      ("wall time", f"{wall:.2f} s"),
      ("trajectories / s", f"{n / wall:.2f}"),
      ("tool calls", f"{calls} ({errors} errors; {tools.calls} ran in the sandbox)"),
      ("tool calls / s", f"{calls / wall:.1f}"),
      ("tool latency per turn, ms", f"mean {lat.mean():.1f}  p50 {np.median(lat):.1f}  "
                                    f"p90 {np.percentile(lat, 90):.1f}"),
      ("turns / trajectory", f"{np.mean([t.num_turns for t in trajs]):.2f}"),
      ("finish reasons", ", ".join(f"{k} {v}" for k, v in sorted(reasons.items()))),
      ("response tokens / trajectory", f"mean {resp.mean():.0f}, model {model_tok / n:.0f}"),
      ("engine generated tokens / s", f"{d.get('generated_tokens', 0) / wall:.0f}"),
      ("engine slot utilisation", f"{util:.2f} (active slot-steps / (decode steps x slots))"),
      ("engine busy fraction", f"{d.get('busy_s', 0.0) / wall:.2f}"),
      ("engine decode / prefill time", f"{d.get('decode_s', 0.0):.2f} s in {d.get('decode_steps', 0)} "
                                       f"steps / {d.get('prefill_s', 0.0):.2f} s in "
                                       f"{d.get('prefill_calls', 0)} calls "
                                       f"({d.get('prefill_padded_tokens', 0)} padded tokens)"),
      ("prefill tokens (prefix-reused)", f"{d.get('prefill_tokens', 0)} "
                                         f"({d.get('reused_prefix_tokens', 0)})"),
      ("prefix reused / reusable", f"{wrapped.reused} / {wrapped.reusable} tokens of later turns "
                                   f"({100 * wrapped.reused / max(wrapped.reusable, 1):.0f}%); "
                                   f"prefix_grace_s {ecfg.prefix_grace_s}"),
      ("mean queue wait per request", f"{1e3 * pool.stats()['jax0/mean_queue_wait_s']:.1f} ms "
                                      "(warm-up included)"),
  ]
  for k, v in rows:
    print(f"    {k:<32}{v}")
  static = {}
  if FLAGS.static_baseline:
    med = {m: statistics.median(w) for m, w in modes.items()}
    # What the spread allows, in decode steps (prefill and tools left out; slots >=
    # trajectories): static waits for each turn's longest sequence, continuous only for
    # the longest trajectory.
    per_traj = list(wrapped.decoded.values())
    turns = max(max(t) for t in per_traj) + 1
    static_steps = sum(max(t.get(k, 0) for t in per_traj) for k in range(turns))
    cont_steps = max(sum(t.values()) for t in per_traj)
    static = {"wall_s": modes, "trajectories_per_s": {m: n / w for m, w in med.items()},
              "continuous_over_static": med["static"] / med["continuous"],
              "decode_step_bound": static_steps / cont_steps}
    print(f"    static batching baseline ({FLAGS.rounds} runs per mode, alternating, same "
          f"problems and seeds): continuous {n / med['continuous']:.2f} vs static "
          f"{n / med['static']:.2f} trajectories/s -> continuous batching "
          f"{static['continuous_over_static']:.2f}x; the lengths allow at most "
          f"{static['decode_step_bound']:.2f}x (decode steps: static {static_steps}, "
          f"continuous {cont_steps}; {FLAGS.slots} slots)")
    # Where each mode's engine time went (median run): continuous batching saves decode
    # steps; prefill, which both modes pay, dilutes the ratio.
    for m, runs in engine_s.items():
      dec_s, steps, pre_s, pcalls = (statistics.median(r[j] for r in runs) for j in range(4))
      static[f"engine_{m}"] = {"decode_s": dec_s, "decode_steps": steps, "prefill_s": pre_s,
                               "prefill_calls": pcalls}
      print(f"      {m:<10} engine: decode {dec_s:.2f} s in {steps:.0f} steps "
            f"({1e3 * dec_s / max(steps, 1):.1f} ms each), prefill {pre_s:.2f} s in "
            f"{pcalls:.0f} calls")
  return {"static_baseline": static, "trajectories": n, "wall_s": wall, "trajectories_per_s": n / wall,
          "tool_calls": calls, "tool_errors": errors, "tool_calls_per_s": calls / wall,
          "tool_latency_ms": lat.tolist(), "finish_reasons": reasons,
          "response_tokens_mean": float(resp.mean()), "model_tokens": model_tok,
          "engine_tokens_per_s": d.get("generated_tokens", 0) / wall,
          "slot_utilisation": util, "engine_busy_fraction": d.get("busy_s", 0.0) / wall,
          "compile_s": compile_s, "warm_up": FLAGS.warm_up, "slots": ecfg.num_slots, "max_len": ecfg.max_len,
          "prefix_reused": wrapped.reused, "prefix_reusable": wrapped.reusable,
          "prefill_tokens": d.get("prefill_tokens", 0), "prefix_grace_s": ecfg.prefix_grace_s}


# --- (c) batch-invariant rollouts: what the switch costs --------------------------------


def bench_invariant():
  import jax
  import numpy as np

  from rstar_jax.model import qwen3
  from rstar_jax.model.model_config import Qwen3Config
  from rstar_jax.rollout.jax_engine import EngineConfig, GenerationRequest, JaxEngine

  # experiments/configs/toy.py's model and engine (vocab: its toy tokenizer's size).
  cfg = Qwen3Config(vocab_size=2048, hidden_size=128, intermediate_size=384,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=64, tie_word_embeddings=True, initializer_range=0.05)
  model = qwen3.create_model(cfg, seed=1)
  slots, max_len = 64, 384
  n_traj, turns, think = FLAGS.trajectories, FLAGS.max_turns, FLAGS.think_tokens
  rng = np.random.RandomState(0)
  prompts = [rng.randint(0, cfg.vocab_size, rng.randint(60, 90)).tolist() for _ in range(n_traj)]
  budgets = [max(4, int(think * 2 ** rng.uniform(-1, 1))) for _ in range(n_traj)]
  tool_ids = [[rng.randint(0, cfg.vocab_size, rng.randint(16, 41)).tolist() for _ in range(turns)]
              for _ in range(n_traj)]
  waits = [[rng.uniform(0.005, 0.04) for _ in range(turns)] for _ in range(n_traj)]
  modes = {"off": EngineConfig(num_slots=slots, max_len=max_len),
           "on": EngineConfig(num_slots=slots, max_len=max_len, batch_invariant=True)}
  engines = {m: JaxEngine(model, c, name=f"jax_{m}") for m, c in modes.items()}
  compile_s = {}
  for m, e in engines.items():
    t = time.perf_counter()
    compile_s[m] = (e.warm_up(), time.perf_counter() - t)

  async def trajectory(engine, i, seed):
    ctx, out = list(prompts[i]), []
    for k in range(turns):
      budget = min(budgets[i], max_len - 1 - len(ctx))
      if budget <= 0:
        break
      r = await engine.generate(GenerationRequest(
          input_ids=ctx, max_new_tokens=budget, temperature=1.0, seed=seed * 100_000 + i * 10 + k,
          request_id=f"{i}/turn{k}"))
      ctx = ctx + r.output_ids
      out.append((r.output_ids, np.float32(r.logprobs).tobytes()))
      if k + 1 < turns and len(ctx) + len(tool_ids[i][k]) < max_len - 1:
        await asyncio.sleep(waits[i][k])      # the tool runs: the slot is free meanwhile
        ctx = ctx + tool_ids[i][k]
    return out

  def run(mode, seed):
    e = engines[mode]
    before = dict(e.metrics)

    async def main():
      return await asyncio.gather(*(trajectory(e, i, seed) for i in range(n_traj)))
    t = time.perf_counter()
    outs = asyncio.run(main())
    wall = time.perf_counter() - t
    d = {k: v - before.get(k, 0) for k, v in e.metrics.items()}
    return wall, d, outs

  with JitTimer() as timer:
    for m in modes:
      run(m, 0)                                # warm: the event loop, the first calls
    runs = {m: [] for m in modes}
    outs = {}
    probes = {"peak": [], "bandwidth": [], "rows_peak": []}
    for r in range(FLAGS.rounds):
      for m in modes:
        timer.reset()
        wall, d, outs[m] = run(m, r + 1)
        runs[m].append((wall, d, dict(timer.seconds), dict(timer.calls)))
      probes["peak"].append(roofline.matmul_peak_gflops(repeats=3))
      probes["bandwidth"].append(roofline.memory_bandwidth_gbs(repeats=3))
      probes["rows_peak"].append(
          roofline.matmul_chain_gflops(slots, cfg.hidden_size, cfg.intermediate_size, repeats=3))
  for e in engines.values():
    e.stop()
  peak, bandwidth, rows_peak = (statistics.median(probes[k]) for k in probes)
  # Decode roofline per step (64 rows) with the switch: every weight read once and
  # applied to every row, plus the k/v of whole slots. Without it a step reads the
  # length bucket of its longest row where `decode_attend` takes one, a bound that
  # changes step by step: "off" is not set against it.
  dense = cfg.num_params
  kv_bytes = slots * max_len * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4
  step_bytes = 4 * dense + kv_bytes
  attn = 4 * slots * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * max_len
  step_flops = 2 * slots * dense + attn
  limit_s = max(step_flops / (rows_peak * 1e9), step_bytes / (bandwidth * 1e9))
  same_tokens = [[t for t, _ in o] for o in outs["off"]] == [[t for t, _ in o] for o in outs["on"]]
  same = outs["off"] == outs["on"]
  print(f"\n(c) batch_invariant off vs on, {FLAGS.rounds} alternating runs each: {n_traj} "
        f"trajectories x up to {turns} turns of ~{think} tokens (1/2x-2x), tool turns of 16-40 "
        f"tokens after 5-40 ms; toy model ({cfg.num_params / 1e6:.2f}M params), {slots} slots x "
        f"{max_len}")
  print(f"    limits probed after each round (median): 1024^3 matmul {peak:.0f} GFLOP/s, chain of "
        f"{slots}-row products {rows_peak:.0f} GFLOP/s, read bandwidth {bandwidth:.1f} GB/s; "
        f"decode step limit (whole slots) {1e3 * limit_s:.2f} ms")
  print(f"    {'mode':<6}{'wall s':>9}{'tok/s':>9}{'decode ms/step':>16}{'of limit':>10}"
        f"{'prefill s':>11}{'calls':>7}{'prefill tok':>13}{'reused tok':>12}{'shapes':>8}")
  summary = {}
  for m in modes:
    walls = [w for w, _, _, _ in runs[m]]
    k = walls.index(statistics.median(walls)) if len(walls) % 2 else int(np.argmin(walls))
    wall, d, secs, calls = runs[m][k]
    step_ms = 1e3 * secs["_decode"] / max(d.get("decode_steps", 1), 1)
    toks = d.get("generated_tokens", 0)
    summary[m] = {"wall_s": walls, "tokens_per_s": toks / wall, "decode_ms_per_step": step_ms,
                  "fraction_of_decode_limit": 1e3 * limit_s / step_ms if m == "on" else None,
                  "prefill_s": secs["_prefill"], "prefill_calls": calls["_prefill"],
                  "prefill_tokens": d.get("prefill_tokens", 0),
                  "reused_prefix_tokens": d.get("reused_prefix_tokens", 0),
                  "decode_steps": d.get("decode_steps", 0), "generated_tokens": toks,
                  "compiled_shapes": compile_s[m][0], "compile_s": compile_s[m][1]}
    frac = summary[m]["fraction_of_decode_limit"]
    print(f"    {m:<6}{wall:>9.2f}{toks / wall:>9.0f}{step_ms:>16.2f}"
          f"{f'{100 * frac:.0f}%' if frac else '-':>10}{secs['_prefill']:>11.2f}"
          f"{calls['_prefill']:>7}{summary[m]['prefill_tokens']:>13}"
          f"{summary[m]['reused_prefix_tokens']:>12}{compile_s[m][0]:>8}")
  ratio = summary["on"]["tokens_per_s"] / summary["off"]["tokens_per_s"]
  print(f"    tokens/s with the switch / without: {ratio:.2f} (median run of each); last "
        f"round, off vs on: {'the same' if same_tokens else 'different'} tokens, "
        f"{'the same' if same else 'different'} log-prob bits")
  return {"modes": summary, "on_over_off_tokens_per_s": ratio, "same_bits_last_round": same,
          "same_tokens_last_round": same_tokens,
          "probes": probes, "decode_limit_step_s": limit_s, "slots": slots, "max_len": max_len,
          "trajectories": n_traj, "turns": turns, "think_tokens": think,
          "jax_devices": str(jax.devices())}


def main(_):
  import jax
  # The machine is often shared: the load average says how far to trust the figures.
  print(f"jax devices: {jax.devices()}; load average {os.getloadavg()[0]:.1f}")
  result = {"benchmark": "bench_rollout", "cpus": os.cpu_count(),
            "load_average_start": os.getloadavg()}
  if not FLAGS.skip_a:
    result["generate"] = bench_generate()
  if not FLAGS.skip_b:
    result["agent"] = bench_agent()
  if FLAGS.invariant:
    result["invariant"] = bench_invariant()
  result["load_average_end"] = os.getloadavg()
  print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
  results_json.write(FLAGS.out, result)


if __name__ == "__main__":
  app.run(main)
