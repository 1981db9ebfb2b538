"""Tokenizer: a thin wrapper over the `tokenizers` library.

Loads a Hugging Face model directory's `tokenizer.json` (for example Qwen3's) or
trains a small byte-level BPE for the toy task, and exposes what the chat protocol
and the engines need: encode / decode (decode keeps special tokens by default, the
tool-call parser needs them), the ids of the protocol's special tokens, pad / eos ids
and the vocabulary size.

We wrap `tokenizers.Tokenizer` rather than `transformers`: it is the same Rust
tokenizer without the Python layers, and `save` writes a directory that
`transformers.AutoTokenizer` can also load.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

# The pieces of the Qwen chat / Hermes tool format. Control tokens are `special`
# (dropped by decode(skip_special_tokens=True)); the tag tokens are added tokens that
# are *not* special, as in Qwen's tokenizer.json, so skip_special_tokens keeps them.
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"

CONTROL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
TOOL_TAG_TOKENS = (TOOL_CALL_START, TOOL_CALL_END, TOOL_RESPONSE_START,
                   TOOL_RESPONSE_END, "<think>", "</think>")
# rStar2's reasoning / answer tags are plain text in Qwen3's vocabulary; in a
# toy tokenizer we make them single ids because they occur in every trace.
REASON_TAG_TOKENS = ("<reason>", "</reason>", "<answer>", "</answer>")

# Qwen2/Qwen3's pre-tokenizer split (from their tokenizer.json): digits one by one.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def number_chunk_pattern(digits: int) -> str:
  """Qwen's split with numbers cut into chunks of up to `digits` digits from the left
  (3: as GPT-4's cl100k does; 1: Qwen's own pattern). A tiny model copies a number far
  more reliably when each chunk is a rare token: with single digits, "the token after
  the previous 6" matches in many places."""
  if not isinstance(digits, int) or isinstance(digits, bool) or not 1 <= digits <= 9:
    raise ValueError(f"number chunk size must be an int in 1..9, got {digits!r}")
  if digits == 1:
    return QWEN_SPLIT_PATTERN
  return QWEN_SPLIT_PATTERN.replace(r"|\p{N}|", rf"|\p{{N}}{{1,{digits}}}|")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatTokenIds:
  """Ids of the tokens the chat / tool-call protocol is built from."""
  im_start: int
  im_end: int
  tool_call_start: int
  tool_call_end: int
  tool_response_start: int
  tool_response_end: int


_CHAT_TOKEN_FIELDS = {
    "im_start": IM_START,
    "im_end": IM_END,
    "tool_call_start": TOOL_CALL_START,
    "tool_call_end": TOOL_CALL_END,
    "tool_response_start": TOOL_RESPONSE_START,
    "tool_response_end": TOOL_RESPONSE_END,
}


def _token_content(value: Any) -> str | None:
  """tokenizer_config.json stores a token either as a string or as a dict."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, dict) and isinstance(value.get("content"), str):
    return value["content"]
  raise ValueError(f"cannot read a token from tokenizer_config.json value {value!r}")


class Verbatim(str):
  """Untrusted text (a problem, a tool's output) for `Tokenizer.encode_parts`: the
  special-token strings in it are encoded as text, never as the tokens."""


class Tokenizer:
  """A `tokenizers.Tokenizer` plus the ids the rollout and the trainer need.

  Args:
    tokenizer: the underlying Rust tokenizer.
    eos_token: the token that ends generation. Default: `<|im_end|>` if the
      vocabulary has it (a chat model ends its turn with it), else `<|endoftext|>`.
    pad_token: the padding token. Default: `<|endoftext|>` if present, else eos.
  """

  def __init__(self, tokenizer: tokenizers.Tokenizer, *, eos_token: str | None = None,
               pad_token: str | None = None):
    self._tok = tokenizer
    if eos_token is None:
      eos_token = next((t for t in (IM_END, ENDOFTEXT) if self.has_token(t)), None)
      if eos_token is None:
        raise ValueError(f"no eos_token given and the vocabulary has neither {IM_END!r} "
                         f"nor {ENDOFTEXT!r}")
    if pad_token is None:
      pad_token = ENDOFTEXT if self.has_token(ENDOFTEXT) else eos_token
    self.eos_token = eos_token
    self.pad_token = pad_token
    self.eos_id = self.token_id(eos_token)
    self.pad_id = self.token_id(pad_token)

  # --- loading / saving ---------------------------------------------------------

  @classmethod
  def from_file(cls, path: str, **kwargs) -> Tokenizer:
    """Loads a `tokenizer.json` file."""
    if not os.path.isfile(path):
      raise FileNotFoundError(f"tokenizer file not found: {path}")
    return cls(tokenizers.Tokenizer.from_file(path), **kwargs)

  @classmethod
  def from_dir(cls, model_dir: str) -> Tokenizer:
    """Loads a Hugging Face model directory: `tokenizer.json` plus, if present,
    `tokenizer_config.json` for the eos / pad tokens."""
    if not os.path.isdir(model_dir):   # said as such, not as a tokenizer format problem
      raise FileNotFoundError(f"{model_dir!r}: " + ("not a directory" if os.path.exists(model_dir)
                                                    else "no such directory"))
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
      raise FileNotFoundError(
          f"{model_dir!r} has no tokenizer.json (only the fast-tokenizer format is "
          "supported; convert a slow tokenizer with transformers first)")
    kwargs = {}
    config_path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(config_path):
      with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
      # A Base model's config names <|endoftext|> as eos; the chat protocol stops on
      # <|im_end|> through its own stop ids, so we keep the file's choice here.
      kwargs["eos_token"] = _token_content(config.get("eos_token"))
      kwargs["pad_token"] = _token_content(config.get("pad_token"))
    return cls.from_file(path, **kwargs)

  def save(self, model_dir: str, *, model_max_length: int = 32768,
           chat_template: str | None = None) -> None:
    """Writes `tokenizer.json` and a `tokenizer_config.json` that
    `transformers.AutoTokenizer.from_pretrained(model_dir)` loads."""
    os.makedirs(model_dir, exist_ok=True)
    self._tok.save(os.path.join(model_dir, "tokenizer.json"))
    added = {}
    for token_id, token in sorted(self._tok.get_added_tokens_decoder().items()):
      added[str(token_id)] = {
          "content": token.content, "lstrip": token.lstrip, "normalized": token.normalized,
          "rstrip": token.rstrip, "single_word": token.single_word, "special": token.special,
      }
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": self.eos_token,
        "pad_token": self.pad_token,
        "unk_token": None,
        "add_bos_token": False,
        # transformers would otherwise rewrite " ." to "." etc. on decode.
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": model_max_length,
    }
    if chat_template is not None:
      config["chat_template"] = chat_template
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
      json.dump(config, f, indent=2, ensure_ascii=False)

  # --- ids ------------------------------------------------------------------------

  @property
  def backend(self) -> tokenizers.Tokenizer:
    return self._tok

  @property
  def vocab_size(self) -> int:
    """Number of ids including added tokens (a model's embedding table may be
    larger, e.g. Qwen3 pads 151669 to 151936)."""
    return self._tok.get_vocab_size(with_added_tokens=True)

  def has_token(self, token: str) -> bool:
    return self._tok.token_to_id(token) is not None

  def token_id(self, token: str) -> int:
    """The id of `token`; a clear error if the vocabulary lacks it."""
    token_id = self._tok.token_to_id(token)
    if token_id is None:
      raise ValueError(f"the tokenizer has no token {token!r}")
    return token_id

  def id_to_token(self, token_id: int) -> str | None:
    return self._tok.id_to_token(token_id)

  @property
  def special_ids(self) -> frozenset[int]:
    """Ids of the added tokens marked special (dropped by skip_special_tokens)."""
    return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

  def chat_token_ids(self) -> ChatTokenIds:
    """Ids of the chat protocol's tokens.

    Each must exist *and* encode to exactly that single id from text: a token that
    is in the BPE vocabulary but not registered as an added token would be split by
    the pre-tokenizer, and the protocol could not be parsed from generated ids.
    """
    missing, split, ids = [], [], {}
    for field, token in _CHAT_TOKEN_FIELDS.items():
      token_id = self._tok.token_to_id(token)
      if token_id is None:
        missing.append(token)
        continue
      if self.encode(token) != [token_id]:
        split.append(token)
      ids[field] = token_id
    if missing or split:
      problems = []
      if missing:
        problems.append(f"missing token(s) {', '.join(missing)}")
      if split:
        problems.append(f"token(s) {', '.join(split)} not encoded as one id (add them as "
                        "added tokens)")
      raise ValueError(f"tokenizer unusable for the chat protocol: {'; '.join(problems)}")
    return ChatTokenIds(**ids)

  # --- text <-> ids ------------------------------------------------------------

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`; adds no BOS/EOS (the chat protocol places every token)."""
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_parts(self, parts: Sequence[str]) -> list[int]:
    """Token ids of `"".join(parts)` in which every `Verbatim` part stays text.

    An added-token string inside a `Verbatim` part (`<|im_end|>` printed by a tool,
    `</tool_response>` in a problem) is encoded as the characters it is made of, so
    untrusted text cannot close a turn or forge a tool response; the other parts'
    added tokens are kept. When no added token touches a `Verbatim` part (the usual
    case) the ids are exactly `encode("".join(parts))`. Otherwise the text is cut
    around each such match: the match is encoded without added tokens, the rest as
    usual (so BPE merges never cross the cut).
    """
    text = "".join(parts)
    verbatim, start = [], 0
    for part in parts:
      if isinstance(part, Verbatim) and part:
        verbatim.append((start, start + len(part)))
      start += len(part)
    literals: list[tuple[int, int]] = []
    # Normally one cut suffices; added tokens with lstrip / rstrip could match anew
    # in a cut segment, so cut until nothing touches a Verbatim part.
    while True:
      ids, forged = self._encode_around(text, literals, verbatim)
      if not forged:
        return ids
      literals = sorted(literals + forged)

  def _encode_around(self, text, literals, verbatim):
    """Ids of `text` with the `literals` spans encoded without added tokens; and the
    spans of added tokens that still overlap a `verbatim` span."""
    ids, forged, pos = [], [], 0
    for lo, hi in literals + [(len(text), len(text))]:
      if pos < lo:
        enc = self._tok.encode(text[pos:lo], add_special_tokens=False)
        if not self._added_ids.isdisjoint(enc.ids):
          for token_id, (a, b) in zip(enc.ids, enc.offsets):
            if token_id not in self._added_ids:
              continue
            a, b = a + pos, b + pos
            # The token's own characters decide, not the whitespace an lstrip /
            # rstrip token takes in with them.
            content = self._added_content[token_id]
            c = text.find(content, a, b)
            c0, c1 = (c, c + len(content)) if c >= 0 else (a, b)
            if any(c0 < v1 and v0 < c1 for v0, v1 in verbatim):
              forged.append((a, b))
        ids += enc.ids
      if lo < hi:
        plain = self._plain.encode(text[lo:hi], add_special_tokens=False).ids
        if not self._added_ids.isdisjoint(plain):
          raise ValueError(f"this tokenizer cannot encode {text[lo:hi]!r} as text: its "
                           "vocabulary maps it back to an added token")
        ids += plain
      pos = max(pos, hi)
    return ids, forged

  @functools.cached_property
  def _added_content(self) -> dict[int, str]:
    return {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}

  @functools.cached_property
  def _added_ids(self) -> frozenset[int]:
    return frozenset(self._added_content)

  @functools.cached_property
  def _plain(self) -> tokenizers.Tokenizer:
    """The same tokenizer without its added tokens (they become plain text)."""
    spec = json.loads(self._tok.to_str())
    spec["added_tokens"] = []
    return tokenizers.Tokenizer.from_str(json.dumps(spec))

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
    """Text of `ids`. Special tokens are kept unless asked otherwise."""
    return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def __len__(self) -> int:
    return self.vocab_size

  def __repr__(self) -> str:
    return (f"Tokenizer(vocab_size={self.vocab_size}, eos={self.eos_token!r}, "
            f"pad={self.pad_token!r})")


def _byte_level_bpe(pattern: str) -> tokenizers.Tokenizer:
  tok = tokenizers.Tokenizer(models.BPE())
  # No normalizer (Qwen has NFC): we want text to round-trip byte for byte.
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
  ])
  tok.decoder = decoders.ByteLevel()
  return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int, *,
                    control_tokens: Sequence[str] = CONTROL_TOKENS,
                    added_tokens: Sequence[str] = TOOL_TAG_TOKENS + REASON_TAG_TOKENS,
                    min_frequency: int = 2,
                    pattern: str = QWEN_SPLIT_PATTERN) -> Tokenizer:
  """Trains a byte-level BPE shaped like Qwen's.

  Control tokens (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`) become special
  added tokens with the first ids; the tag tokens become non-special added tokens,
  as in Qwen's tokenizer.json. Every one encodes to a single id and any text
  round-trips exactly (byte-level, no normalizer).

  Args:
    texts: training corpus. Occurrences of the control / added tokens are cut out
      before BPE training so that no merge spans them.
    vocab_size: target size including the 256 byte symbols and the added tokens; the
      result is smaller when the corpus has fewer distinct merges.
    control_tokens: special tokens, placed at ids 0.. in this order.
    added_tokens: non-special single-id tokens, appended after training.
    min_frequency: minimum count for a merge.
    pattern: the pre-tokenizer split regex (default: Qwen's).
  """
  reserved = list(control_tokens) + list(added_tokens)
  if len(set(reserved)) != len(reserved):
    raise ValueError(f"duplicate tokens among control_tokens + added_tokens: {reserved}")
  floor = 256 + len(reserved)
  if vocab_size < floor:
    raise ValueError(f"vocab_size={vocab_size} is below the {floor} ids taken by the 256 "
                     f"byte symbols and {len(reserved)} added tokens")
  if min_frequency < 1:
    raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")
  splitter = re.compile("|".join(re.escape(t) for t in sorted(reserved, key=len, reverse=True)))

  def pieces():
    for text in texts:
      if not isinstance(text, str):
        raise TypeError(f"train_tokenizer expects strings, got {type(text).__name__}")
      yield from (p for p in splitter.split(text) if p)

  tok = _byte_level_bpe(pattern)
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size - len(added_tokens),
      min_frequency=min_frequency,
      special_tokens=list(control_tokens),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False,
  )
  tok.train_from_iterator(pieces(), trainer=trainer)
  tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False)
                  for t in added_tokens])
  eos = IM_END if IM_END in control_tokens else None
  pad = ENDOFTEXT if ENDOFTEXT in control_tokens else None
  return Tokenizer(tok, eos_token=eos, pad_token=pad)
