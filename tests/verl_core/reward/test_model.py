"""Reward model: a tiny Qwen2 sequence classifier scores packed batches like one sequence at a time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from verl_core.reward import ModelScorer, load_reward_scorer, reward_model_scores
from verl_core.reward.scorers import RewardBatch

TEXTS = [
    "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nAdd 12 and 30.<|im_end|>\n<|im_start|>assistant\n",
]
RESPONSES = ["2 + 3 = 5\n#### 5", "12 + 30 = 42, so the answer is\n#### 42", "no idea"]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    from verl_core.data.tokenizer import train_tokenizer

    path = tmp_path_factory.mktemp("rm")
    tok = train_tokenizer([*TEXTS, *RESPONSES] * 4, 300)
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_packed_scores_equal_per_sample_logits(rm_dir: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    model, tokenizer = load_reward_scorer(str(rm_dir), dtype="float32", device=torch.device("cpu"))
    texts = [p + r for p in TEXTS for r in RESPONSES]  # 6 ragged sequences
    # a 40-token budget splits the 6 sequences into several packed micro-batches
    got = reward_model_scores(model, tokenizer, texts, max_tokens_per_batch=40)
    reference = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    want = []
    with torch.no_grad():
        for t in texts:
            ids = torch.tensor([tokenizer(t, add_special_tokens=False)["input_ids"]])
            want.append(float(reference(input_ids=ids).logits[0, 0]))  # (1, 1): the last token's score
    assert len(set(round(w, 6) for w in want)) == len(want)  # distinct scores: not a constant head
    assert got == pytest.approx(want, abs=1e-5)


def test_model_scorer_scores_prompt_plus_response(rm_dir: Path) -> None:
    model, tokenizer = load_reward_scorer(str(rm_dir), dtype="float32", device=torch.device("cpu"))
    batch = RewardBatch(
        group_id=[0, 1], sample_index=[0, 0], data_source=["x", "x"], ground_truth=["5", "42"],
        prompt_text=TEXTS, response_text=RESPONSES[:2], response_length=[5, 9],
        finish_reason=["stop", "stop"], extra_info=[{}, {}],
    )  # fmt: skip
    out = ModelScorer(model, tokenizer, 4096)(batch)
    want = reward_model_scores(model, tokenizer, [TEXTS[0] + RESPONSES[0], TEXTS[1] + RESPONSES[1]],
                               max_tokens_per_batch=1)  # fmt: skip
    assert out.scores == pytest.approx(want, abs=1e-5) and out.errors == [None, None]
