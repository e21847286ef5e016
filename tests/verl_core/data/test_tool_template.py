"""The hermes (Qwen2.5) tool template, written out by hand, and the tool role of every built-in."""

from __future__ import annotations

import pytest

from verl_core.data.templates import BUILTIN_TEMPLATES, HERMES, render, turn_format
from verl_core.data.tokenize import ChatFormat, TextEncoder, tokenize_sft
from verl_core.data.tokenizer import train_tokenizer
from verl_core.rollout.multi_turn import ToolTurnRenderer

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Arithmetic",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "12*34?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*34"}}}
        ],
    },
    {"role": "tool", "content": "408"},
    {"role": "assistant", "content": "408"},
]


def test_hermes_renders_qwen25_tool_format() -> None:
    expected = (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "calculator", "description": "Arithmetic", '
        '"parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n12*34?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n408<|im_end|>\n"
    )
    assert render(HERMES, CONVERSATION, add_generation_prompt=False, tools=[CALC]) == expected
    # no tools: a plain chatml conversation (the system turn only when there is one)
    assert render(HERMES, CONVERSATION[1:2], add_generation_prompt=True) == (
        "<|im_start|>user\n12*34?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert turn_format(HERMES) == ("<|im_end|>", "\n")


def test_consecutive_tool_results_share_one_user_turn() -> None:
    render_turn = ToolTurnRenderer(HERMES)
    assert render_turn(["1", "2"], turn_closed=False) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # the model sampled <|im_end|> itself: the tool turn starts after it
    assert render_turn(["1"], turn_closed=True) == (
        "\n<|im_start|>user\n<tool_response>\n1\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("chatml", "<|im_end|>\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"),
        (
            "llama3",
            "<|eot_id|><|start_header_id|>tool<|end_header_id|>\n\n408<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
        ("plain", "</s>408\n\n"),
    ],
)
def test_every_builtin_has_a_tool_role(name: str, expected: str) -> None:
    assert ToolTurnRenderer(BUILTIN_TEMPLATES[name], eos_token="</s>")(["408"], turn_closed=False) == expected


def test_chat_format_shows_its_tools_in_the_prompt() -> None:
    # template_pack renders RL prompts (and SFT prompts) with the multi-turn tools' schemas
    fmt = ChatFormat("hermes", HERMES, "", "", (2,), tools=(CALC,))
    text = fmt.render(CONVERSATION[1:2], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n") and '"name": "calculator"' in text
    assert text.endswith("<|im_start|>user\n12*34?<|im_end|>\n<|im_start|>assistant\n")
    no_tools = ChatFormat("hermes", HERMES, "", "", (2,))
    assert no_tools.render(CONVERSATION[1:2], add_generation_prompt=True).startswith("<|im_start|>user")


def test_multi_turn_sft_rows_train_model_turns_and_mask_tool_results() -> None:
    tok = train_tokenizer(["12*34 408 <tool_call> </tool_call> <tool_response> calculator"] * 5, 300)
    fmt = ChatFormat("hermes", HERMES, "", "<|endoftext|>", (tok.convert_tokens_to_ids("<|im_end|>"),))
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
    messages = [
        {"role": "user", "content": "12*34?"},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "408"},
    ]

    def run(max_response_length: int, truncation: str = "error") -> tuple[list[int], list[int], int]:
        out = tokenize_sft(
            TextEncoder(tok), fmt, [messages], ["408"],
            max_prompt_length=64, max_response_length=max_response_length, truncation=truncation, where="t",
        )  # fmt: skip
        assert out.loss_mask is not None
        return out.input_ids[0], out.loss_mask[0], out.prompt_lengths[0]

    ids, mask, p = run(128)
    # the whole conversation, rendered by the template, token for token
    assert tok.decode(ids) == render(
        HERMES, [*messages, {"role": "assistant", "content": "408"}], add_generation_prompt=False
    ).rstrip("\n")
    assert (
        tok.decode(ids[:p]) == "<|im_start|>user\n12*34?<|im_end|>\n<|im_start|>assistant\n"
    )  # prompt: the first user turn
    assert tok.decode([t for t, m in zip(ids, mask, strict=True) if m]) == call + "<|im_end|>408<|im_end|>"
    assert tok.decode([t for t, m in zip(ids[p:], mask[p:], strict=True) if not m]) == (
        "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # max_response_length bounds all turns together; the mask is cut with the ids
    cut, cut_mask, _ = run(len(ids) - p - 3, truncation="right")
    assert cut == ids[: len(cut)] and cut_mask == mask[: len(cut)]
