"""Where the LM head runs in :func:`response_log_probs` (verl_core/training/ppo_kernels.py): without
autograd on the real response tokens only, with the same values as the padded ``(S, R)`` layout that
the differentiable pass keeps."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.verl_core.training.test_ppo import PROMPTS, RESPONSES, tiny_lm
from verl_core.models import packed
from verl_core.models.packed import PackedCausalLM
from verl_core.training.ppo_kernels import make_ppo_batch, response_log_probs


@pytest.mark.parametrize("share_prompts", [False, True])
def test_no_grad_pass_runs_the_head_on_real_tokens_with_the_same_values(
    monkeypatch: pytest.MonkeyPatch, share_prompts: bool
) -> None:
    rows: list[int] = []  # hidden-state rows given to the LM head, per call
    real = packed.chunked_log_probs

    def spy(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        rows.append(hidden.shape[0])
        return real(hidden, *args, **kwargs)

    monkeypatch.setattr(packed, "chunked_log_probs", spy)
    prompts = PROMPTS + PROMPTS[:1]  # a second sample of prompt 0: shared with share_prompts
    responses = [*RESPONSES, [5, 6]]
    model = PackedCausalLM(tiny_lm())
    batch = make_ppo_batch(prompts, responses, share_prompts=share_prompts)
    padded_lp, padded_ent = response_log_probs(model, batch, with_entropy=True)  # autograd on
    with torch.no_grad():
        lp, ent = response_log_probs(model, batch, with_entropy=True)
    # responses of 3, 1, 0, 4 and 2 tokens: the padded layout is 5 × 4 = 20 rows, 10 of them real
    assert rows == [20, 10]
    assert ent is not None and padded_ent is not None
    torch.testing.assert_close(lp, padded_lp.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, padded_ent.detach(), atol=1e-6, rtol=0)
    assert (lp[batch.response_mask == 0] == 0).all()  # 0 where masked, as before
