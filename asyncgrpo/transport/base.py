"""The transport contract: a handful of async operations on ``/``-separated keys.

Everything above storage (adapter store, checkpoints, rollout channel) is written once against
:class:`Transport`, so switching from a shared directory to S3 or a Hugging Face bucket is a URL
change. Keys are relative to the transport's root (a directory, a bucket prefix); they never start
with ``/`` and never contain ``.`` or ``..`` segments, so a key cannot escape the root.

Guarantees every implementation gives (the conformance suite in ``tests/transport`` checks them):

* a ``put`` is atomic: readers see the old object, no object, or the whole new one;
* ``put(..., mode="create")`` writes only if the key does not exist, else raises
  :class:`~asyncgrpo.errors.AlreadyExists`; of two concurrent creators exactly one wins;
* a missing key raises :class:`~asyncgrpo.errors.NotFound` (also a ``FileNotFoundError``);
* ``delete`` of a missing key is not an error (S3 semantics);
* ``list(prefix)`` yields every object under ``prefix/`` (whole segments), in no set order.
"""

from __future__ import annotations

import abc
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

from asyncgrpo.errors import IntegrityError, InvalidKey, NotFound

__all__ = ["ObjectInfo", "PutMode", "Transport", "check_key", "join_key", "too_large"]

PutMode = Literal["overwrite", "create"]
"""``"overwrite"`` replaces an existing object; ``"create"`` raises ``AlreadyExists`` instead."""

CHUNK_BYTES = 8 * 1024 * 1024
"""Streaming granularity for ``get_file``/``put_file`` (keeps memory flat for large files)."""


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What ``head`` and ``list`` report about one object."""

    key: str
    size: int
    mtime: float | None = None
    """Seconds since the epoch, when the store reports it."""


def check_key(key: str, *, allow_empty: bool = False) -> str:
    """Return ``key`` with any trailing ``/`` removed, or raise :class:`InvalidKey`.

    Rejecting ``..`` here (not per implementation) is what confines every transport to its root.
    """
    if not isinstance(key, str):
        raise InvalidKey(f"key must be a str, got {type(key).__name__}")
    stripped = key.rstrip("/")
    if not stripped:
        if allow_empty:
            return ""
        raise InvalidKey("key is empty; keys are '/'-separated paths like 'adapters/run/v1/x'")
    if stripped.startswith("/") or "\\" in stripped or "\x00" in stripped:
        raise InvalidKey(f"key {key!r} must be relative, '/'-separated, without backslash or NUL")
    for part in stripped.split("/"):
        if part in ("", ".", ".."):
            raise InvalidKey(f"key {key!r} has an empty, '.' or '..' segment")
    return stripped


def too_large(what: str, max_bytes: int) -> IntegrityError:
    """The error for an object that holds more than a reader's ``max_bytes``."""
    return IntegrityError(f"{what} holds more than {max_bytes} bytes, the most this read accepts")


def join_key(*parts: str) -> str:
    """Join key segments with ``/``, skipping empty ones."""
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


class Transport(abc.ABC):
    """Async object storage rooted at one URL.

    Implementations override the abstract methods; ``exists``, ``put_file``/``get_file`` and the
    async-context-manager support have working defaults that backends may specialise (the local
    and S3 transports stream files instead of holding them in memory).
    """

    url: str
    """The URL this transport was opened with (credentials never included)."""

    # ---- abstract operations ------------------------------------------------------------------
    @abc.abstractmethod
    async def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """Return the whole object; ``NotFound`` if missing. With ``max_bytes``, an object
        larger than that raises :class:`~asyncgrpo.errors.IntegrityError`, read no further."""

    @abc.abstractmethod
    async def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> None:
        """Store ``data`` atomically at ``key``."""

    @abc.abstractmethod
    async def head(self, key: str) -> ObjectInfo:
        """Return size (and mtime) of ``key``; ``NotFound`` if missing."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Yield every object whose key lies under ``prefix`` (whole segments)."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook, most transports hold nothing
        """Release connections and worker threads."""

    # ---- defaults -----------------------------------------------------------------------------
    async def exists(self, key: str) -> bool:
        try:
            await self.head(key)
        except NotFound:
            return False
        return True

    async def put_file(
        self, key: str, path: str | os.PathLike[str], *, mode: PutMode = "overwrite"
    ) -> None:
        """Upload a local file. The default reads it whole; backends override to stream."""
        data = await _read_file(Path(path))
        await self.put(key, data, mode=mode)

    async def get_file(
        self, key: str, path: str | os.PathLike[str], *, max_bytes: int | None = None
    ) -> int:
        """Download ``key`` to ``path`` (written to a temp name, then renamed); return its size.
        ``max_bytes`` as for :meth:`get`: nothing is left at ``path`` then."""
        data = await self.get(key, max_bytes=max_bytes)
        await _write_file_atomic(Path(path), [data])
        return len(data)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


async def _read_file(path: Path) -> bytes:
    import anyio

    try:
        return await anyio.Path(path).read_bytes()
    except FileNotFoundError as exc:
        raise NotFound(f"local file {path} does not exist") from exc


async def _write_file_atomic(path: Path, chunks: list[bytes] | AsyncIterator[bytes]) -> int:
    """Write chunks to ``path`` via a temp file in the same directory and ``os.replace``."""
    import anyio

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{id(chunks):x}.tmp")
    size = 0
    try:
        async with await anyio.open_file(tmp, "wb") as f:
            if isinstance(chunks, list):
                for chunk in chunks:
                    await f.write(chunk)
                    size += len(chunk)
            else:
                async for chunk in chunks:
                    await f.write(chunk)
                    size += len(chunk)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size
