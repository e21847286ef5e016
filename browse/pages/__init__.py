"""The rollout browser's pages, one module per view (:mod:`browse.app` routes URLs to them)."""
