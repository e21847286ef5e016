"""The torchrun command of an SPMD job: one node (standalone rendezvous) or several (c10d)."""

from __future__ import annotations

import pytest

from verl_core.runtime.launch import LaunchSpec, torchrun_command


def test_one_node_uses_a_standalone_rendezvous() -> None:
    spec = LaunchSpec(1, 2, rdzv_id="r-rl-loop", rdzv_endpoint=None)
    argv = torchrun_command(spec, "/tmp/job.json", python="py")
    assert argv == [
        "py", "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
        "--nproc-per-node", "2", "--max-restarts", "0", "-m", "launcher.spmd", "--job", "/tmp/job.json",
    ]  # fmt: skip


def test_several_nodes_meet_at_the_c10d_endpoint() -> None:
    spec = LaunchSpec(4, 8, rdzv_id="r-rl-loop", rdzv_endpoint="node0:29400")
    # a follower node: the rendezvous store is hosted by node 0 (is_host=0 here), its job comes from there
    assert torchrun_command(spec, "rendezvous", python="py") == [
        "py", "-m", "torch.distributed.run", "--nnodes", "4", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "node0:29400", "--rdzv-id", "r-rl-loop", "--rdzv-conf", "is_host=0",
        "--nproc-per-node", "8", "--max-restarts", "0", "-m", "launcher.spmd", "--job", "rendezvous",
    ]  # fmt: skip
    assert spec.world_size == 32  # 4 nodes × 8 processes


def test_several_nodes_need_an_endpoint() -> None:
    with pytest.raises(ValueError, match=r"trainer\.rdzv_endpoint"):
        LaunchSpec(2, 1, rdzv_id="x", rdzv_endpoint=None)
