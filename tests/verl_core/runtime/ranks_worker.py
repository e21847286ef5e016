"""Run by test_ranks.py under ``torchrun --nproc_per_node 2``: the object collectives of an SPMD job."""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from tests.verl_core.training.teardown import end_worker
from verl_core.runtime import ranks


def main(out: str) -> None:
    dist.init_process_group("gloo")
    r = ranks.rank()
    result: dict[str, object] = {"world": ranks.world_size(), "main": ranks.is_main()}
    result["local"] = [ranks.local_rank(), ranks.local_world_size()]  # torchrun's LOCAL_* variables
    result["decided"] = ranks.broadcast_from_main(f"decided by {r}")
    result["gathered"] = ranks.gather_to_main([f"{r}a", f"{r}b"])
    result["all"] = ranks.all_gather([r * 10])
    result["on_main"] = ranks.on_main(lambda: f"ran on {r}")
    try:
        ranks.on_main(lambda: 1 / 0)
    except ranks.RankFailedError as err:  # the other ranks
        result["failed"] = f"RankFailedError: {err}"
    except ZeroDivisionError as err:  # rank 0 gets its own exception back
        result["failed"] = f"ZeroDivisionError: {err}"
    with open(f"{out}.{r}", "w") as f:
        json.dump(result, f)
    end_worker()


if __name__ == "__main__":
    main(sys.argv[1])
