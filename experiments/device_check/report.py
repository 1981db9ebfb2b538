"""The device check's report: OUT/device_check.json (written atomically, also while the
sections still run) and the markdown table of sections, targets and train-step runs."""
from __future__ import annotations

import json
import os
from typing import Any

from absl import flags

FLAGS = flags.FLAGS


def json_default(x):
  try:
    return float(x)
  except (TypeError, ValueError):
    return str(x)


def write_json(report: dict[str, Any], *, partial: bool) -> None:
  """Writes OUT/device_check.json atomically; `partial` marks a report still running."""
  path = os.path.join(FLAGS.out, "device_check.json")
  with open(path + ".tmp", "w") as f:
    json.dump(dict(report, partial=partial), f, indent=1, default=json_default)
  os.replace(path + ".tmp", path)


def fmt(v) -> str:
  if v is None:
    return "n/a"
  if isinstance(v, bool):
    return str(v)
  if isinstance(v, float):
    return f"{v:.4g}"
  return str(v)


def markdown(report: dict[str, Any]) -> str:
  """The report as a markdown table of sections and targets."""
  lines = [f"# Device check, {report['date']}",
           "", f"- device: {report.get('device')}; commit {report.get('commit')}; "
           f"{'--tiny (CPU sizes)' if report['tiny'] else 'full sizes'}; total "
           f"{report['total_s']:.0f} s", f"- command: `{report['command']}`", "",
           "| section | ok | seconds | error |", "|---|---|---|---|"]
  for name, r in report["sections"].items():
    err = (r.get("error") or "").splitlines()[0][:160] if not r["ok"] else ""
    lines.append(f"| {name} | {'yes' if r['ok'] else 'NO'} | {r.get('wall_s', 0):.0f} | "
                 f"{err.replace('|', '/')} |")
  lines += ["", "| section | check | value | target | met | note |", "|---|---|---|---|---|---|"]
  for c in report["checks"]:
    met = {True: "met", False: "MISSED", None: "n/a"}[c["met"]]
    lines.append(f"| {c['section']} | {c['name']} | {fmt(c['value'])} | {c['target']} | "
                 f"{met} | {c['note']} |")
  ts = report["sections"].get("train_step", {})
  if ts.get("runs"):
    lines += ["", "MFU: attention FLOPs in full (PaLM) / causal half (MaxText).", "",
              "| attention | seq | step ms | tokens/s | MFU (measured peak) | "
              "MFU (data sheet) | kernels |", "|---|---|---|---|---|---|---|"]
    for r in ts["runs"]:
      if r["ok"]:
        kernels = ", ".join(c for c in r["hlo_custom_calls"] if "cudnn" in c.lower()
                            or "triton" in c.lower()) or "-"
        both = r.get("mfu_both", {})
        mfu = {k: f"{fmt(r['mfu'].get(k))} / "
                  f"{fmt((both.get(k) or {}).get('causal_attention'))}"
               for k in ("measured", "data_sheet")}
        lines.append(f"| {r['attention_impl']} | {r['seq']} | {1e3 * r['median_s']:.1f} | "
                     f"{r['tokens_per_s']:,.0f} | {mfu['measured']} | "
                     f"{mfu['data_sheet']} | {kernels} |")
      else:
        lines.append(f"| {r['attention_impl']} | {r['seq']} | failed: "
                     f"{r['error'].splitlines()[0][:120]} | | | | |")
  parts = report["sections"].get("parts", {})
  if parts.get("ok"):
    steps = ", ".join(f"{n} layers {1e3 * v['median_s']:.1f} ms"
                      for n, v in parts["steps"].items())
    lines += ["", f"- parts ({parts['attention_impl']}, {parts['rows']} x {parts['seq']}, "
              f"{parts['pad_share']:.0%} padding, one process): {steps}; per layer "
              f"{1e3 * parts['per_layer_s']:.2f} ms; head + log-probs "
              f"{1e3 * parts['head_logprobs_s']:.2f} ms; optimizer "
              f"{1e3 * parts['optimizer_s']:.2f} ms"]
  return "\n".join(lines) + "\n"
