"""Qwen3 architecture config and the published presets.

The preset numbers are those of the published Hugging Face `config.json` files of
the Qwen3 dense models (Qwen/Qwen3-0.6B ... Qwen/Qwen3-14B; the -Base checkpoints
share the architecture). `tiny*` sizes exist for tests and CPU demos.
"""
from __future__ import annotations

import dataclasses
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "qkv_proj", "save_qkv_attn",
                  "save_dot_except_mlp")
# "dot_product_lengths": "dot_product" where every row of a training batch is one
# sequence plus right padding (RL batches): the rows' lengths, not a [B, T, S] mask, go
# to cuDNN (its padding-aware causal kernel); batches with packed rows keep the mask.
ATTENTION_IMPLS = ("xla", "chunked", "blockwise", "dot_product", "dot_product_lengths", "auto")
# How a decode step (one new token per row) attends over the KV cache: "dense" reads the
# first attend_len slots of every row (attention_impl's cached path); "pallas" reads each
# row's filled slots only (rstar_jax/model/decode_attention.py).
DECODE_ATTENTION_IMPLS = ("dense", "pallas")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3Config:
  """Architecture plus numerics of a Qwen3 decoder.

  Architecture fields mirror HF `Qwen3Config`; the rest (dtypes, remat,
  attention implementation, scan) are how we run it and do not change the function.
  """
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 40_960
  initializer_range: float = 0.02
  # How we run it.
  param_dtype: str = "float32"
  dtype: str = "float32"  # compute dtype of matmuls; norms and softmax stay fp32.
  remat_policy: str = "none"
  attention_impl: str = "blockwise"
  attention_chunk: int = 1024  # query-block length for attention_impl="chunked" / "blockwise".
  decode_attention_impl: str = "dense"  # DECODE_ATTENTION_IMPLS
  scan_layers: bool = True

  def __post_init__(self):
    positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim",
                "max_position_embeddings", "attention_chunk")
    for name in positive:
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"Qwen3Config.{name} must be a positive int, got {value!r}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
          f"Qwen3Config: num_attention_heads ({self.num_attention_heads}) must be a "
          f"multiple of num_key_value_heads ({self.num_key_value_heads}) for GQA")
    if self.head_dim % 2:
      raise ValueError(f"Qwen3Config.head_dim must be even for RoPE, got {self.head_dim}")
    for name in ("param_dtype", "dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"Qwen3Config.{name}={getattr(self, name)!r}; choose from {DTYPES}")
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(
          f"Qwen3Config.remat_policy={self.remat_policy!r}; choose from {REMAT_POLICIES}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(
          f"Qwen3Config.attention_impl={self.attention_impl!r}; choose from {ATTENTION_IMPLS}")
    if self.decode_attention_impl not in DECODE_ATTENTION_IMPLS:
      raise ValueError(
          f"Qwen3Config.decode_attention_impl={self.decode_attention_impl!r}; choose from "
          f"{DECODE_ATTENTION_IMPLS}")
    for name in ("rope_theta", "rms_norm_eps"):
      if not getattr(self, name) > 0:
        raise ValueError(f"Qwen3Config.{name} must be > 0, got {getattr(self, name)!r}")

  @property
  def num_params(self) -> int:
    h, i, l = self.hidden_size, self.intermediate_size, self.num_hidden_layers
    q = self.num_attention_heads * self.head_dim
    kv = self.num_key_value_heads * self.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h + 2 * self.head_dim
    embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
    return l * per_layer + embed + h

  def replace(self, **changes: Any) -> "Qwen3Config":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def _qwen3(**kw) -> Qwen3Config:
  base = dict(vocab_size=151_936, head_dim=128, num_key_value_heads=8,
              rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40_960)
  base.update(kw)
  return Qwen3Config(**base)


PRESETS: dict[str, Qwen3Config] = {
    "qwen3-0.6b": _qwen3(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                         num_attention_heads=16, tie_word_embeddings=True),
    "qwen3-1.7b": _qwen3(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                         num_attention_heads=16, tie_word_embeddings=True),
    "qwen3-4b": _qwen3(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                       num_attention_heads=32, tie_word_embeddings=True),
    "qwen3-8b": _qwen3(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, tie_word_embeddings=False),
    "qwen3-14b": _qwen3(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                        num_attention_heads=40, tie_word_embeddings=False),
    # Tiny sizes for tests and CPU demos (vocab is set by the tokenizer in use).
    "tiny": Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, max_position_embeddings=2048, rope_theta=10_000.0),
    "small": Qwen3Config(vocab_size=2048, hidden_size=256, intermediate_size=768,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         head_dim=32, max_position_embeddings=4096, rope_theta=10_000.0),
}


def get_preset(name: str, **overrides: Any) -> Qwen3Config:
  if name not in PRESETS:
    raise ValueError(f"Unknown model preset {name!r}; known presets: {sorted(PRESETS)}")
  return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]


# ---- config.model ------------------------------------------------------------------------
def _model_config_fields():
  fields = [("preset", str | None, dataclasses.field(default=None)),
            ("hf_dir", str | None, dataclasses.field(default=None))]
  for f in dataclasses.fields(Qwen3Config):
    fields.append((f.name, f.type + " | None" if isinstance(f.type, str) else f.type | None,
                   dataclasses.field(default=None)))
  return fields


def _model_config_post_init(self):
  if bool(self.preset) == bool(self.hf_dir):
    raise ValueError("ModelConfig: set exactly one of `preset` (one of "
                     f"{sorted(PRESETS)}) or `hf_dir` (a HF Qwen3 directory)")
  if self.preset and self.preset not in PRESETS:
    raise ValueError(f"ModelConfig.preset={self.preset!r}; known presets: {sorted(PRESETS)}")


ModelConfig = dataclasses.make_dataclass(
    "ModelConfig", _model_config_fields(), frozen=True, kw_only=True,
    namespace={"__post_init__": _model_config_post_init, "__module__": __name__,
               "__doc__": """`config.model`: where the weights come from, and Qwen3Config overrides.

  Exactly one of `preset` (a random init of a published or tiny architecture) or
  `hf_dir` (a Hugging Face checkpoint). Every Qwen3Config field is also a field here;
  None keeps the preset's / checkpoint's value. A checkpoint's architecture cannot
  be changed, only how it runs (dtypes, remat, attention)."""})

# Fields of a checkpoint that may differ from its config.json: how it runs, not what it is.
RUNTIME_FIELDS = ("param_dtype", "dtype", "remat_policy", "attention_impl", "attention_chunk",
                  "decode_attention_impl", "scan_layers")


def overrides_of(cfg) -> dict[str, Any]:
  """The Qwen3Config fields a ModelConfig sets (not None)."""
  return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(Qwen3Config)
          if getattr(cfg, f.name) is not None}
