"""The rollout browser's data layer: read-only queries over a run's committed Parquet artifacts
(:mod:`browse.queries`, DuckDB over the files in place) and the garbled-output heuristics
(:mod:`browse.garbled`). The pages (Dash) call these; nothing else imports this package but
``flows.cli.browse``."""
