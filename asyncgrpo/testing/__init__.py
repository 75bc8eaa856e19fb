"""Helpers for tests, demos and benchmarks: a tiny local model, a LoRA adapter, reference logprobs.

Everything here is built locally (no Hugging Face Hub) and is deterministic for a seed. It needs
the ``train`` extra (torch, transformers, peft, tokenizers).
"""

from asyncgrpo.testing.tiny import (
    ReferencePolicy,
    make_lora_adapter,
    make_tiny_model,
    reference_logprobs,
    tiny_serve_config,
)

__all__ = [
    "ReferencePolicy",
    "make_lora_adapter",
    "make_tiny_model",
    "reference_logprobs",
    "tiny_serve_config",
]
