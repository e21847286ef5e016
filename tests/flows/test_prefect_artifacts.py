"""The pieces of the pipeline's Prefect artifacts that make them readable in Prefect's UI
(:mod:`flows.prefect_artifacts`); the UI itself renders them in tests/flows/test_prefect_ui_browser.py."""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

from flows.prefect_artifacts import image_markdown, in_run, markdown_cell, user_text
from verl_core.store import ArtifactStore


class ChatML:
    """A tokenizer's ``apply_chat_template`` for ChatML, as the quickstart's template renders it."""

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> str:
        turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return turns + "<|im_start|>assistant\n"


class NoTemplate:
    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> str:
        raise ValueError("no chat template")


def test_markdown_cell_keeps_text_as_written() -> None:
    cell = markdown_cell("2 + 2 = 4\n#### 4 | <think>*x*</think>")
    # one line (no heading can start one), every punctuation mark escaped, no raw '<' or '|'
    assert cell == r"2 \+ 2 \= 4 ↵ \#\#\#\# 4 \| \<think\>\*x\*\<\/think\>"
    # un-escaping gives the text back (CommonMark drops the backslash before punctuation)
    assert re.sub(r"\\(.)", r"\1", cell.replace(" ↵ ", "\n")) == "2 + 2 = 4\n#### 4 | <think>*x*</think>"


def test_user_text_is_the_user_message_without_the_template() -> None:
    question = "Take 9. Subtract 9.\nWhat is the final number?"
    prompt = ChatML().apply_chat_template([{"role": "user", "content": question}])
    assert user_text(ChatML(), prompt) == question
    # a prompt the single-user-message rendering does not frame (a system message) stays whole
    with_system = ChatML().apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]
    )
    assert user_text(ChatML(), with_system) == with_system
    assert user_text(NoTemplate(), "plain prompt") == "plain prompt"


def test_paths_are_shown_in_the_run_and_plots_inlined(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path / "runs"))  # the default store's name: runs/runs/{run_id} inside
    png = b"\x89PNG\r\n\x1a\n" + bytes(100)
    stage = store.open_stage("r1", "report")
    stage.write_bytes("plots/kl.png", png)
    m = store.read_manifest(stage.commit(summary={"plots": ["plots/kl.png"]}))
    uri = store.file_uri(m, "plots/kl.png")
    assert "/runs/runs/r1/" in uri  # the layout, unchanged
    assert in_run(store, "r1", uri).startswith("report/attempt-") and "runs/" not in in_run(store, "r1", uri)
    assert in_run(store, "r2", uri) == uri  # not a file of that run: the full URI
    shown = image_markdown(store, m, "plots/kl.png", "r1")
    data = re.search(r"!\[kl\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", shown)
    assert data is not None and base64.b64decode(data.group(1)) == png
    assert "file://" not in shown
