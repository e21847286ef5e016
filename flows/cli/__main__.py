"""``python -m flows.cli ...``: the ``verl-flow`` command."""

from flows.cli import main

main()
