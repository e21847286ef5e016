"""Library warnings that every flow run on a CPU worker would log, and say nothing about the run,
dropped where they are logged: one :class:`logging.Filter` per library logger, matching one message
each. Installed on import of the :mod:`flows` package (every deployment's entrypoint is under it);
every other record of those loggers passes.

- DeepSpeed (installed for ``*.strategy=deepspeed``) is imported by accelerate's
  ``extract_model_from_parallel`` under every ``save_pretrained`` (the SFT and export stages), and
  its accelerator probe warns "Setting accelerator to CPU ..." on any machine without CUDA, through
  its own stdout handler of the ``DeepSpeed`` logger.
- bitsandbytes (installed for ``model.quantization``) is imported by peft with every policy; on CPUs
  with AVX512-BF16 its CPU backend tries to fetch a 4-bit GEMM kernel from the Hugging Face Hub at
  import and warns "Failed to load CPU gemm_4bit_forward from kernels-community ..." when offline or
  without the ``kernels`` package; it only concerns 4-bit weights on CPU.
"""

from __future__ import annotations

import logging

# logger name → the start of the one message dropped from it
NOISE: dict[str, str] = {
    "DeepSpeed": "Setting accelerator to CPU. If you have GPU or other accelerator",
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community",
}


class _DropMessage(logging.Filter):
    """Drops the records of its logger whose message starts with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def quiet_library_warnings() -> None:
    """Install the filters (once: a second call adds none). The libraries' loggers keep them when
    the libraries configure them at import (``logging.getLogger`` returns the same logger)."""
    for name, prefix in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) for f in logger.filters):
            logger.addFilter(_DropMessage(prefix))
