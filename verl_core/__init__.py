"""verl_core."""
