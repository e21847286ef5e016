"""Chat templates: the tokenizer's own, or a named built-in for tokenizers without one.

Templates are Jinja strings in the HF format (``messages``, ``add_generation_prompt``,
``bos_token``, ``eos_token``), rendered with a compiled-once sandboxed environment, so rendering
thousands of rows costs milliseconds, and the same string can be stored in the tokenizer's config
for the exported model.

    chatml  <|im_start|>user\\n{content}<|im_end|>\\n<|im_start|>assistant\\n{response}<|im_end|>\\n
    llama3  <|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\n{content}<|eot_id|>...
    plain   {content}\\n\\n{response}{eos}            (no special tokens besides the eos token)
    hermes  chatml with tools (Qwen2.5's tool format): the tool list in the system turn, assistant
            tool calls as <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, tool
            results as <tool_response>\\n...\\n</tool_response> inside one user turn

Every built-in renders a ``tool`` message (a tool's result): chatml and llama3 as a turn of role
``tool``, plain as its content, hermes as Qwen2.5 does. Render with ``tools=[openai schemas]`` to
show the model its tools (hermes; the others ignore ``tools``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any, NamedTuple

from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

PLAIN = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ message['content'] + '\\n\\n' }}{% endif %}"
    "{% endfor %}"
)

# Qwen2.5's template (tokenizer_config.json of Qwen/Qwen2.5-*-Instruct), without Qwen's default system
# prompt: hub templates cannot be downloaded here, so it is written out and tested in the repo.
HERMES = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' or (message['role'] == 'system' and not loop.first)"
    " or (message['role'] == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{\\"name\\": \\"\' + tool_call.name + \'\\", \\"arguments\\": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

BUILTIN_TEMPLATES: dict[str, str] = {"chatml": CHATML, "llama3": LLAMA3, "plain": PLAIN, "hermes": HERMES}

_SENTINEL = "\x00VERL_FLOW_RESPONSE\x00"


class TurnFormat(NamedTuple):
    """How a template closes the assistant's turn: ``end_text`` right after the response (e.g.
    ``"<|im_end|>"``) and what the template appends after it (e.g. ``"\\n"``)."""

    end_text: str
    trailer: str


def resolve_template(choice: str, tokenizer_template: str | None) -> tuple[str, str]:
    """``(name, jinja)`` of the template to use: ``choice`` is auto|chatml|llama3|plain|hermes; auto takes
    the tokenizer's own template and falls back to chatml."""
    if choice == "auto":
        if tokenizer_template:
            return "tokenizer", tokenizer_template
        return "chatml", CHATML
    try:
        return choice, BUILTIN_TEMPLATES[choice]
    except KeyError:
        valid = ", ".join(["auto", *BUILTIN_TEMPLATES])
        raise ValueError(f"unknown chat template {choice!r}; valid: {valid}") from None


@lru_cache(maxsize=16)
def _compile(template: str) -> Template:
    # As transformers compiles chat templates: trim/lstrip blocks, loop controls, raise_exception.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = _tojson  # as transformers: no HTML escaping, keys in the given order
    return env.from_string(template)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def render(
    template: str,
    messages: Sequence[Mapping[str, str]],
    *,
    add_generation_prompt: bool,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """The text of ``messages`` under ``template`` (HF chat-template variables)."""
    return _compile(template).render(
        messages=[dict(m) for m in messages],
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
        **extra,
    )


def turn_format(template: str, *, bos_token: str = "", eos_token: str = "") -> TurnFormat:
    """Find how ``template`` ends an assistant turn, by rendering a probe conversation.

    Checks that the rendered assistant turn continues the generation prompt exactly (the response
    directly follows ``render(prompt, add_generation_prompt=True)``); raises ValueError otherwise,
    since SFT loss masks rely on it."""
    probe = [{"role": "user", "content": "1 + 1?"}]
    head = render(template, probe, add_generation_prompt=True, bos_token=bos_token, eos_token=eos_token)
    full = render(
        template,
        [*probe, {"role": "assistant", "content": _SENTINEL}],
        add_generation_prompt=False,
        bos_token=bos_token,
        eos_token=eos_token,
    )
    if not full.startswith(head + _SENTINEL):
        raise ValueError(
            "the chat template does not render the assistant turn as a continuation of the "
            "generation prompt; choose data.chat_template=chatml|llama3|plain"
        )
    after = full[len(head) + len(_SENTINEL) :]
    return TurnFormat(end_text=after.rstrip("\n"), trailer=after[len(after.rstrip("\n")) :])
