"""The rStar2-Agent chat protocol (rstar_jax.rollout.chat) as a Hugging Face chat template.

A Hugging Face export carries it in its tokenizer_config.json, so that
`apply_chat_template` on the export renders what the protocol renders; the rollout itself
never renders through it.
"""
from __future__ import annotations

import json

from rstar_jax.model import tokenizer as tokenizer_lib
from rstar_jax.rollout import chat


def _jinja_str(text: str) -> str:
  """`text` as a Jinja string literal (JSON escapes are Jinja's; non-ASCII kept as is)."""
  return json.dumps(text, ensure_ascii=False)


def hf_chat_template(config: chat.ChatConfig) -> str:
  """A Jinja chat template that renders what this protocol renders, for HF exports.

  `AutoTokenizer.from_pretrained(export).apply_chat_template(messages, tokenize=False,
  add_generation_prompt=True)` then equals `chat.prompt_text(problem, config)` for
  `[{"role": "user", "content": problem}]`, and a whole SFT conversation renders to the
  text of `chat.ChatProtocol.render_conversation(messages)`: the texts of `config` (system
  prompt, tools section with the JSON schema, user template, `reason_open` after the
  generation prompt, re-opened after tool turns if `reopen_reason`) are baked in.

  Messages are as `render_conversation` takes them: an optional `system` message
  (replaces the system prompt; the tools section stays), one `user` message (the
  problem), then assistant turns; an assistant turn that calls tools (`tool_calls`:
  [{"name", "arguments"}] or OpenAI's {"type": "function", "function": {...}}, or
  calls written in its content) is followed by one `tool` message per call, all merged
  into one user turn of `<tool_response>` blocks, as the rollout does. The `tools`
  argument of `apply_chat_template` is ignored: the protocol has one fixed tool, from
  `config.tool_schema`. Arguments given as a JSON string are inserted verbatim (our
  renderer re-serialises them), so pass them as objects for byte-equal text.

  Structures the protocol cannot render (a second user message, a tool message without
  a pending call, more calls than `max_parallel_calls`, messages after the final answer,
  a generation prompt after the final answer) raise a TemplateError naming the problem.
  """
  user_prefix, user_suffix = config.user_template.split("{problem}")
  schema = json.dumps(dict(config.tool_schema), ensure_ascii=False)
  values = {
      "im_start": tokenizer_lib.IM_START, "im_end": tokenizer_lib.IM_END,
      "call_open": tokenizer_lib.TOOL_CALL_START, "call_close": tokenizer_lib.TOOL_CALL_END,
      "response_open": tokenizer_lib.TOOL_RESPONSE_START,
      "response_close": tokenizer_lib.TOOL_RESPONSE_END,
      "system_prompt": config.system_prompt,
      "tools_section": f"{config.tools_header}\n{schema}{config.tools_footer}",
      "user_prefix": user_prefix, "user_suffix": user_suffix,
      "reason_first": config.reason_open,
      "reason_again": config.reason_open if config.reopen_reason else "",
  }
  header = "".join(f"{{%- set {k} = {_jinja_str(v)} -%}}\n" for k, v in values.items())
  header += (f"{{%- set max_calls = {int(config.max_parallel_calls)} -%}}\n"
             f"{{%- set stop_at_call = {'true' if config.stop_at_tool_call else 'false'} -%}}\n")
  # Every output is an expression and every tag trims whitespace, so the template's own
  # layout (and transformers' trim_blocks / lstrip_blocks) adds no characters.
  body = r'''
{%- set ns = namespace(users=0, assistants=0, pending=0, done=false, text="") -%}
{%- set start = 0 -%}
{%- if messages and messages[0].role == "system" -%}
  {%- set system_prompt = messages[0].content if messages[0].content is string else "" -%}
  {%- set start = 1 -%}
{%- endif -%}
{{- im_start + "system\n" + system_prompt + tools_section + im_end + "\n" -}}
{%- for message in messages[start:] -%}
  {%- if message.content is defined and message.content is not none and message.content is not string -%}
    {{- raise_exception("message " ~ (loop.index0 + start) ~ ": content must be a string") -}}
  {%- endif -%}
  {%- set content = message.content if message.content is string else "" -%}
  {%- if ns.done -%}
    {{- raise_exception("message " ~ (loop.index0 + start) ~ " follows an assistant turn without a tool call, which must be the last message") -}}
  {%- endif -%}
  {%- if message.role == "user" -%}
    {%- if ns.users > 0 -%}
      {{- raise_exception("message " ~ (loop.index0 + start) ~ ": the protocol has one user message (the problem); tool results go in 'tool' messages") -}}
    {%- endif -%}
    {%- set ns.users = 1 -%}
    {{- im_start + "user\n" + user_prefix + content + user_suffix + im_end + "\n" -}}
  {%- elif message.role == "assistant" -%}
    {%- if ns.users == 0 -%}
      {{- raise_exception("message " ~ (loop.index0 + start) ~ ": an assistant message before the user message") -}}
    {%- endif -%}
    {%- if ns.pending > 0 -%}
      {{- raise_exception("message " ~ (loop.index0 + start) ~ ": " ~ ns.pending ~ " tool call(s) of the previous assistant message have no tool message") -}}
    {%- endif -%}
    {%- set ns.text = content -%}
    {%- for call in message.tool_calls or [] -%}
      {%- set fn = call.function if call.function is defined else call -%}
      {%- set args = fn.arguments if fn.arguments is defined and fn.arguments is not none else {} -%}
      {%- if args is string -%}
        {%- set ns.text = ns.text + "\n" + call_open + "\n{\"name\": " + (fn.name | tojson) + ", \"arguments\": " + args + "}\n" + call_close -%}
      {%- else -%}
        {%- set ns.text = ns.text + "\n" + call_open + "\n" + ({"name": fn.name, "arguments": args} | tojson) + "\n" + call_close -%}
      {%- endif -%}
    {%- endfor -%}
    {%- set calls = ns.text.count(call_open) -%}
    {%- if calls > max_calls -%}
      {{- raise_exception("message " ~ (loop.index0 + start) ~ " has " ~ calls ~ " tool calls but max_parallel_calls=" ~ max_calls) -}}
    {%- endif -%}
    {%- if calls > 0 and stop_at_call and not ns.text.endswith(call_close) -%}
      {{- raise_exception("message " ~ (loop.index0 + start) ~ " has text after " ~ call_close ~ ", which the rollout never generates with stop_at_tool_call=True") -}}
    {%- endif -%}
    {{- im_start + "assistant\n" + (reason_first if ns.assistants == 0 else reason_again) + ns.text + im_end -}}
    {%- set ns.assistants = ns.assistants + 1 -%}
    {%- set ns.pending = calls -%}
    {%- set ns.done = calls == 0 -%}
  {%- elif message.role == "tool" -%}
    {%- if ns.pending == 0 -%}
      {{- raise_exception("message " ~ (loop.index0 + start) ~ ": a tool message without a pending tool call") -}}
    {%- endif -%}
    {%- if loop.previtem is defined and loop.previtem.role == "assistant" -%}
      {{- "\n" + im_start + "user" -}}
    {%- endif -%}
    {{- "\n" + response_open + "\n" + content + "\n" + response_close -}}
    {%- set ns.pending = ns.pending - 1 -%}
    {%- if ns.pending == 0 -%}
      {{- im_end + "\n" -}}
    {%- endif -%}
  {%- else -%}
    {{- raise_exception("message " ~ (loop.index0 + start) ~ ": unknown role " ~ message.role) -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt is defined and add_generation_prompt -%}
  {%- if ns.done -%}
    {{- raise_exception("add_generation_prompt after the final assistant answer: the protocol has no further turn") -}}
  {%- endif -%}
  {%- if ns.pending > 0 -%}
    {{- raise_exception(ns.pending ~ " tool call(s) of the last assistant message have no tool message") -}}
  {%- endif -%}
  {{- im_start + "assistant\n" + (reason_first if ns.assistants == 0 else reason_again) -}}
{%- endif -%}
'''
  return header + body.lstrip("\n")
