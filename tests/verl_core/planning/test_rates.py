"""Matmul rates at a model's own shapes: the interpolation, the seconds they price, and the cost
model's forwards and updates at them, worked out by hand on a tiny geometry."""

from __future__ import annotations

from dataclasses import replace

import pytest

from verl_core.planning.cost import Workload, checkpoint_bytes, checkpoint_disk_bytes, phase_features
from verl_core.planning.geometry import Geometry
from verl_core.planning.rates import (
    PASSES,
    ShapeRates,
    matmul_seconds,
    measure_shape_rates,
    measure_write_bandwidth,
    weight_shapes,
)

# h 8, 2 layers, 2 query heads and 1 KV head of 4, MLP 16, 32 rows, tied: per layer q 8·8, k and v
# 8·4, o 8·8, gate and up 8·16, down 16·8 (in·out 576); the head 8·32 = 256
TINY = Geometry("qwen2", 8, 2, 2, 1, 4, 16, 32)


def _flat(rate: float, tokens: tuple[int, ...] = (1, 1000)) -> ShapeRates:
    """Every shape and pass at ``rate`` FLOP/s."""
    return ShapeRates(tokens, {(s, p): (rate,) * len(tokens) for s in weight_shapes(TINY) for p in PASSES})


def test_weight_shapes_are_the_matmul_parameters() -> None:
    # Σ in·out·count = 2 layers · 576 + 256 = 1,408 = N
    assert sum(i * o * c for i, o, c in weight_shapes(TINY).values()) == TINY.matmul_params == 1_408


def test_rate_is_linear_in_log_tokens_between_anchors_and_held_at_the_ends() -> None:
    rates = ShapeRates((10, 1000), {("head", "fwd"): (1.0, 3.0)})
    assert rates.rate("head", "fwd", 100) == pytest.approx(2.0)  # log 100 halfway from log 10 to log 1000
    assert rates.rate("head", "fwd", 5) == 1.0 and rates.rate("head", "fwd", 5000) == 3.0
    assert ShapeRates.from_json(rates.to_json()) == rates


def test_matmul_seconds_by_hand() -> None:
    # 10 backbone tokens, 4 head tokens, rate 1: 2·1,152·10 + 2·256·4 = 23,040 + 2,048 = 25,088
    assert matmul_seconds(TINY, _flat(1.0), 10, 4, 1000, ("fwd",)) == 25_088
    # three passes, three times; a critic (no head tokens): the layers only
    assert matmul_seconds(TINY, _flat(1.0), 10, 4, 1000, PASSES) == 3 * 25_088
    assert matmul_seconds(TINY, _flat(1.0), 10, 0, 1000, ("fwd",)) == 23_040
    # the head runs in chunks: 100 head tokens in chunks of 10 take the rate at 10 tokens (1 FLOP/s),
    # not at 100 (2 FLOP/s halfway in log between 10 and 1000): 2·256·100 / 1
    slow_small = ShapeRates((10, 1000), {k: (1.0, 3.0) for k in _flat(1.0).rates})
    head_only = matmul_seconds(TINY, slow_small, 0, 100, 10, ("fwd",))
    assert head_only == pytest.approx(2 * 256 * 100 / 1.0)


def test_cost_features_at_flat_shape_rates_are_the_flop_features() -> None:
    # every shape at the plain rate: the forwards' and updates' seconds equal FLOPs / rate (the
    # attention is priced at the shapes' best rate, the same here), micro-batches or not
    w = Workload(
        samples=2, prompt_tokens=6.0, response_tokens=4.0, old_log_prob_samples=1, actor_steps=2,
        critic_steps=2, micro_batches=2, has_ref=True, n=2, share_prompts=True,
    )  # fmt: skip
    plain = phase_features(TINY, w, rate_flops=1e9)
    shaped = phase_features(TINY, w, rate_flops=1e9, shapes=_flat(1e9))
    for phase in ("old_log_prob", "ref", "values", "update_actor", "update_critic"):
        assert shaped[phase]["matmul_flop"] == pytest.approx(plain[phase]["matmul_flop"]), phase
    # LoRA: no weight gradients of the frozen weights, forward + input gradient: 2 of the 3 passes
    lora = replace(w, lora_rank=2)
    two = phase_features(TINY, lora, 1e9, shapes=_flat(1e9))["update_actor"]["matmul_flop"]
    assert two == pytest.approx(phase_features(TINY, lora, 1e9)["update_actor"]["matmul_flop"])


def test_checkpoint_save_at_a_write_bandwidth_counts_the_policy_file_twice() -> None:
    w = Workload(
        samples=2, prompt_tokens=6.0, response_tokens=4.0, old_log_prob_samples=1, actor_steps=2,
        critic_steps=0, micro_batches=1, has_ref=True,
    )  # fmt: skip
    # P = 2·608 + 256 + 8 = 1,480 parameters: policy 4P = 5,920 and moments 8P = 11,840 bytes, the
    # policy written once more (a temporary folder, then the store): 23,680 bytes to disk
    assert checkpoint_bytes(TINY, w) == 17_760 and checkpoint_disk_bytes(TINY, w) == 23_680
    f = phase_features(TINY, w, 1e9, write_bandwidth=1_000.0)
    assert f["checkpoint_save"]["save_byte"] == pytest.approx(23.68)


def test_measurements_run_on_a_tiny_geometry(tmp_path: object) -> None:
    rates = measure_shape_rates(TINY, (4, 16), seconds=0.001)
    assert set(rates.rates) == {(s, p) for s in weight_shapes(TINY) for p in PASSES}
    assert all(r > 0 for v in rates.rates.values() for r in v)
    assert measure_write_bandwidth(str(tmp_path), nbytes=1 << 20, chunk=1 << 18) > 0
