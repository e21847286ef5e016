"""The terms of a memory plan (:mod:`verl_core.planning.memory`): activations, log-prob chunks, one
trained model's state, the optimizer step's temporaries and what a checkpoint holds while it writes;
formulas in :mod:`verl_core.planning.memory`'s docstring.

What the code does now, and so what is counted:

* the optimizer step: on CPU :class:`~verl_core.training.adamw.GradScratchAdamW` (the single-process
  ``TrainEngine``) writes AdamW's ``denom`` into the gradient, dead after the step: no temporary.
  Elsewhere (a GPU, a DTensor shard of ``fsdp2``, DeepSpeed) torch's single-tensor AdamW
  (``foreach=False``) allocates ``sqrt(v)`` and its quotient by the bias correction for one parameter
  at a time: two tensors of the largest (shard of a) parameter.
* a checkpoint: the trainer state (moments, RNG, counters) is ``torch.save``'d straight from the
  tensors into a file staged in the attempt's folder (:func:`verl_core.models.checkpoint.save_state`,
  ``StageWriter.staged_file``) and hard-linked into place; the policy's and a critic's weights go to
  the store from ``save_pretrained``'s folder as paths (``stages.floor.artifacts.write_policy``,
  :func:`verl_core.models.checkpoint.saved_model`; safetensors writes from the tensors' own memory).
  None of them holds a copy. A LoRA model built from scratch also writes its frozen base, rebuilt
  as a plain module first: ``P·b`` while it is written. Measured (an 18.5M-parameter Qwen2, fp32,
  RSS growth above the live state, warm): ``saved_model`` 0.01·P·b, ``save_state`` of the moments
  0.01, ``load_state`` (memory-mapped) + ``optimizer.load_state_dict`` 0; the former bytes path
  (``model_files``) 1.02·P·b.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from verl_core.planning.geometry import Geometry
from verl_core.planning.parts import Component, Parts

GIB = 1 << 30
MIB = 1 << 20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# float32 (C, V) buffers a log-prob chunk holds at once (see the module docstring of memory)
CHUNK_BUFFERS = 4


def part(name: str, nbytes: float, formula: str, shared: bool = False) -> Component:
    return Component(name, int(nbytes), formula, shared)


# -- activations and logits --------------------------------------------------------------------


def activation_elements(g: Geometry) -> int:
    """``A``: elements one decoder layer saves for backward per token (memory's docstring)."""
    d = g.head_dim
    return 2 * 3 * g.hidden_size + 3 * g.num_heads * d + 2 * g.num_kv_heads * d + 4 * g.intermediate_size


def activation_bytes(g: Geometry, tokens: int, c: int, *, checkpointed: bool) -> int:
    """Saved activations of a ``tokens``-token micro-batch: ``T·(L·A + 3h)`` elements, the norms' at 4
    bytes, the others at ``c``; checkpointed ``T·(L·h + A + 3h)`` (each layer's input, one layer
    recomputed in backward). ``3h``: the final norm's input, normalised and scaled outputs."""
    norms = 2 * 3 * g.hidden_size  # fp32 whatever c is
    per_layer = norms * 4 + (activation_elements(g) - norms) * c
    final = 3 * g.hidden_size * 4
    if checkpointed:
        return tokens * (g.num_layers * g.hidden_size * 4 + per_layer + final)
    return tokens * (g.num_layers * per_layer + final)


def no_grad_layer_bytes(g: Geometry, tokens: int, c: int) -> int:
    """One layer's intermediates of a no-grad forward, plus the hidden stream: ``T·(3I + 4h)·c``."""
    return tokens * (3 * g.intermediate_size + 4 * g.hidden_size) * c


def chunk_tokens(vocab: int) -> int:
    """Tokens per LM-head chunk as :class:`verl_core.models.packed.PackedCausalLM` runs them."""
    from verl_core.models import packed

    default = int(inspect.signature(packed.PackedCausalLM).parameters["chunk_size"].default)
    rule = getattr(packed, "logits_chunk_tokens", None)
    return int(rule(default, vocab)) if rule is not None else default


def logits_bytes(vocab: int, response_tokens: int, *, grad: bool) -> int:
    """Float32 logits of the chunked log-probs (memory's docstring)."""
    from verl_core.models.packed import _KEEP_LOGITS_ELEMENTS

    chunk = CHUNK_BUFFERS * min(chunk_tokens(vocab), max(1, response_tokens)) * vocab * 4
    if grad and response_tokens * vocab <= _KEEP_LOGITS_ELEMENTS:
        return max(chunk, 4 * response_tokens * vocab * 4)
    return chunk


# -- one trained model -------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    strategy: str  # "single" | "fsdp2" | "deepspeed"
    zero_stage: int
    offload: bool
    world: int
    gpu: bool

    def shards(self) -> tuple[int, int, int]:
        """Divisors of the weights, the gradients and the moments."""
        w, fsdp, ds = self.world, self.strategy == "fsdp2", self.strategy == "deepspeed"
        return (
            w if fsdp or (ds and self.zero_stage == 3) else 1,
            w if fsdp or (ds and self.zero_stage >= 2) else 1,
            w if fsdp or ds else 1,
        )

    @property
    def scratch_step(self) -> bool:
        """Whether AdamW runs :class:`~verl_core.training.adamw.GradScratchAdamW`'s path: plain CPU
        tensors of the one-process engine (no temporaries)."""
        return not self.gpu and self.strategy == "single"


def step_temporaries(label: str, largest: int, b: int, at: Placement) -> Parts:
    """The optimizer step's temporaries beside the gradients (module docstring): none on
    GradScratchAdamW's path, else ``sqrt(v)`` and its quotient of the largest parameter (its shard)."""
    if at.scratch_step:
        return ()
    _, _, so = at.shards()
    return (part(f"{label} optimizer step temporaries", 2 * largest * b / so, f"2·{largest:,}·b/{so}"),)


@dataclass(frozen=True)
class Trained:
    """What one trained model (actor, critic, SFT policy) holds: on its device, offloaded to the host,
    and added during an update (gradients, compute copies, step temporaries)."""

    device: Parts
    host: Parts
    grads: Component  # all gradients, from the first backward to the optimizer step
    head_grad: Component  # the LM head's, allocated first in a backward (the critic: none)
    step: Parts  # the optimizer step's temporaries
    extras: Parts  # compute copies, gathered units: through forward and backward
    tied: Parts = ()  # a tied embedding's input gradient, beside every other at the backward's end

    def update(self, saved: Parts, several: bool) -> Parts:
        """What an update holds at its peak beside the resident state, ``saved`` being a micro-batch's
        activations: with ``several`` micro-batches per optimizer step the second runs forward beside
        the first's gradients (all of them); with one, gradients are freed after each step
        (``set_to_none``), so the peak is the larger of the forward-backward (activations and the LM
        head's gradient) and the end of the backward and the step (all gradients; a tied embedding's
        second gradient, from its input lookup, a fresh ``(V, h)`` tensor summed into the LM head's;
        the step's temporaries)."""
        if several:
            return (self.grads, *self.tied, *self.step, *self.extras, *saved)
        fwd = (self.head_grad, *self.extras, *saved)
        step = (self.grads, *self.tied, *self.step, *self.extras)
        return max(fwd, step, key=lambda parts: sum(c.nbytes for c in parts))


def trained(
    label: str,
    g: Geometry,
    frozen: float,
    trainable: int,
    matmul: int,
    b: int,
    c: int,
    at: Placement,
    head: int,
) -> Trained:
    """Weights (``frozen`` bytes + ``trainable``·b), AdamW moments, gradients of one model, sharded by
    its placement, on the host with ``offload``; ``head``: trainable parameters of its LM head."""
    sw, sg, so = at.shards()
    formula = f"P·b/{sw}, P_t = {trainable:,}, b = {b}"
    weights = part(f"{label} weights", (frozen + trainable * b) / sw, formula)
    moments = part(f"{label} AdamW moments", 2 * trainable * b / so, f"2·P_t·b/{so}")
    largest = min(trainable, max(g.embedding_params, g.hidden_size * g.intermediate_size))
    grads = part(f"{label} gradients", trainable * b / sg, f"P_t·b/{sg}")
    head_grad = part(f"{label} LM head gradient", head * b / sg, f"V·h·b/{sg} (first in backward)")
    extras = []
    if c < b:
        extras.append(part(f"{label} compute copies", matmul * c / sw, f"N·c = {matmul:,}·{c} (autocast)"))
    if sw > 1:  # FSDP2 all-gathers the root (embedding, head) and a layer or two in the compute dtype
        gathered = (g.embedding_params + 2 * g.layer_params) * c
        extras.append(part(f"{label} gathered units", gathered, "(V·h + 2 layers)·c"))
    held = (weights, moments)
    device, host = ((), held) if at.offload else (held, ())
    temps = step_temporaries(label, largest, b, at)
    # the tied (V, h) weight gets two gradients in backward: the LM head's, then the lookup's
    tied = (part(f"{label} tied embedding's input gradient", head * b / sg, f"V·h·b/{sg}"),) if head else ()
    return Trained(device, host, grads, head_grad, temps, tuple(extras), tied if g.tied_embeddings else ())


# -- checkpoint --------------------------------------------------------------------------------


def policy_file_parts(g: Geometry, b: int, lora_rank: int, scratch: bool) -> Parts:
    """What writing a policy checkpoint holds beside the live state (module docstring): nothing but
    the plain base module a LoRA model from scratch is rebuilt into, ``P·b``; every file streams."""
    if lora_rank and scratch:
        return (part("plain base module", g.n_params * b, "P·b (the base rebuilt to be saved)"),)
    return ()
