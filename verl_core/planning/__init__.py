"""Planning a run before it starts: a model's geometry from its config (no weights built), the memory
each process needs and the seconds each phase takes, from the config and a measured (CPU) or published
(GPU) matmul rate."""
