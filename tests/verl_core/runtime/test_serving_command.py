"""``verl-flow serve``'s vLLM command line: the rollout section's settings by their names and types,
memory by the rollout engines' one rule (``verl_core.rollout.vllm_spec.memory_kwargs``). No vLLM here:
the command is built, not run (tests/flows/test_serving.py runs the real server)."""

from __future__ import annotations

from pathlib import Path

from verl_core.config import RolloutConfig
from verl_core.rollout.vllm_spec import GIB
from verl_core.runtime.serving import ServeConfig, server_command, server_facts


def flags(cmd: list[str]) -> dict[str, str | None]:
    """``--name value`` pairs (a flag without a value: None) after the module name."""
    out: dict[str, str | None] = {}
    args = cmd[3:]
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
            out[arg] = value
    return out


def test_serve_takes_vllms_settings_from_the_rollout_section(tmp_path: Path) -> None:
    # no field of its own repeats a rollout field under another name or type (0.9 vs 0.5, int GiB)
    assert not (set(ServeConfig.model_fields) - {"rollout"}) & set(RolloutConfig.model_fields)
    rollout = RolloutConfig(tensor_parallel_size=2, vllm_enforce_eager=True, gpu_memory_utilization=0.7)
    cmd = server_command("py", tmp_path, ServeConfig(rollout=rollout), "m", server_facts(is_cpu=False))
    assert cmd[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    got = flags(cmd)
    assert got["--tensor-parallel-size"] == "2" and "--enforce-eager" in got
    assert got["--gpu-memory-utilization"] == "0.7" and "--kv-cache-memory-bytes" not in got


def test_the_server_memory_is_the_rollout_engines_rule(tmp_path: Path) -> None:
    def memory(cfg: ServeConfig, is_cpu: bool) -> dict[str, str | None]:
        got = flags(server_command("py", tmp_path, cfg, "m", server_facts(is_cpu)))
        return {k: v for k, v in got.items() if k in ("--kv-cache-memory-bytes", "--gpu-memory-utilization")}

    default = ServeConfig()
    sized = ServeConfig(rollout=RolloutConfig(kv_cache_gib=2.0))
    # GPU, KV cache in GiB: the bytes and a utilization for vLLM's start check (the server has its
    # device to itself: the configured 0.5); the old command passed the bytes alone (vLLM's 0.92)
    assert memory(sized, is_cpu=False) == {
        "--kv-cache-memory-bytes": str(2 * GIB),
        "--gpu-memory-utilization": "0.5",
    }
    assert memory(default, is_cpu=False) == {"--gpu-memory-utilization": "0.5"}
    # the CPU platform: bytes, cpu_kv_cache_gib unless kv_cache_gib is given
    assert memory(default, is_cpu=True) == {"--kv-cache-memory-bytes": str(GIB)}
    assert memory(sized, is_cpu=True) == {"--kv-cache-memory-bytes": str(2 * GIB)}
