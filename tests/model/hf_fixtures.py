"""Tiny random Hugging Face Qwen3 checkpoints, built in-process (nothing downloaded)."""
from __future__ import annotations

import json
import os

import numpy as np


def tiny_hf_config(**kw):
  import transformers
  base = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=256, rope_parameters={"rope_type": "default",
                                                            "rope_theta": 10_000.0},
              tie_word_embeddings=False, rms_norm_eps=1e-6)
  base.update(kw)
  return transformers.Qwen3Config(**base)


def make_hf_model(tmp_dir: str, seed: int = 0, max_shard_size: str | None = None, **kw):
  """Saves a random HF Qwen3ForCausalLM to `tmp_dir`; returns the torch model."""
  import torch
  import transformers
  torch.manual_seed(seed)
  cfg = tiny_hf_config(**kw)
  model = transformers.Qwen3ForCausalLM(cfg).eval()
  # Norm weights init to 1; randomise them so parity tests exercise them.
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
  save_kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
  model.save_pretrained(tmp_dir, **save_kw)
  return model


def rewrite_config_transformers4(hf_dir: str) -> None:
  """Rewrites config.json in the transformers-4 spelling (rope_theta, torch_dtype)."""
  path = os.path.join(hf_dir, "config.json")
  with open(path) as f:
    d = json.load(f)
  rope = d.pop("rope_parameters", None) or {}
  d["rope_theta"] = rope.get("rope_theta", 10_000.0)
  d["torch_dtype"] = d.pop("dtype", "float32")
  with open(path, "w") as f:
    json.dump(d, f)


def torch_logits(model, tokens: np.ndarray, attention_mask: np.ndarray | None = None,
                 position_ids: np.ndarray | None = None) -> np.ndarray:
  import torch
  kw = {}
  if attention_mask is not None:
    kw["attention_mask"] = torch.tensor(attention_mask)
  if position_ids is not None:
    kw["position_ids"] = torch.tensor(position_ids)
  with torch.no_grad():
    return model(torch.tensor(tokens), **kw).logits.float().numpy()
