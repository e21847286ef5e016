"""Models: loading (HF id, local path or a from-scratch config; LoRA/QLoRA via PEFT), packed forward
with per-backend varlen attention, value heads, and checkpoint files (safetensors, restricted state
loading). Plain torch/transformers objects in and out; no config objects, no Prefect."""
