r"""Two runs of one config, compared bit for bit; and what moves a rollout's bits.

  python -m experiments.repro_check --workdir=/tmp/repro            # two short toy runs
  python -m experiments.repro_check --workdir=/tmp/repro_full --full --concurrent
                                                 # the README's main job, twice at once
  python -m experiments.repro_check --engine_table                  # the cause, per choice

Runs (default): the toy recipe twice, one after the other, from scratch in
<workdir>/run0 and <workdir>/run1, with the same command (the short-run settings:
`--config.sft.epochs=0.5 --config.stage1.num_steps=<--steps> --config.stage2.num_steps=0
--config.stage3.num_steps=0 --config.rl.checkpoint_every=2 --config.eval.after_sft=False
--config.eval.k=1 --config.data.toy.eval_problems=32`, plus `--extra` flags), then
compares: every file of each stage's HF export (bytes), every metrics row (every key
but wall-clock ones: `time/*`, `*_s`, `*per_s`), the evaluation reports (the same
keys) and the evaluation tables each run printed (its stdout, <workdir>/runN.log).
Prints a table, writes --out as JSON.

--full: the config as it is (the README's main job: only `--config.workdir` and
--extra flags, none of the shortening ones). --concurrent: both runs at once, so their
timing differs (which requests share the engine, when tool calls come back).
--reuse: compare two runs already in <workdir>/run0, run1 (started by hand with the
command this prints, logs to <workdir>/run0.log, run1.log).

--engine_table: the toy model (random weights) in a JaxEngine of the toy recipe's
shape, one target request compared bit for bit with itself run alone, under each
engine choice that can change with a run's timing (batch company, slot, the
neighbours' lengths, a cached prefix, several decode steps per call), with
EngineConfig.batch_invariant off and on. This is where run-to-run differences come
from (docs/guides/reproducibility.md).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import time

from absl import app
from absl import flags

from experiments.common import results_json

flags.DEFINE_string("workdir", "/tmp/rstar_repro", "runs go to <workdir>/run0, run1")
flags.DEFINE_string("config", "experiments/configs/toy.py", "the recipe config file")
flags.DEFINE_integer("steps", 6, "stage-1 RL steps per run")
flags.DEFINE_float("sft_epochs", 0.5, "SFT epochs per run")
flags.DEFINE_multi_string("extra", [], "more --config.* flags for both runs")
flags.DEFINE_boolean("engine_table", False, "print the engine table instead of running")
flags.DEFINE_boolean("reuse", False, "compare runs already in --workdir (no new runs)")
flags.DEFINE_boolean("full", False, "run the config untouched (the README's main job): no "
                     "shortening flags, only --config.workdir and --extra")
flags.DEFINE_boolean("concurrent", False, "start the two runs at once")
flags.DEFINE_string("out", "/tmp/repro_check.json", "where the result goes as JSON")
FLAGS = flags.FLAGS

_WALL_CLOCK = re.compile(r"(^time/|_s$|per_s$|seconds|elapsed|timestamp)")


# --- two runs -------------------------------------------------------------------------


def _command(workdir: str) -> list[str]:
  if FLAGS.full:
    return [sys.executable, "-m", "experiments.recipe", f"--config={FLAGS.config}",
            f"--config.workdir={workdir}", *FLAGS.extra]
  return [sys.executable, "-m", "experiments.recipe", f"--config={FLAGS.config}",
          f"--config.workdir={workdir}", f"--config.sft.epochs={FLAGS.sft_epochs}",
          f"--config.stage1.num_steps={FLAGS.steps}", "--config.stage2.num_steps=0",
          "--config.stage3.num_steps=0", "--config.rl.checkpoint_every=2",
          "--config.eval.after_sft=False", "--config.eval.k=1",
          "--config.data.toy.eval_problems=32", *FLAGS.extra]


def _strip(x):
  """x without its wall-clock entries (dict keys matching _WALL_CLOCK), recursively."""
  if isinstance(x, dict):
    return {k: _strip(v) for k, v in x.items() if not _WALL_CLOCK.search(str(k))}
  if isinstance(x, list):
    return [_strip(v) for v in x]
  return x


def _rows(path: str) -> list:
  with open(path) as f:
    return [_strip(json.loads(line)) for line in f if line.strip()]


def _digest_dir(path: str) -> str:
  h = hashlib.sha256()
  for root, dirs, files in sorted(os.walk(path)):
    dirs.sort()
    for name in sorted(files):
      p = os.path.join(root, name)
      h.update(os.path.relpath(p, path).encode())
      with open(p, "rb") as f:
        h.update(f.read())
  return h.hexdigest()[:16]


# An absl log line (stderr, in the same log as stdout): "I1127 06:39:53.841520 1405... ]".
_LOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ ")


def printed_tables(text: str) -> list[str]:
  """The evaluation tables a recipe run printed (EvalReport.to_table) and its
  "pass@1 after SFT ... -> final ..." line, from its log. stdout is block-buffered and
  shares the file with stderr's log lines, so those may fall inside a table: they are
  dropped first, and each table is then read by its shape (title, sampling line, rule,
  rows, rule; then an optional per-source block: header, rule, rows, rule)."""
  lines = [l.rstrip("\n") for l in text.splitlines() if not _LOG_LINE.match(l)]
  out, i = [], 0
  while i < len(lines):
    line = lines[i]
    if line.startswith("pass@1 after SFT "):
      out.append(line)
    if not (line.startswith("Evaluation") and i + 2 < len(lines)
            and lines[i + 2] and set(lines[i + 2]) == {"-"}):
      i += 1
      continue
    rule, j = lines[i + 2], i + 3
    while j < len(lines) and lines[j] != rule:
      j += 1
    j += 1                                       # past the closing rule
    if j + 1 < len(lines) and lines[j].startswith("source") and set(lines[j + 1]) == {"-"}:
      dashes, j = lines[j + 1], j + 2
      while j < len(lines) and lines[j] != dashes:
        j += 1
      j += 1
    out.append("\n".join(lines[i:j]))
    i = j
  return out


def _summary(workdir: str) -> dict[str, object]:
  """What a run produced that must not change between runs, by name."""
  out = {}
  if os.path.exists(workdir + ".log"):
    with open(workdir + ".log", errors="replace") as f:
      # Line by line, so a difference is reported by its line.
      out["stdout: evaluation tables"] = [t.splitlines() for t in printed_tables(f.read())]
  for stage in sorted(os.listdir(workdir)):
    d = os.path.join(workdir, stage)
    if os.path.isdir(os.path.join(d, "export")):
      out[f"{stage}/export sha256"] = _digest_dir(os.path.join(d, "export"))
    if os.path.isdir(d):
      for name in sorted(os.listdir(d)):
        if name.startswith("metrics_") and name.endswith(".jsonl"):
          out[f"{stage}/{name}"] = _rows(os.path.join(d, name))
  for name in sorted(os.listdir(workdir)):
    if name.startswith("eval_") and name.endswith(".json") and "made_with" not in name:
      with open(os.path.join(workdir, name)) as f:
        out[name] = _strip(json.load(f))
    if name.startswith("eval_") and name.endswith("_samples.jsonl"):   # every trajectory
      with open(os.path.join(workdir, name), "rb") as f:
        out[f"{name} sha256"] = hashlib.sha256(f.read()).hexdigest()[:16]
  return out


def _first_difference(a, b, where=""):
  """A short description of where a and b first differ (None: equal)."""
  if type(a) is not type(b):
    return f"{where}: {a!r} vs {b!r}"[:200]
  if isinstance(a, dict):
    for k in sorted(set(a) | set(b)):
      if k not in a or k not in b:
        return f"{where}/{k}: only in run {'1' if k not in a else '0'}"
      d = _first_difference(a[k], b[k], f"{where}/{k}")
      if d:
        return d
    return None
  if isinstance(a, list):
    if len(a) != len(b):
      return f"{where}: {len(a)} vs {len(b)} entries"
    for i, (x, y) in enumerate(zip(a, b)):
      d = _first_difference(x, y, f"{where}[{i}]")
      if d:
        return d
    return None
  return None if a == b else f"{where}: {a!r} vs {b!r}"[:200]


def _headline(s: dict) -> dict[str, str]:
  """A few figures of a run to print beside the verdict."""
  out = {}
  for stage in ("stage1", "stage2", "stage3"):
    rl = s.get(f"{stage}/metrics_rl.jsonl") or []
    if rl:
      out[f"{stage} last reward_mean"] = f"{rl[-1].get('rollout/reward_mean', float('nan')):.6f}"
      out[f"{stage} last train/loss"] = repr(rl[-1].get("train/loss"))
      if stage == "stage1":
        out["stage1 step-1 logp_diff_mean_abs"] = repr(rl[0].get("train/logp_diff_mean_abs"))
  if "stdout: evaluation tables" in s:      # equal and empty would prove nothing
    out["printed evaluation tables"] = str(len(s["stdout: evaluation tables"]))
  for k, v in s.items():
    if k.startswith("eval_") and isinstance(v, dict):
      for key in ("pass@1", "pass_at_1", "accuracy", "mean_reward"):
        if key in v:
          out[f"{k} {key}"] = repr(v[key])
  return out


def _wait(workdir: str, start: float, proc: subprocess.Popen, walls: list) -> None:
  if proc.wait():
    raise SystemExit(f"{workdir}: exit status {proc.returncode} (see {workdir}.log)")
  walls.append(time.perf_counter() - start)
  print(f"  {workdir}: {walls[-1] / 60:.1f} min", flush=True)


def two_runs() -> dict:
  runs = [os.path.join(FLAGS.workdir, f"run{i}") for i in range(2)]
  walls = []
  if not FLAGS.reuse:
    for w in runs:
      if os.path.exists(w):
        raise SystemExit(f"{w} exists: give another --workdir (or --reuse to compare it)")
    os.makedirs(FLAGS.workdir, exist_ok=True)
    procs = []
    for w in runs:
      cmd = _command(w)
      print("+", " ".join(cmd), f"> {w}.log 2>&1", flush=True)
      with open(w + ".log", "w") as log:
        procs.append((w, time.perf_counter(),
                      subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)))
      if not FLAGS.concurrent:
        _wait(*procs[-1], walls)
    if FLAGS.concurrent:
      for p in procs:
        _wait(*p, walls)
  a, b = (_summary(w) for w in runs)
  table = []
  for k in sorted(set(a) | set(b)):
    diff = _first_difference(a.get(k), b.get(k), k)
    table.append((k, diff is None, diff or ""))
  what = ("the config untouched" if FLAGS.full else
          f"stage 1: {FLAGS.steps} steps, SFT {FLAGS.sft_epochs} epochs")
  print(f"\nTwo runs of {FLAGS.config} ({what}{', at once' if FLAGS.concurrent else ''}), "
        f"compared without wall-clock fields:")
  for k, same, diff in table:
    print(f"  {'same' if same else 'DIFFERENT':<10} {k}" + (f"   first: {diff}" if diff else ""))
  ha, hb = _headline(a), _headline(b)
  for k in ha:
    print(f"  {k:<40} run0 {ha[k]:<24} run1 {hb.get(k)}")
  if walls:
    print("  wall time per run: " + ", ".join(f"{w / 60:.1f} min" for w in walls))
  identical = all(same for _, same, _ in table)
  print(f"\n{'IDENTICAL' if identical else 'NOT identical'}: {len(table)} items compared")
  return {"identical": identical, "items": [{"item": k, "same": s, "first_difference": d}
                                            for k, s, d in table],
          "headline": [ha, hb], "wall_s": walls, "command": _command("<workdir>/runN")}


# --- the engine table --------------------------------------------------------------------


def engine_table() -> dict:
  import numpy as np

  from rstar_jax.model import qwen3
  from rstar_jax.model.model_config import Qwen3Config
  from rstar_jax.rollout.jax_engine import EngineConfig, GenerationRequest, JaxEngine

  # experiments/configs/toy.py's model (vocab: its toy tokenizer's size), random weights.
  cfg = Qwen3Config(vocab_size=2048, hidden_size=128, intermediate_size=384,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=64, tie_word_embeddings=True, initializer_range=0.05)
  model = qwen3.create_model(cfg, seed=0)
  rng = np.random.RandomState(0)

  def req(rid, n, new, seed):
    return GenerationRequest(input_ids=rng.randint(0, cfg.vocab_size, n).tolist(),
                             max_new_tokens=new, seed=seed, temperature=1.0, request_id=rid)
  # A toy prompt is ~70 tokens; a short one (20) stays in the decode buckets below 128.
  targets = {"short (20 tokens)": req("target", 20, 40, 0),
             "toy-length (70 tokens)": req("target", 70, 40, 0)}
  others = [req(f"n{i}", int(rng.randint(10, 200)), 60, i + 1) for i in range(15)]
  peers = [req(f"p{i}", int(rng.randint(60, 90)), 30, 50 + i) for i in range(3)]
  fill = [req(f"f{i}", 5, 1, 100 + i) for i in range(5)]
  tool = list(range(10, 40))          # a tool response's tokens

  def bits(r):
    return r.output_ids, np.asarray(r.logprobs, np.float32)

  def pick(results):
    return bits(next(r for r in results if r.request_id == "target"))

  def run(ecfg, reqs, before=()):
    e = JaxEngine(model, ecfg)
    if before:
      e.generate_sync(list(before))
    return pick(e.generate_sync(list(reqs)))

  def next_turn(first, out, seed=7):
    return dataclasses.replace(first, input_ids=list(first.input_ids) + out.output_ids + tool,
                               seed=seed)

  def second_turns(ecfg, target, company):
    """The target's next turn on the engine that ran its first turn (its prefix cached),
    with `company` trajectories doing the same at the same moment."""
    e = JaxEngine(model, ecfg)
    firsts = [target] + company
    outs = e.generate_sync(firsts)
    return pick(e.generate_sync([next_turn(f, o) for f, o in zip(firsts, outs)]))

  rows, out = [], {}
  for invariant in (False, True):
    ecfg = EngineConfig(num_slots=16, max_len=384, batch_invariant=invariant)
    for tname, target in targets.items():
      alone = run(ecfg, [target])
      cases = {
          "in a batch of 15 others (10-200 tokens)": run(ecfg, [target] + others),
          "last of that batch (queued, another slot)": run(ecfg, others + [target]),
          "alone in another slot": run(ecfg, [target], before=fill),
          "4 decode steps per call": run(dataclasses.replace(ecfg, decode_steps=4),
                                         [target] + others),
      }
      for name, (ids, lp) in cases.items():
        rows.append((invariant, tname, name, ids, lp, alone))
      # Next turns: the reference is the next turn run alone on a fresh engine.
      e = JaxEngine(model, ecfg)
      nxt = next_turn(target, e.generate_sync([target])[0])
      ref = run(ecfg, [nxt])
      rows.append((invariant, tname, "next turn, prefix cached", *second_turns(ecfg, target, []),
                   ref))
      rows.append((invariant, tname, "next turn, cached, 3 peers' next turns too",
                   *second_turns(ecfg, target, peers), ref))
  print("\nOne request's tokens and log-probs versus the same request alone on a fresh "
        "engine (toy model, 16 slots x 384):")
  print(f"  {'invariant':<10}{'request':<24}{'case':<46}{'tokens':>7}{'log-prob bits':>14}"
        f"{'max |diff|':>11}")
  for invariant, tname, name, ids, lp, (ref_ids, ref) in rows:
    n = min(len(lp), len(ref))
    same_ids = ids == ref_ids
    same_bits = same_ids and np.array_equal(lp[:n].view(np.uint32), ref[:n].view(np.uint32))
    diff = float(np.abs(lp[:n] - ref[:n]).max()) if n else 0.0
    print(f"  {str(invariant):<10}{tname:<24}{name:<46}{'same' if same_ids else 'DIFF':>7}"
          f"{'same' if same_bits else 'DIFF':>14}{diff:>11.2e}")
    out.setdefault("on" if invariant else "off", {})[f"{tname}: {name}"] = {
        "same_tokens": same_ids, "same_bits": bool(same_bits), "max_abs_diff": diff}
  return out


def main(_):
  cpu = results_json.cpu_model()
  result = {"benchmark": "repro_check", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpu": cpu, "cpus": os.cpu_count()}
  print(f"{result['date']}, {cpu}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
  result["commit"] = results_json.commit()
  if FLAGS.engine_table:
    result["engine_table"] = engine_table()
  else:
    result["two_runs"] = two_runs()
  results_json.write(FLAGS.out, result)


if __name__ == "__main__":
  app.run(main)
