"""The HF export's chat template renders exactly what our chat protocol renders.

A tiny model is exported with `save_hf(..., tokenizer_dir=..., chat_template=
chat_template.hf_chat_template(config))` and loaded back with transformers' AutoTokenizer; its
`apply_chat_template` text must equal `ChatProtocol`'s prompt / conversation text.
"""
import json
import os

from flax import nnx
import jax
import numpy as np
import pytest

from rstar_jax.data import toy_task
from rstar_jax.model import hf_io, qwen3
from rstar_jax.model import tokenizer as tokenizer_lib
from rstar_jax.model.model_config import Qwen3Config
from rstar_jax.rollout import chat, chat_template

transformers = pytest.importorskip("transformers")

PROBLEM = "What is 123 * 456 + 7?"
TRICKY = chat.ChatConfig(
    # Jinja syntax, quotes, backslashes, newlines, non-ASCII and an emoji in every baked text.
    system_prompt='Be {{ careful }} {% raw %} {# no comment #} "quoted" \\boxed{} \u00e9 \U0001F600',
    tools_header="\n<tools>\t{%- endraw -%}",
    tools_footer="\n</tools> }} %}",
    tool_schema=chat.python_tool_schema("run_py", description='Runs "code" {{x}} \u00fc'),
    user_template="Problem \u2192 {problem}\n-- answer in \\boxed{} {{ }}",
    reason_open="<reason>",
    reopen_reason=False,
    stop_at_tool_call=False,
    max_parallel_calls=2,
)
CONFIGS = {"release": chat.ChatConfig(), "toy": toy_task.toy_chat_config(), "tricky": TRICKY}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
  tok = toy_task.train_toy_tokenizer(512, n=150, seed=0)
  path = str(tmp_path_factory.mktemp("tokenizer"))
  tok.save(path)
  return path


@pytest.fixture(scope="module")
def model():
  # Zero weights from the abstract model: the template test needs a model to export, not
  # its values, and this skips create_model's initialisation compile (~10 s on CPU).
  cfg = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=8)
  graphdef, abstract = nnx.split(qwen3.abstract_model(cfg))
  return nnx.merge(graphdef, jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), abstract))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def exported(request, tmp_path_factory, model, tokenizer_dir):
  """(config, our protocol, AutoTokenizer of the export) for each chat config."""
  config = CONFIGS[request.param]
  out = str(tmp_path_factory.mktemp(f"export_{request.param}"))
  hf_io.save_hf(model, out, dtype="float32", tokenizer_dir=tokenizer_dir,
                chat_template=chat_template.hf_chat_template(config))
  with open(os.path.join(out, "tokenizer_config.json"), encoding="utf-8") as f:
    assert json.load(f)["chat_template"] == chat_template.hf_chat_template(config)
  hf_tok = transformers.AutoTokenizer.from_pretrained(out)
  proto = chat.ChatProtocol(tokenizer_lib.Tokenizer.from_dir(tokenizer_dir), config)
  return config, proto, hf_tok


def _render(hf_tok, messages, add_generation_prompt):
  return hf_tok.apply_chat_template(messages, tokenize=False,
                                    add_generation_prompt=add_generation_prompt)


def _conversation(config, *, system=None):
  """user, a structured call, its tool response, a call written in the content, its
  response, the final answer (the SFT message layout of sft_examples / toy_task)."""
  name = config.tool_name
  first_response = chat.render_executor_result(
      {"status": "ok", "stdout": "56088\n", "wall_time": 0.02}, config)
  second_response = chat.render_executor_result(
      {"status": "error", "error": "NameError at line 1: name 'x' is not defined\nprint(x)"},
      config)
  messages = [{"role": "user", "content": PROBLEM},
              {"role": "assistant", "content": "Let me compute it. \u00e9",
               "tool_calls": [{"type": "function",
                               "function": {"name": name,
                                            "arguments": {"code": "print(123 * 456)"}}}]},
              {"role": "tool", "content": first_response},
              {"role": "assistant",
               "content": "Now add.\n<tool_call>\n" + json.dumps(
                   {"name": name, "arguments": {"code": "print(x + 7)"}}) + "\n</tool_call>"},
              {"role": "tool", "content": second_response},
              {"role": "assistant",
               "content": "So </reason> <answer> \\boxed{56095} </answer>"}]
  if system is not None:
    messages.insert(0, {"role": "system", "content": system})
  return messages


def test_generation_prompt_equals_our_prompt(exported):
  config, proto, hf_tok = exported
  text = _render(hf_tok, [{"role": "user", "content": PROBLEM}], True)
  assert text == chat.prompt_text(PROBLEM, config) == proto.prompt_text(PROBLEM)
  assert text == proto.tokenizer.decode(proto.prompt_ids(PROBLEM))
  assert text.endswith("<|im_start|>assistant\n" + config.reason_open)
  # Without the generation prompt: up to the user turn.
  assert _render(hf_tok, [{"role": "user", "content": PROBLEM}], False) == (
      chat.system_text(config) + chat.user_text(PROBLEM, config))


@pytest.mark.parametrize("system", [None, "Custom system prompt {{ not jinja }}."])
def test_conversation_equals_render_conversation(exported, system):
  config, proto, hf_tok = exported
  messages = _conversation(config, system=system)
  rendered = proto.render_conversation(messages)
  ours = proto.tokenizer.decode(rendered.ids)
  text = _render(hf_tok, messages, False)
  assert text == ours
  assert text.count("<tool_response>") == 2 and text.endswith("</answer><|im_end|>")
  # Same ids as well: the export's tokenizer encodes the template's text to our ids.
  assert hf_tok(text, add_special_tokens=False)["input_ids"] == rendered.ids
  # The rollout's state after the last tool turn (everything before the final answer's
  # model tokens) is what the template renders with the generation prompt.
  last_tool_token = max(i for i, m in enumerate(rendered.loss_mask) if m == 0)
  prefix = proto.tokenizer.decode(rendered.ids[:last_tool_token + 1])
  assert _render(hf_tok, messages[:-1], True) == prefix
  assert prefix.endswith("<|im_start|>assistant\n"
                         + (config.reason_open if config.reopen_reason else ""))


# Only the configs where the case exists (a skip per other config would count as a skip).
@pytest.mark.parametrize("exported", [k for k in sorted(CONFIGS)
                                      if CONFIGS[k].max_parallel_calls >= 2], indirect=True)
def test_parallel_calls_share_one_tool_turn(exported):
  config, proto, hf_tok = exported
  assert config.max_parallel_calls >= 2
  calls = [{"name": config.tool_name, "arguments": {"code": f"print({i})"}} for i in (1, 2)]
  messages = [{"role": "user", "content": PROBLEM},
              {"role": "assistant", "content": "Two at once.", "tool_calls": calls},
              {"role": "tool", "content": "one"}, {"role": "tool", "content": "two"},
              {"role": "assistant", "content": "Done \\boxed{3}"}]
  text = _render(hf_tok, messages, False)
  assert text == proto.tokenizer.decode(proto.render_conversation(messages).ids)
  assert text.count("<|im_start|>user") == 2 and text.count("<tool_response>") == 2
  assert _render(hf_tok, messages[:4], True) == proto.tokenizer.decode(
      proto.render_conversation(messages).ids[:-len(proto.tokenizer.encode("Done \\boxed{3}")) - 1])


@pytest.mark.parametrize("exported", [k for k in sorted(CONFIGS)
                                      if CONFIGS[k] == toy_task.toy_chat_config()],
                         indirect=True)
def test_toy_traces_render_identically(exported):
  config, proto, hf_tok = exported
  assert config == toy_task.toy_chat_config()   # toy traces use the toy chat config
  problems = toy_task.generate_problems(12, seed=3)
  for trace in toy_task.make_traces(problems, seed=4, chat_config=config):
    messages = [dict(m) for m in trace.messages]
    expected = proto.tokenizer.decode(proto.render_conversation(messages).ids)
    assert _render(hf_tok, messages, False) == expected
    assert expected == toy_task.conversation_text(messages, config)


@pytest.mark.parametrize("messages, match", [
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
      {"role": "user", "content": "c"}], "must be the last message"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "c"}], "one user message"),
    ([{"role": "user", "content": "a"}, {"role": "tool", "content": "c"}],
     "without a pending tool call"),
    ([{"role": "assistant", "content": "b"}], "before the user message"),
    ([{"role": "user", "content": ["parts"]}], "content must be a string"),
])
def test_structures_the_protocol_cannot_render_raise(exported, messages, match):
  _, proto, hf_tok = exported
  with pytest.raises(Exception, match=match):
    _render(hf_tok, messages, False)
  with pytest.raises(ValueError):  # our renderer refuses them too
    proto.render_conversation(messages)


def test_generation_prompt_after_a_pending_call_or_final_answer_raises(exported):
  config, _, hf_tok = exported
  messages = _conversation(config)
  with pytest.raises(Exception, match="have no tool message"):
    _render(hf_tok, messages[:2], True)
  with pytest.raises(Exception, match="after the final assistant answer"):
    _render(hf_tok, messages, True)


def test_save_hf_chat_template_needs_a_tokenizer(tmp_path, model, tokenizer_dir):
  with pytest.raises(ValueError, match="needs tokenizer_dir"):
    hf_io.save_hf(model, str(tmp_path / "a"), chat_template="{{ x }}")
  with pytest.raises(ValueError, match="non-empty string"):
    hf_io.save_hf(model, str(tmp_path / "b"), tokenizer_dir=tokenizer_dir, chat_template=" ")
  # Without a template the tokenizer is exported unchanged; a stale chat_template.jinja,
  # which transformers would prefer, is replaced by the tokenizer_config.json entry.
  out = tmp_path / "c"
  hf_io.save_hf(model, str(out), tokenizer_dir=tokenizer_dir)
  assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
  (out / "chat_template.jinja").write_text("stale")
  hf_io.save_hf(model, str(out), tokenizer_dir=tokenizer_dir, chat_template="{{ 'new' }}")
  assert not (out / "chat_template.jinja").exists()
  hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
  assert hf_tok.apply_chat_template([{"role": "user", "content": "a"}], tokenize=False) == "new"
