"""Helpers for tests, demos and benchmarks: a tiny local model, a LoRA adapter, reference logprobs.

Everything here is built locally (no Hugging Face Hub) and is deterministic for a seed. It needs
the ``train`` extra (torch, transformers, peft, tokenizers).
"""

from __future__ import annotations

from asyncgrpo.lazy import lazy_exports

_EXPORTS = {
    "ReferencePolicy": "asyncgrpo.testing.tiny",
    "make_lora_adapter": "asyncgrpo.testing.tiny",
    "make_tiny_model": "asyncgrpo.testing.tiny",
    "reference_logprobs": "asyncgrpo.testing.tiny",
    "tiny_serve_config": "asyncgrpo.testing.tiny",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
