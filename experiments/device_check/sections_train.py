"""The device check's train-step sections: train_step (the RL trainer's sharded GRPO
step per attention implementation and sequence length, with its levers), parts (the
step's per-layer, head and optimizer costs; packed rows) and memory (the device's peak
against the CPU host's ahead-of-time plan), with the batches and the segment-isolation
figure they build."""
from __future__ import annotations

import functools
import time
from typing import Any

from absl import flags

from experiments.device_check.checks import (TARGETS, check_at_least, check_at_most,
                                             check_dot_product_attention, check_lever,
                                             check_memory_vs_plan, check_row,
                                             check_segment_isolation, parse_lever)
from experiments.device_check.report import fmt
from experiments.device_check.workload import (device_peak_bytes, make_mesh, matmul_peaks,
                                               on_accelerator, own_attention, sizes,
                                               slice_config)

FLAGS = flags.FLAGS


def section_train_step(ctx: dict[str, Any]) -> dict[str, Any]:
  from experiments.common import roofline
  from experiments.common import step_timing
  from rstar_jax.train import step as core

  sz = sizes()
  mesh = make_mesh()
  n_dev = mesh.devices.size
  peaks = matmul_peaks(ctx, n_dev)
  # The 14B config's attention on this device ("auto": cuDNN's kernel on an NVIDIA GPU,
  # "chunked" elsewhere) gets the MFU target and the longer sequences.
  own = own_attention()
  impls = list(FLAGS.attention_impls)
  if own not in impls:
    impls.insert(0, own)
  cases = [(impl, sz["train_seqs"][0]) for impl in impls]
  cases += [(own, s) for s in sz["train_seqs"][1:]]
  rows = core.batch_multiple(1, mesh)
  batch_n = max(sz["train_batch"], rows)
  def time_case(run: dict[str, Any], label: str, model_over: dict[str, Any],
                step_over: dict[str, Any] | None) -> dict[str, Any]:
    """One train-step case on the slice: `run` filled with its timing (or its error)."""
    t0 = time.perf_counter()
    try:
      cfg = slice_config(**model_over)
      batch = step_timing.random_batch(cfg.vocab_size, batch_n, run["seq"], row_multiple=rows,
                                       length_multiple=64 if not FLAGS.tiny else 8)
      timing = step_timing.time_train_step(cfg, mesh, batch=batch, steps=FLAGS.steps,
                                           logprob_chunk=sz["logprob_chunk"],
                                           compiled_text=True, step_overrides=step_over)
      run.update(step_timing.as_dict(timing, peaks), ok=True, peak_bytes=device_peak_bytes())
      # MFU both ways, labelled: attention FLOPs in full (PaLM; `mfu`, `flops`) and the
      # causal half (MaxText).
      run["flops_causal_attention"] = roofline.train_flops(cfg, timing.batch, timing.seq,
                                                           causal=True)
      run["mfu_both"] = {k: roofline.mfu_both(cfg, timing.batch, timing.seq,
                                              timing.median_s, v)
                         for k, v in peaks.items()}
    except Exception as e:  # e.g. out of memory at 12288: the other cases still count
      run.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
    run["seconds"] = time.perf_counter() - t0
    print(f"train_step {label}: " + (
        f"{1e3 * run['median_s']:.1f} ms, MFU {run['mfu']}" if run["ok"] else run["error"][:300]),
        flush=True)
    return run

  runs = [time_case({"attention_impl": impl, "seq": seq, "batch": batch_n}, f"{impl} seq {seq}",
                    {"attention_impl": impl}, None) for impl, seq in cases]
  # The levers, one case each beside the base case (own attention, first sequence length,
  # the same batch), so a lever's time and loss are compared within one run.
  lever_runs = []
  for text in FLAGS.levers:
    where, field, value = parse_lever(text)
    lever_runs.append(time_case(
        {"lever": text, "attention_impl": own, "seq": sz["train_seqs"][0], "batch": batch_n},
        f"lever {text}",
        dict({"attention_impl": own}, **({field: value} if where == "model" else {})),
        {field: value} if where == "step" else None))
  by = {(r["attention_impl"], r["seq"]): r for r in runs if r["ok"]}
  seq0 = sz["train_seqs"][0]
  accel = on_accelerator()
  checks = []
  main = by.get((own, seq0))
  mfu = main["mfu"].get("data_sheet") if main else None
  causal = (main["mfu_both"].get("data_sheet") or {}).get("causal_attention") if main else None
  checks.append(check_row(f"MFU of the data sheet's bf16 peak, {own}, seq {seq0} "
                          "(attention FLOPs in full)", mfu,
                          f">= {TARGETS['mfu_data_sheet_min']:g}",
                          check_at_least(mfu, "mfu_data_sheet_min") if accel else None,
                          (f"causal-halved attention FLOPs (MaxText): {fmt(causal)}" if accel
                           else "CPU: no data sheet peak")))
  dpa, blk = by.get(("dot_product", seq0)), by.get(("blockwise", seq0))
  target = f">= {TARGETS['dot_product_speedup_min']:g}, cuDNN fused attention in the HLO"
  name = "dot_product (cuDNN) speed / blockwise speed"
  if dpa and blk:
    speed = blk["median_s"] / dpa["median_s"]
    scale = max(abs(blk["loss"][0]), 1e-6)
    loss_rel = abs(dpa["loss"][0] - blk["loss"][0]) / scale
    met, detail = check_dot_product_attention(dpa["hlo_custom_calls"], speed)
    # On a CPU there is no cuDNN: the figure is reported, the target does not apply.
    checks.append(check_row(name, speed, target, met if accel else None, detail))
    checks.append(check_row("dot_product loss vs blockwise, rel. diff", loss_rel,
                            f"<= {TARGETS['attention_loss_rel_diff_max']:g}",
                            check_at_most(loss_rel, "attention_loss_rel_diff_max")))
  elif {"dot_product", "blockwise"} <= set(FLAGS.attention_impls):
    checks.append(check_row(name, None, target, False, "a run failed"))
  else:   # not asked for (--attention_impls): nothing to compare
    checks.append(check_row(name, None, target, None, "not both in --attention_impls"))
  failed = [f"{r['attention_impl']}@{r['seq']}" for r in runs if not r["ok"]]
  checks.append(check_row("train-step cases that ran", len(runs) - len(failed), f"{len(runs)}",
                          not failed, ", ".join(failed)))
  base = by.get((own, seq0))
  for run in lever_runs:
    met, rel = check_lever(base["loss"][0] if base else None,
                           run["loss"][0] if run["ok"] else None)
    note = (run.get("error", "")[:300] if not run["ok"] else "the base case failed" if not base
            else f"step {1e3 * run['median_s']:.1f} ms vs {1e3 * base['median_s']:.1f} ms "
                 f"without it ({base['median_s'] / run['median_s']:.2f}x)"
                 + ("" if accel else "; CPU: timing only"))
    checks.append(check_row(f"lever {run['lever']}: first loss vs the step without it, rel. diff",
                            rel, f"<= {TARGETS['lever_loss_rel_diff_max']:g}", met, note))
  return {"num_params": slice_config().num_params, "mesh": dict(mesh.shape), "peaks_gflops": peaks,
          "runs": runs, "lever_runs": lever_runs, "checks": checks}

def padded_batch(vocab_size: int, rows: int, seq: int, seed: int = 0) -> dict[str, Any]:
  """[rows, seq] GRPO batch of random trajectories that do not fill their rows: row i
  holds seq * (3/4 - i / (8 rows)) tokens (a quarter prompt), the rest is padding
  (attention_mask 0), so the mask path of attention (the padding segment, 0) and of the
  loss runs. T is `seq` (a power of two: build_batch rounds the longest row up to it).
  One trajectory per row: the RL step's positions count from the row's start, so it
  packs no second sequence into a row (SFT does)."""
  import numpy as np

  from rstar_jax.rl import batching
  if seq & (seq - 1):
    raise ValueError(f"padded_batch: seq {seq} must be a power of two")
  rng = np.random.RandomState(seed)
  trajs = []
  for i in range(rows):
    n = max(4, int(seq * (0.75 - i / (8 * rows))))
    prompt = n // 4
    resp = n + 1 - prompt
    trajs.append(batching.TokenTrajectory(
        prompt_ids=rng.randint(0, vocab_size, prompt).tolist(),
        response_ids=rng.randint(0, vocab_size, resp).tolist(), response_mask=[1] * resp,
        response_logprobs=(-rng.rand(resp) * 2).tolist()))
  batch = batching.build_batch(trajs, rng.randn(rows).astype(np.float32), row_multiple=rows,
                               length_multiple=8, pow2_lengths=True)
  if batch["input_ids"].shape != (rows, seq):
    raise AssertionError(f"padded_batch: shape {batch['input_ids'].shape} != {(rows, seq)}")
  return batch


def segment_isolation_rel_l2(cfg, seq: int, *, seed: int = 0,
                             merge_segments: bool = False) -> float:
  """Relative L2 distance between the hidden states of three random sequences packed
  into one row of `seq` (segment ids 1, 2, 3, positions restarting at 0, the last
  eighth padding: the segment path of attention, as SFT packs rows) and the same
  sequences each alone in a row of its own (segment 1, then padding).
  merge_segments: test hook, the packed row as one segment (a planted fault)."""
  from flax import nnx
  import jax
  import jax.numpy as jnp
  import numpy as np

  from rstar_jax.model import qwen3
  model = qwen3.create_model(cfg, seed=seed)
  graphdef, state = nnx.split(model)
  del model

  @jax.jit
  def hidden_of(state, tokens, positions, segments):
    h, _ = nnx.merge(graphdef, state)(tokens, positions, segment_ids=segments)
    return h.astype(jnp.float32)

  rng = np.random.RandomState(seed)
  lens = [seq // 2, seq // 4, seq // 8]
  tokens = np.zeros((1, seq), np.int32)
  positions = np.zeros((1, seq), np.int32)
  segments = np.zeros((1, seq), np.int32)
  alone = np.zeros((3, seq), np.int32)
  alone_pos = np.tile(np.arange(seq, dtype=np.int32), (3, 1))
  alone_seg = np.zeros((3, seq), np.int32)
  start = 0
  spans = []
  for i, n in enumerate(lens):
    ids = rng.randint(0, cfg.vocab_size, n)
    tokens[0, start:start + n] = ids
    positions[0, start:start + n] = np.arange(n)
    segments[0, start:start + n] = 1 if merge_segments else i + 1
    alone[i, :n] = ids
    alone_seg[i, :n] = 1
    spans.append((start, n))
    start += n
  packed = np.asarray(hidden_of(state, tokens, positions, segments))
  single = np.asarray(hidden_of(state, alone, alone_pos, alone_seg))
  a = np.concatenate([packed[0, s:s + n] for s, n in spans]).astype(np.float64)
  b = np.concatenate([single[i, :n] for i, (_, n) in enumerate(spans)]).astype(np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def section_parts(ctx: dict[str, Any]) -> dict[str, Any]:
  """What a train step's parts cost, measured in one process: the step of L and of 2L
  layers on the same padded batch (per layer: the difference / L), the output head with
  the log-probs alone (forward + backward) and the optimizer update alone."""
  import gc

  from flax import nnx
  import jax
  import jax.numpy as jnp
  import optax

  from experiments.common import roofline
  from experiments.common import step_timing
  from rstar_jax import optim
  from rstar_jax.model import qwen3
  from rstar_jax.train import step as core

  sz = sizes()
  mesh = make_mesh()
  peaks = matmul_peaks(ctx, mesh.devices.size)
  own = own_attention()
  seq = sz["train_seqs"][0]
  rows = core.batch_multiple(1, mesh)
  layers = slice_config().num_hidden_layers
  batch = padded_batch(slice_config().vocab_size, rows, seq)
  real = int(batch["attention_mask"].sum())
  out: dict[str, Any] = {"attention_impl": own, "rows": rows, "seq": seq,
                         "real_tokens": real, "pad_share": 1 - real / (rows * seq), "steps": {}}
  chunk = min(sz["logprob_chunk"], seq)
  for n in (layers, 2 * layers):
    cfg = slice_config(attention_impl=own, num_hidden_layers=n)
    timing = step_timing.time_train_step(cfg, mesh, batch=batch, steps=FLAGS.steps,
                                         logprob_chunk=chunk)
    out["steps"][str(n)] = {"median_s": timing.median_s, "step_s": timing.step_s,
                            "loss": timing.loss, "compile_s": timing.compile_s,
                            "flops": timing.flops, "flops_causal_attention":
                            roofline.train_flops(cfg, rows, seq, causal=True)}
    del timing
    gc.collect()
  t1, t2 = out["steps"][str(layers)], out["steps"][str(2 * layers)]
  per_layer = (t2["median_s"] - t1["median_s"]) / layers
  out["per_layer_s"] = per_layer
  out["rest_s"] = t1["median_s"] - layers * per_layer   # embedding, head, loss, optimizer
  out["per_layer_mfu"] = {}
  if per_layer > 0:
    for conv, key in (("full_attention", "flops"), ("causal_attention", "flops_causal_attention")):
      flops = (t2[key] - t1[key]) / layers
      out["per_layer_mfu"][conv] = {k: flops / per_layer / 1e9 / v for k, v in peaks.items()}
  # The head and the log-probs alone: the unembedding matmul, log-softmax and gather in
  # chunks, forward and backward, on random final hidden states.
  cfg = slice_config(attention_impl=own, num_hidden_layers=layers)
  model = qwen3.create_model(cfg, seed=0)
  graphdef, params = nnx.split(model)
  del model
  hidden = jax.random.normal(jax.random.PRNGKey(1), (rows, seq, cfg.hidden_size),
                             jnp.dtype(cfg.dtype))
  targets = jnp.asarray(batch["target_ids"])

  def head(p, h):
    return nnx.merge(graphdef, p).token_logprobs(h, targets, chunk=chunk).sum()
  head_grad = jax.jit(jax.value_and_grad(head, argnums=(0, 1)))
  out["head_logprobs_s"] = roofline._median_time(
      lambda: jax.block_until_ready(head_grad(params, hidden)), FLAGS.steps)
  # Dropped (not `del`: the timing lambda above closes over them) so the memory is freed.
  head_grad = hidden = None
  gc.collect()
  # The optimizer alone: the train step's AdamW update (with its clipping) of the L-layer
  # slice's parameters, state donated as in the step.
  tx = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-6, warmup_steps=0))
  holder = [params, tx.init(params)]
  grads = jax.tree.map(lambda x: jnp.full_like(x, 1e-3), params)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def update(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  def run_update():
    holder[0], holder[1] = update(holder[0], holder[1], grads)
    jax.block_until_ready(holder[0])
  out["optimizer_s"] = roofline._median_time(run_update, FLAGS.steps)
  holder = grads = params = None   # freed before the next part (the closures keep the names)
  jax.clear_caches()
  gc.collect()
  # Packed rows: the segment path of the 14B config's attention on this device.
  seg_cfg = slice_config(attention_impl=own, num_hidden_layers=layers, remat_policy="none")
  out["segment_isolation_rel_l2"] = segment_isolation_rel_l2(seg_cfg, seq)
  out["checks"] = [check_row(
      f"packed rows, {own}: hidden states of 3 packed sequences vs each alone, rel. L2",
      out["segment_isolation_rel_l2"], f"<= {TARGETS['segment_isolation_rel_l2_max']:g}",
      *check_segment_isolation(out["segment_isolation_rel_l2"])), check_row(
      "per-layer step cost, (2L step - L step) / L", per_layer, "> 0",
      (per_layer > 0) if on_accelerator() else None,
      f"L = {layers}; head + log-probs {out['head_logprobs_s']:.4g} s, optimizer "
      f"{out['optimizer_s']:.4g} s, rest of the L step {out['rest_s']:.4g} s; "
      f"{out['pad_share']:.0%} padding" + ("" if on_accelerator() else "; CPU: timing only"))]
  return out


def section_memory(ctx: dict[str, Any]) -> dict[str, Any]:
  del ctx
  import jax

  from experiments import plan_memory as pm
  from experiments.common import step_timing
  from rstar_jax.train import step as core

  sz = sizes()
  mesh = make_mesh()
  cfg = slice_config()
  seq = sz["train_seqs"][0]
  rows = core.batch_multiple(1, mesh)
  case = pm.PlanCase(preset="tiny" if FLAGS.tiny else "qwen3-14b",
                     num_hidden_layers=None if FLAGS.tiny else FLAGS.layers,
                     mesh=(("fsdp", mesh.devices.size),), seq_len=seq, micro_batch=1,
                     micro_batches=1, remat_policy=cfg.remat_policy,
                     attention_impl=cfg.attention_impl, attention_chunk=cfg.attention_chunk,
                     param_dtype=cfg.param_dtype, dtype=cfg.dtype,
                     logprob_chunk=sz["logprob_chunk"], compute_entropy=True)
  assert case.model_config() == cfg, (case.model_config(), cfg)
  out: dict[str, Any] = {"case": {k: v for k, v in vars(case).items()}}
  # The plan for this device (its own compiler) and the one a CPU host makes.
  plans = {}
  for name, devices, options in (("this_device", jax.devices(), None),
                                 ("cpu_host", jax.devices("cpu"), pm.FAST_COMPILE_OPTIONS)):
    try:
      est = pm.plan(case, devices=devices, compiler_options=options)
      plans[name] = {"peak_bytes": est.peak_bytes, "temp_bytes": est.temp_bytes,
                     "argument_bytes": est.argument_bytes, "state_bytes": est.state_bytes,
                     "compile_s": est.compile_seconds}
    except Exception as e:
      plans[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
  out["plans"] = plans
  batch = step_timing.random_batch(cfg.vocab_size, rows, seq, row_multiple=rows,
                                   length_multiple=64 if not FLAGS.tiny else 8)
  timing = step_timing.time_train_step(cfg, mesh, batch=batch, steps=1,
                                       logprob_chunk=sz["logprob_chunk"])
  measured = device_peak_bytes()
  out.update(measured_peak_bytes=measured, step_s=timing.median_s)
  for name in ("this_device", "cpu_host"):
    planned = plans[name].get("peak_bytes")
    out[f"measured_over_plan_{name}"] = measured / planned if measured and planned else None
  # The check: the measured peak against the CPU host's plan, the one the 14B memory
  # figures come from (experiments/plan_memory.py on fake CPU devices). The plan for this
  # device is reported beside it, not checked: it is the compiled program's own memory
  # analysis, which the allocator's peak matches by construction (1.0000002 on the H100).
  cpu = plans["cpu_host"]
  met, detail = check_memory_vs_plan(measured, cpu.get("peak_bytes"), cpu.get("error", ""))
  tol = TARGETS["memory_plan_rel_max"]
  out["checks"] = [check_row("measured peak / CPU-host AOT plan",
                             out["measured_over_plan_cpu_host"],
                             f"within {1 - tol:.2f}..{1 + tol:.2f}", met, detail)]
  return out
