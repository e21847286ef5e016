"""VLLMProcessEngine: the pipeline's processes drive vLLM in a subprocess of the vLLM environment.
One engine start for the module (~35-50 s on 2 cores). The engine's own behaviour is tested in the
vLLM environment (tests/vllm); here: the channel, weight sync through it, errors coming back."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.vllm_env import vllm_python
from verl_core.errors import ConfigError
from verl_core.models.loading import ScratchSpec, init_causal_lm, scratch_config
from verl_core.rollout import HFEngine, SamplingParams, VLLMProcessEngine, make_engine

from .conftest import vllm_spec

TOL = 1e-5  # fp32 on both sides (tests/vllm/test_engine.py says why)


def head32_model(tok: Any, seed: int) -> torch.nn.Module:
    """hidden 64 = 2 heads of 32 (vLLM's CPU attention takes head sizes 32, 64, 80, ...), tied."""
    spec = ScratchSpec("qwen2", 64, 2, 2, 1, 128, 128)
    config = scratch_config(spec, len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return init_causal_lm(config, seed=seed).eval()


@pytest.fixture(scope="module")
def policy(tok: Any) -> torch.nn.Module:
    return head32_model(tok, seed=3)


@pytest.fixture(scope="module")
def engine(policy: torch.nn.Module, tok: Any) -> Iterator[VLLMProcessEngine]:
    python = vllm_python()
    e = make_engine("vllm", policy, tok, spec=vllm_spec(), vllm_python=python)
    assert isinstance(e, VLLMProcessEngine)
    yield e
    e.close()


def logprob_gap(a: list[Any], b: list[Any]) -> float:
    assert [c.response_ids for c in a] == [c.response_ids for c in b]
    return max(
        float((torch.tensor(x.logprobs) - torch.tensor(y.logprobs)).abs().max())
        for x, y in zip(a, b, strict=True)
    )


def test_generate_through_the_subprocess_equals_the_hf_engine(
    engine: VLLMProcessEngine, policy: torch.nn.Module, tok: Any, prompts: list[str]
) -> None:
    params = SamplingParams(n=2, temperature=0, max_new_tokens=10)
    got = engine.generate(prompts, params)
    ref = HFEngine(policy, tok).generate(prompts, params)
    assert [(c.prompt_index, c.sample_index, c.finish_reason) for c in got] == [
        (c.prompt_index, c.sample_index, c.finish_reason) for c in ref
    ]
    assert logprob_gap(got, ref) < TOL
    sampled = SamplingParams(n=3, max_new_tokens=10, seed=4)
    assert engine.generate(prompts, sampled) == engine.generate(prompts, sampled)  # seeded per request


def test_weight_sync_through_staged_buckets_reaches_the_engine(
    engine: VLLMProcessEngine, policy: torch.nn.Module, tok: Any, prompts: list[str]
) -> None:
    new = copy.deepcopy(policy)
    with torch.no_grad():  # an update the log-probs feel
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    params = SamplingParams(temperature=0, max_new_tokens=10)
    old_ref = HFEngine(policy, tok).generate(prompts, params)
    engine.load_weights(new.state_dict().items(), 4)  # 1 MiB buckets: several files
    assert engine.policy_version == 4
    got = engine.generate(prompts, params)
    new_ref = HFEngine(new, tok).generate(prompts, params)
    assert logprob_gap(got, new_ref) < TOL
    same = [(c, o) for c, o in zip(got, old_ref, strict=True) if c.response_ids == o.response_ids]
    assert same  # where the tokens agree, the log-probs are the new weights', not the old ones
    assert logprob_gap([c for c, _ in same], [o for _, o in same]) > 100 * TOL
    engine.update_weights(policy, 5)
    assert logprob_gap(engine.generate(prompts, params), old_ref) < TOL


def test_a_payload_without_the_tied_lm_head_is_refused_through_the_channel(
    engine: VLLMProcessEngine, policy: torch.nn.Module
) -> None:
    weights = {k: v for k, v in policy.state_dict().items() if k != "lm_head.weight"}
    version = engine.policy_version
    with pytest.raises(ConfigError, match=r"missing 1 tensor\(s\) \['lm_head.weight'\]"):
        engine.load_weights(weights.items(), version + 1)
    assert engine.policy_version == version


def test_a_dead_engine_process_is_reported_with_its_log(policy: torch.nn.Module, tok: Any) -> None:
    with pytest.raises(ConfigError, match="is not an executable Python interpreter"):
        make_engine("vllm", policy, tok, spec=vllm_spec(), vllm_python="/nonexistent/python")
    e = VLLMProcessEngine.__new__(VLLMProcessEngine)  # the channel alone: a process that exits at once
    e._tmp = tempfile.mkdtemp()
    e._log_path = os.path.join(e._tmp, "host.log")
    e._log = open(e._log_path, "wb")  # noqa: SIM115
    e._proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('boom: no vllm here', file=sys.stderr); sys.exit(3)"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=e._log,
    )  # fmt: skip
    e._proc.wait()
    with pytest.raises(RuntimeError, match=r"(?s)exited \(code 3\).*boom: no vllm here"):
        e._call({"op": "generate"})
    e.close()
