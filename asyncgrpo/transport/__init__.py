"""Async storage transports: local directory, S3, GCS, Azure Blob (obstore), Hugging Face buckets.

``open_transport(url)`` returns a :class:`Transport`; backends import their heavy dependency
(obstore, huggingface_hub) only when opened.
"""

from __future__ import annotations

from asyncgrpo.lazy import lazy_exports

_EXPORTS = {
    "ObjectInfo": "asyncgrpo.transport.base",
    "PutMode": "asyncgrpo.transport.base",
    "Transport": "asyncgrpo.transport.base",
    "check_transport_url": "asyncgrpo.transport.registry",
    "open_transport": "asyncgrpo.transport.registry",
    "register_scheme": "asyncgrpo.transport.registry",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
