r"""python -m experiments.entropy --hf_dir /tmp/rstar_toy/stage3/export --trajectories /tmp/rstar_toy/eval_final_samples.jsonl --out /tmp/rstar_toy/entropy.json

Token-entropy analysis of a policy on stored trajectories (rstar_jax/analysis/entropy.py).

Scores every stored trajectory (prompt_ids, response_ids, response_mask: the recipe's
`eval_*_samples.jsonl`) with the HF export in --hf_dir, takes the top --top_q share of
model-written tokens by entropy, classifies each as "reflection" (within
--reflection_window tokens after a tool response) or "forking" (elsewhere), prints the
summary and the most frequent tokens per class, and writes all of it (plus the
per-token entropies with --save_entropies) as JSON to --out. The export's tokenizer.json,
when present, turns token ids into text.
"""
import json
import os
import sys
import time

from absl import app
from absl import flags

_HF_DIR = flags.DEFINE_string("hf_dir", None, "HF export of the policy (config.json + safetensors)")
_TRAJ = flags.DEFINE_string("trajectories", None, "JSONL with prompt_ids, response_ids, "
                            "response_mask per line (eval_*_samples.jsonl)")
_TOP_Q = flags.DEFINE_float("top_q", 0.2, "share of model tokens taken as high-entropy")
_WINDOW = flags.DEFINE_integer("reflection_window", 8,
                               "tokens after a tool response that count as reflection")
_OUT = flags.DEFINE_string("out", "", "JSON output (default: print only)")
_LIMIT = flags.DEFINE_integer("limit", 0, "first N trajectories only (0: all)")
_BATCH = flags.DEFINE_integer("batch_size", 8, "trajectories per forward pass")
_CHUNK = flags.DEFINE_integer("chunk", 256, "positions whose logits exist at once")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "entropy of p^(1/T) (sampling temperature)")
_DTYPE = flags.DEFINE_string("dtype", "float32", "compute and parameter dtype")
_ATTENTION = flags.DEFINE_string("attention_impl", "", "override the attention impl (e.g. "
                                 "chunked for long trajectories)")
_TOP_N = flags.DEFINE_integer("top_n", 30, "rows per token table")
_SAVE_ENT = flags.DEFINE_bool("save_entropies", False, "store per-token entropies in --out")


def main(argv):
  if len(argv) > 1:
    sys.exit(f"unexpected arguments {argv[1:]}")
  from rstar_jax.analysis import entropy
  if not _HF_DIR.value or not _TRAJ.value:
    sys.exit("--hf_dir and --trajectories are required\nusage: " + __doc__.strip().splitlines()[0])
  if not os.path.exists(os.path.join(_HF_DIR.value, "config.json")):
    sys.exit(f"--hf_dir {_HF_DIR.value}: no config.json (not a HF export)")
  if not 0 < _TOP_Q.value <= 1 or _WINDOW.value < 0:
    sys.exit(f"--top_q must be in (0, 1] and --reflection_window >= 0 (got {_TOP_Q.value}, "
             f"{_WINDOW.value})")
  if _BATCH.value < 1 or _CHUNK.value < 1 or _LIMIT.value < 0 or _TEMPERATURE.value <= 0:
    sys.exit(f"--batch_size and --chunk must be >= 1, --limit >= 0 and --temperature > 0 (got "
             f"{_BATCH.value}, {_CHUNK.value}, {_LIMIT.value}, {_TEMPERATURE.value})")
  from rstar_jax.model.model_config import DTYPES
  if _DTYPE.value not in DTYPES:
    sys.exit(f"--dtype={_DTYPE.value!r}: choose from {list(DTYPES)}")
  if _OUT.value:   # found out now, not after the scoring
    try:
      os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    except OSError as e:
      sys.exit(f"--out {_OUT.value}: cannot write there ({type(e).__name__}: {e.strerror or e})")
  try:
    trajs = entropy.load_trajectories(_TRAJ.value, limit=_LIMIT.value or None)
  except entropy.TrajectoryError as e:
    sys.exit(f"trajectory error: {e}")

  from rstar_jax.model import hf_io
  overrides = {"param_dtype": _DTYPE.value, "dtype": _DTYPE.value}
  if _ATTENTION.value:
    overrides["attention_impl"] = _ATTENTION.value
  model = hf_io.load_hf(_HF_DIR.value, **overrides)
  decode = None
  if os.path.exists(os.path.join(_HF_DIR.value, "tokenizer.json")):
    from rstar_jax.model import tokenizer as tokenizer_lib
    tok = tokenizer_lib.Tokenizer.from_dir(_HF_DIR.value)
    decode = lambda i: tok.decode([i])
  t0 = time.time()
  try:
    ents = entropy.token_entropies(model, trajs, batch_size=_BATCH.value, chunk=_CHUNK.value,
                                   temperature=_TEMPERATURE.value)
  except entropy.TrajectoryError as e:
    sys.exit(f"trajectory error ({_TRAJ.value}): {e}")
  seconds = time.time() - t0
  result = entropy.analyze(trajs, ents, top_q=_TOP_Q.value, window=_WINDOW.value,
                           decode=decode, top_n=_TOP_N.value)
  result["source"] = {"hf_dir": _HF_DIR.value, "trajectories": _TRAJ.value,
                      "temperature": _TEMPERATURE.value, "dtype": _DTYPE.value,
                      "score_seconds": round(seconds, 2)}
  if _SAVE_ENT.value:
    result["entropies"] = [{"uid": t.uid, "entropy": [round(float(x), 5) for x in e]}
                           for t, e in zip(trajs, ents)]
  print(entropy.format_report(result))
  print(f"scored {len(trajs)} trajectories in {seconds:.1f} s")
  if _OUT.value:   # its directory was made at the start
    with open(_OUT.value, "w") as f:
      json.dump(result, f, indent=2)
    print(f"written: {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
