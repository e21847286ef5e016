"""Policy losses: PPO clip / clip-higher / dual clip and GSPO by hand, gradients, micro-batching."""

import math

import pytest
import torch

from verl_core.algorithms import (
    POLICY_LOSSES,
    PolicyLossOutput,
    agg_norm_for,
    get_policy_loss,
    pack_padded,
    pad_packed,
)

F64 = torch.float64

# Six tokens in two rows (T = 3); ε_low = 0.2, ε_high = 0.28, c = 3. Per token (ratio ρ, advantage A):
#   t1 ρ=1.5 A=+1: L1 = −1.5, L2 = −1·clip(1.5, 0.8, 1.28) = −1.28, max = −1.28, clipped
#   t2 ρ=0.5 A=+1: L1 = −0.5, L2 = −0.8,                       max = −0.5,  not clipped
#   t3 ρ=0.5 A=−1: L1 = 0.5,  L2 = 0.8,                        max = 0.8,   clipped; 0.8 < c·1 = 3
#   t4 ρ=4.0 A=−1: L1 = 4,    L2 = 1.28,                       max = 4 -> dual clip min(4, 3) = 3
#   t5 ρ=1.0 A=+2: L1 = L2 = −2,                               max = −2
#   t6 masked out (ρ=10, A=−5) contributes nothing.
RATIOS = [[1.5, 0.5, 0.5], [4.0, 1.0, 10.0]]
ADVANTAGES = torch.tensor([[1.0, 1.0, -1.0], [-1.0, 2.0, -5.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
OLD_LOG_PROB = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, -2.0]], dtype=F64)


def _log_prob() -> torch.Tensor:
    return (OLD_LOG_PROB + torch.tensor(RATIOS, dtype=F64).log()).requires_grad_(True)


def _vanilla(log_prob: torch.Tensor, mode: str, clip_ratio_c: float | None = 3.0) -> PolicyLossOutput:
    return get_policy_loss("vanilla")(
        log_prob=log_prob,
        old_log_prob=OLD_LOG_PROB,
        advantages=ADVANTAGES,
        response_mask=MASK,
        loss_agg_mode=mode,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=clip_ratio_c,
    )


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 0.004),  # (−1.28 − 0.5 + 0.8 + 3 − 2) / 5 = 0.02 / 5
        ("seq-mean-token-sum", 0.01),  # (−0.98 + 1.0) / 2
        ("seq-mean-token-mean", 0.0866667),  # (−0.98/3 + 1.0/2) / 2 = (−0.326667 + 0.5) / 2
        ("seq-mean-token-sum-norm", 0.0066667),  # 0.02 / 3
    ],
)
def test_vanilla_hand_example(mode: str, expected: float) -> None:
    loss, stats = _vanilla(_log_prob(), mode)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats.pg_clipfrac.item() == pytest.approx(2 / 5)  # t1, t3
    assert stats.pg_clipfrac_lower.item() == pytest.approx(1 / 5)  # t4
    # ppo_kl = mean(old − new) = −(ln 1.5 + ln 0.5 + ln 0.5 + ln 4 + ln 1) / 5 = −ln 1.5 / 5 = −0.081093
    assert stats.ppo_kl.item() == pytest.approx(-0.081093, abs=1e-6)


def test_vanilla_without_dual_clip() -> None:
    # t4 keeps L = 4: (−1.28 − 0.5 + 0.8 + 4 − 2) / 5 = 1.02 / 5 = 0.204
    loss, stats = _vanilla(_log_prob(), "token-mean", clip_ratio_c=None)
    assert loss.item() == pytest.approx(0.204)
    assert stats.pg_clipfrac_lower.item() == 0.0


def test_vanilla_gradient() -> None:
    # Only unclipped tokens carry gradient: dL/dlogp = −A·ρ, /5 tokens.
    # t2: −1·0.5/5 = −0.1; t5: −2·1/5 = −0.4; t1, t3 (clipped) and t4 (dual-clipped) are constants.
    log_prob = _log_prob()
    loss, _ = _vanilla(log_prob, "token-mean")
    loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.0, -0.1, 0.0], [0.0, -0.4, 0.0]], dtype=F64))


def test_vanilla_log_ratio_is_clamped() -> None:
    # log ρ = 50 is clamped to 20; with A = −1 and no dual clip the loss is e^20, finite.
    loss, _ = get_policy_loss("vanilla")(
        log_prob=torch.tensor([[50.0]], dtype=F64),
        old_log_prob=torch.tensor([[0.0]], dtype=F64),
        advantages=torch.tensor([[-1.0]], dtype=F64),
        response_mask=torch.tensor([[1]]),
        loss_agg_mode="token-mean",
        clip_ratio_c=None,
    )
    assert loss.item() == pytest.approx(math.exp(20.0))


def test_dual_clip_bound_must_exceed_one() -> None:
    with pytest.raises(ValueError, match=r"clip_ratio_c must be > 1\.0"):
        _vanilla(_log_prob(), "token-mean", clip_ratio_c=0.5)


def test_gspo_hand_example() -> None:
    # ε = 0.2 both sides.
    # row 0: log ratios ln 2, 0 -> s = exp(ln 2 / 2) = √2 = 1.414214, A = +1:
    #   L1 = −1.414214, L2 = −1.2 -> −1.2 on both tokens (clipped)
    # row 1: mask 1 1 0, log ratios ln 0.9, 0, (99 masked) -> s = √0.9 = 0.948683, A = −1:
    #   L1 = L2 = 0.948683 (inside the clip range)
    # seq-mean-token-mean: (−1.2 + 0.948683) / 2 = −0.125658
    old = torch.zeros(2, 3, dtype=F64)
    log_prob = torch.tensor([[math.log(2.0), 0.0, 0.0], [math.log(0.9), 0.0, 99.0]], dtype=F64)
    log_prob.requires_grad_(True)
    loss, stats = get_policy_loss("gspo")(
        log_prob=log_prob,
        old_log_prob=old,
        advantages=torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=F64),
        response_mask=torch.tensor([[1, 1, 0], [1, 1, 0]]),
        loss_agg_mode="seq-mean-token-mean",
    )
    assert loss.item() == pytest.approx(-0.125658, abs=1e-6)
    assert stats.pg_clipfrac.item() == pytest.approx(0.5)
    assert stats.pg_clipfrac_lower.item() == 0.0
    # ppo_kl = −(ln 2 + 0 + ln 0.9 + 0) / 4 = −(0.693147 − 0.105361) / 4 = −0.146947
    assert stats.ppo_kl.item() == pytest.approx(-0.146947, abs=1e-6)
    # Gradient: row 0 is clipped (0). Row 1 token t: −A·s / (2 tokens · 2 sequences) = 0.948683/4 = 0.237171.
    loss.backward()
    torch.testing.assert_close(
        log_prob.grad,
        torch.tensor([[0.0, 0.0, 0.0], [0.237171, 0.237171, 0.0]], dtype=F64),
        atol=1e-6,
        rtol=0,
    )


def test_gspo_equals_the_sequence_level_objective() -> None:
    # Unclipped (wide ε), seq-mean-token-mean GSPO is −(1/S) Σ_i A_i s_i(θ) in value and gradient
    # (Zheng et al. 2025, eq. 5 and 10), with s_i = exp(mean_t log ρ_it) written out directly here.
    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    old = torch.randn(3, 4, generator=gen, dtype=F64)
    log_prob = (old + 0.1 * torch.randn(3, 4, generator=gen, dtype=F64)).requires_grad_(True)
    seq_adv = torch.tensor([0.5, -1.0, 2.0], dtype=F64)
    loss, _ = get_policy_loss("gspo")(
        log_prob=log_prob,
        old_log_prob=old,
        advantages=seq_adv[:, None].expand(3, 4),
        response_mask=mask,
        loss_agg_mode="seq-mean-token-mean",
        clip_ratio_low=10.0,
        clip_ratio_high=10.0,
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    leaf = log_prob.detach().requires_grad_(True)
    lengths = mask.sum(-1)
    seq_ratio = torch.exp(((leaf - old) * mask).sum(-1) / lengths)
    reference = -(seq_adv * seq_ratio).mean()
    (ref_grad,) = torch.autograd.grad(reference, leaf)
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(grad, ref_grad)


@pytest.mark.parametrize("name", POLICY_LOSSES)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_policy_loss_micro_batches_sum_to_mini_batch(name: str, mode: str) -> None:
    gen = torch.Generator().manual_seed(1)
    lengths = torch.tensor([2, 6, 3, 5, 1, 4])
    mask = (torch.arange(6)[None, :] < lengths[:, None]).long()
    old = torch.randn(6, 6, generator=gen, dtype=F64)
    log_prob = (old + 0.3 * torch.randn(6, 6, generator=gen, dtype=F64)).requires_grad_(True)
    adv = torch.randn(6, 6, generator=gen, dtype=F64)
    fn = get_policy_loss(name)
    norm = agg_norm_for(mask, horizon=6)

    def run(rows: slice) -> torch.Tensor:
        t = int(lengths[rows].max())
        return fn(
            log_prob=log_prob[rows, :t],
            old_log_prob=old[rows, :t],
            advantages=adv[rows, :t],
            response_mask=mask[rows, :t],
            loss_agg_mode=mode,
            norm=norm,
        ).loss

    full = run(slice(0, 6))
    (full_grad,) = torch.autograd.grad(full, log_prob)
    micro = run(slice(0, 2)) + run(slice(2, 6))
    (micro_grad,) = torch.autograd.grad(micro, log_prob)
    torch.testing.assert_close(micro, full)
    torch.testing.assert_close(micro_grad, full_grad)
    assert full_grad.abs().sum() > 0


def test_policy_loss_on_packed_data_via_pad_packed() -> None:
    # Packed (N,) inputs, padded with pad_packed, give the same loss as the hand-built padded batch.
    packed = {name: pack_padded(t, MASK) for name, t in (("lp", _log_prob().detach()), ("old", OLD_LOG_PROB))}
    cu_seqlens = torch.tensor([0, 3, 5], dtype=torch.int32)
    log_prob = pad_packed(packed["lp"], cu_seqlens)
    old = pad_packed(packed["old"], cu_seqlens)
    adv = pad_packed(pack_padded(ADVANTAGES, MASK), cu_seqlens)
    loss, _ = get_policy_loss("vanilla")(
        log_prob=log_prob.values,
        old_log_prob=old.values,
        advantages=adv.values,
        response_mask=log_prob.mask,
        loss_agg_mode="token-mean",
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
    )
    assert loss.item() == pytest.approx(0.004)
