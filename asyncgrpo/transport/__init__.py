"""Async storage transports: local directory, S3, GCS, Azure Blob (obstore), Hugging Face buckets.

``open_transport(url)`` returns a :class:`Transport`; backends import their heavy dependency
(obstore, huggingface_hub) only when opened.
"""

from asyncgrpo.transport.base import ObjectInfo, PutMode, Transport
from asyncgrpo.transport.registry import open_transport, register_scheme

__all__ = ["ObjectInfo", "PutMode", "Transport", "open_transport", "register_scheme"]
