"""What asyncgrpo knows of vLLM's HTTP API, and the client that speaks it."""

from __future__ import annotations

from asyncgrpo.lazy import lazy_exports

_EXPORTS = {
    "VLLMClient": "asyncgrpo.vllm.client",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
