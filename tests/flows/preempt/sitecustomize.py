"""Put on ``PYTHONPATH`` of a Prefect worker by tests/flows/test_deployments.py: every Python process
the worker starts (its flow-run processes) pauses at the named point of ``tests/reliability/runner.py``
when ``RELIABILITY_PAUSE_AT`` is set, and writes ``$RELIABILITY_MARKER``; the test then kills the
worker and its flow-run process with SIGKILL, as a preemption would. Production code has no hook."""

import os

if os.environ.get("RELIABILITY_PAUSE_AT"):
    from tests.reliability.runner import install

    install(os.environ["RELIABILITY_PAUSE_AT"], pause=True)
