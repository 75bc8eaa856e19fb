"""A Tinker-compatible service: the ``tinker`` SDK's REST API over asyncgrpo's trainer.

``python -m asyncgrpo.tinker --model DIR`` or, in-process,
``async with serve_tinker(TinkerConfig(model=DIR, port=0)) as url: ...``; then
``tinker.ServiceClient(base_url=url)`` works unchanged. Needs the ``tinker`` extra (the SDK's
own wire types) and the ``train`` extra (torch, peft).
"""

from __future__ import annotations

from asyncgrpo.lazy import lazy_exports

_EXPORTS = {
    "TinkerConfig": "asyncgrpo.config.tinker",
    "serve_tinker": "asyncgrpo.tinker.server",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
