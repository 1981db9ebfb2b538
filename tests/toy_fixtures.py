"""Tiny toy policies and stored trajectories, built in-process (nothing downloaded):
a random Qwen3 exported with `hf_io.save_hf` beside a toy tokenizer trained on the spot,
and toy traces with tool calls rendered through the chat protocol."""
from __future__ import annotations

import json
import os

import numpy as np

from rstar_jax.model import qwen3
from rstar_jax.model.model_config import Qwen3Config

CFG = Qwen3Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  initializer_range=0.5, rope_theta=10_000.0, tie_word_embeddings=False)


def random_model(cfg: Qwen3Config = CFG, seed: int = 0):
  """A Qwen3 with N(0, 0.3) weights, built without compiling an initialiser
  (qwen3.create_model jit-compiles one: ~10 s on a busy 2-core machine)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  graphdef, abstract = nnx.split(qwen3.abstract_model(cfg))
  rng = np.random.RandomState(seed)
  state = jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 0.3, a.shape).astype(a.dtype)),
                       abstract)
  return nnx.merge(graphdef, state)


def toy_export(root: str, seed: int = 0, vocab: int = 1800):
  """(hf_dir, model, tokenizer): a random tiny Qwen3 saved under root/hf with the toy
  tokenizer (root/tok) beside its weights, as the recipe exports a stage."""
  from rstar_jax.data import toy_task
  from rstar_jax.model import hf_io
  tok = toy_task.train_toy_tokenizer(vocab, n=300, seed=seed)
  tok_dir = os.path.join(root, "tok")
  tok.save(tok_dir)
  model = random_model(CFG.replace(vocab_size=len(tok)), seed=seed)
  hf_dir = os.path.join(root, "hf")
  hf_io.save_hf(model, hf_dir, dtype="float32", tokenizer_dir=tok_dir)
  return hf_dir, model, tok


def write_toy_samples(path: str, tok, n: int = 6, seed: int = 1) -> str:
  """n toy traces (half with a buggy first call, every one calling the tool) as rows of
  an `eval_*_samples.jsonl`: uid, prompt_ids, response_ids, response_mask."""
  from rstar_jax.data import toy_task
  from rstar_jax.rollout import chat
  proto = chat.ChatProtocol(tok, toy_task.toy_chat_config())
  problems = toy_task.generate_problems(n, seed=seed, levels=(1, 2))
  traces = toy_task.make_traces(problems, seed=seed + 1,
                                config=toy_task.TraceConfig(bug_share=0.5, no_tool_share=0.0))
  with open(path, "w") as f:
    for i, tr in enumerate(traces):
      r = toy_task.render_trace(proto, tr)
      f.write(json.dumps({"uid": f"p{i}#0", "prompt_ids": r.ids[:r.prompt_len],
                          "response_ids": r.ids[r.prompt_len:],
                          "response_mask": r.loss_mask[r.prompt_len:]}) + "\n")
  return path
