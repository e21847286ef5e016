"""Training: the optimizer engine (single device, FSDP2, DeepSpeed) behind one step API, distributed
helpers, and the SFT and PPO losses over packed batches. Tensors and plain values in, named results
out; no config objects, no Prefect."""
