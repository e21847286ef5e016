"""One contender of the lease race (``test_lease_race``): a long-lived process that, for each JSON line
``{"store": url, "run_id": id, "start_at": unix time}`` on stdin, sleeps until ``start_at`` and tries
to take ``run_id``'s lease, then answers one JSON line ``{"run_id", "won", "error"}`` on stdout; a line
without ``run_id`` only connects to the store (answered ``{"ready": true}``).

Won leases are kept (never released) until the process exits, so a loser can never win later by
finding the lease gone. One process serves every trial: the imports and the first S3 connection are
paid once, not per trial. Run as ``python -m tests.reliability.lease_racer``."""

from __future__ import annotations

import json
import sys
import time

from verl_core.store import ArtifactStore
from verl_core.store.lease import RunLease


def main() -> None:
    stores: dict[str, ArtifactStore] = {}
    held: list[RunLease] = []
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        trial = json.loads(line)
        store = stores.get(trial["store"])
        if store is None:
            store = stores[trial["store"]] = ArtifactStore(trial["store"])
            store.exists(store.root)  # connect before the first start signal
        if "run_id" not in trial:
            print(json.dumps({"ready": True}), flush=True)
            continue
        lease = RunLease(store, trial["run_id"], ttl_s=60)
        time.sleep(max(0.0, trial["start_at"] - time.time()))
        try:
            lease.acquire()
        except Exception as e:
            answer = {"run_id": trial["run_id"], "won": False, "error": f"{type(e).__name__}: {e}"}
        else:
            held.append(lease)
            answer = {"run_id": trial["run_id"], "won": True, "error": None}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
