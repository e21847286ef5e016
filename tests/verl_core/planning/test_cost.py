"""The cost model: FLOP counts by hand, the fit recovering known coefficients, monotone predictions."""

from __future__ import annotations

from dataclasses import asdict, fields, replace

import pytest
import torch

from verl_core.config import load_config
from verl_core.planning.cost import (
    CPU_CALIBRATION,
    GPU_CALIBRATION,
    Calibration,
    Workload,
    checkpoint_bytes,
    fit_calibration,
    forward_flops,
    gpu_peak_flops,
    measure_cpu_copy_bandwidth,
    measure_cpu_matmul_rate,
    nnls,
    phase_features,
    predict,
    predict_seconds,
    stored_tokens,
    synced_bytes,
    train_factor,
    workload_of,
)
from verl_core.planning.geometry import Geometry

# h 8, 2 layers, 2 query heads and 1 key/value head of 4, MLP 16, 32 rows, tied. Per layer: q 8·8 = 64,
# k and v 8·4 = 32 each, o 8·8 = 64, MLP 3·8·16 = 384 → 576; N = 2·576 + the head 32·8 = 1,408;
# d = H·d_h = 8.
TINY = Geometry("qwen2", 8, 2, 2, 1, 4, 16, 32)


def _workload(**kw: object) -> Workload:
    base = Workload(
        samples=2, prompt_tokens=6.0, response_tokens=4.0, old_log_prob_samples=1, actor_steps=2,
        critic_steps=2, micro_batches=1, has_ref=True, n=2, share_prompts=True,
    )  # fmt: skip
    return replace(base, **kw)  # type: ignore[arg-type]


def test_forward_flops_by_hand() -> None:
    assert TINY.matmul_params == 1_408  # decoder layers 1,152 + the LM head 32·8 = 256
    # 2 sequences of 10 tokens, all through layers and head: 2·1152·20 = 46,080, 2·256·20 = 10,240;
    # attention 2·L·d·S·ℓ² = 2·2·8·2·100 = 6,400
    assert forward_flops(TINY, 20, 20, 2, 10) == 62_720
    # a critic: no LM head
    assert forward_flops(TINY, 20, 0, 2, 10) == 52_480


def test_phase_flops_count_each_model_and_pass() -> None:
    w = _workload()  # 1 prompt of 6 tokens × 2 samples of 4 response tokens, the prompt stored once
    f = phase_features(TINY, w, rate_flops=1.0, bandwidth=1.0)  # FLOP features are FLOPs, bytes bytes
    # layers on 6 + 2·4 = 14 tokens: 2·1152·14 = 32,256; head on 8 response tokens: 2·256·8 = 4,096;
    # attention 6,400 → 42,752
    full = 42_752
    assert stored_tokens(w, 2) == 14
    assert f["generation"]["gen_flop"] == full  # prefill once + decode = the same matmuls
    assert f["ref"]["matmul_flop"] == full
    # the old log-prob sample (the other's π_old is its own first forward): layers on 0.5·6 + 4 = 7
    # tokens, head on 4, attention of one sequence 3,200 → 16,128 + 2,048 + 3,200
    assert f["old_log_prob"]["matmul_flop"] == 21_376
    assert f["update_actor"]["matmul_flop"] == 3 * full  # forward + backward
    assert f["update_critic"]["matmul_flop"] == 3 * (32_256 + 6_400)  # no LM head
    # logits: 8 response positions × 32 rows per pass, 3 passes in training; AdamW: 2 steps × every
    # parameter's 4 bytes (fp32)
    assert f["ref"]["logit"] == 256
    assert f["update_actor"]["logit"] == 768
    assert f["update_actor"]["opt_param"] == 2 * 4 * TINY.n_params
    # weight passes: per layer 576 matrix weights + q/k/v biases 8 + 4 + 4 + two norms 2·8 = 608;
    # N = 2·608 + the embedding 256 + the final norm 8 = 1,480 parameters, 5,920 bytes; once per
    # forward phase, 3 per training micro-batch (forward read, backward read, gradient write)
    assert TINY.n_params == 1_480
    assert f["ref"]["weight_pass"] == f["old_log_prob"]["weight_pass"] == 5_920
    assert f["update_actor"]["weight_pass"] == 3 * 5_920
    # the critic: no LM head rows, a value head of h + 1 = 9 (the tied embedding stays for the input)
    assert f["update_critic"]["opt_param"] == 2 * 4 * (1_480 + 9)
    # the sync stages every state-dict tensor, the tied head under its own name too: (1,480 + 256)·4
    assert f["weight_sync"]["sync_byte"] == synced_bytes(TINY, w) == 6_944
    # a bandwidth twice as high halves every memory feature and no FLOP feature
    fast = phase_features(TINY, w, rate_flops=1.0, bandwidth=2.0)
    assert fast["update_actor"]["opt_param"] == f["update_actor"]["opt_param"] / 2
    assert fast["update_actor"]["matmul_flop"] == f["update_actor"]["matmul_flop"]
    # without sharing every sample stores its prompt: 2·(6 + 4) = 20 tokens
    assert stored_tokens(replace(w, share_prompts=False), 2) == 20
    # no reference, no critic: no such phases
    bare = phase_features(TINY, replace(w, has_ref=False, critic_steps=0), 1.0)
    assert {"ref", "values", "update_critic"}.isdisjoint(bare)


def test_checkpoint_features_split_fresh_pages_and_fixed_costs() -> None:
    w = _workload()  # PPO: a critic beside the policy, fp32
    # policy 1,480·4 + its moments 8·1,480 = 17,760; critic (1,480 + 9)·(4 + 8) = 17,868 → 35,628 B
    assert checkpoint_bytes(TINY, w) == 35_628
    f = phase_features(TINY, w, 1.0)
    save, load = f["checkpoint_save"], f["checkpoint_load"]
    assert save == {"save_byte": 35_628, "fresh_byte": 35_628, "save_call": 1.0}  # free memory unknown
    assert load == {"load_byte": 35_628, "load_call": 1.0}  # its own fixed cost: it builds the models
    # 10,000 B free: the rest of the page cache comes from reclaimed pages, none fresh below 0
    assert phase_features(TINY, w, 1.0, free_bytes=10_000)["checkpoint_save"]["fresh_byte"] == 10_000
    assert phase_features(TINY, w, 1.0, free_bytes=1e9)["checkpoint_save"]["fresh_byte"] == 35_628
    assert phase_features(TINY, w, 1.0, free_bytes=-5.0)["checkpoint_save"]["fresh_byte"] == 0.0


def test_fit_tells_fresh_pages_from_bytes_with_free_memory_short_in_some_rows() -> None:
    # 2 s/GB written, 3 s/GB more for each fresh byte, 0.5 s a save: with every byte fresh the two
    # per-byte prices are one feature; rows with free memory short tell them apart
    truth = replace(
        Calibration(**{f.name: 0.0 for f in fields(Calibration)}),
        save_byte=2e-9,
        fresh_byte=3e-9,
        save_call=0.5,
    )
    rows = []
    for g in (
        TINY,
        Geometry("qwen2", 64, 4, 4, 2, 16, 128, 1000),
        Geometry("qwen2", 128, 8, 4, 2, 32, 256, 5000),
    ):
        for free in (None, 1_000.0):
            f = phase_features(g, _workload(), 1.0, free_bytes=free)["checkpoint_save"]
            rows.append((f, predict({"s": f}, truth)["s"]))
    fitted = asdict(fit_calibration(rows))
    for name in ("save_byte", "fresh_byte", "save_call"):
        assert fitted[name] == pytest.approx(asdict(truth)[name], rel=1e-6), name


def test_train_factor_counts_recompute_and_lora() -> None:
    assert train_factor(_workload()) == 3.0
    assert train_factor(_workload(gradient_checkpointing=True)) == 4.0  # the forward again in backward
    assert train_factor(_workload(lora_rank=8)) == 2.0  # no weight gradients of the frozen base
    # LoRA syncs and optimizes only the adapters
    f = phase_features(TINY, _workload(lora_rank=2), 1.0, bandwidth=1.0)
    assert f["weight_sync"]["sync_byte"] == 4 * TINY.lora_params(2)
    assert f["update_actor"]["opt_param"] == 2 * 4 * TINY.lora_params(2)
    # the frozen base is read twice per micro-batch (forward, backward), no weight gradient written
    assert f["update_actor"]["weight_pass"] == 2 * 4 * TINY.n_params


def test_workload_of_follows_the_config() -> None:
    cfg = load_config(
        None,
        ["data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=2", "actor.use_kl_loss=true",
         "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=1"],
    )  # fmt: skip
    w = workload_of(cfg, prompt_tokens=10, response_tokens=5)
    assert w.samples == 8
    assert w.old_log_prob_samples == 4  # 8 minus the first mini-batch's 2 prompts × 2 samples
    assert (w.actor_steps, w.critic_steps) == (2, 4)  # 4 prompts / 2 per step; / 1 per step
    assert w.has_ref
    kl_in_reward = load_config(None, ["algorithm.use_kl_in_reward=true"])
    assert workload_of(kl_in_reward).old_log_prob_samples == workload_of(kl_in_reward).samples


def test_nnls_keeps_coefficients_non_negative() -> None:
    # b = 3·a₀ − 1·a₁ = (2, 1, 0) unconstrained; with x ≥ 0 the second coefficient is 0 and the first
    # the mean of b, 1 (the gradient along a₁ there, (1, 2, 3)·(1, 0, −1) = −2, keeps it out)
    a = torch.tensor([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]], dtype=torch.float64)
    x = nnls(a, a @ torch.tensor([3.0, -1.0], dtype=torch.float64))
    assert x[1] == 0 and x[0] == pytest.approx(1.0)
    exact = nnls(a, a @ torch.tensor([0.5, 3.0], dtype=torch.float64))
    assert torch.allclose(exact, torch.tensor([0.5, 3.0], dtype=torch.float64))


def test_fit_recovers_known_coefficients_from_synthetic_rows() -> None:
    # per-FLOP, per-weight-pass and per-optimizer-parameter terms apart: the workloads differ in tokens
    # at fixed steps and in steps at fixed tokens, so no feature is a multiple of another across rows
    truth = Calibration(**{f.name: 0.0 for f in fields(Calibration)})
    truth = replace(truth, gen_flop=4.0, gen_call=0.2, matmul_flop=2.0, fwd_call=0.1, logit=1e-8,
                    weight_pass=3.0, opt_param=20.0, train_call=0.3, sync_byte=10.0,
                    sync_call=0.5)  # fmt: skip
    geometries = [
        TINY,
        Geometry("qwen2", 64, 4, 4, 2, 16, 128, 1000),
        Geometry("qwen2", 128, 8, 4, 2, 32, 256, 5000),
    ]
    rows = []
    for g in geometries:
        for s, p, r in ((2, 10.0, 5.0), (8, 30.0, 20.0), (4, 50.0, 7.0)):
            w = _workload(
                samples=s, prompt_tokens=p, response_tokens=r, old_log_prob_samples=s // 2, actor_steps=s // 2
            )
            f = phase_features(g, w, rate_flops=1e9, bandwidth=1e10)
            pred = predict(f, truth)
            rows += [
                (f[k], pred[k]) for k in ("generation", "ref", "old_log_prob", "update_actor", "weight_sync")
            ]
    fitted = asdict(fit_calibration(rows))
    for name, value in asdict(truth).items():
        if value:
            assert fitted[name] == pytest.approx(value, rel=1e-6), name
    assert fitted["save_byte"] == 0.0  # no row carries a checkpoint feature


@pytest.mark.parametrize("calibration", [CPU_CALIBRATION, GPU_CALIBRATION])
def test_prediction_grows_with_tokens_and_size(calibration: Calibration) -> None:
    cfg = load_config(None, ["algorithm.adv_estimator=gae", "actor.use_kl_loss=true"])
    small, large = TINY, Geometry("qwen2", 64, 4, 4, 2, 16, 128, 1000)
    base = predict_seconds(cfg, small, 1e10, calibration, workload_of(cfg, 20, 10))
    longer = predict_seconds(cfg, small, 1e10, calibration, workload_of(cfg, 20, 40))
    bigger = predict_seconds(cfg, large, 1e10, calibration, workload_of(cfg, 20, 10))
    for phase, seconds in base.items():
        assert longer[phase] >= seconds and bigger[phase] >= seconds, phase
    assert longer["iteration"] > base["iteration"] and bigger["iteration"] > base["iteration"]
    assert base["iteration"] > 0


def test_rates() -> None:
    assert gpu_peak_flops("NVIDIA H200") == 989e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu_peak_flops("a CPU") is None
    assert measure_cpu_matmul_rate(n=64, seconds=0.01) > 0
    assert measure_cpu_copy_bandwidth(nbytes=1 << 20, repeats=2) > 0


def test_fit_floor_weighs_millisecond_phases_absolutely() -> None:
    # one coefficient c, features x and seconds y: (1, 1.0), (1, 1.0), and a 1 ms phase timed 50% long
    # (x 0.001, y 0.0015). Relative error weighs the three alike: Σ (c·x/y − 1)² is least at
    # c = Σ(x/y) / Σ(x/y)² = (2 + 2/3) / (2 + 4/9) = 1.0909; with a 0.5 s floor the small row's
    # residual is (c·0.001 − 0.0015) / 0.5, negligible: c = 1.0000 (the exact rows alone)
    rows = [({"matmul_flop": 1.0}, 1.0), ({"matmul_flop": 1.0}, 1.0), ({"matmul_flop": 0.001}, 0.0015)]
    assert fit_calibration(rows).matmul_flop == pytest.approx(24 / 22, rel=1e-6)
    assert fit_calibration(rows, floor_s=0.5).matmul_flop == pytest.approx(1.0, abs=1e-5)
    # rows all above the floor: the plain relative fit
    assert fit_calibration(rows[:2], floor_s=0.5).matmul_flop == pytest.approx(1.0)
